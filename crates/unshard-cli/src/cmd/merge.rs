//! `unshard merge`: write a Hugging Face model directory from a checkpoint, then
//! print what was done (the summary) unless asked to be quiet.

use std::io::Write;
use std::path::PathBuf;

use unshard::{MergeOptions, MergeReport, OpenOptions, Part, WarningKind};

use crate::text::{human_bytes, list_some};

use crate::args::{JsonArg, PlanArgs};
use crate::exit::{Status, UsageError};
use crate::progress::Bar;
use crate::signals;
use crate::text;
use crate::unsafe_report::{self, RefuseArg};

/// Arguments of the command (its help is on `Command` in main.rs).
#[derive(clap::Args, Debug)]
pub struct MergeArgs {
    /// The checkpoint: a torch.save file (policy.pt, pytorch_model.bin, ...), a
    /// torch.distributed.checkpoint directory, a directory of per-rank files, a
    /// DeepSpeed checkpoint folder (`latest` + `global_stepN/`, or a Trainer
    /// `checkpoint-N/`), or a peft LoRA/DoRA adapter directory (fused into --base).
    checkpoint: PathBuf,

    /// Where to write the model directory (created; must be empty or absent).
    /// The same as --output.
    #[arg(value_name = "OUT", required_unless_present = "output")]
    out: Option<PathBuf>,

    /// Where to write the model directory, when not given after the checkpoint.
    #[arg(long, short, value_name = "DIR")]
    output: Option<PathBuf>,

    #[command(flatten)]
    plan: PlanArgs,

    /// Write inf where a cast to float16 overflows (instead of failing).
    #[arg(long)]
    allow_overflow: bool,

    /// Replace a non-empty output directory.
    #[arg(long)]
    force: bool,

    /// Read the written output back and check it against the checkpoint (as
    /// `unshard verify` does) before moving it into place.
    #[arg(long)]
    verify: bool,

    /// Fail, writing nothing, if any tensor holds NaN or inf (instead of warning).
    #[arg(long)]
    fail_on_nonfinite: bool,

    /// Do not write OUT/unshard.json (the inputs' absolute paths, the options, each
    /// file's size and checksum), which `unshard verify OUT` reads.
    #[arg(long)]
    no_manifest: bool,

    /// Write the weights alone when there is no config.json (no --base and none
    /// beside the checkpoint): an output transformers cannot load until a
    /// config.json is added. Without it such a merge is refused.
    #[arg(long)]
    weights_only: bool,

    #[command(flatten)]
    refuse: RefuseArg,

    /// No progress output and no summary: errors and warnings only (the warning
    /// about a pickle that would run code included).
    #[arg(long, short)]
    quiet: bool,

    /// A longer summary: every renamed tensor and every tensor taken from the base
    /// (the summary lists the first few).
    #[arg(long, short, conflicts_with_all = ["quiet", "json"])]
    verbose: bool,

    // --json: the merge report on stdout instead of the summary on stderr;
    // warnings still go to stderr.
    #[command(flatten)]
    json: JsonArg,

    /// Write only part I of N of the output's shards (I from 0), for a merge split
    /// over N processes or machines sharing the output's filesystem; the last part
    /// to finish commits the output. `auto` takes I and N from torchrun (RANK,
    /// WORLD_SIZE) or Slurm (SLURM_PROCID/SLURM_NTASKS, or a job array's
    /// SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT).
    #[arg(long, value_name = "I/N|auto", conflicts_with = "json")]
    part: Option<String>,
}

