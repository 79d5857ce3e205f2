//! `unshard inspect`: what an input holds, as a table or as JSON.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use unshard::report::human_bytes;
use unshard::source::{self, Checkpoint, OpenOptions};
use unshard::stats::TensorStats;

use crate::args::{JsonArg, KeyArg};
use crate::exit::Status;
use crate::text::{self, escape};

/// Arguments of the command (its help is on `Command` in main.rs).
#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// What to inspect: a torch.save file (.pt, .bin), a .safetensors file, a
    /// model directory, a torch.distributed.checkpoint (DCP) directory (.metadata and
    /// .distcp files), or a directory of per-rank files (one torch.save per rank).
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
    let ckpt = source::open(&args.path, &OpenOptions { key: args.key.key })?;
    let stats = if args.stats {
        Some(unshard::stats::checkpoint_stats(
            &ckpt,
            &crate::signals::token(),
        )?)
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
        text::write_escaped(&mut out, |w| {
            print_table(w, &ckpt)?;
            if let Some(stats) = &stats {
                print_stats(w, &ckpt, stats)?;
            }
            Ok(())
        })?;
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
            escape(&t.name),
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
            .map(|e| escape(&e.name).chars().count())
            .max()
            .unwrap_or(0)
            .min(48);
        for e in &ckpt.extras {
            writeln!(w, "  {:ew$}  {}", escape(&e.name), e.kind)?;
        }
    }
    for n in &ckpt.notes {
        writeln!(w, "note: {n}")?;
    }
    Ok(())
}

/// Width of the name column: the longest name, within reason.
fn name_width(ckpt: &Checkpoint) -> usize {
    ckpt.tensors
        .iter()
        .map(|t| escape(&t.name).chars().count())
        .max()
        .unwrap_or(4)
        .clamp(4, 72)
}
