//! Where buckets live: the [`Store`] contract and its implementations.
pub use self::error::StoreError;
mod error;
pub mod postgres;
