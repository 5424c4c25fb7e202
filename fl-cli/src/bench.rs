//! `fl bench`: throughput of local training and evaluation per model, the wall time of one
//! FedMR round in the paper's setting, server-side table operations and peak memory, as a
//! Markdown table. Timings are measured, never asserted (CI runs `fl bench --quick` as a smoke
//! test).

use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use burn::tensor::Device;
use fl_core::Classifier;
use fl_core::layers::{Granularity, ParamTable, recombine};
use fl_core::trainer::{LocalTask, TrainConfig, evaluate, train_local};
use fl_data::{Dataset, Normalization};
use fl_models::kernels::Kernel;
use fl_models::{ModelKind, with_model};
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

use crate::backend;
use crate::config::RunConfig;

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchArgs {
    /// Models to measure.
    pub models: Vec<ModelKind>,
    /// Samples per client (the FedMR paper's clients hold about 500 CIFAR images).
    pub samples: usize,
    /// Clients per round (K).
    pub clients: usize,
    /// Local epochs per round.
    pub epochs: usize,
    /// Worker threads (clients trained in parallel).
    pub threads: usize,
    /// Input shape `[channels, height, width]` of the synthetic images.
    pub input: [usize; 3],
    /// Train with Burn's balanced gradient checkpointing (`--gradient-checkpointing`).
    pub gradient_checkpointing: bool,
}

/// Parses `CxHxW` (e.g. `1x28x28`) for `fl bench --input`: 1–16 channels, sides of 16–256
/// pixels.
pub fn parse_input_shape(text: &str) -> Result<[usize; 3], String> {
    let dims: Vec<usize> = text
        .split('x')
        .map(|d| d.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .map_err(|_| format!("'{text}' is not CxHxW (e.g. 3x32x32)"))?;
    // Every model accepts 16×16 (VGG-16's five pools need it) and up.
    match dims[..] {
        [c, h, w]
            if (1..=16).contains(&c) && (16..=256).contains(&h) && (16..=256).contains(&w) =>
        {
            Ok([c, h, w])
        }
        _ => Err(format!(
            "'{text}' is not CxHxW with 1-16 channels and sides of 16-256 pixels (e.g. 1x28x28)"
        )),
    }
}

/// The kernel families `fl bench --burn-kernels` switches to Burn's own ops.
#[derive(Debug, Clone, PartialEq)]
pub struct BurnKernels(pub Vec<Kernel>);

impl BurnKernels {
    /// Switches these kernels off for the whole process (the others stay on).
    pub fn apply(&self) {
        fl_models::kernels::set_enabled(true);
        for &k in &self.0 {
            fl_models::kernels::set_kernel_enabled(k, false);
        }
    }
}

/// Parses `--burn-kernels`' value: `all` or a comma-separated list of kernel names.
pub fn parse_burn_kernels(text: &str) -> Result<BurnKernels, String> {
    if text == "all" {
        return Ok(BurnKernels(Kernel::ALL.to_vec()));
    }
    let mut kernels: Vec<Kernel> = Vec::new();
    for name in text.split(',') {
        let k: Kernel = name.trim().parse()?;
        if !kernels.contains(&k) {
            kernels.push(k);
        }
    }
    Ok(BurnKernels(kernels))
}

/// What the run uses, for the header line.
fn kernels_in_use() -> String {
    // fl-models' kernels are CPU code for flex tensors; other backends run Burn's throughout.
    if backend::name() != "flex" {
        return "Burn's own kernels".into();
    }
    let off: Vec<&str> = Kernel::ALL
        .into_iter()
        .filter(|&k| !fl_models::kernels::kernel_enabled(k))
        .map(Kernel::name)
        .collect();
    match off.len() {
        0 => "fl-models kernels where they apply".into(),
        n if n == Kernel::ALL.len() => "Burn's own kernels".into(),
        _ => format!(
            "fl-models kernels where they apply, Burn's for {}",
            off.join(", ")
        ),
    }
}

impl BenchArgs {
    /// A seconds-long smoke configuration.
    pub fn quick(models: Vec<ModelKind>, threads: usize) -> Self {
        Self {
            models,
            samples: 20,
            clients: 2,
            epochs: 1,
            threads,
            input: [3, 32, 32],
            gradient_checkpointing: false,
        }
    }
}

/// One model's measurements.
struct Row {
    model: ModelKind,
    params: usize,
    /// One client on one thread.
    train_one_thread_per_s: f64,
    /// One client with the whole pool (the backend's intra-op parallelism).
    train_per_s: f64,
    eval_per_s: f64,
    round_s: f64,
    round_per_s: f64,
    recombine_ms: f64,
    average_ms: f64,
    mix_ms: f64,
    copy_ms: f64,
}

/// Runs the benchmark and prints the table.
pub fn bench(args: &BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.samples > 0 && args.clients > 0 && args.epochs > 0,
        "--samples, --clients and --epochs must be at least 1"
    );
    fl_core::engine::check_threads(args.threads).map_err(|m| anyhow::anyhow!("--threads {m}"))?;
    if let Some(m) = crate::config::first_repeated(&args.models) {
        anyhow::bail!("--models lists {m} twice");
    }
    for model in &args.models {
        model.check_input(args.input)?;
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(args.threads)
        .build()
        .context("thread pool")?;
    let device = backend::device();
    let [c, h, w] = args.input;
    let data = synthetic(args.samples * args.clients, args.input, 10);
    let norm = Normalization {
        mean: vec![0.5; c],
        std: vec![0.25; c],
    };
    println!(
        "backend {} ({}), {} threads; {c}×{h}×{w} inputs, 10 classes, batch 50, SGD lr 0.01 \
         momentum 0.5; a round = {} clients × {} epochs × {} samples",
        backend::label(),
        kernels_in_use(),
        args.threads,
        args.clients,
        args.epochs,
        args.samples
    );
    let mut rows = Vec::new();
    for &model in &args.models {
        let ad = backend::training_device(args.gradient_checkpointing);
        ad.seed(1);
        let row = with_model!(model, args.input, 10, &ad, |m| pool
            .install(|| measure(model, m, &data, &norm, args, &device)))?;
        rows.push(row);
    }
    println!(
        "\n| model | params | train samples/s (1 client, 1 thread) | train samples/s (1 client, {} threads) | eval samples/s | FedMR round (s) | round samples/s (K clients, {} threads) | recombine K (ms) | average K (ms) | α-mix (ms) | copy K once (ms) |",
        args.threads, args.threads
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.0} | {:.2} | {:.0} | {:.3} | {:.2} | {:.3} | {:.2} |",
            r.model,
            r.params,
            r.train_one_thread_per_s,
            r.train_per_s,
            r.eval_per_s,
            r.round_s,
            r.round_per_s,
            r.recombine_ms,
            r.average_ms,
            r.mix_ms,
            r.copy_ms
        );
    }
    match peak_rss_mib() {
        Some(mib) => println!("\npeak RSS: {mib:.0} MiB"),
        None => println!("\npeak RSS: not available on this platform"),
    }
    Ok(())
}

