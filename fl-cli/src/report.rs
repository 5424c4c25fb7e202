//! Reading finished runs back for `fl plot` and `fl compare`.
//!
//! A run directory holds `metrics.jsonl`; a directory whose subfolders are runs (e.g. one per
//! seed) is a group, summarised as mean ± standard deviation across its runs.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use fl_core::RoundMetrics;
use fl_core::engine::{files, read_metrics};

use crate::config::RunConfig;

/// One curve or table row: a run, or several runs (seeds) of one setting.
#[derive(Debug, Clone)]
pub struct RunGroup {
    /// Legend / row label (the directory name).
    pub label: String,
    /// Metrics of each run, in directory order.
    pub runs: Vec<Vec<RoundMetrics>>,
    /// Each client's architecture, where the runs recorded one (`manifest.json`'s
    /// `architectures`: personalised runs over a model zoo).
    pub architectures: Option<Vec<String>>,
}

/// Loads `dir` as a run, or as a group of the runs in its subfolders.
pub fn load_group(dir: &Path) -> anyhow::Result<RunGroup> {
    let label = dir
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| dir.display().to_string());
    let read = |d: &Path| {
        read_metrics(&d.join(files::METRICS), usize::MAX)
            .with_context(|| format!("reading {}", d.join(files::METRICS).display()))
    };
    if dir.join(files::METRICS).is_file() {
        let runs = vec![read(dir)?];
        let architectures = read_architectures(dir)?;
        return Ok(RunGroup {
            label,
            runs,
            architectures,
        });
    }
    let entries = std::fs::read_dir(dir)
        .with_context(|| format!("{} is not a run directory", dir.display()))?;
    let mut subdirs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join(files::METRICS).is_file())
        .collect();
    subdirs.sort();
    if subdirs.is_empty() {
        bail!(
            "{} has no {} (nor do its subfolders)",
            dir.display(),
            files::METRICS
        );
    }
    check_one_setting(&subdirs)?;
    let runs = subdirs
        .iter()
        .map(|d| read(d))
        .collect::<anyhow::Result<_>>()?;
    let architectures = read_architectures(&subdirs[0])?;
    for d in &subdirs[1..] {
        if read_architectures(d)? != architectures {
            bail!(
                "{} and {} give their clients different architectures: not one setting",
                subdirs[0].display(),
                d.display()
            );
        }
    }
    Ok(RunGroup {
        label,
        runs,
        architectures,
    })
}

/// Refuses a group whose runs are not the seeds of one setting: their `config.toml`s must
/// agree but for the seed, the directory and what a resume may change (rounds, threads, ...),
/// and no seed may come twice (a copied run would shrink the spread). Groups with a run
/// without a readable `config.toml` (written by the library, not by `fl`, or by a version
/// whose settings this one no longer reads) are not checked: their metrics still plot.
fn check_one_setting(runs: &[PathBuf]) -> anyhow::Result<()> {
    let mut configs = Vec::new();
    for run in runs {
        let Ok(cfg) = RunConfig::from_file(&run.join("config.toml")) else {
            return Ok(());
        };
        configs.push((run, cfg));
    }
    let Some((first, base)) = configs.first() else {
        return Ok(());
    };
    let setting = |c: &RunConfig| {
        let mut c = c.clone();
        c.run.resume_with(&base.run, |_| true);
        c.run.seed = base.run.seed;
        c.run.out = None;
        c.to_toml()
    };
    let want = setting(base);
    for (i, (run, cfg)) in configs.iter().enumerate() {
        let have = setting(cfg);
        if have != want {
            let diff = crate::config::first_difference(&want, &have)
                .map_or(String::new(), |(a, b)| format!(" (`{a}` against `{b}`)"));
            bail!(
                "{} and {} are not seeds of one setting{diff}: give them as separate runs",
                first.display(),
                run.display()
            );
        }
        if let Some((twin, _)) = configs[..i]
            .iter()
            .find(|(_, c)| c.run.seed == cfg.run.seed)
        {
            bail!(
                "{} and {} are both seed {} of one setting (the same run twice): keep one",
                twin.display(),
                run.display(),
                cfg.run.seed
            );
        }
    }
    Ok(())
}

