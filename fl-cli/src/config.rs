//! The run configuration: the shared [`RunSettings`] plus the algorithm's typed settings
//! ([`Algorithm`]), from defaults, then the algorithm's paper defaults, then a TOML file
//! (`--config`), then the flags given on the command line.
//!
//! `config.toml` holds the run settings at the top, `algorithm = "NAME"` and the algorithm's
//! settings in a `[NAME]` section. Flat keys of the algorithm's own settings are accepted too
//! (short configs and run directories of earlier versions, which list every algorithm's
//! settings: those of other algorithms are ignored at their default values).

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use fl_core::{EngineConfig, TrainConfig};
use fl_data::{DatasetKind, PartitionScheme};
use fl_models::ModelKind;
use serde::{Deserialize, Serialize};
use toml::{Table, Value};

use crate::algorithms::{Algorithm, NAMES, defaults_from_flags, field_names, to_table};

/// How the training set is split among clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PartitionKind {
    /// Uniformly at random.
    Iid,
    /// Per-class Dirichlet shares (as the FedMR code).
    Dirichlet,
    /// Equal sizes with a per-client Dirichlet label mix (every client gets samples, for
    /// thousands of clients).
    DirichletBalanced,
    /// `--classes-per-client` distinct classes per client.
    Pathological,
    /// The dataset's own split (FEMNIST writers).
    Natural,
    /// A partition JSON file (`--partition-file`, e.g. another run's `partition.json`).
    File,
}

/// The settings every algorithm shares; the top of `config.toml`.
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunSettings {
    /// Dataset: fashion-mnist, mnist, cifar10, cifar100, cifar100-coarse, svhn, femnist,
    /// image-folder.
    #[arg(long, default_value = "fashion-mnist")]
    pub dataset: String,
    /// Directory with the dataset files (default: $FL_DATA_DIR, system paths, embedded copy).
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Model (see `fl models`).
    #[arg(long, default_value = "cnn")]
    pub model: String,
    /// Number of clients (0 with `--partition natural`: all of the dataset's).
    #[arg(long, default_value_t = 100)]
    pub clients: usize,
    /// Clients sampled per round.
    #[arg(long, default_value_t = 10)]
    pub sample: usize,
    /// Sample this fraction of the clients per round instead of --sample (at least one; the
    /// FedMR authors' `--frac`).
    #[arg(long, value_name = "F")]
    pub sample_fraction: Option<f64>,
    /// Number of rounds.
    #[arg(long, default_value_t = 50)]
    pub rounds: usize,
    /// Local epochs per round.
    #[arg(long, default_value_t = 5)]
    pub local_epochs: usize,
    /// Local mini-batch size.
    #[arg(long, default_value_t = 50)]
    pub batch_size: usize,
    /// Local learning rate.
    #[arg(long, default_value_t = 0.01)]
    pub lr: f64,
    /// Local SGD momentum (PyTorch semantics, no dampening).
    #[arg(long, default_value_t = 0.5)]
    pub momentum: f64,
    /// Local L2 weight decay.
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// Client partition.
    #[arg(long, value_enum, default_value = "dirichlet")]
    pub partition: PartitionKind,
    /// Pathological partition: distinct classes per client (pFedClub: 2).
    #[arg(long, value_name = "K", default_value_t = 2)]
    pub classes_per_client: usize,
    /// Dirichlet concentration (> 0; small is more skewed).
    #[arg(long, default_value_t = 0.5)]
    pub alpha: f64,
    /// Smallest client size a Dirichlet draw must give (redrawn until it does).
    #[arg(long, default_value_t = 10)]
    pub min_client_size: usize,
    /// With `--partition natural`: only writers with at least N training samples are clients
    /// (the FedMR paper's FEMNIST: the writers with more than 100 samples, LEAF's `-k 100`, which
    /// counts before LEAF's train/test split).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub min_writer_samples: usize,
    /// Use this partition JSON (as written to a run's partition.json) instead of drawing one.
    #[arg(long, value_name = "FILE")]
    pub partition_file: Option<PathBuf>,
    /// SHA-256 of `partition_file`, recorded when the run starts and checked when it is re-run.
    #[arg(skip)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partition_sha256: Option<String>,
    /// Run seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Evaluate every N rounds (and after the last).
    #[arg(long, default_value_t = 1)]
    pub eval_every: usize,
    /// Evaluation batch size.
    #[arg(long, default_value_t = 500)]
    pub eval_batch_size: usize,
    /// Evaluate per client, on pFedClub's split: the training and test sets are pooled and
    /// split into the clients' training portions, each client's own test portion and the
    /// server's public share; the metric is the mean over clients of the (optionally
    /// fine-tuned) global model on each client's test portion. pFedClub always uses this split.
    #[arg(long)]
    pub personal: bool,
    /// With the personal split: fraction of all samples held by the server as public data.
    #[arg(long, default_value_t = 0.08)]
    pub public_fraction: f64,
    /// With the personal split: fraction of all samples that form the clients' test portions.
    #[arg(long, default_value_t = 0.2)]
    pub test_fraction: f64,
    /// With the personal split: a random subset of this many pooled samples (quick studies).
    #[arg(long, value_name = "N")]
    pub max_samples: Option<usize>,
    /// With --personal: SGD steps at --lr on each client's training data before it evaluates
    /// the global model (the Per-FedAvg paper's protocol for FedAvg; 0: none).
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub fine_tune_steps: usize,
    /// Worker threads (default: all cores). Results do not depend on it.
    #[arg(long, default_value_t = default_threads())]
    pub threads: usize,
    /// At most N clients train at once (default: as many as threads run). Each holds its
    /// model's activations: 1 bounds local training's memory at one client's (pFedClub's Zoo I
    /// on MobileNets). Results do not depend on it.
    #[arg(long, value_name = "N")]
    pub parallel_clients: Option<usize>,
    /// Recompute each training batch norm's output in the backward pass instead of keeping it
    /// from the forward pass (Burn's balanced gradient checkpointing): the same results bit
    /// for bit, 20–40% less memory for training ResNets and MobileNets, a few percent slower
    /// (default: on for pFedClub and its baselines, whose zoos train MobileNets side by side;
    /// off otherwise). Results do not depend on it.
    #[arg(long, value_name = "BOOL", action = clap::ArgAction::Set)]
    pub gradient_checkpointing: Option<bool>,
    /// Output directory (default: runs/ALGORITHM-DATASET-MODEL-sSEED).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
}