fn measure<M: Classifier>(
    kind: ModelKind,
    model: M,
    data: &Dataset,
    norm: &Normalization,
    args: &BenchArgs,
    device: &Device,
) -> anyhow::Result<Row> {
    let start = ParamTable::from_module(&model);
    let params = start.num_trainable();
    let cfg = TrainConfig {
        local_epochs: 1,
        batch_size: 50,
        lr: 0.01,
        momentum: 0.5,
        weight_decay: 0.0,
        ..TrainConfig::default()
    };
    let client = |c: usize, cfg: &TrainConfig| {
        let indices: Vec<usize> = (c * args.samples..(c + 1) * args.samples).collect();
        train_local(
            LocalTask {
                template: model.clone(),
                start: start.clone(),
                data,
                norm,
                indices: &indices,
                client: c,
                round: 1,
                seed: 1,
                objective: None,
                state: None,
                personal_template: None,
            },
            cfg,
        )
    };
    // Warm-up (allocations, kernel selection), then one client alone: on one thread, and with
    // the whole pool (the backend's operations split across its threads). The engine runs
    // clients as tasks of that same pool, so it gets client-level parallelism when K ≥ threads
    // and intra-op parallelism otherwise, without a switch.
    // Timed over three epochs: one epoch of a small client is too short to time reliably.
    client(0, &cfg)?;
    let timed = TrainConfig {
        local_epochs: 3,
        ..cfg
    };
    let one_thread = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .context("thread pool")?;
    let t = Instant::now();
    one_thread.install(|| client(0, &timed))?;
    let train_one_thread_per_s = 3.0 * args.samples as f64 / t.elapsed().as_secs_f64();
    let t = Instant::now();
    client(0, &timed)?;
    let train_per_s = 3.0 * args.samples as f64 / t.elapsed().as_secs_f64();

    let eval_data = data.subset(&(0..args.samples).collect::<Vec<_>>());
    // Warm-up, as for training (and as the PyTorch comparator does): the first pass at the
    // evaluation batch size allocates and faults in its buffers.
    evaluate(&model, &eval_data, norm, 500);
    let t = Instant::now();
    evaluate(&model, &eval_data, norm, 500);
    let eval_per_s = args.samples as f64 / t.elapsed().as_secs_f64();

    // One FedMR round: K clients in parallel, then recombination.
    let round_cfg = TrainConfig {
        local_epochs: args.epochs,
        ..cfg
    };
    let t = Instant::now();
    let uploads: Vec<ParamTable> = (0..args.clients)
        .into_par_iter()
        .map(|c| client(c, &round_cfg).map(|u| u.table))
        .collect::<Result<_, _>>()?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    recombine(&uploads, Granularity::Tensor, &mut rng)?;
    let round_s = t.elapsed().as_secs_f64();
    let round_per_s = (args.clients * args.epochs * args.samples) as f64 / round_s;

    // Server-side operations on K device tables (host-resident for the CPU backends).
    let tables: Vec<ParamTable> = (0..args.clients)
        .map(|k| start.scale(1.0 + k as f64 * 1e-3))
        .collect();
    let time_ms = |f: &mut dyn FnMut() -> anyhow::Result<()>| -> anyhow::Result<f64> {
        f()?; // warm-up
        let reps = 5;
        let t = Instant::now();
        for _ in 0..reps {
            f()?;
        }
        Ok(t.elapsed().as_secs_f64() * 1e3 / reps as f64)
    };
    // FedMR's recombination (moves tensor handles), FedAvg's average, FedCross's α-mix.
    let recombine_ms = time_ms(&mut || {
        // Results stay alive across the sync, so lazy backends cannot skip the work.
        let _recombined = recombine(&tables, Granularity::Tensor, &mut rng)?;
        sync(device)
    })?;
    let average_ms = time_ms(&mut || {
        let _average = ParamTable::average(&tables, None)?;
        sync(device)
    })?;
    let mix_ms = time_ms(&mut || {
        let _mixed = tables[0].mix(&tables[1 % tables.len()], 0.99)?;
        sync(device)
    })?;
    // The reference: materialising a copy of every byte of the K tables once.
    let copy_ms = time_ms(&mut || {
        let _copies: Vec<ParamTable> = tables.iter().map(|t| t.scale(1.0)).collect();
        sync(device)
    })?;
    Ok(Row {
        model: kind,
        params,
        train_one_thread_per_s,
        train_per_s,
        eval_per_s,
        round_s,
        round_per_s,
        recombine_ms,
        average_ms,
        mix_ms,
        copy_ms,
    })
}

