//! `fl landscape`: the loss of a run's final global model on a 2-D plane through it, along two
//! random filter-normalised directions (Li et al. 2018; FedMR's Fig. 7), as a heat map and a CSV.

use std::path::Path;

use anyhow::{Context, anyhow, bail};
use fl_core::landscape::{LandscapePoint, filter_normalized_direction, loss_surface};
use fl_core::{Classifier, ParamTable};
use fl_data::load_dataset;
use fl_models::with_model;
use plotters::prelude::*;
use rand::SeedableRng;

use crate::algorithms::Algorithm;
use crate::backend;
use crate::config::RunConfig;

/// The most points per axis `--grid` takes.
pub const MAX_GRID: usize = 201;

/// What to compute.
#[derive(Debug, Clone)]
pub struct LandscapeArgs {
    /// Points per axis (odd, so the model itself is the centre).
    pub grid: usize,
    /// The plane covers `[-span, span]²` in units of the filter norms.
    pub span: f64,
    /// Test images evaluated per point (the first ones of the test set).
    pub samples: usize,
    /// Seed of the two directions.
    pub seed: u64,
}

/// Computes the landscape of `run`'s `model.bpk`, writes `out` (PNG) and the CSV next to it.
pub fn landscape(run: &Path, args: &LandscapeArgs, out: &Path) -> anyhow::Result<()> {
    // More points than the 1000×600 image has room for would only cost hours.
    if !(3..=MAX_GRID).contains(&args.grid) || args.grid.is_multiple_of(2) {
        bail!(
            "--grid must be odd, from 3 to {MAX_GRID}, got {}",
            args.grid
        );
    }
    if !(args.span.is_finite() && args.span > 0.0) || args.samples == 0 {
        bail!("--span must be > 0 and --samples at least 1");
    }
    if out.extension().and_then(|e| e.to_str()) != Some("png") {
        bail!("{}: the output must end in .png", out.display());
    }
    crate::plot::check_output_dir(out)?;
    let cfg = RunConfig::from_file(&run.join("config.toml"))
        .with_context(|| format!("{} is not a run directory", run.display()))?;
    if let Algorithm::Pfedclub(_) = cfg.algorithm {
        bail!(
            "{} is a run of `fl pfedclub` (variant {}): its clients keep their own models, of several architectures, and there is no global model to draw",
            run.display(),
            cfg.label()
        );
    }
    let weights = run.join(fl_core::engine::files::MODEL);
    if !weights.is_file() {
        bail!(
            "{} has no final model yet (the run has not finished)",
            run.display()
        );
    }
    let data = load_dataset(cfg.run.dataset_kind()?, cfg.run.data_dir.as_deref())?;
    let n = args.samples.min(data.test.len());
    let test = data.test.subset(&(0..n).collect::<Vec<_>>());
    let device = backend::device();
    let (shape, classes) = (data.train.image_shape(), data.train.num_classes());
    let coords: Vec<f64> = (0..args.grid)
        .map(|i| -args.span + 2.0 * args.span * i as f64 / (args.grid - 1) as f64)
        .collect();
    let points = with_model!(cfg.run.model_kind()?, shape, classes, &device, |model| {
        surface(
            model,
            &weights,
            &coords,
            args.seed,
            &test,
            &data.normalization,
            &device,
        )
    })?;
    write_csv(&out.with_extension("csv"), &points)?;
    draw(
        out,
        &points,
        &coords,
        &format!("{} loss landscape", cfg.label()),
    )?;
    let centre = points[points.len() / 2];
    let lowest = points
        .iter()
        .min_by(|a, b| a.loss.total_cmp(&b.loss))
        .expect("non-empty grid");
    println!(
        "centre loss {:.4} (accuracy {:.2}%); lowest {:.4} at ({:.2}, {:.2}); wrote {} and {}",
        centre.loss,
        100.0 * centre.accuracy,
        lowest.loss,
        lowest.x,
        lowest.y,
        out.display(),
        out.with_extension("csv").display()
    );
    Ok(())
}

fn surface<M: Classifier>(
    model: M,
    weights: &Path,
    coords: &[f64],
    seed: u64,
    test: &fl_data::Dataset,
    norm: &fl_data::Normalization,
    device: &burn::tensor::Device,
) -> anyhow::Result<Vec<LandscapePoint>> {
    let model = model
        .try_load_file(weights)
        .map_err(|e| anyhow!("cannot load {}: {e}", weights.display()))?;
    let center = ParamTable::from_module(&model);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let d1 = filter_normalized_direction(&center, &mut rng, device)?;
    let d2 = filter_normalized_direction(&center, &mut rng, device)?;
    Ok(loss_surface(
        &model, &center, &d1, &d2, coords, test, norm, 500,
    )?)
}

fn write_csv(path: &Path, points: &[LandscapePoint]) -> anyhow::Result<()> {
    let mut text = String::from("x,y,loss,accuracy\n");
    for p in points {
        text.push_str(&format!("{},{},{},{}\n", p.x, p.y, p.loss, p.accuracy));
    }
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

/// A heat map of log-loss (dark = low), 800×700, with the model at the centre marked.
fn draw(out: &Path, points: &[LandscapePoint], coords: &[f64], title: &str) -> anyhow::Result<()> {
    crate::plot::register_font()?;
    let err = |e: DrawingAreaErrorKind<_>| anyhow!("drawing {}: {e}", out.display());
    let root = BitMapBackend::new(out, (800, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let span = coords[coords.len() - 1];
    let step = 2.0 * span / (coords.len() - 1) as f64;
    let logs: Vec<f64> = points.iter().map(|p| p.loss.max(1e-12).ln()).collect();
    let (lo, hi) = logs
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "{title} (loss {:.3} – {:.3}, log colour scale)",
                lo.exp(),
                hi.exp()
            ),
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(
            -span - step / 2.0..span + step / 2.0,
            -span - step / 2.0..span + step / 2.0,
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc("direction 1")
        .y_desc("direction 2")
        .draw()
        .map_err(err)?;
    chart
        .draw_series(points.iter().zip(&logs).map(|(p, &l)| {
            let t = if hi > lo { (l - lo) / (hi - lo) } else { 0.0 };
            let color = viridis(t);
            Rectangle::new(
                [
                    (p.x - step / 2.0, p.y - step / 2.0),
                    (p.x + step / 2.0, p.y + step / 2.0),
                ],
                color.filled(),
            )
        }))
        .map_err(err)?;
    chart
        .draw_series(std::iter::once(Cross::new(
            (0.0, 0.0),
            8,
            WHITE.stroke_width(2),
        )))
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Viridis, linearly interpolated between five of its stops (`t` in `[0, 1]`).
pub(crate) fn viridis(t: f64) -> RGBColor {
    const STOPS: [(f64, f64, f64); 5] = [
        (68.0, 1.0, 84.0),
        (59.0, 82.0, 139.0),
        (33.0, 145.0, 140.0),
        (94.0, 201.0, 98.0),
        (253.0, 231.0, 37.0),
    ];
    let x = t.clamp(0.0, 1.0) * (STOPS.len() - 1) as f64;
    let i = (x.floor() as usize).min(STOPS.len() - 2);
    let f = x - i as f64;
    let (a, b) = (STOPS[i], STOPS[i + 1]);
    let mix = |p: f64, q: f64| (p + f * (q - p)).round() as u8;
    RGBColor(mix(a.0, b.0), mix(a.1, b.1), mix(a.2, b.2))
}
