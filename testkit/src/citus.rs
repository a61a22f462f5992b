//! [`TempCitus`]: a throwaway Citus cluster (a coordinator and N workers), each node a
//! [`TempPostgres`].
//!
//! Every node is started with `shared_preload_libraries = 'citus'` (plus
//! `max_prepared_transactions`, which Citus needs for its own DDL) and the builder's settings,
//! gets `CREATE EXTENSION citus` in its `postgres` database, and the coordinator then registers
//! itself (`citus_set_coordinator_host`) and each worker (`citus_add_node`). Nodes are started
//! side by side, one thread each. Dropping the value stops and removes every node.
//!
//! Needs the Citus extension installed for the server binaries in use (`citus.so` in
//! `pg_config --pkglibdir`); without it starting fails with [`EmbeddedErrorKind::Command`] and
//! a message saying how to install it.

use std::path::PathBuf;
use std::time::Duration;

use tokio_postgres::NoTls;

use super::cluster::{TempPostgres, TempPostgresBuilder};
use super::error::{EmbeddedError, EmbeddedErrorKind};
use super::os;

/// How long the cluster's setup SQL (extension, node registration) may take in all.
const SETUP_TIMEOUT: Duration = Duration::from_secs(60);

/// Builds a [`TempCitus`]: how many workers, and settings for every node.
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `start` is called"]
pub struct TempCitusBuilder {
    workers: usize,
    settings: Vec<(String, String)>,
    start_timeout: Duration,
}

impl Default for TempCitusBuilder {
    fn default() -> Self {
        TempCitusBuilder {
            workers: 2,
            settings: Vec::new(),
            start_timeout: Duration::from_secs(20),
        }
    }
}

impl TempCitusBuilder {
    /// How many workers besides the coordinator (at least 1). Defaults to 2.
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = n.max(1);
        self
    }

    /// A `postgresql.conf` setting for every node, after (so overriding) the defaults, as
    /// [`TempPostgresBuilder::setting`]. `citus.shard_count`, for instance, sets how many shards
    /// a table distributed later gets.
    pub fn setting(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.settings.push((name.into(), value.into()));
        self
    }

    /// How long each node may take to accept connections, as
    /// [`TempPostgresBuilder::start_timeout`]. Defaults to 20 s (a busy machine starting
    /// several servers at once).
    pub fn start_timeout(mut self, timeout: Duration) -> Self {
        self.start_timeout = timeout;
        self
    }

    /// Starts the nodes, creates the extension on each and registers the workers with the
    /// coordinator. Blocking (several seconds); async code calls it through
    /// [`tokio::task::spawn_blocking`].
    ///
    /// # Errors
    ///
    /// [`EmbeddedErrorKind::Command`] when the Citus extension is not installed (the message
    /// says how to install it), as [`TempPostgres::start`] for a node that does not start, and
    /// [`EmbeddedErrorKind::Database`] when the setup SQL fails.
    pub fn start(self) -> Result<TempCitus, EmbeddedError> {
        let bins = os::binaries()?;
        if let Some(missing) = missing_extension(&bins.dir) {
            return Err(EmbeddedError::new(EmbeddedErrorKind::Command, missing));
        }
        let mut node = TempPostgres::builder()
            .setting("shared_preload_libraries", "citus")
            .setting("max_prepared_transactions", "100")
            .start_timeout(self.start_timeout);
        for (name, value) in &self.settings {
            node = node.setting(name.clone(), value.clone());
        }
        let started: Vec<Result<TempPostgres, EmbeddedError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..=self.workers)
                .map(|_| {
                    let builder: TempPostgresBuilder = node.clone();
                    scope.spawn(move || builder.start())
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(EmbeddedError::new(
                            EmbeddedErrorKind::Io,
                            "the thread starting a Citus node panicked",
                        ))
                    })
                })
                .collect()
        });
        let mut nodes = Vec::with_capacity(started.len());
        for node in started {
            nodes.push(node?);
        }
        let coordinator = nodes.remove(0);
        let cluster = TempCitus {
            coordinator,
            workers: nodes,
            node,
        };
        cluster.setup()?;
        Ok(cluster)
    }
}

