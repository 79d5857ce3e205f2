//! The library's error type.
//!
//! Every error names what is at fault (a file, a key, a tensor) and, where the user
//! can do something about it, carries a hint. The errors a caller may want to act
//! on are variants of their own that carry their data (the tensors not in the
//! base, the shapes that differ, the output that exists...). Hints speak of the
//! library's options (`strict`, `force`, `renames`); a front end maps them to its
//! own words (the command line to its flags). The binary renders `error:`, the
//! causes, and `hint:`; the library only describes.

use std::path::PathBuf;

use crate::text::list_some;

/// Result alias for the library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operating-system call on a file failed.
    #[error("cannot {op} {}", path.display())]
    Io {
        /// What was being done (`open`, `read`, `create`...).
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },

    /// A file's bytes do not form what they claim to be (truncated, corrupt, inconsistent).
    #[error("{}: {msg}", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        msg: String,
    },

    /// The input's pickles would run code under `torch.load`, and the caller asked
    /// to refuse such inputs (`--refuse-unsafe`, `--strict`). Nothing was run.
    #[error("{}: refusing a file whose pickle would run code under torch.load: {}", path.display(), list_some(calls, 4))]
    Unsafe {
        /// The first file holding such a pickle.
        path: PathBuf,
        /// The callables, by full name or the chain of calls that makes them.
        calls: Vec<String>,
    },

    /// A pickle inside a file could not be parsed.
    #[error("{}: cannot parse the pickle in {entry}", path.display())]
    Pickle {
        /// The file.
        path: PathBuf,
        /// The archive entry holding the pickle.
        entry: String,
        /// What the pickle machine found.
        #[source]
        source: unshard_pickle::Error,
    },

    /// The file is a known kind that unshard deliberately does not read.
    #[error("{}: {what} is not supported", path.display())]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// What it holds that is not read.
        what: String,
        /// What to do instead.
        hint: Option<String>,
    },

    /// The input is not a format unshard knows.
    #[error("{}: not a checkpoint unshard can read ({found})", path.display())]
    UnknownFormat {
        /// The input.
        path: PathBuf,
        /// What it looks like.
        found: String,
    },

    /// A tensor's description is invalid (bad shape, out-of-bounds strides, ...).
    #[error("{}: tensor '{tensor}': {msg}", path.display())]
    BadTensor {
        /// The file that describes it.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// What is wrong.
        msg: String,
    },

    /// A checkpoint made of several files lacks one of them (a rank's file).
    #[error("{}: {msg}", path.display())]
    Incomplete {
        /// The checkpoint.
        path: PathBuf,
        /// What is missing.
        msg: String,
        /// What to do about it.
        hint: Option<String>,
    },

    /// No tensors were found where they were looked for.
    #[error("{}: no tensors found{}", path.display(), at.as_ref().map(|k| format!(" under '{k}'")).unwrap_or_default())]
    NoTensors {
        /// The input.
        path: PathBuf,
        /// The key looked under, if any.
        at: Option<String>,
        /// What to do about it.
        hint: Option<String>,
    },

    /// The `key` open option named a path that does not exist.
    #[error("{}: key '{key}' not found", path.display())]
    KeyNotFound {
        /// The input.
        path: PathBuf,
        /// The key asked for.
        key: String,
        /// The keys at the level where it was looked for.
        available: Vec<String>,
    },

    /// Several candidate tensor dicts and no way to choose between them.
    #[error("{}: tensors found under several keys: {}", path.display(), candidates.join(", "))]
    AmbiguousTensors {
        /// The input.
        path: PathBuf,
        /// The keys that hold tensor dicts.
        candidates: Vec<String>,
    },

    /// A LoRA adapter cannot be fused as the options stand; `remedy` says which
    /// option to change (its hint names the library's options).
    #[error("{msg}")]
    Adapter {
        /// What is wrong, naming the file or the weight.
        msg: String,
        /// What to change.
        remedy: AdapterRemedy,
    },

    /// The merge plan is invalid: the checkpoint does not fit the base.
    #[error("{msg}")]
    Plan {
        /// What does not fit.
        msg: String,
        /// What to do about it.
        hint: Option<String>,
    },

    /// Checkpoint tensors that the base model does not have.
    #[error("{} checkpoint tensor(s) are not in the base model {}: {}", .names.len(), .base.display(), list_some(.names, 8))]
    UnknownTensors {
        /// The checkpoint's tensors (output names) the base lacks.
        names: Vec<String>,
        /// The base's weights.
        base: PathBuf,
        /// Base names close to the first unknown ones.
        similar: Vec<String>,
    },

    /// Tensors whose shape differs in the checkpoint and the base.
    #[error("{} tensor(s) have a different shape in the checkpoint and the base: {}", .tensors.len(), list_some(.tensors, 6))]
    ShapeMismatch {
        /// Each tensor with both shapes.
        tensors: Vec<ShapeDiff>,
    },

    /// Two checkpoint tensors would be written under one name.
    #[error("checkpoint tensors '{first}' and '{second}' both become '{name}' after renaming")]
    DuplicateName {
        /// The first tensor, as the checkpoint names it.
        first: String,
        /// The second one.
        second: String,
        /// The output name both get.
        name: String,
    },

    /// `strict` is set and base tensors are missing from the checkpoint.
    #[error("strict: {} base tensor(s) are missing from the checkpoint: {}", .missing.len(), list_some(.missing, 8))]
    Strict {
        /// The base tensors the checkpoint lacks.
        missing: Vec<String>,
    },

    /// The output directory exists and is not empty (and `force` is not set).
    #[error("{}: the output directory exists and is not empty", .path.display())]
    OutputExists {
        /// The output directory.
        path: PathBuf,
    },

    /// `fail_on_nonfinite` is set and tensors hold NaN or inf.
    #[error("{} tensor(s) hold non-finite values: {}", .tensors.len(), list_some(.tensors, 6))]
    NonFinite {
        /// Each tensor with its counts.
        tensors: Vec<NonFiniteTensor>,
    },

    /// A cast overflowed to infinity.
    #[error("casting tensor '{tensor}' to {dtype} overflows: {count} finite value(s) become inf")]
    Overflow {
        /// The tensor.
        tensor: String,
        /// The dtype it is cast to.
        dtype: crate::dtype::DType,
        /// How many values overflow.
        count: u64,
    },

    /// The output location is unusable.
    #[error("{}: {msg}", path.display())]
    Output {
        /// The output.
        path: PathBuf,
        /// What is wrong with it.
        msg: String,
        /// What to do about it.
        hint: Option<String>,
    },

    /// The user asked for something inconsistent.
    #[error("{0}")]
    Usage(String),

    /// The operation was cancelled (its [`Cancel`](crate::cancel::Cancel) token).
    #[error("interrupted")]
    Interrupted,

    /// The path is a part of a checkpoint, or the folder around one, not the
    /// checkpoint itself; the hint names what to pass.
    #[error("{}: {found}", path.display())]
    WrongInput {
        /// The path given.
        path: PathBuf,
        /// What it is.
        found: String,
        /// What to pass instead.
        hint: String,
    },

    /// A check on the output failed (a merge's read-back verification).
    #[error("{msg}")]
    Check {
        /// What failed.
        msg: String,
        /// What to do about it.
        hint: Option<String>,
    },
}

