//! `merge`: open, plan, write, commit. The one entry point the binary calls.

use std::path::PathBuf;
use std::time::{Duration, Instant};

pub use crate::options::MergeOptions;
pub use crate::prepare::prepare;
#[cfg(feature = "internals")]
pub use crate::prepare::Base;

use serde::Serialize;

use crate::digest::hex;
use crate::dtype::ConvertStats;
use crate::dtype::DType;
use crate::error::NonFiniteTensor;
use crate::error::{Error, Result};
use crate::lora;
use crate::manifest::{FileEntry, Manifest, MANIFEST};
use crate::plan::{Origin, Plan};
use crate::prepare::{Prepared, Sources};
use crate::source;
use crate::source::audit::UnsafeCall;
use crate::verify::{self, VerifyReport};
use crate::write::{self, Progress, Sink, StagingDir, WriteOptions};

/// What a merge did: what the command line's summary and `merge --json` show,
/// and what Python's `MergeReport` holds.
#[derive(Clone, Debug, Serialize)]
#[serde(into = "MergeJson")]
pub struct MergeReport {
    /// Where the output was written.
    pub output: PathBuf,
    /// The checkpoint's format.
    pub checkpoint_format: source::Format,
    /// Where in the checkpoint the tensors were found.
    pub checkpoint_key: Option<String>,
    /// What the reader noticed (skipped optimizer state...).
    pub checkpoint_notes: Vec<String>,
    /// What planning noticed (conversions, fused layouts...).
    pub notes: Vec<String>,
    /// Where the config came from, if not from the `base` option.
    pub config_from: Option<PathBuf>,
    /// Tensors written.
    pub tensors_written: usize,
    /// Of those, how many came from the checkpoint.
    pub from_checkpoint: usize,
    /// Output names taken from the base.
    pub from_base: Vec<String>,
    /// `(checkpoint name, output name)` of each renamed tensor.
    pub renamed: Vec<(String, String)>,
    /// `(checkpoint name, why)` of each tensor left out.
    pub dropped: Vec<(String, String)>,
    /// `(from, to, how many tensors)` of each cast.
    pub casts: Vec<(DType, DType, usize)>,
    /// What may be wrong with the inputs or the output (see [`Warning`]).
    pub warnings: Vec<Warning>,
    /// What the inputs' pickles would run under `torch.load` (unshard ran none of it).
    pub unsafe_calls: Vec<UnsafeCall>,
    /// Tensors holding NaN or inf, or that overflowed when cast.
    pub nonfinite: Vec<NonFiniteTensor>,
    /// Every file written, relative to the output, in the order written.
    pub files: Vec<String>,
    /// The BLAKE3 checksum (hexadecimal) of each of `files`, where one was taken
    /// (for `unshard.json` or the `verify` option).
    pub checksums: Vec<Option<String>>,
    /// Bytes written, all files.
    pub bytes_written: u64,
    /// Bytes of tensor data written.
    pub tensor_bytes: u64,
    /// Safetensors shards written.
    pub shards: usize,
    /// Staging directories of interrupted runs that were removed.
    pub cleaned: Vec<PathBuf>,
    /// What the `verify` option found (always a pass: a failure is an error).
    pub verified: Option<VerifyReport>,
    /// How long the merge took.
    pub elapsed: Duration,
}

/// What a [`Warning`] is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WarningKind {
    /// An input's pickle would run code under `torch.load` (unshard ran none of it).
    UnsafePickle,
    /// A tensor holds NaN or inf values in the checkpoint.
    NonFinite,
    /// Values overflowed to inf when cast to the output dtype.
    Overflow,
    /// Something about the output the user should check (no tokenizer, the base
    /// model again, ...).
    Merge,
}

/// One thing a merge found that may be wrong with its inputs or its output: what
/// every front end shows (the CLI on stderr, Python through `warnings`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Warning {
    /// What it is about.
    pub kind: WarningKind,
    /// The warning, in words (without a `warning:` prefix).
    pub message: String,
    /// The output tensor it is about, if one.
    pub tensor: Option<String>,
    /// The input file it is about, if one.
    pub file: Option<String>,
}

