use std::sync::Arc;

use crate::DataError;

/// Per-channel normalisation applied when a batch is turned into `f32`:
/// `x = (pixel / 255 - mean[c]) / std[c]`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Normalization {
    /// Mean per channel, in `[0, 1]` pixel units.
    pub mean: Vec<f32>,
    /// Standard deviation per channel, in `[0, 1]` pixel units.
    pub std: Vec<f32>,
}

/// A labelled image dataset held once in memory as `u8` pixels (N×C×H×W, row-major).
///
/// Clients refer to samples by index; nothing is copied per client, and clones share the
/// samples.
#[derive(Debug, Clone)]
pub struct Dataset {
    images: Arc<Vec<u8>>,
    labels: Arc<Vec<u16>>,
    channels: usize,
    height: usize,
    width: usize,
    num_classes: usize,
}

impl Dataset {
    /// Per-channel mean and standard deviation of the pixels (in `[0, 1]` units), for datasets
    /// without published statistics.
    pub fn channel_stats(&self) -> Normalization {
        let plane = self.height * self.width;
        let (mut mean, mut std) = (Vec::new(), Vec::new());
        for c in 0..self.channels {
            let (mut sum, mut sq, mut n) = (0f64, 0f64, 0f64);
            for image in self.images.chunks_exact(self.channels * plane) {
                for &p in &image[c * plane..(c + 1) * plane] {
                    let x = p as f64 / 255.0;
                    sum += x;
                    sq += x * x;
                    n += 1.0;
                }
            }
            let m = sum / n.max(1.0);
            mean.push(m as f32);
            std.push(((sq / n.max(1.0) - m * m).max(1e-12)).sqrt() as f32);
        }
        Normalization { mean, std }
    }

    /// Builds a dataset, checking that pixel and label counts agree and every label is a class.
    pub fn new(
        images: Vec<u8>,
        labels: Vec<u16>,
        [channels, height, width]: [usize; 3],
        num_classes: usize,
    ) -> Result<Self, DataError> {
        let sample = channels * height * width;
        if sample == 0 || images.len() != labels.len() * sample {
            return Err(DataError::corrupt(
                "<dataset>",
                format!(
                    "{} pixels do not make {} images of {channels}x{height}x{width}",
                    images.len(),
                    labels.len()
                ),
            ));
        }
        if let Some(bad) = labels.iter().find(|&&l| l as usize >= num_classes) {
            return Err(DataError::corrupt(
                "<dataset>",
                format!("label {bad} out of range for {num_classes} classes"),
            ));
        }
        Ok(Self {
            images: Arc::new(images),
            labels: Arc::new(labels),
            channels,
            height,
            width,
            num_classes,
        })
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether the dataset has no samples.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Image shape `[channels, height, width]`.
    pub fn image_shape(&self) -> [usize; 3] {
        [self.channels, self.height, self.width]
    }

    /// Number of classes the labels index into.
    pub fn num_classes(&self) -> usize {
        self.num_classes
    }

    /// All labels, in sample order.
    pub fn labels(&self) -> &[u16] {
        &self.labels
    }

    /// The distinct classes of the samples `indices`, ascending (a client's label set).
    pub fn classes_of(&self, indices: &[usize]) -> Vec<usize> {
        let mut classes: Vec<usize> = indices.iter().map(|&i| self.labels[i] as usize).collect();
        classes.sort_unstable();
        classes.dedup();
        classes
    }

    /// The raw pixels of sample `index` (C×H×W bytes).
    pub fn image(&self, index: usize) -> &[u8] {
        let size = self.channels * self.height * self.width;
        &self.images[index * size..(index + 1) * size]
    }

    /// Gathers the samples at `indices` into a normalised `f32` batch (N×C×H×W) and its labels.
    pub fn batch(&self, indices: &[usize], norm: &Normalization) -> (Vec<f32>, Vec<i64>) {
        let plane = self.height * self.width;
        let mut pixels = Vec::with_capacity(indices.len() * self.channels * plane);
        let mut labels = Vec::with_capacity(indices.len());
        for &i in indices {
            let image = self.image(i);
            for c in 0..self.channels {
                let (mean, inv_std) = (norm.mean[c], 1.0 / norm.std[c]);
                pixels.extend(
                    image[c * plane..(c + 1) * plane]
                        .iter()
                        .map(|&p| (p as f32 / 255.0 - mean) * inv_std),
                );
            }
            labels.push(self.labels[i] as i64);
        }
        (pixels, labels)
    }

    /// The samples of `self` followed by those of `other` (same image shape and classes), e.g.
    /// to pool a dataset's training and test sets before a custom split.
    pub fn concat(&self, other: &Self) -> Result<Self, DataError> {
        if self.image_shape() != other.image_shape() || self.num_classes != other.num_classes {
            return Err(DataError::corrupt(
                "<dataset>",
                format!(
                    "cannot pool {:?} images of {} classes with {:?} images of {} classes",
                    self.image_shape(),
                    self.num_classes,
                    other.image_shape(),
                    other.num_classes
                ),
            ));
        }
        let mut pooled = self.clone();
        Arc::make_mut(&mut pooled.images).extend_from_slice(&other.images);
        Arc::make_mut(&mut pooled.labels).extend_from_slice(&other.labels);
        Ok(pooled)
    }

    /// Splits off the samples at `indices` into a new dataset (used for the embedded copy).
    pub fn subset(&self, indices: &[usize]) -> Self {
        let mut images = Vec::with_capacity(indices.len() * self.image(0).len());
        let mut labels = Vec::with_capacity(indices.len());
        for &i in indices {
            images.extend_from_slice(self.image(i));
            labels.push(self.labels[i]);
        }
        Self {
            images: Arc::new(images),
            labels: Arc::new(labels),
            ..*self
        }
    }
}

/// A training set (split among clients) and a test set (for the global model), plus how to
/// normalise them.
#[derive(Debug, Clone)]
pub struct FederatedDataset {
    /// Dataset name, e.g. `fashion-mnist`.
    pub name: String,
    /// Where it was read from (a directory, or `embedded`).
    pub origin: String,
    /// Samples the clients train on.
    pub train: Dataset,
    /// Samples the server evaluates on.
    pub test: Dataset,
    /// Per-channel normalisation used by the trainer and evaluator.
    pub normalization: Normalization,
    /// The dataset's own client split, if it has one (FEMNIST: one client per writer), as
    /// training-set indices.
    pub natural_clients: Option<Vec<Vec<usize>>>,
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_label_set_is_the_distinct_classes_ascending() {
        let data = crate::source::synthetic(40, [1, 4, 4], 10, 1);
        let idx = [3, 7, 3, 12, 30];
        let mut expected: Vec<usize> = idx.iter().map(|&i| data.labels()[i] as usize).collect();
        expected.sort_unstable();
        expected.dedup();
        assert_eq!(data.classes_of(&idx), expected);
        assert!(data.classes_of(&[]).is_empty());
    }
}