defaults_from_flags!(RunSettings);

/// The first item of `items` that an earlier one repeats (a model or seed listed twice).
pub(crate) fn first_repeated<T: PartialEq + Copy>(items: &[T]) -> Option<T> {
    (1..items.len()).find_map(|i| items[..i].contains(&items[i]).then_some(items[i]))
}

/// The first line at which two configurations' TOML texts differ, if any does.
pub(crate) fn first_difference<'a>(a: &'a str, b: &'a str) -> Option<(&'a str, &'a str)> {
    a.lines().zip(b.lines()).find(|(x, y)| x != y)
}

/// All cores: the default of `--threads`.
pub(crate) fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The flags of every algorithm subcommand: the run settings plus how to run.
#[derive(Debug, Clone, Default, Args)]
pub struct RunArgs {
    /// TOML file with any settings (flags given on the command line win).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Continue the killed or finished run in DIR (its config.toml is used; `--rounds` may
    /// extend it).
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// No progress bar or summary (also automatic when stdout is not a terminal).
    #[arg(long)]
    pub quiet: bool,
    /// Run once per seed (comma-separated), each into OUT/sSEED; `fl plot` and `fl compare`
    /// summarise OUT as mean ± std.
    #[arg(long, value_delimiter = ',', value_name = "SEED,...", conflicts_with_all = ["seed", "resume"])]
    pub seeds: Option<Vec<u64>>,
    /// The run settings.
    #[command(flatten)]
    pub settings: RunSettings,
    /// The ids of the flags given on the command line (filled after parsing): only they
    /// override the config file.
    #[arg(skip)]
    pub given: Vec<String>,
}

impl RunArgs {
    /// Whether the flag `id` was given on the command line.
    pub fn given(&self, id: &str) -> bool {
        self.given.iter().any(|g| g == id)
    }
}

/// Everything that defines a run; written to `config.toml` in the run directory.
#[derive(Debug, Clone, PartialEq)]
pub struct RunConfig {
    /// The shared settings.
    pub run: RunSettings,
    /// The algorithm and its settings.
    pub algorithm: Algorithm,
}

