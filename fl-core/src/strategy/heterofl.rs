//! HeteroFL (E. Diao, J. Ding and V. Tarokh, "HeteroFL: Computation and Communication
//! Efficient Federated Learning for Heterogeneous Clients", ICLR 2021): clients train
//! sub-models of one global architecture, each hidden layer cut to a fraction r of its width.
//!
//! - A client of rate r receives the global model's *leading corner*: the first ⌈r·w⌉
//!   channels or units of every hidden layer (the input channels and the classes stay), which
//!   is exactly its own model's shape ([`slice()`]).
//! - The server averages every parameter entry over the round's clients holding it, unweighted
//!   (the authors' code); an entry no client held keeps its value; entries of the output layer
//!   count only for the classes in the client's data (the authors' label split)
//!   ([`aggregate`]).
//! - Clients train with the scaler (hidden outputs divided by r while training, in
//!   `fl-models`) and the masked loss: logits of classes absent from their data are set to 0
//!   before the cross-entropy ([`MaskedLoss`]).
//!
//! Runs on pFedClub's per-client machinery (`--variant heterofl`); each client is evaluated
//! with its slice of the global model on its own test portion.

use super::StrategyError;
use crate::layers::ParamTable;
use crate::trainer::LocalObjective;

/// The client side of HeteroFL: the masked cross-entropy.
pub struct MaskedLoss;

impl LocalObjective for MaskedLoss {
    fn masks_absent_classes(&self) -> bool {
        true
    }

    fn uses_parameters(&self) -> bool {
        false
    }
}

/// For a tensor of shape `outer` and its leading corner of shape `inner`, the row-major index
/// into `outer` of every element of the corner, in the corner's row-major order.
pub fn corner_indices(outer: &[usize], inner: &[usize]) -> Vec<usize> {
    debug_assert_eq!(outer.len(), inner.len());
    let mut indices = vec![0usize];
    for (&o, &i) in outer.iter().zip(inner) {
        indices = indices
            .iter()
            .flat_map(|&base| (0..i).map(move |k| base * o + k))
            .collect();
    }
    indices
}

/// Checks that `sub`'s tensors are leading corners of `global`'s (same names, no dimension
/// larger).
pub fn check_fits(global: &ParamTable, sub: &ParamTable) -> Result<(), StrategyError> {
    let (g, s) = (global.layout().tensors(), sub.layout().tensors());
    let fits = g.len() == s.len()
        && g.iter().zip(s).all(|(g, s)| {
            g.name == s.name
                && g.shape.len() == s.shape.len()
                && g.shape.iter().zip(&s.shape).all(|(a, b)| b <= a)
        });
    if fits {
        Ok(())
    } else {
        Err(StrategyError::Config(
            "HeteroFL needs every client model to be a width-scaled copy of one architecture"
                .into(),
        ))
    }
}

/// The sub-model of `global` with `layout`'s shapes: the leading corner of every tensor.
pub fn slice(global: &ParamTable, layout: &ParamTable) -> Result<ParamTable, StrategyError> {
    check_fits(global, layout)?;
    let host = global.to_host()?;
    let device = global.device();
    let values = host
        .iter()
        .zip(global.layout().tensors())
        .zip(layout.layout().tensors())
        .map(|((v, g), s)| {
            corner_indices(&g.shape, &s.shape)
                .into_iter()
                .map(|i| v[i])
                .collect()
        })
        .collect();
    Ok(layout.from_host(values, &device)?)
}

/// One round's upload: the client's trained sub-model and the classes in its data.
pub struct Upload<'a> {
    /// The trained sub-model.
    pub table: &'a ParamTable,
    /// The classes the client holds (its output-layer entries count only for these).
    pub classes: &'a [usize],
}

