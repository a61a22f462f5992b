//! The `tokenlease` command.
fn main() {}
