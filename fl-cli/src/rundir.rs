//! A run directory: created only for a run that can start, locked for the whole run so two
//! processes never share it, and filled with the files that describe the run.

use std::fs::{File, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use fl_data::{FederatedDataset, Partition};

use crate::backend;
use crate::config::RunConfig;

/// The lock file inside a run directory; it holds the pid of the process running it.
pub const LOCK_FILE: &str = ".lock";

/// An open run directory, exclusively locked until dropped (or the process ends, however it
/// ends: the lock is the operating system's advisory `flock`, not the file's existence).
#[derive(Debug)]
pub struct RunDir {
    /// The directory.
    pub path: PathBuf,
    _lock: File,
}

impl RunDir {
    /// Creates (or, resuming, opens) `cfg`'s run directory and locks it, only for a run that
    /// can start: the engine settings and `partition` (of `train_len` training samples) are
    /// checked first. Refuses a directory another process holds, and one that already holds a
    /// run unless resuming.
    pub fn open(
        cfg: &RunConfig,
        resume: bool,
        partition: &Partition,
        train_len: usize,
    ) -> anyhow::Result<Self> {
        cfg.run.engine().validate(partition.num_clients())?;
        partition.validate(train_len)?;
        let path = cfg.out_dir();
        // Checked before the lock file is made (it would be left in a user's directory),
        // and again under the lock, which another run may have taken first.
        if !resume && path.is_dir() {
            check_unused(&path, false)?;
        }
        std::fs::create_dir_all(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        let lock = lock_dir(&path)?;
        if resume {
            check_same_partition(&path, partition)?;
            warn_if_other_build(&path);
        } else {
            check_unused(&path, true)?;
        }
        Ok(Self { path, _lock: lock })
    }
}

/// Refuses to resume a run whose settings now draw another partition than its
/// `partition.json`: its training data changed since it started (the embedded Fashion-MNIST
/// copy then the full one, another `--data-dir`), and the rounds would go on over other samples.
fn check_same_partition(path: &Path, partition: &Partition) -> anyhow::Result<()> {
    let file = path.join("partition.json");
    if !file.exists() {
        // Stopped before its files were written: nothing to compare.
        return Ok(());
    }
    let saved = Partition::load(&file)?;
    if saved != *partition {
        let size = |p: &Partition| {
            let samples: usize = p.clients.iter().map(Vec::len).sum();
            format!("{} clients, {samples} samples", p.num_clients())
        };
        bail!(
            "cannot resume {}: its partition.json ({}) differs from the partition its settings draw now ({}): the training data changed since the run started (see dataset_origin in its manifest.json)",
            path.display(),
            size(&saved),
            size(partition)
        );
    }
    Ok(())
}

/// This binary's commit (`manifest.json`'s `git_hash`).
fn git_hash() -> &'static str {
    option_env!("FL_GIT_HASH").unwrap_or("unknown")
}

/// Warns when a run resumes under a binary of another commit than the one that started it:
/// the rounds after the resume may then not be those of an uninterrupted run.
fn warn_if_other_build(path: &Path) {
    let manifest = std::fs::read_to_string(path.join("manifest.json")).ok();
    let started = manifest
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .and_then(|m| m["git_hash"].as_str().map(String::from));
    if let Some(started) = started
        && ![started.as_str(), git_hash()].contains(&"unknown")
        && started != git_hash()
    {
        tracing::warn!(
            "{} was started by fl at commit {started}; this binary is of commit {}: the rounds from here on may differ from an uninterrupted run's",
            path.display(),
            git_hash()
        );
    }
}

/// Refuses a new run's directory unless it is empty (but for its lock): one holding a run,
/// even one stopped before its first checkpoint, is continued with `--resume`; any other
/// files would be overwritten or mixed with the run's (a directory of runs is one `fl plot`
/// and `fl compare` read as seeds). Before the directory is `locked`, a run with a lock file
/// passes: taking the lock then says whether another process is running it.
fn check_unused(path: &Path, locked: bool) -> anyhow::Result<()> {
    let run_file = |name: &str| path.join(name).exists();
    if run_file(fl_core::engine::files::CHECKPOINT) || run_file("config.toml") {
        if !locked && run_file(LOCK_FILE) {
            return Ok(());
        }
        bail!(
            "{} already holds a run; continue it with --resume {} or choose another --out",
            path.display(),
            path.display()
        );
    }
    let entries =
        std::fs::read_dir(path).with_context(|| format!("cannot read {}", path.display()))?;
    for entry in entries {
        let name = entry
            .with_context(|| format!("cannot read {}", path.display()))?
            .file_name();
        if name != LOCK_FILE {
            bail!(
                "{} is not empty (it holds {}): a new run needs a new or empty directory; choose another --out",
                path.display(),
                name.to_string_lossy()
            );
        }
    }
    Ok(())
}

/// Takes `dir`'s lock (its `.lock` file, held until the file is dropped) and writes this
/// process's pid into it; refuses a directory another process holds.
pub fn lock_dir(dir: &Path) -> anyhow::Result<File> {
    let path = dir.join(LOCK_FILE);
    let mut file = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = match holder.trim() {
                "" => "another process".to_string(),
                pid => format!("process {pid}"),
            };
            bail!(
                "{} is in use by {holder} (lock {}); wait for it to finish or choose another --out",
                dir.display(),
                path.display()
            );
        }
        Err(TryLockError::Error(e)) => bail!("cannot lock {}: {e}", path.display()),
    }
    file.set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| writeln!(file, "{}", std::process::id()))
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(file)
}

