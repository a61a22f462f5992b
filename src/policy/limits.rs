//! A route's `limits` and the file's `budgets`: their checks.
//!
//! A route lists its limits in the order the HTTP layer checks them. Each is a limit of its own
//! (a `name`, a `plan`, and an entity source, or none for the whole route) or a budget named in
//! the file's `budgets`, shared by every route that lists it.

use std::collections::HashMap;

use super::check::Checker;
use super::error::{PolicyError, push_key, quote, shorten};
use super::raw::{Obj, RawEntity, RawLimit, RawMap};
use super::types::{EntityRule, EntitySource, RouteLimit};

/// The most limits one route lists: each request carries a word of flags per route, one bit a
/// limit, and a route with more limits than this is a file to split, not one to serve.
pub const MAX_ROUTE_LIMITS: usize = 16;

/// The file's budgets, by name, checked.
pub(super) type Budgets = HashMap<String, EntityRule>;

/// The longest limit or budget name, in characters.
pub(super) const MAX_LIMIT_NAME: usize = 64;

/// Whether `name` is a limit or budget name: 1 to 64 of `A-Z a-z 0-9 _ . -`, so it is a
/// header field name's part (`X-RateLimit-{name}-Remaining`) and holds no colon (which could
/// make two limits' keys the same).
pub(super) fn limit_name_ok(name: &str) -> bool {
    (1..=MAX_LIMIT_NAME).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

impl Checker {
    /// The file's `budgets`: each a valid name and an entity rule (source, type, plan).
    pub(super) fn budgets(
        &self,
        raw: RawMap<RawEntity>,
        lookup: &dyn Fn(&str, &str) -> Result<usize, PolicyError>,
    ) -> Result<Budgets, PolicyError> {
        let at = |name: &str| {
            let mut field = String::from("budgets");
            push_key(&mut field, name);
            field
        };
        if let Some(name) = raw.duplicates.first() {
            return Err(self.err(
                at(name),
                "duplicate budget name: each budget may be defined once",
            ));
        }
        let mut budgets = Budgets::with_capacity(raw.entries.len());
        for (name, entity) in raw.entries {
            if !limit_name_ok(&name) {
                return Err(self.err(
                    at(&name),
                    format!(
                        "invalid budget name {}: use 1 to {MAX_LIMIT_NAME} of A-Z a-z 0-9 _ . -",
                        quote(&name)
                    ),
                ));
            }
            // No route yet: a `path_param` is checked on each route that names the budget.
            let rule = self.entity(&at(&name), entity, "", &[], lookup)?;
            budgets.insert(name, rule);
        }
        Ok(budgets)
    }

    /// A route's `limits` at `{field}.limits`, on the route with pattern `path` and parameters
    /// `params`.
    pub(super) fn limits(
        &self,
        field: &str,
        raw: Vec<Obj<RawLimit>>,
        path: &str,
        params: &[String],
        lookup: &dyn Fn(&str, &str) -> Result<usize, PolicyError>,
        budgets: &Budgets,
    ) -> Result<Vec<RouteLimit>, PolicyError> {
        if raw.is_empty() {
            return Err(self.err(
                format!("{field}.limits"),
                "limits nothing: list at least one limit",
            ));
        }
        if raw.len() > MAX_ROUTE_LIMITS {
            return Err(self.err(
                format!("{field}.limits"),
                format!(
                    "lists {} limits: a route has at most {MAX_ROUTE_LIMITS}",
                    raw.len()
                ),
            ));
        }
        let mut limits: Vec<RouteLimit> = Vec::with_capacity(raw.len());
        for (j, Obj(limit)) in raw.into_iter().enumerate() {
            let at = format!("{field}.limits[{j}]");
            let limit = match limit.budget.clone() {
                Some(budget) => self.budget_limit(&at, limit, &budget, path, params, budgets)?,
                None => self.own_limit(&at, limit, path, params, lookup)?,
            };
            if let Some(first) = limits.iter().position(|l| l.name == limit.name) {
                let which = if limit.budget.is_some() {
                    "budget"
                } else {
                    "name"
                };
                return Err(self.err(
                    format!("{at}.{which}"),
                    format!(
                        "duplicate limit name {}: already {field}.limits[{first}]; each limit \
                         of a route has a name of its own",
                        quote(&limit.name)
                    ),
                ));
            }
            limits.push(limit);
        }
        Ok(limits)
    }

    /// A limit that names a budget: the budget's source, type and plan, named by the budget.
    fn budget_limit(
        &self,
        at: &str,
        raw: RawLimit,
        budget: &str,
        path: &str,
        params: &[String],
        budgets: &Budgets,
    ) -> Result<RouteLimit, PolicyError> {
        let set_on_budget = [
            raw.name.as_ref().map(|_| "name"),
            raw.plan.as_ref().map(|_| "plan"),
            raw.path_param.as_ref().map(|_| "path_param"),
            raw.header.as_ref().map(|_| "header"),
            raw.client_ip.map(|_| "client_ip"),
            raw.entity_type.as_ref().map(|_| "type"),
        ];
        if let Some(extra) = set_on_budget.into_iter().flatten().next() {
            return Err(self.err(
                format!("{at}.{extra}"),
                format!(
                    "a budget's limit takes its name, source, type and plan from budgets.{}; \
                     give only budget (and shadow)",
                    shorten(budget)
                ),
            ));
        }
        let Some(rule) = budgets.get(budget) else {
            let mut known: Vec<&str> = budgets.keys().map(String::as_str).collect();
            known.sort_unstable();
            let known = if known.is_empty() {
                "the file defines none".to_owned()
            } else {
                format!("defined budgets: {}", shorten(&known.join(", ")))
            };
            return Err(self.err(
                format!("{at}.budget"),
                format!("unknown budget {}; {known}", quote(budget)),
            ));
        };
        if let EntitySource::PathParam(param) = &rule.source
            && !params.contains(param)
        {
            return Err(self.err(
                format!("{at}.budget"),
                format!(
                    "budget {} reads the path parameter {}, which {} does not have",
                    quote(budget),
                    quote(param),
                    quote(path)
                ),
            ));
        }
        Ok(RouteLimit {
            name: budget.to_owned(),
            plan: rule.plan.clone(),
            source: Some(rule.source.clone()),
            entity_type: rule.entity_type.clone(),
            budget: Some(budget.to_owned()),
            shadow: raw.shadow == Some(true),
        })
    }

    /// A limit of the route's own: a name, a plan, and an entity source or none.
    fn own_limit(
        &self,
        at: &str,
        raw: RawLimit,
        path: &str,
        params: &[String],
        lookup: &dyn Fn(&str, &str) -> Result<usize, PolicyError>,
    ) -> Result<RouteLimit, PolicyError> {
        let Some(name) = raw.name else {
            return Err(self.err(
                at,
                "missing name: every limit has one (or give budget to use a shared budget)",
            ));
        };
        if !limit_name_ok(&name) {
            return Err(self.err(
                format!("{at}.name"),
                format!(
                    "invalid limit name {}: use 1 to {MAX_LIMIT_NAME} of A-Z a-z 0-9 _ . -",
                    quote(&name)
                ),
            ));
        }
        let Some(plan) = raw.plan else {
            return Err(self.err(at, "missing plan: give the plan of the limit's buckets"));
        };
        let has_source =
            raw.path_param.is_some() || raw.header.is_some() || raw.client_ip.is_some();
        if !has_source {
            if raw.entity_type.is_some() {
                return Err(self.err(
                    format!("{at}.type"),
                    "only applies to a limit per entity (path_param, header or client_ip)",
                ));
            }
            lookup(&format!("{at}.plan"), &plan)?;
            return Ok(RouteLimit {
                name,
                plan,
                source: None,
                entity_type: None,
                budget: None,
                shadow: raw.shadow == Some(true),
            });
        }
        let entity = RawEntity {
            path_param: raw.path_param,
            header: raw.header,
            client_ip: raw.client_ip,
            entity_type: raw.entity_type,
            plan,
        };
        let rule = self.entity(at, entity, path, params, lookup)?;
        Ok(RouteLimit {
            name,
            plan: rule.plan,
            source: Some(rule.source),
            entity_type: rule.entity_type,
            budget: None,
            shadow: raw.shadow == Some(true),
        })
    }
}