/// Waits for queued device work (a no-op cost on the eager CPU backends).
fn sync(device: &Device) -> anyhow::Result<()> {
    device
        .sync()
        .map_err(|e| anyhow::anyhow!("device sync: {e:?}"))
}

/// Random images and labels in the dataset format (speed does not depend on content).
fn synthetic(n: usize, shape: [usize; 3], classes: usize) -> Dataset {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let pixels = n * shape.iter().product::<usize>();
    let images: Vec<u8> = (0..pixels).map(|_| rng.random()).collect();
    let labels: Vec<u16> = (0..n)
        .map(|_| rng.random_range(0..classes as u16))
        .collect();
    Dataset::new(images, labels, shape, classes).expect("consistent synthetic data")
}

/// `fl bench --round CONFIG`: one round of the run `config` describes (rounds set to 1, run in
/// a fresh temporary directory), timed by the run's own metrics: local training, the server
/// step (with pFedClub's phases) and evaluation, then the process's peak RSS, which covers the
/// dataset, every persistent client model and the server step.
pub fn bench_round(config: &Path, threads: Option<usize>) -> anyhow::Result<()> {
    let mut table = crate::config::read_table(config)?;
    let out = std::env::temp_dir().join(format!("fl-bench-round-{}", std::process::id()));
    table.insert("rounds".into(), 1.into());
    table.insert("out".into(), out.display().to_string().into());
    if let Some(t) = threads {
        table.insert("threads".into(), (t as i64).into());
    }
    let cfg = RunConfig::from_table(&mut table)
        .with_context(|| format!("invalid config {}", config.display()))?;
    let result = crate::run::run_one(&cfg, false, true).and_then(|()| {
        let metrics = std::fs::read_to_string(out.join("metrics.jsonl"))?;
        let first = metrics
            .lines()
            .next()
            .context("the round wrote no metrics")?;
        Ok(serde_json::from_str::<serde_json::Value>(first)?)
    });
    std::fs::remove_dir_all(&out).ok();
    let m = result?;
    let seconds = |key: &str| m[key].as_f64().unwrap_or(0.0);
    println!(
        "one round of {} ({}, {} threads, backend {}, {})\n",
        config.display(),
        cfg.label(),
        cfg.run.threads,
        backend::label(),
        kernels_in_use()
    );
    println!("| part | seconds |\n|---|---|");
    println!("| local training | {:.2} |", seconds("train_seconds"));
    println!("| server step | {:.2} |", seconds("aggregate_seconds"));
    if let Some(phases) = m["phase_seconds"].as_object() {
        for (phase, s) in phases {
            println!("| server: {phase} | {:.2} |", s.as_f64().unwrap_or(0.0));
        }
    }
    println!("| evaluation | {:.2} |", seconds("eval_seconds"));
    match peak_rss_mib() {
        Some(mib) => println!("\npeak RSS: {mib:.0} MiB"),
        None => println!("\npeak RSS: not available on this platform"),
    }
    Ok(())
}

