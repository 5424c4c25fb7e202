//! Running an algorithm from a resolved [`RunConfig`].

use std::io::IsTerminal;
use std::path::Path;

use anyhow::{Context, bail};
use burn::module::Module;
use burn::tensor::Device;
use fl_core::rng::{Purpose, derive_seed};
use fl_core::strategy::FineTune;
use fl_core::strategy::Strategy;
use fl_core::{Classifier, ClientModels, EngineConfig, RoundMetrics, Simulation};
use fl_data::{FederatedDataset, Partition, load_dataset};
use fl_models::{ModelKind, with_model};
use indicatif::{ProgressBar, ProgressStyle};

use crate::algorithms::{Algorithm, pfedclub};
use crate::backend;
use crate::config::{PartitionKind, RunArgs, RunConfig, RunSettings};
use crate::personal::{personal_data, write_split};
use crate::rundir::{RunDir, write_run_files};

/// `fl ALGORITHM` (with the subcommand's algorithm) and `fl run FILE` (`command = None`: the
/// file's algorithm): resolves the configuration, or takes a resumed run's, checks it and runs
/// it once, or once per seed of `--seeds` (each into its own `sSEED` folder, afresh).
pub fn start(command: Option<&Algorithm>, args: &RunArgs) -> anyhow::Result<()> {
    let (cfg, resume) = resolve(command, args)?;
    check(&cfg)?;
    if !resume {
        cfg.check_flags(args)?;
    }
    let Some(seeds) = &args.seeds else {
        return run_one(&cfg, resume, args.quiet);
    };
    if let Some(seed) = crate::config::first_repeated(seeds) {
        bail!("--seeds lists {seed} twice: both runs would share one directory");
    }
    let r = &cfg.run;
    let base = r.out.clone().unwrap_or_else(|| {
        Path::new("runs").join(format!("{}-{}-{}", cfg.label(), r.dataset, r.model))
    });
    for &seed in seeds {
        let mut cfg = cfg.clone();
        cfg.run.seed = seed;
        cfg.run.out = Some(base.join(format!("s{seed}")));
        run_one(&cfg, false, args.quiet)?;
    }
    Ok(())
}

/// Checks a configuration's settings before any data is read.
pub fn check(cfg: &RunConfig) -> anyhow::Result<()> {
    cfg.run.dataset_kind()?;
    if !matches!(cfg.algorithm, Algorithm::Pfedclub(_)) {
        cfg.run.model_kind()?;
    }
    cfg.algorithm.settings().check(&cfg.run)?;
    if cfg.run.personal {
        crate::personal::check(&cfg.run)?;
    }
    // The engine's settings too, but for two that only the data or the machine that runs the
    // configuration can tell (a sweep's cell may run on a cluster): the clients to sample from
    // and the thread bound. The engine checks those itself.
    let engine = EngineConfig {
        threads: 1,
        ..cfg.run.engine()
    };
    engine.validate(usize::MAX)?;
    Ok(())
}

/// The configuration of a new run, or of the resumed run in `--resume DIR` (whose
/// `config.toml` wins; only `--rounds` may extend it, and `--threads`, `--parallel-clients`
/// and `--gradient-checkpointing` may change).
fn resolve(command: Option<&Algorithm>, args: &RunArgs) -> anyhow::Result<(RunConfig, bool)> {
    let Some(dir) = &args.resume else {
        return Ok((RunConfig::resolve(command, args)?, false));
    };
    if !dir.join("config.toml").exists() {
        // A directory of runs (--seeds, a sweep cell): say which to resume.
        let mut runs: Vec<_> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.join("config.toml").is_file())
            .collect();
        runs.sort();
        if let Some(first) = runs.first() {
            bail!(
                "{} holds {} runs, not one: resume each, e.g. --resume {}",
                dir.display(),
                runs.len(),
                first.display()
            );
        }
    }
    let mut cfg = RunConfig::from_file(&dir.join("config.toml"))
        .with_context(|| format!("{} is not a run directory", dir.display()))?;
    if let Some(command) = command
        && command.name() != cfg.algorithm.name()
    {
        bail!(
            "{} is a '{}' run, not '{}'",
            dir.display(),
            cfg.algorithm.name(),
            command.name()
        );
    }
    if args.given.iter().any(|id| {
        !(["resume", "quiet"].contains(&id.as_str())
            || RunSettings::RESUMABLE.contains(&id.as_str()))
    }) {
        eprintln!(
            "warning: --resume continues with {}/config.toml; other settings given are ignored",
            dir.display()
        );
    }
    cfg.run.resume_with(&args.settings, |id| args.given(id));
    cfg.run.out = Some(dir.clone());
    Ok((cfg, true))
}

