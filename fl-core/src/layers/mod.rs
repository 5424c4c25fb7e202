//! The record-level layer API: any Burn module seen as an ordered table of named tensors.
//!
//! A [`ParamTable`] holds one flattened device tensor per parameter or buffer of a module, in the
//! module's visiting order, under its dotted path (`conv1.weight`, `bn1.running_var`). Tensors are
//! grouped into **layers** (all tensors of one leaf module: a convolution's weight and bias, a
//! BatchNorm's gamma, beta and running statistics) and, when the model declares them, **blocks**
//! (ordered groups of layers with input and output shapes, e.g. a residual unit).
//!
//! Every operation works on device tensors; table values are reference-counted handles, so
//! dispatching a table to a client or permuting layers between models never copies weights.
//!
//! Burn 0.22 traps this module takes care of (each has a test):
//! - `Module::clone()` shares BatchNorm running statistics between clones: [`ParamTable::load_into`]
//!   first detaches the target with `valid()`, so loaded copies never share state.
//! - A visited running statistic is one batch stale until synced: [`ParamTable::from_module`]
//!   reads `module.valid()`, which syncs.
//! - A value loaded into an autodiff model must be re-attached to autodiff, or training silently
//!   stops: loading keeps each target parameter's device, autodiff context and `require_grad`.
//! - `valid()` then `train()` drops a gradient-checkpointing strategy (back to none): loading
//!   puts the target's strategy back, so a model built on a checkpointing device keeps it.

use std::collections::HashMap;
use std::sync::Arc;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Device, GradientCheckpointingStrategy, Tensor, TensorData};

mod arith;
mod parts;
mod recombine;
mod similarity;

pub use recombine::{Recombination, recombine};
pub use similarity::{cosine, sum_products};

/// Errors of the layer API.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    /// Two tables (or a table and a module) do not have the same parameters.
    #[error("parameter layouts differ: {0}")]
    LayoutMismatch(String),
    /// An operation needs at least one table.
    #[error("no tables given")]
    Empty,
    /// Weights must be finite, non-negative and not all zero.
    #[error("invalid averaging weights: {0}")]
    BadWeights(String),
    /// A model's block declaration does not cover its layers exactly once.
    #[error("invalid block declaration: {0}")]
    BadBlocks(String),
    /// A granularity that cannot be applied.
    #[error("invalid granularity: {0}")]
    BadGranularity(String),
    /// Tensor data could not be read back from the device.
    #[error("cannot read tensor data: {0}")]
    Data(String),
}

/// Whether a tensor is trained by the optimiser or is a statistic updated in the forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ParamKind {
    /// A trainable parameter (weights, biases, BatchNorm gamma/beta).
    Trainable,
    /// A buffer such as a BatchNorm running mean or variance.
    Buffer,
}

/// Names of the buffers Burn's normalisation layers keep (Burn's visitor does not tell them apart
/// from parameters, so they are recognised by field name).
const BUFFER_NAMES: [&str; 2] = ["running_mean", "running_var"];

/// A model-declared group of layers, with the shapes it maps between (batch dimension omitted).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockSpec {
    /// A readable name, e.g. `stage1.unit0`.
    pub name: String,
    /// Path prefixes of the modules in this block (`conv1` matches `conv1.weight`, `conv1.bias`).
    pub modules: Vec<String>,
    /// Shape of the block's input, e.g. `[16, 32, 32]`.
    pub input_shape: Vec<usize>,
    /// Shape of the block's output.
    pub output_shape: Vec<usize>,
}

/// One tensor's description in a [`Layout`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Dotted module path, e.g. `fc1.weight`.
    pub name: String,
    /// The tensor's shape in the module.
    pub shape: Vec<usize>,
    /// Trainable parameter or buffer.
    pub kind: ParamKind,
    /// Index of the layer it belongs to.
    pub layer: usize,
}

/// The shared description of a table: tensor names and shapes, layers and blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    tensors: Vec<TensorInfo>,
    layers: Vec<(String, Vec<usize>)>,
    blocks: Vec<(BlockSpec, Vec<usize>)>,
}

