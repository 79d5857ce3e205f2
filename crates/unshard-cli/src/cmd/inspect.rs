//! `unshard inspect`: what an input holds, as a table or as JSON.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use unshard::report::human_bytes;
use unshard::source::{self, Checkpoint, OpenOptions};
use unshard::stats::TensorStats;

use crate::args::{JsonArg, KeyArg};
use crate::cmd::scan::printable;
use crate::exit::Status;

/// Arguments of the command (its help is on `Command` in main.rs).
#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// A torch.save file, a .safetensors file, or a model directory.
    path: PathBuf,

    #[command(flatten)]
    json: JsonArg,

    #[command(flatten)]
    key: KeyArg,

    /// Also show mean, std, min and max of every tensor (reads all the values).
    #[arg(long)]
    stats: bool,
}

pub fn run(args: InspectArgs) -> anyhow::Result<Status> {
    let ckpt = source::open(&args.path, &OpenOptions { key: args.key.key })
        .inspect_err(|_| crate::unsafe_report::after_error(&[args.path.as_path()]))?;
    let stats = if args.stats {
        Some(unshard::stats::checkpoint_stats(&ckpt)?)
    } else {
        None
    };
    let mut out = std::io::stdout().lock();
    if args.json.json {
        let mut v = to_json(&ckpt);
        if let (Some(stats), Some(tensors)) = (&stats, v["tensors"].as_array_mut()) {
            for (t, s) in tensors.iter_mut().zip(stats) {
                t["stats"] = stats_json(s);
            }
        }
        serde_json::to_writer_pretty(&mut out, &v)?;
        writeln!(out)?;
    } else {
        print_table(&mut out, &ckpt)?;
        if let Some(stats) = &stats {
            print_stats(&mut out, &ckpt, stats)?;
        }
    }
    Ok(Status::Success)
}

/// `--stats` in JSON: non-finite statistics (no finite values) become `null`.
fn stats_json(s: &TensorStats) -> serde_json::Value {
    let f = |v: f64| serde_json::Number::from_f64(v).map_or(serde_json::Value::Null, Into::into);
    serde_json::json!({
        "mean": f(s.mean), "std": f(s.std), "min": f(s.min), "max": f(s.max),
        "nan": s.nan, "inf": s.inf,
    })
}

/// `--stats` as a table: over finite values; NaN and inf are counted.
fn print_stats(w: &mut dyn Write, ckpt: &Checkpoint, stats: &[TensorStats]) -> std::io::Result<()> {
    let name_w = name_width(ckpt);
    writeln!(
        w,
        "statistics (finite values; std with correction 1, as torch.std):"
    )?;
    writeln!(
        w,
        "  {:name_w$}  {:>12}  {:>12}  {:>12}  {:>12}  non-finite",
        "name", "mean", "std", "min", "max"
    )?;
    for (t, s) in ckpt.tensors.iter().zip(stats) {
        write!(
            w,
            "  {:name_w$}  {:>12.5e}  {:>12.5e}  {:>12.5e}  {:>12.5e}",
            printable(&t.name),
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

fn dtype_histogram(ckpt: &Checkpoint) -> BTreeMap<&'static str, usize> {
    let mut h = BTreeMap::new();
    for t in &ckpt.tensors {
        *h.entry(t.dtype.safetensors_name()).or_insert(0) += 1;
    }
    h
}

/// The stable JSON schema documented in the README.
pub fn to_json(ckpt: &Checkpoint) -> serde_json::Value {
    let tensors: Vec<serde_json::Value> = ckpt
        .tensors
        .iter()
        .map(|t| {
            let mut v = serde_json::json!({
                "name": t.name,
                "dtype": t.dtype.safetensors_name(),
                "shape": t.shape,
                "bytes": t.nbytes(),
            });
            if let Some(l) = &t.layout {
                v["layout"] = serde_json::Value::String(l.clone());
            }
            v
        })
        .collect();
    serde_json::json!({
        "format": ckpt.format.id(),
        "path": ckpt.path.display().to_string(),
        "key": ckpt.key,
        "tensors": tensors,
        "total_tensors": ckpt.tensors.len(),
        "total_parameters": ckpt.total_parameters(),
        "total_bytes": ckpt.total_bytes(),
        "dtypes": dtype_histogram(ckpt),
        "non_tensor": ckpt.extras.iter().map(|e| serde_json::json!({"name": e.name, "kind": e.kind})).collect::<Vec<_>>(),
        "notes": ckpt.notes,
        "unsafe": ckpt.unsafe_calls.iter().map(crate::cmd::scan::call_json).collect::<Vec<_>>(),
    })
}

fn print_table(w: &mut dyn Write, ckpt: &Checkpoint) -> std::io::Result<()> {
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
    writeln!(
        w,
        "  {:name_w$}  {:8}  {:shape_w$}  {:>10}",
        "name", "dtype", "shape", "size"
    )?;
    for (t, shape) in ckpt.tensors.iter().zip(&shapes) {
        write!(
            w,
            "  {:name_w$}  {:8}  {:shape_w$}  {:>10}",
            printable(&t.name),
            t.dtype.safetensors_name(),
            shape,
            human_bytes(t.nbytes())
        )?;
        if let Some(l) = &t.layout {
            write!(w, "  {l}")?;
        }
        writeln!(w)?;
    }
    let hist: Vec<String> = dtype_histogram(ckpt)
        .iter()
        .map(|(d, n)| format!("{d}: {n}"))
        .collect();
    writeln!(
        w,
        "{} tensors, {} parameters, {} ({})",
        ckpt.tensors.len(),
        ckpt.total_parameters(),
        human_bytes(ckpt.total_bytes()),
        hist.join(", ")
    )?;
    if !ckpt.extras.is_empty() {
        writeln!(w, "non-tensor entries (not weights; ignored by merge):")?;
        let ew = ckpt
            .extras
            .iter()
            .map(|e| e.name.len())
            .max()
            .unwrap_or(0)
            .min(48);
        for e in &ckpt.extras {
            // Keys come from the file: a key holding ESC[1A ESC[2K would erase the
            // line above (a payload's) from a terminal.
            writeln!(w, "  {:ew$}  {}", printable(&e.name), printable(&e.kind))?;
        }
    }
    for n in &ckpt.notes {
        writeln!(w, "note: {}", printable(n))?;
    }
    print_unsafe(w, ckpt)
}

/// The section listing what the pickles would run under torch.load.
fn print_unsafe(w: &mut dyn Write, ckpt: &Checkpoint) -> std::io::Result<()> {
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
        writeln!(w, "  {}", printable(&format!("{file}{}", c.describe())))?;
    }
    Ok(())
}

/// Width of the name column: the longest name, within reason.
fn name_width(ckpt: &Checkpoint) -> usize {
    ckpt.tensors
        .iter()
        .map(|t| t.name.len())
        .max()
        .unwrap_or(4)
        .clamp(4, 72)
}
