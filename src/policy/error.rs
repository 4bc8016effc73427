use std::fmt;

/// A configuration mistake, found when the layer is built. The message says what to change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    message: String,
}

impl ConfigError {
    pub(crate) fn new(message: impl Into<String>) -> Self {
        ConfigError {
            message: message.into(),
        }
    }

    pub(crate) fn in_rule(rule: &str, problem: impl fmt::Display) -> Self {
        ConfigError::new(format!("rule \"{rule}\": {problem}"))
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tollgate configuration: {}", self.message)
    }
}

impl std::error::Error for ConfigError {}
