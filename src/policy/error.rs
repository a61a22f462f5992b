//! [`PolicyError`]: why a policy file was refused, and the helpers that keep its messages
//! short whatever the input; and `RouteConfigError`, why the HTTP layer refused a route.

use std::fmt;
use std::fmt::Write as _;

/// User values (names, numbers, keys) quoted in messages are cut to this many characters,
/// followed by `…(N bytes)` giving the whole value's length.
pub(crate) const MAX_QUOTED: usize = 64;

/// The longest message, in bytes, whatever it quotes; longer ones are cut (on a character
/// boundary) and end in `…(N bytes)`.
pub(crate) const MAX_MESSAGE: usize = 1024;

/// The byte offset after the first `max` characters of `s`, or `None` when `s` is no longer.
fn cut_at(s: &str, max: usize) -> Option<usize> {
    s.char_indices().nth(max).map(|(at, _)| at)
}

/// `s` as it is when at most [`MAX_QUOTED`] characters, else its first [`MAX_QUOTED`]
/// characters and `…(N bytes)`.
pub(crate) fn shorten(s: &str) -> String {
    match cut_at(s, MAX_QUOTED) {
        Some(at) => format!("{}…({} bytes)", &s[..at], s.len()),
        None => s.to_owned(),
    }
}

/// Appends `.key`, or `["key"]` when the key is not a plain word (holds a dot, space, ...)
/// or is longer than 64 characters (then cut as [`quote`] cuts).
pub(super) fn push_key(field: &mut String, key: &str) {
    let plain = !key.is_empty()
        && key.len() <= MAX_QUOTED
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if plain {
        if !field.is_empty() {
            field.push('.');
        }
        field.push_str(key);
    } else {
        let _ = write!(field, "[{}]", quote(key));
    }
}

/// `s` in double quotes with escapes, cut as [`shorten`] cuts: `"abc…"…(1048576 bytes)`.
pub(crate) fn quote(s: &str) -> String {
    match cut_at(s, MAX_QUOTED) {
        Some(at) => format!("{:?}…({} bytes)", &s[..at], s.len()),
        None => format!("{s:?}"),
    }
}

/// A number from the file for a message: as written by `Display` when short, else in
/// exponent form (`1e308`, not 309 digits; `1e-300`, not 300 zeros).
pub(crate) fn number(x: f64) -> String {
    let plain = x.to_string();
    if plain.len() <= 24 {
        plain
    } else {
        format!("{x:e}")
    }
}

/// Every span quoted in backticks or double quotes in `message` (as serde writes the values it
/// echoes) cut as [`shorten`] cuts it.
pub(crate) fn shorten_quoted(message: &str) -> String {
    let mut out = String::with_capacity(message.len().min(MAX_MESSAGE));
    let mut rest = message;
    while let Some(open) = rest.find(['`', '"']) {
        let delim = rest.as_bytes()[open];
        out.push_str(&rest[..=open]);
        let inner = &rest[open + 1..];
        // The closing delimiter; inside double quotes a backslash escapes the next character.
        let mut close = None;
        let mut escaped = false;
        for (i, b) in inner.bytes().enumerate() {
            if escaped {
                escaped = false;
            } else if b == b'\\' && delim == b'"' {
                escaped = true;
            } else if b == delim {
                close = Some(i);
                break;
            }
        }
        let end = close.unwrap_or(inner.len());
        let span = &inner[..end];
        match cut_at(span, MAX_QUOTED) {
            Some(at) => {
                out.push_str(&span[..at]);
                if close.is_some() {
                    out.push(delim as char);
                }
                out.push_str(&format!("…({} bytes)", span.len()));
            }
            None => {
                out.push_str(span);
                if close.is_some() {
                    out.push(delim as char);
                }
            }
        }
        rest = match close {
            Some(i) => &inner[i + 1..],
            None => "",
        };
    }
    out.push_str(rest);
    out
}

/// `message` cut to at most about [`MAX_MESSAGE`] bytes.
fn bounded(message: String) -> String {
    if message.len() <= MAX_MESSAGE {
        return message;
    }
    let mut at = MAX_MESSAGE;
    while !message.is_char_boundary(at) {
        at -= 1;
    }
    format!("{}…({} bytes)", &message[..at], message.len())
}

