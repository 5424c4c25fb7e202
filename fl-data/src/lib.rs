//! Datasets and client partitions for federated-learning simulations.
//!
//! This crate has no Burn dependency: it stores images as `u8` in one shared [`Dataset`] and
//! describes clients as index lists into it ([`Partition`]), so a simulation with 100,000 clients
//! never copies pixels. Normalisation to `f32` happens per batch in the trainer.
//!
//! - [`idx`]: MNIST / Fashion-MNIST IDX files, raw or gzip.
//! - [`source`]: which files to read (`--data-dir`, `$FL_DATA_DIR`, system paths, embedded copy).
//! - [`partition`]: IID and Dirichlet label partitions with feasibility checks.

mod dataset;
mod error;
pub mod idx;
pub mod partition;
pub mod source;

pub use dataset::{Dataset, FederatedDataset, Normalization};
pub use error::DataError;
pub use partition::{Partition, PartitionScheme};
pub use source::{DatasetKind, load_dataset};
