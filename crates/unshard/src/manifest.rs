//! `unshard.json`: what a merge did, written into the output beside the files it
//! describes (committed by the same rename, so it is there exactly when they are):
//! the unshard version, the inputs, the options that decide the output's bytes,
//! and each file's size and checksum.
//!
//! It serves `verify`, which takes the checkpoint and the options from it when
//! none are given (explicit ones win), and checks that no file changed since the
//! merge. It is a file of its own rather than fields in `config.json` or the
//! safetensors headers so that every file transformers writes stays byte for byte
//! what `save_pretrained` writes; loaders read `config.json` and the weights by
//! name and ignore it (README: "unshard.json").
//!
//! A file's checksum is its BLAKE3 hash (what `b3sum` prints), which the writer
//! assembles from the [`WINDOW_BYTES`](crate::write::WINDOW_BYTES) blocks it
//! hashes as it writes them, in any order ([`FileDigest::tree`](crate::write::FileDigest::tree)).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::bytes::fs;
use crate::digest::hex;
use crate::digest::{Expected, ExpectedDigest};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::options::{MergeOptions, VerifyOptions};
use crate::plan::{DtypeChoice, ExpertLayout};
use crate::source::audit::UnsafeCall;
use crate::write::{FileDigest, WINDOW_BYTES};

pub use crate::source::hf_dir::MANIFEST;

/// The checksum algorithm, as recorded.
const ALGORITHM: &str = "blake3";

/// `unshard.json`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    /// The unshard that wrote the output.
    pub unshard_version: String,
    /// What was merged.
    pub inputs: Inputs,
    /// The options that decide the output's bytes.
    pub options: Recorded,
    /// How the files' checksums are computed.
    pub checksum: Checksum,
    /// Every file the merge wrote (this one aside), in the order written.
    pub files: Vec<FileEntry>,
    /// What the inputs' pickles would run under `torch.load` (unshard ran none of
    /// it): empty for clean inputs.
    #[serde(default)]
    pub unsafe_calls: Vec<RecordedCall>,
}

/// One call an input's pickle would make under `torch.load`, as recorded.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct RecordedCall {
    /// The file holding the pickle.
    pub file: String,
    /// The archive entry (or legacy pickle) holding it.
    pub entry: String,
    /// The callable's full name (`posix.system`).
    pub callable: String,
    /// The opcode that calls it.
    pub route: String,
    /// Byte offset of that opcode inside the entry.
    pub offset: usize,
    /// `dangerous` or `unknown`.
    pub verdict: String,
}

impl RecordedCall {
    fn of(c: &UnsafeCall) -> RecordedCall {
        RecordedCall {
            file: absolute(&c.path),
            entry: c.entry.clone(),
            callable: c.callable.clone(),
            route: c.route.clone(),
            offset: c.offset,
            verdict: c.verdict.as_str().into(),
        }
    }
}

/// The inputs of a merge, local paths made absolute.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Inputs {
    /// The checkpoint.
    pub checkpoint: String,
    /// Its format, as detected.
    pub checkpoint_format: String,
    /// The base (a directory, a bucket URL, or a Hub id resolved in the cache).
    pub base: Option<String>,
    /// Set when a URL above was given with user info or a query string, which
    /// are not recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub urls_redacted: Option<String>,
}

/// The merge's options, as `verify` takes them back.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct Recorded {
    /// `auto` or a dtype name (`bfloat16`).
    pub dtype: String,
    /// The dtype the floating tensors were written in.
    pub dtype_written: Option<String>,
    /// `--key`.
    pub key: Option<String>,
    /// `--tag`.
    pub tag: Option<String>,
    /// `--strict`.
    pub strict: bool,
    /// `--rename`, each as `[regex, replacement]`.
    pub renames: Vec<(String, String)>,
    /// `--max-shard-size`, in bytes.
    pub max_shard_size: u64,
    /// `--adapter`.
    pub adapter: Option<String>,
    /// `--adapter-config`.
    pub adapter_config: Option<String>,
    /// `--no-fuse`.
    pub no_fuse: bool,
    /// `--allow-overflow`.
    pub allow_overflow: bool,
    /// `--layout` (`packed` or `original`); absent: as the base's files.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layout: Option<String>,
}

