//! The library's error type.
//!
//! Every error names what is at fault (a file, a key, a tensor) and, where the user
//! can do something about it, carries a hint. The binary renders `error:`, the
//! causes, and `hint:`; the library only describes.

use std::path::PathBuf;

/// Result alias for the library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operating-system call on a file failed.
    #[error("cannot {op} {}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A file's bytes do not form what they claim to be (truncated, corrupt, inconsistent).
    #[error("{}: {msg}", path.display())]
    Corrupt { path: PathBuf, msg: String },

    /// The input's pickles would run code under `torch.load`, and the caller asked
    /// to refuse such inputs (`--refuse-unsafe`, `--strict`). Nothing was run.
    #[error("{}: refusing a file whose pickle would run code under torch.load: {}", path.display(), crate::report::list_some(calls, 4))]
    Unsafe { path: PathBuf, calls: Vec<String> },

    /// A pickle inside a file could not be parsed.
    #[error("{}: cannot parse the pickle in {entry}", path.display())]
    Pickle {
        path: PathBuf,
        entry: String,
        #[source]
        source: unshard_pickle::Error,
    },

    /// The file is a known kind that unshard deliberately does not read.
    #[error("{}: {what} is not supported", path.display())]
    Unsupported {
        path: PathBuf,
        what: String,
        hint: Option<String>,
    },

    /// The input is not a format unshard knows.
    #[error("{}: not a checkpoint unshard can read ({found})", path.display())]
    UnknownFormat { path: PathBuf, found: String },

    /// A tensor's description is invalid (bad shape, out-of-bounds strides, ...).
    #[error("{}: tensor '{tensor}': {msg}", path.display())]
    BadTensor {
        path: PathBuf,
        tensor: String,
        msg: String,
    },

    /// A checkpoint made of several files lacks one of them (a rank's file).
    #[error("{}: {msg}", path.display())]
    Incomplete {
        path: PathBuf,
        msg: String,
        hint: Option<String>,
    },

    /// No tensors were found where they were looked for.
    #[error("{}: no tensors found{}", path.display(), at.as_ref().map(|k| format!(" under '{k}'")).unwrap_or_default())]
    NoTensors {
        path: PathBuf,
        at: Option<String>,
        hint: Option<String>,
    },

    /// `--key` named a path that does not exist.
    #[error("{}: key '{key}' not found", path.display())]
    KeyNotFound {
        path: PathBuf,
        key: String,
        available: Vec<String>,
    },

    /// Several candidate tensor dicts and no way to choose between them.
    #[error("{}: tensors found under several keys: {}", path.display(), candidates.join(", "))]
    AmbiguousTensors {
        path: PathBuf,
        candidates: Vec<String>,
    },

    /// The merge plan is invalid: the checkpoint does not fit the base.
    #[error("{msg}")]
    Plan { msg: String, hint: Option<String> },

    /// A cast overflowed to infinity.
    #[error("casting tensor '{tensor}' to {dtype} overflows: {count} finite value(s) become inf")]
    Overflow {
        tensor: String,
        dtype: crate::DType,
        count: u64,
    },

    /// The output location is unusable.
    #[error("{}: {msg}", path.display())]
    Output {
        path: PathBuf,
        msg: String,
        hint: Option<String>,
    },

    /// The user asked for something inconsistent.
    #[error("{0}")]
    Usage(String),

    /// The operation was interrupted (Ctrl-C or a signal).
    #[error("interrupted")]
    Interrupted,

    /// A check on the output failed (`--verify`, `--fail-on-nonfinite`).
    #[error("{msg}")]
    Check { msg: String, hint: Option<String> },
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
            Error::KeyNotFound { available, .. } if !available.is_empty() => Some(format!(
                "keys at that level: {}",
                crate::report::list_some(available, 12)
            )),
            Error::AmbiguousTensors { candidates, .. } => Some(format!(
                "pick one with --key, e.g. --key {}",
                candidates.first().map(String::as_str).unwrap_or("state")
            )),
            Error::Overflow { dtype, .. } => Some(format!(
                "values beyond the range of {dtype} cannot be represented; choose --dtype bfloat16 or float32, or pass --allow-overflow to write inf"
            )),
            Error::Unsafe { .. } => Some(
                "unshard ran none of it, but the file is compromised: do not load it with torch.load(weights_only=False); `unshard scan` lists every call; without --refuse-unsafe and --strict, unshard warns and reads the tensors"
                    .into(),
            ),
            Error::Pickle { .. } | Error::Corrupt { .. } => Some(
                "the file may be truncated or damaged; check that the training job finished writing it"
                    .into(),
            ),
            Error::Io { source, .. } if source.raw_os_error() == Some(libc::ENOSPC) => {
                Some("the disk is full; free space or choose another --output".into())
            }
            Error::Io { source, .. } if source.raw_os_error() == Some(libc::EMFILE) => Some(
                "a merge keeps every input file open, one per rank of a sharded checkpoint; raise the limit on open files (`ulimit -n`) to more than the number of files"
                    .into(),
            ),
            _ => None,
        }
    }
}
