//! One module per subcommand. Each declares its arguments (`clap::Args`) and a
//! `run` that returns `anyhow::Result<Status>`; `main` maps that to the exit code.

pub mod completions;
pub mod diff;
pub mod inspect;
pub mod man;
pub mod merge;
pub mod scan;
pub mod verify;