/// The clients' architectures a run's `manifest.json` records, if any.
fn read_architectures(run: &Path) -> anyhow::Result<Option<Vec<String>>> {
    let path = run.join("manifest.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(None);
    };
    let manifest: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?;
    Ok(manifest.get("architectures").map(|a| {
        a.as_array()
            .into_iter()
            .flatten()
            .map(|k| k.as_str().unwrap_or("?").to_string())
            .collect()
    }))
}

/// Splits every group whose runs record each client's architecture and φ (`client_phi`,
/// pFedClub) into one curve per architecture, "LABEL cnn1", whose `phi` is the mean φ of that
/// architecture's clients that got a teacher in the round — pFedClub's Fig. 6. Other groups are
/// kept as they are.
pub fn expand_architectures(groups: Vec<RunGroup>) -> Vec<RunGroup> {
    let mut out = Vec::new();
    for group in groups {
        let Some(archs) = group.architectures.clone() else {
            out.push(group);
            continue;
        };
        let mut names: Vec<&String> = Vec::new();
        for a in &archs {
            if !names.contains(&a) {
                names.push(a);
            }
        }
        for name in names {
            let phi_of = |m: &RoundMetrics| -> Option<f64> {
                let phis = m.extra.get("client_phi")?.as_array()?;
                let of_arch: Vec<f64> = m
                    .clients
                    .iter()
                    .zip(phis)
                    .filter(|(c, _)| archs.get(**c) == Some(name))
                    .filter_map(|(_, phi)| phi.as_f64())
                    .collect();
                (!of_arch.is_empty()).then(|| of_arch.iter().sum::<f64>() / of_arch.len() as f64)
            };
            let runs = group
                .runs
                .iter()
                .map(|run| {
                    run.iter()
                        .map(|m| {
                            let mut m = m.clone();
                            match phi_of(&m) {
                                Some(phi) => m.extra.insert("phi".into(), phi.into()),
                                None => m.extra.remove("phi"),
                            };
                            m
                        })
                        .collect()
                })
                .collect();
            out.push(RunGroup {
                label: format!("{} {name}", group.label),
                runs,
                architectures: group.architectures.clone(),
            });
        }
    }
    out
}

/// Splits every group whose runs evaluated each of their K models (`model_acc`, FedMR's and
/// FedIndep's `--eval-models`) into K curves "LABEL model k" plus "LABEL averaged" (the global
/// model), as FedMR's Fig. 5 draws them; other groups are kept as they are.
pub fn expand_models(groups: Vec<RunGroup>) -> Vec<RunGroup> {
    let per_model = |m: &RoundMetrics, key: &str| -> Option<Vec<f64>> {
        let values = m.extra.get(key)?.as_array()?;
        values.iter().map(serde_json::Value::as_f64).collect()
    };
    let mut out = Vec::new();
    for group in groups {
        let k = group
            .runs
            .iter()
            .flatten()
            .find_map(|m| per_model(m, "model_acc"))
            .map_or(0, |v| v.len());
        if k == 0 {
            out.push(group);
            continue;
        }
        for model in 0..k {
            let runs = group
                .runs
                .iter()
                .map(|run| {
                    run.iter()
                        .map(|m| {
                            let pick = |key| per_model(m, key).and_then(|v| v.get(model).copied());
                            RoundMetrics {
                                test_acc: pick("model_acc"),
                                test_loss: pick("model_loss"),
                                ..m.clone()
                            }
                        })
                        .collect()
                })
                .collect();
            out.push(RunGroup {
                label: format!("{} model {}", group.label, model + 1),
                runs,
                architectures: group.architectures.clone(),
            });
        }
        out.push(RunGroup {
            label: format!("{} averaged", group.label),
            ..group
        });
    }
    out
}

/// Mean and (sample) standard deviation.
pub fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = if xs.len() > 1 {
        xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (mean, var.sqrt())
}

/// A per-round metric that can be plotted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Metric {
    /// Test accuracy (in %).
    Accuracy,
    /// Test loss.
    Loss,
    /// pFedClub's φ, the teachers' mean relative size (|w*| − |w|)/|w| (per architecture).
    Phi,
}

