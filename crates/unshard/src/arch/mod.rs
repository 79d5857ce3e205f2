//! Architectures: which tensors, of which shapes, a model's config.json calls for.
//!
//! A merge onto a config-only base (or onto the config found beside a checkpoint)
//! has no weights to compare names and shapes with; without this, a checkpoint of
//! another size or family is written with exit 0 and fails when loaded. The
//! knowledge is a table generated from transformers' own models
//! (`fixtures/gen_arch_table.py` -> `layouts.json`), so covering a new family is
//! regenerating data. `eval` turns a config into the expected tensors,
//! `check` compares a checkpoint with them.

pub mod check;
pub mod conversions;
pub mod eval;
pub mod table;

#[cfg(feature = "internals")]
pub use check::PLACEHOLDER_HINT;
pub use check::{check, placeholders};
pub use eval::{expected, Expected};
#[cfg(feature = "internals")]
pub use eval::{family_for, ExpectedTensor, Unknown};
