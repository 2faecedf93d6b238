//! TODO: failover (being written)
