//! TODO: rewrite (being written)
