//! Sweeps: a paper table as one TOML file, expanded deterministically into named runs, run
//! locally (`fl sweep run`) or as a Slurm job array (`fl sweep slurm`), and summarised
//! (`fl sweep report`).
//!
//! A sweep file holds a base configuration (any `fl run` config: `base_file` and/or `[base]`),
//! `[axes]` (each key a list of values: run settings such as `algorithm`, `alpha`, `model`, or
//! an algorithm's setting as `"fedmr.first_stage"`; or bundles, inline tables that set several
//! at once, e.g. `partition = [{ partition = "iid" }, { partition = "dirichlet", alpha = 0.1 }]`
//! or `method = [{ name = "fedmr-fs50", algorithm = "fedmr", "fedmr.first_stage" = 50 }]`),
//! optional explicit `[[cells]]`, and `seeds`.
//! Every combination of the axes is a cell, then each explicit cell; each cell runs once per
//! seed into `OUT/<cell>/s<seed>`. Entries are numbered cell-major (`fl sweep plan` lists them);
//! `fl sweep run SPEC --cell I` runs entry I, the code path of both the local runner and every
//! Slurm array task.

pub mod local;
pub mod slurm;

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use fl_core::engine::{files, read_metrics};
use serde::Deserialize;
use toml::{Table, Value};

use crate::algorithms::NAMES;
use crate::config::{RunConfig, read_table, toml_error};

/// The sweep file's shape.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SpecFile {
    /// Output directory (default `runs/sweeps/<file stem>`), relative to the working directory.
    out: Option<PathBuf>,
    /// A config file the base starts from, relative to the sweep file.
    base_file: Option<PathBuf>,
    /// Settings over the base file's.
    #[serde(default)]
    base: Table,
    /// Setting → values; every combination is a cell.
    #[serde(default)]
    axes: Table,
    /// Further cells, each a table of settings (and an optional `name`).
    #[serde(default)]
    cells: Vec<Table>,
    /// Seeds every cell runs with.
    #[serde(default = "default_seeds")]
    seeds: Vec<u64>,
}

/// A cell before expansion: its explicit name, if any, and its settings in order.
type Setting = (Option<String>, Vec<(String, Value)>);

fn default_seeds() -> Vec<u64> {
    vec![1]
}

/// One run of a sweep: a cell with one seed.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The cell's name (its directory under the sweep's output).
    pub cell: String,
    /// The seed.
    pub seed: u64,
    /// The run's configuration (its `out` is [`Entry::dir`]).
    pub config: RunConfig,
}

impl Entry {
    /// The run directory, `OUT/<cell>/s<seed>`.
    pub fn dir(&self) -> PathBuf {
        self.config.out_dir()
    }

    /// The marker a failed run leaves beside its directory, holding the error.
    pub fn failure_marker(&self) -> PathBuf {
        self.dir().with_extension("failed")
    }

    /// Where the run stands.
    pub fn status(&self) -> Status {
        let done = last_round(&self.dir());
        if done >= self.config.run.rounds {
            Status::Done
        } else if self.failure_marker().exists() {
            Status::Failed
        } else if self.dir().join("config.toml").exists() {
            Status::Partial(done)
        } else {
            Status::New
        }
    }
}

/// The last round in a run directory's metrics (0: none).
pub fn last_round(dir: &Path) -> usize {
    read_metrics(&dir.join(files::METRICS), usize::MAX)
        .ok()
        .and_then(|m| m.last().map(|m| m.round))
        .unwrap_or(0)
}

/// Where a sweep entry stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Not started.
    New,
    /// Started, this many rounds done.
    Partial(usize),
    /// Failed (its error beside the run directory); retried with `--retry-failed`.
    Failed,
    /// All rounds done.
    Done,
}

/// An expanded sweep.
#[derive(Debug, Clone)]
pub struct Sweep {
    /// The sweep file.
    pub spec: PathBuf,
    /// The output directory.
    pub out: PathBuf,
    /// The axes (names and values, as written), for the report.
    pub axes: Vec<(String, Vec<String>)>,
    /// The cells' names, in order.
    pub cells: Vec<String>,
    /// Every run, cell-major.
    pub entries: Vec<Entry>,
}