/// How the checksums are computed.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Checksum {
    /// What the checksum is.
    pub algorithm: String,
    /// The block size, in bytes.
    pub block_size: u64,
}

/// One file of the output.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FileEntry {
    /// Relative to the output directory.
    pub name: String,
    /// Bytes.
    pub size: u64,
    /// Hexadecimal; absent where it could not be taken (a shard of another part).
    pub checksum: Option<String>,
}

impl Manifest {
    /// The manifest of a merge with options `opts` that wrote `files`.
    pub fn new(
        opts: &MergeOptions,
        checkpoint_format: &str,
        dtype_written: Option<DType>,
        files: Vec<FileEntry>,
        unsafe_calls: &[UnsafeCall],
    ) -> Manifest {
        let p = &opts.plan;
        Manifest {
            unshard_version: env!("CARGO_PKG_VERSION").into(),
            inputs: Inputs {
                checkpoint: absolute(&opts.checkpoint),
                checkpoint_format: checkpoint_format.into(),
                base: opts.base.as_deref().map(absolute),
                urls_redacted: (fs::secrets_removed(&opts.checkpoint)
                    || opts.base.as_deref().is_some_and(fs::secrets_removed))
                .then(|| {
                    "user info (user:password@) and query strings (?...) were removed from these URLs; pass them again to verify".to_string()
                }),
            },
            options: Recorded {
                dtype: match p.dtype {
                    DtypeChoice::Auto => "auto".into(),
                    DtypeChoice::Fixed(d) => d.torch_name().into(),
                },
                dtype_written: dtype_written.map(|d| d.torch_name().into()),
                key: opts.open.key.clone(),
                tag: opts.open.tag.clone(),
                strict: p.strict,
                renames: p
                    .renames
                    .iter()
                    .map(|(r, s)| (r.as_str().to_string(), s.clone()))
                    .collect(),
                max_shard_size: p.max_shard_size,
                adapter: opts.adapter.name.clone(),
                adapter_config: opts.adapter.config.as_deref().map(absolute),
                no_fuse: opts.adapter.no_fuse,
                allow_overflow: opts.allow_overflow,
                layout: layout_name(p.layout).map(String::from),
            },
            checksum: Checksum {
                algorithm: ALGORITHM.into(),
                block_size: WINDOW_BYTES,
            },
            files,
            unsafe_calls: unsafe_calls.iter().map(RecordedCall::of).collect(),
        }
    }

    /// The file's bytes: pretty JSON and a newline.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut text = serde_json::to_string_pretty(self).unwrap_or_default();
        text.push('\n');
        text.into_bytes()
    }

    /// Reads `dir/unshard.json`: `None` when there is none.
    pub fn read(dir: &Path) -> Result<Option<Manifest>> {
        let path = dir.join(MANIFEST);
        if !fs::is_file(&path) {
            return Ok(None);
        }
        let bytes = fs::read(&path)?;
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| Error::Output {
                path: path.clone(),
                msg: format!("is not a manifest unshard can read: {e}"),
                hint: Some(format!(
                    "pass the checkpoint and the merge's options to verify explicitly, or remove {MANIFEST}"
                )),
            })
    }

    /// The checksums to hold the files to (those with one recorded, in a scheme
    /// this unshard computes).
    pub fn expected(&self) -> Vec<Expected> {
        if !self.computes_checksums() {
            return Vec::new();
        }
        self.files
            .iter()
            .filter_map(|f| {
                let sum = parse_hex(f.checksum.as_deref()?)?;
                Some(Expected {
                    name: f.name.clone(),
                    size: f.size,
                    digest: ExpectedDigest::Recorded(sum),
                })
            })
            .collect()
    }
}

