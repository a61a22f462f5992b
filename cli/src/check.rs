//! `tokenlease check`: validate a policy file without touching the database.
//!
//! A valid file may still hold limits that cannot work as meant; those are warned about on
//! stderr (the exit code stays 0):
//!
//! - A plan whose fallback is a local bucket for one instance (`"instances": 1`, or no
//!   `fallback` at all, which defaults to it): while the database is down or slow, every
//!   instance admits the plan's whole limit on its own, so a fleet of N admits N times it.
//! - A leased plan whose capacity is above the most one lease holds (`LeaseSettings::MAX_LEASE`,
//!   about 7.2 × 10⁷ tokens): its leases are held to that size, and a call costing more is
//!   decided by a store statement of its own, as in direct mode, not from a lease.
//! - A limit of a plan of several (`limits`) whose capacity and rate are both at least another
//!   limit's of the plan: it never refuses a take, since the other always refuses first.
//! - An entity plan with a larger burst (capacity) or a faster refill than its route's global
//!   plan. One entity can then spend the whole endpoint's budget before its own limit
//!   applies, and every other entity is denied by the global layer with it, which is what the
//!   entity layer is there to prevent.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use tokenlease::policy::{FallbackMode, LeaseSettings, Policies};

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
            let mut stderr = std::io::stderr().lock();
            for warning in warnings(&policies) {
                let _ = writeln!(stderr, "{}", printed(&args.file, &warning));
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(err) => {
            let _ = writeln!(std::io::stderr().lock(), "{err}");
            Ok(ExitCode::FAILURE)
        }
    }
}

/// One warning as `check` and the demo's reload print it: `FILE: warning: TEXT`, wrapped to
/// [`figures::WIDTH`](super::figures::WIDTH) columns (continuation lines indented by two
/// spaces).
pub(crate) fn printed(file: &Path, warning: &str) -> String {
    super::figures::wrap(&format!("{}: warning: {warning}", file.display()))
}

/// The plans whose fallback is a local bucket for one instance, one line each in file order,
/// then the leased plans whose capacity is above what a lease holds, then the routes whose entity plan allows more than their global plan: a larger burst or a
/// faster refill, one line per route, naming the route, both plans and both figures.
pub(crate) fn warnings(policies: &Policies) -> Vec<String> {
    let mut out = Vec::new();
    for plan in policies.plans() {
        if matches!(plan.fallback().mode, FallbackMode::Local { instances } if instances.get() == 1)
        {
            out.push(format!(
                "{}.fallback: the fallback is a local bucket for 1 instance (the default when \
                 \"fallback\" is unset): while the database is down or slow, every instance \
                 admits the plan's whole limit on its own, so N instances admit N times it; \
                 set \"fallback\": {{ \"mode\": \"local\", \"instances\": N }} to the number of \
                 instances, or \"mode\": \"deny\" to refuse while the database cannot answer",
                plan_path(plan.name()),
            ));
        }
    }
    for plan in policies.plans() {
        out.extend(never_binding(plan));
    }
    let most = LeaseSettings::MAX_LEASE;
    for plan in policies.plans() {
        let Some(lease) = plan.lease() else {
            continue;
        };
        if plan.capacity() <= most {
            continue;
        }
        let largest = plan.capacity().as_nanos() as f64 * lease.max_fraction / 1e9;
        let held = if largest > most.as_nanos() as f64 / 1e9 {
            format!(
                "its leases (max_fraction × capacity = {largest} tokens) are held to that size, \
                 and "
            )
        } else {
            String::new()
        };
        out.push(format!(
            "{}.lease: the capacity {} is above the most one lease holds, {} tokens: {held}a \
             call costing more than that is decided by a store statement of its own, as in \
             direct mode, not from a lease; give such costs a direct-mode plan, or keep the \
             capacity at most {} tokens",
            plan_path(plan.name()),
            plan.capacity().trimmed(),
            most.trimmed(),
            most.as_nanos() / 1_000_000_000,
        ));
    }
    for (i, route) in policies.routes().iter().enumerate() {
        // Each limit per entity of the route (not a budget shared with other routes) against
        // each limit on the whole route.
        let whole = route.limits.iter().filter(|l| l.source.is_none());
        let pairs: Vec<(&str, &str)> = whole
            .flat_map(|g| {
                route
                    .limits
                    .iter()
                    .filter(|e| e.source.is_some() && e.budget.is_none())
                    .map(move |e| (g.plan.as_str(), e.plan.as_str()))
            })
            .collect();
        for (global, entity) in pairs {
            if let Some(warning) = entity_above_route(policies, i, route, global, entity) {
                out.push(warning);
            }
        }
    }
    out
}

/// The warnings for the limits of a plan of several that can never refuse a take: a limit
/// whose capacity and rate are both at least another's holds, from the same full start and
/// the same takes, never fewer tokens than that one, so the other always refuses first.
fn never_binding(plan: &tokenlease::policy::Plan) -> Vec<String> {
    let limits: Vec<_> = plan.bucket().limits().collect();
    let mut out = Vec::new();
    for (j, loose) in limits.iter().enumerate() {
        let tighter = limits.iter().enumerate().find(|&(i, tight)| {
            i != j
                && tight.capacity() <= loose.capacity()
                && tight.rate() <= loose.rate()
                && (i < j || tight != loose)
        });
        if let Some((_, tight)) = tighter {
            out.push(format!(
                "{}.limits: the limit of capacity {} refilling {} tokens a second never \
                 refuses a take: the limit of capacity {} refilling {} a second is as small \
                 and as slow, so it always refuses first; remove the first, or raise the \
                 second's capacity or rate",
                plan_path(plan.name()),
                loose.capacity().trimmed(),
                loose.rate().per_second_amount().trimmed(),
                tight.capacity().trimmed(),
                tight.rate().per_second_amount().trimmed(),
            ));
        }
    }
    out
}

/// The warning for an entity limit of `route` (routes[`i`]) under plan `entity` that allows
/// more than its whole-route limit under plan `global`, if it does.
fn entity_above_route(
    policies: &Policies,
    i: usize,
    route: &tokenlease::policy::Route,
    global: &str,
    entity: &str,
) -> Option<String> {
    {
        let (Some(g), Some(e)) = (policies.plan(global), policies.plan(entity)) else {
            return None;
        };
        let mut above = Vec::new();
        if e.capacity() > g.capacity() {
            above.push(format!(
                "burst {} > {}",
                e.capacity().trimmed(),
                g.capacity().trimmed()
            ));
        }
        if e.rate() > g.rate() {
            above.push(format!(
                "rate {}/s > {}/s",
                e.rate().as_f64(),
                g.rate().as_f64()
            ));
        }
        if above.is_empty() {
            return None;
        }
        Some(format!(
            "routes[{i}] ({} {}): the entity plan {:?} allows more than the global plan {:?} \
             ({}): one entity can spend the whole endpoint's budget before its own limit \
             applies, and every other entity is then denied by the global layer; make the \
             entity plan smaller than the global one",
            route.method,
            short(&route.path),
            short(e.name()),
            short(g.name()),
            above.join(", "),
        ))
    }
}

/// `plans.NAME` for a plain name, as the policy errors write it, else `plans["NAME"]` (cut).
fn plan_path(name: &str) -> String {
    if !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        format!("plans.{name}")
    } else {
        format!("plans[{:?}]", short(name))
    }
}

/// `text` cut to 100 characters (route paths and plan names come from the file).
fn short(text: &str) -> String {
    if text.chars().count() <= 100 {
        text.to_owned()
    } else {
        format!("{}…", text.chars().take(100).collect::<String>())
    }
}
