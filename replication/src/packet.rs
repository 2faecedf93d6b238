//! TODO: packet (being written)