impl Manifest {
    /// Whether the checksums are in the scheme this unshard computes.
    fn computes_checksums(&self) -> bool {
        self.checksum.algorithm == ALGORITHM && self.checksum.block_size == WINDOW_BYTES
    }
}

impl FileEntry {
    /// The entry of file `name`, whose blocks hashed to `d`.
    pub fn new(name: &str, d: &FileDigest) -> FileEntry {
        FileEntry {
            name: name.into(),
            size: d.size,
            checksum: d.tree().map(|t| hex(&t)),
        }
    }

    /// The entries of the files a write reported.
    pub fn of_written(names: &[String], digests: &[FileDigest]) -> Vec<FileEntry> {
        names
            .iter()
            .zip(digests)
            .map(|(n, d)| FileEntry::new(n, d))
            .collect()
    }
}

/// What [`Manifest::fill`] did: the options it took from the manifest, and those
/// given that differ from it (given ones win), each as a command-line flag.
#[derive(Clone, Debug, Default)]
pub struct Filled {
    /// Flags taken from the manifest (`--dtype bfloat16`).
    pub taken: Vec<String>,
    /// Flags given that differ from the manifest, with its value
    /// (`--dtype float16 (unshard.json: bfloat16)`).
    pub overridden: Vec<String>,
    /// Why the recorded checksums are not compared (a scheme this unshard does
    /// not compute: a manifest of an older unshard), if so.
    pub checksums_skipped: Option<String>,
}

