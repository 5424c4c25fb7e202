//! `fl`: federated-learning simulations on Burn. See `fl --help`.

mod backend;
mod bench;
mod config;
mod landscape;
mod log;
mod partition;
mod personal;
mod plot;
mod report;
mod run;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use config::{BaselineArgs, FedCrossArgs, FedMrArgs, RunArgs};

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
    /// FedAvg (McMahan et al. 2017): clients train the global model, the server averages them.
    Fedavg {
        #[command(flatten)]
        args: Box<RunArgs>,
        /// Average uploads with equal weights instead of by sample counts.
        #[arg(long)]
        unweighted: bool,
    },
    /// FedMR (Hu et al. 2024): K models, recombined layer-wise across clients every round.
    Fedmr {
        #[command(flatten)]
        args: Box<RunArgs>,
        #[command(flatten)]
        fedmr: FedMrArgs,
    },
    /// FedCross (Hu et al. 2024): K models, each fused with a collaborative partner every round.
    Fedcross {
        #[command(flatten)]
        args: Box<RunArgs>,
        #[command(flatten)]
        cross: FedCrossArgs,
    },
    /// FedIndep: K models trained independently, re-dispatched to random clients each round.
    Fedindep {
        #[command(flatten)]
        args: Box<RunArgs>,
    },
    /// FedProx (Li et al. 2020): FedAvg with the local proximal term (μ/2)·‖w − w_global‖².
    Fedprox {
        #[command(flatten)]
        args: Box<RunArgs>,
        /// Proximal weight μ (papers: 0.01 CIFAR-10, 0.001 CIFAR-100, 0.1 FEMNIST) (default 0.01).
        #[arg(long)]
        mu: Option<f64>,
    },
    /// SCAFFOLD (Karimireddy et al. 2020): control variates correct client drift.
    Scaffold {
        #[command(flatten)]
        args: Box<RunArgs>,
        /// Server learning rate η_g (default 1).
        #[arg(long)]
        server_lr: Option<f64>,
    },
    /// FedAvgM (Hsu et al. 2019): FedAvg with server momentum.
    Fedavgm {
        #[command(flatten)]
        args: Box<RunArgs>,
        /// Server momentum β (default 0.9).
        #[arg(long)]
        server_momentum: Option<f64>,
        /// Server learning rate (default 1).
        #[arg(long)]
        server_lr: Option<f64>,
    },
    /// FedExP (Jhunjhunwala et al. 2023): FedAvg with an extrapolated server step size.
    Fedexp {
        #[command(flatten)]
        args: Box<RunArgs>,
        /// ε of the step-size rule (default 0.001).
        #[arg(long)]
        epsilon: Option<f64>,
    },
    /// pFedClub (Wang et al. 2024): personalised FL over heterogeneous model zoos by block
    /// substitution; also pFedHR-style reassembly, FedAvg per architecture and local training
    /// (`--variant`), and the paper's ablations.
    Pfedclub {
        #[command(flatten)]
        args: Box<RunArgs>,
        #[command(flatten)]
        club: personal::ClubArgs,
    },
    /// FedMut (Hu et al. 2024): the global model is mutated into K models along its last update.
    Fedmut {
        #[command(flatten)]
        args: Box<RunArgs>,
        /// Mutation radius α (default 4.0).
        #[arg(long)]
        mut_radius: Option<f64>,
        /// Initial imbalance of the mutation pairs, decaying to 0 over --mut-bound rounds (default 0.3).
        #[arg(long)]
        mut_rate: Option<f64>,
        /// Rounds over which the imbalance decays (default 100).
        #[arg(long)]
        mut_bound: Option<usize>,
    },
    /// MOON (Li et al. 2021): FedAvg with a model-contrastive local loss.
    Moon {
        #[command(flatten)]
        args: Box<RunArgs>,
        /// Weight μ of the contrastive term (default: 5, or 1 for CIFAR-100 and FEMNIST).
        #[arg(long)]
        moon_mu: Option<f64>,
        /// Temperature τ (default 0.5).
        #[arg(long)]
        tau: Option<f64>,
    },
    /// FedASAM (Caldarola et al. 2022): FedAvg with adaptive sharpness-aware local steps.
    Fedasam {
        #[command(flatten)]
        args: Box<RunArgs>,
        /// Neighbourhood radius ρ (default 0.1).
        #[arg(long)]
        rho: Option<f64>,
        /// η of the adaptive scaling |w| + η (default 0).
        #[arg(long)]
        eta: Option<f64>,
        /// Plain SAM (FedSAM) instead of ASAM.
        #[arg(long)]
        sam: bool,
    },
    /// Clustered sampling (Fraboni et al. 2021, Algorithm 2): clients clustered by the
    /// similarity of their updates, one sampled per cluster-based distribution.
    Clusamp {
        #[command(flatten)]
        args: Box<RunArgs>,
        /// Distance between updates: arccos (default), l1, l2.
        #[arg(long)]
        cluster_distance: Option<String>,
        /// What Ward's linkage clusters: rows of the distance matrix (authors' code, default)
        /// or the distances themselves.
        #[arg(long)]
        linkage: Option<String>,
    },
    /// FedGen (Zhu et al. 2021): a server-trained generator of latent features regularises
    /// the clients (data-free knowledge distillation).
    Fedgen {
        #[command(flatten)]
        args: Box<RunArgs>,
        /// Generator noise: gaussian (paper, default) or uniform (authors' code).
        #[arg(long)]
        gen_noise: Option<String>,
        /// Generator learning rate (default: 3e-4; 1e-4 for CIFAR-100).
        #[arg(long)]
        gen_lr: Option<f64>,
        /// Generator steps per round (default 50).
        #[arg(long)]
        gen_steps: Option<usize>,
        /// Client weight α of the generated-latent cross-entropy, decaying 0.98 per round
        /// (default: 10; 0.2 for CIFAR-10).
        #[arg(long)]
        gen_alpha: Option<f64>,
        /// Client weight β of the latent KL term, decaying 0.98 per round (default: 10; 0.2 for
        /// CIFAR-10, 1 for CIFAR-100).
        #[arg(long)]
        gen_beta: Option<f64>,
    },
    /// Plot test accuracy (or loss) against rounds for runs; a directory of runs (one per seed)
    /// is drawn as its mean with a ±1 std band.
    Plot {
        /// Run directories (or directories of runs).
        #[arg(required = true)]
        runs: Vec<PathBuf>,
        /// Output file: .png or .svg.
        #[arg(short, long, default_value = "curves.png")]
        out: PathBuf,
        /// What to plot.
        #[arg(long, value_enum, default_value = "accuracy")]
        metric: report::Metric,
        /// Title above the plot.
        #[arg(long, default_value = "")]
        title: String,
    },
    /// A paper-style table of runs: final and best accuracy (mean ± std over seeds), rounds to
    /// a target accuracy, total communication.
    Compare {
        /// Run directories (or directories of runs).
        #[arg(required = true)]
        runs: Vec<PathBuf>,
        /// Target accuracy for the rounds-to-target column (0-1).
        #[arg(long, default_value_t = 0.8)]
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
        /// Points per axis, odd.
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
        /// A seconds-long smoke run (2 clients × 1 epoch × 20 samples).
        #[arg(long)]
        quick: bool,
        /// Run Burn's own convolution, max-pool and BatchNorm instead of fl-models' CPU
        /// kernels (for an A/B comparison on flex).
        #[arg(long)]
        burn_kernels: bool,
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
        /// Fetch the canonical file names from this base URL instead (a local mirror).
        #[arg(long, value_name = "URL")]
        mirror: Option<String>,
        /// No progress bar (also automatic when stderr is not a terminal).
        #[arg(long)]
        quiet: bool,
    },
    /// List the models with their parameter counts and blocks for a dataset.
    Models {
        /// Dataset whose input shape and classes to use.
        #[arg(long, default_value = "fashion-mnist")]
        dataset: String,
    },
}