/// Everything the merge warns about, unsafe pickle calls first (one warning per
/// file, naming each call), then per-tensor non-finite values and overflows,
/// then what planning found.
fn warnings(plan: &Plan, stats: &[ConvertStats], unsafe_calls: &[UnsafeCall]) -> Vec<Warning> {
    let mut out = unsafe_warnings(unsafe_calls);
    for (t, s) in plan.tensors.iter().zip(stats) {
        if s.nan > 0 || s.inf > 0 {
            out.push(Warning {
                kind: WarningKind::NonFinite,
                message: format!(
                    "tensor '{}' holds {} NaN and {} inf value(s) in the checkpoint",
                    t.name, s.nan, s.inf
                ),
                tensor: Some(t.name.clone()),
                file: None,
            });
        }
        if s.overflow > 0 {
            out.push(Warning {
                kind: WarningKind::Overflow,
                message: format!(
                    "tensor '{}': {} value(s) overflowed to inf in {}",
                    t.name, s.overflow, t.dtype
                ),
                tensor: Some(t.name.clone()),
                file: None,
            });
        }
    }
    out.extend(plan.report.warnings.iter().map(|w| Warning {
        kind: WarningKind::Merge,
        message: w.clone(),
        tensor: None,
        file: None,
    }));
    out
}

/// One [`WarningKind::UnsafePickle`] warning per file, listing each call as
/// [`UnsafeCall::describe`] words it.
fn unsafe_warnings(calls: &[UnsafeCall]) -> Vec<Warning> {
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(first) = calls.get(i) {
        let same = calls[i..]
            .iter()
            .take_while(|c| c.path == first.path)
            .count();
        let listed: Vec<String> = calls[i..i + same].iter().map(|c| c.describe()).collect();
        let file = first.path.display().to_string();
        out.push(Warning {
            kind: WarningKind::UnsafePickle,
            message: format!(
                "{file}: its pickle would run code under torch.load (unshard ran none of it): {}",
                listed.join("; ")
            ),
            tensor: None,
            file: Some(file),
        });
        i += same;
    }
    out
}

/// A [`MergeReport`] as JSON: what a user or a script needs, not the plan's
/// byte layout.
#[derive(Serialize)]
struct MergeJson {
    output: String,
    checkpoint_format: &'static str,
    checkpoint_key: Option<String>,
    notes: Vec<String>,
    config_from: Option<String>,
    tensors_written: usize,
    from_checkpoint: usize,
    from_base: Vec<String>,
    renamed: Vec<(String, String)>,
    dropped: Vec<(String, String)>,
    casts: Vec<(DType, DType, usize)>,
    warnings: Vec<Warning>,
    unsafe_calls: Vec<UnsafeCall>,
    nonfinite: Vec<NonFinite>,
    files: Vec<String>,
    bytes_written: u64,
    verified: Option<VerifyReport>,
    seconds: f64,
}

/// [`crate::error::NonFiniteTensor`] as the JSON report spells it (`tensor`, no dtype).
#[derive(Serialize)]
struct NonFinite {
    tensor: String,
    nan: u64,
    inf: u64,
    overflow: u64,
}

impl From<MergeReport> for MergeJson {
    fn from(o: MergeReport) -> Self {
        MergeJson {
            output: o.output.display().to_string(),
            checkpoint_format: o.checkpoint_format.id(),
            checkpoint_key: o.checkpoint_key,
            notes: o.checkpoint_notes.into_iter().chain(o.notes).collect(),
            config_from: o.config_from.map(|p| p.display().to_string()),
            tensors_written: o.tensors_written,
            from_checkpoint: o.from_checkpoint,
            from_base: o.from_base,
            renamed: o.renamed,
            dropped: o.dropped,
            casts: o.casts,
            warnings: o.warnings,
            unsafe_calls: o.unsafe_calls,
            nonfinite: o
                .nonfinite
                .into_iter()
                .map(|t| NonFinite {
                    tensor: t.name,
                    nan: t.nan,
                    inf: t.inf,
                    overflow: t.overflow,
                })
                .collect(),
            files: o.files,
            bytes_written: o.bytes_written,
            verified: o.verified,
            seconds: o.elapsed.as_secs_f64(),
        }
    }
}