/// Peak resident set size of this process (Linux `VmHWM`).
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// The 3×3 and 5×5 stride-1 convolutions of the FedMR CNN, the FedAvg CNN, ResNet-20 and
/// VGG-16 on 3×32×32 inputs, one row per distinct shape, their 1×28×28 maps where the kernel
/// paths differ (the FedMR and FedAvg CNNs' unpadded 24×24 and 8×8, ResNet-20's and VGG-16's 7×7,
/// VGG-16's 3×3 and 1×1), and pFedClub's CNN1–CNN4
/// layers at 3×32×32 and where their kernel paths differ at 1×28×28, MobileNetV1's pointwise
/// (1×1) layers, one per map size, and MobileNetV2's narrow ones on 32×32 maps (24 ↔ 144
/// channels: gemm's products with a short side), the pointwise layers of `resnet20-ref`'s
/// bottlenecks on 32×32 maps and its 1×28×28 maps, and the stride-2 layers of both ResNet-20s.
/// `[c_in, c_out, size, kernel, padding, stride]`. A first layer's input gradient is never
/// computed in training; its row still times one.
#[cfg(feature = "flex")]
const KERNEL_SHAPES: [(&str, [usize; 6]); 55] = [
    ("cnn conv1", [3, 6, 32, 5, 0, 1]),
    ("cnn conv2", [6, 16, 14, 5, 0, 1]),
    ("cnn conv1 (1×28×28)", [1, 16, 28, 5, 0, 1]),
    ("cnn conv2 (1×28×28)", [16, 32, 12, 5, 0, 1]),
    ("cnn-fedavg conv1", [3, 32, 32, 5, 0, 1]),
    ("cnn-fedavg conv2", [32, 64, 14, 5, 0, 1]),
    ("cnn-fedavg conv1 (1×28×28)", [1, 32, 28, 5, 0, 1]),
    ("cnn-fedavg conv2 (1×28×28)", [32, 64, 12, 5, 0, 1]),
    ("resnet20 stage 1", [16, 16, 32, 3, 1, 1]),
    ("resnet20 stage 2", [32, 32, 16, 3, 1, 1]),
    ("resnet20 stage 3", [64, 64, 8, 3, 1, 1]),
    ("resnet20 stage 1 (1×28×28)", [16, 16, 28, 3, 1, 1]),
    ("resnet20 stage 2 (1×28×28)", [32, 32, 14, 3, 1, 1]),
    ("resnet20 stage 3 (1×28×28)", [64, 64, 7, 3, 1, 1]),
    ("vgg16 block 1", [64, 64, 32, 3, 1, 1]),
    ("vgg16 block 2", [128, 128, 16, 3, 1, 1]),
    ("vgg16 block 3", [256, 256, 8, 3, 1, 1]),
    ("vgg16 block 2 (1×28×28)", [128, 128, 14, 3, 1, 1]),
    ("vgg16 block 3 (1×28×28)", [256, 256, 7, 3, 1, 1]),
    ("vgg16 block 4", [512, 512, 4, 3, 1, 1]),
    ("vgg16 block 5", [512, 512, 2, 3, 1, 1]),
    ("vgg16 block 4 (1×28×28)", [512, 512, 3, 3, 1, 1]),
    ("vgg16 block 5 (1×28×28)", [512, 512, 1, 3, 1, 1]),
    ("cnn1–cnn4 conv1", [3, 32, 32, 5, 2, 1]),
    ("cnn4 conv2", [32, 32, 32, 3, 1, 1]),
    ("cnn4 conv3", [32, 64, 16, 3, 1, 1]),
    ("cnn4 conv4", [64, 64, 16, 5, 2, 1]),
    ("cnn4 conv5", [64, 128, 8, 3, 1, 1]),
    ("cnn4 conv6", [128, 128, 8, 3, 1, 1]),
    ("cnn1/cnn2 conv2", [32, 64, 16, 5, 2, 1]),
    ("cnn2 conv3", [64, 128, 8, 5, 2, 1]),
    ("cnn3 conv2 (1×28×28)", [32, 64, 14, 5, 2, 1]),
    ("cnn4 conv2 (1×28×28)", [32, 32, 28, 3, 1, 1]),
    ("cnn4 conv4 (1×28×28)", [64, 64, 14, 5, 2, 1]),
    ("cnn3 conv4", [128, 128, 8, 5, 2, 1]),
    ("cnn3 conv4 (1×28×28)", [128, 128, 7, 5, 2, 1]),
    ("cnn3 conv5", [128, 256, 4, 5, 2, 1]),
    ("cnn3 conv5 (1×28×28)", [128, 256, 3, 5, 2, 1]),
    ("mobilenet-v1 pw1", [32, 64, 32, 1, 0, 1]),
    ("mobilenet-v1 pw3", [128, 128, 16, 1, 0, 1]),
    ("mobilenet-v1 pw5", [256, 256, 8, 1, 0, 1]),
    ("mobilenet-v1 pw5 (1×28×28)", [256, 256, 7, 1, 0, 1]),
    ("mobilenet-v1 pw7–pw11", [512, 512, 4, 1, 0, 1]),
    ("mobilenet-v1 pw13", [1024, 1024, 2, 1, 0, 1]),
    ("mobilenet-v2 pw expand (32×32)", [24, 144, 32, 1, 0, 1]),
    ("mobilenet-v2 pw project (32×32)", [144, 24, 32, 1, 0, 1]),
    ("resnet20-ref pw 16→64 (32×32)", [16, 64, 32, 1, 0, 1]),
    ("resnet20-ref pw 64→16 (32×32)", [64, 16, 32, 1, 0, 1]),
    ("resnet20-ref pw 128→32 (1×28×28)", [128, 32, 14, 1, 0, 1]),
    ("resnet20-ref pw 64→256 (1×28×28)", [64, 256, 7, 1, 0, 1]),
    ("resnet20 stride 2 (32×32 → 16×16)", [16, 32, 32, 3, 1, 2]),
    ("resnet20 stride 2 (16×16 → 8×8)", [32, 64, 16, 3, 1, 2]),
    (
        "resnet20-ref stride 2 (32×32 → 16×16)",
        [32, 32, 32, 3, 1, 2],
    ),
    ("resnet20-ref stride 2 (16×16 → 8×8)", [64, 64, 16, 3, 1, 2]),
    (
        "resnet20-ref shortcut stride 2 (32×32 → 16×16)",
        [64, 128, 32, 1, 0, 2],
    ),
];

