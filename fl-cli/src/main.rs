//! `fl`: federated-learning simulations on Burn. See `fl --help`.

mod algorithms;
mod backend;
mod bench;
mod config;
mod interrupt;
mod landscape;
mod log;
mod partition;
mod personal;
mod plot;
mod report;
mod run;
mod rundir;
mod sweep;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand};

use config::RunArgs;

/// Federated-learning simulations (FedAvg, ...) on Burn, reproducible from a seed.
#[derive(Debug, Parser)]
#[command(name = "fl", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the algorithm and settings of a TOML config file (e.g. one from `configs/`);
    /// flags override the file.
    Run {
        /// The config file.
        file: PathBuf,
        #[command(flatten)]
        args: Box<RunArgs>,
    },
    #[command(flatten)]
    Algorithm(algorithms::AlgorithmCommand),
    /// Plot test accuracy (or loss) against rounds for runs; a directory of runs (one per seed)
    /// is drawn as its mean with a ±1 std band.
    Plot {
        /// Run directories (or directories of runs).
        #[arg(required = true)]
        runs: Vec<PathBuf>,
        /// Output file: .png or .svg.
        #[arg(short, long, default_value = "curves.png")]
        out: PathBuf,
        /// What to plot; `phi` (pFedClub runs) draws one curve per client architecture.
        #[arg(long, value_enum, default_value = "accuracy")]
        metric: report::Metric,
        /// Title above the plot.
        #[arg(long, default_value = "")]
        title: String,
        /// Draw each of the K models of runs made with `--eval-models` (FedMR, FedIndep) next
        /// to their averaged model, as FedMR's Fig. 5.
        #[arg(long)]
        models: bool,
    },
    /// A paper-style table of runs: final and best accuracy (mean ± std over seeds), rounds to
    /// a target accuracy (and wall-clock seconds to it), total communication.
    Compare {
        /// Run directories (or directories of runs).
        #[arg(required = true)]
        runs: Vec<PathBuf>,
        /// Target accuracy for the rounds-to-target column (0-1).
        #[arg(long, default_value_t = 0.8, value_parser = report::parse_target)]
        target: f64,
        /// Output format.
        #[arg(long, value_enum, default_value = "markdown")]
        format: report::TableFormat,
    },
    /// Loss landscape of a finished run's global model on the plane of two random
    /// filter-normalised directions (Li et al. 2018; FedMR's Fig. 7): PNG heat map + CSV.
    Landscape {
        /// The run directory (needs its model.bpk).
        run: PathBuf,
        /// Output PNG (the CSV is written next to it) (default RUN/landscape.png).
        #[arg(short, long)]
        out: Option<PathBuf>,
        /// Points per axis, odd (3 to 201).
        #[arg(long, default_value_t = 21)]
        grid: usize,
        /// Half-width of the plane in filter-norm units.
        #[arg(long, default_value_t = 1.0)]
        span: f64,
        /// Test images evaluated per point.
        #[arg(long, default_value_t = 1000)]
        samples: usize,
        /// Seed of the two directions.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Measure training, evaluation, a FedMR round and server operations per model, with
    /// peak memory (prints a Markdown table; see README "Speed").
    Bench {
        /// Models, comma-separated.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "cnn,cnn-fedavg,resnet20,vgg16"
        )]
        models: Vec<String>,
        /// Samples per client.
        #[arg(long, default_value_t = 500)]
        samples: usize,
        /// Clients per round (K).
        #[arg(long, default_value_t = 10)]
        clients: usize,
        /// Local epochs per round.
        #[arg(long, default_value_t = 5)]
        epochs: usize,
        /// Worker threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
        /// Input shape CxHxW of the synthetic images (the papers use 3x32x32 and 1x28x28).
        #[arg(long, default_value = "3x32x32", value_parser = bench::parse_input_shape)]
        input: [usize; 3],
        /// A seconds-long smoke run (2 clients × 1 epoch × 20 samples).
        #[arg(long)]
        quick: bool,
        /// Train with Burn's balanced gradient checkpointing (batch-norm outputs recomputed in
        /// the backward pass: less memory, the same results), as `--gradient-checkpointing
        /// true` runs do.
        #[arg(long, value_name = "BOOL", default_value_t = false, action = clap::ArgAction::Set)]
        gradient_checkpointing: bool,
        /// Run Burn's own ops instead of fl-models' CPU kernels, for an A/B comparison on
        /// flex: all of them (`--burn-kernels`), or some (`--burn-kernels=depthwise,activation`;
        /// kernels: conv, depthwise, max-pool, avg-pool, batch-norm, activation, linear,
        /// optimizer, eval-chunks).
        #[arg(
            long,
            value_name = "KERNELS",
            num_args = 0..=1,
            require_equals = true,
            default_missing_value = "all",
            value_parser = bench::parse_burn_kernels
        )]
        burn_kernels: Option<bench::BurnKernels>,
        /// Instead of the model table: time one round of the run this config describes
        /// (training, server step with pFedClub's phases, evaluation) and its peak RSS.
        #[arg(long, value_name = "CONFIG", conflicts_with = "quick")]
        round: Option<PathBuf>,
        /// Instead of the model table: this machine's multiply-add peak and the convolution
        /// kernels' GFLOP/s on the models' shapes (what bounds training speed here).
        #[arg(long, conflicts_with_all = ["quick", "round", "burn_kernels"])]
        kernels: bool,
        /// With `--kernels`: only the layers whose name contains one of these
        /// (comma-separated, e.g. `--layers resnet20,cnn2`).
        #[arg(long, value_delimiter = ',', requires = "kernels")]
        layers: Vec<String>,
    },
    /// Draw how a partition splits the classes among clients: a heat map (clients × classes)
    /// and a CSV, for a run's partition.json (`--run DIR`) or the one the flags would draw.
    Partition {
        /// A run directory whose partition to draw.
        #[arg(long, value_name = "DIR")]
        run: Option<PathBuf>,
        /// Output PNG (the CSV is written next to it).
        #[arg(short = 'o', long, default_value = "partition.png")]
        image: PathBuf,
        #[command(flatten)]
        args: Box<RunArgs>,
    },
    /// Fetch a dataset's canonical files once (verified by size and SHA-256) into the per-user
    /// cache, where every subcommand finds them.
    Download {
        /// Dataset: fashion-mnist, mnist, cifar10, cifar100 (also cifar100-coarse), svhn.
        dataset: String,
        /// Target directory (default: ~/.cache/fl/DATASET, searched by dataset resolution).
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
        /// Fetch the canonical file names from this base URL instead (a mirror): http(s)://,
        /// file://, or a directory holding them. Verified all the same.
        #[arg(long, value_name = "URL")]
        mirror: Option<String>,
        /// No progress bar (also automatic when stderr is not a terminal).
        #[arg(long)]
        quiet: bool,
    },
    /// Sweeps: a whole paper table from one TOML file (base config, axes, explicit cells,
    /// seeds), run locally N at a time or as a Slurm job array, restartable, and summarised.
    Sweep {
        #[command(subcommand)]
        command: SweepCommand,
    },
    /// List the models with their parameter counts and blocks for a dataset.
    Models {
        /// Dataset whose input shape and classes to use.
        #[arg(long, default_value = "fashion-mnist")]
        dataset: String,
        /// Where an image folder's images are (`--dataset image-folder`: its shape and
        /// classes are read from them).
        #[arg(long)]
        data_dir: Option<PathBuf>,
    },
}

