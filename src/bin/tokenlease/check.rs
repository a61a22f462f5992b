//! `tokenlease check`.

use std::process::ExitCode;

/// Arguments of `tokenlease check`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {}

/// Runs the subcommand.
pub(crate) fn run(_args: Args) -> super::CmdResult {
    Ok(ExitCode::FAILURE)
}