impl RunConfig {
    /// Defaults, then the algorithm's paper defaults, then `--config`, then the flags given.
    /// `command` is the subcommand's algorithm with its flags' values; `None` takes the config
    /// file's (`fl run FILE`).
    pub fn resolve(command: Option<&Algorithm>, args: &RunArgs) -> anyhow::Result<Self> {
        let (mut file, file_algorithm) = match &args.config {
            Some(path) => {
                let mut table = read_table(path)?;
                let name = take_algorithm(&mut table)
                    .with_context(|| format!("invalid config {}", path.display()))?;
                (table, name)
            }
            None => (Table::new(), None),
        };
        let name = match (command, &file_algorithm) {
            (Some(a), _) => a.name().to_string(),
            (None, Some(n)) => n.clone(),
            (None, None) => "fedavg".to_string(),
        };
        if let (Some(path), Some(other)) = (&args.config, &file_algorithm)
            && *other != name
        {
            // Another algorithm's file: its run settings apply, its own settings do not.
            let theirs = Algorithm::with_defaults(other)?;
            file.remove(other.as_str());
            for key in theirs.field_names() {
                file.remove(&key);
            }
            eprintln!(
                "note: {} configures {other}; its {other} settings do not apply to {name}",
                path.display()
            );
        }
        let invalid = || match &args.config {
            Some(path) => format!("invalid config {}", path.display()),
            None => "invalid settings".into(),
        };
        // The file's settings (its own flat keys moved into the section), then the flags given.
        let mut section =
            split_section(&mut file, &Algorithm::with_defaults(&name)?).with_context(invalid)?;
        for (key, value) in to_table(&args.settings) {
            if args.given(&key) {
                file.insert(key, value);
            }
        }
        if let Some(command) = command {
            for (key, value) in command.section() {
                if args.given(&key) {
                    section.insert(key, value);
                }
            }
        }
        file.insert(name.clone(), Value::Table(section));
        file.insert("algorithm".into(), name.into());
        Self::from_table(&mut file).with_context(invalid)
    }