/// `fl sweep` subcommands.
#[derive(Debug, Subcommand)]
enum SweepCommand {
    /// Print the expanded runs (numbered: `--cell I`), their status and the work they hold.
    Plan {
        /// The sweep file.
        spec: PathBuf,
    },
    /// Run every unfinished run on this machine, --jobs at a time (finished ones are skipped,
    /// started ones resumed exactly); or, with --cell I, run I alone (what Slurm tasks run).
    Run {
        /// The sweep file.
        spec: PathBuf,
        /// Runs at once (each gets cores / jobs threads).
        #[arg(long, default_value_t = 1, conflicts_with = "cell")]
        jobs: usize,
        /// Run only entry I of `fl sweep plan`.
        #[arg(long, value_name = "I")]
        cell: Option<usize>,
        /// Threads of the --cell run (default: the configuration's).
        #[arg(long, requires = "cell")]
        threads: Option<usize>,
        /// Run failed runs again too.
        #[arg(long, conflicts_with = "cell")]
        retry_failed: bool,
        /// No progress display.
        #[arg(long)]
        quiet: bool,
    },
    /// Submit every unfinished run as one Slurm job array (`sbatch --array`), each task
    /// running `fl sweep run SPEC --cell I`; submit again to run only what did not finish.
    Slurm {
        /// The sweep file.
        spec: PathBuf,
        #[command(flatten)]
        args: sweep::slurm::SlurmArgs,
    },
    /// The sweep's results as a paper-style table: final accuracy (mean ± std over seeds) by
    /// the `algorithm` axis × the other axes, then every cell's `fl compare` row.
    Report {
        /// The sweep file.
        spec: PathBuf,
        /// Target accuracy for the rounds-to-target column (0-1).
        #[arg(long, default_value_t = 0.8, value_parser = report::parse_target)]
        target: f64,
        /// Output format.
        #[arg(long, value_enum, default_value = "markdown")]
        format: report::TableFormat,
    },
}

