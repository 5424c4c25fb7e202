//! Arithmetic on parameter tables: averages, mixes, differences, norms.

use burn::tensor::Tensor;

use super::{LayerError, ParamKind, ParamTable, host_f32};

impl ParamTable {
    /// Weighted average `Σ wᵢ·tableᵢ / Σ wᵢ` of tables with one layout (e.g. FedAvg by sample
    /// counts). `weights = None` is the unweighted mean.
    pub fn average(tables: &[ParamTable], weights: Option<&[f64]>) -> Result<Self, LayerError> {
        let first = tables.first().ok_or(LayerError::Empty)?;
        for t in &tables[1..] {
            first.check_same(t)?;
        }
        let w: Vec<f64> = match weights {
            None => vec![1.0; tables.len()],
            Some(w) if w.len() != tables.len() => {
                return Err(LayerError::BadWeights(format!(
                    "{} weights for {} tables",
                    w.len(),
                    tables.len()
                )));
            }
            Some(w) => w.to_vec(),
        };
        let total: f64 = w.iter().sum();
        if w.iter().any(|x| !x.is_finite() || *x < 0.0) || total <= 0.0 {
            return Err(LayerError::BadWeights(format!("{w:?}")));
        }
        let values = (0..first.values.len())
            .map(|i| {
                let mut acc = first.values[i].clone().mul_scalar(w[0] / total);
                for (t, wk) in tables.iter().zip(&w).skip(1) {
                    acc = acc.add(t.values[i].clone().mul_scalar(wk / total));
                }
                acc
            })
            .collect();
        Ok(Self {
            layout: first.layout.clone(),
            values,
        })
    }

    /// `alpha·self + (1 − alpha)·other`, tensor by tensor (FedCross's fusion).
    pub fn mix(&self, other: &Self, alpha: f64) -> Result<Self, LayerError> {
        self.combine(alpha, other, 1.0 - alpha)
    }

    /// `a·self + b·other`, tensor by tensor: the one primitive behind server-side update
    /// arithmetic (pseudo-gradients `x − y`, momentum `β·v + Δ`, steps `x − η·Δ`).
    pub fn combine(&self, a: f64, other: &Self, b: f64) -> Result<Self, LayerError> {
        self.check_same(other)?;
        let values = self
            .values
            .iter()
            .zip(&other.values)
            .map(|(x, y)| x.clone().mul_scalar(a).add(y.clone().mul_scalar(b)))
            .collect();
        Ok(Self {
            layout: self.layout.clone(),
            values,
        })
    }

    /// `self − other` (e.g. a client's update `y − x`).
    pub fn sub(&self, other: &Self) -> Result<Self, LayerError> {
        self.combine(1.0, other, -1.0)
    }

    /// Every tensor multiplied by `s`.
    pub fn scale(&self, s: f64) -> Self {
        Self {
            layout: self.layout.clone(),
            values: self
                .values
                .iter()
                .map(|v| v.clone().mul_scalar(s))
                .collect(),
        }
    }

    /// A table of the same layout filled with zeros.
    pub fn zeros_like(&self) -> Self {
        Self {
            layout: self.layout.clone(),
            values: self.values.iter().map(Tensor::zeros_like).collect(),
        }
    }

    /// Squared Euclidean norm over all tensors (one host read).
    pub fn sq_norm(&self) -> Result<f64, LayerError> {
        let parts: Vec<Tensor<1>> = self
            .values
            .iter()
            .map(|v| v.clone().square().sum())
            .collect();
        Ok(host_f32(Tensor::cat(parts, 0))?
            .iter()
            .map(|&x| x as f64)
            .sum())
    }

    /// `Σ f(w, o)` over the trainable tensors, `w` from `self` and `o` the same tensor of
    /// `other` (moved to `self`'s device), where `f` reduces a pair to one value. It stays on
    /// the autodiff graph: the building block of local loss terms such as FedProx's
    /// `‖w − w₀‖²`.
    pub fn trainable_sum(
        &self,
        other: &Self,
        f: impl Fn(Tensor<1>, Tensor<1>) -> Tensor<1>,
    ) -> Tensor<1> {
        let device = self.device();
        let terms: Vec<Tensor<1>> = self
            .values
            .iter()
            .zip(&other.values)
            .zip(&self.layout.tensors)
            .filter(|(_, info)| info.kind == ParamKind::Trainable)
            .map(|((w, o), _)| f(w.clone(), o.clone().to_device(&device)))
            .collect();
        Tensor::cat(terms, 0).sum()
    }

    /// A copy of `self` whose [`ParamKind::Buffer`] tensors (BatchNorm statistics) are taken
    /// from `other`: used to aggregate only trainable parameters.
    pub fn with_buffers_from(&self, other: &Self) -> Result<Self, LayerError> {
        self.check_same(other)?;
        let values = self
            .values
            .iter()
            .zip(&other.values)
            .zip(&self.layout.tensors)
            .map(|((mine, theirs), info)| match info.kind {
                ParamKind::Buffer => theirs.clone(),
                ParamKind::Trainable => mine.clone(),
            })
            .collect();
        Ok(Self {
            layout: self.layout.clone(),
            values,
        })
    }

    /// Applies `f` to every tensor whose kind is `kind`; other tensors are kept as they are.
    pub fn map_kind(&self, kind: ParamKind, f: impl Fn(Tensor<1>) -> Tensor<1>) -> Self {
        let values = self
            .values
            .iter()
            .zip(&self.layout.tensors)
            .map(|(v, info)| {
                if info.kind == kind {
                    f(v.clone())
                } else {
                    v.clone()
                }
            })
            .collect();
        Self {
            layout: self.layout.clone(),
            values,
        }
    }
}
