//! The `unshard` binary: see the library half of this crate ([`unshard_cli::run`]).

use std::process::ExitCode;

fn main() -> ExitCode {
    ExitCode::from(unshard_cli::run(std::env::args_os()))
}
