//! Routes in a policy file: their checks (method, path pattern, plans, entities, shadow) and
//! the route patterns themselves (`/bookings/{id}`, `{*rest}`).

use super::error::{PolicyError, quote, shorten};
use super::raw::{Obj, RawEntity, RawRoute};
use super::types::{EntityRule, EntitySource, Route, RouteLimit, RouteShadow};

use super::check::Checker;
use super::check::{MAX_ENTITY_TYPE, METHODS};
use super::limits::Budgets;

impl Checker {
    /// A checked route and its shape for duplicate detection (method, path with parameter
    /// names blanked out).
    pub(super) fn route(
        &self,
        field: &str,
        raw: RawRoute,
        lookup: &dyn Fn(&str, &str) -> Result<usize, PolicyError>,
        budgets: &Budgets,
    ) -> Result<(Route, (String, String)), PolicyError> {
        if !METHODS.contains(&raw.method.as_str()) {
            let upper = raw.method.to_ascii_uppercase();
            let hint = if METHODS.contains(&upper.as_str()) {
                " (methods are upper-case)"
            } else {
                ""
            };
            return Err(self.err(
                format!("{field}.method"),
                format!(
                    "unknown HTTP method {}{hint}; use one of {}",
                    quote(&raw.method),
                    METHODS.join(", ")
                ),
            ));
        }
        let path_field = format!("{field}.path");
        if raw.path.is_empty() {
            return Err(self.err(path_field, "must not be empty; route paths start with '/'"));
        }
        if !raw.path.starts_with('/') {
            return Err(self.err(
                path_field,
                format!("must start with '/', got {}", quote(&raw.path)),
            ));
        }
        let pattern = parse_pattern(&raw.path).map_err(|reason| {
            self.err(
                &path_field,
                format!("invalid route pattern {}: {reason}", quote(&raw.path)),
            )
        })?;
        if let Some(raw_limits) = raw.limits {
            let older = [
                raw.global.as_ref().map(|_| "global"),
                raw.entity.as_ref().map(|_| "entity"),
                raw.shadow.as_ref().map(|_| "shadow"),
            ];
            if let Some(older) = older.into_iter().flatten().next() {
                return Err(self.err(
                    format!("{field}.{older}"),
                    "give the route's limits either in limits or with global and entity, not \
                     both: write this one as an item of limits",
                ));
            }
            let limits = self.limits(
                field,
                raw_limits,
                &raw.path,
                &pattern.params,
                lookup,
                budgets,
            )?;
            let route = Route {
                method: raw.method,
                path: raw.path,
                global: None,
                entity: None,
                shadow: RouteShadow::all(false),
                limits,
            };
            let shape = (route.method.clone(), pattern.shape);
            return Ok((route, shape));
        }
        if let Some(global) = &raw.global {
            lookup(&format!("{field}.global"), global)?;
        }
        let entity = match raw.entity {
            Some(Obj(entity)) => Some(self.entity(
                &format!("{field}.entity"),
                entity,
                &raw.path,
                &pattern.params,
                lookup,
            )?),
            None => None,
        };
        if raw.global.is_none() && entity.is_none() {
            return Err(self.err(
                field,
                "limits nothing: give global, entity or both".to_owned(),
            ));
        }
        let shadow = match raw.shadow {
            None | Some(serde_json::Value::Bool(false)) => RouteShadow::all(false),
            Some(serde_json::Value::Bool(true)) => RouteShadow::all(true),
            Some(serde_json::Value::String(layer)) if layer == "api" => RouteShadow::api(),
            Some(serde_json::Value::String(layer)) if layer == "entity" => RouteShadow::entity(),
            Some(other) => {
                return Err(self.err(
                    format!("{field}.shadow"),
                    format!(
                        "expected true, false, \"api\" or \"entity\", got {}",
                        shorten(&other.to_string())
                    ),
                ));
            }
        };
        if shadow.api && !shadow.entity && raw.global.is_none() {
            return Err(self.err(
                format!("{field}.shadow"),
                "puts the api layer in shadow mode, but the route has no global plan",
            ));
        }
        if shadow.entity && !shadow.api && entity.is_none() {
            return Err(self.err(
                format!("{field}.shadow"),
                "puts the entity layer in shadow mode, but the route has no entity",
            ));
        }
        let mut limits = Vec::with_capacity(2);
        if let Some(plan) = &raw.global {
            limits.push(RouteLimit {
                name: "api".to_owned(),
                plan: plan.clone(),
                source: None,
                entity_type: None,
                budget: None,
                shadow: shadow.api,
            });
        }
        if let Some(rule) = &entity {
            limits.push(RouteLimit {
                name: "entity".to_owned(),
                plan: rule.plan.clone(),
                source: Some(rule.source.clone()),
                entity_type: rule.entity_type.clone(),
                budget: None,
                shadow: shadow.entity,
            });
        }
        let route = Route {
            method: raw.method,
            path: raw.path,
            global: raw.global,
            entity,
            shadow,
            limits,
        };
        let shape = (route.method.clone(), pattern.shape);
        Ok((route, shape))
    }

