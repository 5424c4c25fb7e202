//! The algorithm registry: every algorithm's typed settings, one file each, listed once in
//! `registry!` below.
//!
//! An algorithm's settings struct is at the same time its command-line flags (clap), its
//! `[name]` section of `config.toml` (serde) and its defaults (the flags' defaults, so
//! `--help`, a config file that leaves a key out and `config.toml` agree). [`Settings`] checks
//! the values and builds the strategy. Adding an algorithm: its strategy in `fl-core`, its
//! settings file here (copy `fedprox.rs`), one line in `registry!`.

pub mod clusamp;
pub mod fedasam;
pub mod fedavg;
pub mod fedavgm;
pub mod fedcross;
pub mod fedexp;
pub mod fedgen;
pub mod fedmr;
pub mod fedmut;
pub mod fedprox;
pub mod moon;
pub mod perfedavg;
pub mod pfedbayes;
pub mod pfedclub;
pub mod pfedme;
pub mod scaffold;

use std::fmt::Debug;

use anyhow::bail;
use clap::{Args, FromArgMatches, Subcommand};
use fl_core::Strategy;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::config::{RunArgs, RunSettings};

pub use clusamp::ClusampSettings;
pub use fedasam::FedAsamSettings;
pub use fedavg::{FedAvgSettings, FedIndepSettings};
pub use fedavgm::FedAvgMSettings;
pub use fedcross::FedCrossSettings;
pub use fedexp::FedExpSettings;
pub use fedgen::FedGenSettings;
pub use fedmr::FedMrSettings;
pub use fedmut::FedMutSettings;
pub use fedprox::FedProxSettings;
pub use moon::MoonSettings;
pub use perfedavg::PerFedAvgSettings;
pub use pfedbayes::PFedBayesSettings;
pub use pfedclub::PfedclubSettings;
pub use pfedme::PFedMeSettings;
pub use scaffold::ScaffoldSettings;

/// The clients' per-class sample counts, computed on demand (FedGen needs them).
pub type LabelCounts<'a> = &'a dyn Fn() -> Vec<Vec<usize>>;

/// An algorithm's typed settings.
pub trait Settings: Debug {
    /// Fills the settings whose defaults depend on the run (MOON's μ, FedGen's per-dataset
    /// values) and adjusts run settings the algorithm fixes, so `config.toml` records them.
    fn settle(&mut self, _run: &mut RunSettings) {}

    /// Run settings this algorithm's paper uses where neither the file nor a flag sets them.
    fn run_defaults(&self) -> toml::Table {
        toml::Table::new()
    }

    /// The strategy these settings describe, checked. Called with empty label counts to check
    /// the settings before any data is read.
    fn strategy(
        &self,
        run: &RunSettings,
        label_counts: LabelCounts<'_>,
    ) -> anyhow::Result<Box<dyn Strategy>>;

    /// Checks the settings before any data is read.
    fn check(&self, run: &RunSettings) -> anyhow::Result<()> {
        self.strategy(run, &Vec::new).map(drop)
    }
}

/// A subcommand's flags: the shared run flags plus the algorithm's own.
#[derive(Debug, Clone, Args)]
pub struct AlgorithmArgs<S: Args> {
    /// The shared run flags.
    #[command(flatten)]
    pub run: RunArgs,
    /// The algorithm's flags.
    #[command(flatten)]
    pub settings: S,
}

/// Serialises settings to a TOML table (unset options are left out).
pub fn to_table<T: Serialize>(value: &T) -> toml::Table {
    toml::Table::try_from(value).expect("settings serialise to a TOML table")
}

/// The values of `S`'s flags when none is given: its defaults.
pub fn flag_defaults<S: Args + FromArgMatches>() -> S {
    let cmd = S::augment_args(clap::Command::new("defaults").no_binary_name(true));
    let matches = cmd.get_matches_from(std::iter::empty::<String>());
    S::from_arg_matches(&matches).expect("every flag has a default")
}