/// Builds the data, the model(s) and the strategy a configuration names, and runs them on
/// the engine: global algorithms here, pFedClub through [`pfedclub::run_one`].
pub fn run_one(cfg: &RunConfig, resume: bool, quiet: bool) -> anyhow::Result<()> {
    let quiet = quiet || !std::io::stdout().is_terminal();
    let data = load_dataset(cfg.run.dataset_kind()?, cfg.run.data_dir.as_deref())?;
    if data.origin == "embedded" {
        eprintln!(
            "note: using the embedded Fashion-MNIST copy (10k test images split 8,000/2,000); install dataset-fashion-mnist or pass --data-dir for the full set"
        );
    }
    if let Algorithm::Pfedclub(club) = &cfg.algorithm {
        return pfedclub::run_one(cfg, club, &data, resume, quiet);
    }
    let model_kind = cfg.run.model_kind()?;
    model_kind.check_input(data.train.image_shape())?;
    let mut cfg = cfg.clone();
    // With --personal, pFedClub's split: per-client test portions of the pooled data.
    let (data, partition, split) = if cfg.run.personal {
        let p = personal_data(&cfg.run, &data)?;
        (p.data, p.partition, Some(p.split))
    } else {
        let partition = build_partition(&mut cfg.run, &data)?;
        (data, partition, None)
    };
    cfg.run.settle_clients(partition.num_clients())?;
    let cfg = &cfg;
    let mut strategy = cfg.algorithm.settings().strategy(&cfg.run, &|| {
        partition.label_histogram(data.train.labels(), data.train.num_classes())
    })?;
    let dir = RunDir::open(cfg, resume, &partition, data.train.len())?;
    let out = dir.path.clone();
    if !resume {
        write_run_files(cfg, &out, &data, &partition, serde_json::Map::new())?;
        if let Some(split) = &split {
            write_split(&out, split)?;
        }
    }
    let fine_tune = (cfg.run.fine_tune_steps > 0).then_some(FineTune {
        steps: cfg.run.fine_tune_steps,
        lr: cfg.run.lr,
        proximal: None,
    });
    let ad = backend::training_device(cfg.run.gradient_checkpointing.unwrap_or(false));
    let init = backend::init_device().autodiff();
    init.seed(derive_seed(cfg.run.seed, Purpose::Init, 0, 0));
    let (shape, classes) = (data.train.image_shape(), data.train.num_classes());
    with_model!(model_kind, shape, classes, &init, |model| {
        // Initialised on the CPU, trained on the run's device: one seed, one start everywhere.
        // Burn initialises parameters lazily, on the device they are on at first use: read them
        // here, or moving would only retarget them and the run's device would draw them.
        let model = if init == ad {
            model
        } else {
            fl_core::ParamTable::from_module(&model);
            model.to_device(&ad)
        };
        let template = model.clone();
        let build = move |_: usize| template.clone();
        let sim = Simulation {
            model,
            data: &data,
            partition: &partition,
            config: cfg.run.engine(),
            out_dir: Some(out.clone()),
            objective: None,
            clients: split.as_ref().map(|s| ClientModels {
                build: &build,
                tests: &s.test,
                fine_tune,
            }),
            stop: Some(crate::interrupt::flag()),
        };
        simulate(&sim, cfg, resume, quiet, strategy.as_mut())
    })
}

