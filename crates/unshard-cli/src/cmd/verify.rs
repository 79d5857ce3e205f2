//! `unshard verify`: check that a model directory holds exactly what merging a
//! checkpoint gives, tensor by tensor, and that its files are consistent.

use std::io::Write;
use std::path::PathBuf;

use unshard::{Manifest, MANIFEST};
use unshard::{OpenOptions, VerifyOptions};

use crate::args::{JsonArg, PlanArgs};
use crate::exit::{self, Status, UsageError};
use crate::progress::Bar;
use crate::text;
use crate::unsafe_report::{self, RefuseArg};

/// Arguments of the command (its help is on `Command` in main.rs).
#[derive(clap::Args, Debug)]
pub struct VerifyArgs {
    /// The model directory to check.
    dir: PathBuf,

    /// The checkpoint the directory should hold (as given to `unshard merge`). By
    /// default the one DIR/unshard.json records.
    #[arg(long, value_name = "CHECKPOINT")]
    against: Option<PathBuf>,

    // The options the merge was run with: the same flags, the same parsing. Those
    // not given are taken from DIR/unshard.json when the merge wrote one.
    #[command(flatten)]
    plan: PlanArgs,

    #[command(flatten)]
    refuse: RefuseArg,

    /// No progress output.
    #[arg(long, short)]
    quiet: bool,

    #[command(flatten)]
    json: JsonArg,
}

pub fn run(args: VerifyArgs) -> anyhow::Result<Status> {
    let mut opts = VerifyOptions {
        dir: unshard::location(&args.dir),
        checkpoint: args
            .against
            .as_deref()
            .map(unshard::location)
            .unwrap_or_default(),
        base: args.plan.base_dir().as_deref().map(unshard::location),
        open: OpenOptions {
            key: args.plan.key.key.clone(),
            tag: args.plan.key.tag.clone(),
        },
        plan: args.plan.plan_options()?,
        adapter: args.plan.adapter.options(),
        unsafe_pickles: args.refuse.policy(args.plan.strict),
        checksums: Vec::new(),
        cancel: crate::signals::token(),
    };
    let manifest_path = opts.dir.join(MANIFEST);
    match Manifest::read(&opts.dir)? {
        Some(m) => {
            let filled = m.fill(&mut opts)?;
            let mut err = std::io::stderr().lock();
            text::write_escaped(&mut err, |w| {
                if !filled.taken.is_empty() && !args.quiet {
                    writeln!(
                        w,
                        "note: the merge's options, from {}: {}",
                        manifest_path.display(),
                        filled.taken.join(" ")
                    )?;
                }
                if let Some(why) = &filled.checksums_skipped {
                    writeln!(w, "warning: {}: {why}", manifest_path.display())?;
                }
                if !filled.overridden.is_empty() {
                    writeln!(
                        w,
                        "note: given here, used instead of what {} records: {}",
                        manifest_path.display(),
                        filled.overridden.join(", ")
                    )?;
                }
                Ok(())
            })?;
        }
        None if opts.checkpoint.as_os_str().is_empty() => {
            return Err(UsageError {
                msg: format!(
                    "no checkpoint to verify against: {} has no {MANIFEST} (written by unshard merge without --no-manifest)",
                    opts.dir.display()
                ),
                hint: "pass the checkpoint and the merge's options: `unshard verify DIR --against CHECKPOINT [--base BASE --dtype ...]`".into(),
            }
            .into())
        }
        None => {}
    }
    let progress = Bar::new(args.quiet, "compared");
    let report = unshard::verify(&opts, &progress)
        .inspect_err(|_| unsafe_report::after_error(&[opts.checkpoint.as_path()]))?;
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