fn sweep_command(command: SweepCommand) -> anyhow::Result<()> {
    match command {
        SweepCommand::Plan { spec } => {
            print!("{}", sweep::plan(&sweep::Sweep::load(&spec)?));
            Ok(())
        }
        SweepCommand::Run {
            spec,
            jobs,
            cell,
            threads,
            retry_failed,
            quiet,
        } => {
            let sweep = sweep::Sweep::load(&spec)?;
            match cell {
                Some(i) => sweep::local::run_entry(&sweep, i, threads),
                None => sweep::local::run_all(&sweep, jobs, retry_failed, quiet),
            }
        }
        SweepCommand::Slurm { spec, args } => {
            sweep::slurm::submit(&sweep::Sweep::load(&spec)?, &args)
        }
        SweepCommand::Report {
            spec,
            target,
            format,
        } => sweep::report(&sweep::Sweep::load(&spec)?, target, format).map(|t| print!("{t}")),
    }
}

fn load_groups(dirs: &[PathBuf]) -> anyhow::Result<Vec<report::RunGroup>> {
    dirs.iter().map(|d| report::load_group(d)).collect()
}

/// The ids of the arguments given on the command line (not defaulted) of the subcommand.
/// (Argument groups, which clap's derive names after the flattened structs, are not flags.)
fn given_ids(matches: &ArgMatches) -> Vec<String> {
    matches
        .ids()
        .filter(|id| !id.as_str().starts_with(char::is_uppercase))
        .filter(|id| matches.value_source(id.as_str()) == Some(ValueSource::CommandLine))
        .map(|id| id.to_string())
        .collect()
}

/// Parses the command line; a usage error is one line on stderr and exit code 1.
fn parse() -> Result<Cli, ExitCode> {
    // "--mu -1" is a negative value (then refused by the flag's own check), not an unknown flag.
    let parsed = Cli::command()
        .mut_subcommands(|c| {
            c.mut_args(|a| {
                let takes_values = a.get_action().takes_values();
                a.allow_negative_numbers(takes_values)
            })
        })
        .try_get_matches()
        .and_then(|m| Ok((Cli::from_arg_matches(&m)?, m)));
    let (mut cli, matches) = match parsed {
        Ok(p) => p,
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => {
            let text = e.to_string();
            let lines: Vec<&str> = text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with("For more information"))
                .collect();
            eprintln!("{}", lines.join(" "));
            return Err(ExitCode::FAILURE);
        }
    };
    let given = matches.subcommand().map(|(_, m)| given_ids(m));
    let args = match &mut cli.command {
        Command::Algorithm(c) => Some(c.run_args_mut()),
        Command::Run { args, .. } | Command::Partition { args, .. } => Some(args.as_mut()),
        _ => None,
    };
    if let (Some(args), Some(given)) = (args, given) {
        args.given = given;
    }
    Ok(cli)
}

/// glibc's allocator, tuned for tensors (a user's own `GLIBC_TUNABLES` wins):
/// - one arena: glibc gives threads their own, and memory freed in one arena is not reused by
///   the others; with tensors allocated on one worker thread and dropped on another, a Zoo I
///   pFedClub round on two threads peaked at 3.3 GiB instead of 2.35 (three runs each, same
///   speed);
/// - blocks up to 128 MiB from the heap (glibc maps anything over 32 MiB afresh, so VGG-16's
///   67 MB FC-layer gradients and optimiser buffers page-faulted in on every step: training
///   +10%), with the top of the heap trimmed above 128 MiB: at 64 MiB, glibc's own figure once
///   its threshold has grown to 32 MiB, freeing VGG-16's 64 MiB weight gradient trimmed the heap
///   and the next one page-faulted in afresh (its weight gradient ran at a third of the speed,
///   training 4% slower); Zoo I's round peaked at 1,813 and 1,893 MiB against 1,971 and 1,850
///   (512 MiB kept 300 MiB more there).
fn tune_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("GLIBC_TUNABLES").is_none() {
        // SAFETY: `mallopt` only sets allocator parameters; called before any thread starts.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 1);
            libc::mallopt(libc::M_MMAP_THRESHOLD, 128 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 128 << 20);
        }
    }
}

