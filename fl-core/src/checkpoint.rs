//! Checkpoints: the strategy's server models and state in one safetensors file, written
//! atomically (temporary file + rename) so a run killed mid-write keeps its last checkpoint.

use std::collections::HashMap;
use std::path::Path;

use burn::tensor::Device;
use safetensors::tensor::{Dtype, TensorView};

use crate::layers::ParamTable;
use crate::strategy::StrategyState;

/// Errors reading or writing a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// File system error.
    #[error("checkpoint {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not a checkpoint this version can read.
    #[error("checkpoint {path} is unreadable: {problem}")]
    Corrupt {
        /// The file.
        path: String,
        /// What is wrong.
        problem: String,
    },
}

/// A decoded checkpoint.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// The last completed round (1-based).
    pub round: usize,
    /// The strategy's name (checked on resume).
    pub strategy: String,
    /// The strategy's state.
    pub state: StrategyState,
}

/// Writes `state` after `round` to `path` atomically.
pub fn save(
    path: &Path,
    round: usize,
    strategy: &str,
    state: &StrategyState,
) -> Result<(), CheckpointError> {
    let corrupt = |problem: String| CheckpointError::Corrupt {
        path: path.display().to_string(),
        problem,
    };
    let mut named = Vec::new();
    for (slot, table) in state.tables.iter().enumerate() {
        for t in table.named_host().map_err(|e| corrupt(e.to_string()))? {
            let bytes: Vec<u8> = t.values.iter().flat_map(|v| v.to_le_bytes()).collect();
            named.push((format!("{slot}/{}", t.name), t.shape, bytes));
        }
    }
    let views = named
        .iter()
        .map(|(n, shape, bytes)| {
            TensorView::new(Dtype::F32, shape.clone(), bytes)
                .map(|v| (n.clone(), v))
                .map_err(|e| corrupt(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let meta = HashMap::from([
        ("fl.round".to_string(), round.to_string()),
        ("fl.strategy".to_string(), strategy.to_string()),
        ("fl.slots".to_string(), state.tables.len().to_string()),
        ("fl.extra".to_string(), state.extra.to_string()),
    ]);
    let bytes = safetensors::serialize(views, Some(meta)).map_err(|e| corrupt(e.to_string()))?;
    let tmp = path.with_extension("tmp");
    let io = |source| CheckpointError::Io {
        path: path.display().to_string(),
        source,
    };
    std::fs::write(&tmp, bytes).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

/// Reads a checkpoint, rebuilding tables with `layout_of`'s layout on `device`.
pub fn load(
    path: &Path,
    layout_of: &ParamTable,
    device: &Device,
) -> Result<Checkpoint, CheckpointError> {
    load_with(path, device, &|_, _| Ok(layout_of.clone()))
}

/// Reads a checkpoint whose tables have different layouts: `layout_of(slot, extra)` gives a
/// table with slot `slot`'s layout (`extra` is the checkpoint's JSON state) or says why there is
/// none.
pub fn load_with(
    path: &Path,
    device: &Device,
    layout_of: &dyn Fn(usize, &serde_json::Value) -> Result<ParamTable, String>,
) -> Result<Checkpoint, CheckpointError> {
    let p = path.display().to_string();
    let corrupt = |problem: String| CheckpointError::Corrupt {
        path: p.clone(),
        problem,
    };
    let bytes = std::fs::read(path).map_err(|source| CheckpointError::Io {
        path: p.clone(),
        source,
    })?;
    let (_, metadata) =
        safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| corrupt(e.to_string()))?;
    let meta = metadata
        .metadata()
        .clone()
        .ok_or_else(|| corrupt("no metadata".into()))?;
    let field = |k: &str| {
        meta.get(k)
            .cloned()
            .ok_or_else(|| corrupt(format!("missing {k}")))
    };
    let round: usize = field("fl.round")?
        .parse()
        .map_err(|e| corrupt(format!("fl.round: {e}")))?;
    let slots: usize = field("fl.slots")?
        .parse()
        .map_err(|e| corrupt(format!("fl.slots: {e}")))?;
    let extra =
        serde_json::from_str(&field("fl.extra")?).map_err(|e| corrupt(format!("fl.extra: {e}")))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| corrupt(e.to_string()))?;
    let mut tables = Vec::with_capacity(slots);
    for slot in 0..slots {
        let layout = layout_of(slot, &extra).map_err(&corrupt)?;
        let mut named = HashMap::new();
        for info in layout.layout().tensors() {
            let key = format!("{slot}/{}", info.name);
            let view = st
                .tensor(&key)
                .map_err(|e| corrupt(format!("{key}: {e}")))?;
            if view.dtype() != Dtype::F32 {
                return Err(corrupt(format!("{key} is not f32")));
            }
            let values: Vec<f32> = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            named.insert(info.name.clone(), values);
        }
        tables.push(
            layout
                .from_named_host(named, device)
                .map_err(|e| corrupt(e.to_string()))?,
        );
    }
    Ok(Checkpoint {
        round,
        strategy: field("fl.strategy")?,
        state: StrategyState { tables, extra },
    })
}
