//! Ctrl-C (SIGINT) and SIGTERM: the first asks the run to stop after the round under way (it
//! is checkpointed, so `--resume` continues exactly); a second stops at once.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// Set by the first signal; the engine stops between rounds when it is set.
static STOP: AtomicBool = AtomicBool::new(false);

/// The command that continues the run under way, for the message of a second signal.
static RESUME: Mutex<Option<String>> = Mutex::new(None);

/// The exit code of an interrupted run (128 + SIGINT, as a shell reports it).
pub const EXIT_CODE: u8 = 130;

/// The flag the engine watches.
pub fn flag() -> &'static AtomicBool {
    &STOP
}

/// Installs the handler (once, before any run starts).
pub fn install() {
    let handler = || {
        let resume = RESUME.lock().map(|r| r.clone()).unwrap_or_default();
        let again = STOP.swap(true, Ordering::SeqCst);
        match (again, resume) {
            (false, Some(_)) => {
                eprintln!("\nstopping after the round under way (press Ctrl-C again to stop now)")
            }
            (_, resume) => {
                if let Some(resume) = resume {
                    eprintln!("\nstopped; continue from the last checkpoint with: {resume}");
                }
                std::process::exit(EXIT_CODE.into());
            }
        }
    };
    // Without a handler (another one is installed) Ctrl-C still stops the process.
    let _ = ctrlc::set_handler(handler);
}

/// Records the command that resumes the run starting now (`None` when it ends).
pub fn set_resume_command(command: Option<String>) {
    if let Ok(mut r) = RESUME.lock() {
        *r = command;
    }
}

/// The error a sweep returns when it stopped on a signal: main exits with [`EXIT_CODE`].
#[derive(Debug, thiserror::Error)]
#[error("stopped; every run is checkpointed, continue with: {resume}")]
pub struct Stopped {
    /// The command that continues.
    pub resume: String,
}

/// The error a run returns when it stopped on a signal: main exits with [`EXIT_CODE`].
#[derive(Debug, thiserror::Error)]
#[error("interrupted after round {round}; continue with: {resume}")]
pub struct Interrupted {
    /// The last checkpointed round.
    pub round: usize,
    /// The command that continues the run.
    pub resume: String,
}