    /// Reads a run's `config.toml` (or any config file, as written).
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let mut table = read_table(path)?;
        Self::from_table(&mut table).with_context(|| format!("invalid config {}", path.display()))
    }

    /// Reads a configuration table (as a config file's).
    pub fn from_table(table: &mut Table) -> anyhow::Result<Self> {
        let name = take_algorithm(table)?.unwrap_or_else(|| "fedavg".into());
        let defaults = Algorithm::with_defaults(&name)?;
        let mut section = split_section(table, &defaults)?;
        // Earlier versions kept the personal split's settings in [pfedclub]; a value given at
        // the top (a flag) wins.
        for key in ["public_fraction", "test_fraction", "max_samples"] {
            if name == "pfedclub"
                && let Some(value) = section.remove(key)
            {
                table.entry(key).or_insert(value);
            }
        }
        let mut run = defaults.settings().run_defaults();
        run.extend(std::mem::take(table));
        let mut cfg = Self {
            run: run.try_into().map_err(toml_error)?,
            algorithm: Algorithm::from_section(&name, section)?,
        };
        cfg.settle();
        Ok(cfg)
    }

    /// Fills the algorithm's run-dependent defaults; a partition file is the partition.
    fn settle(&mut self) {
        if self.run.partition_file.is_some() {
            self.run.partition = PartitionKind::File;
        }
        self.algorithm.settings_mut().settle(&mut self.run);
    }

    /// Refuses flags given on the command line that this run would ignore (a setting of another
    /// partition scheme, a FedMR option of a mode not chosen): never silently accepted.
    pub fn check_flags(&self, args: &RunArgs) -> anyhow::Result<()> {
        use crate::algorithms::fedmr::Unit;
        let r = &self.run;
        let p = r.partition;
        let partition = p.to_possible_value().expect("named");
        let partition = partition.get_name();
        let drawing =
            |ok: bool| (!ok).then(|| format!("does not apply to --partition {partition}"));
        let only_with = |ok: bool, needs: &str| (!ok).then(|| format!("applies only with {needs}"));
        let problem = |flag: &str| match flag {
            "alpha" => drawing(matches!(
                p,
                PartitionKind::Dirichlet | PartitionKind::DirichletBalanced
            )),
            "min_client_size" => drawing(p == PartitionKind::Dirichlet),
            "classes_per_client" => drawing(p == PartitionKind::Pathological),
            "min_writer_samples" => drawing(p == PartitionKind::Natural),
            "segment_fraction" => only_with(
                matches!(&self.algorithm, Algorithm::Fedmr(s) if s.granularity == Unit::Segments),
                "--granularity segments",
            ),
            "secure_passes" => only_with(
                matches!(&self.algorithm, Algorithm::Fedmr(s) if s.secure),
                "--secure",
            ),
            "public_fraction" | "test_fraction" | "max_samples" | "fine_tune_steps" => {
                only_with(self.is_personal(), "--personal")
            }
            // The K models are scored on the shared test set, which a per-client run lacks.
            "eval_models" => r
                .personal
                .then(|| "does not apply to --personal".to_string()),
            _ => None,
        };
        for flag in &args.given {
            if let Some(why) = problem(flag) {
                bail!("--{} {why}", flag.replace('_', "-"));
            }
        }
        Ok(())
    }

    /// The configuration as `config.toml` text.
    pub fn to_toml(&self) -> String {
        let mut table = Table::new();
        let name = self.algorithm.name();
        table.insert("algorithm".into(), name.into());
        let mut run = to_table(&self.run);
        if self.run.partition == PartitionKind::File {
            // Only the file defines the partition: leave out the drawing settings.
            for unused in ["alpha", "min_client_size", "classes_per_client"] {
                run.remove(unused);
            }
        }
        table.extend(run);
        let section = self.algorithm.section();
        if !section.is_empty() {
            table.insert(name.into(), Value::Table(section));
        }
        toml::to_string(&table).expect("a TOML table serialises")
    }

    /// Whether clients keep personal models, evaluated on their own test portions of the
    /// pooled data (pFedClub, `--personal`): the partition then indexes the pooled samples.
    pub fn is_personal(&self) -> bool {
        self.run.personal || matches!(self.algorithm, Algorithm::Pfedclub(_))
    }

    /// The run's label in directory names and summaries (pFedClub's variant).
    pub fn label(&self) -> &'static str {
        match &self.algorithm {
            Algorithm::Pfedclub(s) => s.variant.label(),
            a => a.name(),
        }
    }

    /// The output directory.
    pub fn out_dir(&self) -> PathBuf {
        let r = &self.run;
        r.out.clone().unwrap_or_else(|| {
            PathBuf::from("runs").join(format!(
                "{}-{}-{}-s{}",
                self.label(),
                r.dataset,
                r.model,
                r.seed
            ))
        })
    }
}

/// Reads a TOML file into a table.
pub fn read_table(path: &Path) -> anyhow::Result<Table> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read config {}", path.display()))?;
    text.parse::<Table>().map_err(|e| {
        // One line: where, and what (the TOML error's own text draws the line with a caret).
        let at = e.span().map_or(String::new(), |span| {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            format!(" at line {line}, column {column}")
        });
        anyhow::anyhow!(
            "invalid config {}{at}: {}",
            path.display(),
            e.message().trim().replace('\n', "; ")
        )
    })
}

/// A settings table's type error on one line ("invalid type: …, expected usize in `clients`").
pub fn toml_error(e: toml::de::Error) -> anyhow::Error {
    let text = e.to_string();
    let words: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    anyhow::anyhow!(words.join(" "))
}

/// Removes and returns the table's `algorithm` key.
fn take_algorithm(table: &mut Table) -> anyhow::Result<Option<String>> {
    match table.remove("algorithm") {
        None => Ok(None),
        Some(Value::String(name)) => {
            Algorithm::with_defaults(&name)?;
            Ok(Some(name))
        }
        Some(other) => bail!("`algorithm` must be a name, got {other}"),
    }
}