/// What kind of problem a [`PolicyError`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PolicyErrorKind {
    /// The file could not be read, or is not UTF-8.
    Read,
    /// The file (or text) is larger than [`MAX_POLICY_BYTES`](super::MAX_POLICY_BYTES); it
    /// was not read whole.
    TooLarge {
        /// The limit in bytes.
        limit: u64,
    },
    /// Malformed JSON, a wrong type, an unknown or repeated field: found while reading the
    /// JSON, with a line and column.
    Syntax,
    /// A value out of its documented range, a bad name, an unknown plan, a duplicate: found
    /// while checking the values.
    Invalid,
    /// The policy defines more plans than a limiter can hold.
    TooManyPlans {
        /// The plans the policy defines.
        count: usize,
        /// The most a limiter holds: [`MAX_PLANS`](super::MAX_PLANS).
        limit: usize,
    },
}

/// Why a policy file was refused: one message naming the file, the field and, for syntax and
/// type errors, the line and column.
///
/// It displays as
///
/// ```text
/// policy.json:3:17: plans.standard.capacity: invalid type: string "100", expected u64
/// policy.json: plans.standard.capacity: must be a whole number of tokens ≥ 1, got 0
/// ```
///
/// Syntax and type errors (found while reading the JSON) carry a line and column; errors found
/// while checking the values (a zero capacity, an unknown plan name) name the field only.
///
/// Every value from the file that a message quotes (a name, a number, a key, a path) is cut
/// to 64 characters followed by `…(N bytes)`, and numbers too long to print whole are written
/// with an exponent (`1e308`), so a hostile file cannot make a huge message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError {
    /// The file as given to [`Policies::from_file`](super::Policies::from_file), or `<policy>`.
    file: String,
    /// The plan the error is about: the one being defined, or the unknown one referenced.
    plan: Option<String>,
    /// The JSON path of the offending value, e.g. `plans.standard.capacity` or `routes[0].path`.
    field: Option<String>,
    /// One-based line and column from serde_json, for syntax and type errors (a policy is at
    /// most 16 MiB, so both fit in 32 bits; kept small so the error stays small).
    line_column: Option<(u32, u32)>,
    /// What is wrong, lower-case, without file or field.
    message: String,
    /// What kind of problem it is.
    kind: Kind,
}

/// [`PolicyErrorKind`] without its constants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Read,
    TooLarge,
    Syntax,
    Invalid,
    /// The plans the policy defines (a 16 MiB file holds fewer than `u32::MAX`; 32 bits keep
    /// the error small).
    TooManyPlans(u32),
}

impl PolicyError {
    /// An [`Invalid`](PolicyErrorKind::Invalid) error; `message` is cut to [`MAX_MESSAGE`]
    /// bytes.
    pub(crate) fn new(file: &str, message: impl Into<String>) -> Self {
        PolicyError {
            file: file.to_owned(),
            plan: None,
            field: None,
            line_column: None,
            message: bounded(message.into()),
            kind: Kind::Invalid,
        }
    }

    pub(crate) fn with_kind(mut self, kind: Kind) -> Self {
        self.kind = kind;
        self
    }

    pub(crate) fn with_field(mut self, field: impl Into<String>) -> Self {
        let field = field.into();
        self.field = (!field.is_empty()).then(|| bounded(field));
        self
    }

    /// The plan, cut as [`shorten`] cuts (a valid plan name is never cut).
    pub(crate) fn with_plan(mut self, plan: &str) -> Self {
        self.plan = Some(shorten(plan));
        self
    }

    pub(crate) fn with_line_column(mut self, line_column: Option<(usize, usize)>) -> Self {
        let small = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        self.line_column = line_column.map(|(line, column)| (small(line), small(column)));
        self
    }

    /// The file the policy came from (`<policy>` when it was given as a string without origin).
    pub fn file(&self) -> &str {
        &self.file
    }

    /// What kind of problem this is: reading, size, syntax, an invalid value, or too many
    /// plans.
    pub fn kind(&self) -> PolicyErrorKind {
        match self.kind {
            Kind::Read => PolicyErrorKind::Read,
            Kind::TooLarge => PolicyErrorKind::TooLarge {
                limit: super::MAX_POLICY_BYTES,
            },
            Kind::Syntax => PolicyErrorKind::Syntax,
            Kind::Invalid => PolicyErrorKind::Invalid,
            Kind::TooManyPlans(count) => PolicyErrorKind::TooManyPlans {
                count: count as usize,
                limit: super::MAX_PLANS,
            },
        }
    }

    /// The plan the error is about: the plan being defined where the error is, or the unknown
    /// plan a reference names. `None` when no plan is involved. A name longer than 64
    /// characters (never a valid one) is cut to 64 and ends in `…(N bytes)`.
    pub fn plan(&self) -> Option<&str> {
        self.plan.as_deref()
    }

