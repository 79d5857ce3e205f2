//! `unshard verify`: check that a model directory holds exactly what merging a
//! checkpoint gives, tensor by tensor, and that its files are consistent.

use std::io::Write;
use std::path::PathBuf;

use unshard::merge::MergeOptions;
use unshard::source::OpenOptions;
use unshard::verify;

use crate::args::{JsonArg, PlanArgs};
use crate::exit::{self, Status};
use crate::progress::Bar;
use crate::text;

/// Arguments of the command (its help is on `Command` in main.rs).
#[derive(clap::Args, Debug)]
pub struct VerifyArgs {
    /// The model directory to check.
    dir: PathBuf,

    /// The checkpoint the directory should hold (as given to `unshard merge`).
    #[arg(long, value_name = "CHECKPOINT")]
    against: PathBuf,

    // The options the merge was run with: the same flags, the same parsing.
    #[command(flatten)]
    plan: PlanArgs,

    /// No progress output.
    #[arg(long, short)]
    quiet: bool,

    #[command(flatten)]
    json: JsonArg,
}

pub fn run(args: VerifyArgs) -> anyhow::Result<Status> {
    let opts = MergeOptions {
        checkpoint: args.against,
        base: args.plan.base.clone(),
        output: args.dir,
        open: OpenOptions {
            key: args.plan.key.key.clone(),
        },
        plan: args.plan.plan_options()?,
        cancel: crate::signals::token(),
        ..MergeOptions::default()
    };
    let progress = Bar::new(args.quiet, "compared");
    let report = verify::verify_against(&opts, &progress)?;
    let mut out = std::io::stdout().lock();
    if args.json.json {
        serde_json::to_writer_pretty(&mut out, &to_json(&report))?;
        writeln!(out)?;
    } else {
        for f in report.findings() {
            writeln!(out, "{}", text::escape_lines(&f))?;
        }
        if report.is_ok() {
            writeln!(out, "ok: {}", report.summary())?;
        }
    }
    out.flush()?;
    if report.is_ok() {
        return Ok(Status::Success);
    }
    exit::print_error(&anyhow::anyhow!(
        "verification failed: {}",
        report.summary()
    ));
    Ok(Status::Failure)
}

/// The report as JSON. Numbers that are not finite (a max abs diff of inf, a NaN
/// value) become null.
fn to_json(r: &verify::VerifyReport) -> serde_json::Value {
    use serde_json::json;
    let problems: Vec<_> = r
        .problems
        .iter()
        .map(|p| json!({"file": p.file, "tensor": p.tensor, "message": p.msg}))
        .collect();
    let mismatches: Vec<_> = r
        .mismatches
        .iter()
        .map(|m| {
            json!({
                "file": m.file,
                "tensor": m.name,
                "dtype": m.dtype.safetensors_name(),
                "shape": m.shape,
                "differing": m.differing,
                "nan_mismatch": m.nan_mismatch,
                "max_abs_diff": m.max_abs_diff,
                "first": m.first.map(|d| json!({
                    "index": verify::unravel(d.index, &m.shape),
                    "expected": d.expected,
                    "found": d.found,
                })),
            })
        })
        .collect();
    json!({
        "ok": r.is_ok(),
        "dir": r.dir.display().to_string(),
        "files": r.files,
        "tensors_compared": r.tensors_compared,
        "bytes_compared": r.bytes_compared,
        "problems": problems,
        "mismatches": mismatches,
        "summary": r.summary(),
    })
}
