//! `unshard scan PATH...`: report every callable a pickle would run under
//! `torch.load`, in files and directories (recursively), without running anything.
//! Exit 1 if anything is outside the allowlist or unreadable, 0 if every file is
//! clean: usable as a pre-upload or CI check, as picklescan is. A Trainer's
//! `training_args.bin` is listed as recognised, not unsafe (see `scan::trainer`).

use std::io::Write;
use std::path::PathBuf;

use unshard::FileScan;

use crate::args::JsonArg;
use crate::exit::Status;
use crate::text::escape;

/// Arguments of the command (its help is on `Command` in main.rs).
#[derive(clap::Args, Debug)]
pub struct ScanArgs {
    /// Files or directories (searched recursively) to scan.
    #[arg(required = true)]
    paths: Vec<PathBuf>,

    /// List only the files that would run code or could not be read fully, with no
    /// summary line: nothing when all is clean (the exit code says it).
    #[arg(long, short, conflicts_with = "json")]
    quiet: bool,

    #[command(flatten)]
    json: JsonArg,
}

pub fn run(args: ScanArgs) -> anyhow::Result<Status> {
    let files = unshard::scan_paths(&args.paths);
    let mut out = std::io::stdout().lock();
    if args.json.json {
        serde_json::to_writer_pretty(&mut out, &to_json(&files))?;
        writeln!(out)?;
    } else {
        print_text(&mut out, &files, args.quiet)?;
    }
    out.flush()?;
    Ok(if files.iter().all(FileScan::is_clean) {
        Status::Success
    } else {
        Status::Failure
    })
}

fn to_json(files: &[FileScan]) -> serde_json::Value {
    let list: Vec<serde_json::Value> = files
        .iter()
        .map(|f| {
            serde_json::json!({
                "path": f.path.display().to_string(),
                "kind": f.kind,
                "pickles": f.pickles,
                "clean": f.is_clean(),
                "unsafe": f.unsafe_calls,
                "recognised": f.recognised,
                "omitted": f.omitted,
                "problems": f.problems,
            })
        })
        .collect();
    serde_json::json!({
        "files": list,
        "scanned": files.len(),
        "unsafe_files": files.iter().filter(|f| !f.unsafe_calls.is_empty() || f.omitted > 0).count(),
        "problem_files": files.iter().filter(|f| !f.problems.is_empty()).count(),
        "clean": files.iter().all(FileScan::is_clean),
    })
}

fn print_text(w: &mut dyn Write, files: &[FileScan], quiet: bool) -> std::io::Result<()> {
    let mut pickles = 0;
    for f in files {
        pickles += f.pickles;
        if f.is_clean() && (quiet || f.recognised.is_empty()) {
            continue;
        }
        writeln!(w, "{}: {}", escape(&f.path.display().to_string()), f.kind)?;
        if !quiet && !f.recognised.is_empty() {
            let names: std::collections::BTreeSet<&str> =
                f.recognised.iter().map(|c| c.callable.as_str()).collect();
            let names: Vec<&str> = names.into_iter().collect();
            writeln!(
                w,
                "  recognised: a Trainer's arguments (training_args.bin): torch.load imports \
                 {} and sets their fields without running a constructor; nothing the file \
                 chooses runs, and unshard never reads it",
                escape(&names.join(", "))
            )?;
        }
        for c in &f.unsafe_calls {
            writeln!(w, "  unsafe: {}", escape(&c.describe()))?;
        }
        if f.omitted > 0 {
            writeln!(w, "  unsafe: {} more not listed", f.omitted)?;
        }
        for p in &f.problems {
            writeln!(w, "  problem: {}", escape(p))?;
        }
    }
    let unsafe_files = files
        .iter()
        .filter(|f| !f.unsafe_calls.is_empty() || f.omitted > 0)
        .count();
    let problem_files = files.iter().filter(|f| !f.problems.is_empty()).count();
    if quiet {
        return Ok(());
    }
    writeln!(
        w,
        "scanned {} file(s), {pickles} pickle(s): {unsafe_files} would run code under torch.load, {problem_files} could not be read fully{}",
        files.len(),
        if unsafe_files + problem_files == 0 {
            "; clean"
        } else {
            ""
        }
    )
}
