//! [`PolicyError`]: why a policy file was refused.

use std::fmt;

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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError {
    /// The file as given to [`Policies::from_file`](super::Policies::from_file), or `<policy>`.
    file: String,
    /// The plan the error is about: the one being defined, or the unknown one referenced.
    plan: Option<String>,
    /// The JSON path of the offending value, e.g. `plans.standard.capacity` or `routes[0].path`.
    field: Option<String>,
    /// One-based line and column from serde_json, for syntax and type errors.
    line_column: Option<(usize, usize)>,
    /// What is wrong, lower-case, without file or field.
    message: String,
}

impl PolicyError {
    pub(crate) fn new(file: &str, message: impl Into<String>) -> Self {
        PolicyError {
            file: file.to_owned(),
            plan: None,
            field: None,
            line_column: None,
            message: message.into(),
        }
    }

    pub(crate) fn with_field(mut self, field: impl Into<String>) -> Self {
        let field = field.into();
        self.field = (!field.is_empty()).then_some(field);
        self
    }

    pub(crate) fn with_plan(mut self, plan: impl Into<String>) -> Self {
        self.plan = Some(plan.into());
        self
    }

    pub(crate) fn with_line_column(mut self, line_column: Option<(usize, usize)>) -> Self {
        self.line_column = line_column;
        self
    }

    /// The file the policy came from (`<policy>` when it was given as a string without origin).
    pub fn file(&self) -> &str {
        &self.file
    }

    /// The plan the error is about: the plan being defined where the error is, or the unknown
    /// plan a reference names. `None` when no plan is involved.
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
