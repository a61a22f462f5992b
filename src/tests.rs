//! Support shared by the library's unit tests (the integration tests have theirs in
//! `tests/common`).

use std::time::Duration;

/// The one place where the library's unit tests wait for something by looking again (L4, as
/// `tests/common`'s `eventually` for the integration tests): looks at `check` at once, then
/// every `step` of tokio's clock (real time, or the paused clock of a test that paused it), the
/// last look at the deadline, `within` from now; fails naming `what` never happened.
pub(crate) async fn eventually(
    step: Duration,
    within: Duration,
    what: &str,
    mut check: impl AsyncFnMut() -> bool,
) {
    let deadline = crate::clock::instant() + within;
    loop {
        if check().await {
            return;
        }
        let now = crate::clock::instant();
        assert!(now < deadline, "{what}: not within {within:?}");
        // sleep: the poll's step, between two looks at the condition.
        tokio::time::sleep(step.min(deadline - now)).await;
    }
}
