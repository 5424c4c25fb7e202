//! Federated-learning research framework on Burn: one dependency for the whole library.
//!
//! - [`core`] ([`fl_core`]): the layer API, local trainer, strategies and simulation engine.
//! - [`models`] ([`fl_models`]): backend-generic models with block decompositions.
//! - [`data`] ([`fl_data`]): dataset readers and client partitions.
//!
//! See `examples/` for embedding the engine with your own Burn module.

pub use fl_core as core;
pub use fl_data as data;
pub use fl_models as models;