/// Writes `config.toml`, `manifest.json` (with `extra` fields) and `partition.json`.
pub fn write_run_files(
    cfg: &RunConfig,
    out: &Path,
    data: &FederatedDataset,
    partition: &Partition,
    extra: serde_json::Map<String, serde_json::Value>,
) -> anyhow::Result<()> {
    let write = |name: &str, text: String| {
        let path = out.join(name);
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))
    };
    write("config.toml", cfg.to_toml())?;
    let mut manifest = serde_json::json!({
        "fl_version": env!("CARGO_PKG_VERSION"),
        "git_hash": git_hash(),
        "backend": backend::name(),
        "seed": cfg.run.seed,
        "algorithm": cfg.label(),
        "dataset": data.name,
        "dataset_origin": data.origin,
        "train_samples": data.train.len(),
        "test_samples": data.test.len(),
        "command": std::env::args().collect::<Vec<_>>(),
    });
    if let Some(device) = backend::device_name() {
        manifest["device"] = device.into();
    }
    if let (Some(file), Some(sha)) = (&cfg.run.partition_file, &cfg.run.partition_sha256) {
        manifest["partition_file"] = file.display().to_string().into();
        manifest["partition_sha256"] = sha.clone().into();
    }
    manifest.as_object_mut().expect("an object").extend(extra);
    write(
        "manifest.json",
        serde_json::to_string_pretty(&manifest).expect("json"),
    )?;
    partition.save(&out.join("partition.json"))?;
    Ok(())
}

/// Records in `out`'s `config.toml` the [`RunSettings::RESUMABLE`] settings a resumed run
/// continues with (an extended `--rounds`, another `--threads`), so that the next `--resume`
/// without them (as the interrupt message prints it) goes on the same way. Written to a
/// temporary file and renamed, so a crash leaves the old file or the new one; unchanged, it is
/// not rewritten.
///
/// [`RunSettings::RESUMABLE`]: crate::config::RunSettings::RESUMABLE
pub fn record_resumed_settings(cfg: &RunConfig, out: &Path) -> anyhow::Result<()> {
    let path = out.join("config.toml");
    let old = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let mut saved = RunConfig::from_file(&path)?;
    saved.run.resume_with(&cfg.run, |_| true);
    let new = saved.to_toml();
    if new == old {
        return Ok(());
    }
    let tmp = path.with_extension("toml.tmp");
    std::fs::write(&tmp, new)
        .and_then(|()| std::fs::rename(&tmp, &path))
        .with_context(|| format!("cannot write {}", path.display()))
}
