//! `fl`: federated-learning simulations on Burn. See `fl --help`.

mod backend;
mod config;
mod run;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

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
    /// FedAvg (McMahan et al. 2017): clients train the global model, the server averages them.
    Fedavg {
        #[command(flatten)]
        args: Box<RunArgs>,
        /// Average uploads with equal weights instead of by sample counts.
        #[arg(long)]
        unweighted: bool,
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
    let result = match cli.command {
        Command::Fedavg { args, unweighted } => run::fedavg(&args, unweighted),
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