/// Runs a prepared simulation with a progress bar, `log.txt` and a closing line.
pub fn simulate<M: Classifier>(
    sim: &Simulation<'_, M>,
    cfg: &RunConfig,
    resume: bool,
    quiet: bool,
    strategy: &mut dyn Strategy,
) -> anyhow::Result<()> {
    let out = cfg.out_dir();
    let bar = round_bar(cfg.run.rounds, quiet);
    let what = if sim.clients.is_some() {
        "mean client acc"
    } else {
        "test acc"
    };
    let on_round = |m: &RoundMetrics| {
        bar.set_position(m.round as u64);
        if let Some(acc) = m.test_acc {
            bar.set_message(format!("{what} {:.2}%", 100.0 * acc));
        }
        tracing::info!(round = m.round, test_acc = ?m.test_acc, train_loss = m.train_loss, "round done");
    };
    crate::log::open_run_log(&out)
        .with_context(|| format!("cannot write {}", out.join(crate::log::LOG_FILE).display()))?;
    if !quiet {
        eprintln!("backend: {} ({:?})", backend::label(), backend::device());
    }
    tracing::info!(
        backend = %backend::label(),
        algorithm = %cfg.label(),
        dataset = %sim.data.name,
        model = %cfg.run.model,
        seed = cfg.run.seed,
        rounds = cfg.run.rounds,
        resume,
        out = %out.display(),
        "run started"
    );
    let resume_command = format!("fl {} --resume {}", cfg.algorithm.name(), out.display());
    crate::interrupt::set_resume_command(Some(resume_command.clone()));
    // A resumed run's new settings go into config.toml once the engine has taken the
    // resume (its first round), and again at the end for a run that had nothing left to do.
    let record = || {
        if resume {
            crate::rundir::record_resumed_settings(cfg, &out)
        } else {
            Ok(())
        }
    };
    let mut new_rounds = 0;
    let result = sim.run(strategy, resume, &mut |m| {
        new_rounds += 1;
        if new_rounds == 1
            && let Err(e) = record()
        {
            tracing::warn!("{e:#}");
        }
        on_round(m)
    });
    crate::interrupt::set_resume_command(None);
    match &result {
        Ok(s) => tracing::info!(rounds = s.rounds.len(), "run finished"),
        // For log.txt only: main prints the error itself.
        Err(e) => tracing::error!(target: crate::log::RUN_ONLY, "run failed: {e}"),
    }
    crate::log::close_run_log();
    let summary = match result {
        Err(fl_core::EngineError::Interrupted(round)) => {
            bar.abandon();
            record()?;
            return Err(crate::interrupt::Interrupted {
                round,
                resume: resume_command,
            }
            .into());
        }
        r => r?,
    };
    record()?;
    if resume && new_rounds == 0 {
        eprintln!(
            "note: {} has already finished its {} rounds; extend it with --rounds N",
            out.display(),
            cfg.run.rounds
        );
    }
    bar.finish_and_clear();
    if !quiet {
        let best = summary
            .rounds
            .iter()
            .filter_map(|m| m.test_acc)
            .fold(0.0f64, f64::max);
        if let Some(last) = summary.rounds.iter().rev().find_map(|m| m.test_acc) {
            let what = if sim.clients.is_some() {
                "mean client accuracy"
            } else {
                "test accuracy"
            };
            println!(
                "{}: final {what} {:.2}%, best {:.2}% after {} rounds; results in {}",
                cfg.label(),
                100.0 * last,
                100.0 * best,
                cfg.run.rounds,
                out.display()
            );
        }
    }
    Ok(())
}

