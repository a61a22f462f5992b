//! `tokenlease check`: validate a policy file without touching the database.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use tokenlease::policy::Policies;

/// Arguments of `tokenlease check`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The policy file (JSON) to check.
    pub(crate) file: PathBuf,
}

/// Runs the subcommand: prints the policy's one-line summary and succeeds, or prints the first
/// error (file, line and column, field, what is wrong) to stderr and fails.
///
/// Writes with `writeln!` rather than `println!`, which panics when stdout is a closed pipe
/// (`tokenlease check policy.json | true`); the exit code carries the verdict either way.
pub(crate) fn run(args: Args) -> super::CmdResult {
    match Policies::from_file(&args.file) {
        Ok(policies) => {
            // A closed stdout loses only the summary; the exit code still says the file is valid.
            let _ = writeln!(std::io::stdout().lock(), "{}", policies.summary());
            Ok(ExitCode::SUCCESS)
        }
        Err(err) => {
            let _ = writeln!(std::io::stderr().lock(), "{err}");
            Ok(ExitCode::FAILURE)
        }
    }
}
