//! `unshard verify`: check that a model directory holds exactly what merging a
//! checkpoint gives, tensor by tensor, and that its files are consistent.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use unshard::merge::MergeOptions;
use unshard::source::OpenOptions;
use unshard::verify;

use crate::{output, plan_options, DtypeArg};

/// Arguments of the command (its help is on `Command` in main.rs).
#[derive(clap::Args, Debug)]
pub struct VerifyArgs {
    /// The model directory to check.
    dir: PathBuf,

    /// The checkpoint the directory should hold (as given to `unshard merge`).
    #[arg(long, value_name = "CHECKPOINT")]
    against: PathBuf,

    /// The base model directory given to the merge.
    #[arg(long, value_name = "DIR")]
    base: Option<PathBuf>,

    /// The --dtype given to the merge.
    #[arg(long, value_enum, default_value = "auto")]
    dtype: DtypeArg,

    /// The --max-shard-size given to the merge. Accepted so that a merge command line
    /// can be reused; the shard layout itself is not compared.
    #[arg(long, default_value = "5GB", value_name = "SIZE")]
    max_shard_size: String,

    /// The --strict given to the merge.
    #[arg(long)]
    strict: bool,

    /// The --key given to the merge.
    #[arg(long, value_name = "PATH")]
    key: Option<String>,

    /// The --rename rules given to the merge.
    #[arg(long, value_name = "REGEX=REPLACEMENT")]
    rename: Vec<String>,

    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,
}

pub fn run(args: VerifyArgs) -> anyhow::Result<()> {
    let opts = MergeOptions {
        checkpoint: args.against,
        base: args.base,
        output: args.dir,
        open: OpenOptions { key: args.key },
        plan: plan_options(args.dtype, &args.max_shard_size, args.strict, &args.rename)?,
        ..MergeOptions::default()
    };
    let progress = output::Bar::new(!args.quiet && std::io::stderr().is_terminal());
    let report = verify::verify_against(&opts, &progress)?;
    let mut out = std::io::stdout().lock();
    for f in report.findings() {
        writeln!(out, "{f}")?;
    }
    if report.is_ok() {
        writeln!(out, "ok: {}", report.summary())?;
        return Ok(());
    }
    out.flush()?;
    anyhow::bail!("verification failed: {}", report.summary())
}
