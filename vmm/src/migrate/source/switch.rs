//! The migration thread's switch to post-copy (`--postcopy`,
//! `migrate-postcopy`): when the pre-copy rounds stop shrinking the dirty
//! set (or after `--postcopy-after-rounds`, or by hand), the guest is
//! paused, the pages the destination lacks are named, the state goes, and
//! after `Go` the destination runs the guest while this thread serves its
//! pages (`postcopy::serve`).
//!
//! Runs on the migration thread. Never does: resume the guest once `Go`
//! was sent (a failure after it loses the guest: neither side holds all of
//! it, and the report says so), or free the guest's memory before the
//! destination said it holds every page.

use std::sync::atomic::Ordering;
use std::time::Instant;

use migration::protocol::{self, Message};

use super::{Laps, Run, IO_TIMEOUT};
use crate::migrate::postcopy::serve::{self, Needed};
use crate::migrate::status::{DowntimeParts, Phase, PostcopyReport};
use crate::migrate::MigrateError;
use crate::streams::endpoint::Conn;
use crate::vstate::memory::DirtyBitmap;

impl Run<'_> {
    /// Whether the pre-copy gives way to post-copy at the look after
    /// `round` rounds, which found `bytes` dirty (the look before found
    /// `last_set`): asked by hand, or with `postcopy` after the rounds
    /// given, or once a round no longer shrank the set.
    pub(super) fn postcopy_now(&self, round: u32, bytes: u64, last_set: Option<u64>) -> bool {
        if self.switch.is_some_and(|s| s.load(Ordering::SeqCst)) {
            return true;
        }
        if !self.params.postcopy {
            return false;
        }
        if self
            .params
            .postcopy_after_rounds
            .is_some_and(|n| round >= n)
        {
            return true;
        }
        round >= 2 && last_set.is_some_and(|last| bytes >= last)
    }

    /// The switch, and the pages served until the destination holds all.
    pub(super) fn postcopy(
        &mut self,
        conn: &mut Conn,
        others: &mut [Conn],
        pending: Vec<DirtyBitmap>,
    ) -> Result<(), MigrateError> {
        let needed = self.switch_over(conn, others, pending)?;
        self.serve(conn, needed)
    }

    /// Pauses the guest, names the pages the destination lacks (the dirty
    /// log's last set with `pending`), sends the state and `Go`.
    fn switch_over(
        &mut self,
        conn: &mut Conn,
        others: &mut [Conn],
        pending: Vec<DirtyBitmap>,
    ) -> Result<Needed, MigrateError> {
        let mut parts = DowntimeParts::default();
        let mut laps = Laps(Instant::now());
        let last = self.pause_for_switch(&pending, &mut parts, &mut laps)?;
        // The other streams' shares are whole: the rest goes on this one.
        for c in others.iter_mut() {
            protocol::write_message(c, &Message::Commit)?;
        }
        let needed = Needed::new(last);
        for m in needed.messages() {
            protocol::write_message(conn, &m)?;
        }
        laps.lap(&mut parts.pages_ms);
        self.hand_over(conn, &mut parts, &mut laps)?;
        protocol::write_message(conn, &Message::Go)?;
        // From here the guest is the destination's, its missing pages ours.
        self.switched = true;
        self.downtime = self.paused_at.map(|t| t.elapsed());
        let needed_pages = needed.left();
        self.update(|s| {
            s.downtime_parts = Some(parts);
            s.phase = Phase::PostCopy;
            s.postcopy = Some(PostcopyReport {
                switched_at_round: s.round,
                needed_pages,
                source_kept_memory: true,
                ..Default::default()
            });
        });
        log::info!("switched to post-copy: the destination lacks {needed_pages} pages");
        Ok(needed)
    }

    /// Serves the destination's pages (requested first, the rest in the
    /// background within the bandwidth cap) until it holds every one.
    fn serve(&mut self, conn: &mut Conn, needed: Needed) -> Result<(), MigrateError> {
        let t = Instant::now();
        let total = needed.left();
        let layout = crate::boot::layout::ram_ranges(self.vm.manifest().mem_bytes);
        let cap = self
            .params
            .bandwidth_mib
            .map(|m| m as f64 * f64::from(1 << 20));
        let progress = |sent: u64, asked: u64| {
            self.update(|s| {
                if let Some(p) = &mut s.postcopy {
                    (p.sent_pages, p.requested_pages) = (sent, asked);
                }
            })
        };
        let ram = self.vm.ram();
        let served = serve::serve(ram, conn, needed, &layout, cap, IO_TIMEOUT, &progress)?;
        let st = served.stalls;
        let ms = |us: u64| us as f64 / 1000.0;
        self.update(|s| {
            if let Some(p) = &mut s.postcopy {
                p.sent_pages = total;
                p.requested_pages = served.requested;
                p.faults = st.faults;
                (p.fault_p50_ms, p.fault_p99_ms) = (ms(st.p50_us), ms(st.p99_us));
                p.fault_max_ms = ms(st.max_us);
                p.fetch_ms = t.elapsed().as_secs_f64() * 1000.0;
            }
        });
        Ok(())
    }
}