/// The models' large fully connected layers (`d_in → d_out`), one row per distinct shape:
/// CNN1's, CNN2's, CNN4's and the FedAvg CNN's first FC layer at 3×32×32 (and CNN2's at
/// 1×28×28), VGG-16's 4096 → 4096 and CNN3's second.
#[cfg(feature = "flex")]
const LINEAR_SHAPES: [(&str, [usize; 2]); 7] = [
    ("cnn1/cnn3 fc1", [4096, 512]),
    ("cnn-fedavg fc1", [1600, 512]),
    ("cnn2 fc1", [8192, 512]),
    ("cnn2 fc1 (1×28×28)", [6272, 512]),
    ("cnn4 fc1", [2048, 512]),
    ("cnn3/cnn4 fc2", [512, 256]),
    ("vgg16 fc2", [4096, 4096]),
];

/// The MobileNets' depthwise layers `(channels, size, kernel, stride)` at 3×32×32 (and where
/// their maps differ, 1×28×28): one per map size, kernel and stride, large maps to the
/// smallest.
#[cfg(feature = "flex")]
const DEPTHWISE_SHAPES: [(&str, [usize; 4]); 18] = [
    ("mobilenet-v2 dw (144 @ 32×32)", [144, 32, 3, 1]),
    ("mobilenet-v1 dw1 (stride 2)", [64, 32, 3, 2]),
    ("mobilenet-v1 dw1 (1×28×28, stride 2)", [64, 28, 3, 2]),
    ("mobilenet-v2 dw (144 @ 32×32, stride 2)", [144, 32, 3, 2]),
    ("mobilenet-v1 dw2", [128, 16, 3, 1]),
    ("mobilenet-v1 dw2 (1×28×28)", [128, 14, 3, 1]),
    ("mobilenet-v1 dw3 (stride 2)", [128, 16, 3, 2]),
    ("mobilenet-v1 dw3 (1×28×28, stride 2)", [128, 14, 3, 2]),
    ("mobilenet-v1 dw4", [256, 8, 3, 1]),
    ("mobilenet-v1 dw5 (stride 2)", [256, 8, 3, 2]),
    ("mobilenet-v1 dw4 (1×28×28)", [256, 7, 3, 1]),
    ("mobilenet-v1 dw5 (1×28×28, stride 2)", [256, 7, 3, 2]),
    ("mobilenet-v1 dw6–dw10", [512, 4, 3, 1]),
    ("mobilenet-v1 dw12", [1024, 2, 3, 1]),
    ("mobilenet-v2 dw (576 @ 8×8)", [576, 8, 3, 1]),
    ("mobilenet-v2 dw (960 @ 4×4)", [960, 4, 3, 1]),
    ("mobilenet-v3 dw (240 @ 4×4, 5×5)", [240, 4, 5, 1]),
    ("mobilenet-v3 dw (576 @ 2×2, 5×5)", [576, 2, 5, 1]),
];

