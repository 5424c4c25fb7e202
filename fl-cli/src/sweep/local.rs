//! Running a sweep on this machine: one entry (`--cell I`, also what every Slurm array task
//! runs), or all unfinished entries N at a time, each in its own `fl` process with its share
//! of the cores, under one progress display.
//!
//! Restartable: finished entries are skipped, started ones resumed from their checkpoints
//! (exactly), failed ones reported and retried with `--retry-failed`. Ctrl-C stops every
//! running entry after its round (checkpointed); killing the sweep and starting it again loses
//! nothing.

use std::io::IsTerminal;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};

use super::{Entry, Status, Sweep, last_round};
use crate::config::RunConfig;

/// Runs entry `index` (resuming it when it has started): the code path of the local runner's
/// processes and of Slurm's array tasks. A failure leaves its error beside the run directory.
pub fn run_entry(sweep: &Sweep, index: usize, threads: Option<usize>) -> anyhow::Result<()> {
    let entry = sweep.entry(index)?;
    let marker = entry.failure_marker();
    let _ = std::fs::remove_file(&marker);
    let result = start(entry, threads);
    if let Err(e) = &result
        && !e.is::<crate::interrupt::Interrupted>()
    {
        if let Some(parent) = marker.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
        let _ = std::fs::write(&marker, format!("{}\n", crate::one_line(e)));
    }
    result
}

fn start(entry: &Entry, threads: Option<usize>) -> anyhow::Result<()> {
    let dir = entry.dir();
    let mut cfg = entry.config.clone();
    if let Some(t) = threads {
        cfg.run.threads = t;
    }
    let started = dir.join("config.toml");
    let resume = started.exists();
    if resume {
        // The run continues only with the settings it started with, but those a resume may
        // change: more rounds in the sweep file extend it.
        let before = RunConfig::from_file(&started)?;
        let normal = |c: &RunConfig| {
            let mut c = c.clone();
            c.run.resume_with(&before.run, |_| true);
            c.run.out = None;
            c.to_toml()
        };
        let (was, now) = (normal(&before), normal(&cfg));
        if was != now {
            let diff = crate::config::first_difference(&now, &was)
                .map_or(String::new(), |(a, b)| format!(" (now `{a}`, was `{b}`)"));
            bail!(
                "{} started with other settings{diff}; restore the sweep file or remove the directory",
                dir.display()
            );
        }
        if last_round(&dir) >= cfg.run.rounds {
            return Ok(());
        }
    }
    crate::run::run_one(&cfg, resume, true)
}

/// A running entry.
struct Running {
    index: usize,
    child: Child,
}