impl Manifest {
    /// Completes `opts` with what the merge recorded: every option left unset
    /// (the checkpoint empty, an option `None`, the dtype `auto`, no renames,
    /// flags off) takes the manifest's value; options set stay as they are. The
    /// files' checksums are added.
    pub fn fill(&self, opts: &mut VerifyOptions) -> Result<Filled> {
        let mut f = Filled::default();
        let r = &self.options;
        let mut path = |flag: &str, given: &mut Option<PathBuf>, recorded: &Option<String>| match (
            &*given, recorded,
        ) {
            (None, Some(v)) => {
                f.taken.push(format!("{flag} {v}"));
                *given = Some(PathBuf::from(v));
            }
            (Some(g), Some(v)) if !same_path(g, v) => f
                .overridden
                .push(format!("{flag} {} (unshard.json: {v})", g.display())),
            _ => {}
        };
        let mut checkpoint =
            (!opts.checkpoint.as_os_str().is_empty()).then(|| opts.checkpoint.clone());
        path(
            "--against",
            &mut checkpoint,
            &Some(self.inputs.checkpoint.clone()),
        );
        path("--base", &mut opts.base, &self.inputs.base);
        path(
            "--adapter-config",
            &mut opts.adapter.config,
            &r.adapter_config,
        );
        opts.checkpoint = checkpoint.unwrap_or_default();
        let mut text = |flag: &str, given: &mut Option<String>, recorded: &Option<String>| match (
            &*given, recorded,
        ) {
            (None, Some(v)) => {
                f.taken.push(format!("{flag} {v}"));
                *given = Some(v.clone());
            }
            (Some(g), Some(v)) if g != v => {
                f.overridden.push(format!("{flag} {g} (unshard.json: {v})"))
            }
            _ => {}
        };
        text("--key", &mut opts.open.key, &r.key);
        text("--tag", &mut opts.open.tag, &r.tag);
        text("--adapter", &mut opts.adapter.name, &r.adapter);
        let recorded_dtype =
            match r.dtype.as_str() {
                "auto" | "" => DtypeChoice::Auto,
                d => DtypeChoice::Fixed(DType::from_torch_name(d).ok_or_else(|| {
                    self.unreadable(format!("options.dtype '{d}' is not a dtype"))
                })?),
            };
        match (opts.plan.dtype, recorded_dtype) {
            (DtypeChoice::Auto, DtypeChoice::Fixed(d)) => {
                f.taken.push(format!("--dtype {d}"));
                opts.plan.dtype = recorded_dtype;
            }
            (DtypeChoice::Fixed(g), rec) if rec != opts.plan.dtype => {
                let v = match rec {
                    DtypeChoice::Auto => "auto".to_string(),
                    DtypeChoice::Fixed(d) => d.to_string(),
                };
                f.overridden
                    .push(format!("--dtype {g} (unshard.json: {v})"));
            }
            _ => {}
        }
        if opts.plan.renames.is_empty() {
            for (re, with) in &r.renames {
                let rx = regex::Regex::new(re).map_err(|e| {
                    self.unreadable(format!(
                        "options.renames '{re}' is not a regular expression: {e}"
                    ))
                })?;
                f.taken.push(format!("--rename '{re}={with}'"));
                opts.plan.renames.push((rx, with.clone()));
            }
        } else if !r.renames.is_empty() {
            let given: Vec<(String, String)> = opts
                .plan
                .renames
                .iter()
                .map(|(r, s)| (r.as_str().to_string(), s.clone()))
                .collect();
            if given != r.renames {
                f.overridden
                    .push("--rename (unshard.json records other renames)".into());
            }
        }
        let recorded_layout = match r.layout.as_deref() {
            None => ExpertLayout::Base,
            Some("packed") => ExpertLayout::Packed,
            Some("original") => ExpertLayout::Original,
            Some(l) => return Err(self.unreadable(format!("options.layout '{l}' is not a layout"))),
        };
        match (opts.plan.layout, layout_name(recorded_layout)) {
            (ExpertLayout::Base, Some(v)) => {
                f.taken.push(format!("--layout {v}"));
                opts.plan.layout = recorded_layout;
            }
            (given, rec) if given != ExpertLayout::Base && given != recorded_layout => {
                f.overridden.push(format!(
                    "--layout {} (unshard.json: {})",
                    layout_name(given).unwrap_or("base"),
                    rec.unwrap_or("as the base's files")
                ));
            }
            _ => {}
        }
        let mut flag = |name: &str, given: &mut bool, recorded: bool| {
            if recorded && !*given {
                f.taken.push(name.into());
                *given = true;
            }
        };
        flag("--strict", &mut opts.plan.strict, r.strict);
        flag("--no-fuse", &mut opts.adapter.no_fuse, r.no_fuse);
        opts.checksums = self.expected();
        if !self.computes_checksums() {
            f.checksums_skipped = Some(format!(
                "its checksums are '{}' in blocks of {} bytes, which this unshard does not compute ('{ALGORITHM}' in blocks of {WINDOW_BYTES}): the files are checked against the checkpoint but not against those checksums; merge again to record new ones",
                self.checksum.algorithm, self.checksum.block_size
            ));
        }
        Ok(f)
    }

    fn unreadable(&self, msg: String) -> Error {
        Error::Usage(format!(
            "{MANIFEST}: {msg}; pass the merge's options to verify explicitly, or remove {MANIFEST}"
        ))
    }
}

/// `--layout`'s value for a layout; `None` for the base's.
fn layout_name(l: ExpertLayout) -> Option<&'static str> {
    match l {
        ExpertLayout::Base => None,
        ExpertLayout::Packed => Some("packed"),
        ExpertLayout::Original => Some("original"),
    }
}

fn same_path(given: &Path, recorded: &str) -> bool {
    given == Path::new(recorded) || absolute(given) == recorded
}

/// A local path made absolute (so that `verify` finds it from anywhere); a URL,
/// a Hub id or a path that does not exist as given.
fn absolute(p: &Path) -> String {
    let abs: PathBuf = if fs::is_url(p) {
        PathBuf::from(crate::text::without_secrets(&p.to_string_lossy()))
    } else {
        std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf())
    };
    abs.to_string_lossy().into_owned()
}

