//! [`Policies`]: reading, checking and looking up a policy file.

use std::fmt::Write as _;
use std::io::Read as _;
use std::path::Path;
use std::sync::Arc;

use serde_path_to_error::Segment;

use super::MAX_POLICY_BYTES;
use super::check::Checker;
use super::error::{Kind, PolicyError, push_key, shorten, shorten_quoted};
use super::raw::{Obj, RawPolicies};
use super::types::{FieldsOn, KeyRule, Plan, Policies, Route};

/// The name used in errors for a policy given as a string without a file.
pub(super) const NO_ORIGIN: &str = "<policy>";

/// # Loading
impl Policies {
    /// Reads and checks the policy file at `path`.
    ///
    /// # Errors
    ///
    /// A [`PolicyError`] naming the file when it cannot be read, is not UTF-8, or is not a valid
    /// policy (see [`from_json_str`](Self::from_json_str)).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Policies, PolicyError> {
        let path = path.as_ref();
        let file = path.display().to_string();
        let cannot = |e: std::io::Error| {
            PolicyError::new(&file, format!("cannot read the file: {}", lower(&e)))
                .with_kind(Kind::Read)
        };
        let mut reader = std::fs::File::open(path).map_err(cannot)?;
        // The size from the metadata refuses a large file without reading it; reading at most
        // one byte past the limit also catches files that grow or report no size (a pipe).
        let size = reader.metadata().map_err(cannot)?.len();
        if size > MAX_POLICY_BYTES {
            return Err(too_large(&file, Some(size)));
        }
        let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
        (&mut reader)
            .take(MAX_POLICY_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(cannot)?;
        if bytes.len() as u64 > MAX_POLICY_BYTES {
            return Err(too_large(&file, None));
        }
        let text = std::str::from_utf8(&bytes).map_err(|e| {
            let offset = e.valid_up_to();
            PolicyError::new(&file, format!("not valid UTF-8 at byte offset {offset}"))
                .with_line_column(Some(line_column(&bytes, offset)))
                .with_kind(Kind::Read)
        })?;
        Self::from_json_str(text, Some(path))
    }

    /// Parses and checks a policy given as JSON text. `origin` names the file in errors;
    /// `<policy>` when `None`. A leading byte-order mark is ignored.
    ///
    /// Loading takes time linear in the size of the text, which may be at most
    /// [`MAX_POLICY_BYTES`].
    ///
    /// # Errors
    ///
    /// The first problem found, as one [`PolicyError`]: a text over [`MAX_POLICY_BYTES`],
    /// malformed JSON, trailing characters, a wrong type or an unknown field (with line and
    /// column), or a value that is out of range or names a plan that does not exist (see the
    /// [module docs](super) for the full list).
    pub fn from_json_str(json: &str, origin: Option<&Path>) -> Result<Policies, PolicyError> {
        let file = match origin {
            Some(path) => path.display().to_string(),
            None => NO_ORIGIN.to_owned(),
        };
        if json.len() as u64 > MAX_POLICY_BYTES {
            return Err(too_large(&file, Some(json.len() as u64)));
        }
        let json = json.strip_prefix('\u{feff}').unwrap_or(json);
        let mut de = serde_json::Deserializer::from_str(json);
        let Obj(raw) =
            serde_path_to_error::deserialize::<_, Obj<RawPolicies>>(&mut de).map_err(|e| {
                let (field, plan) = path_of(e.path());
                let err = json_error(&file, e.inner()).with_field(field);
                match plan {
                    Some(plan) => err.with_plan(&plan),
                    None => err,
                }
            })?;
        de.end().map_err(|e| json_error(&file, &e))?;
        Checker { file }.check(raw)
    }
}

/// # Lookups
impl Policies {
    /// The plan called `name`.
    pub fn plan(&self, name: &str) -> Option<&Arc<Plan>> {
        self.by_name.get(name).map(|&i| &self.plans[i])
    }

    /// The plan for a store key: the rule with the longest prefix of `key`, else the default
    /// plan, else `None`.
    pub fn plan_for_key(&self, key: &str) -> Option<&Arc<Plan>> {
        self.plan_index_for_key(key).map(|i| &self.plans[i])
    }

    /// The index among [`plans`](Self::plans) of the plan for `key`, as
    /// [`plan_for_key`](Self::plan_for_key) chooses it.
    pub(crate) fn plan_index_for_key(&self, key: &str) -> Option<usize> {
        self.keys
            .iter()
            .position(|rule| key.starts_with(rule.prefix.as_str()))
            .map(|i| self.key_plans[i])
            .or(self.default_plan)
    }

    /// Replaces each plan with `f`'s: a limiter shares one `Arc` per distinct plan across
    /// reloads. `f` must return a plan equal to the one it is given.
    pub(crate) fn intern_plans(&mut self, mut f: impl FnMut(&Arc<Plan>) -> Arc<Plan>) {
        for plan in &mut self.plans {
            let interned = f(plan);
            debug_assert!(*interned == **plan);
            *plan = interned;
        }
    }

