//! Post-copy (`--postcopy`, `migrate-postcopy`): the guest switches to the
//! destination before all of its memory is there, and the destination
//! fetches what it lacks on demand, so that any workload ends in bounded
//! time.
//!
//! - [`serve`]: the source's side, after `Go`: the pages the destination
//!   lacks, requested ones first, the rest in the background.
//! - [`fetch`]: the destination's side: guest RAM under a userfaultfd; a
//!   fault on a missing page asks the source for it and waits.
//!
//! The switch itself is the migration thread's (`source::switch`); the
//! messages (`Postcopy`, `PageRequest`, `Done`) are
//! `migration::protocol::postcopy`'s. Once post-copy starts, neither side
//! alone holds the guest: a broken link loses it, and both sides say so.

pub mod fetch;
pub mod serve;
