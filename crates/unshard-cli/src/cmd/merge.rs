//! `unshard merge`: write a Hugging Face model directory from a checkpoint, then
//! print what was done (the summary) unless asked to be quiet.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use unshard::merge::{self, MergeOptions, MergeOutcome};
use unshard::plan::Origin;
use unshard::report::{human_bytes, list_some};
use unshard::source::OpenOptions;

use crate::args::PlanArgs;
use crate::exit::Status;
use crate::progress::Bar;
use crate::unsafe_report::{self, RefuseArg};

/// Arguments of the command (its help is on `Command` in main.rs).
#[derive(clap::Args, Debug)]
pub struct MergeArgs {
    /// The checkpoint: a torch.save file (policy.pt, pytorch_model.bin, ...), a
    /// torch.distributed.checkpoint directory, or a directory of per-rank files.
    checkpoint: PathBuf,

    /// Where to write the model directory (created; must be empty or absent).
    #[arg(long, short, value_name = "DIR")]
    output: PathBuf,

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

    #[command(flatten)]
    refuse: RefuseArg,

    /// No progress bar and no summary; errors and unsafe-pickle warnings only.
    #[arg(long, short)]
    quiet: bool,
}

pub fn run(args: MergeArgs) -> anyhow::Result<Status> {
    let opts = MergeOptions {
        checkpoint: args.checkpoint,
        base: args.plan.base.clone(),
        output: args.output,
        open: OpenOptions {
            key: args.plan.key.key.clone(),
        },
        plan: args.plan.plan_options()?,
        force: args.force,
        allow_overflow: args.allow_overflow,
        verify: args.verify,
        fail_on_nonfinite: args.fail_on_nonfinite,
        refuse_unsafe: args.refuse.refuse_unsafe || args.plan.strict,
        on_unsafe: Some(unsafe_report::warn),
    };
    let progress = Bar::new(!args.quiet && std::io::stderr().is_terminal());
    let outcome = merge::merge(&opts, &progress).inspect_err(|_| {
        let base = opts.base.as_deref().into_iter();
        let paths: Vec<&std::path::Path> = base.chain([opts.checkpoint.as_path()]).collect();
        unsafe_report::after_error(&paths);
    })?;
    if !args.quiet {
        let mut err = std::io::stderr().lock();
        print_summary(&mut err, &opts, &outcome)?;
        err.flush()?;
    }
    Ok(Status::Success)
}

/// The report after a successful merge.
fn print_summary(w: &mut dyn Write, opts: &MergeOptions, o: &MergeOutcome) -> std::io::Result<()> {
    let plan = &o.plan;
    let r = &plan.report;
    let from_ckpt = plan
        .tensors
        .iter()
        .filter(|t| t.origin == Origin::Checkpoint)
        .count();
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
        writeln!(w, "note: config and tokenizer taken from {}", c.display())?;
    }
    writeln!(
        w,
        "tensors: {} written, {from_ckpt} from the checkpoint, {} from the base",
        plan.tensors.len(),
        r.from_base.len()
    )?;
    if let Some((a, b)) = r.renamed.first() {
        let more = if r.renamed.len() > 1 { ", ..." } else { "" };
        writeln!(w, "renamed: {} ({a} -> {b}{more})", r.renamed.len())?;
    }
    for (name, why) in &r.dropped {
        writeln!(w, "dropped: {name} ({why})")?;
    }
    if !r.from_base.is_empty() {
        writeln!(w, "from base: {}", list_some(&r.from_base, 6))?;
    }
    for (from, to, n) in &r.casts {
        writeln!(w, "cast: {n} tensor(s) {from} -> {to}")?;
    }
    for n in &r.notes {
        writeln!(w, "note: {n}")?;
    }
    for (t, s) in plan.tensors.iter().zip(&o.write.stats) {
        if s.nan > 0 || s.inf > 0 {
            writeln!(
                w,
                "warning: tensor '{}' holds {} NaN and {} inf value(s) in the checkpoint",
                t.name, s.nan, s.inf
            )?;
        }
        if s.overflow > 0 {
            writeln!(
                w,
                "warning: tensor '{}': {} value(s) overflowed to inf in {}",
                t.name, s.overflow, t.dtype
            )?;
        }
    }
    for x in &r.warnings {
        writeln!(w, "warning: {x}")?;
    }
    if let Some(v) = &o.verified {
        writeln!(w, "verified: {}", v.summary())?;
    }
    for c in &o.write.cleaned {
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
        human_bytes(plan.total_size),
        plan.shards.len(),
        opts.output.display(),
        human_bytes((plan.total_size as f64 / secs.max(1e-9)) as u64)
    )
}
