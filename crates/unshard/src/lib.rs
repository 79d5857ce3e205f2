//! unshard: turn what distributed training left on disk into a Hugging Face model
//! directory.
//!
//! The library's API is this page: five operations, their options and reports,
//! and the types they share.
//!
//! - [`merge()`]: a checkpoint (onto a base model) into a model directory, written
//!   into a staging directory and renamed into place when complete
//!   ([`merge_into`] writes into any [`Sink`]);
//! - [`inspect()`]: what an input holds;
//! - [`verify()`]: whether a model directory holds exactly what a merge writes;
//! - [`diff()`]: two inputs compared tensor by tensor;
//! - [`scan_paths()`]: what the pickles in files would run under `torch.load`
//!   (unshard runs none of it; reading operations report the same findings, as
//!   [`UnsafeCall`]s, to the [`UnsafePolicy`] of their options).
//!
//! Every operation takes a [`Cancel`] token in its options (no process-global
//! state: operations in one process run and stop separately), reports progress to
//! a [`Progress`], and fails with a typed [`Error`] that names the file, key or
//! tensor at fault; [`Error::hint`] says what to change, in terms of the options.
//! Reports derive `Serialize`: the command line's `--json` outputs are their JSON.
//!
//! ```no_run
//! use unshard::{Cancel, MergeOptions, NoProgress, VerifyOptions};
//!
//! let cancel = Cancel::new(); // keep a clone to cancel from another thread
//! let opts = MergeOptions {
//!     checkpoint: "checkpoints/global_step_100/actor".into(),
//!     base: Some("Qwen2.5-7B".into()),
//!     output: "merged".into(),
//!     cancel: cancel.clone(),
//!     ..MergeOptions::default()
//! };
//! let report = unshard::merge(&opts, &NoProgress)?;
//! println!("{}", serde_json::to_string_pretty(&report).unwrap_or_default());
//! let report = unshard::verify(&VerifyOptions::of_merge(&opts, &opts.output), &NoProgress)?;
//! assert!(report.is_ok());
//! # Ok::<(), unshard::Error>(())
//! ```
//!
//! How the library is organised (layers that import only downward: readers,
//! mapping, plan, engine, sink) and where new formats, transforms and stores plug
//! in is in `docs/architecture.md`. The modules behind this page are private to
//! the crate; the `internals` feature makes them public, hidden from the docs, for
//! the crate's own integration tests and fuzz targets only: they are no API.
#![deny(missing_docs)]

// The library's modules: crate-private, or public (hidden from the docs) under the
// `internals` feature. Declared one by one, not through a macro, so that rustfmt
// and cargo-mutants, which do not expand macros, find their files.
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod arch;
#[cfg(not(feature = "internals"))]
mod arch;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod bytes;
#[cfg(not(feature = "internals"))]
mod bytes;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod cancel;
#[cfg(not(feature = "internals"))]
mod cancel;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod diff;
#[cfg(not(feature = "internals"))]
mod diff;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod digest;
#[cfg(not(feature = "internals"))]
mod digest;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod dtype;
#[cfg(not(feature = "internals"))]
mod dtype;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod error;
#[cfg(not(feature = "internals"))]
mod error;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod hub;
#[cfg(not(feature = "internals"))]
mod hub;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod inspect;
#[cfg(not(feature = "internals"))]
mod inspect;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod lora;
#[cfg(not(feature = "internals"))]
mod lora;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod manifest;
#[cfg(not(feature = "internals"))]
mod manifest;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod merge;
#[cfg(not(feature = "internals"))]
mod merge;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod options;
#[cfg(not(feature = "internals"))]
mod options;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod parts;
#[cfg(not(feature = "internals"))]
mod parts;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod plan;
#[cfg(not(feature = "internals"))]
mod plan;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod prepare;
#[cfg(not(feature = "internals"))]
mod prepare;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod read;
#[cfg(not(feature = "internals"))]
mod read;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod scan;
#[cfg(not(feature = "internals"))]
mod scan;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod source;
#[cfg(not(feature = "internals"))]
mod source;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod stats;
#[cfg(not(feature = "internals"))]
mod stats;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod text;
#[cfg(not(feature = "internals"))]
mod text;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod verify;
#[cfg(not(feature = "internals"))]
mod verify;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod write;
#[cfg(not(feature = "internals"))]
mod write;

pub use cancel::Cancel;
pub use diff::{diff, DiffReport, DiffSide, TensorDiff, ValueDiff};
pub use digest::{Expected, ExpectedDigest};
pub use dtype::DType;
pub use error::{AdapterOption, AdapterRemedy};
pub use error::{Error, NonFiniteTensor, Result, ShapeDiff};
pub use inspect::{inspect, InspectReport, InspectedTensor, NonTensor};
pub use lora::input::AdapterOptions;
pub use manifest::{Manifest, MANIFEST};
pub use merge::{merge, merge_into, parse_size, MergeReport, Warning, WarningKind};
pub use options::{DiffOptions, InspectOptions, MergeOptions, UnsafePolicy, VerifyOptions};
pub use parts::{merge_part, Part};
pub use plan::{parse_rename, DtypeChoice, ExpertLayout, Origin, PlanOptions, RenameError};
pub use scan::{scan_file, scan_paths, FileScan, UnsafeCall};
pub use source::{
    fs::{is_url, location},
    Format, OpenOptions,
};
pub use stats::TensorStats;
pub use verify::{verify, FirstDiff, Mismatch, Problem, VerifyReport};
pub use write::{NoProgress, Progress, ShardFile, Sink, StagingDir};

/// The repository's `fixtures/` folder, which the unit tests read.
#[cfg(test)]
pub(crate) fn fixtures() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}