impl Metric {
    /// Axis label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Accuracy => "test accuracy (%)",
            Self::Loss => "test loss",
            Self::Phi => "φ, teachers' relative size",
        }
    }

    fn of(self, m: &RoundMetrics) -> Option<f64> {
        match self {
            Self::Accuracy => m.test_acc.map(|a| 100.0 * a),
            Self::Loss => m.test_loss,
            Self::Phi => m.extra.get("phi").and_then(serde_json::Value::as_f64),
        }
    }
}

/// `(round, mean, std)` over the rounds every run of the group evaluated.
pub fn curve(group: &RunGroup, metric: Metric) -> Vec<(usize, f64, f64)> {
    let first = &group.runs[0];
    first
        .iter()
        .filter_map(|m| {
            let values: Option<Vec<f64>> = group
                .runs
                .iter()
                .map(|run| {
                    run.iter()
                        .find(|x| x.round == m.round)
                        .and_then(|x| metric.of(x))
                })
                .collect();
            let values = values?;
            let (mean, std) = mean_std(&values);
            Some((m.round, mean, std))
        })
        .collect()
}

/// Strategy metrics that count traffic on top of the models sent (`bytes_down`, `bytes_up`):
/// SCAFFOLD's control variates, FedGen's generator, secure FedMR's client-to-client exchange.
const EXTRA_TRAFFIC: [&str; 3] = [
    "control_bytes",
    "generator_bytes_down",
    "secure_exchange_bytes",
];

/// Every byte a round communicated.
fn round_bytes(m: &RoundMetrics) -> f64 {
    let extra: u64 = EXTRA_TRAFFIC
        .iter()
        .filter_map(|k| m.extra.get(*k).and_then(serde_json::Value::as_u64))
        .sum();
    (m.bytes_down + m.bytes_up) as f64 + extra as f64
}

/// Summary numbers of one run.
struct RunSummary {
    final_acc: f64,
    best_acc: f64,
    rounds_to_target: Option<usize>,
    /// Wall-clock seconds (training, aggregation, evaluation) until the target was reached.
    seconds_to_target: Option<f64>,
    megabytes: f64,
}

/// Parses `--target`: an accuracy as a fraction in (0, 1], as `metrics.jsonl` keeps it.
pub fn parse_target(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(t) if t > 0.0 && t <= 1.0 => Ok(t),
        _ => Err(format!(
            "'{s}' is not an accuracy in (0, 1] (e.g. 0.8 for 80%)"
        )),
    }
}

fn summarise(run: &[RoundMetrics], target: f64) -> Option<RunSummary> {
    let evaluated: Vec<(usize, f64)> = run
        .iter()
        .filter_map(|m| m.test_acc.map(|a| (m.round, a)))
        .collect();
    let &(_, final_acc) = evaluated.last()?;
    Some(RunSummary {
        final_acc,
        best_acc: evaluated.iter().map(|x| x.1).fold(f64::MIN, f64::max),
        rounds_to_target: evaluated.iter().find(|x| x.1 >= target).map(|x| x.0),
        seconds_to_target: {
            let mut elapsed = 0.0;
            run.iter().find_map(|m| {
                elapsed += m.train_seconds + m.aggregate_seconds + m.eval_seconds;
                m.test_acc.filter(|&a| a >= target).map(|_| elapsed)
            })
        },
        megabytes: run.iter().map(round_bytes).sum::<f64>() / 1e6,
    })
}

/// Output format of `fl compare`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TableFormat {
    /// A Markdown table.
    Markdown,
    /// Comma-separated values with a header row.
    Csv,
}

