//! `unshard inspect`: what an input holds, as a table or as JSON.

use std::io::Write;
use std::path::PathBuf;

use crate::text::human_bytes;
use unshard::{InspectOptions, InspectReport, OpenOptions};

use crate::args::{JsonArg, KeyArg};
use crate::exit::Status;
use crate::text::{self, escape};

/// Arguments of the command (its help is on `Command` in main.rs).
#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// What to inspect: a torch.save file (.pt, .bin), a .safetensors file, a
    /// model directory, a torch.distributed.checkpoint (DCP) directory (.metadata and
    /// .distcp files), a directory of per-rank files (one torch.save per rank), or
    /// a DeepSpeed checkpoint folder (`latest` + `global_stepN/`).
    path: PathBuf,

    #[command(flatten)]
    json: JsonArg,

    #[command(flatten)]
    key: KeyArg,

    /// Also show mean, std, min and max of every tensor (reads all the values).
    #[arg(long)]
    stats: bool,

    /// No per-tensor table: the format, the totals, the non-tensor entries, notes
    /// and what a pickle would run (never silenced).
    #[arg(long, short, conflicts_with_all = ["json", "stats"])]
    quiet: bool,
}

pub fn run(args: InspectArgs) -> anyhow::Result<Status> {
    let report = unshard::inspect(&InspectOptions {
        path: unshard::location(&args.path),
        open: OpenOptions {
            key: args.key.key,
            tag: args.key.tag,
        },
        stats: args.stats,
        cancel: crate::signals::token(),
    })
    .inspect_err(|_| crate::unsafe_report::after_error(&[args.path.as_path()]))?;
    let mut out = std::io::stdout().lock();
    if args.json.json {
        // The schema documented in the README.
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
    } else {
        text::write_escaped(&mut out, |w| {
            print_table(w, &report, args.quiet)?;
            if args.stats {
                print_stats(w, &report)?;
            }
            Ok(())
        })?;
    }
    Ok(Status::Success)
}

/// `--stats` as a table: over finite values; NaN and inf are counted.
fn print_stats(w: &mut dyn Write, r: &InspectReport) -> std::io::Result<()> {
    let name_w = name_width(r);
    writeln!(
        w,
        "statistics (finite values; std with correction 1, as torch.std):"
    )?;
    writeln!(
        w,
        "  {:name_w$}  {:>12}  {:>12}  {:>12}  {:>12}  non-finite",
        "name", "mean", "std", "min", "max"
    )?;
    for (t, s) in r
        .tensors
        .iter()
        .filter_map(|t| Some((t, t.stats.as_ref()?)))
    {
        write!(
            w,
            "  {:name_w$}  {:>12.5e}  {:>12.5e}  {:>12.5e}  {:>12.5e}",
            escape(&t.name),
            s.mean,
            s.std,
            s.min,
            s.max
        )?;
        if s.nan + s.inf > 0 {
            write!(w, "  {} NaN, {} inf", s.nan, s.inf)?;
        }
        writeln!(w)?;
    }
    Ok(())
}

fn print_table(w: &mut dyn Write, ckpt: &InspectReport, quiet: bool) -> std::io::Result<()> {
    let at = match &ckpt.key {
        Some(k) => format!(", tensors under '{k}'"),
        None => String::new(),
    };
    writeln!(w, "{}: {}{at}", ckpt.path.display(), ckpt.format)?;
    let name_w = name_width(ckpt);
    let shapes: Vec<String> = ckpt
        .tensors
        .iter()
        .map(|t| format!("{:?}", t.shape))
        .collect();
    let shape_w = shapes.iter().map(String::len).max().unwrap_or(5).max(5);
    if !quiet {
        writeln!(
            w,
            "  {:name_w$}  {:8}  {:shape_w$}  {:>10}",
            "name", "dtype", "shape", "size"
        )?;
    }
    for (t, shape) in ckpt.tensors.iter().zip(&shapes).filter(|_| !quiet) {
        write!(
            w,
            "  {:name_w$}  {:8}  {:shape_w$}  {:>10}",
            escape(&t.name),
            t.dtype.safetensors_name(),
            shape,
            human_bytes(t.bytes)
        )?;
        if let Some(l) = &t.layout {
            write!(w, "  {l}")?;
        }
        writeln!(w)?;
    }
    let hist: Vec<String> = ckpt
        .dtypes
        .iter()
        .map(|(d, n)| format!("{d}: {n}"))
        .collect();
    writeln!(
        w,
        "{} tensors, {} parameters, {} ({})",
        ckpt.total_tensors,
        ckpt.total_parameters,
        human_bytes(ckpt.total_bytes),
        hist.join(", ")
    )?;
    if !ckpt.non_tensor.is_empty() {
        writeln!(w, "non-tensor entries (not weights; ignored by merge):")?;
        let ew = ckpt
            .non_tensor
            .iter()
            .map(|e| escape(&e.name).chars().count())
            .max()
            .unwrap_or(0)
            .min(48);
        for e in &ckpt.non_tensor {
            writeln!(w, "  {:ew$}  {}", escape(&e.name), e.kind)?;
        }
    }
    for n in &ckpt.notes {
        writeln!(w, "note: {n}")?;
    }
    print_unsafe(w, ckpt)
}

/// The section listing what the pickles would run under torch.load.
fn print_unsafe(w: &mut dyn Write, ckpt: &InspectReport) -> std::io::Result<()> {
    if ckpt.unsafe_calls.is_empty() {
        return Ok(());
    }
    writeln!(
        w,
        "would run under torch.load (not run by unshard; the file is compromised):"
    )?;
    for c in &ckpt.unsafe_calls {
        let file = if ckpt.path == c.path {
            String::new()
        } else {
            format!("{}: ", c.path.display())
        };
        writeln!(w, "  {file}{}", c.describe())?;
    }
    Ok(())
}

/// Width of the name column: the longest name, within reason.
fn name_width(ckpt: &InspectReport) -> usize {
    ckpt.tensors
        .iter()
        .map(|t| escape(&t.name).chars().count())
        .max()
        .unwrap_or(4)
        .clamp(4, 72)
}