/// Writing into a closed pipe (`fl bench --kernels | head -1`) ends the process quietly, as it
/// ends other Unix tools: Rust ignores SIGPIPE, so `println!` would panic instead. A run ended
/// this way resumes from its last checkpoint; its run directory's lock dies with it.
fn default_sigpipe() {
    #[cfg(unix)]
    // SAFETY: restores the default disposition of one signal, before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() -> ExitCode {
    tune_malloc();
    default_sigpipe();
    let cli = match parse() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    log::init();
    interrupt::install();
    let result = match cli.command {
        Command::Run { file, args } => run::start(
            None,
            &config::RunArgs {
                config: Some(file),
                ..*args
            },
        ),
        Command::Algorithm(command) => {
            let (args, algorithm) = command.into_parts();
            run::start(Some(&algorithm), &args)
        }
        Command::Plot {
            runs,
            out,
            metric,
            title,
            models,
        } => load_groups(&runs).and_then(|g| {
            let g = if models { report::expand_models(g) } else { g };
            // φ is drawn per client architecture, as pFedClub's Fig. 6.
            let g = if metric == report::Metric::Phi {
                report::expand_architectures(g)
            } else {
                g
            };
            plot::plot(&g, metric, &title, &out)
        }),
        Command::Compare {
            runs,
            target,
            format,
        } => load_groups(&runs)
            .and_then(|g| report::compare_table(&g, target, format))
            .map(|table| print!("{table}")),
        Command::Models { dataset, data_dir } => run::list_models(&dataset, data_dir.as_deref()),
        Command::Sweep { command } => sweep_command(command),
        Command::Download {
            dataset,
            dir,
            mirror,
            quiet,
        } => run::download(&dataset, dir, mirror.as_deref(), quiet),
        Command::Partition { run, image, args } => run::partition(run.as_deref(), &args, &image),
        Command::Bench {
            threads,
            kernels: true,
            layers,
            ..
        } => bench::bench_kernels(threads, &layers),
        Command::Bench {
            threads,
            burn_kernels,
            round: Some(config),
            ..
        } => {
            if let Some(kernels) = &burn_kernels {
                kernels.apply();
            }
            bench::bench_round(&config, threads)
        }
        Command::Bench {
            models,
            samples,
            clients,
            epochs,
            threads,
            input,
            quick,
            gradient_checkpointing,
            burn_kernels,
            round: None,
            kernels: false,
            layers: _,
        } => models
            .iter()
            .map(|m| m.parse::<fl_models::ModelKind>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(anyhow::Error::from)
            .and_then(|models| {
                let threads = threads.unwrap_or_else(config::default_threads);
                let args = if quick {
                    bench::BenchArgs {
                        input,
                        gradient_checkpointing,
                        ..bench::BenchArgs::quick(models, threads)
                    }
                } else {
                    bench::BenchArgs {
                        models,
                        samples,
                        clients,
                        epochs,
                        threads,
                        input,
                        gradient_checkpointing,
                    }
                };
                if let Some(kernels) = &burn_kernels {
                    kernels.apply();
                }
                bench::bench(&args)
            }),
        Command::Landscape {
            out,
            run,
            grid,
            span,
            samples,
            seed,
        } => landscape::landscape(
            &run,
            &landscape::LandscapeArgs {
                grid,
                span,
                samples,
                seed,
            },
            &out.unwrap_or_else(|| run.join("landscape.png")),
        ),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is::<interrupt::Interrupted>() || e.is::<interrupt::Stopped>() => {
            eprintln!("{e}");
            ExitCode::from(interrupt::EXIT_CODE)
        }
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, each cause once: a cause whose text its parent's
/// message already holds (`cannot read F: No such file…` over `No such file…`) is not repeated.
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line.replace('\n', " ")
}