/// The `fl compare` table: one row per group.
pub fn compare_table(
    groups: &[RunGroup],
    target: f64,
    format: TableFormat,
) -> anyhow::Result<String> {
    let header = [
        "run".to_string(),
        "seeds".into(),
        "rounds".into(),
        "final acc (%)".into(),
        "best acc (%)".into(),
        format!("rounds to {:.0}%", 100.0 * target),
        format!("seconds to {:.0}%", 100.0 * target),
        "total MB".into(),
    ];
    let mut rows = vec![header.to_vec()];
    for g in groups {
        // Seeds are compared over the rounds all of them ran, as `curve` draws them: a mean of
        // finals at different rounds would mislead.
        let last = |r: &Vec<RoundMetrics>| r.last().map_or(0, |m| m.round);
        let common = g.runs.iter().map(last).min().unwrap_or(0);
        let longest = g.runs.iter().map(last).max().unwrap_or(0);
        if common < longest {
            tracing::warn!(
                "{}: its runs reached rounds {common} to {longest}; compared over the first {common}, which all ran",
                g.label
            );
        }
        let summaries: Vec<RunSummary> = g
            .runs
            .iter()
            .map(|r| {
                let ran = r.partition_point(|m| m.round <= common);
                summarise(&r[..ran], target)
            })
            .collect::<Option<_>>()
            .with_context(|| format!("{}: a run has no evaluated round", g.label))?;
        let pm = |xs: Vec<f64>, scale: f64| {
            let (m, s) = mean_std(&xs);
            if xs.len() > 1 {
                format!("{:.2} ± {:.2}", scale * m, scale * s)
            } else {
                format!("{:.2}", scale * m)
            }
        };
        // Mean over the runs when every run reached the target.
        let to_target = |reached: Vec<f64>| {
            if reached.len() == summaries.len() {
                let (m, _) = mean_std(&reached);
                format!("{m:.0}")
            } else {
                format!("not reached ({}/{})", reached.len(), summaries.len())
            }
        };
        let rounds_to = to_target(
            summaries
                .iter()
                .filter_map(|s| s.rounds_to_target.map(|r| r as f64))
                .collect(),
        );
        let seconds_to = to_target(
            summaries
                .iter()
                .filter_map(|s| s.seconds_to_target)
                .collect(),
        );
        rows.push(vec![
            g.label.clone(),
            summaries.len().to_string(),
            common.to_string(),
            pm(summaries.iter().map(|s| s.final_acc).collect(), 100.0),
            pm(summaries.iter().map(|s| s.best_acc).collect(), 100.0),
            rounds_to,
            seconds_to,
            pm(summaries.iter().map(|s| s.megabytes).collect(), 1.0),
        ]);
    }
    Ok(render(&rows, format))
}