/// A value as it appears in a cell name: strings bare, others as TOML writes them.
/// A bundle (a table value: several settings at once) by its `name`, or its values joined.
fn show(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Table(t) => match t.get("name") {
            Some(name) => show(name),
            None => t.values().map(show).collect::<Vec<_>>().join("-"),
        },
        other => other.to_string(),
    }
}

/// Applies one axis value (or explicit cell setting): a plain value sets `key`; a bundle sets
/// each of its keys (`key` is then only the axis' label).
fn apply(table: &mut Table, key: &str, value: Value) -> anyhow::Result<()> {
    match value {
        Value::Table(bundle) => {
            for (k, v) in bundle {
                if k != "name" {
                    set(table, &k, v)?;
                }
            }
            Ok(())
        }
        v => set(table, key, v),
    }
}

/// Sets `key` (`name` or `section.name`) in `table`.
fn set(table: &mut Table, key: &str, value: Value) -> anyhow::Result<()> {
    match key.split_once('.') {
        None => {
            table.insert(key.into(), value);
        }
        Some((section, name)) => {
            let entry = table
                .entry(section)
                .or_insert_with(|| Value::Table(Table::new()));
            let Value::Table(t) = entry else {
                bail!("`{section}` is a setting, not a section: cannot set `{key}`");
            };
            t.insert(name.into(), value);
        }
    }
    Ok(())
}

