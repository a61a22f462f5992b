//! A statement in flight on a pooled connection, and what happens to it when its call gives up
//! (abandoned: cancelled, its session closed), and the server's refusals that only a pooler or a
//! changed schema cause.

use std::time::Duration;

use tokio_postgres::NoTls;
use tokio_postgres::error::SqlState;

use super::{Manager, PgConnection};

/// The refusals of a prepared statement that only a transaction pooler causes: the statement
/// is not in the session (26000), another client's of the same name is (42P05), or that one
/// takes other parameters (08P01). The server ran nothing.
pub(super) fn refused_by_pooler(e: &tokio_postgres::Error) -> bool {
    e.code().is_some_and(|code| {
        [
            SqlState::INVALID_SQL_STATEMENT_NAME,
            SqlState::DUPLICATE_PSTATEMENT,
            SqlState::PROTOCOL_VIOLATION,
        ]
        .contains(code)
    })
}

/// "cached plan must not change result type": the statement's result changed since the session
/// prepared it. The server ran nothing.
pub(super) fn stale_plan(e: &tokio_postgres::Error) -> bool {
    e.code() == Some(&SqlState::FEATURE_NOT_SUPPORTED)
        && e.as_db_error().is_some_and(|db| {
            db.message()
                .contains("cached plan must not change result type")
        })
}

/// How long an abandoned statement's connection waits for the statement to finish on its own
/// before it is cancelled: a reply that is merely late (a slow link) then costs no new
/// connection, while a statement stuck on a lock is cancelled after this.
pub(super) const ABANDON_GRACE: Duration = Duration::from_millis(50);

/// A pooled connection with a statement in flight.
///
/// Dropped before [`done`](Self::done), as when the call timed out or the caller dropped the
/// call's future, the statement is *abandoned*: dropping a tokio-postgres future does not stop
/// the statement on the server, and returning the connection to the pool would queue the next
/// caller behind it. So a task (spawned, bounded) keeps the connection out of the pool and sends
/// it an empty query, whose reply comes after the abandoned statement's:
///
/// - when that reply comes within [`ABANDON_GRACE`], the statement finished by itself and the
///   session is idle with nothing sent to it: the connection goes back to the pool. Over a slow
///   link, where every reply is late, this is what keeps the pool's connections: closing each
///   one would make the next caller open a connection over the same slow link, whose start-up
///   and first statement together can take longer than a call, and so on;
/// - otherwise the server gets a cancel request for the statement, the task waits until the
///   session is idle, and then closes the connection instead of returning it: the cancel,
///   delivered late, could otherwise hit the next caller's statement.
///
/// The connection holds its pool slot until then, so the pool never has more sessions busy on
/// the server than its size. Each step is bounded by the connect timeout; a server that does not
/// answer gets its socket closed. Cancels are counted in `tokenlease_store_cancels_total{result}`
/// (`result="none"` for a statement that finished in the grace).
pub(super) struct InFlight {
    pub(super) conn: Option<bb8::PooledConnection<'static, Manager>>,
    pub(super) cancel_timeout: Duration,
}

impl InFlight {
    pub(super) fn conn(&self) -> &PgConnection {
        self.conn
            .as_deref()
            .expect("connection present until dropped")
    }

    /// The statement finished: the connection goes back to the pool.
    pub(super) fn done(mut self) {
        drop(self.conn.take());
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        conn.discard();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(abandon(conn, self.cancel_timeout));
            }
            // No runtime to cancel from: close the socket; the server's statement_timeout ends
            // the statement.
            Err(_) => conn.abort_driver(),
        }
    }
}

/// Waits briefly for the statement running on `conn` to finish and returns the connection to the
/// pool, or cancels the statement, waits (bounded) until its session is idle, and closes it. See
/// [`InFlight`].
pub(super) async fn abandon(mut conn: bb8::PooledConnection<'static, Manager>, bound: Duration) {
    // The reply to an empty query comes after the abandoned statement's: within the grace, the
    // statement finished by itself and no cancel was sent, so the session can be used again.
    let idle_query = conn.simple_query("");
    if let Ok(Ok(_)) = tokio::time::timeout(ABANDON_GRACE.min(bound), idle_query).await {
        metrics::counter!(crate::metrics::STORE_CANCELS, "result" => "none").increment(1);
        conn.keep();
        return;
    }
    let token = conn.cancel_token();
    let sent = matches!(
        tokio::time::timeout(bound, token.cancel_query(NoTls)).await,
        Ok(Ok(()))
    );
    metrics::counter!(
        crate::metrics::STORE_CANCELS,
        "result" => if sent { "sent" } else { "failed" }
    )
    .increment(1);
    // Ok(Err(_)) is fine too: the cancel hit the empty query, so the session is idle.
    let idle = tokio::time::timeout(bound, conn.simple_query(""))
        .await
        .is_ok();
    if !idle {
        conn.abort_driver();
    }
    // Marked discarded: dropping it closes the session rather than pooling it.
    drop(conn);
}