/// Runs a whole merge into the local directory `opts.output`: written into a
/// staging directory beside it, renamed into place when complete.
pub fn merge(opts: &MergeOptions, progress: &dyn Progress) -> Result<MergeReport> {
    // URLs given with user info or a query are used without them from here on, so
    // no message or output file shows them.
    let given = opts;
    let opts = &MergeOptions {
        checkpoint: source::fs::location(&given.checkpoint),
        base: given.base.as_deref().map(source::fs::location),
        output: source::fs::location(&given.output),
        ..given.clone()
    };
    if source::fs::is_url(&opts.output) {
        return merge_to_bucket(opts, progress);
    }
    // Output problems are cheap to find: report them before reading anything.
    let cleaned = write::check_output(&opts.output, &write_options(opts))?;
    let open_sink = || -> Result<Box<dyn Sink>> { Ok(Box::new(StagingDir::create(&opts.output)?)) };
    let mut report = merge_into(opts, progress, &open_sink)?;
    report.cleaned = cleaned;
    Ok(report)
}

/// A merge into object storage (see [`crate::write::bucket`]): the output prefix is
/// checked before anything is read, and written by a [`crate::write::bucket::BucketSink`].
#[cfg(feature = "remote")]
fn merge_to_bucket(opts: &MergeOptions, progress: &dyn Progress) -> Result<MergeReport> {
    use crate::write::bucket::{check_output, BucketSink};
    if opts.verify {
        // Refused before any work: the output has no local copy to read back.
        return Err(Error::Usage(
            "--verify reads the output back before committing it, which an output in object storage does not allow; run `unshard verify` on it afterwards".into(),
        ));
    }
    check_output(&opts.output, opts.force)?;
    let open_sink =
        || -> Result<Box<dyn Sink>> { Ok(Box::new(BucketSink::create(&opts.output, opts.force)?)) };
    merge_into(opts, progress, &open_sink)
}

#[cfg(not(feature = "remote"))]
fn merge_to_bucket(opts: &MergeOptions, _: &dyn Progress) -> Result<MergeReport> {
    Err(Error::Unsupported {
        path: opts.output.clone(),
        what: "writing to object storage in this build".into(),
        hint: Some(
            "build unshard with the `remote` feature (the default for the command-line tool)"
                .into(),
        ),
    })
}

/// Refuses a plan with no config.json to write, which transformers could not load,
/// unless the options ask for weights only.
pub(crate) fn check_loadable(opts: &MergeOptions, plan: &Plan) -> Result<()> {
    if plan.config.is_some() || opts.weights_only {
        return Ok(());
    }
    let (msg, hint) = match &opts.base {
        Some(b) => (
            format!(
                "{}: the base has no config.json, so the output would hold weights only, which transformers cannot load",
                b.display()
            ),
            "pass as --base the model directory training started from (with its config.json), a Hub id in the local cache (org/name), or the Trainer output folder that holds config.json; or --weights-only to write the weights alone",
        ),
        None => (
            format!(
                "{}: no config.json: no --base was given and none is beside the checkpoint, so the output would hold weights only, which transformers cannot load",
                opts.checkpoint.display()
            ),
            "pass --base: the model directory training started from, a Hub id in the local cache (org/name), or the Trainer output folder that holds config.json; or --weights-only to write the weights alone",
        ),
    };
    Err(Error::plan(msg, Some(hint.into())))
}

/// Why `no_fuse` cannot write into a bucket: the adapter directory is written with
/// local file calls.
pub(crate) const NO_FUSE_NEEDS_A_DIRECTORY: &str =
    "--no-fuse writes the adapter into a local output directory, and this output has none: write to a local directory and upload it";

