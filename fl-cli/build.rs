//! Records the git commit for the run manifest.
fn main() {
    let hash = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=FL_GIT_HASH={}", hash.trim());
    println!("cargo:rerun-if-changed=../.git/HEAD");
}
