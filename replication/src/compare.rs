//! TODO: compare (being written)