/// `fl sweep run SPEC --jobs N`: every unfinished entry (failed ones too with
/// `retry_failed`), `jobs` at a time, each with `cores / jobs` threads.
pub fn run_all(sweep: &Sweep, jobs: usize, retry_failed: bool, quiet: bool) -> anyhow::Result<()> {
    if jobs == 0 {
        bail!("--jobs must be at least 1");
    }
    std::fs::create_dir_all(&sweep.out)
        .with_context(|| format!("cannot create {}", sweep.out.display()))?;
    // One runner per sweep: a second would start the same entries.
    let _lock = crate::rundir::lock_dir(&sweep.out)?;
    let logs = sweep.out.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("cannot create {}", logs.display()))?;
    let statuses: Vec<Status> = sweep.entries.iter().map(Entry::status).collect();
    let skipped_failed = statuses.iter().filter(|s| **s == Status::Failed).count();
    let mut todo: Vec<usize> = (0..sweep.entries.len())
        .filter(|&i| match statuses[i] {
            Status::Done => false,
            Status::Failed => retry_failed,
            _ => true,
        })
        .collect();
    // Seed by seed (every cell's first seed, then the second, ...): a sweep stopped half-way
    // already has a whole table.
    let seeds: Vec<u64> = sweep.entries.iter().map(|e| e.seed).collect();
    todo.sort_by_key(|&i| (seeds.iter().position(|&s| s == sweep.entries[i].seed), i));
    let mut todo: std::collections::VecDeque<usize> = todo.into();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (cores / jobs).max(1);
    let rounds_left = |i: usize| {
        let e = &sweep.entries[i];
        e.config.run.rounds.saturating_sub(last_round(&e.dir()))
    };
    let total: usize = todo.iter().map(|&i| rounds_left(i)).sum();
    let start_rounds: Vec<usize> = sweep.entries.iter().map(|e| last_round(&e.dir())).collect();
    let mut rounds_now = start_rounds.clone();
    let mut ended: Vec<usize> = Vec::new();
    let already = sweep.entries.len() - todo.len() - if retry_failed { 0 } else { skipped_failed };
    let bar = if quiet || !std::io::stderr().is_terminal() {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total as u64).with_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} rounds, ETA {eta}  {msg}")
                .expect("a valid template"),
        )
    };
    let say = |line: String| {
        if bar.is_hidden() {
            if !quiet {
                eprintln!("{line}");
            }
        } else {
            bar.println(line);
        }
    };
    let exe = std::env::current_exe().context("cannot find the fl executable")?;
    // The first signal only asks to stop (the runs finish their round): see `interrupt`.
    let resume = format!("fl sweep run {}", sweep.spec.display());
    crate::interrupt::set_resume_command(Some(resume.clone()));
    let mut running: Vec<Running> = Vec::new();
    let (mut done, mut failed, mut interrupted) = (already, 0usize, 0usize);
    let stop = crate::interrupt::flag();
    let mut stopping = false;
    loop {
        if stop.load(Ordering::SeqCst) && !stopping {
            stopping = true;
            for r in &running {
                // SAFETY: kill(2) on the pid of a child we spawned and have not reaped.
                unsafe { libc::kill(r.child.id() as libc::pid_t, libc::SIGTERM) };
            }
        }
        while !stopping && running.len() < jobs {
            let Some(i) = todo.pop_front() else { break };
            let e = &sweep.entries[i];
            let log = logs.join(format!("{}-s{}.log", e.cell, e.seed));
            let file = std::fs::File::create(&log)
                .with_context(|| format!("cannot create {}", log.display()))?;
            let child = Command::new(&exe)
                .args(["sweep", "run"])
                .arg(&sweep.spec)
                .args(["--cell", &i.to_string(), "--threads", &threads.to_string()])
                .stdin(Stdio::null())
                // Their own process group: a Ctrl-C reaches them once, forwarded by us.
                .process_group(0)
                .stdout(file.try_clone()?)
                .stderr(file)
                .spawn()
                .context("cannot start fl")?;
            running.push(Running { index: i, child });
        }
        let mut k = 0;
        while k < running.len() {
            let Some(status) = running[k].child.try_wait()? else {
                k += 1;
                continue;
            };
            let r = running.swap_remove(k);
            ended.push(r.index);
            let e = &sweep.entries[r.index];
            let name = format!("{}/s{}", e.cell, e.seed);
            match status.code() {
                Some(0) => {
                    done += 1;
                    say(format!("finished {name}"));
                }
                Some(130) => interrupted += 1,
                _ => {
                    failed += 1;
                    let why = std::fs::read_to_string(e.failure_marker())
                        .unwrap_or_else(|_| format!("exit status {status}"));
                    say(format!("FAILED {name}: {}", why.trim()));
                }
            }
        }
        // Only running entries (and those just ended) move: read just their metrics.
        for &i in running.iter().map(|r| &r.index).chain(&ended) {
            rounds_now[i] = last_round(&sweep.entries[i].dir());
        }
        ended.clear();
        let progressed: usize = sweep
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let r = e.config.run.rounds;
                rounds_now[i].min(r) - start_rounds[i].min(r)
            })
            .sum();
        bar.set_position(progressed as u64);
        bar.set_message(format!(
            "{done}/{} runs done, {} running, {failed} failed",
            sweep.entries.len(),
            running.len()
        ));
        if running.is_empty() && (todo.is_empty() || stopping) {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    bar.finish_and_clear();
    crate::interrupt::set_resume_command(None);
    if !quiet {
        eprintln!(
            "{done}/{} runs done, {failed} failed this time{}",
            sweep.entries.len(),
            if skipped_failed > 0 && !retry_failed {
                format!(", {skipped_failed} failed before (retry with --retry-failed)")
            } else {
                String::new()
            }
        );
    }
    if stopping || interrupted > 0 {
        return Err(crate::interrupt::Stopped { resume }.into());
    }
    let unfinished = failed + if retry_failed { 0 } else { skipped_failed };
    if unfinished > 0 {
        bail!(
            "{unfinished} of {} runs failed; their errors are beside their run directories (*.failed) and in {}",
            sweep.entries.len(),
            logs.display()
        );
    }
    Ok(())
}