/// HeteroFL's server step: every entry of `global` averaged over the uploads holding it,
/// unweighted; entries held by none keep their value. `head` is the output layer's (weight
/// `[D, C]`, bias `[C]`) tensor indices, whose class entries count only for clients holding
/// the class.
pub fn aggregate(
    global: &ParamTable,
    uploads: &[Upload<'_>],
    head: (usize, usize),
) -> Result<ParamTable, StrategyError> {
    let mut host = global.to_host()?;
    let tensors = global.layout().tensors();
    let mut sums: Vec<Vec<f64>> = host.iter().map(|v| vec![0.0; v.len()]).collect();
    let mut counts: Vec<Vec<u32>> = host.iter().map(|v| vec![0; v.len()]).collect();
    for up in uploads {
        check_fits(global, up.table)?;
        let values = up.table.to_host()?;
        for (t, v) in values.iter().enumerate() {
            let shape = &up.table.layout().tensors()[t].shape;
            let classes = shape.last().copied().unwrap_or(1);
            let indices = corner_indices(&tensors[t].shape, shape);
            for (k, (&i, &x)) in indices.iter().zip(v).enumerate() {
                // The class is the last index of the head's weight and bias.
                if (t == head.0 || t == head.1) && !up.classes.contains(&(k % classes)) {
                    continue;
                }
                sums[t][i] += x as f64;
                counts[t][i] += 1;
            }
        }
    }
    for ((v, s), n) in host.iter_mut().zip(&sums).zip(&counts) {
        for ((x, &s), &n) in v.iter_mut().zip(s).zip(n) {
            if n > 0 {
                *x = (s / n as f64) as f32;
            }
        }
    }
    Ok(global.from_host(host, &global.device())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_model::flat;
    use burn::nn::LinearConfig;

    fn linear(d: usize, c: usize, fill: f32) -> ParamTable {
        let t =
            ParamTable::from_module(&LinearConfig::new(d, c).init(&crate::test_model::device()));
        let host = vec![vec![fill; d * c], vec![fill; c]];
        t.from_host(host, &t.device()).unwrap()
    }

    #[test]
    fn corners_are_leading_indices_in_row_major_order() {
        assert_eq!(corner_indices(&[3, 4], &[2, 2]), vec![0, 1, 4, 5]);
        assert_eq!(corner_indices(&[2, 3, 2], &[1, 2, 1]), vec![0, 2]);
        assert_eq!(corner_indices(&[5], &[5]), (0..5).collect::<Vec<_>>());
    }

    #[test]
    fn entries_are_averaged_over_their_holders_and_the_rest_keep_their_value() {
        // Global: a 4→3 linear layer, all 10; two clients: 2→3 (value 1) and 4→3 (value 4),
        // both holding every class. The head is a different (unused) pair here.
        let global = linear(4, 3, 10.0);
        let (small, full) = (linear(2, 3, 1.0), linear(4, 3, 4.0));
        let all = [0, 1, 2];
        let ups = [
            Upload {
                table: &small,
                classes: &all,
            },
            Upload {
                table: &full,
                classes: &all,
            },
        ];
        let out = to_rows(&aggregate(&global, &ups, (usize::MAX, usize::MAX)).unwrap());
        // Rows 0-1 of the weight held by both: 2.5; rows 2-3 by the full one only: 4; bias: 2.5.
        assert_eq!(
            out[0],
            vec![2.5; 6]
                .into_iter()
                .chain(vec![4.0; 6])
                .collect::<Vec<_>>()
        );
        assert_eq!(out[1], vec![2.5; 3]);
        // Held by nobody: unchanged; held by all: their average.
        let only_small = aggregate(&global, &ups[..1], (usize::MAX, usize::MAX)).unwrap();
        assert_eq!(
            to_rows(&only_small)[0],
            vec![1.0; 6]
                .into_iter()
                .chain(vec![10.0; 6])
                .collect::<Vec<_>>()
        );
        // The head's class entries count only for the clients holding the class.
        let ups = [
            Upload {
                table: &small,
                classes: &[0],
            },
            Upload {
                table: &full,
                classes: &[0, 1],
            },
        ];
        let out = to_rows(&aggregate(&global, &ups, (0, 1)).unwrap());
        assert_eq!(out[1], vec![2.5, 4.0, 10.0]);
        assert_eq!(&out[0][..3], &[2.5, 4.0, 10.0]);
        assert_eq!(&out[0][9..], &[4.0, 4.0, 10.0]);
        // Slicing the global model gives the sub-model's shapes and the corner's values.
        let sub = slice(&aggregate(&global, &ups, (0, 1)).unwrap(), &small).unwrap();
        assert_eq!(flat(&sub)[..6], out[0][..6]);
        assert!(slice(&small, &global).is_err());
    }

    fn to_rows(t: &ParamTable) -> Vec<Vec<f32>> {
        t.to_host().unwrap()
    }
}
