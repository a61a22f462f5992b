//! `tokenlease migrate`: apply the embedded migrations and print what was applied.

use std::process::ExitCode;

use tokenlease::store::migrate;
use tokenlease_testkit::TempPostgres;

use super::db::DatabaseError;

/// Arguments of `tokenlease migrate`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The database to migrate (URL or key=value). Without it, a throwaway PostgreSQL is
    /// started, migrated and removed again: a demonstration only.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
}

/// Runs the subcommand on a tokio runtime of its own.
pub(crate) fn run(args: Args) -> super::CmdResult {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Declared before the runtime's work so it outlives every connection made below.
    let mut _throwaway = None;
    let conn = match args.database_url.filter(|u| !u.trim().is_empty()) {
        Some(url) => url,
        None => {
            eprintln!(
                "tokenlease: DATABASE_URL is not set: starting a throwaway PostgreSQL (removed \
                 when this command exits, so this only demonstrates the migrations)"
            );
            let pg = TempPostgres::start()?;
            eprintln!(
                "tokenlease: throwaway PostgreSQL {} at {}",
                pg.version(),
                pg.url()
            );
            let conn = pg.connection_string("postgres");
            _throwaway = Some(pg);
            conn
        }
    };
    let report = runtime.block_on(async {
        let (mut client, connection) = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
            .await
            .map_err(|err| DatabaseError::new("connect to", &conn, &err))?;
        let connection = tokio::spawn(connection);
        let report = migrate(&mut client)
            .await
            .map_err(|err| DatabaseError::new("migrate", &conn, &err))?;
        drop(client);
        let _ = connection.await;
        Ok::<_, Box<dyn std::error::Error>>(report)
    })?;
    for migration in &report.applied {
        println!("applied {migration}");
    }
    for migration in &report.already_present {
        println!("already present {migration}");
    }
    println!("{report}");
    Ok(ExitCode::SUCCESS)
}
