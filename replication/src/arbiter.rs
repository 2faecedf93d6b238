//! TODO: arbiter (being written)
