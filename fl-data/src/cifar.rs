//! CIFAR-10 and CIFAR-100 in their standard **binary** distributions.
//!
//! - CIFAR-10 (`cifar-10-batches-bin/`): `data_batch_1.bin` … `data_batch_5.bin` (training set,
//!   in file order) and `test_batch.bin`; each record is 1 label byte and 3,072 pixel bytes
//!   (the red, green and blue 32×32 planes: already C×H×W).
//! - CIFAR-100 (`cifar-100-binary/`): `train.bin`, `test.bin`; each record is a coarse label
//!   byte (20 superclasses), a fine label byte (100 classes) and 3,072 pixel bytes.
//!
//! Either the extracted folder or its parent may be given.

use std::path::{Path, PathBuf};

use crate::{DataError, Dataset};

const PIXELS: usize = 3 * 32 * 32;

/// Which CIFAR and which labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CifarVariant {
    /// CIFAR-10, 10 classes.
    Cifar10,
    /// CIFAR-100 with its 100 fine labels.
    Cifar100Fine,
    /// CIFAR-100 with its 20 coarse labels (what the FedMR/FedCross code trains on).
    Cifar100Coarse,
}

impl CifarVariant {
    /// The folder the official archive extracts to.
    pub fn folder(self) -> &'static str {
        match self {
            Self::Cifar10 => "cifar-10-batches-bin",
            _ => "cifar-100-binary",
        }
    }

    /// Training and test files, in order.
    pub fn files(self) -> (Vec<String>, Vec<String>) {
        match self {
            Self::Cifar10 => (
                (1..=5).map(|i| format!("data_batch_{i}.bin")).collect(),
                vec!["test_batch.bin".into()],
            ),
            _ => (vec!["train.bin".into()], vec!["test.bin".into()]),
        }
    }

    /// Number of classes.
    pub fn num_classes(self) -> usize {
        match self {
            Self::Cifar10 => 10,
            Self::Cifar100Fine => 100,
            Self::Cifar100Coarse => 20,
        }
    }

    /// Bytes of labels before each record's pixels, and which of them is used.
    fn label_layout(self) -> (usize, usize) {
        match self {
            Self::Cifar10 => (1, 0),
            Self::Cifar100Coarse => (2, 0),
            Self::Cifar100Fine => (2, 1),
        }
    }

    /// The directory holding the files: `dir` itself or `dir/<folder>`.
    pub fn locate(self, dir: &Path) -> Option<PathBuf> {
        let (train, test) = self.files();
        [dir.to_path_buf(), dir.join(self.folder())]
            .into_iter()
            .find(|d| train.iter().chain(&test).all(|f| d.join(f).is_file()))
    }
}

/// Parses one binary file's records into `images` and `labels`.
fn read_records(
    path: &Path,
    variant: CifarVariant,
    images: &mut Vec<u8>,
    labels: &mut Vec<u16>,
) -> Result<(), DataError> {
    let bytes = std::fs::read(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let (label_bytes, which) = variant.label_layout();
    let record = label_bytes + PIXELS;
    if bytes.is_empty() || bytes.len() % record != 0 {
        return Err(DataError::corrupt(
            path,
            format!(
                "{} bytes is not a whole number of {record}-byte records (truncated or not a {} file?)",
                bytes.len(),
                variant.folder()
            ),
        ));
    }
    let classes = variant.num_classes();
    for (i, r) in bytes.chunks_exact(record).enumerate() {
        let label = r[which] as usize;
        if label >= classes {
            return Err(DataError::corrupt(
                path,
                format!("record {i}: label {label} out of range for {classes} classes"),
            ));
        }
        labels.push(label as u16);
        images.extend_from_slice(&r[label_bytes..]);
    }
    Ok(())
}

/// Reads the training and test sets from the directory found by [`CifarVariant::locate`].
pub fn read_cifar(dir: &Path, variant: CifarVariant) -> Result<(Dataset, Dataset), DataError> {
    let (train_files, test_files) = variant.files();
    let read = |files: &[String]| -> Result<Dataset, DataError> {
        let (mut images, mut labels) = (Vec::new(), Vec::new());
        for f in files {
            read_records(&dir.join(f), variant, &mut images, &mut labels)?;
        }
        Dataset::new(images, labels, [3, 32, 32], variant.num_classes())
    };
    Ok((read(&train_files)?, read(&test_files)?))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Writes a CIFAR binary file of `n` records whose pixels encode (record, channel).
    pub fn write_fixture(path: &Path, n: usize, label_bytes: &dyn Fn(usize) -> Vec<u8>) {
        let mut bytes = Vec::new();
        for i in 0..n {
            bytes.extend(label_bytes(i));
            for c in 0..3 {
                bytes.extend(std::iter::repeat_n((10 * i + c) as u8, 1024));
            }
        }
        std::fs::write(path, bytes).unwrap();
    }

    #[test]
    fn cifar10_reads_batches_in_order_with_planar_pixels() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("cifar-10-batches-bin");
        std::fs::create_dir(&dir).unwrap();
        for b in 1..=5 {
            write_fixture(&dir.join(format!("data_batch_{b}.bin")), 2, &|i| {
                vec![((b - 1) * 2 + i) as u8]
            });
        }
        write_fixture(&dir.join("test_batch.bin"), 3, &|i| vec![9 - i as u8]);
        // The parent folder works too.
        let found = CifarVariant::Cifar10.locate(root.path()).unwrap();
        let (train, test) = read_cifar(&found, CifarVariant::Cifar10).unwrap();
        assert_eq!(train.len(), 10);
        assert_eq!(train.labels(), &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(test.labels(), &[9, 8, 7]);
        assert_eq!(train.image_shape(), [3, 32, 32]);
        // Record 1 of batch 1: red plane 10, green 11, blue 12.
        let img = train.image(1);
        assert_eq!((img[0], img[1024], img[2048]), (10, 11, 12));
    }

    #[test]
    fn cifar100_selects_fine_or_coarse_labels() {
        let dir = tempfile::tempdir().unwrap();
        for f in ["train.bin", "test.bin"] {
            write_fixture(&dir.path().join(f), 4, &|i| {
                vec![(i % 20) as u8, (50 + i) as u8]
            });
        }
        let (coarse, _) = read_cifar(dir.path(), CifarVariant::Cifar100Coarse).unwrap();
        let (fine, _) = read_cifar(dir.path(), CifarVariant::Cifar100Fine).unwrap();
        assert_eq!(coarse.labels(), &[0, 1, 2, 3]);
        assert_eq!(coarse.num_classes(), 20);
        assert_eq!(fine.labels(), &[50, 51, 52, 53]);
        assert_eq!(fine.num_classes(), 100);
    }

    #[test]
    fn truncated_files_and_bad_labels_are_errors_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        for f in ["train.bin", "test.bin"] {
            write_fixture(&dir.path().join(f), 2, &|_| vec![1, 2]);
        }
        let train = dir.path().join("train.bin");
        let mut bytes = std::fs::read(&train).unwrap();
        bytes.pop();
        std::fs::write(&train, &bytes).unwrap();
        let e = read_cifar(dir.path(), CifarVariant::Cifar100Fine)
            .unwrap_err()
            .to_string();
        assert!(e.contains("train.bin") && e.contains("whole number"), "{e}");
        write_fixture(&train, 1, &|_| vec![25, 2]);
        let e = read_cifar(dir.path(), CifarVariant::Cifar100Coarse)
            .unwrap_err()
            .to_string();
        assert!(e.contains("label 25 out of range for 20"), "{e}");
    }
}
