//! [`FaultProxy`]: a fault-injecting TCP proxy. Put it between a limiter and PostgreSQL, then
//! make the network slow, silent or hostile on demand (the fault tests and
//! `tokenlease loadtest --fault slow` do).
//!
//! [`FaultProxy::start`] listens on 127.0.0.1 (a random port) and forwards every accepted
//! connection to the upstream address. The handle is cheap to clone; every setting applies at
//! once to existing and new connections:
//!
//! - pass (the default): bytes flow both ways as soon as they arrive;
//! - [`delay`](FaultProxy::delay): every chunk read in one direction is forwarded that much later
//!   (latency, not a throughput cap: chunks queue, in order, each on its own timer);
//! - [`black_hole`](FaultProxy::black_hole): connections are accepted, nothing is forwarded either way
//!   (the proxy stops reading, so the peers' kernels buffer and then stall, as with a hung server).
//!   Lifting it forwards what was held, in order;
//! - [`refuse`](FaultProxy::refuse): new connections are reset as soon as they are accepted;
//! - [`reset_all`](FaultProxy::reset_all) / [`reset_fraction`](FaultProxy::reset_fraction): SO_LINGER 0 and
//!   close, so both peers see a TCP RST;
//! - [`close_all`](FaultProxy::close_all): an orderly close (FIN) of every connection.
//!
//! When the upstream cannot be reached, the client's connection is reset.
//!
//! [`upstream_ports`](FaultProxy::upstream_ports) lists the local ports of the proxy's live
//! connections to the upstream: the `client_port`s the server sees in `pg_stat_activity`, so a
//! test can count the server sessions of the clients behind one proxy.
use std::collections::BTreeSet;
use std::hash::{BuildHasher, RandomState};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{broadcast, mpsc, watch};
use tokio::time::Instant;

/// What to do to live connections.
#[derive(Debug, Clone, Copy)]
enum Kill {
    /// Reset every connection whose draw is below this fraction (1.0: all of them).
    Reset { fraction: f64, salt: u64 },
    /// Close every connection in order.
    Close,
}

#[derive(Debug)]
struct Shared {
    upstream: SocketAddr,
    /// Client → server delay, in nanoseconds.
    up_delay: AtomicU64,
    /// Server → client delay, in nanoseconds.
    down_delay: AtomicU64,
    refuse: AtomicBool,
    /// `true` while black-holed.
    hole: watch::Sender<bool>,
    kill: broadcast::Sender<Kill>,
    active: AtomicUsize,
    accepted: AtomicU64,
    resets: AtomicU64,
    salt: AtomicU64,
    hasher: RandomState,
    /// Local ports of the live upstream connections.
    ports: Mutex<BTreeSet<u16>>,
}

/// A running fault-injecting proxy; a cheap handle (clones control the same proxy). It runs on
/// the tokio runtime it was started on and stops with that runtime.
#[derive(Debug, Clone)]
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl FaultProxy {
    /// Starts a proxy on a random loopback port in front of `upstream`, passing everything.
    ///
    /// # Errors
    ///
    /// When no loopback port can be bound.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<FaultProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            up_delay: AtomicU64::new(0),
            down_delay: AtomicU64::new(0),
            refuse: AtomicBool::new(false),
            hole: watch::channel(false).0,
            kill: broadcast::channel(64).0,
            active: AtomicUsize::new(0),
            accepted: AtomicU64::new(0),
            resets: AtomicU64::new(0),
            salt: AtomicU64::new(0),
            hasher: RandomState::new(),
            ports: Mutex::new(BTreeSet::new()),
        });
        tokio::spawn(accept_loop(listener, Arc::clone(&shared)));
        Ok(FaultProxy { addr, shared })
    }

    /// The address to connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port to connect to.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Back to passing everything at once: no delay, no black hole, no refusal.
    pub fn pass(&self) {
        self.delay(Duration::ZERO, Duration::ZERO);
        self.black_hole(false);
        self.refuse(false);
    }

    /// Delays client → server bytes by `up` and server → client bytes by `down`.
    pub fn delay(&self, up: Duration, down: Duration) {
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.shared.up_delay.store(ns(up), Ordering::SeqCst);
        self.shared.down_delay.store(ns(down), Ordering::SeqCst);
    }

    /// Stops (or resumes) forwarding in both directions, on every connection.
    pub fn black_hole(&self, on: bool) {
        self.shared.hole.send_replace(on);
    }

    /// Resets (or accepts again) new connections.
    pub fn refuse(&self, on: bool) {
        self.shared.refuse.store(on, Ordering::SeqCst);
    }

    /// Resets every live connection (SO_LINGER 0, then close: both peers see RST).
    pub fn reset_all(&self) {
        self.reset_fraction(1.0);
    }

    /// Resets about `fraction` of the live connections, chosen at random.
    pub fn reset_fraction(&self, fraction: f64) {
        let salt = self.shared.salt.fetch_add(1, Ordering::SeqCst);
        let _ = self.shared.kill.send(Kill::Reset { fraction, salt });
    }

    /// Closes every live connection in order (FIN).
    pub fn close_all(&self) {
        let _ = self.shared.kill.send(Kill::Close);
    }

    /// Connections open through the proxy now.
    pub fn active(&self) -> usize {
        self.shared.active.load(Ordering::SeqCst)
    }

    /// Connections accepted since the start.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Connections reset by the proxy since the start (refusals included).
    pub fn resets(&self) -> u64 {
        self.shared.resets.load(Ordering::SeqCst)
    }

    /// The local ports of the proxy's live upstream connections (what the server sees as each
    /// session's `client_port`).
    pub fn upstream_ports(&self) -> Vec<u16> {
        self.shared.ports.lock().iter().copied().collect()
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut id = 0u64;
    loop {
        let Ok((client, _)) = listener.accept().await else {
            // Out of file descriptors, say: do not spin.
            tokio::time::sleep(Duration::from_millis(1)).await;
            continue;
        };
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        if shared.refuse.load(Ordering::SeqCst) {
            reset(&client);
            shared.resets.fetch_add(1, Ordering::SeqCst);
            drop(client);
            continue;
        }
        id += 1;
        let kill = shared.kill.subscribe();
        tokio::spawn(serve(client, Arc::clone(&shared), kill, id));
    }
}

