//! Running a sweep on a Slurm cluster: one job array whose task I runs entry I through the
//! same code path as the local runner (`fl sweep run SPEC --cell I`), a log per task, and,
//! submitted again, only the entries not finished (failed, interrupted or never run).

use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail};
use clap::Args;

use super::{Status, Sweep};

/// `fl sweep slurm`'s options (passed to `sbatch` as `#SBATCH` lines).
#[derive(Debug, Clone, Args)]
pub struct SlurmArgs {
    /// Slurm partition (default: the cluster's).
    #[arg(long)]
    pub partition: Option<String>,
    /// Time limit per task, in Slurm's format (e.g. 04:00:00).
    #[arg(long)]
    pub time: Option<String>,
    /// Generic resources per task (e.g. gpu:1).
    #[arg(long)]
    pub gres: Option<String>,
    /// CPUs per task (each task runs with this many threads).
    #[arg(long, default_value_t = 2)]
    pub cpus_per_task: usize,
    /// At most this many tasks at once (`--array=…%K`).
    #[arg(long, value_name = "K")]
    pub array_limit: Option<usize>,
    /// Write the job script and print it, without submitting.
    #[arg(long)]
    pub dry_run: bool,
}

/// `0,1,2,5,7,8` as `0-2,5,7-8`.
pub fn ranges(indices: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < indices.len() {
        let mut j = i;
        while j + 1 < indices.len() && indices[j + 1] == indices[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            indices[i].to_string()
        } else {
            format!("{}-{}", indices[i], indices[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

/// Shell-quotes a path for the job script.
fn quote(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', r"'\''"))
}

/// The job script of the entries `todo`.
fn script(sweep: &Sweep, todo: &[usize], args: &SlurmArgs) -> anyhow::Result<String> {
    let exe = std::env::current_exe()
        .and_then(|e| e.canonicalize())
        .context("cannot find the fl executable")?;
    let spec = sweep.spec.canonicalize()?;
    let cwd = std::env::current_dir()?;
    let logs = cwd.join(&sweep.out).join("logs");
    let stem = spec
        .file_stem()
        .map_or("sweep".into(), |s| s.to_string_lossy());
    let mut array = ranges(todo);
    if let Some(k) = args.array_limit {
        if k == 0 {
            bail!("--array-limit must be at least 1");
        }
        array += &format!("%{k}");
    }
    if args.cpus_per_task == 0 {
        bail!("--cpus-per-task must be at least 1");
    }
    let mut lines = vec![
        "#!/bin/sh".to_string(),
        format!("#SBATCH --job-name=fl-{stem}"),
        format!("#SBATCH --array={array}"),
        format!("#SBATCH --chdir={}", cwd.display()),
        format!("#SBATCH --output={}/slurm-%A_%a.log", logs.display()),
        format!("#SBATCH --cpus-per-task={}", args.cpus_per_task),
    ];
    for (flag, value) in [
        ("partition", &args.partition),
        ("time", &args.time),
        ("gres", &args.gres),
    ] {
        if let Some(v) = value {
            lines.push(format!("#SBATCH --{flag}={v}"));
        }
    }
    lines.push(format!(
        "exec {} sweep run {} --cell \"$SLURM_ARRAY_TASK_ID\" --threads \"${{SLURM_CPUS_PER_TASK:-{}}}\"",
        quote(&exe),
        quote(&spec),
        args.cpus_per_task
    ));
    Ok(lines.join("\n") + "\n")
}

/// Writes the job array of every unfinished entry and submits it with `sbatch`.
pub fn submit(sweep: &Sweep, args: &SlurmArgs) -> anyhow::Result<()> {
    let todo: Vec<usize> = (0..sweep.entries.len())
        .filter(|&i| sweep.entries[i].status() != Status::Done)
        .collect();
    if todo.is_empty() {
        println!("every run of {} has finished", sweep.spec.display());
        return Ok(());
    }
    let dir = sweep.out.join("slurm");
    std::fs::create_dir_all(sweep.out.join("logs"))
        .and_then(|()| std::fs::create_dir_all(&dir))
        .with_context(|| format!("cannot create {}", dir.display()))?;
    let text = script(sweep, &todo, args)?;
    let path = dir.join("job.sh");
    std::fs::write(&path, &text).with_context(|| format!("cannot write {}", path.display()))?;
    if args.dry_run {
        print!("{text}");
        eprintln!(
            "wrote {} ({} tasks); not submitted",
            path.display(),
            todo.len()
        );
        return Ok(());
    }
    let out = Command::new("sbatch")
        .arg("--parsable")
        .arg(&path)
        .output()
        .context("cannot run sbatch (is Slurm installed and on PATH?)")?;
    if !out.status.success() {
        bail!(
            "sbatch refused {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let job = String::from_utf8_lossy(&out.stdout).trim().to_string();
    println!(
        "submitted job {job}: {} of {} runs (array {}), logs in {}",
        todo.len(),
        sweep.entries.len(),
        ranges(&todo),
        sweep.out.join("logs").display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn index_lists_compress_to_slurm_ranges() {
        assert_eq!(super::ranges(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
        assert_eq!(super::ranges(&[3]), "3");
    }
}
