//! `fl partition`: how a partition splits the classes among clients, as a heat map (clients ×
//! classes, colour = samples) and a CSV, for a run's `partition.json` or a freshly drawn one.

use std::path::Path;

use anyhow::{Context, anyhow, bail};
use fl_data::{FederatedDataset, Partition};
use plotters::prelude::*;

use crate::landscape::viridis;

/// Draws `partition` of `data`'s training labels into `out` (PNG) and writes the CSV next to it.
pub fn draw_partition(
    data: &FederatedDataset,
    partition: &Partition,
    title: &str,
    out: &Path,
) -> anyhow::Result<()> {
    if out.extension().and_then(|e| e.to_str()) != Some("png") {
        bail!("{}: the output must end in .png", out.display());
    }
    crate::plot::check_output_dir(out)?;
    let classes = data.train.num_classes();
    let hist = partition.label_histogram(data.train.labels(), classes);
    let mut csv = String::from("client");
    for c in 0..classes {
        csv.push_str(&format!(",class{c}"));
    }
    csv.push('\n');
    for (i, row) in hist.iter().enumerate() {
        csv.push_str(&i.to_string());
        for n in row {
            csv.push_str(&format!(",{n}"));
        }
        csv.push('\n');
    }
    let csv_path = out.with_extension("csv");
    std::fs::write(&csv_path, csv)
        .with_context(|| format!("cannot write {}", csv_path.display()))?;

    crate::plot::register_font()?;
    let err = |e: DrawingAreaErrorKind<_>| anyhow!("drawing {}: {e}", out.display());
    let root = BitMapBackend::new(out, (1000, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let clients = hist.len();
    let max = hist.iter().flatten().copied().max().unwrap_or(1).max(1) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..clients as f64, 0f64..classes as f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc("client")
        .y_desc("class")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(err)?;
    chart
        .draw_series(hist.iter().enumerate().flat_map(|(i, row)| {
            row.iter().enumerate().map(move |(c, &n)| {
                // Square-root scale: small shares stay visible next to dominant classes.
                let color = if n == 0 {
                    WHITE
                } else {
                    viridis(1.0 - (n as f64 / max).sqrt())
                };
                Rectangle::new(
                    [(i as f64, c as f64), (i as f64 + 1.0, c as f64 + 1.0)],
                    color.filled(),
                )
            })
        }))
        .map_err(err)?;
    root.present().map_err(err)?;
    let sizes = partition.sizes();
    let classes_per_client: Vec<usize> = hist
        .iter()
        .map(|row| row.iter().filter(|&&n| n > 0).count())
        .collect();
    println!(
        "{clients} clients: sizes {}–{} (mean {:.0}), classes per client {}–{} (mean {:.1}); wrote {} and {}",
        sizes.iter().min().unwrap_or(&0),
        sizes.iter().max().unwrap_or(&0),
        sizes.iter().sum::<usize>() as f64 / clients.max(1) as f64,
        classes_per_client.iter().min().unwrap_or(&0),
        classes_per_client.iter().max().unwrap_or(&0),
        classes_per_client.iter().sum::<usize>() as f64 / clients.max(1) as f64,
        out.display(),
        csv_path.display()
    );
    Ok(())
}
