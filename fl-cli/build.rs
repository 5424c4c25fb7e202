//! Records the git commit for the run manifest.
use std::path::Path;
use std::process::Command;

/// `git ARGS`' trimmed output, if git runs and succeeds.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    out.status.success().then(|| text.trim().to_string())
}

fn main() {
    let hash = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=FL_GIT_HASH={hash}");
    // A commit moves the branch, not HEAD (which only names the branch): watch HEAD, the
    // branch's ref and packed-refs, wherever this checkout (or worktree) keeps them. Only
    // existing files: cargo reruns a build script on every build while one is missing.
    let branch = git(&["symbolic-ref", "-q", "HEAD"]);
    let watched = ["HEAD", "packed-refs"]
        .into_iter()
        .map(String::from)
        .chain(branch)
        .filter_map(|name| git(&["rev-parse", "--git-path", &name]));
    for path in watched.filter(|p| Path::new(p).exists()) {
        println!("cargo:rerun-if-changed={path}");
    }
}