/// Runs a merge into the [`Sink`] that `open_sink` makes once the plan is ready
/// (`opts.output` is then only used in messages). What the sink wrote is
/// committed only when everything succeeded, verification included.
pub fn merge_into(
    opts: &MergeOptions,
    progress: &dyn Progress,
    open_sink: &dyn Fn() -> Result<Box<dyn Sink>>,
) -> Result<MergeReport> {
    let started = Instant::now();
    // A checkpoint of thousands of ranks takes seconds to open: say what is going on.
    progress.stage(&format!("reading {}", opts.checkpoint.display()));
    let Prepared {
        checkpoint: mut ckpt,
        mut base,
        mut plan,
        adapter,
    } = prepare(Sources::from(opts))?;
    check_loadable(opts, &plan)?;
    let wopts = WriteOptions {
        extra_files: base
            .as_ref()
            .map(|b| b.dir.extra_files.clone())
            .unwrap_or_default(),
        ..write_options(opts)
    };
    let sink = open_sink()?;
    // Refused before anything is written, not after the shards.
    if adapter.as_deref().is_some_and(|a| a.no_fuse()) && sink.staged_dir().is_none() {
        return Err(Error::Usage(NO_FUSE_NEEDS_A_DIRECTORY.into()));
    }
    // With an adapter, lora::summary says whether the fuse changes anything.
    let unchanged = match adapter {
        Some(_) => None,
        None => verify::unchanged_from_base(
            &plan,
            Prepared::inputs_of(&ckpt, base.as_ref()),
            &opts.cancel,
        )?,
    };
    // The plan holds what it takes of the inputs' tensor descriptions; the writer
    // and verify read the inputs' files only. At DeepSeek-V3's tensor count the
    // base's descriptions are a fifth of the heap.
    ckpt.tensors = Vec::new();
    if let Some(w) = base.as_mut().and_then(|b| b.weights.as_mut()) {
        w.tensors = Vec::new();
    }
    release_freed_memory();
    let inputs = Prepared::inputs_of(&ckpt, base.as_ref());
    if let Some(n) = unchanged {
        plan.report.warnings.push(format!(
            "all {n} checkpoint tensor(s) equal the base's after conversion: the output is the base model again (an adapter-only export, or a checkpoint saved before training changed anything?)"
        ));
    }
    let summary = write::write_into(&plan, inputs, sink.as_ref(), &wopts, progress)?;
    if let Some(a) = adapter.as_deref().filter(|a| a.no_fuse()) {
        let Some(dir) = sink.staged_dir() else {
            return Err(Error::Usage(NO_FUSE_NEEDS_A_DIRECTORY.into()));
        };
        lora::export::write_adapter_dir(&dir.join("adapter"), a.resolved(), &ckpt.files)?;
    }
    if opts.fail_on_nonfinite {
        verify::check_finite(&plan, &summary.stats)?;
    }
    let verified = if opts.verify {
        let Some(dir) = sink.staged_dir() else {
            return Err(Error::Usage(
                "verifying a merge reads its output back, and this output has no local copy".into(),
            ));
        };
        verify::drop_cached(dir, &plan);
        // The writer's block checksums, compared with the one read of the output.
        let expected = crate::digest::written(&summary.files, &summary.digests);
        let report = verify::verify_dir(
            dir,
            &plan,
            inputs,
            &expected,
            &write::NoProgress,
            &opts.cancel,
        )?;
        if !report.is_ok() {
            return Err(report.to_error());
        }
        Some(report)
    } else {
        None
    };
    let mut summary = summary;
    if !opts.no_manifest {
        // Written last, into the same staging: committed with the rest or not at all.
        let files = FileEntry::of_written(&summary.files, &summary.digests);
        let calls = crate::prepare::unsafe_calls(&ckpt, base.as_ref());
        let bytes = Manifest::new(opts, ckpt.format.id(), plan.dtype, files, &calls).to_bytes();
        sink.write_file(MANIFEST, &bytes)?;
        summary.files.push(MANIFEST.into());
        summary.digests.push(write::FileDigest::of_bytes(&bytes));
    }
    opts.cancel.check()?;
    sink.commit()?;
    let config_from = match (&opts.base, &base) {
        (None, Some(b)) => Some(b.dir.path.clone()),
        _ => None,
    };
    let unsafe_calls = crate::prepare::unsafe_calls(&ckpt, base.as_ref());
    Ok(MergeReport {
        output: opts.output.clone(),
        checkpoint_format: ckpt.format,
        checkpoint_key: ckpt.key.clone(),
        checkpoint_notes: ckpt.notes.clone(),
        notes: plan.report.notes.clone(),
        config_from,
        tensors_written: plan.tensors.len(),
        from_checkpoint: plan
            .tensors
            .iter()
            .filter(|t| t.origin == Origin::Checkpoint)
            .count(),
        from_base: plan.report.from_base.clone(),
        renamed: plan.report.renamed.clone(),
        dropped: plan.report.dropped.clone(),
        casts: plan.report.casts.clone(),
        warnings: warnings(&plan, &summary.stats, &unsafe_calls),
        unsafe_calls,
        nonfinite: verify::nonfinite_tensors(&plan, &summary.stats),
        checksums: summary
            .digests
            .iter()
            .map(|d| d.tree().map(|t| hex(&t)))
            .collect(),
        files: summary.files,
        bytes_written: summary.bytes_written,
        tensor_bytes: plan.total_size,
        shards: plan.shards.len(),
        cleaned: summary.cleaned,
        verified,
        elapsed: started.elapsed(),
    })
}

