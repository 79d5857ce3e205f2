//! `merge`: open, plan, write, commit. The one entry point the binary calls.

use std::path::PathBuf;
use std::time::{Duration, Instant};

pub use crate::options::MergeOptions;
pub use crate::prepare::prepare;
#[cfg(feature = "internals")]
pub use crate::prepare::Base;

use serde::Serialize;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::lora;
use crate::manifest::{FileEntry, Manifest, MANIFEST};
use crate::plan::{Origin, Plan};
use crate::prepare::{Prepared, Sources};
use crate::source;
use crate::verify::{self, VerifyReport};
use crate::write::{self, Progress, Sink, StagingDir, WriteOptions, WriteSummary};

/// What a merge did.
#[derive(Clone, Debug, Serialize)]
#[serde(into = "MergeJson")]
pub struct MergeOutcome {
    /// What was written and why (names, dtypes, shards, the planning report).
    pub plan: Plan,
    /// What writing saw (per-tensor NaN/inf/overflow counts, files).
    pub write: WriteSummary,
    /// The checkpoint's format.
    pub checkpoint_format: source::Format,
    /// Where in the checkpoint the tensors were found.
    pub checkpoint_key: Option<String>,
    /// What the reader noticed (skipped optimizer state...).
    pub checkpoint_notes: Vec<String>,
    /// Where the config came from, if not from the `base` option.
    pub config_from: Option<PathBuf>,
    /// What the `verify` option found (always a pass: a failure is an error).
    pub verified: Option<VerifyReport>,
    /// How long the merge took.
    pub elapsed: Duration,
}

/// A [`MergeOutcome`] as JSON: what a user or a script needs, not the plan's
/// byte layout.
#[derive(Serialize)]
struct MergeJson {
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
    warnings: Vec<String>,
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

impl From<MergeOutcome> for MergeJson {
    fn from(o: MergeOutcome) -> Self {
        let nonfinite = verify::nonfinite_tensors(&o.plan, &o.write.stats)
            .into_iter()
            .map(|t| NonFinite {
                tensor: t.name,
                nan: t.nan,
                inf: t.inf,
                overflow: t.overflow,
            })
            .collect();
        let r = o.plan.report;
        MergeJson {
            checkpoint_format: o.checkpoint_format.id(),
            checkpoint_key: o.checkpoint_key,
            notes: o.checkpoint_notes.into_iter().chain(r.notes).collect(),
            config_from: o.config_from.map(|p| p.display().to_string()),
            tensors_written: o.plan.tensors.len(),
            from_checkpoint: o
                .plan
                .tensors
                .iter()
                .filter(|t| t.origin == Origin::Checkpoint)
                .count(),
            from_base: r.from_base,
            renamed: r.renamed,
            dropped: r.dropped,
            casts: r.casts,
            warnings: r.warnings,
            nonfinite,
            files: o.write.files,
            bytes_written: o.write.bytes_written,
            verified: o.verified,
            seconds: o.elapsed.as_secs_f64(),
        }
    }
}

/// Runs a whole merge into the local directory `opts.output`: written into a
/// staging directory beside it, renamed into place when complete.
pub fn merge(opts: &MergeOptions, progress: &dyn Progress) -> Result<MergeOutcome> {
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
    let mut outcome = merge_into(opts, progress, &open_sink)?;
    outcome.write.cleaned = cleaned;
    Ok(outcome)
}

/// A merge into object storage (see [`crate::write::bucket`]): the output prefix is
/// checked before anything is read, and written by a [`crate::write::bucket::BucketSink`].
#[cfg(feature = "remote")]
fn merge_to_bucket(opts: &MergeOptions, progress: &dyn Progress) -> Result<MergeOutcome> {
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
fn merge_to_bucket(opts: &MergeOptions, _: &dyn Progress) -> Result<MergeOutcome> {
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
) -> Result<MergeOutcome> {
    let started = Instant::now();
    // A checkpoint of thousands of ranks takes seconds to open: say what is going on.
    progress.stage(&format!("reading {}", opts.checkpoint.display()));
    let Prepared {
        checkpoint: ckpt,
        base,
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
    let inputs = Prepared::inputs_of(&ckpt, base.as_ref());
    // With an adapter, lora::summary says whether the fuse changes anything.
    let unchanged = match adapter {
        Some(_) => None,
        None => verify::unchanged_from_base(&plan, inputs, &opts.cancel)?,
    };
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
        let bytes = Manifest::new(opts, ckpt.format.id(), plan.dtype, files).to_bytes();
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
    Ok(MergeOutcome {
        plan,
        write: summary,
        checkpoint_format: ckpt.format,
        checkpoint_key: ckpt.key.clone(),
        checkpoint_notes: ckpt.notes.clone(),
        config_from,
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