    /// The entity rule written at `field` (a route's `entity`, a budget, or a limit with an
    /// entity source) on a route with pattern `path` and parameters `params` (a budget has
    /// no route: `path` empty and any `path_param` allowed, checked on each route naming it).
    pub(super) fn entity(
        &self,
        field: &str,
        raw: RawEntity,
        path: &str,
        params: &[String],
        lookup: &dyn Fn(&str, &str) -> Result<usize, PolicyError>,
    ) -> Result<EntityRule, PolicyError> {
        let field = field.to_owned();
        let client_ip = raw.client_ip == Some(true);
        let given: Vec<&str> = [
            raw.path_param.as_ref().map(|_| "path_param"),
            raw.header.as_ref().map(|_| "header"),
            client_ip.then_some("client_ip"),
        ]
        .into_iter()
        .flatten()
        .collect();
        let source = match given.as_slice() {
            [] => {
                return Err(self.err(
                    field,
                    "no entity source: give one of path_param, header or client_ip: true",
                ));
            }
            [_] => {
                if let Some(param) = raw.path_param {
                    if !path.is_empty() && !params.contains(&param) {
                        let known = if params.is_empty() {
                            "it has none".to_owned()
                        } else {
                            format!("it has {}", shorten(&params.join(", ")))
                        };
                        return Err(self.err(
                            format!("{field}.path_param"),
                            format!(
                                "{} is not a parameter of {}; {known}",
                                quote(&param),
                                quote(path)
                            ),
                        ));
                    }
                    EntitySource::PathParam(param)
                } else if let Some(header) = raw.header {
                    if !is_header_name(&header) {
                        return Err(self.err(
                            format!("{field}.header"),
                            format!("{} is not a valid HTTP header name", quote(&header)),
                        ));
                    }
                    EntitySource::Header(header.to_ascii_lowercase())
                } else {
                    EntitySource::ClientIp
                }
            }
            many => {
                return Err(self.err(
                    field,
                    format!(
                        "more than one entity source ({}): give exactly one",
                        many.join(", ")
                    ),
                ));
            }
        };
        if let Some(kind) = &raw.entity_type {
            let ok = !kind.is_empty()
                && kind.chars().count() <= MAX_ENTITY_TYPE
                && !kind.chars().any(char::is_control);
            if !ok {
                return Err(self.err(
                    format!("{field}.type"),
                    format!(
                        "must be 1 to {MAX_ENTITY_TYPE} characters without control \
                         characters, got {}",
                        quote(kind)
                    ),
                ));
            }
        }
        lookup(&format!("{field}.plan"), &raw.plan)?;
        Ok(EntityRule {
            source,
            entity_type: raw.entity_type,
            plan: raw.plan,
        })
    }
}

/// Whether `name` is an HTTP field name: one or more `tchar`s (RFC 9110 §5.6.2).
pub(super) fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name.bytes().all(|b| {
            b.is_ascii_alphanumeric()
                || matches!(
                    b,
                    b'!' | b'#'
                        | b'$'
                        | b'%'
                        | b'&'
                        | b'\''
                        | b'*'
                        | b'+'
                        | b'-'
                        | b'.'
                        | b'^'
                        | b'_'
                        | b'`'
                        | b'|'
                        | b'~'
                )
        })
}

