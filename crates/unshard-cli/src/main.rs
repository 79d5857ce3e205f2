//! The `unshard` command: a thin layer over the library. It parses arguments,
//! renders progress and errors, and maps outcomes to exit codes (0 success,
//! 1 failure, 2 bad usage).

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use unshard::merge::{self, MergeOptions};
use unshard::plan::{DtypeChoice, PlanOptions};
use unshard::source::OpenOptions;
use unshard::{DType, Error};

mod diff_cmd;
mod inspect;
mod output;
mod verify_cmd;

/// Turn distributed-training checkpoints into Hugging Face model directories.
///
/// unshard reads what PyTorch FSDP, FSDP2 and torch.save leave on disk, without
/// Python and without executing the pickle, and writes sharded safetensors with
/// config, generation config and tokenizer, in bounded memory.
#[derive(Parser, Debug)]
#[command(name = "unshard", version, about, long_about = None, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Merge a training checkpoint (onto a base model) into a Hugging Face directory.
    Merge(MergeArgs),
    /// Show what a checkpoint, safetensors file or model directory holds.
    Inspect(InspectArgs),
    /// Check that a model directory holds exactly what merging a checkpoint gives.
    ///
    /// Re-derives the merge from the checkpoint and the options given (pass the
    /// ones the merge was run with) and compares every tensor's bytes, NaN matching
    /// any NaN; checks that headers, index, shards and config.json agree. Tensors
    /// are matched by name, so an output written with any shard size, by unshard or
    /// by transformers, verifies. Exits 0 with a one-line summary when everything
    /// matches; otherwise prints each problem and each mismatching tensor (file,
    /// name, differing elements, max abs diff, first difference) and exits 1.
    Verify(verify_cmd::VerifyArgs),
    /// Compare two checkpoints or model directories tensor by tensor.
    ///
    /// Any inputs unshard reads, in any dtype: prints the tensors that differ
    /// (dtypes, shapes, differing elements, max abs diff, relative L2 ‖A−B‖/‖B‖)
    /// and the names found on one side only. Values compare as numbers, NaN
    /// matching NaN; names are compared without FSDP/DDP/torch.compile wrapper
    /// prefixes. Exits 0 when A and B hold the same names, dtypes, shapes and
    /// values, 1 otherwise.
    Diff(diff_cmd::DiffArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum DtypeArg {
    /// The base config's dtype, else the base weights', else the checkpoint's.
    Auto,
    Float16,
    Bfloat16,
    Float32,
}

#[derive(clap::Args, Debug)]
struct MergeArgs {
    /// The checkpoint: a torch.save file (policy.pt, pytorch_model.bin, ...), a
    /// torch.distributed.checkpoint directory, or a directory of per-rank files.
    checkpoint: PathBuf,

    /// The Hugging Face model directory training started from: supplies config.json,
    /// tokenizer files, the dtype, and any weights the checkpoint lacks.
    #[arg(long, value_name = "DIR")]
    base: Option<PathBuf>,

    /// Where to write the model directory (created; must be empty or absent).
    #[arg(long, short, value_name = "DIR")]
    output: PathBuf,

    /// dtype of the floating-point tensors written.
    #[arg(long, value_enum, default_value = "auto")]
    dtype: DtypeArg,

    /// Largest shard file: decimal units as transformers (5GB = 5e9 bytes), or
    /// binary units (GiB, MiB). A tensor larger than this gets a shard of its own.
    #[arg(long, default_value = "5GB", value_name = "SIZE")]
    max_shard_size: String,

    /// Fail when the base has tensors the checkpoint lacks (instead of copying them).
    #[arg(long)]
    strict: bool,

    /// Write inf where a cast to float16 overflows (instead of failing).
    #[arg(long)]
    allow_overflow: bool,

    /// Dotted path of the state dict inside the pickle (e.g. `state`, `model.module`).
    /// By default unshard finds it.
    #[arg(long, value_name = "PATH")]
    key: Option<String>,

    /// DeepSpeed checkpoints: the tag folder to read instead of the one named by
    /// `latest` (e.g. `global_step500`).
    #[arg(long, value_name = "TAG")]
    tag: Option<String>,

    /// Rename tensors: a regular expression and its replacement (`$1` for groups),
    /// applied after wrapper prefixes are stripped. Repeatable.
    #[arg(long, value_name = "REGEX=REPLACEMENT")]
    rename: Vec<String>,

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

    /// No progress bar and no summary; errors only.
    #[arg(long, short)]
    quiet: bool,
}

#[derive(clap::Args, Debug)]
struct InspectArgs {
    /// A torch.save file, a .safetensors file, or a model directory.
    path: PathBuf,

    /// Print one JSON object instead of a table (schema in the README).
    #[arg(long)]
    json: bool,

    /// Dotted path of the state dict inside the pickle.
    #[arg(long, value_name = "PATH")]
    key: Option<String>,

    /// DeepSpeed checkpoints: the tag folder to read instead of the one named by
    /// `latest` (e.g. `global_step500`).
    #[arg(long, value_name = "TAG")]
    tag: Option<String>,

    /// Also show mean, std, min and max of every tensor (reads all the values).
    #[arg(long)]
    stats: bool,
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
    let cli = Cli::parse();
    output::install_signal_handlers();
    raise_open_file_limit();
    let result = match cli.command {
        Command::Merge(args) => run_merge(args),
        Command::Inspect(args) => {
            inspect::run(&args.path, args.key, args.tag, args.json, args.stats)
        }
        Command::Verify(args) => verify_cmd::run(args),
        Command::Diff(args) => match diff_cmd::run(args) {
            Ok(false) => return ExitCode::from(1),
            other => other.map(|_| ()),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // A reader that went away (`unshard inspect ... | head`) is not an error.
        Err(e)
            if e.chain().any(|c| {
                c.downcast_ref::<std::io::Error>()
                    .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            }) =>
        {
            ExitCode::SUCCESS
        }
        Err(e) => {
            output::print_error(&e);
            match e.downcast_ref::<Error>() {
                Some(Error::Usage(_)) => ExitCode::from(2),
                _ => ExitCode::from(1),
            }
        }
    }
}

fn run_merge(args: MergeArgs) -> anyhow::Result<()> {
    let opts = MergeOptions {
        checkpoint: args.checkpoint,
        base: args.base,
        output: args.output,
        open: OpenOptions {
            key: args.key,
            tag: args.tag,
        },
        plan: plan_options(args.dtype, &args.max_shard_size, args.strict, &args.rename)?,
        force: args.force,
        allow_overflow: args.allow_overflow,
        verify: args.verify,
        fail_on_nonfinite: args.fail_on_nonfinite,
    };
    let progress = output::Bar::new(!args.quiet && std::io::stderr().is_terminal());
    let outcome = merge::merge(&opts, &progress)?;
    if !args.quiet {
        let mut err = std::io::stderr().lock();
        output::print_merge_summary(&mut err, &opts, &outcome)?;
        err.flush()?;
    }
    Ok(())
}

/// The options that shape a plan, shared by `merge` and `verify`.
fn plan_options(
    dtype: DtypeArg,
    max_shard_size: &str,
    strict: bool,
    rename: &[String],
) -> Result<PlanOptions, Error> {
    let max_shard_size = merge::parse_size(max_shard_size)
        .filter(|&s| s > 0)
        .ok_or_else(|| {
            Error::Usage(format!(
                "--max-shard-size '{max_shard_size}' is not a size (examples: 5GB, 500MB, 2GiB)"
            ))
        })?;
    let mut renames = Vec::new();
    for r in rename {
        let (re, rep) = r
            .split_once('=')
            .ok_or_else(|| Error::Usage(format!("--rename '{r}' must be REGEX=REPLACEMENT")))?;
        let re = regex::Regex::new(re).map_err(|e| {
            Error::Usage(format!("--rename '{r}': invalid regular expression: {e}"))
        })?;
        renames.push((re, rep.to_string()));
    }
    let dtype = match dtype {
        DtypeArg::Auto => DtypeChoice::Auto,
        DtypeArg::Float16 => DtypeChoice::Fixed(DType::F16),
        DtypeArg::Bfloat16 => DtypeChoice::Fixed(DType::BF16),
        DtypeArg::Float32 => DtypeChoice::Fixed(DType::F32),
    };
    Ok(PlanOptions {
        dtype,
        strict,
        renames,
        max_shard_size,
    })
}
