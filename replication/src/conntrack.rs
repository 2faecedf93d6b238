//! TODO: conntrack (being written)
