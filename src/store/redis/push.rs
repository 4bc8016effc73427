//! [`Push`]: what a connection listening for forgotten keys hears.

/// What a listening connection hears.
#[derive(Debug)]
pub(crate) enum Push {
    /// A message on the channel: the Redis name of a key forgotten.
    Message(Vec<u8>),
    /// The connection dropped.
    Disconnected,
    /// Anything else (the subscription's own confirmations).
    Other,
}
