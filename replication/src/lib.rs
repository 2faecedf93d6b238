//! COLO fault tolerance, the pure parts (../shared/design.md §6): no KVM,
//! no threads, no sockets of its own, except the etcd lease ([`etcd`]),
//! which owns one runtime thread and its connections to etcd. `vmm` owns
//! the threads, the VMs and the wire; it drives these types with frames,
//! times and events, and implements the traits they need. Every module is
//! unit-tested alone.
//!
//! The network side (the primary's compare thread):
//! - [`packet`]: a frame from a tap, parsed once (etherparse) into what
//!   the compare needs: TCP (connection, seq, ack, flags, payload), UDP,
//!   ICMP, or pass-through (ARP, anything unparseable).
//! - [`conntrack`]: connections keyed the same way both directions, with
//!   the secondary's sequence offset for each TCP connection.
//! - [`rewrite`]: rewriting a secondary TCP segment's sequence (and a
//!   client segment's ack towards the secondary) by that offset, with the
//!   checksum updated incrementally.
//! - [`compare`]: primary and secondary frames queued per connection and
//!   matched; a match releases primary frames, a mismatch or a frame held
//!   past the compare timeout asks for a checkpoint, a full queue drops
//!   and counts.
//! - [`histogram`]: latency histograms (power-of-two buckets of µs) for
//!   the hold times and the proxies' stages.
//! - [`survivor`]: the secondary's copy of the offsets (told by the
//!   primary with each mirrored client segment), so that it goes on
//!   rewriting once it serves.
//!
//! The control side (the VMM thread and the checkpoint thread):
//! - [`schedule`]: when the next checkpoint is due, and why.
//! - [`failover`]: roles, the pair's state, the heartbeat, and who may
//!   serve after a failure, decided by an [`arbiter`] (a lease), never
//!   guessed.
//! - [`arbiter`]: the lease trait, the gate a side's output passes, and
//!   the one-host lock-file lease.
//! - [`etcd`]: the lease across hosts, a key in etcd under a TTL lease.
//! - [`journal`]: the secondary's disk: the primary's writes journaled
//!   until a checkpoint commits, its own guest's writes in an overlay
//!   dropped at each checkpoint and merged at failover.
//!
//! Shared: `sync` (crate-private), the one lock helper, which takes over a
//! lock poisoned by a panicking holder.

pub mod arbiter;
pub mod compare;
pub mod conntrack;
pub mod etcd;
mod etcd_keepalive;
pub mod failover;
pub mod histogram;
pub mod journal;
pub mod packet;
pub mod rewrite;
pub mod schedule;
pub mod survivor;
mod sync;
