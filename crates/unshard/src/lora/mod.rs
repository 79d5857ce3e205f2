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

use crate::Error;

pub mod config;
pub mod eval;
pub mod export;
pub mod input;
pub mod locate;
pub mod mapping;
pub mod math;
pub mod names;
pub mod reference;
pub mod report;
pub mod resolve;

pub use config::AdapterConfig;
pub use input::{AdapterInput, AdapterOptions};
pub use mapping::LoraFuse;
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

/// An adapter option, as [`AdapterRemedy`] names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdapterOption {
    /// [`AdapterOptions::name`].
    Name,
    /// [`AdapterOptions::config`].
    Config,
    /// [`AdapterOptions::no_fuse`].
    NoFuse,
}

impl AdapterOption {
    /// How the library's messages name the option; a front end may replace these
    /// words with its own (the command line with its flag).
    pub fn words(self) -> &'static str {
        match self {
            AdapterOption::Name => "the adapter `name` option",
            AdapterOption::Config => "the adapter `config` option",
            AdapterOption::NoFuse => "the adapter `no_fuse` option",
        }
    }
}

/// What to change when an adapter cannot be fused as the options stand: the remedy
/// of an [`Error::Adapter`], which a front end words in its own terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AdapterRemedy {
    /// The adapter asked for is not there: name one of those the message lists.
    PickListed,
    /// Several adapters are saved together: name one.
    NameOne,
    /// The adapter config could not be read: give the one peft wrote.
    ConfigUnreadable,
    /// The adapter config given is not there (the message names `Config`).
    ConfigAbsent,
    /// No adapter config was found beside the weights: give the one the run used.
    ConfigNotFound,
    /// The adapter's weights do not fit the base's.
    CheckBase,
    /// There is no base model to fuse into.
    NoBase,
    /// The base model lacks a weight the adapter changes.
    BaseLacksWeight,
    /// An adapter option was set for an input that holds no adapter (the message
    /// names the option).
    NotAnAdapter(AdapterOption),
}

impl AdapterRemedy {
    /// The hint, in terms of the library's options.
    pub fn hint(self) -> &'static str {
        match self {
            AdapterRemedy::PickListed => "set the adapter `name` option to one of those names",
            AdapterRemedy::NameOne => "choose one with the adapter `name` option",
            AdapterRemedy::ConfigUnreadable => {
                "give the adapter_config.json peft wrote for this adapter as the adapter `config` option"
            }
            AdapterRemedy::ConfigAbsent => {
                "give the adapter_config.json the adapter was trained with (or its directory)"
            }
            AdapterRemedy::ConfigNotFound => {
                "give the adapter config the run used as the adapter `config` option (never guess lora_alpha)"
            }
            AdapterRemedy::CheckBase => "check that the base is the model the adapter was trained on",
            AdapterRemedy::NoBase => "give the model the adapter was trained on as the `base`",
            AdapterRemedy::BaseLacksWeight => {
                "give the base model the adapter was trained on as the `base`"
            }
            AdapterRemedy::NotAnAdapter(_) => {
                "give a peft adapter directory or a checkpoint of a peft-wrapped model, or unset the option"
            }
        }
    }

    /// The option the error's message names, if any.
    pub fn option_in_message(self) -> Option<AdapterOption> {
        match self {
            AdapterRemedy::ConfigAbsent => Some(AdapterOption::Config),
            AdapterRemedy::NotAnAdapter(o) => Some(o),
            _ => None,
        }
    }
}
