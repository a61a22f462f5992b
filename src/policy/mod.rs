//! Policy file.