    /// The default plan (`default_plan` in the file), if any.
    pub fn default_plan(&self) -> Option<&Arc<Plan>> {
        self.default_plan.map(|i| &self.plans[i])
    }

    /// All plans, in file order.
    pub fn plans(&self) -> impl Iterator<Item = &Arc<Plan>> {
        self.plans.iter()
    }

    /// The key prefix rules, longest prefix first.
    pub fn key_rules(&self) -> &[KeyRule] {
        &self.keys
    }

    /// The HTTP routes, in file order.
    pub fn routes(&self) -> &[Route] {
        &self.routes
    }

    /// Whether the HTTP layer also writes the legacy `X-RateLimit-{Name}-Remaining` field of
    /// each limit (file field `x_ratelimit_remaining`, `false` unless given); `RateLimit` carries
    /// the same counts.
    pub fn x_ratelimit_remaining(&self) -> bool {
        self.x_ratelimit_remaining
    }

    /// Which responses the HTTP layer writes its header fields on (file field `fields_on`,
    /// [`FieldsOn::EveryResponse`] unless given).
    pub fn fields_on(&self) -> FieldsOn {
        self.fields_on
    }

    /// One line for humans: `policy.json: 3 plans, 2 routes, 1 key rule`.
    pub fn summary(&self) -> String {
        fn count(n: usize, one: &str) -> String {
            if n == 1 {
                format!("1 {one}")
            } else {
                format!("{n} {one}s")
            }
        }
        format!(
            "{}: {}, {}, {}",
            self.origin,
            count(self.plans.len(), "plan"),
            count(self.routes.len(), "route"),
            count(self.keys.len(), "key rule"),
        )
    }
}

/// The error for a policy over [`MAX_POLICY_BYTES`]; `size` when known.
pub(super) fn too_large(file: &str, size: Option<u64>) -> PolicyError {
    let size = match size {
        Some(size) => format!("{size} bytes"),
        None => "larger".to_owned(),
    };
    PolicyError::new(
        file,
        format!(
            "the policy is too large: {size}, more than the limit of {MAX_POLICY_BYTES} bytes \
             (16 MiB)"
        ),
    )
    .with_kind(Kind::TooLarge)
}

/// Turns a serde_json error into a [`PolicyError`] with line and column. The values serde
/// quotes (strings, field names, numbers) are cut to 64 characters.
pub(super) fn json_error(file: &str, err: &serde_json::Error) -> PolicyError {
    let (line, column) = (err.line(), err.column());
    let text = err.to_string();
    let suffix = format!(" at line {line} column {column}");
    let message = shorten_quoted(text.strip_suffix(&suffix).unwrap_or(&text));
    let message = match message.strip_prefix("EOF ") {
        Some(rest) => format!("end of file {rest}"),
        None => message.to_owned(),
    };
    // serde quotes unknown field names and strings as written; keep the message on one line.
    let message = if message.chars().any(char::is_control) {
        message
            .chars()
            .map(|c| {
                if c.is_control() {
                    c.escape_debug().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect()
    } else {
        message
    };
    PolicyError::new(file, message)
        .with_line_column((line > 0).then_some((line, column)))
        .with_kind(Kind::Syntax)
}

/// The dotted field path of a serde path, and the plan it is inside of, if any.
pub(super) fn path_of(path: &serde_path_to_error::Path) -> (String, Option<String>) {
    let mut field = String::new();
    let mut plan = None;
    for (i, segment) in path.iter().enumerate() {
        match segment {
            Segment::Seq { index } => {
                let _ = write!(field, "[{index}]");
            }
            Segment::Map { key } => {
                if i == 1 && field == "plans" {
                    plan = Some(shorten(key));
                }
                push_key(&mut field, key);
            }
            Segment::Enum { variant } => push_key(&mut field, variant),
            // A key that was never read (a syntax error where a key should be): the path so
            // far is the object the error is in.
            Segment::Unknown => break,
        }
    }
    (field, plan)
}

/// An error's text with its first letter in lower case (io errors start upper-case).
pub(super) fn lower(err: &dyn std::fmt::Display) -> String {
    let text = err.to_string();
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => text,
    }
}

/// One-based line and column of byte `offset`, counted as serde_json counts (bytes).
pub(super) fn line_column(bytes: &[u8], offset: usize) -> (usize, usize) {
    let before = &bytes[..offset.min(bytes.len())];
    let line = 1 + before.iter().filter(|&&b| b == b'\n').count();
    let column = match before.iter().rposition(|&b| b == b'\n') {
        Some(nl) => offset - nl,
        None => offset + 1,
    };
    (line, column)
}

#[cfg(test)]
mod tests;
