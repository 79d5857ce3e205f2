//! From Python's arguments to the library's options, and from the library's
//! reports and errors back to what Python receives.
//!
//! Option values are parsed here with the command line's own rules (the same
//! dtype spellings, sizes and rename syntax), but messages name the keyword
//! arguments (`max_shard_size=`), not the flags.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use unshard::{
    AdapterOption, AdapterOptions, Cancel, DiffOptions, Error, InspectOptions, Manifest,
    MergeOptions, OpenOptions, Part, PlanOptions, Progress, RenameError, UnsafePolicy,
    VerifyOptions, MANIFEST,
};

use crate::job::Counters;

/// The keyword arguments of `merge` and `verify`, as `_api.py` serialises them.
#[derive(Deserialize)]
struct Kwargs {
    base: Option<String>,
    dtype: String,
    max_shard_size: String,
    strict: bool,
    key: Option<String>,
    tag: Option<String>,
    rename: Vec<String>,
    force: bool,
    allow_overflow: bool,
    verify: bool,
    fail_on_nonfinite: bool,
    adapter: Option<String>,
    adapter_config: Option<String>,
    no_fuse: bool,
    #[serde(default)]
    no_manifest: bool,
    #[serde(default)]
    weights_only: bool,
    #[serde(default)]
    refuse_unsafe: bool,
    #[serde(default)]
    part: Option<String>,
    #[serde(default)]
    layout: Option<String>,
}

/// A merge (or the merge a `verify` re-derives), ready to run.
pub struct MergeRequest {
    opts: MergeOptions,
    /// `part=`: `I/N` or `auto`.
    part: Option<String>,
}

impl MergeRequest {
    /// Parses the keyword arguments; a bad value is a usage error naming it.
    pub fn parse(checkpoint: &str, output: &str, kwargs: &str) -> Result<MergeRequest, Error> {
        let k: Kwargs = serde_json::from_str(kwargs)
            .map_err(|e| Error::Usage(format!("malformed options from the Python layer: {e}")))?;
        let plan = plan_options(&k)?;
        let open = OpenOptions {
            key: k.key,
            tag: k.tag,
        };
        Ok(MergeRequest {
            opts: MergeOptions {
                checkpoint: PathBuf::from(checkpoint),
                base: k.base.map(PathBuf::from),
                output: PathBuf::from(output),
                open,
                plan,
                force: k.force,
                allow_overflow: k.allow_overflow,
                verify: k.verify,
                fail_on_nonfinite: k.fail_on_nonfinite,
                no_manifest: k.no_manifest,
                weights_only: k.weights_only,
                // As on the command line: `strict` refuses too. Python is told
                // through the report's warnings, not a callback.
                unsafe_pickles: UnsafePolicy {
                    refuse: k.refuse_unsafe || k.strict,
                    report: None,
                },
                adapter: AdapterOptions {
                    name: k.adapter,
                    config: k.adapter_config.map(PathBuf::from),
                    no_fuse: k.no_fuse,
                },
                cancel: Cancel::new(),
            },
            part: k.part,
        })
    }

    /// Runs the merge; the report as JSON.
    pub fn run(mut self, progress: &dyn Progress, cancel: &Cancel) -> Result<String, Error> {
        self.opts.cancel = cancel.clone();
        if let Some(p) = &self.part {
            let part = match p.as_str() {
                "auto" => Part::from_env(|k| std::env::var(k).ok()),
                p => Part::parse(p),
            }
            // The library words these for the command line's --part.
            .map_err(|e| match e {
                Error::Usage(m) => Error::Usage(
                    m.replace("--part auto", "part='auto'")
                        .replace("--part '", "part='"),
                ),
                e => e,
            })?;
            let o = unshard::merge_part(&self.opts, part, progress)?;
            return to_json(&PartJson {
                part: format!("{}/{}", part.index, part.count),
                output: self.opts.output.display().to_string(),
                shards: o.shards,
                total_shards: o.total_shards,
                committed: o.committed,
                waiting_for: o.waiting_for,
                plan_hash: o.plan_hash,
                staging: o.staging.display().to_string(),
            });
        }
        let outcome = unshard::merge(&self.opts, progress)?;
        to_json(&outcome)
    }