/// `fl bench --kernels`: the thread pool's multiply-add peak, then each convolution shape's
/// forward pass and gradients in GFLOP/s and as a share of that peak (batch 50, as training).
/// With `layers`, only the shapes whose name contains one of them.
pub fn bench_kernels(threads: Option<usize>, layers: &[String]) -> anyhow::Result<()> {
    #[cfg(feature = "flex")]
    {
        use fl_models::kernels::roofline::{
            ConvShape, DepthwiseShape, conv_rates, depthwise_rates, fma_peak_gflops, linear_rates,
        };
        let threads = threads.unwrap_or_else(crate::config::default_threads);
        fl_core::engine::check_threads(threads).map_err(|m| anyhow::anyhow!("--threads {m}"))?;
        let chosen =
            |name: &str| layers.is_empty() || layers.iter().any(|l| name.contains(l.as_str()));
        anyhow::ensure!(
            KERNEL_SHAPES.iter().any(|(name, _)| chosen(name))
                || LINEAR_SHAPES.iter().any(|(name, _)| chosen(name))
                || DEPTHWISE_SHAPES.iter().any(|(name, _)| chosen(name)),
            "--layers {}: no layer of `fl bench --kernels` matches",
            layers.join(",")
        );
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .context("thread pool")?;
        let peak = pool.install(|| fma_peak_gflops(1.0));
        match peak {
            Some(p) => println!(
                "multiply-add peak: {p:.0} GFLOP/s on {threads} threads ({:.0} per thread; \
                 fused multiply-adds in {} registers, 2 FLOPs per lane)",
                p / threads as f64,
                if fl_models::kernels::Isa::active() == fl_models::kernels::Isa::Avx512 {
                    "AVX-512"
                } else {
                    "AVX2"
                }
            ),
            None => println!("multiply-add peak: not measured (no AVX2/FMA on this CPU)"),
        }
        let share = |rate: f64| match peak {
            Some(p) => format!("{rate:.0} ({:.0}%)", 100.0 * rate / p),
            None => format!("{rate:.0}"),
        };
        let convs: Vec<_> = KERNEL_SHAPES
            .iter()
            .filter(|(name, _)| chosen(name))
            .collect();
        if !convs.is_empty() {
            println!(
                "\nConvolution rates count every tap, padding included (the usual convention); \
                 where some taps read only the zero padding, the second share is the rate of \
                 the taps that read the input (what a kernel skipping zero products computes, \
                 and what the training table's GFLOP/sample counts) against the peak.\n\n\
                 | layer | c_in→c_out @ size, kernel | taps reading the input | kernel path | forward GFLOP/s (% of peak) | input gradient | weight gradient |"
            );
            println!("|---|---|---|---|---|---|---|");
        }
        for &&(name, [c_in, c_out, size, kernel, padding, stride]) in &convs {
            let shape = ConvShape {
                c_in,
                c_out,
                size,
                kernel,
                padding,
                stride,
            };
            let r = pool.install(|| conv_rates(shape, 50, 0.5));
            // Each pass's kernels, named once where the next pass runs the same.
            let mut path = r.path.to_string();
            if r.input_grad_path != r.path {
                path += &format!("; input gradient: {}", r.input_grad_path);
            }
            if r.weight_grad_path != r.input_grad_path {
                path += &format!("; weight gradient: {}", r.weight_grad_path);
            }
            let valid = shape.valid_share();
            let cell = |rate: f64| match peak {
                Some(p) if valid < 1.0 => format!(
                    "{rate:.0} ({:.0}%; {:.0}% on those taps)",
                    100.0 * rate / p,
                    100.0 * rate * valid / p
                ),
                _ => share(rate),
            };
            let stride = if stride > 1 {
                format!(", stride {stride}")
            } else {
                String::new()
            };
            println!(
                "| {name} | {c_in}→{c_out} @ {size}×{size}, {kernel}×{kernel}{stride} | {:.0}% | {path} | {} | {} | {} |",
                100.0 * valid,
                cell(r.forward),
                cell(r.input_grad),
                cell(r.weight_grad)
            );
        }
        let linear: Vec<_> = LINEAR_SHAPES
            .iter()
            .filter(|(name, _)| chosen(name))
            .collect();
        if !linear.is_empty() {
            println!(
                "\n| fully connected layer | d_in→d_out | forward GFLOP/s (% of peak) | input gradient | weight gradient |"
            );
            println!("|---|---|---|---|---|");
        }
        for (name, [d_in, d_out]) in linear {
            let r = pool.install(|| linear_rates(*d_in, *d_out, 50, 0.5));
            println!(
                "| {name} | {d_in}→{d_out} | {} | {} | {} |",
                share(r.forward),
                share(r.input_grad),
                share(r.weight_grad)
            );
        }
        let depthwise: Vec<_> = DEPTHWISE_SHAPES
            .iter()
            .filter(|(name, _)| chosen(name))
            .collect();
        if !depthwise.is_empty() {
            println!(
                "\n| depthwise layer | channels @ size, kernel, stride | path | forward GFLOP/s | input gradient | weight gradient | per-plane path: forward | input gradient | weight gradient |"
            );
            println!("|---|---|---|---|---|---|---|---|---|");
        }
        for (name, [channels, size, kernel, stride]) in depthwise {
            let shape = DepthwiseShape {
                channels: *channels,
                size: *size,
                kernel: *kernel,
                stride: *stride,
            };
            let r = pool.install(|| depthwise_rates(shape, 50, 0.5));
            let [f, i, w] = r.chosen.map(|v| format!("{v:.1}"));
            let [pf, pi, pw] = r.planes.map(|v| format!("{v:.1}"));
            println!(
                "| {name} | {channels} @ {size}×{size}, {kernel}×{kernel}, {stride} | {} | {f} | {i} | {w} | {pf} | {pi} | {pw} |",
                r.path
            );
        }
        Ok(())
    }
    #[cfg(not(feature = "flex"))]
    {
        let _ = (threads, layers);
        anyhow::bail!(
            "fl bench --kernels measures the flex backend's CPU kernels: build with the flex feature"
        )
    }
}
