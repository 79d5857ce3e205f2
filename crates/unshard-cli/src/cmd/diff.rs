//! `unshard diff`: compare two checkpoints or model directories tensor by tensor.

use std::io::Write;
use std::path::PathBuf;

use crate::text::list_some;
use unshard::{DiffOptions, DiffReport, DiffSide, TensorDiff, ValueDiff};

use crate::args::JsonArg;
use crate::exit::Status;
use crate::progress::Bar;
use crate::text::{self, escape};
use crate::unsafe_report::{self, RefuseArg};

/// Arguments of the command (its help is on `Command` in main.rs).
#[derive(clap::Args, Debug)]
pub struct DiffArgs {
    /// A checkpoint, safetensors file or model directory.
    a: PathBuf,

    /// Another one: the reference for relative differences.
    b: PathBuf,

    /// List every tensor present on both sides, not only those that differ.
    #[arg(long)]
    all: bool,

    #[command(flatten)]
    refuse: RefuseArg,

    /// No progress output.
    #[arg(long, short)]
    quiet: bool,

    // The JSON lists every common tensor, identical or not (README.md).
    #[command(flatten)]
    json: JsonArg,
}

/// Succeeds when the two inputs are identical, fails when they differ.
pub fn run(args: DiffArgs) -> anyhow::Result<Status> {
    let opts = DiffOptions {
        a: unshard::location(&args.a),
        b: unshard::location(&args.b),
        unsafe_pickles: args.refuse.policy(false),
        cancel: crate::signals::token(),
        ..DiffOptions::default()
    };
    let progress = Bar::new(args.quiet, "compared");
    let report = unshard::diff(&opts, &progress)
        .inspect_err(|_| unsafe_report::after_error(&[opts.a.as_path(), opts.b.as_path()]))?;
    let mut out = std::io::stdout().lock();
    if args.json.json {
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
    } else {
        text::write_escaped(&mut out, |w| print_report(w, &report, args.all))?;
    }
    out.flush()?;
    Ok(if report.identical() {
        Status::Success
    } else {
        Status::Failure
    })
}

fn describe(c: &DiffSide) -> String {
    format!("{} ({}, {} tensors)", c.path.display(), c.format, c.tensors)
}

fn print_report(w: &mut dyn Write, r: &DiffReport, all: bool) -> std::io::Result<()> {
    writeln!(w, "A: {}", describe(&r.a))?;
    writeln!(w, "B: {}", describe(&r.b))?;
    let shown: Vec<&TensorDiff> = r.tensors.iter().filter(|t| all || !t.identical()).collect();
    if !shown.is_empty() {
        let rows: Vec<[String; 6]> = shown.iter().map(|t| row(t)).collect();
        let header = [
            "name",
            "dtype A/B",
            "shape",
            "differing",
            "max abs diff",
            "rel L2",
        ]
        .map(String::from);
        let mut widths = header.clone().map(|h| h.len());
        for r in &rows {
            for (w, c) in widths.iter_mut().zip(r) {
                *w = (*w).max(c.len());
            }
        }
        widths[0] = widths[0].min(72);
        for r in std::iter::once(&header).chain(&rows) {
            writeln!(
                w,
                "  {:w0$}  {:w1$}  {:w2$}  {:>w3$}  {:>w4$}  {:>w5$}",
                r[0],
                r[1],
                r[2],
                r[3],
                r[4],
                r[5],
                w0 = widths[0],
                w1 = widths[1],
                w2 = widths[2],
                w3 = widths[3],
                w4 = widths[4],
                w5 = widths[5]
            )?;
        }
    }
    if !r.only_a.is_empty() {
        writeln!(
            w,
            "only in A ({}): {}",
            r.only_a.len(),
            list_some(&r.only_a, 8)
        )?;
    }
    if !r.only_b.is_empty() {
        writeln!(
            w,
            "only in B ({}): {}",
            r.only_b.len(),
            list_some(&r.only_b, 8)
        )?;
    }
    if r.renamed.0 + r.renamed.1 > 0 {
        writeln!(
            w,
            "note: names compared without wrapper prefixes ({} in A, {} in B)",
            r.renamed.0, r.renamed.1
        )?;
    }
    let same = r.tensors.iter().filter(|t| t.identical()).count();
    let mut line = format!("{} of {} common tensor(s) identical", same, r.tensors.len());
    let worst = |key: fn(&ValueDiff) -> f64| {
        r.tensors
            .iter()
            .filter_map(|t| t.values.map(|v| (key(&v), t)))
            .filter(|(x, _)| *x > 0.0)
            .max_by(|x, y| x.0.total_cmp(&y.0))
    };
    if let Some((m, t)) = worst(|v| v.max_abs) {
        line.push_str(&format!(
            "; largest max abs diff {} in '{}'",
            num(m),
            t.name
        ));
    }
    if let Some((m, t)) = worst(|v| v.rel_l2) {
        line.push_str(&format!("; largest rel L2 {} in '{}'", num(m), t.name));
    }
    writeln!(w, "{line}")?;
    writeln!(
        w,
        "{}",
        if r.identical() {
            "A and B are identical"
        } else {
            "A and B differ"
        }
    )
}

fn row(t: &TensorDiff) -> [String; 6] {
    let dtypes = if t.dtype_a == t.dtype_b {
        t.dtype_a.safetensors_name().to_string()
    } else {
        format!(
            "{}/{}",
            t.dtype_a.safetensors_name(),
            t.dtype_b.safetensors_name()
        )
    };
    let shape = if t.shape_a == t.shape_b {
        format!("{:?}", t.shape_a)
    } else {
        format!("{:?}/{:?}", t.shape_a, t.shape_b)
    };
    match t.values {
        Some(v) => {
            let mut differing = v.differing.to_string();
            if v.nan_mismatch > 0 {
                differing.push_str(&format!(" ({} NaN)", v.nan_mismatch));
            }
            [
                escape(&t.name).into_owned(),
                dtypes,
                shape,
                differing,
                num(v.max_abs),
                num(v.rel_l2),
            ]
        }
        None => [
            escape(&t.name).into_owned(),
            dtypes,
            shape,
            "shapes differ".into(),
            "-".into(),
            "-".into(),
        ],
    }
}

fn num(v: f64) -> String {
    let a = v.abs();
    if v.is_nan() || v.is_infinite() || a == 0.0 || (1e-3..1e6).contains(&a) {
        format!("{v:.6}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string()
    } else {
        format!("{v:.3e}")
    }
}
