//! TODO: schedule (being written)
