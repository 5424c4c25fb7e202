use std::path::PathBuf;

/// Everything that can go wrong while reading or partitioning data.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file could not be opened or read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A file was read but its content is not what its format requires.
    #[error("{path}: {problem}")]
    Corrupt {
        /// The file (or a description of the in-memory source).
        path: PathBuf,
        /// What is wrong, in words.
        problem: String,
    },
    /// No directory holding the dataset's files was found.
    #[error(
        "dataset {dataset} not found (looked in: {searched}); pass --data-dir or set FL_DATA_DIR"
    )]
    NotFound {
        /// The dataset name.
        dataset: String,
        /// The places searched, comma separated.
        searched: String,
    },
    /// The dataset name is not one this crate knows.
    #[error(
        "unknown dataset '{0}' (known: fashion-mnist, mnist, cifar10, cifar100, cifar100-coarse, femnist, svhn, image-folder)"
    )]
    UnknownDataset(String),
    /// A partition request that cannot be satisfied.
    #[error("invalid partition: {0}")]
    Partition(String),
    /// Fetching or verifying a dataset's files failed.
    #[error("download failed: {0}")]
    Download(String),
}

impl DataError {
    pub(crate) fn corrupt(path: impl Into<PathBuf>, problem: impl Into<String>) -> Self {
        Self::Corrupt {
            path: path.into(),
            problem: problem.into(),
        }
    }
}
