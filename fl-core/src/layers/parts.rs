//! Tables built from named tensors rather than read from a module: several tables side by side
//! under prefixes (a Bayesian model's means and scales travel as one table).

use burn::tensor::Tensor;

use super::{LayerError, Layout, ParamTable};
use std::sync::Arc;

impl ParamTable {
    /// A table of `(name, shape, value)` tensors, `value` flattened. Names ending in
    /// `running_mean` / `running_var` are buffers, as in a module's table.
    pub fn from_parts(parts: Vec<(String, Vec<usize>, Tensor<1>)>) -> Result<Self, LayerError> {
        if parts.is_empty() {
            return Err(LayerError::Empty);
        }
        let mut names = std::collections::HashSet::new();
        let mut tensors = Vec::with_capacity(parts.len());
        let mut values = Vec::with_capacity(parts.len());
        for (name, shape, value) in parts {
            let n: usize = shape.iter().product();
            if value.dims() != [n] {
                return Err(LayerError::LayoutMismatch(format!(
                    "'{name}' has shape {shape:?} but {} values",
                    value.dims()[0]
                )));
            }
            if !names.insert(name.clone()) {
                return Err(LayerError::LayoutMismatch(format!(
                    "'{name}' appears twice"
                )));
            }
            tensors.push((name, shape));
            values.push(value);
        }
        Ok(Self {
            layout: Arc::new(Layout::new(tensors)),
            values,
        })
    }

    /// Tensors `indices` of this table (in that order), named `prefix.<name>`.
    pub fn prefixed(
        &self,
        prefix: &str,
        indices: impl IntoIterator<Item = usize>,
    ) -> Vec<(String, Vec<usize>, Tensor<1>)> {
        indices
            .into_iter()
            .map(|i| {
                let info = &self.layout.tensors[i];
                (
                    format!("{prefix}.{}", info.name),
                    info.shape.clone(),
                    self.values[i].clone(),
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::ParamKind;
    use crate::test_model::tiny;

    #[test]
    fn prefixed_parts_rebuild_a_table_with_the_same_values_and_kinds() {
        let t = ParamTable::from_module(&tiny(3));
        let n = t.values().len();
        let mut parts = t.prefixed("a", 0..n);
        parts.extend(t.prefixed("b", [0]));
        let both = ParamTable::from_parts(parts).unwrap();
        assert_eq!(both.values().len(), n + 1);
        assert_eq!(both.layout().tensors()[0].name, "a.conv.weight");
        assert_eq!(both.layout().tensors()[n].name, "b.conv.weight");
        let kinds = |t: &ParamTable| {
            t.layout()
                .tensors()
                .iter()
                .map(|i| i.kind)
                .collect::<Vec<_>>()
        };
        assert_eq!(kinds(&both)[..n], kinds(&t)[..]);
        assert!(kinds(&both).contains(&ParamKind::Buffer));
        assert_eq!(both.to_host().unwrap()[..n], t.to_host().unwrap()[..]);
        // Duplicate names and wrong sizes are refused.
        assert!(ParamTable::from_parts(t.prefixed("a", [0, 0])).is_err());
        let mut bad = t.prefixed("a", [0]);
        bad[0].1 = vec![1];
        assert!(ParamTable::from_parts(bad).is_err());
    }
}
