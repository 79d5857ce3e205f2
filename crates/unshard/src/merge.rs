//! `merge`: open, plan, write, commit. The one entry point the binary calls.

use std::path::PathBuf;
use std::time::{Duration, Instant};

pub use crate::options::MergeOptions;
pub use crate::prepare::{prepare, Base};

use crate::plan::Plan;
use crate::prepare::Prepared;
use crate::source;
use crate::verify::{self, VerifyReport};
use crate::write::{self, Progress, WriteOptions, WriteSummary};
use crate::Result;

/// What a merge did.
#[derive(Debug)]
pub struct MergeOutcome {
    pub plan: Plan,
    pub write: WriteSummary,
    pub checkpoint_format: source::Format,
    pub checkpoint_key: Option<String>,
    pub checkpoint_notes: Vec<String>,
    /// Where the config came from, if not from `--base`.
    pub config_from: Option<PathBuf>,
    /// What `--verify` found (always a pass: a failure is an error).
    pub verified: Option<VerifyReport>,
    pub elapsed: Duration,
}

/// Runs a whole merge.
pub fn merge(opts: &MergeOptions, progress: &dyn Progress) -> Result<MergeOutcome> {
    let started = Instant::now();
    let mut protected = vec![opts.checkpoint.clone()];
    protected.extend(opts.base.clone());
    let wopts = WriteOptions {
        force: opts.force,
        allow_overflow: opts.allow_overflow,
        extra_files: Vec::new(),
        protected,
    };
    // Output problems are cheap to find: report them before reading anything.
    let cleaned = write::check_output(&opts.output, &wopts)?;
    // A checkpoint of thousands of ranks takes seconds to open: say what is going on.
    progress.stage(&format!("reading {}", opts.checkpoint.display()));
    let Prepared {
        checkpoint: ckpt,
        base,
        mut plan,
    } = prepare(opts)?;
    let wopts = WriteOptions {
        extra_files: base
            .as_ref()
            .map(|b| b.dir.extra_files.clone())
            .unwrap_or_default(),
        ..wopts
    };
    let staging = write::create_staging(&opts.output)?;
    let inputs = Prepared::inputs_of(&ckpt, base.as_ref());
    if let Some(n) = verify::unchanged_from_base(&plan, inputs)? {
        plan.report.warnings.push(format!(
            "all {n} checkpoint tensor(s) equal the base's after conversion: the output is the base model again (an adapter-only export, or a checkpoint saved before training changed anything?)"
        ));
    }
    let mut summary = write::write_into(&plan, inputs, &staging.path, &wopts, progress)?;
    summary.cleaned = cleaned;
    if opts.fail_on_nonfinite {
        verify::check_finite(&plan, &summary.stats)?;
    }
    let verified = if opts.verify {
        verify::drop_cached(&staging.path, &plan);
        let report = verify::verify_dir(&staging.path, &plan, inputs, &write::NoProgress)?;
        if !report.is_ok() {
            return Err(report.to_error());
        }
        Some(report)
    } else {
        None
    };
    write::commit(staging, &opts.output)?;
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