    /// The JSON path of the offending value, dotted: `plans.standard.capacity`,
    /// `routes[1].entity.header`. Names that are not plain words are written in brackets:
    /// `plans["v1.2"].capacity`. `None` when the error is about the whole file.
    pub fn field(&self) -> Option<&str> {
        self.field.as_deref()
    }

    /// One-based line and column of syntax and type errors, as serde_json reports them (column
    /// 0 means the error is at the start of the line, e.g. at end of file).
    pub fn line_column(&self) -> Option<(usize, usize)> {
        self.line_column
            .map(|(line, column)| (line as usize, column as usize))
    }

    /// What is wrong, without the file, position and field.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.file)?;
        if let Some((line, column)) = self.line_column {
            write!(f, ":{line}:{column}")?;
        }
        f.write_str(": ")?;
        if let Some(field) = &self.field {
            write!(f, "{field}: ")?;
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for PolicyError {}

/// A route in the policy file that the HTTP layer cannot use (`tokenlease::http`).
///
/// Defined here, beside [`PolicyError`], so that [`ReloadError`](crate::ReloadError) can carry it
/// without the limiter depending on the HTTP layer; re-exported there.
#[cfg(feature = "http")]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RouteConfigError {
    /// A route names a plan the policy file does not define.
    #[error("route {endpoint}: unknown plan {plan:?}")]
    UnknownPlan {
        /// The route's endpoint, `METHOD:pattern`.
        endpoint: String,
        /// The plan name.
        plan: String,
    },
    /// A route's entity header is not a valid header name.
    #[error("route {endpoint}: {header:?} is not a valid header name")]
    InvalidHeader {
        /// The route's endpoint, `METHOD:pattern`.
        endpoint: String,
        /// The header name as written.
        header: String,
    },
    /// A route pattern given to [`RouteLimitLayer::route_pattern`](crate::http::RouteLimitLayer::route_pattern) is not an axum 0.8 pattern
    /// (for example the older `:id` syntax): it would never match as meant, and the route
    /// would go unlimited.
    #[error("route pattern {pattern:?} is not an axum 0.8 route pattern: {reason}")]
    InvalidPattern {
        /// The pattern as given (its first 100 characters).
        pattern: String,
        /// What is wrong with it, and how to write it.
        reason: String,
    },
    /// A budget name given to [`RouteLimitLayer::entity_budget`](crate::http::RouteLimitLayer::entity_budget) is not 1 to 64 of
    /// `A-Z a-z 0-9 _ . -`.
    #[error("budget name {budget:?}: use 1 to 64 of A-Z a-z 0-9 _ . -")]
    InvalidBudget {
        /// The name as given (its first 100 characters).
        budget: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_cut_with_their_length() {
        assert_eq!(shorten("abc"), "abc");
        let long = "é".repeat(100);
        assert_eq!(shorten(&long), format!("{}…(200 bytes)", "é".repeat(64)));
        assert_eq!(quote("a\"b"), r#""a\"b""#);
        assert_eq!(
            quote(&"x".repeat(65)),
            format!("\"{}\"…(65 bytes)", "x".repeat(64))
        );
        assert_eq!(number(1e308), "1e308");
        assert_eq!(number(1e-300), "1e-300");
        assert_eq!(number(0.0000000001), "0.0000000001");
        assert_eq!(number(2e9), "2000000000");
    }

    #[test]
    fn quoted_spans_are_cut() {
        let long = "y".repeat(1000);
        let message = format!("invalid type: string \"{long}\", expected u64");
        assert_eq!(
            shorten_quoted(&message),
            format!(
                "invalid type: string \"{}\"…(1000 bytes), expected u64",
                "y".repeat(64)
            )
        );
        let message = format!("unknown field `{long}`, expected `a` or `b`");
        assert_eq!(
            shorten_quoted(&message),
            format!(
                "unknown field `{}`…(1000 bytes), expected `a` or `b`",
                "y".repeat(64)
            )
        );
        assert_eq!(shorten_quoted(r#"a "b\"c" d"#), r#"a "b\"c" d"#);
        assert_eq!(shorten_quoted("unclosed `abc"), "unclosed `abc");
        let huge = PolicyError::new("f", "z".repeat(100_000));
        assert!(huge.message().len() < MAX_MESSAGE + 32);
        assert!(huge.message().ends_with("…(100000 bytes)"));
    }
}