impl Layout {
    fn new(tensors: Vec<(String, Vec<usize>)>) -> Self {
        let mut layers: Vec<(String, Vec<usize>)> = Vec::new();
        let mut infos = Vec::with_capacity(tensors.len());
        for (i, (name, shape)) in tensors.into_iter().enumerate() {
            let (prefix, leaf) = name.rsplit_once('.').unwrap_or(("", name.as_str()));
            let kind = if BUFFER_NAMES.contains(&leaf) {
                ParamKind::Buffer
            } else {
                ParamKind::Trainable
            };
            let layer = match layers.iter().position(|(l, _)| l == prefix) {
                Some(l) => l,
                None => {
                    layers.push((prefix.to_string(), Vec::new()));
                    layers.len() - 1
                }
            };
            layers[layer].1.push(i);
            infos.push(TensorInfo {
                name,
                shape,
                kind,
                layer,
            });
        }
        Self {
            tensors: infos,
            layers,
            blocks: Vec::new(),
        }
    }

    /// The tensors, in module order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Layer names (module paths) with the indices of their tensors.
    pub fn layers(&self) -> &[(String, Vec<usize>)] {
        &self.layers
    }

    /// Declared blocks with the indices of their tensors (empty if the model declared none).
    pub fn blocks(&self) -> &[(BlockSpec, Vec<usize>)] {
        &self.blocks
    }

    /// The number of elements of each declared block's tensors that `keep` accepts (all of
    /// them, or only the trainable ones), in block order.
    pub fn block_sizes(&self, keep: impl Fn(&TensorInfo) -> bool) -> Vec<usize> {
        self.blocks
            .iter()
            .map(|(_, members)| {
                members
                    .iter()
                    .map(|&t| &self.tensors[t])
                    .filter(|t| keep(t))
                    .map(|t| t.shape.iter().product::<usize>())
                    .sum()
            })
            .collect()
    }

    fn with_blocks(mut self, specs: Vec<BlockSpec>) -> Result<Self, LayerError> {
        let mut owner: Vec<Option<usize>> = vec![None; self.tensors.len()];
        let mut blocks = Vec::with_capacity(specs.len());
        for (b, spec) in specs.into_iter().enumerate() {
            let mut members = Vec::new();
            for prefix in &spec.modules {
                let matched: Vec<usize> = (0..self.tensors.len())
                    .filter(|&i| {
                        let n = &self.tensors[i].name;
                        n.strip_prefix(prefix.as_str())
                            .is_some_and(|rest| rest.starts_with('.'))
                    })
                    .collect();
                if matched.is_empty() {
                    return Err(LayerError::BadBlocks(format!(
                        "block '{}' names module '{prefix}', which has no tensors",
                        spec.name
                    )));
                }
                for i in matched {
                    if let Some(other) = owner[i].replace(b) {
                        return Err(LayerError::BadBlocks(format!(
                            "tensor '{}' is in blocks {other} and {b}",
                            self.tensors[i].name
                        )));
                    }
                    members.push(i);
                }
            }
            members.sort_unstable();
            blocks.push((spec, members));
        }
        if let Some(i) = owner.iter().position(Option::is_none) {
            return Err(LayerError::BadBlocks(format!(
                "tensor '{}' belongs to no block",
                self.tensors[i].name
            )));
        }
        self.blocks = blocks;
        Ok(self)
    }

    fn check_same(&self, other: &Layout) -> Result<(), LayerError> {
        if self.tensors.len() != other.tensors.len() {
            return Err(LayerError::LayoutMismatch(format!(
                "{} tensors vs {}",
                self.tensors.len(),
                other.tensors.len()
            )));
        }
        for (a, b) in self.tensors.iter().zip(&other.tensors) {
            if a.name != b.name || a.shape != b.shape {
                return Err(LayerError::LayoutMismatch(format!(
                    "'{}' {:?} vs '{}' {:?}",
                    a.name, a.shape, b.name, b.shape
                )));
            }
        }
        Ok(())
    }
}

/// A host copy of one tensor of a table.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Dotted module path.
    pub name: String,
    /// Shape in the module.
    pub shape: Vec<usize>,
    /// Values, row-major.
    pub values: Vec<f32>,
}

/// The unit that [`recombine()`] permutes across models.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "level", rename_all = "kebab-case")]
pub enum Granularity {
    /// Every tensor on its own (weight, bias and each BatchNorm statistic independently).
    Tensor,
    /// All tensors of one layer move together.
    Layer,
    /// All tensors of one declared block move together.
    Block,
    /// The layers cut into `⌈1/fraction⌉` contiguous segments; `fraction = 1` moves whole models.
    Segments {
        /// Fraction of the layers in one segment, in `(0, 1]`.
        fraction: f64,
    },
}

