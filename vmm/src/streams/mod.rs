//! Streams: the connections migration and COLO carry their bytes on. An
//! address and the connected stream ([`endpoint`]), the rule for plain
//! TCP or TLS and the loaded identity ([`transport`]), mutually
//! authenticated TLS ([`tls`]) and the thread that pumps a TLS session
//! (`tls_pump`).
//!
//! A layer of its own under both `migrate` and `colo`: it knows nothing of
//! either (no page, no checkpoint, no VM), and runs on whatever thread
//! opens the stream, except a TLS session's pump thread. Never does:
//! import the VM core, `migrate` or `colo`.

pub mod endpoint;
pub mod tls;
mod tls_pump;
pub mod transport;

pub use endpoint::Endpoint;
pub use transport::Transport;