pub fn run(args: MergeArgs) -> anyhow::Result<Status> {
    let output = match (args.out, args.output) {
        (Some(a), Some(b)) if a != b => {
            return Err(UsageError {
                msg: format!(
                    "two outputs given: '{}' after the checkpoint and --output '{}'",
                    a.display(),
                    b.display()
                ),
                hint: "give the output directory once: `unshard merge CHECKPOINT OUT`".into(),
            }
            .into())
        }
        (Some(o), _) | (None, Some(o)) => o,
        // clap already requires one of the two.
        (None, None) => {
            return Err(UsageError {
                msg: "no output directory given".into(),
                hint: "`unshard merge CHECKPOINT OUT`".into(),
            }
            .into())
        }
    };
    // A URL's user info and query are kept by its store's client, never shown.
    let opts = MergeOptions {
        checkpoint: unshard::location(&args.checkpoint),
        base: args.plan.base_dir().as_deref().map(unshard::location),
        output: unshard::location(&output),
        open: OpenOptions {
            key: args.plan.key.key.clone(),
            tag: args.plan.key.tag.clone(),
        },
        plan: args.plan.plan_options()?,
        force: args.force,
        allow_overflow: args.allow_overflow,
        verify: args.verify,
        fail_on_nonfinite: args.fail_on_nonfinite,
        no_manifest: args.no_manifest,
        weights_only: args.weights_only,
        adapter: args.plan.adapter.options(),
        unsafe_pickles: args.refuse.policy(args.plan.strict),
        cancel: signals::token(),
    };
    signals::protect_output(&opts.output);
    let progress = Bar::new(args.quiet, "written");
    if let Some(part) = &args.part {
        let part = match part.as_str() {
            "auto" => Part::from_env(|k| std::env::var(k).ok())?,
            p => Part::parse(p)?,
        };
        let o = unshard::merge_part(&opts, part, &progress)?;
        if !args.quiet {
            let mut err = std::io::stderr().lock();
            let p = format!("part {}/{}", part.index, part.count);
            text::write_escaped(&mut err, |w| {
                writeln!(
                    w,
                    "{p}: wrote {} of {} shard(s) ({})",
                    o.shards.len(),
                    o.total_shards,
                    list_some(&o.shards, 4)
                )?;
                if o.committed {
                    writeln!(
                        w,
                        "{p}: every part is done: committed {}",
                        opts.output.display()
                    )
                } else {
                    let waiting: Vec<String> =
                        o.waiting_for.iter().map(|i| i.to_string()).collect();
                    writeln!(
                        w,
                        "{p}: done; waiting for part(s) {} (plan {}, in {})",
                        list_some(&waiting, 8),
                        o.plan_hash,
                        o.staging.display()
                    )
                }
            })?;
            err.flush()?;
        }
        return Ok(Status::Success);
    }
    let outcome = unshard::merge(&opts, &progress).inspect_err(|_| {
        let base = opts.base.as_deref().into_iter();
        let paths: Vec<&std::path::Path> = base.chain([opts.checkpoint.as_path()]).collect();
        unsafe_report::after_error(&paths);
    })?;
    let mut err = std::io::stderr().lock();
    // --quiet silences what was done, never what may be wrong with the result.
    text::write_escaped(&mut err, |w| match args.quiet || args.json.json {
        true => print_warnings(w, &outcome),
        false => print_summary(w, &opts, &outcome, args.verbose),
    })?;
    err.flush()?;
    if args.json.json {
        let mut out = std::io::stdout().lock();
        serde_json::to_writer_pretty(&mut out, &outcome)?;
        writeln!(out)?;
        out.flush()?;
    }
    // The process exits next: freeing the plan's pieces one by one (hundreds of
    // thousands for a checkpoint of many ranks, about 0.1 s) would only delay it.
    std::mem::forget(outcome);
    Ok(Status::Success)
}

/// The report after a successful merge.
fn print_summary(
    w: &mut dyn Write,
    opts: &MergeOptions,
    o: &MergeReport,
    verbose: bool,
) -> std::io::Result<()> {
    let at = o
        .checkpoint_key
        .as_deref()
        .map(|k| format!(", tensors under '{k}'"))
        .unwrap_or_default();
    writeln!(
        w,
        "read {} ({}{at})",
        opts.checkpoint.display(),
        o.checkpoint_format
    )?;
    for n in &o.checkpoint_notes {
        writeln!(w, "note: {n}")?;
    }
    if let Some(c) = &o.config_from {
        writeln!(
            w,
            "note: config.json (and tokenizer files, if any) taken from {}",
            c.display()
        )?;
    }
    writeln!(
        w,
        "tensors: {} written, {} from the checkpoint, {} from the base",
        o.tensors_written,
        o.from_checkpoint,
        o.from_base.len()
    )?;
    if verbose {
        for (a, b) in &o.renamed {
            writeln!(w, "renamed: {a} -> {b}")?;
        }
    } else if let Some((a, b)) = o.renamed.first() {
        let more = if o.renamed.len() > 1 { ", ..." } else { "" };
        writeln!(w, "renamed: {} ({a} -> {b}{more})", o.renamed.len())?;
    }
    for (name, why) in &o.dropped {
        writeln!(w, "dropped: {name} ({why})")?;
    }
    if verbose {
        for name in &o.from_base {
            writeln!(w, "from base: {name}")?;
        }
    } else if !o.from_base.is_empty() {
        writeln!(w, "from base: {}", list_some(&o.from_base, 6))?;
    }
    for (from, to, n) in &o.casts {
        writeln!(w, "cast: {n} tensor(s) {from} -> {to}")?;
    }
    for n in &o.notes {
        writeln!(w, "note: {n}")?;
    }
    print_warnings(w, o)?;
    if let Some(v) = &o.verified {
        writeln!(w, "verified: {}", v.summary())?;
    }
    for c in &o.cleaned {
        writeln!(
            w,
            "note: removed {} left by an interrupted run",
            c.display()
        )?;
    }
    let secs = o.elapsed.as_secs_f64();
    writeln!(
        w,
        "wrote {} in {} shard(s) to {} in {secs:.2} s ({}/s)",
        human_bytes(o.tensor_bytes),
        o.shards,
        opts.output.display(),
        human_bytes((o.tensor_bytes as f64 / secs.max(1e-9)) as u64)
    )
}

/// The warnings about the written model (non-finite values, overflows, what the
/// plan found suspicious): printed even under --quiet. Unsafe pickle calls were
/// printed when the inputs were opened (see `unsafe_report`).
fn print_warnings(w: &mut dyn Write, o: &MergeReport) -> std::io::Result<()> {
    for x in &o.warnings {
        if x.kind != WarningKind::UnsafePickle {
            writeln!(w, "warning: {}", x.message)?;
        }
    }
    Ok(())
}
