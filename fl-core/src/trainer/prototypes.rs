//! A client's per-class mean representations (FedGH's prototypes, FedProto's too).

use fl_data::{Dataset, Normalization};

use super::{TrainError, make_batch, model_device};
use crate::model::Classifier;

/// Per-class mean representations of one client's samples: for each class it holds, the
/// number of its samples and the mean of their representations
/// ([`Classifier::features`], in inference mode).
#[derive(Debug, Clone, PartialEq)]
pub struct Prototypes {
    /// `(class, samples, mean representation)`, by class.
    pub classes: Vec<(usize, usize, Vec<f32>)>,
}

impl Prototypes {
    /// The prototypes of `model` (in inference mode) over `indices`, computed in batches of
    /// `batch` (the mean over all samples of a class, not of batch means).
    pub fn of<M: Classifier>(
        model: &M,
        data: &Dataset,
        norm: &Normalization,
        indices: &[usize],
        batch: usize,
    ) -> Result<Self, TrainError> {
        let device = model_device(model);
        let labels = data.labels();
        let mut sums: std::collections::BTreeMap<usize, (usize, Vec<f64>)> = Default::default();
        for chunk in indices.chunks(batch.max(1)) {
            let (images, _) = make_batch(data, norm, chunk, &device);
            let features = model.features(images).ok_or(TrainError::NoFeatures)?;
            let width = features.dims()[1];
            let host: Vec<f32> = features.into_data().try_into_vec().expect("f32 features");
            for (row, &i) in host.chunks(width).zip(chunk) {
                let (n, sum) = sums
                    .entry(labels[i] as usize)
                    .or_insert_with(|| (0, vec![0.0; width]));
                *n += 1;
                for (s, &x) in sum.iter_mut().zip(row) {
                    *s += x as f64;
                }
            }
        }
        let classes = sums
            .into_iter()
            .map(|(c, (n, sum))| (c, n, sum.iter().map(|s| (s / n as f64) as f32).collect()))
            .collect();
        Ok(Self { classes })
    }

    /// Bytes of the upload: the mean representations and a class label each.
    pub fn byte_size(&self) -> usize {
        self.classes.iter().map(|(_, _, m)| 4 * m.len() + 4).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_model::{synthetic_data, tiny};

    #[test]
    fn prototypes_are_per_class_means_whatever_the_batching() {
        let (data, norm) = synthetic_data(30, 2);
        let indices: Vec<usize> = (3..30).collect();
        let model = tiny(4);
        let p = Prototypes::of(&model, &data, &norm, &indices, 4).unwrap();
        let q = Prototypes::of(&model, &data, &norm, &indices, 100).unwrap();
        let labels = data.labels();
        assert_eq!(p.classes.len(), q.classes.len());
        for ((c, n, mean), (c2, n2, mean2)) in p.classes.iter().zip(&q.classes) {
            assert_eq!((c, n), (c2, n2));
            let own: Vec<usize> = indices
                .iter()
                .copied()
                .filter(|&i| labels[i] as usize == *c)
                .collect();
            assert_eq!(*n, own.len());
            let (images, _) = make_batch(&data, &norm, &own, &model_device(&model));
            let f: Vec<f32> = model
                .features(images)
                .unwrap()
                .into_data()
                .try_into_vec()
                .unwrap();
            for (k, (&a, &b)) in mean.iter().zip(mean2).enumerate() {
                let expected = f.chunks(16).map(|r| r[k]).sum::<f32>() / own.len() as f32;
                assert!((a - expected).abs() < 1e-4 && (a - b).abs() < 1e-5);
            }
        }
        assert_eq!(p.byte_size(), p.classes.len() * (16 * 4 + 4));
    }
}