/// `overlay`'s keys over `base`'s (sections merged key by key).
fn merge(base: &mut Table, overlay: Table) {
    for (k, v) in overlay {
        match (base.get_mut(&k), v) {
            (Some(Value::Table(b)), Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// Letters, digits, `.`, `_`, `+` and `-` are kept in a cell name; anything else becomes `-`.
fn sanitise(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "+-._".contains(c) {
                c
            } else {
                '-'
            }
        })
        .collect()
}

impl Sweep {
    /// Reads and expands a sweep file; every run's configuration is checked.
    pub fn load(spec: &Path) -> anyhow::Result<Self> {
        let table = read_table(spec)?;
        let file: SpecFile = table
            .try_into()
            .map_err(toml_error)
            .with_context(|| format!("invalid sweep {}", spec.display()))?;
        Self::expand(spec, file).with_context(|| format!("invalid sweep {}", spec.display()))
    }

    fn expand(spec: &Path, file: SpecFile) -> anyhow::Result<Self> {
        let mut base = match &file.base_file {
            Some(f) => read_table(&spec.parent().unwrap_or(Path::new(".")).join(f))?,
            None => Table::new(),
        };
        // A base file's seed and output are the sweep's to set.
        base.remove("seed");
        base.remove("out");
        for key in ["seed", "out"] {
            if file.base.contains_key(key) || file.axes.contains_key(key) {
                bail!("`{key}` is the sweep's to set (use `seeds = [...]` and `out`)");
            }
        }
        merge(&mut base, file.base);
        if file.seeds.is_empty() {
            bail!("`seeds` must list at least one seed");
        }
        if let Some(seed) = crate::config::first_repeated(&file.seeds) {
            // Both runs would go to the same directory.
            bail!("`seeds` lists {seed} twice");
        }
        let mut axes = Vec::new();
        for (key, values) in &file.axes {
            let Value::Array(values) = values else {
                bail!("axis `{key}` must be a list of values");
            };
            if values.is_empty() {
                bail!("axis `{key}` has no values");
            }
            axes.push((key.clone(), values.clone()));
        }
        // The product of the axes (the last varies fastest), then the explicit cells.
        let mut settings: Vec<Setting> = if axes.is_empty() && !file.cells.is_empty() {
            Vec::new()
        } else {
            vec![(None, Vec::new())]
        };
        for (key, values) in &axes {
            settings = settings
                .into_iter()
                .flat_map(|(_, s)| {
                    values.iter().map(move |v| {
                        let mut s = s.clone();
                        s.push((key.clone(), v.clone()));
                        (None, s)
                    })
                })
                .collect();
        }
        for cell in file.cells {
            let mut cell = cell;
            let name = match cell.remove("name") {
                Some(Value::String(n)) => Some(n),
                Some(other) => bail!("a cell's `name` must be a string, got {other}"),
                None => None,
            };
            settings.push((name, cell.into_iter().collect()));
        }
        let out = file.out.unwrap_or_else(|| {
            let stem = spec
                .file_stem()
                .map_or("sweep".into(), |s| s.to_string_lossy());
            Path::new("runs").join("sweeps").join(stem.as_ref())
        });
        let mut cells = Vec::new();
        let mut entries = Vec::new();
        for (name, setting) in settings {
            let name = sanitise(&name.unwrap_or_else(|| {
                let parts: Vec<String> = setting
                    .iter()
                    .map(|(k, v)| format!("{k}-{}", show(v)))
                    .collect();
                if parts.is_empty() {
                    "base".into()
                } else {
                    parts.join("_")
                }
            }));
            if cells.contains(&name) {
                bail!("two cells are named '{name}' (give explicit cells a `name`)");
            }
            let mut table = base.clone();
            for (key, value) in setting {
                apply(&mut table, &key, value)?;
            }
            // Sections of other algorithms (a base shared by several) do not apply.
            let algorithm = match table.get("algorithm") {
                Some(Value::String(a)) => a.clone(),
                Some(other) => bail!("cell '{name}': `algorithm` must be a name, got {other}"),
                None => "fedavg".into(),
            };
            table.retain(|k, v| {
                let k: &str = k;
                !(v.is_table() && NAMES.contains(&k) && k != algorithm)
            });
            for &seed in &file.seeds {
                let mut t = table.clone();
                t.insert("seed".into(), Value::Integer(seed as i64));
                let dir = out.join(&name).join(format!("s{seed}"));
                t.insert("out".into(), dir.display().to_string().into());
                let config =
                    RunConfig::from_table(&mut t).with_context(|| format!("cell '{name}'"))?;
                crate::run::check(&config).with_context(|| format!("cell '{name}'"))?;
                entries.push(Entry {
                    cell: name.clone(),
                    seed,
                    config,
                });
            }
            cells.push(name);
        }
        Ok(Self {
            spec: spec.to_path_buf(),
            out,
            axes: axes
                .into_iter()
                .map(|(k, vs)| (k, vs.iter().map(show).collect()))
                .collect(),
            cells,
            entries,
        })
    }

    /// The entry `index` (as `fl sweep plan` numbers them).
    pub fn entry(&self, index: usize) -> anyhow::Result<&Entry> {
        self.entries.get(index).with_context(|| {
            format!(
                "{} has {} runs (0 to {}), not {index}",
                self.spec.display(),
                self.entries.len(),
                self.entries.len().saturating_sub(1)
            )
        })
    }
}

/// `fl sweep plan`: the runs, their status and the work they hold.
pub fn plan(sweep: &Sweep) -> String {
    let mut out = format!(
        "{}: {} cells × seeds = {} runs into {}\n",
        sweep.spec.display(),
        sweep.cells.len(),
        sweep.entries.len(),
        sweep.out.display()
    );
    let (mut work, mut left) = (0usize, 0usize);
    for (i, e) in sweep.entries.iter().enumerate() {
        let r = &e.config.run;
        // Client-epochs: the unit of local training work.
        let per_round = r.sample * r.local_epochs;
        work += r.rounds * per_round;
        let (status, done) = match e.status() {
            Status::New => ("new".to_string(), 0),
            Status::Partial(done) => (format!("{done}/{} rounds", r.rounds), done),
            Status::Failed => ("failed".into(), 0),
            Status::Done => ("done".into(), r.rounds),
        };
        left += (r.rounds - done.min(r.rounds)) * per_round;
        out += &format!(
            "{i:>4}  {}/s{}  {} {} {} rounds={} clients={} sample={} epochs={}  [{status}]\n",
            e.cell,
            e.seed,
            e.config.label(),
            r.dataset,
            r.model,
            r.rounds,
            r.clients,
            r.sample,
            r.local_epochs
        );
    }
    out += &format!("work: {work} client-epochs of local training, {left} left\n");
    out
}

/// `fl sweep report`: the finished runs' cells as one paper-style table (rows: the `algorithm` axis, or the
/// first; columns: the other axes' combinations; final accuracy mean ± std over seeds), then
/// `fl compare`'s full table of every cell.
pub fn report(
    sweep: &Sweep,
    target: f64,
    format: crate::report::TableFormat,
) -> anyhow::Result<String> {
    // Only finished runs: a mean over seeds at different rounds would mislead.
    let mut groups = Vec::new();
    let mut unfinished = 0;
    for cell in &sweep.cells {
        let mut runs = Vec::new();
        for e in sweep.entries.iter().filter(|e| &e.cell == cell) {
            if e.status() == Status::Done {
                runs.push(read_metrics(&e.dir().join(files::METRICS), usize::MAX)?);
            } else {
                unfinished += 1;
            }
        }
        if !runs.is_empty() {
            groups.push(crate::report::RunGroup {
                label: cell.clone(),
                runs,
                architectures: None,
            });
        }
    }
    if groups.is_empty() {
        bail!("no run of {} has finished yet", sweep.spec.display());
    }
    let mut text = String::new();
    if let Some(pivot) = pivot(sweep, &groups, format) {
        text += &pivot;
        text += "\n";
    }
    text += &crate::report::compare_table(&groups, target, format)?;
    if unfinished > 0 && format == crate::report::TableFormat::Markdown {
        text += &format!(
            "\n{unfinished} of {} runs have not finished and are not in the tables.\n",
            sweep.entries.len()
        );
    }
    Ok(text)
}

/// The pivot table of final accuracies, when the sweep has two or more axes.
fn pivot(
    sweep: &Sweep,
    groups: &[crate::report::RunGroup],
    format: crate::report::TableFormat,
) -> Option<String> {
    if sweep.axes.len() < 2 {
        return None;
    }
    let row_axis = sweep
        .axes
        .iter()
        .position(|(k, _)| k == "algorithm")
        .unwrap_or(0);
    // A cell's name is `k-v_k-v…` in axis order: its value on each axis.
    let values = |cell: &str| -> Option<Vec<String>> {
        let mut rest = cell.to_string();
        let mut out = Vec::new();
        for (i, (k, _)) in sweep.axes.iter().enumerate() {
            let k = sanitise(k);
            rest = rest.strip_prefix(&format!("{k}-"))?.to_string();
            let next = sweep
                .axes
                .get(i + 1)
                .map(|(k, _)| format!("_{}-", sanitise(k)));
            let cut = next.and_then(|n| rest.find(&n)).unwrap_or(rest.len());
            out.push(rest[..cut].to_string());
            rest = rest[cut..].trim_start_matches('_').to_string();
        }
        Some(out)
    };
    let mut rows: Vec<String> = Vec::new();
    let mut cols: Vec<String> = Vec::new();
    let mut cells = std::collections::HashMap::new();
    for g in groups {
        let Some(v) = values(&g.label) else { continue };
        let row = v[row_axis].clone();
        let col: Vec<String> = v
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != row_axis)
            .map(|(i, x)| format!("{}={x}", sweep.axes[i].0))
            .collect();
        let col = col.join(" ");
        let finals: Vec<f64> = g
            .runs
            .iter()
            .filter_map(|r| r.iter().rev().find_map(|m| m.test_acc))
            .collect();
        let (m, s) = crate::report::mean_std(&finals);
        let text = if finals.len() > 1 {
            format!("{:.2} ± {:.2} ({})", 100.0 * m, 100.0 * s, finals.len())
        } else {
            format!("{:.2} ({})", 100.0 * m, finals.len())
        };
        if !rows.contains(&row) {
            rows.push(row.clone());
        }
        if !cols.contains(&col) {
            cols.push(col.clone());
        }
        cells.insert((row, col), text);
    }
    let corner = format!("{} (final acc %, seeds)", sweep.axes[row_axis].0);
    let header: Vec<String> = std::iter::once(corner)
        .chain(cols.iter().cloned())
        .collect();
    let mut table = vec![header];
    for r in &rows {
        let mut line = vec![r.clone()];
        for c in &cols {
            line.push(
                cells
                    .get(&(r.clone(), c.clone()))
                    .cloned()
                    .unwrap_or("–".into()),
            );
        }
        table.push(line);
    }
    Some(crate::report::render(&table, format))
}
