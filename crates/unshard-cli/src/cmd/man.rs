//! `unshard man [COMMAND]`: a man page in roff, rendered by clap_mangen from the
//! same definitions that parse the command line, so it cannot fall behind.
//! `unshard man` is unshard(1) (options and the list of commands);
//! `unshard man merge` is unshard-merge(1) with every option of `merge`.

use std::io::Write;

use clap::CommandFactory;

use crate::exit::{Status, UsageError};
use crate::Cli;

/// Arguments of the command (its help is on `Command` in main.rs).
#[derive(clap::Args, Debug)]
pub struct ManArgs {
    /// A subcommand (merge, inspect, verify, diff, ...) for its own page.
    #[arg(value_name = "COMMAND")]
    command: Option<String>,
}

pub fn run(args: ManArgs) -> anyhow::Result<Status> {
    let mut top = Cli::command();
    // Building sets each subcommand's full name ("unshard merge") for its synopsis.
    top.build();
    let page = match &args.command {
        None => clap_mangen::Man::new(top),
        Some(name) => {
            let sub = top
                .find_subcommand(name)
                .cloned()
                .ok_or_else(|| UsageError {
                    msg: format!("no command '{name}'"),
                    hint: format!(
                        "one of: {}",
                        top.get_subcommands()
                            .map(|c| c.get_name())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                })?;
            clap_mangen::Man::new(sub).title(format!("unshard-{name}"))
        }
    };
    let mut out = std::io::stdout().lock();
    page.render(&mut out)?;
    out.flush()?;
    Ok(Status::Success)
}
