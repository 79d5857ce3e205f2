//! The `unshard` command: a thin layer over the library. It parses arguments,
//! renders progress and errors, and maps outcomes to exit codes (0 success,
//! 1 failure, 2 bad usage; see `exit.rs`). Each subcommand lives in `cmd/`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod args;
mod cmd;
mod exit;
mod hints;
mod panic_hook;
mod progress;
mod signals;
mod text;

/// What `unshard --help` says first: what the tool does, in two lines.
const ABOUT: &str = "\
Turns distributed-training checkpoints (FSDP/DCP directories, per-rank files, torch.save)
into Hugging Face model directories, bit-exact, without running their pickles.";

/// The command line: a subcommand and its arguments.
#[derive(Parser, Debug)]
#[command(name = "unshard", version, about = ABOUT, long_about = None, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Merge a training checkpoint (onto a base model) into a Hugging Face directory.
    Merge(cmd::merge::MergeArgs),
    /// Show what a checkpoint, safetensors file or model directory holds.
    ///
    /// Lists every tensor (name, dtype, shape, size; for sharded inputs how each
    /// is split), the totals, and the non-tensor entries a merge ignores.
    Inspect(cmd::inspect::InspectArgs),
    /// Check that a model directory holds exactly what merging a checkpoint gives.
    ///
    /// Re-derives the merge from the checkpoint and the options given (pass the
    /// ones the merge was run with) and compares every tensor's bytes, NaN matching
    /// any NaN; checks that headers, index, shards and config.json agree. Tensors
    /// are matched by name, so an output written with any shard size, by unshard or
    /// by transformers, verifies (--max-shard-size is accepted so that a merge
    /// command line can be reused; the shard layout is not compared). Exits 0 with
    /// a one-line summary when everything matches; otherwise prints each problem
    /// and each mismatching tensor (file, name, differing elements, max abs diff,
    /// first difference) and exits 1.
    Verify(cmd::verify::VerifyArgs),
    /// Compare two checkpoints or model directories tensor by tensor.
    ///
    /// Any inputs unshard reads, in any dtype: prints the tensors that differ
    /// (dtypes, shapes, differing elements, max abs diff, relative L2 ‖A−B‖/‖B‖)
    /// and the names found on one side only. Values compare as numbers, NaN
    /// matching NaN; names are compared without FSDP/DDP/torch.compile wrapper
    /// prefixes. Exits 0 when A and B hold the same names, dtypes, shapes and
    /// values, 1 otherwise.
    Diff(cmd::diff::DiffArgs),
    /// Print a shell completion script: `unshard completions bash > /etc/bash_completion.d/unshard`.
    Completions(cmd::completions::CompletionsArgs),
    /// Print a man page (roff), made from these help texts: `unshard man | man -l -`.
    Man(cmd::man::ManArgs),
}

/// A sharded checkpoint has one file per rank, and a merge keeps each open: raise the
/// soft limit on open files (often 1024) to the hard limit the system allows.
fn raise_open_file_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed to them.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

fn main() -> ExitCode {
    panic_hook::install();
    let cli = Cli::parse();
    signals::install();
    raise_open_file_limit();
    // How the tests see the panic message; there is no other way to reach a panic
    // on purpose.
    if std::env::var_os("UNSHARD_TEST_PANIC").is_some() {
        panic!("UNSHARD_TEST_PANIC is set");
    }
    exit::finish(match cli.command {
        Command::Merge(args) => cmd::merge::run(args),
        Command::Inspect(args) => cmd::inspect::run(args),
        Command::Verify(args) => cmd::verify::run(args),
        Command::Diff(args) => cmd::diff::run(args),
        Command::Completions(args) => cmd::completions::run(args),
        Command::Man(args) => cmd::man::run(args),
    })
}