/// The rounds progress bar (hidden when quiet).
pub fn round_bar(rounds: usize, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    ProgressBar::new(rounds as u64).with_style(
        ProgressStyle::with_template(
            "{bar:30} round {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .expect("valid template"),
    )
}

/// The run's partition: `--partition-file`, the dataset's natural split, or a seeded draw.
/// A partition file's SHA-256 is recorded in `cfg` (and must match one recorded before).
fn build_partition(cfg: &mut RunSettings, data: &FederatedDataset) -> anyhow::Result<Partition> {
    // The natural partition comes with the data (FEMNIST writers); the others are drawn.
    let scheme = cfg.partition_scheme()?;
    Ok(match &cfg.partition_file {
        Some(path) => {
            let sha = fl_data::download::sha256_of(path)?;
            if let Some(recorded) = &cfg.partition_sha256
                && *recorded != sha
            {
                bail!(
                    "{} changed since the run was configured (SHA-256 {sha}, recorded {recorded})",
                    path.display()
                );
            }
            cfg.partition_sha256 = Some(sha);
            let p = Partition::load(path)?;
            if cfg.clients != 0 && p.num_clients() != cfg.clients {
                bail!(
                    "{} has {} clients, but --clients is {}",
                    path.display(),
                    p.num_clients(),
                    cfg.clients
                );
            }
            p
        }
        None => match scheme {
            None => natural_partition(data, cfg.clients, cfg.min_writer_samples)?,
            Some(scheme) => Partition::new(
                &scheme,
                data.train.labels(),
                data.train.num_classes(),
                cfg.clients,
                derive_seed(cfg.seed, Purpose::Partition, 0, 0),
            )?,
        },
    })
}

/// `fl partition`: draws a run's partition (with `run`) or the one the flags would draw.
pub fn partition(run: Option<&Path>, args: &RunArgs, image: &Path) -> anyhow::Result<()> {
    // A run's flags either draw a fresh partition or, with --run, contradict the run's own.
    for flag in &args.given {
        let flag = flag.replace('_', "-");
        match (flag.as_str(), run) {
            ("out", _) => bail!("--out does not apply to fl partition (the image: -o/--image)"),
            ("resume", _) => bail!("--resume does not apply to fl partition (a run's: --run DIR)"),
            ("run" | "image" | "quiet", _) => {}
            (_, Some(dir)) => bail!(
                "--{flag} does not apply with --run: it draws {}'s own partition",
                dir.display()
            ),
            _ => {}
        }
    }
    let config = match run {
        Some(dir) => RunConfig::from_file(&dir.join("config.toml"))
            .with_context(|| format!("{} is not a run directory", dir.display()))?,
        None => RunConfig::resolve(Some(&Algorithm::with_defaults("fedavg")?), args)?,
    };
    let cfg = &config.run;
    let data = load_dataset(cfg.dataset_kind()?, cfg.data_dir.as_deref())?;
    // A personalised run's clients train on their portions of the pooled samples (train and
    // test sets), which its partition indexes.
    let (data, drawn) = if config.is_personal() {
        let p = personal_data(cfg, &data)?;
        (p.data, Some(p.partition))
    } else {
        (data, None)
    };
    let partition = match (run, drawn) {
        (Some(dir), _) => {
            let p = Partition::load(&dir.join("partition.json"))?;
            p.validate(data.train.len())?;
            p
        }
        (None, Some(drawn)) => drawn,
        (None, None) => build_partition(&mut cfg.clone(), &data)?,
    };
    let scheme = match cfg.partition {
        PartitionKind::Dirichlet => format!("Dirichlet {}", cfg.alpha),
        PartitionKind::DirichletBalanced => format!("balanced Dirichlet {}", cfg.alpha),
        PartitionKind::Pathological => format!("{} classes per client", cfg.classes_per_client),
        PartitionKind::Iid => "IID".into(),
        PartitionKind::Natural => "natural".into(),
        PartitionKind::File => "from a file".into(),
    };
    let title = format!(
        "{}: {} clients, {scheme}, seed {}",
        data.name,
        partition.num_clients(),
        cfg.seed
    );
    crate::partition::draw_partition(&data, &partition, &title, image)
}

/// The dataset's own split (FEMNIST: one client per writer), limited to the first `clients`
/// (all of them for 0).
fn natural_partition(
    data: &FederatedDataset,
    clients: usize,
    min_samples: usize,
) -> anyhow::Result<Partition> {
    let Some(writers) = &data.natural_clients else {
        bail!(
            "--partition natural needs a dataset with its own client split (femnist); {} has none",
            data.name
        );
    };
    // The FedMR paper's FEMNIST keeps the writers with enough samples (LEAF's `-k`).
    let writers: Vec<&Vec<usize>> = writers.iter().filter(|w| w.len() >= min_samples).collect();
    let which = if min_samples > 0 {
        format!("writers with at least {min_samples} training samples")
    } else {
        "writers".into()
    };
    if writers.is_empty() || clients > writers.len() {
        bail!(
            "--clients {clients} is more than the {} {which} {} has",
            writers.len(),
            data.name
        );
    }
    let clients = if clients == 0 { writers.len() } else { clients };
    let partition = Partition {
        clients: writers[..clients].iter().map(|w| w.to_vec()).collect(),
    };
    partition.validate(data.train.len())?;
    Ok(partition)
}

/// `fl models`: for `dataset`'s input shape and classes, read from `data_dir` where the
/// dataset has no fixed ones (image folders).
pub fn list_models(dataset: &str, data_dir: Option<&Path>) -> anyhow::Result<()> {
    let kind: fl_data::DatasetKind = dataset.parse()?;
    let (shape, classes) = match (kind.image_shape(), kind.num_classes()) {
        (Some(_), Some(_)) if data_dir.is_some() => {
            bail!("--data-dir applies only to --dataset image-folder: {kind}'s shape is fixed")
        }
        (Some(shape), Some(classes)) => (shape, classes),
        _ => {
            let Some(dir) = data_dir else {
                bail!(
                    "{kind} has no fixed image shape: pass --data-dir DIR to read it from the folder"
                );
            };
            let data = load_dataset(kind, Some(dir))?;
            (data.train.image_shape(), data.train.num_classes())
        }
    };
    let device: Device = backend::device();
    for &m in ModelKind::all() {
        if m.check_input(shape).is_err() {
            let min = m.min_side();
            println!(
                "{:<12} needs images of at least {min}×{min} pixels",
                m.name()
            );
            continue;
        }
        let (params, blocks) = with_model!(m, shape, classes, &device, |model| (
            fl_core::ParamTable::from_module(&model).num_trainable(),
            model.blocks()
        ));
        println!("{:<12} {:>10} parameters", m.name(), params);
        for b in blocks {
            println!(
                "  {:<10} {:?} -> {:?}",
                b.name, b.input_shape, b.output_shape
            );
        }
    }
    Ok(())
}

/// A progress bar per downloaded file.
struct DownloadBar {
    bar: Option<ProgressBar>,
    quiet: bool,
}

impl fl_data::download::Progress for DownloadBar {
    fn start(&mut self, name: &str, size: u64) {
        if self.quiet {
            return;
        }
        let bar = ProgressBar::new(size).with_style(
            ProgressStyle::with_template("{msg:28} {bar:30} {bytes}/{total_bytes} [{eta_precise}]")
                .expect("valid template"),
        );
        bar.set_message(name.to_string());
        self.bar = Some(bar);
    }

    fn advance(&mut self, bytes: u64) {
        if let Some(bar) = &self.bar {
            bar.inc(bytes);
        }
    }

    fn finish(&mut self, name: &str) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        if !self.quiet {
            eprintln!("{name}: verified");
        }
    }
}