/// What writing takes from the merge's options (the base's extra files are added
/// once the base is open).
fn write_options(opts: &MergeOptions) -> WriteOptions {
    let mut protected = vec![opts.checkpoint.clone()];
    protected.extend(opts.base.clone());
    WriteOptions {
        force: opts.force,
        allow_overflow: opts.allow_overflow,
        extra_files: Vec::new(),
        protected,
        cancel: opts.cancel.clone(),
        // Hashing costs about a core-second per GB: only for what uses it.
        checksums: !opts.no_manifest || opts.verify,
    }
}

/// Parses a shard size: `5GB` (decimal, as transformers), `500MiB` (binary), or bytes.
pub fn parse_size(s: &str) -> Option<u64> {
    let t = s.trim();
    let upper = t.to_ascii_uppercase();
    let units: [(&str, u64); 9] = [
        ("TIB", 1 << 40),
        ("GIB", 1 << 30),
        ("MIB", 1 << 20),
        ("KIB", 1 << 10),
        ("TB", 1_000_000_000_000),
        ("GB", 1_000_000_000),
        ("MB", 1_000_000),
        ("KB", 1_000),
        ("B", 1),
    ];
    for (u, m) in units {
        if let Some(num) = upper.strip_suffix(u) {
            let num = num.trim();
            if let Ok(n) = num.parse::<u64>() {
                return n.checked_mul(m);
            }
            let f: f64 = num.parse().ok()?;
            if !(f.is_finite() && f >= 0.0) {
                return None;
            }
            return Some((f * m as f64) as u64);
        }
    }
    upper.parse().ok()
}

/// Hands the memory planning freed back to the system before the writer's threads
/// start: glibc keeps freed chunks in its heap, so the reading and planning of tens
/// of thousands of tensors would otherwise stay in the resident set while writing.
fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_decimal_unless_binary_units_are_given() {
        assert_eq!(parse_size("5GB"), Some(5_000_000_000));
        assert_eq!(parse_size("200KB"), Some(200_000));
        assert_eq!(parse_size("2GiB"), Some(2 << 30));
        assert_eq!(parse_size("1.5MB"), Some(1_500_000));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("five"), None);
        assert_eq!(parse_size("-1GB"), None);
    }
}