/// A route pattern taken apart.
#[derive(Debug)]
pub(super) struct Pattern {
    /// Parameter names in order (without the `*` of a catch-all).
    pub(super) params: Vec<String>,
    /// The path with every parameter name removed (`/bookings/{}`), so two routes that match
    /// the same requests have the same shape.
    pub(super) shape: String,
}

/// The shape of an axum 0.8 route pattern: the pattern with its parameter names removed
/// (`/items/{}` for `/items/{itemId}`), so two patterns that match the same requests have the
/// same shape. `None` for a pattern this crate refuses.
#[cfg(feature = "http")]
pub(crate) fn route_shape(path: &str) -> Option<String> {
    parse_pattern(path).ok().map(|p| p.shape)
}

/// Why `path` is not an axum 0.8 route pattern, if it is not one.
#[cfg(feature = "http")]
pub(crate) fn route_pattern_error(path: &str) -> Option<String> {
    parse_pattern(path).err()
}

/// The parameter names of an axum 0.8 route pattern, in order (`None` for a refused pattern).
#[cfg(feature = "http")]
pub(crate) fn route_params(path: &str) -> Option<Vec<String>> {
    parse_pattern(path).ok().map(|p| p.params)
}

/// Checks an axum 0.8 route pattern: `{name}` parameters, a `{*name}` catch-all only at the
/// end, `{{` and `}}` for literal braces, no whitespace, control characters, `?` or `#`, and
/// no segment in the older `:name` / `*name` syntax (axum 0.8 refuses to route those, so such
/// a policy route would never match a request and its limits would silently never apply).
pub(super) fn parse_pattern(path: &str) -> Result<Pattern, String> {
    for segment in path.split('/') {
        for (mark, written) in [(':', "{name}"), ('*', "{*name}")] {
            if let Some(name) = segment.strip_prefix(mark) {
                let hint = if name.is_empty() {
                    written.to_owned()
                } else if mark == ':' {
                    format!("{{{name}}}")
                } else {
                    format!("{{*{name}}}")
                };
                return Err(format!(
                    "segment {} uses the older {mark}name parameter syntax, which axum 0.8 \
                     does not route; write it as {}",
                    quote(segment),
                    quote(&hint)
                ));
            }
        }
    }
    let mut params: Vec<String> = Vec::new();
    let mut names: std::collections::HashSet<&str> = std::collections::HashSet::new();
    let mut shape = String::with_capacity(path.len());
    let mut chars = path.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        match c {
            '{' if chars.peek().map(|&(_, n)| n) == Some('{') => {
                chars.next();
                shape.push_str("{{");
            }
            '}' if chars.peek().map(|&(_, n)| n) == Some('}') => {
                chars.next();
                shape.push_str("}}");
            }
            '}' => return Err(format!("unmatched '}}' at byte {at}")),
            '{' => {
                let rest = &path[at + 1..];
                let end = rest
                    .find(['}', '{', '/'])
                    .filter(|&e| rest.as_bytes()[e] == b'}')
                    .ok_or_else(|| format!("unclosed '{{' at byte {at}"))?;
                let inner = &rest[..end];
                let (catch_all, name) = match inner.strip_prefix('*') {
                    Some(name) => (true, name),
                    None => (false, inner),
                };
                let name_ok = !name.is_empty()
                    && name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
                if !name_ok {
                    return Err(format!(
                        "parameter name {} must be 1 or more of A-Z a-z 0-9 _ -",
                        quote(name)
                    ));
                }
                if !names.insert(name) {
                    return Err(format!("parameter {} appears twice", quote(name)));
                }
                if catch_all && at + 1 + end + 1 != path.len() {
                    return Err(format!(
                        "catch-all parameter {} must end the path",
                        quote(name)
                    ));
                }
                params.push(name.to_owned());
                shape.push_str(if catch_all { "{*}" } else { "{}" });
                // Skip the name and the closing brace.
                for _ in 0..inner.chars().count() + 1 {
                    chars.next();
                }
            }
            c if c.is_whitespace() || c.is_control() || c == '?' || c == '#' => {
                return Err(format!("{c:?} is not allowed in a route pattern"));
            }
            c => shape.push(c),
        }
    }
    Ok(Pattern { params, shape })
}
