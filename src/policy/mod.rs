//! What is limited and how much: [`Quota`], [`Rule`], [`Cost`], [`FailureMode`] (re-exported at
//! the crate root).

mod cost;
mod failure;
mod quota;
mod rule;

pub use cost::Cost;
pub use failure::FailureMode;
pub use quota::Quota;
pub use rule::Rule;

pub(crate) use rule::CompiledRule;
