//! Checkpoints: the strategy's server models and state in one safetensors file, written
//! atomically (temporary file + rename) so a run killed mid-write keeps its last checkpoint.
//!
//! The file's metadata is one key, `fl`, holding the round, strategy, state and a SHA-256 of
//! that header and every tensor byte: a damaged file is refused on resume rather than trained
//! from, and the same state always gives the same bytes (one key, so no map order to vary).

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use burn::tensor::Device;
use safetensors::tensor::{Dtype, View};
use sha2::{Digest, Sha256};

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
    /// The file is damaged or not a checkpoint this version can read.
    #[error("checkpoint {path} is corrupt: {problem}")]
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

/// What the `fl` metadata key holds besides the checksum, in a fixed field order.
#[derive(serde::Serialize, serde::Deserialize)]
struct Header {
    round: usize,
    strategy: String,
    slots: usize,
    extra: serde_json::Value,
}

/// The `fl` metadata key: the header and the SHA-256 of it and the tensor bytes.
#[derive(serde::Serialize, serde::Deserialize)]
struct Stamped {
    header: Header,
    sha256: String,
}

/// The metadata key of this version's checkpoints.
const KEY: &str = "fl";

/// SHA-256 (hex) of the header's JSON followed by every tensor's name and bytes, in name order
/// (independent of where the file puts them).
fn checksum<'a>(header: &Header, tensors: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> String {
    let mut tensors: Vec<_> = tensors.into_iter().collect();
    tensors.sort_unstable_by_key(|&(name, _)| name);
    let mut hash = Checksum::new(header);
    for (name, bytes) in tensors {
        hash.add(name, bytes);
    }
    hash.finish()
}

/// [`checksum`] fed one tensor at a time, in name order.
struct Checksum(Sha256);

impl Checksum {
    fn new(header: &Header) -> Self {
        let mut hash = Sha256::new();
        hash.update(serde_json::to_vec(header).expect("headers serialise"));
        Checksum(hash)
    }

    fn add(&mut self, name: &str, bytes: &[u8]) {
        self.0.update(name.as_bytes());
        self.0.update(bytes);
    }

    fn finish(self) -> String {
        self.0
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// One tensor of a checkpoint being written, copied off its table only when its bytes are
/// needed: a checkpoint of 50 MobileNets never holds a second copy of every model.
struct LazyTensor<'a> {
    name: String,
    table: &'a ParamTable,
    index: usize,
    shape: Vec<usize>,
}

impl LazyTensor<'_> {
    fn bytes(&self) -> Result<Vec<u8>, crate::layers::LayerError> {
        let values = self.table.tensor_host(self.index)?;
        Ok(values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

impl View for &LazyTensor<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        // `save` has read every tensor once already, for the checksum.
        Cow::Owned(self.bytes().expect("a tensor read before reads again"))
    }

    fn data_len(&self) -> usize {
        4 * self.shape.iter().product::<usize>()
    }
}

/// Writes `state` after `round` to `path` atomically, one tensor in memory at a time.
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
    let mut tensors: Vec<LazyTensor<'_>> = Vec::new();
    for (slot, table) in state.tables.iter().enumerate() {
        for (index, info) in table.layout().tensors().iter().enumerate() {
            tensors.push(LazyTensor {
                name: format!("{slot}/{}", info.name),
                table,
                index,
                shape: info.shape.clone(),
            });
        }
    }
    tensors.sort_unstable_by(|a, b| a.name.cmp(&b.name));
    let header = Header {
        round,
        strategy: strategy.to_string(),
        slots: state.tables.len(),
        extra: state.extra.clone(),
    };
    let mut hash = Checksum::new(&header);
    for t in &tensors {
        hash.add(&t.name, &t.bytes().map_err(|e| corrupt(e.to_string()))?);
    }
    let sha256 = hash.finish();
    let stamped = serde_json::to_string(&Stamped { header, sha256 }).expect("headers serialise");
    let meta = HashMap::from([(KEY.to_string(), stamped)]);
    let tmp = path.with_extension("tmp");
    let io = |source| CheckpointError::Io {
        path: path.display().to_string(),
        source,
    };
    let views = tensors.iter().map(|t| (t.name.clone(), t));
    safetensors::serialize_to_file(views, Some(meta), &tmp).map_err(|e| match e {
        safetensors::SafeTensorError::IoError(source) => io(source),
        other => corrupt(other.to_string()),
    })?;
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
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| corrupt(e.to_string()))?;
    let meta = metadata
        .metadata()
        .clone()
        .ok_or_else(|| corrupt("no metadata".into()))?;
    let Header {
        round,
        strategy,
        slots,
        extra,
    } = match meta.get(KEY) {
        Some(text) => {
            let stamped: Stamped =
                serde_json::from_str(text).map_err(|e| corrupt(format!("metadata: {e}")))?;
            let views = st.tensors();
            let found = checksum(
                &stamped.header,
                views.iter().map(|(n, v)| (n.as_str(), v.data())),
            );
            if found != stamped.sha256 {
                return Err(corrupt(format!(
                    "its contents' SHA-256 is {found}, but {} was recorded when it was written",
                    stamped.sha256
                )));
            }
            stamped.header
        }
        None => legacy_header(&meta).map_err(corrupt)?,
    };
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
        strategy,
        state: StrategyState { tables, extra },
    })
}

