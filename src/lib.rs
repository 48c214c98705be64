//! onceflow facade.
pub use onceflow_core::*;
