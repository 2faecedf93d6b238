//! Dirty pages both ways between the pair: a side's bitmaps (one per
//! memory slot, as `GuestRam::dirty_pages` returns them) as the page spans
//! of a `Dirty` message, and spans ORed back into bitmaps.
//!
//! Pure; used by both sides' threads. Spans from the peer are checked
//! against the layout before they get here (`protocol::colo::check_spans`);
//! a page outside every slot is ignored, never indexed.

use migration::protocol::colo::{spans_of, Span};
use migration::protocol::PAGE_SIZE;

use crate::vstate::memory::DirtyBitmap;

/// The spans of the pages set in `bitmaps`.
pub fn spans(bitmaps: &[DirtyBitmap]) -> Vec<Span> {
    let mut all: Vec<&DirtyBitmap> = bitmaps.iter().collect();
    all.sort_by_key(|b| b.gpa);
    spans_of(all.into_iter().flat_map(|b| {
        b.addresses()
            .take_while(move |&gpa| gpa < b.gpa + b.pages * PAGE_SIZE)
    }))
}

/// Sets the bits of the pages of `spans` in `bitmaps`; returns how many
/// pages of the spans fell in a slot.
pub fn mark(bitmaps: &mut [DirtyBitmap], spans: &[Span]) -> u64 {
    let mut marked = 0;
    for s in spans {
        for i in 0..u64::from(s.pages) {
            let Some(gpa) = s.gpa.checked_add(i * PAGE_SIZE) else {
                break;
            };
            let slot = bitmaps
                .iter_mut()
                .find(|b| gpa >= b.gpa && gpa < b.gpa + b.pages * PAGE_SIZE);
            if let Some(b) = slot {
                let page = (gpa - b.gpa) / PAGE_SIZE;
                if let Some(word) = b.bits.get_mut((page / 64) as usize) {
                    *word |= 1 << (page % 64);
                    marked += 1;
                }
            }
        }
    }
    marked
}

/// [`mark`], but for the pages set in `except` (same layout); returns how
/// many pages of the spans fell in a slot, those skipped included.
pub fn mark_except(bitmaps: &mut [DirtyBitmap], spans: &[Span], except: &[DirtyBitmap]) -> u64 {
    let mut theirs: Vec<DirtyBitmap> = bitmaps
        .iter()
        .map(|b| DirtyBitmap {
            bits: vec![0; b.bits.len()],
            ..*b
        })
        .collect();
    let marked = mark(&mut theirs, spans);
    for (t, e) in theirs.iter_mut().zip(except) {
        for (w, x) in t.bits.iter_mut().zip(&e.bits) {
            *w &= !x;
        }
    }
    or(bitmaps, &theirs);
    marked
}

/// Clears every bit.
pub fn clear(bitmaps: &mut [DirtyBitmap]) {
    for b in bitmaps {
        b.bits.iter_mut().for_each(|w| *w = 0);
    }
}

/// ORs `from` into `into`, slot by slot (the same layout).
pub fn or(into: &mut [DirtyBitmap], from: &[DirtyBitmap]) {
    for (a, b) in into.iter_mut().zip(from) {
        crate::vstate::memory::or_into(&mut a.bits, &b.bits);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_slots() -> Vec<DirtyBitmap> {
        vec![
            DirtyBitmap {
                slot: 0,
                gpa: 0,
                pages: 100,
                bits: vec![0; 2],
            },
            DirtyBitmap {
                slot: 1,
                gpa: 1 << 32,
                pages: 64,
                bits: vec![0; 1],
            },
        ]
    }

    #[test]
    fn spans_and_marks_round_trip() {
        let mut a = two_slots();
        let spans_in = [
            Span {
                gpa: 62 * PAGE_SIZE,
                pages: 4,
            },
            Span {
                gpa: (1 << 32) + PAGE_SIZE,
                pages: 1,
            },
        ];
        assert_eq!(mark(&mut a, &spans_in), 5);
        assert_eq!(spans(&a), spans_in.to_vec());
        let mut b = two_slots();
        or(&mut b, &a);
        assert_eq!(spans(&b), spans_in.to_vec());
        clear(&mut b);
        assert!(spans(&b).is_empty());
    }

    #[test]
    fn pages_sent_ahead_are_not_marked_again() {
        let mut a = two_slots();
        let mut ahead = two_slots();
        ahead[0].bits[0] = 0b0110;
        let theirs = [Span { gpa: 0, pages: 4 }];
        assert_eq!(mark_except(&mut a, &theirs, &ahead), 4);
        assert_eq!(a[0].bits[0], 0b1001);
        assert_eq!(a[1].bits[0], 0);
    }

    #[test]
    fn pages_outside_every_slot_are_ignored() {
        let mut a = two_slots();
        let outside = [
            Span {
                gpa: 99 * PAGE_SIZE,
                pages: 3,
            },
            Span {
                gpa: u64::MAX - PAGE_SIZE + 1,
                pages: 4,
            },
        ];
        assert_eq!(mark(&mut a, &outside), 1);
        assert_eq!(
            spans(&a),
            vec![Span {
                gpa: 99 * PAGE_SIZE,
                pages: 1
            }]
        );
    }
}