/// The header of a checkpoint written before checksums (separate `fl.*` keys): still read, so
/// older runs can resume, with a warning that it cannot be verified.
fn legacy_header(meta: &HashMap<String, String>) -> Result<Header, String> {
    let field = |k: &str| meta.get(k).ok_or_else(|| format!("missing {k}"));
    let header = Header {
        round: field("fl.round")?
            .parse()
            .map_err(|e| format!("fl.round: {e}"))?,
        strategy: field("fl.strategy")?.clone(),
        slots: field("fl.slots")?
            .parse()
            .map_err(|e| format!("fl.slots: {e}"))?,
        extra: serde_json::from_str(field("fl.extra")?).map_err(|e| format!("fl.extra: {e}"))?,
    };
    tracing::warn!("checkpoint written before checksums: its contents cannot be verified");
    Ok(header)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_model::{device, flat, tiny};
    use safetensors::tensor::TensorView;

    fn state() -> StrategyState {
        let tables = vec![
            ParamTable::from_module(&tiny(1)),
            ParamTable::from_module(&tiny(2)),
        ];
        let extra = serde_json::json!({"momentum": 0.9, "counter": 7, "b": [1, 2], "a": "x"});
        StrategyState { tables, extra }
    }

    #[test]
    fn round_trips_and_writes_the_same_bytes_for_the_same_state() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        let s = state();
        save(&a, 3, "fedavg", &s).unwrap();
        save(&b, 3, "fedavg", &s).unwrap();
        assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
        let back = load(&a, &s.tables[0], &device()).unwrap();
        assert_eq!((back.round, back.strategy.as_str()), (3, "fedavg"));
        assert_eq!(back.state.extra, s.extra);
        for (x, y) in back.state.tables.iter().zip(&s.tables) {
            assert_eq!(flat(x), flat(y));
        }
    }

    #[test]
    fn the_streamed_file_is_the_whole_in_memory_serialisation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let s = state();
        save(&path, 4, "fedmr", &s).unwrap();
        // What writing every tensor from memory gives (the format of earlier versions).
        let mut named = Vec::new();
        for (slot, table) in s.tables.iter().enumerate() {
            for t in table.named_host().unwrap() {
                let bytes: Vec<u8> = t.values.iter().flat_map(|v| v.to_le_bytes()).collect();
                named.push((format!("{slot}/{}", t.name), t.shape, bytes));
            }
        }
        let header = Header {
            round: 4,
            strategy: "fedmr".into(),
            slots: 2,
            extra: s.extra.clone(),
        };
        let sha256 = checksum(&header, named.iter().map(|(n, _, b)| (n.as_str(), &b[..])));
        let stamped = serde_json::to_string(&Stamped { header, sha256 }).unwrap();
        let views = named.iter().map(|(n, shape, b)| {
            let view = TensorView::new(Dtype::F32, shape.clone(), b);
            (n.clone(), view.unwrap())
        });
        let expected =
            safetensors::serialize(views, Some(HashMap::from([(KEY.to_string(), stamped)])));
        assert_eq!(std::fs::read(&path).unwrap(), expected.unwrap());
    }

    #[test]
    fn damaged_tensor_bytes_are_refused_as_corrupt() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c");
        let s = state();
        save(&path, 1, "fedavg", &s).unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 10] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();
        let err = load(&path, &s.tables[0], &device())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("is corrupt") && err.contains("SHA-256"),
            "{err}"
        );
    }

    #[test]
    fn checkpoints_without_a_checksum_still_load() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old");
        let s = state();
        let host: Vec<_> = s.tables[0].named_host().unwrap();
        let named: Vec<_> = host
            .iter()
            .map(|t| {
                let bytes: Vec<u8> = t.values.iter().flat_map(|v| v.to_le_bytes()).collect();
                (format!("0/{}", t.name), t.shape.clone(), bytes)
            })
            .collect();
        let views = named.iter().map(|(n, shape, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, shape.clone(), b).unwrap(),
            )
        });
        let meta = HashMap::from([
            ("fl.round".to_string(), "2".to_string()),
            ("fl.strategy".to_string(), "fedmr".to_string()),
            ("fl.slots".to_string(), "1".to_string()),
            ("fl.extra".to_string(), "null".to_string()),
        ]);
        std::fs::write(&path, safetensors::serialize(views, Some(meta)).unwrap()).unwrap();
        let back = load(&path, &s.tables[0], &device()).unwrap();
        assert_eq!((back.round, back.strategy.as_str()), (2, "fedmr"));
        assert_eq!(flat(&back.state.tables[0]), flat(&s.tables[0]));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 64, ..Default::default() })]

        /// Damaged checkpoints (bytes flipped, cut short, or noise) are an error, never a panic,
        /// and never load as something else than what was saved.
        #[test]
        fn damaged_checkpoints_never_panic(
            at in proptest::prelude::any::<usize>(),
            noise in proptest::collection::vec(proptest::prelude::any::<u8>(), 1..64),
            cut in proptest::prelude::any::<bool>(),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("c");
            let s = state();
            save(&path, 4, "fedavg", &s).unwrap();
            let mut bytes = std::fs::read(&path).unwrap();
            let n = bytes.len();
            if cut {
                bytes.truncate(at % n);
            } else {
                for (k, x) in noise.iter().enumerate() {
                    bytes[(at + k) % n] ^= x | 1;
                }
            }
            std::fs::write(&path, &bytes).unwrap();
            if let Ok(back) = load(&path, &s.tables[0], &device()) {
                // Only damage to the header's padding can leave it readable.
                proptest::prop_assert_eq!(back.round, 4);
                proptest::prop_assert_eq!(flat(&back.state.tables[1]), flat(&s.tables[1]));
            }
        }
    }
}
