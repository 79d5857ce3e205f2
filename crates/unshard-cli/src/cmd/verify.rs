//! `unshard verify`: check that a model directory holds exactly what merging a
//! checkpoint gives, tensor by tensor, and that its files are consistent.

use std::io::Write;
use std::path::PathBuf;

use unshard::{OpenOptions, VerifyOptions};

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
    let opts = VerifyOptions {
        dir: args.dir,
        checkpoint: args.against,
        base: args.plan.base.clone(),
        open: OpenOptions {
            key: args.plan.key.key.clone(),
        },
        plan: args.plan.plan_options()?,
        cancel: crate::signals::token(),
    };
    let progress = Bar::new(args.quiet, "compared");
    let report = unshard::verify(&opts, &progress)?;
    let mut out = std::io::stdout().lock();
    if args.json.json {
        serde_json::to_writer_pretty(&mut out, &report)?;
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