/// A model as an ordered table of named, flattened device tensors. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct ParamTable {
    layout: Arc<Layout>,
    values: Vec<Tensor<1>>,
}

struct Extractor {
    path: Vec<String>,
    tensors: Vec<(String, Vec<usize>)>,
    values: Vec<Tensor<1>>,
}

impl ModuleVisitor for Extractor {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let tensor = param.val();
        let shape = tensor.dims().to_vec();
        let numel = shape.iter().product::<usize>();
        self.tensors.push((self.path.join("."), shape));
        self.values.push(tensor.reshape([numel]));
    }
}

struct Loader<'a> {
    values: &'a [Tensor<1>],
    layout: &'a Layout,
    next: usize,
    error: Option<LayerError>,
}

impl ModuleMapper for Loader<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let i = self.next;
        self.next += 1;
        let Some(info) = self.layout.tensors.get(i) else {
            self.error.get_or_insert(LayerError::LayoutMismatch(
                "module has more tensors than the table".into(),
            ));
            return param;
        };
        let target: Vec<usize> = param.lazy_shape().as_slice().to_vec();
        if target != info.shape {
            self.error.get_or_insert(LayerError::LayoutMismatch(format!(
                "tensor {i} ('{}') is {:?} in the table but {target:?} in the module",
                info.name, info.shape
            )));
            return param;
        }
        let dims: [usize; D] = target.try_into().expect("rank checked by shape equality");
        let value = self.values[i].clone().reshape(dims);
        let id = param.id;
        // Keeps the parameter's device (with its autodiff context) and require_grad setting.
        param.transform_for_load(value, id)
    }
}

/// Puts a gradient-checkpointing strategy on every float parameter (`train()` re-attaches
/// autodiff without the one the module had).
struct Checkpointing(GradientCheckpointingStrategy);

impl ModuleMapper for Checkpointing {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let strategy = self.0;
        param.map(|t| t.with_gradient_checkpointing_strategy(strategy))
    }
}

impl ParamTable {
    /// Reads every float tensor of `module`, synced and detached (through `module.valid()`).
    pub fn from_module<M: Module>(module: &M) -> Self {
        Self::from_module_tracked(&module.valid())
    }

    /// Reads `module`'s tensors as they are, keeping the autodiff graph: for loss terms over
    /// parameters (FedProx, ...). BatchNorm statistics may be one update stale.
    pub fn from_module_tracked<M: Module>(module: &M) -> Self {
        let mut ex = Extractor {
            path: Vec::new(),
            tensors: Vec::new(),
            values: Vec::new(),
        };
        module.visit(&mut ex);
        Self {
            layout: Arc::new(Layout::new(ex.tensors)),
            values: ex.values,
        }
    }

    /// Like [`from_module`](Self::from_module), also attaching the model's declared blocks.
    pub fn from_module_with_blocks<M: Module>(
        module: &M,
        blocks: Vec<BlockSpec>,
    ) -> Result<Self, LayerError> {
        let table = Self::from_module(module);
        let layout = Arc::unwrap_or_clone(table.layout).with_blocks(blocks)?;
        Ok(Self {
            layout: Arc::new(layout),
            values: table.values,
        })
    }

    /// Writes this table's values into `module` and returns it.
    ///
    /// The module is first detached with `valid()` (so the result shares no BatchNorm state with
    /// clones of the input) and, if its parameters were on an autodiff device, put back into
    /// training mode with `train()`, with the gradient-checkpointing strategy its parameters had.
    /// Parameter ids, devices and `require_grad` are kept, so an
    /// optimiser created for the result works as for any freshly built module.
    pub fn load_into<M: Module>(&self, module: M) -> Result<M, LayerError> {
        let devices = module.devices();
        let autodiff = devices.iter().any(Device::is_autodiff);
        let checkpointing = devices
            .iter()
            .find_map(Device::gradient_checkpointing_strategy)
            .filter(|s| *s != GradientCheckpointingStrategy::Disabled);
        let detached = module.valid();
        let mut loader = Loader {
            values: &self.values,
            layout: &self.layout,
            next: 0,
            error: None,
        };
        let loaded = detached.map(&mut loader);
        if let Some(e) = loader.error {
            return Err(e);
        }
        if loader.next != self.values.len() {
            return Err(LayerError::LayoutMismatch(format!(
                "module has {} tensors, the table {}",
                loader.next,
                self.values.len()
            )));
        }
        Ok(match (autodiff, checkpointing) {
            (true, Some(strategy)) => loaded.train().map(&mut Checkpointing(strategy)),
            (true, None) => loaded.train(),
            (false, _) => loaded,
        })
    }

