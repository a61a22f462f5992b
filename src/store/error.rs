//! Store errors.

/// A store call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Placeholder.
    #[error("other: {0}")]
    Other(String),
}