/// Takes the algorithm's settings out of `table`: its `[NAME]` section and any flat keys of
/// its own. Flat keys of other algorithms at their defaults are dropped (earlier versions
/// wrote every algorithm's settings); anything else of another algorithm is an error.
fn split_section(table: &mut Table, algorithm: &Algorithm) -> anyhow::Result<Table> {
    let name = algorithm.name();
    let mut section = match table.remove(name) {
        None => Table::new(),
        Some(Value::Table(t)) => t,
        Some(_) => bail!("`{name}` must be a [{name}] section"),
    };
    let own = algorithm.field_names();
    let run_fields = field_names::<RunSettings>();
    let keys: Vec<String> = table.keys().cloned().collect();
    for key in keys {
        if run_fields.contains(&key) {
            continue;
        }
        if own.contains(&key) {
            let value = table.remove(&key).expect("listed");
            if section.insert(key.clone(), value).is_some() {
                bail!("`{key}` is set both at the top and in [{name}]");
            }
            continue;
        }
        if NAMES.contains(&key.as_str()) {
            bail!("a [{key}] section does not apply to algorithm {name}");
        }
        for other in NAMES.iter().filter(|&&n| n != name) {
            let theirs = Algorithm::with_defaults(other)?;
            if theirs.field_names().contains(&key) {
                if theirs.section().get(&key) != table.get(&key) {
                    bail!("`{key}` is a {other} setting; this config runs {name}");
                }
                table.remove(&key);
                break;
            }
        }
    }
    Ok(section)
}

impl RunSettings {
    /// The settings a resumed run may change (by flag id); everything else comes from its
    /// `config.toml`. Results do not depend on the thread count, so a run may continue on
    /// another machine.
    pub const RESUMABLE: [&str; 4] = [
        "rounds",
        "threads",
        "parallel_clients",
        "gradient_checkpointing",
    ];

    /// Takes from `other` those of [`Self::RESUMABLE`] for which `given` is true.
    pub fn resume_with(&mut self, other: &RunSettings, given: impl Fn(&str) -> bool) {
        if given("rounds") {
            self.rounds = other.rounds;
        }
        if given("threads") {
            self.threads = other.threads;
        }
        if given("parallel_clients") {
            self.parallel_clients = other.parallel_clients;
        }
        if given("gradient_checkpointing") {
            self.gradient_checkpointing = other.gradient_checkpointing;
        }
    }

    /// Fixes the client count (`clients = 0` with the natural partition: all of the dataset's
    /// clients) and the per-round sample (`sample_fraction`) once the partition has
    /// `num_clients` clients.
    pub fn settle_clients(&mut self, num_clients: usize) -> anyhow::Result<()> {
        self.clients = num_clients;
        if let Some(f) = self.sample_fraction {
            if !(f > 0.0 && f <= 1.0) {
                bail!("--sample-fraction must be in (0, 1], got {f}");
            }
            self.sample = ((f * num_clients as f64).floor() as usize).max(1);
        }
        Ok(())
    }

    /// The dataset kind.
    pub fn dataset_kind(&self) -> anyhow::Result<DatasetKind> {
        Ok(self.dataset.parse()?)
    }

    /// The model kind.
    pub fn model_kind(&self) -> anyhow::Result<ModelKind> {
        Ok(self.model.parse()?)
    }

    /// The partition scheme (`None`: the dataset's natural split or a partition file, which are
    /// not drawn).
    pub fn partition_scheme(&self) -> anyhow::Result<Option<PartitionScheme>> {
        let alpha = || {
            if !(self.alpha.is_finite() && self.alpha > 0.0) {
                bail!("--alpha must be a positive number, got {}", self.alpha);
            }
            Ok(self.alpha)
        };
        Ok(Some(match self.partition {
            PartitionKind::Iid => PartitionScheme::Iid,
            PartitionKind::Dirichlet => PartitionScheme::Dirichlet {
                alpha: alpha()?,
                min_size: self.min_client_size,
            },
            PartitionKind::DirichletBalanced => {
                PartitionScheme::BalancedDirichlet { alpha: alpha()? }
            }
            PartitionKind::Pathological => PartitionScheme::Pathological {
                classes_per_client: self.classes_per_client,
            },
            PartitionKind::Natural => return Ok(None),
            PartitionKind::File if self.partition_file.is_none() => {
                bail!("--partition file needs --partition-file FILE")
            }
            PartitionKind::File => return Ok(None),
        }))
    }

    /// The engine settings.
    pub fn engine(&self) -> EngineConfig {
        EngineConfig {
            sample: self.sample,
            rounds: self.rounds,
            eval_every: self.eval_every,
            seed: self.seed,
            threads: self.threads,
            parallel_clients: self.parallel_clients,
            eval_batch_size: self.eval_batch_size,
            train: TrainConfig {
                local_epochs: self.local_epochs,
                batch_size: self.batch_size,
                lr: self.lr,
                momentum: self.momentum,
                weight_decay: self.weight_decay,
                ..TrainConfig::default()
            },
        }
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
