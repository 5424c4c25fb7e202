//! `fl`: federated-learning simulations on Burn. See `fl --help`.

mod backend;
mod config;
mod run;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use config::{FedCrossArgs, FedMrArgs, RunArgs};

/// Federated-learning simulations (FedAvg, ...) on Burn, reproducible from a seed.
#[derive(Debug, Parser)]
#[command(name = "fl", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
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
    /// List the models with their parameter counts and blocks for a dataset.
    Models {
        /// Dataset whose input shape and classes to use.
        #[arg(long, default_value = "fashion-mnist")]
        dataset: String,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Logs go to stderr, filtered by RUST_LOG (default: warnings only), e.g. RUST_LOG=info.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Fedavg { args, unweighted } => run::fedavg(&args, unweighted),
        Command::Fedmr { args, fedmr } => run::fedmr(&args, &fedmr),
        Command::Fedcross { args, cross } => run::fedcross(&args, &cross),
        Command::Fedindep { args } => run::fedindep(&args),
        Command::Models { dataset } => run::list_models(&dataset),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
