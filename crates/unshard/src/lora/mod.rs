//! LoRA and DoRA adapters, fused into the base weights.
//!
//! peft saves an adapter as small factors (`lora_A`, `lora_B`, DoRA's magnitude) and a
//! config that holds the scale; a training checkpoint of a peft-wrapped model holds
//! the same factors beside the frozen base. This module turns either into what the
//! planner and the engine already understand: a list of tensors under base-model
//! names (weights that replace the base's: saved modules, trained biases, the frozen
//! base of a checkpoint) plus one [`Fuse`] per adapted weight, which says how that
//! weight's content is computed from the base's and the factors.
//!
//! - [`locate`]: where the adapter, its weights and its config are;
//! - [`config`]: `adapter_config.json`, and the refusal of what cannot be fused;
//! - [`names`]: peft's tensor names read back into base names;
//! - `resolve`: names + config -> tensors and fuses, every shape checked;
//! - [`mapping`]: the plan's `LoraFuse` mapping: fused weights become `Expr::Fuse`;
//! - [`input`]: opening an adapter directory or a training checkpoint;
//! - [`math`]: the fuse in float32, and [`eval`], which reads its inputs;
//! - [`reference`](mod@reference): the same in plain float64 loops (verify's evaluation);
//! - [`report`]: the notes and the loud warning when the fuse changes nothing;
//! - [`export`]: `--no-fuse`, the adapter written back as a peft adapter directory.

use std::path::Path;

use crate::error::Error;

pub mod config;
pub mod eval;
pub mod export;
pub mod input;
pub mod locate;
pub mod mapping;
/// The fuse kernel, which the engine shares with this module: `dtype::fuse`.
pub use crate::dtype::fuse as math;
pub mod names;
pub mod reference;
pub mod resolve;
pub mod summary;

pub use crate::error::{AdapterOption, AdapterRemedy};
#[cfg(feature = "internals")]
pub use config::AdapterConfig;
#[cfg(feature = "internals")]
pub use input::AdapterInput;
pub use input::AdapterOptions;
pub use mapping::LoraFuse;
#[cfg(feature = "internals")]
pub use resolve::{resolve, Fuse, Resolved};

/// An error about an adapter input, naming the file; the hint is `remedy`'s.
pub(crate) fn adapter_error(path: &Path, msg: impl std::fmt::Display, hint: &str) -> Error {
    Error::plan(format!("{}: {msg}", path.display()), Some(hint.to_string()))
}

/// An error whose remedy is an option ([`AdapterRemedy`]), naming the file.
pub(crate) fn remedy_error(
    path: &Path,
    msg: impl std::fmt::Display,
    remedy: AdapterRemedy,
) -> Error {
    Error::Adapter {
        msg: format!("{}: {msg}", path.display()),
        remedy,
    }
}