/// A message saying how to install Citus, when `citus.so` is not beside the server's other
/// libraries (`<bin dir>/../lib`, Debian's layout, or `pg_config --pkglibdir`).
fn missing_extension(bin_dir: &std::path::Path) -> Option<String> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(parent) = bin_dir.parent() {
        candidates.push(parent.join("lib").join("citus.so"));
    }
    let pg_config = bin_dir.join("pg_config");
    let output = std::process::Command::new(if pg_config.is_file() {
        pg_config.as_os_str()
    } else {
        std::ffi::OsStr::new("pg_config")
    })
    .arg("--pkglibdir")
    .output();
    if let Ok(output) = output {
        let dir = String::from_utf8_lossy(&output.stdout).trim().to_string();
        if !dir.is_empty() {
            candidates.push(PathBuf::from(dir).join("citus.so"));
        }
    }
    if candidates.iter().any(|c| c.is_file()) {
        return None;
    }
    Some(format!(
        "the Citus extension is not installed for the PostgreSQL server in {} (looked for {}): \
         install Citus's package for this PostgreSQL version, or build it from its source \
         release (https://github.com/citusdata/citus) with this server's pg_config",
        bin_dir.display(),
        candidates
            .iter()
            .map(|c| c.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

/// A throwaway Citus cluster: a coordinator and workers, each a [`TempPostgres`] with the
/// extension created in its `postgres` database and the workers registered. Every node is
/// stopped and removed on drop.
///
/// Each node starts with `shared_preload_libraries = 'citus'`, `max_prepared_transactions`
/// (which Citus needs for its own DDL) and the builder's settings, side by side on threads of
/// their own; the coordinator then registers itself (`citus_set_coordinator_host`) and each
/// worker (`citus_add_node`). Needs the Citus extension for the server binaries in use
/// (`citus.so` in `pg_config --pkglibdir`); without it starting fails with
/// [`EmbeddedErrorKind::Command`] and a message saying how to install it.
///
/// ```no_run
/// use tokenlease_testkit::TempCitus;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let citus = TempCitus::builder().workers(2).setting("citus.shard_count", "4").start()?;
/// let url = citus.url(); // the coordinator; `PostgresStore::connect(&url)` distributes and routes
/// # let _ = url;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct TempCitus {
    coordinator: TempPostgres,
    workers: Vec<TempPostgres>,
    /// How every node was started: [`start_node`](TempCitus::start_node) starts another alike.
    node: TempPostgresBuilder,
}

impl TempCitus {
    /// A builder for a cluster with 2 workers and no extra settings.
    pub fn builder() -> TempCitusBuilder {
        TempCitusBuilder::default()
    }

    /// Starts a cluster with `workers` workers and the default settings. Blocking; see
    /// [`TempCitusBuilder::start`].
    ///
    /// # Errors
    ///
    /// As [`TempCitusBuilder::start`].
    pub fn start(workers: usize) -> Result<TempCitus, EmbeddedError> {
        Self::builder().workers(workers).start()
    }

    /// The coordinator: the node clients connect to.
    pub fn coordinator(&self) -> &TempPostgres {
        &self.coordinator
    }

    /// The workers, in the order they were registered.
    pub fn workers(&self) -> &[TempPostgres] {
        &self.workers
    }

    /// The coordinator's connection string for database `dbname` (the extension exists in
    /// `postgres`), as [`TempPostgres::connection_string`].
    pub fn connection_string(&self, dbname: &str) -> String {
        self.coordinator.connection_string(dbname)
    }

    /// The coordinator's URL for the `postgres` database.
    pub fn url(&self) -> String {
        self.coordinator.url()
    }

    /// The worker listening on `port`, if any (the shard map names nodes by host and port).
    pub fn worker_on_port(&self, port: u16) -> Option<&TempPostgres> {
        self.workers.iter().find(|w| w.port() == port)
    }

    /// Starts one more node with the cluster's settings and the extension created in its
    /// `postgres` database, NOT registered: the caller adds it (`citus_add_node` on the
    /// coordinator, with its [`host`](TempPostgres::host) and [`port`](TempPostgres::port)),
    /// as an operator adding a worker to a running cluster does, and keeps it (dropping it stops
    /// and removes it; the cluster does not own it). Blocking; async code calls it through
    /// [`tokio::task::spawn_blocking`].
    ///
    /// # Errors
    ///
    /// As [`TempPostgres::start`] for a node that does not start, and
    /// [`EmbeddedErrorKind::Database`] when the extension cannot be created.
    pub fn start_node(&self) -> Result<TempPostgres, EmbeddedError> {
        let node = self.node.clone().start()?;
        let conn = node.connection_string("postgres");
        let handle = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|err| EmbeddedError::io("could not start a tokio runtime", &err))?;
            rt.block_on(async move {
                let create = async {
                    connect(&conn)
                        .await?
                        .batch_execute("CREATE EXTENSION IF NOT EXISTS citus")
                        .await
                        .map_err(|err| EmbeddedError::database("CREATE EXTENSION citus", &err))
                };
                match tokio::time::timeout(SETUP_TIMEOUT, create).await {
                    Ok(result) => result,
                    Err(_) => Err(EmbeddedError::new(
                        EmbeddedErrorKind::Timeout,
                        "creating the Citus extension on a new node took too long",
                    )),
                }
            })
        });
        handle.join().unwrap_or_else(|_| {
            Err(EmbeddedError::new(
                EmbeddedErrorKind::Io,
                "the thread setting up a Citus node panicked",
            ))
        })?;
        Ok(node)
    }

    /// Creates the extension on every node and registers the workers, on a thread with its own
    /// runtime (this may be called inside one).
    fn setup(&self) -> Result<(), EmbeddedError> {
        let coordinator = self.coordinator.connection_string("postgres");
        let (host, port) = (self.coordinator.host().to_string(), self.coordinator.port());
        let workers: Vec<(String, String, u16)> = self
            .workers
            .iter()
            .map(|w| {
                (
                    w.connection_string("postgres"),
                    w.host().to_string(),
                    w.port(),
                )
            })
            .collect();
        let handle = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|err| EmbeddedError::io("could not start a tokio runtime", &err))?;
            rt.block_on(async move {
                let setup = async {
                    let mut all = vec![coordinator.clone()];
                    all.extend(workers.iter().map(|(conn, _, _)| conn.clone()));
                    // On every node at once: each its own task on this runtime.
                    let creates: Vec<_> = all
                        .into_iter()
                        .map(|conn| {
                            tokio::spawn(async move {
                                let client = connect(&conn).await?;
                                client
                                    .batch_execute("CREATE EXTENSION IF NOT EXISTS citus")
                                    .await
                                    .map_err(|err| {
                                        EmbeddedError::database("CREATE EXTENSION citus", &err)
                                    })
                            })
                        })
                        .collect();
                    for create in creates {
                        create.await.map_err(|err| {
                            EmbeddedError::new(
                                EmbeddedErrorKind::Io,
                                format!("the task creating the Citus extension failed: {err}"),
                            )
                        })??;
                    }
                    let client = connect(&coordinator).await?;
                    client
                        .execute(
                            "SELECT citus_set_coordinator_host($1, $2)",
                            &[&host, &i32::from(port)],
                        )
                        .await
                        .map_err(|err| {
                            EmbeddedError::database("citus_set_coordinator_host", &err)
                        })?;
                    for (_, worker_host, worker_port) in &workers {
                        client
                            .execute(
                                "SELECT citus_add_node($1, $2)",
                                &[worker_host, &i32::from(*worker_port)],
                            )
                            .await
                            .map_err(|err| EmbeddedError::database("citus_add_node", &err))?;
                    }
                    Ok(())
                };
                match tokio::time::timeout(SETUP_TIMEOUT, setup).await {
                    Ok(result) => result,
                    Err(_) => Err(EmbeddedError::new(
                        EmbeddedErrorKind::Timeout,
                        format!(
                            "setting up the Citus cluster took more than {}s",
                            SETUP_TIMEOUT.as_secs()
                        ),
                    )),
                }
            })
        });
        handle.join().unwrap_or_else(|_| {
            Err(EmbeddedError::new(
                EmbeddedErrorKind::Io,
                "the thread setting up the Citus cluster panicked",
            ))
        })
    }
}

async fn connect(conn: &str) -> Result<tokio_postgres::Client, EmbeddedError> {
    let (client, connection) = tokio_postgres::connect(conn, NoTls)
        .await
        .map_err(|err| EmbeddedError::database("could not connect to a Citus node", &err))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}
