//! TODO: journal (being written)
