//! The limiter.
/// Placeholder.
#[derive(Debug)]
pub struct Limiter;
/// Placeholder.
#[derive(Debug)]
pub struct Decision;
/// Placeholder.
#[derive(Debug)]
pub enum DecidedBy {}
