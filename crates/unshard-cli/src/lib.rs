//! The `unshard` command line: a thin layer over the library. It parses arguments,
//! renders progress and errors, and maps outcomes to exit codes (0 success,
//! 1 failure, 2 bad usage; see `exit.rs`). Each subcommand lives in `cmd/`.
//!
//! The binary (`main.rs`) and the Python package's console script both call
//! [`run`], so `pip install unshard` gives the very same command.

use std::ffi::OsString;

use clap::{Parser, Subcommand};

mod args;
mod cmd;
mod exit;
mod hints;
mod panic_hook;
mod progress;
mod signals;
mod text;
mod unsafe_report;

/// What `unshard --help` says first: what the tool does, in two lines.
const ABOUT: &str = "\
Turns distributed-training checkpoints (FSDP/DCP, per-rank files, DeepSpeed, torch.save)
and LoRA adapters into Hugging Face model directories, bit-exact, without running their pickles.";

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
    /// Report code that files would run under torch.load, without running it.
    ///
    /// Reads every pickle in the files and directories given (recursively): torch.save
    /// archives (every .pkl record, deflated ones too), legacy torch.save streams (all
    /// five pickles), bare pickles, the archives inside .distcp files. Every global a
    /// pickle names or calls, on every path (results it discards, the memo, BUILD
    /// states, persistent ids, dict keys), is checked against what torch, DeepSpeed
    /// and the checkpoint formats legitimately use; everything else is listed with
    /// its full name or the chain producing it, the opcode route, the byte offset and
    /// the record. A Trainer's training_args.bin (arguments rebuilt without running a
    /// constructor) is listed as recognised, not unsafe. Exits 1 if anything unsafe is
    /// listed (or a file cannot be read fully), 0 if every file is clean.
    Scan(cmd::scan::ScanArgs),
    /// Print a shell completion script for bash, zsh, fish, elvish or powershell.
    ///
    /// Install it where your shell looks (then open a new shell):
    ///
    ///   bash: unshard completions bash > ~/.local/share/bash-completion/completions/unshard
    ///
    ///   zsh:  unshard completions zsh > ~/.zfunc/_unshard  (with fpath+=~/.zfunc in ~/.zshrc)
    ///
    ///   fish: unshard completions fish > ~/.config/fish/completions/unshard.fish
    #[command(verbatim_doc_comment)]
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

/// Parses a dtype as `--dtype` does (`auto`, `bfloat16`, `bf16`, `torch.float16`,
/// `half`, ... in any case), for front ends that take it as a string.
pub fn parse_dtype(s: &str) -> Option<unshard::DtypeChoice> {
    use clap::ValueEnum;
    args::DtypeArg::from_str(s, true)
        .ok()
        .map(args::DtypeArg::choice)
}

/// Runs the command line `argv` (`argv[0]` is the program name) and returns the
/// process exit code. It owns the process while it runs: it installs the panic
/// hook and the SIGINT/SIGTERM handling, raises the open-files limit, and may end
/// the process itself on a signal (exit 128 + signal) as the binary does.
pub fn run<I, T>(argv: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    panic_hook::install();
    let cli = match Cli::try_parse_from(argv) {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version are "errors" that print to stdout and exit 0.
            let _ = e.print();
            return u8::try_from(e.exit_code()).unwrap_or(2);
        }
    };
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
        Command::Scan(args) => cmd::scan::run(args),
        Command::Completions(args) => cmd::completions::run(args),
        Command::Man(args) => cmd::man::run(args),
    })
}