/// SO_LINGER 0: the close that follows sends RST instead of FIN.
///
/// tokio deprecates `set_linger` because a non-zero linger blocks the thread in `close`; a zero
/// linger never blocks (the kernel discards the send buffer and sends RST at once).
#[allow(deprecated)]
fn reset(stream: &TcpStream) {
    let _ = stream.set_linger(Some(Duration::ZERO));
}

/// Counts a connection as active while alive.
struct Active<'a>(&'a AtomicUsize);

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Lists an upstream connection's local port while it is alive.
struct Port<'a>(&'a Mutex<BTreeSet<u16>>, Option<u16>);

impl Drop for Port<'_> {
    fn drop(&mut self) {
        if let Some(port) = self.1 {
            self.0.lock().remove(&port);
        }
    }
}

async fn serve(
    mut client: TcpStream,
    shared: Arc<Shared>,
    mut kill: broadcast::Receiver<Kill>,
    id: u64,
) {
    shared.active.fetch_add(1, Ordering::SeqCst);
    let _active = Active(&shared.active);
    let mut upstream = match TcpStream::connect(shared.upstream).await {
        Ok(s) => s,
        Err(_) => {
            reset(&client);
            shared.resets.fetch_add(1, Ordering::SeqCst);
            return;
        }
    };
    let port = upstream.local_addr().ok().map(|a| a.port());
    if let Some(port) = port {
        shared.ports.lock().insert(port);
    }
    let _port = Port(&shared.ports, port);
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let outcome = {
        let (cr, cw) = client.split();
        let (ur, uw) = upstream.split();
        tokio::select! {
            () = pump(cr, uw, &shared, &shared.up_delay) => None,
            () = pump(ur, cw, &shared, &shared.down_delay) => None,
            kind = killed(&mut kill, &shared, id) => Some(kind),
        }
    };
    if let Some(Kill::Reset { .. }) = outcome {
        reset(&client);
        reset(&upstream);
        shared.resets.fetch_add(1, Ordering::SeqCst);
    } else {
        let _ = client.shutdown().await;
        let _ = upstream.shutdown().await;
    }
}

/// Waits for a kill command that applies to connection `id`.
async fn killed(kill: &mut broadcast::Receiver<Kill>, shared: &Shared, id: u64) -> Kill {
    loop {
        match kill.recv().await {
            Ok(Kill::Reset { fraction, salt }) => {
                let draw = shared.hasher.hash_one((id, salt)) as f64 / u64::MAX as f64;
                if draw < fraction {
                    return Kill::Reset { fraction, salt };
                }
            }
            Ok(Kill::Close) => return Kill::Close,
            Err(broadcast::error::RecvError::Lagged(_)) => {}
            Err(broadcast::error::RecvError::Closed) => std::future::pending::<()>().await,
        }
    }
}

/// Waits while the proxy is black-holed.
async fn flowing(hole: &mut watch::Receiver<bool>) {
    let _ = hole.wait_for(|on| !*on).await;
}

/// Forwards one direction until EOF or an error: a reader stamps each chunk with its due time,
/// a writer sends it when due.
async fn pump(
    mut from: tokio::net::tcp::ReadHalf<'_>,
    mut to: tokio::net::tcp::WriteHalf<'_>,
    shared: &Shared,
    delay: &AtomicU64,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let mut read_hole = shared.hole.subscribe();
    let mut write_hole = shared.hole.subscribe();
    let reader = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            flowing(&mut read_hole).await;
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    let due = Instant::now() + Duration::from_nanos(delay.load(Ordering::SeqCst));
                    if tx.send((due, buf[..n].to_vec())).is_err() {
                        return;
                    }
                }
            }
        }
    };
    let writer = async move {
        while let Some((due, bytes)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            flowing(&mut write_hole).await;
            if to.write_all(&bytes).await.is_err() {
                return;
            }
        }
    };
    // EOF from the reader: write what is queued, then end. A write error: end now.
    tokio::pin!(reader, writer);
    tokio::select! {
        () = &mut reader => writer.await,
        () = &mut writer => {}
    }
}
