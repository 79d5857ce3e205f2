//! `unshard verify`: check that a model directory holds exactly what merging a
//! checkpoint gives, tensor by tensor, and that its files are consistent.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use unshard::merge::MergeOptions;
use unshard::source::OpenOptions;
use unshard::verify;

use crate::{output, plan_options, DtypeArg};

/// Arguments of the command (its help is on `Command` in main.rs).
#[derive(clap::Args, Debug)]
pub struct VerifyArgs {
    /// The model directory to check.
    dir: PathBuf,

    /// The checkpoint the directory should hold (as given to `unshard merge`).
    #[arg(long, value_name = "CHECKPOINT")]
    against: PathBuf,

    /// The base model directory given to the merge.
    #[arg(long, value_name = "DIR")]
    base: Option<PathBuf>,

    /// The --dtype given to the merge.
    #[arg(long, value_enum, default_value = "auto")]
    dtype: DtypeArg,

    /// The --max-shard-size given to the merge. Accepted so that a merge command line
    /// can be reused; the shard layout itself is not compared.
    #[arg(long, default_value = "5GB", value_name = "SIZE")]
    max_shard_size: String,

    /// The --strict given to the merge.
    #[arg(long)]
    strict: bool,

    /// The --key given to the merge.
    #[arg(long, value_name = "PATH")]
    key: Option<String>,

    /// The --tag given to the merge.
    #[arg(long, value_name = "TAG")]
    tag: Option<String>,

    /// The --rename rules given to the merge.
    #[arg(long, value_name = "REGEX=REPLACEMENT")]
    rename: Vec<String>,

    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,

    /// Print the result as one JSON object on stdout (schema in README.md); the exit
    /// code is the same.
    #[arg(long)]
    json: bool,
}

pub fn run(args: VerifyArgs) -> anyhow::Result<()> {
    let opts = MergeOptions {
        checkpoint: args.against,
        base: args.base,
        output: args.dir,
        open: OpenOptions {
            key: args.key,
            tag: args.tag,
        },
        plan: plan_options(args.dtype, &args.max_shard_size, args.strict, &args.rename)?,
        ..MergeOptions::default()
    };
    let progress = output::Bar::new(!args.quiet && std::io::stderr().is_terminal());
    let report = verify::verify_against(&opts, &progress)?;
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &to_json(&report))?;
        writeln!(out)?;
    } else {
        for f in report.findings() {
            writeln!(out, "{f}")?;
        }
        if report.is_ok() {
            writeln!(out, "ok: {}", report.summary())?;
        }
    }
    out.flush()?;
    if report.is_ok() {
        return Ok(());
    }
    anyhow::bail!("verification failed: {}", report.summary())
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