/// A tensor whose shape differs in the checkpoint and the base.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShapeDiff {
    /// Its output name.
    pub name: String,
    /// Its shape in the checkpoint.
    pub checkpoint: Vec<u64>,
    /// Its shape in the base.
    pub base: Vec<u64>,
}

impl std::fmt::Display for ShapeDiff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "'{}': checkpoint {:?}, base {:?}",
            self.name, self.checkpoint, self.base
        )
    }
}

/// A tensor holding NaN or inf (in the checkpoint, or after an overflowing cast).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NonFiniteTensor {
    /// Its output name.
    pub name: String,
    /// NaN values.
    pub nan: u64,
    /// inf values in the input.
    pub inf: u64,
    /// Finite values that became inf in the cast to `dtype`.
    pub overflow: u64,
    /// The dtype written.
    pub dtype: crate::dtype::DType,
}

impl std::fmt::Display for NonFiniteTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "'{}' ({} NaN, {} inf", self.name, self.nan, self.inf)?;
        if self.overflow > 0 {
            write!(f, ", {} overflowed to inf in {}", self.overflow, self.dtype)?;
        }
        f.write_str(")")
    }
}

impl Error {
    /// Builds an [`Error::Io`].
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }

    /// Builds an [`Error::Corrupt`].
    pub fn corrupt(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Corrupt {
            path: path.into(),
            msg: msg.into(),
        }
    }

    /// Builds an [`Error::BadTensor`].
    pub fn bad_tensor(
        path: impl Into<PathBuf>,
        tensor: impl Into<String>,
        msg: impl Into<String>,
    ) -> Self {
        Error::BadTensor {
            path: path.into(),
            tensor: tensor.into(),
            msg: msg.into(),
        }
    }

    /// Builds an [`Error::Plan`].
    pub fn plan(msg: impl Into<String>, hint: Option<String>) -> Self {
        Error::Plan {
            msg: msg.into(),
            hint,
        }
    }

    /// What the user can do about it, when there is something to say.
    pub fn hint(&self) -> Option<String> {
        match self {
            Error::Unsupported { hint, .. }
            | Error::Incomplete { hint, .. }
            | Error::NoTensors { hint, .. }
            | Error::Plan { hint, .. }
            | Error::Check { hint, .. }
            | Error::Output { hint, .. } => hint.clone(),
            Error::WrongInput { hint, .. } => Some(hint.clone()),
            Error::Adapter { remedy, .. } => Some(remedy.hint().into()),
            Error::KeyNotFound { available, .. } if !available.is_empty() => Some(format!(
                "keys at that level: {}",
                list_some(available, 12)
            )),
            Error::AmbiguousTensors { candidates, .. } => Some(format!(
                "pick one with the `key` open option, e.g. {}",
                candidates.first().map(String::as_str).unwrap_or("state")
            )),
            Error::Overflow { dtype, .. } => Some(format!(
                "values beyond the range of {dtype} cannot be represented; choose a wider dtype (bfloat16 or float32), or set `allow_overflow` to write inf"
            )),
            Error::Unsafe { .. } => Some(
                "unshard ran none of it, but the file is compromised: do not load it with torch.load(weights_only=False); `unshard scan` lists every call; without `refuse_unsafe` and `strict`, unshard warns and reads the tensors"
                    .into(),
            ),
            Error::UnknownTensors { similar, .. } if similar.is_empty() => Some(
                "check that the base is the model that was trained, or map names with `renames`"
                    .into(),
            ),
            Error::UnknownTensors { similar, .. } => Some(format!(
                "the base has similar names ({}); map them with `renames`, or check that the base is the model that was trained",
                quoted(similar)
            )),
            Error::ShapeMismatch { .. } => Some(
                "the checkpoint was trained from a different architecture or size than the base"
                    .into(),
            ),
            Error::DuplicateName { .. } => Some(
                "keep them apart with `renames`, or pick one state dict with the `key` open option"
                    .into(),
            ),
            Error::Strict { .. } => {
                Some("without `strict` they are copied from the base".into())
            }
            Error::OutputExists { .. } => {
                Some("set `force` to replace it, or choose another output".into())
            }
            Error::NonFinite { .. } => Some(
                "the output was not written; the run may have diverged. Without `fail_on_nonfinite` it is written anyway"
                    .into(),
            ),
            Error::Pickle { .. } | Error::Corrupt { .. } => Some(
                "the file may be truncated or damaged; check that the training job finished writing it"
                    .into(),
            ),
            Error::Io { source, .. } if source.raw_os_error() == Some(libc::ENOSPC) => {
                Some("the disk is full; free space or choose another output".into())
            }
            Error::Io { source, op, path } if source.kind() == std::io::ErrorKind::PermissionDenied => Some(format!(
                "you may not {op} {}: check its owner and mode (`ls -ld {}`), or run as a user who may",
                path.display(),
                path.display()
            )),
            Error::Io { source, .. } if source.raw_os_error() == Some(libc::EMFILE) => Some(
                "input files beyond the limit on open files are opened on demand, but the output and the merge itself need a few more; raise the limit on open files (`ulimit -n`)"
                    .into(),
            ),
            _ => None,
        }
    }
}

/// Names in quotes, comma-separated.
fn quoted(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("'{n}'"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// An adapter option, as [`AdapterRemedy`] names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdapterOption {
    /// the adapter's name (`AdapterOptions::name`).
    Name,
    /// its config (`AdapterOptions::config`).
    Config,
    /// `AdapterOptions::no_fuse`.
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

#[cfg(test)]
mod tests {
    use super::Error;

    #[test]
    fn permission_denied_names_the_file_and_what_to_do() {
        let e = Error::io(
            "open",
            "/data/ckpt/policy.pt",
            std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        );
        assert_eq!(e.to_string(), "cannot open /data/ckpt/policy.pt");
        let hint = e.hint().unwrap_or_default();
        assert!(
            hint.contains("you may not open /data/ckpt/policy.pt")
                && hint.contains("ls -ld /data/ckpt/policy.pt"),
            "{hint}"
        );
        let other = Error::io(
            "open",
            "/x",
            std::io::Error::from(std::io::ErrorKind::NotFound),
        );
        assert_eq!(other.hint(), None);
    }
}