/// A table (header row first) as Markdown or CSV (`±` written `+-` in CSV).
pub fn render(rows: &[Vec<String>], format: TableFormat) -> String {
    match format {
        TableFormat::Csv => rows
            .iter()
            .map(|r| {
                r.iter()
                    .map(|c| c.replace(" ± ", "+-"))
                    .collect::<Vec<_>>()
                    .join(",")
                    + "\n"
            })
            .collect(),
        TableFormat::Markdown => {
            let mut out = String::new();
            for (i, r) in rows.iter().enumerate() {
                out += &format!("| {} |\n", r.join(" | "));
                if i == 0 {
                    out += &format!("|{}\n", "---|".repeat(r.len()));
                }
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(r: usize, acc: Option<f64>) -> RoundMetrics {
        RoundMetrics {
            round: r,
            test_acc: acc,
            test_loss: acc.map(|a| 1.0 - a),
            train_loss: 1.0,
            clients: vec![0],
            bytes_down: 500_000,
            bytes_up: 500_000,
            train_seconds: 2.0,
            aggregate_seconds: 0.5,
            eval_seconds: 0.5,
            extra: Default::default(),
        }
    }

    #[test]
    fn runs_with_per_model_scores_split_into_one_curve_per_model() {
        let mut m = round(1, Some(0.5));
        m.extra
            .insert("model_acc".into(), serde_json::json!([0.25, 0.75]));
        let plain = RunGroup {
            label: "fedavg".into(),
            runs: vec![vec![round(1, Some(0.4))]],
            architectures: None,
        };
        let indep = RunGroup {
            label: "fedindep".into(),
            runs: vec![vec![m]],
            architectures: None,
        };
        let groups = expand_models(vec![plain, indep]);
        let labels: Vec<&str> = groups.iter().map(|g| g.label.as_str()).collect();
        assert_eq!(
            labels,
            [
                "fedavg",
                "fedindep model 1",
                "fedindep model 2",
                "fedindep averaged"
            ]
        );
        let acc = |g: &RunGroup| curve(g, Metric::Accuracy)[0].1;
        assert_eq!(
            groups.iter().map(acc).collect::<Vec<_>>(),
            [40.0, 25.0, 75.0, 50.0]
        );
    }

    #[test]
    fn phi_splits_by_the_clients_architectures() {
        // Clients 0 and 2 are CNN1s, 1 a CNN2; client 2 got no teacher in round 1 and
        // no CNN2 trained in round 2.
        let mut r1 = round(1, Some(0.5));
        r1.clients = vec![0, 1, 2];
        r1.extra
            .insert("client_phi".into(), serde_json::json!([0.5, -0.25, null]));
        let mut r2 = round(2, Some(0.5));
        r2.clients = vec![2, 0];
        r2.extra
            .insert("client_phi".into(), serde_json::json!([1.0, 0.0]));
        let runs = vec![vec![r1.clone(), r2.clone()], vec![r1, r2]];
        let g = RunGroup {
            label: "club".into(),
            runs,
            architectures: Some(vec!["cnn1".into(), "cnn2".into(), "cnn1".into()]),
        };
        let groups = expand_architectures(vec![g]);
        let labels: Vec<&str> = groups.iter().map(|g| g.label.as_str()).collect();
        assert_eq!(labels, ["club cnn1", "club cnn2"]);
        let phi = |g: &RunGroup| -> Vec<(usize, f64)> {
            curve(g, Metric::Phi).iter().map(|p| (p.0, p.1)).collect()
        };
        assert_eq!(phi(&groups[0]), [(1, 0.5), (2, 0.5)]);
        assert_eq!(phi(&groups[1]), [(1, -0.25)]);
    }

    #[test]
    fn groups_average_across_seeds_and_tables_report_targets() {
        let g = RunGroup {
            label: "fedx".into(),
            runs: vec![
                vec![round(1, Some(0.5)), round(2, None), round(3, Some(0.9))],
                vec![round(1, Some(0.7)), round(2, None), round(3, Some(0.7))],
            ],
            architectures: None,
        };
        let c = curve(&g, Metric::Accuracy);
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].0, 1);
        assert!((c[0].1 - 60.0).abs() < 1e-9);
        assert!((c[0].2 - 200f64.sqrt()).abs() < 1e-9);
        let md = compare_table(std::slice::from_ref(&g), 0.8, TableFormat::Markdown).unwrap();
        let lines: Vec<&str> = md.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].contains("rounds to 80%"));
        assert_eq!(
            lines[2],
            "| fedx | 2 | 3 | 80.00 ± 14.14 | 80.00 ± 14.14 | not reached (1/2) | not reached (1/2) | 3.00 ± 0.00 |"
        );
        // The first run reaches 80% in round 3, after 3 × 3 s of training, aggregation and
        // evaluation.
        let first = RunGroup {
            runs: g.runs[..1].to_vec(),
            ..g.clone()
        };
        let csv = compare_table(&[first], 0.8, TableFormat::Csv).unwrap();
        assert_eq!(csv.lines().nth(1).unwrap(), "fedx,1,3,90.00,90.00,3,9,3.00");
        let csv = compare_table(std::slice::from_ref(&g), 0.5, TableFormat::Csv).unwrap();
        assert_eq!(
            csv.lines().nth(1).unwrap(),
            "fedx,2,3,80.00+-14.14,80.00+-14.14,1,3,3.00+-0.00"
        );
        // A seed that ran longer is compared over the rounds both ran (as the curve is drawn).
        let mut longer = g.clone();
        longer.runs[0].push(round(4, Some(0.95)));
        let csv = compare_table(&[longer], 0.5, TableFormat::Csv).unwrap();
        assert_eq!(
            csv.lines().nth(1).unwrap(),
            "fedx,2,3,80.00+-14.14,80.00+-14.14,1,3,3.00+-0.00"
        );
    }

    #[test]
    fn total_traffic_counts_control_variates_and_generators() {
        let mut r = round(1, Some(0.5));
        assert_eq!(round_bytes(&r), 1e6);
        r.extra.insert("control_bytes".into(), 250_000.into());
        r.extra.insert("generator_bytes_down".into(), 50_000.into());
        r.extra.insert("stage".into(), "fedavg".into());
        assert_eq!(round_bytes(&r), 1.3e6);
    }
}