fn parse_hex(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The options `verify` is left with, and the flags its notes name: taken from
    /// `unshard.json` when not given, reported when given otherwise, silent when
    /// given the same (docs/cli.md, `verify`).
    #[test]
    fn verify_takes_what_is_not_given_and_names_what_is_given_otherwise() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().canonicalize().unwrap();
        for d in ["ckpt", "base", "other", "sub"] {
            std::fs::create_dir(root.join(d)).unwrap();
        }
        let ckpt = root.join("ckpt").to_string_lossy().into_owned();
        let base = root.join("base").to_string_lossy().into_owned();
        let m: Manifest = serde_json::from_value(serde_json::json!({
            "unshard_version": "0.1.0",
            "inputs": {"checkpoint": ckpt, "checkpoint_format": "dcp", "base": base},
            "options": {"dtype": "bfloat16", "key": "model", "strict": true,
                        "renames": [["^a\\.", "b."]], "max_shard_size": 5_000_000_000u64},
            "checksum": {"algorithm": "blake3", "block_size": 8_388_608},
            "files": [],
        }))
        .unwrap();
        let flags = |notes: &[String]| -> Vec<String> {
            notes
                .iter()
                .map(|n| n.split(' ').next().unwrap().to_string())
                .collect()
        };

        // Nothing given: everything recorded is taken.
        let mut opts = VerifyOptions::default();
        let f = m.fill(&mut opts).unwrap();
        assert_eq!(
            flags(&f.taken),
            [
                "--against",
                "--base",
                "--key",
                "--dtype",
                "--rename",
                "--strict"
            ]
        );
        assert!(f.overridden.is_empty(), "{:?}", f.overridden);
        assert_eq!(opts.checkpoint, Path::new(&ckpt));
        assert_eq!(opts.base.as_deref(), Some(Path::new(&base)));
        assert_eq!(opts.open.key.as_deref(), Some("model"));
        assert_eq!(
            opts.plan.dtype,
            DtypeChoice::Fixed(DType::from_torch_name("bfloat16").unwrap())
        );
        assert!(opts.plan.strict);
        assert_eq!(opts.plan.renames.len(), 1);

        // The same values given (the checkpoint spelled another way): no note.
        let same = |opts: &mut VerifyOptions| {
            opts.checkpoint = root.join("sub/../ckpt");
            opts.base = Some(PathBuf::from(&base));
            opts.open.key = Some("model".into());
            opts.plan.dtype = DtypeChoice::Fixed(DType::from_torch_name("bfloat16").unwrap());
            opts.plan.renames = vec![(regex::Regex::new("^a\\.").unwrap(), "b.".into())];
            opts.plan.strict = true;
        };
        let mut opts = VerifyOptions::default();
        same(&mut opts);
        let f = m.fill(&mut opts).unwrap();
        assert!(f.taken.is_empty(), "{:?}", f.taken);
        assert!(f.overridden.is_empty(), "{:?}", f.overridden);

        // Other values given: they stay, and each is named.
        let mut opts = VerifyOptions::default();
        same(&mut opts);
        opts.checkpoint = root.join("other");
        opts.open.key = Some("state".into());
        opts.plan.dtype = DtypeChoice::Fixed(DType::from_torch_name("float16").unwrap());
        opts.plan.renames = vec![(regex::Regex::new("^c\\.").unwrap(), "d.".into())];
        let f = m.fill(&mut opts).unwrap();
        assert!(f.taken.is_empty(), "{:?}", f.taken);
        assert_eq!(
            flags(&f.overridden),
            ["--against", "--key", "--dtype", "--rename"]
        );
        assert_eq!(opts.checkpoint, root.join("other"));
        assert_eq!(opts.open.key.as_deref(), Some("state"));
    }
}