    /// Verifies `output` against the merge these options describe, completed (as
    /// `unshard verify` does) by what the output's `unshard.json` records: the
    /// checkpoint when none is given, and every option left at its default. The
    /// report as JSON, with what was taken from `unshard.json`.
    pub fn verify(self, progress: &dyn Progress, cancel: &Cancel) -> Result<String, Error> {
        let mut opts = VerifyOptions::of_merge(&self.opts, &self.opts.output);
        opts.cancel = cancel.clone();
        let filled = match Manifest::read(&opts.dir)? {
            Some(m) => Some(m.fill(&mut opts)?),
            None if opts.checkpoint.as_os_str().is_empty() => {
                return Err(Error::Usage(format!(
                    "no checkpoint to verify against: {} has no {MANIFEST} (merge writes one unless no_manifest=True); pass against=CHECKPOINT and the merge's keywords (base=, dtype=, ...)",
                    opts.dir.display()
                )))
            }
            None => None,
        };
        let report = unshard::verify(&opts, progress)?;
        let mut json = serde_json::to_value(&report).map_err(|e| Error::Check {
            msg: format!("cannot serialise the report: {e}"),
            hint: None,
        })?;
        if let Some(o) = json.as_object_mut() {
            let (taken, overridden, skipped) = match filled {
                Some(f) => (f.taken, f.overridden, f.checksums_skipped),
                None => (Vec::new(), Vec::new(), None),
            };
            o.insert(
                "against".into(),
                opts.checkpoint.display().to_string().into(),
            );
            o.insert("from_manifest".into(), taken.into());
            o.insert("overridden".into(), overridden.into());
            o.insert("checksums_skipped".into(), skipped.into());
        }
        to_json(&json)
    }
}

/// What one part of a split merge did, as `unshard.merge(..., part=)` returns it.
#[derive(serde::Serialize)]
struct PartJson {
    part: String,
    output: String,
    shards: Vec<String>,
    total_shards: usize,
    committed: bool,
    waiting_for: Vec<usize>,
    plan_hash: String,
    staging: String,
}

fn plan_options(k: &Kwargs) -> Result<PlanOptions, Error> {
    let dtype = unshard_cli::parse_dtype(&k.dtype).ok_or_else(|| {
        Error::Usage(format!(
            "dtype={:?} is not a dtype unshard writes (auto, float16, bfloat16, float32, or bf16, fp16, half, fp32, float, torch.bfloat16, ...)",
            k.dtype
        ))
    })?;
    let max_shard_size = unshard::parse_size(&k.max_shard_size)
        .filter(|&s| s > 0)
        .ok_or_else(|| {
            Error::Usage(format!(
                "max_shard_size={:?} is not a size (examples: \"5GB\", \"500MB\", \"2GiB\", 1000000)",
                k.max_shard_size
            ))
        })?;
    let mut renames = Vec::new();
    for r in &k.rename {
        renames.push(unshard::parse_rename(r).map_err(|e| match e {
            RenameError::MissingEquals => {
                Error::Usage(format!("rename {r:?} must be \"REGEX=REPLACEMENT\""))
            }
            RenameError::Regex(e) => {
                Error::Usage(format!("rename {r:?}: invalid regular expression: {e}"))
            }
        })?);
    }
    let layout = match k.layout.as_deref() {
        None => unshard::ExpertLayout::Base,
        Some("packed") => unshard::ExpertLayout::Packed,
        Some("original") => unshard::ExpertLayout::Original,
        Some(l) => {
            return Err(Error::Usage(format!(
            "layout={l:?} is not a layout (\"packed\", \"original\", or None: as the base's files)"
        )))
        }
    };
    Ok(PlanOptions {
        dtype,
        strict: k.strict,
        renames,
        max_shard_size,
        layout,
        ..PlanOptions::default()
    })
}

/// `unshard.inspect`: the report as JSON.
pub fn inspect(
    path: &str,
    key: Option<String>,
    tag: Option<String>,
    stats: bool,
    cancel: &Cancel,
) -> Result<String, Error> {
    let open = OpenOptions { key, tag };
    let report = unshard::inspect(&InspectOptions {
        path: PathBuf::from(path),
        open,
        stats,
        cancel: cancel.clone(),
    })?;
    to_json(&report)
}

/// `unshard.diff`: the report as JSON.
pub fn diff(
    a: &str,
    b: &str,
    refuse_unsafe: bool,
    progress: &dyn Progress,
    cancel: &Cancel,
) -> Result<String, Error> {
    let report = unshard::diff(
        &DiffOptions {
            a: PathBuf::from(a),
            b: PathBuf::from(b),
            open: OpenOptions::default(),
            unsafe_pickles: UnsafePolicy {
                refuse: refuse_unsafe,
                report: None,
            },
            cancel: cancel.clone(),
        },
        progress,
    )?;
    to_json(&report)
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<String, Error> {
    serde_json::to_string(v).map_err(|e| Error::Check {
        msg: format!("cannot serialise the report: {e}"),
        hint: None,
    })
}

/// Progress into the shared counters. `UNSHARD_TEST_WINDOW_DELAY_MS` slows each
/// step down (as in the command line) so that tests can cancel mid-merge.
pub struct Reporter<'a> {
    counters: &'a Counters,
    delay: Option<Duration>,
}

