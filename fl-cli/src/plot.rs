//! `fl plot`: metric-vs-round curves of runs (mean ± std band for seed groups) as PNG or SVG.

use std::path::Path;

use anyhow::{Context, anyhow, bail};
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::report::{Metric, RunGroup, curve};

/// The font is compiled in, so plotting needs no system fonts (DejaVu Sans, see
/// `assets/DejaVuSans-LICENSE.txt`).
static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

/// Tableau's ten colours: distinct on white, also in greyscale print.
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// Makes the embedded font plotters' `sans-serif`.
pub fn register_font() -> anyhow::Result<()> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| anyhow!("the embedded font is invalid"))
}

/// Refuses an output file whose directory does not exist, before any work is done (plotters
/// would only fail when it writes, with its error's debug form).
pub fn check_output_dir(out: &Path) -> anyhow::Result<()> {
    match out.parent() {
        Some(dir) if !dir.as_os_str().is_empty() && !dir.is_dir() => bail!(
            "cannot write {}: {} is not a directory",
            out.display(),
            dir.display()
        ),
        _ => Ok(()),
    }
}

/// Draws `groups` into `out` (`.png` or `.svg`, 1000×600).
pub fn plot(groups: &[RunGroup], metric: Metric, title: &str, out: &Path) -> anyhow::Result<()> {
    check_output_dir(out)?;
    register_font()?;
    let size = (1000, 600);
    match out.extension().and_then(|e| e.to_str()) {
        Some("png") => draw(
            BitMapBackend::new(out, size).into_drawing_area(),
            groups,
            metric,
            title,
        ),
        Some("svg") => draw(
            SVGBackend::new(out, size).into_drawing_area(),
            groups,
            metric,
            title,
        ),
        _ => bail!("{}: the output must end in .png or .svg", out.display()),
    }
    .with_context(|| format!("drawing {}", out.display()))
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    groups: &[RunGroup],
    metric: Metric,
    title: &str,
) -> anyhow::Result<()> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("{e}");
    let curves: Vec<Vec<(usize, f64, f64)>> = groups.iter().map(|g| curve(g, metric)).collect();
    let points = curves.iter().flatten();
    let x_max = points
        .clone()
        .map(|p| p.0)
        .max()
        .with_context(|| format!("no round of these runs has a {} to plot", metric.label()))?;
    let y_lo = points
        .clone()
        .map(|p| p.1 - p.2)
        .fold(f64::INFINITY, f64::min);
    let y_hi = points.map(|p| p.1 + p.2).fold(f64::NEG_INFINITY, f64::max);
    let pad = ((y_hi - y_lo) * 0.05).max(1e-3);
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..x_max as f64, (y_lo - pad)..(y_hi + pad))
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("round")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| match metric {
            Metric::Phi => format!("{y:.2}"),
            _ => format!("{y:.1}"),
        })
        .y_desc(metric.label())
        .label_style(("sans-serif", 16))
        .draw()
        .map_err(err)?;
    for (i, (group, c)) in groups.iter().zip(&curves).enumerate() {
        let color = PALETTE[i % PALETTE.len()].to_rgba();
        if group.runs.len() > 1 {
            // The mean ± std band: upper edge left to right, lower edge back.
            let band: Vec<(f64, f64)> = c
                .iter()
                .map(|p| (p.0 as f64, p.1 + p.2))
                .chain(c.iter().rev().map(|p| (p.0 as f64, p.1 - p.2)))
                .collect();
            chart
                .draw_series(std::iter::once(Polygon::new(band, color.mix(0.2).filled())))
                .map_err(err)?;
        }
        let label = if group.runs.len() > 1 {
            format!("{} ({} seeds)", group.label, group.runs.len())
        } else {
            group.label.clone()
        };
        chart
            .draw_series(LineSeries::new(
                c.iter().map(|p| (p.0 as f64, p.1)),
                color.stroke_width(2),
            ))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .label_font(("sans-serif", 16))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(match metric {
            Metric::Accuracy => SeriesLabelPosition::LowerRight,
            Metric::Loss | Metric::Phi => SeriesLabelPosition::UpperRight,
        })
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}
