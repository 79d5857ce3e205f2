//! unshard: turn what distributed training left on disk into a Hugging Face model
//! directory.
//!
//! The library is organised along the data flow:
//! - [`source`]: readers. Each input format (torch.save zip or legacy, safetensors,
//!   Hugging Face directories, DCP directories, per-rank files) is *described* as a
//!   list of [`source::TensorSource`]s: where each tensor's pieces are, never their bytes.
//! - [`plan`]: pure policy. Names, dtype, ties, overlay on a base model; the result is
//!   a [`plan::Plan`] (what to write) and a report (why), or an error naming the culprit.
//! - [`write`]: the engine. Streams pieces from inputs to output shards, converting
//!   dtypes on the way, into a staging directory that is renamed into place.
//! - [`dtype`]: element types and conversion kernels bit-identical to torch.
//! - [`verify`]: proof that an output holds the checkpoint's values; [`diff`] and
//!   [`stats`] compare and summarise tensors of any input.

pub mod cancel;
pub mod diff;
pub mod dtype;
pub mod error;
pub mod merge;
pub mod options;
pub mod parts;
pub mod plan;
pub mod prepare;
#[cfg(feature = "remote")]
pub mod remote;
pub mod report;
pub mod source;
pub mod stats;
pub mod verify;
pub mod write;

pub use cancel::Cancel;
pub use dtype::DType;
pub use error::{Error, Result};