impl<'a> Reporter<'a> {
    /// A reporter into `counters`.
    pub fn new(counters: &'a Counters) -> Reporter<'a> {
        let delay = std::env::var("UNSHARD_TEST_WINDOW_DELAY_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis);
        Reporter { counters, delay }
    }
}

impl Progress for Reporter<'_> {
    fn start(&self, total_bytes: u64) {
        self.counters.start(total_bytes);
    }
    fn advance(&self, bytes: u64) {
        if let Some(d) = self.delay {
            std::thread::sleep(d);
        }
        self.counters.advance(bytes);
    }
}

/// The `kind` Python maps to an exception class (see `python/unshard/_errors.py`).
pub fn kind_of(e: &Error) -> &'static str {
    match e {
        Error::Io { .. }
        | Error::Corrupt { .. }
        | Error::Pickle { .. }
        | Error::Unsupported { .. }
        | Error::UnknownFormat { .. }
        | Error::BadTensor { .. }
        | Error::Incomplete { .. }
        | Error::NoTensors { .. }
        | Error::KeyNotFound { .. }
        | Error::AmbiguousTensors { .. } => "unreadable_checkpoint",
        Error::UnknownTensors { .. } => "unknown_tensor",
        Error::ShapeMismatch { .. } => "shape_mismatch",
        Error::DuplicateName { .. } => "duplicate_name",
        Error::Strict { .. } => "strict",
        Error::OutputExists { .. } => "output_exists",
        Error::NonFinite { .. } => "non_finite",
        Error::Overflow { .. } => "overflow",
        Error::Output { .. } => "output",
        Error::Usage(_) => "usage",
        Error::Unsafe { .. } => "unsafe_pickle",
        Error::Interrupted => "cancelled",
        Error::Check { .. } => "verification_failed",
        Error::WrongInput { .. } => "wrong_input",
        Error::Adapter { .. } => "adapter",
        Error::Plan { .. } => "plan",
        _ => "error",
    }
}

/// The hint, in Python's words (see [`keywords`]).
pub fn hint_of(e: &Error) -> Option<String> {
    e.hint().map(|h| keywords(&h))
}

/// Flags whose keyword takes `True`.
const SWITCHES: &[&str] = &[
    "strict",
    "force",
    "verify",
    "allow-overflow",
    "fail-on-nonfinite",
    "no-manifest",
    "weights-only",
    "refuse-unsafe",
    "no-fuse",
];

/// Flags whose keyword takes a value.
const VALUED: &[&str] = &[
    "base",
    "dtype",
    "max-shard-size",
    "key",
    "tag",
    "rename",
    "adapter",
    "adapter-config",
    "part",
    "against",
];

/// A message or hint in the words of Python's keyword arguments: the library's
/// option `renames` is the keyword `rename`, and a command-line flag some messages
/// name (`--base`, `--weights-only`) is its keyword (`base=`, `weights_only=True`).
pub fn keywords(text: &str) -> String {
    let text = text
        .replace("`renames`", "`rename=`")
        .replace(AdapterOption::Name.words(), "`adapter=`")
        .replace(AdapterOption::Config.words(), "`adapter_config=`")
        .replace(AdapterOption::NoFuse.words(), "`no_fuse=`");
    let mut out = String::with_capacity(text.len());
    let mut rest = text.as_str();
    while let Some(i) = rest.find("--") {
        let starts_word = rest[..i]
            .chars()
            .next_back()
            .is_none_or(|c| !(c.is_alphanumeric() || c == '-' || c == '_'));
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        let end = after
            .find(|c: char| !(c.is_ascii_lowercase() || c == '-'))
            .unwrap_or(after.len());
        let flag = &after[..end];
        let keyword = flag.replace('-', "_");
        if starts_word && SWITCHES.contains(&flag) {
            out.push_str(&format!("{keyword}=True"));
        } else if starts_word && VALUED.contains(&flag) {
            out.push_str(&format!("{keyword}="));
        } else {
            out.push_str("--");
            out.push_str(flag);
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::keywords;

    #[test]
    fn flags_become_keywords() {
        assert_eq!(
            keywords("pass --base DIR, or --weights-only to write the weights alone"),
            "pass base= DIR, or weights_only=True to write the weights alone"
        );
        assert_eq!(
            keywords("map names with `renames`"),
            "map names with `rename=`"
        );
        // Not a flag of merge, or inside a word: unchanged.
        assert_eq!(keywords("unshard --json a--base"), "unshard --json a--base");
    }
}