/// The field names of `S` (its flags' ids, which are also its TOML keys).
pub fn field_names<S: Args>() -> Vec<String> {
    S::augment_args(clap::Command::new("fields"))
        .get_arguments()
        .map(|a| a.get_id().to_string())
        .collect()
}

/// Parses a value of a serde enum by its name (e.g. `in-order`), for flags.
pub fn parse_name<T: DeserializeOwned>(s: &str) -> Result<T, String> {
    use serde::de::IntoDeserializer;
    let de: serde::de::value::StrDeserializer<'_, serde::de::value::Error> = s.into_deserializer();
    T::deserialize(de).map_err(|e| e.to_string())
}

/// `Default` for a settings struct: its flags' defaults.
macro_rules! defaults_from_flags {
    ($($t:ty),* $(,)?) => {$(
        impl Default for $t {
            fn default() -> Self {
                $crate::algorithms::flag_defaults()
            }
        }
    )*};
}
pub(crate) use defaults_from_flags;

macro_rules! registry {
    ($( $(#[$doc:meta])* $variant:ident($settings:ty) = $name:literal, )*) => {
        /// An algorithm with its settings.
        #[derive(Debug, Clone, PartialEq)]
        pub enum Algorithm {
            $( $(#[$doc])* $variant($settings), )*
        }

        /// The algorithm subcommands.
        #[derive(Debug, Subcommand)]
        pub enum AlgorithmCommand {
            $( $(#[$doc])* #[command(name = $name)] $variant(Box<AlgorithmArgs<$settings>>), )*
        }

        /// Every algorithm's name.
        pub const NAMES: &[&str] = &[$($name),*];

        impl AlgorithmCommand {
            /// The shared flags and the algorithm with its flags' values.
            pub fn into_parts(self) -> (RunArgs, Algorithm) {
                match self {
                    $( Self::$variant(a) => (a.run, Algorithm::$variant(a.settings)), )*
                }
            }

            /// The shared flags.
            pub fn run_args_mut(&mut self) -> &mut RunArgs {
                match self {
                    $( Self::$variant(a) => &mut a.run, )*
                }
            }
        }

        impl Algorithm {
            /// The algorithm's name (its subcommand and `algorithm` key).
            pub fn name(&self) -> &'static str {
                match self {
                    $( Self::$variant(_) => $name, )*
                }
            }

            /// The named algorithm with default settings.
            pub fn with_defaults(name: &str) -> anyhow::Result<Self> {
                Ok(match name {
                    $( $name => Self::$variant(<$settings>::default()), )*
                    other => bail!("unknown algorithm '{other}' (known: {})", NAMES.join(", ")),
                })
            }

            /// The settings as the algorithm's `config.toml` section.
            pub fn section(&self) -> toml::Table {
                match self {
                    $( Self::$variant(s) => to_table(s), )*
                }
            }

            /// The algorithm named `name` with the settings of its `config.toml` section.
            pub fn from_section(name: &str, section: toml::Table) -> anyhow::Result<Self> {
                Ok(match name {
                    $( $name => Self::$variant(section.try_into().map_err(crate::config::toml_error)?), )*
                    other => bail!("unknown algorithm '{other}' (known: {})", NAMES.join(", ")),
                })
            }

            /// The names of the algorithm's settings.
            pub fn field_names(&self) -> Vec<String> {
                match self {
                    $( Self::$variant(_) => field_names::<$settings>(), )*
                }
            }

            /// The settings' behaviour.
            pub fn settings(&self) -> &dyn Settings {
                match self {
                    $( Self::$variant(s) => s, )*
                }
            }

            /// The settings' behaviour, mutably.
            pub fn settings_mut(&mut self) -> &mut dyn Settings {
                match self {
                    $( Self::$variant(s) => s, )*
                }
            }
        }
    };
}

registry! {
    /// FedAvg (McMahan et al. 2017): clients train the global model, the server averages them.
    Fedavg(FedAvgSettings) = "fedavg",
    /// FedMR (Hu et al. 2024): K models, recombined layer-wise across clients every round.
    Fedmr(FedMrSettings) = "fedmr",
    /// FedCross (Hu et al. 2024): K models, each fused with a collaborative partner every round.
    Fedcross(FedCrossSettings) = "fedcross",
    /// FedIndep: K models trained independently, re-dispatched to random clients each round.
    Fedindep(FedIndepSettings) = "fedindep",
    /// FedProx (Li et al. 2020): FedAvg with the local proximal term (μ/2)·‖w − w_global‖².
    Fedprox(FedProxSettings) = "fedprox",
    /// SCAFFOLD (Karimireddy et al. 2020): control variates correct client drift.
    Scaffold(ScaffoldSettings) = "scaffold",
    /// FedAvgM (Hsu et al. 2019): FedAvg with server momentum.
    Fedavgm(FedAvgMSettings) = "fedavgm",
    /// FedExP (Jhunjhunwala et al. 2023): FedAvg with an extrapolated server step size.
    Fedexp(FedExpSettings) = "fedexp",
    /// FedMut (Hu et al. 2024): the global model is mutated into K models along its last update.
    Fedmut(FedMutSettings) = "fedmut",
    /// MOON (Li et al. 2021): FedAvg with a model-contrastive local loss.
    Moon(MoonSettings) = "moon",
    /// FedASAM (Caldarola et al. 2022): FedAvg with adaptive sharpness-aware local steps.
    Fedasam(FedAsamSettings) = "fedasam",
    /// Clustered sampling (Fraboni et al. 2021, Algorithm 2): clients clustered by the
    /// similarity of their updates, one sampled per cluster-based distribution.
    Clusamp(ClusampSettings) = "clusamp",
    /// FedGen (Zhu et al. 2021): a server-trained generator of latent features regularises
    /// the clients (data-free knowledge distillation).
    Fedgen(FedGenSettings) = "fedgen",
    /// pFedClub (Wang et al. 2024): personalised FL over heterogeneous model zoos by block
    /// substitution; also pFedHR-style reassembly, FedAvg per architecture and local training
    /// (`--variant`), and the paper's ablations.
    Pfedclub(PfedclubSettings) = "pfedclub",
    /// Per-FedAvg (Fallah et al. 2020): MAML-style local steps (first-order, or Hessian-free
    /// with --hessian-free); with --personal each client is evaluated after --eval-steps
    /// personalisation steps.
    Perfedavg(PerFedAvgSettings) = "perfedavg",
    /// pFedMe (T. Dinh et al. 2020): Moreau-envelope personalisation (λ, η_p, K inner steps),
    /// β-mixing server; with --personal each client is evaluated on its personalised model.
    Pfedme(PFedMeSettings) = "pfedme",
    /// pFedBayes (Zhang et al. 2022): variational Bayesian personalisation over mean-field
    /// Gaussian weights (ζ, η_p, K steps per batch), β-mixing server; with --personal each client
    /// is evaluated on its personalised posterior's mean.
    Pfedbayes(PFedBayesSettings) = "pfedbayes",
}

/// A check of a setting: `Ok` when `ok`, else the error `what`.
pub fn ensure(ok: bool, what: &str) -> anyhow::Result<()> {
    if ok { Ok(()) } else { bail!("{what}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_algorithm_setting_shares_a_name_with_a_run_setting() {
        let run = field_names::<RunSettings>();
        for name in NAMES {
            for field in Algorithm::with_defaults(name).unwrap().field_names() {
                assert!(!run.contains(&field), "{name}: {field}");
                assert!(!NAMES.contains(&field.as_str()), "{name}: {field}");
            }
        }
    }

    #[test]
    fn defaults_round_trip_through_toml() {
        for name in NAMES {
            let a = Algorithm::with_defaults(name).unwrap();
            let back = Algorithm::from_section(name, a.section()).unwrap();
            assert_eq!(back, a);
        }
    }
}