fn load_groups(dirs: &[PathBuf]) -> anyhow::Result<Vec<report::RunGroup>> {
    dirs.iter().map(|d| report::load_group(d)).collect()
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    log::init();
    let result = match cli.command {
        Command::Run { file, args } => run::from_file(&file, &args),
        Command::Fedavg { args, unweighted } => run::fedavg(&args, unweighted),
        Command::Fedmr { args, fedmr } => run::fedmr(&args, &fedmr),
        Command::Fedcross { args, cross } => run::fedcross(&args, &cross),
        Command::Fedindep { args } => run::fedindep(&args),
        Command::Fedprox { args, mu } => run::baseline(
            "fedprox",
            &args,
            &BaselineArgs {
                mu,
                ..Default::default()
            },
        ),
        Command::Scaffold { args, server_lr } => run::baseline(
            "scaffold",
            &args,
            &BaselineArgs {
                server_lr,
                ..Default::default()
            },
        ),
        Command::Fedavgm {
            args,
            server_momentum,
            server_lr,
        } => run::baseline(
            "fedavgm",
            &args,
            &BaselineArgs {
                server_momentum,
                server_lr,
                ..Default::default()
            },
        ),
        Command::Fedexp { args, epsilon } => run::baseline(
            "fedexp",
            &args,
            &BaselineArgs {
                epsilon,
                ..Default::default()
            },
        ),
        Command::Pfedclub { args, club } => personal::pfedclub(&args, &club),
        Command::Fedmut {
            args,
            mut_radius,
            mut_rate,
            mut_bound,
        } => run::baseline(
            "fedmut",
            &args,
            &BaselineArgs {
                mut_radius,
                mut_rate,
                mut_bound,
                ..Default::default()
            },
        ),
        Command::Moon { args, moon_mu, tau } => run::baseline(
            "moon",
            &args,
            &BaselineArgs {
                moon_mu,
                tau,
                ..Default::default()
            },
        ),
        Command::Fedasam {
            args,
            rho,
            eta,
            sam,
        } => run::baseline(
            "fedasam",
            &args,
            &BaselineArgs {
                rho,
                eta,
                sam,
                ..Default::default()
            },
        ),
        Command::Clusamp {
            args,
            cluster_distance,
            linkage,
        } => run::baseline(
            "clusamp",
            &args,
            &BaselineArgs {
                cluster_distance,
                linkage,
                ..Default::default()
            },
        ),
        Command::Fedgen {
            args,
            gen_noise,
            gen_lr,
            gen_steps,
            gen_alpha,
            gen_beta,
        } => run::baseline(
            "fedgen",
            &args,
            &BaselineArgs {
                gen_noise,
                gen_lr,
                gen_steps,
                gen_alpha,
                gen_beta,
                ..Default::default()
            },
        ),
        Command::Plot {
            runs,
            out,
            metric,
            title,
        } => load_groups(&runs).and_then(|g| plot::plot(&g, metric, &title, &out)),
        Command::Compare {
            runs,
            target,
            format,
        } => load_groups(&runs)
            .and_then(|g| report::compare_table(&g, target, format))
            .map(|table| print!("{table}")),
        Command::Models { dataset } => run::list_models(&dataset),
        Command::Download {
            dataset,
            dir,
            mirror,
            quiet,
        } => run::download(&dataset, dir, mirror.as_deref(), quiet),
        Command::Partition { run, image, args } => run::partition(run.as_deref(), &args, &image),
        Command::Bench {
            models,
            samples,
            clients,
            epochs,
            threads,
            quick,
            burn_kernels,
        } => models
            .iter()
            .map(|m| m.parse::<fl_models::ModelKind>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(anyhow::Error::from)
            .and_then(|models| {
                let threads = threads
                    .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
                let args = if quick {
                    bench::BenchArgs::quick(models, threads)
                } else {
                    bench::BenchArgs {
                        models,
                        samples,
                        clients,
                        epochs,
                        threads,
                    }
                };
                fl_models::kernels::set_enabled(!burn_kernels);
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
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