/// `fl download`.
pub fn download(
    dataset: &str,
    dir: Option<std::path::PathBuf>,
    mirror: Option<&str>,
    quiet: bool,
) -> anyhow::Result<()> {
    let kind: fl_data::DatasetKind = dataset.parse()?;
    let mut files = fl_data::download::sources(kind)?;
    if let Some(base) = mirror {
        match fl_data::download::local_path(base) {
            Some(path) if !path.is_dir() => {
                bail!("--mirror {base}: no such directory")
            }
            None if !(base.starts_with("http://") || base.starts_with("https://")) => {
                bail!(
                    "--mirror must be an http://, https:// or file:// URL or a directory, got {base}"
                )
            }
            _ => {}
        }
        files = files.iter().map(|f| f.from_mirror(base)).collect();
    }
    let dir = match dir {
        Some(d) => d,
        None => fl_data::download::default_dir(kind)
            .context("no home directory for the cache; pass --dir")?,
    };
    if dir.exists() && !dir.is_dir() {
        bail!("--dir {}: not a directory", dir.display());
    }
    let quiet = quiet || !std::io::stderr().is_terminal();
    fl_data::download::download(&files, &dir, &mut DownloadBar { bar: None, quiet })?;
    println!("{kind}: files verified in {}", dir.display());
    Ok(())
}
