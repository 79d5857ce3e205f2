//! `unshard completions SHELL`: the completion script clap_complete derives from
//! the same definitions that parse the command line, so it cannot fall behind.

use std::io::Write;

use clap::CommandFactory;
use clap_complete::Shell;

use crate::exit::Status;
use crate::Cli;

/// Arguments of the command (its help is on `Command` in main.rs).
#[derive(clap::Args, Debug)]
pub struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    shell: Shell,
}

pub fn run(args: CompletionsArgs) -> anyhow::Result<Status> {
    let mut cmd = Cli::command();
    // clap_complete panics when its writer fails: render into memory, then write,
    // so that `unshard completions bash | head` is a closed pipe, not a crash.
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut cmd, "unshard", &mut script);
    let mut out = std::io::stdout().lock();
    out.write_all(&script)?;
    out.flush()?;
    Ok(Status::Success)
}