    /// The shared layout (names, shapes, layers, blocks).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The flattened tensors, in layout order.
    pub fn values(&self) -> &[Tensor<1>] {
        &self.values
    }

    /// Builds a table with the same layout and new values (one per tensor, same sizes).
    pub fn with_values(&self, values: Vec<Tensor<1>>) -> Result<Self, LayerError> {
        if values.len() != self.values.len() {
            return Err(LayerError::LayoutMismatch(format!(
                "{} values for {} tensors",
                values.len(),
                self.values.len()
            )));
        }
        Ok(Self {
            layout: self.layout.clone(),
            values,
        })
    }

    /// Number of scalar values.
    pub fn num_elements(&self) -> usize {
        self.layout
            .tensors
            .iter()
            .map(|t| t.shape.iter().product::<usize>())
            .sum()
    }

    /// Number of trainable scalar values (what PyTorch's `parameters()` counts: BatchNorm running
    /// statistics excluded, unlike Burn's `Module::num_params`).
    pub fn num_trainable(&self) -> usize {
        self.layout
            .tensors
            .iter()
            .filter(|t| t.kind == ParamKind::Trainable)
            .map(|t| t.shape.iter().product::<usize>())
            .sum()
    }

    /// Size in bytes when sent over a network as `f32`.
    pub fn byte_size(&self) -> usize {
        self.num_elements() * std::mem::size_of::<f32>()
    }

    /// The device the tensors live on.
    pub fn device(&self) -> Device {
        self.values[0].device()
    }

    fn check_same(&self, other: &Self) -> Result<(), LayerError> {
        if Arc::ptr_eq(&self.layout, &other.layout) {
            return Ok(());
        }
        self.layout.check_same(&other.layout)
    }

    /// Copies all values to the host, one `Vec<f32>` per tensor (for checkpoints and tests).
    pub fn to_host(&self) -> Result<Vec<Vec<f32>>, LayerError> {
        self.values.iter().map(|v| host_f32(v.clone())).collect()
    }

    /// Builds a table with this layout from host values on `device`.
    pub fn from_host(&self, host: Vec<Vec<f32>>, device: &Device) -> Result<Self, LayerError> {
        let values = host
            .into_iter()
            .zip(&self.layout.tensors)
            .map(|(v, info)| {
                let n = info.shape.iter().product::<usize>();
                if v.len() != n {
                    return Err(LayerError::LayoutMismatch(format!(
                        "'{}' needs {n} values, got {}",
                        info.name,
                        v.len()
                    )));
                }
                Ok(Tensor::from_data(TensorData::new(v, [n]), device))
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.with_values(values)
    }

    /// A host copy of tensor `i` (in [`Layout::tensors`] order), without copying the others.
    pub fn tensor_host(&self, i: usize) -> Result<Vec<f32>, LayerError> {
        host_f32(self.values[i].clone())
    }

    /// Named host copies of all tensors, e.g. to serialise.
    pub fn named_host(&self) -> Result<Vec<HostTensor>, LayerError> {
        Ok(self
            .to_host()?
            .into_iter()
            .zip(&self.layout.tensors)
            .map(|(values, info)| HostTensor {
                name: info.name.clone(),
                shape: info.shape.clone(),
                values,
            })
            .collect())
    }

    /// Loads named host values (as from [`named_host`](Self::named_host)) into this layout.
    pub fn from_named_host(
        &self,
        mut named: HashMap<String, Vec<f32>>,
        device: &Device,
    ) -> Result<Self, LayerError> {
        let host = self
            .layout
            .tensors
            .iter()
            .map(|info| {
                named.remove(&info.name).ok_or_else(|| {
                    LayerError::LayoutMismatch(format!("missing tensor '{}'", info.name))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(extra) = named.keys().next() {
            return Err(LayerError::LayoutMismatch(format!(
                "unexpected tensor '{extra}'"
            )));
        }
        self.from_host(host, device)
    }
}

fn host_f32(t: Tensor<1>) -> Result<Vec<f32>, LayerError> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| LayerError::Data(format!("{e:?}")))
}

#[cfg(test)]
mod tests;
