//! Reading a sampled vCPU's kernel call chain out of guest memory: the
//! guest's own page tables translate each address (4- or 5-level paging,
//! 2 MiB and 1 GiB pages), and the chain follows the kernel's frame
//! pointers (`CONFIG_FRAME_POINTER`: `[rbp]` = caller's rbp, `[rbp+8]` =
//! return address), across the `pt_regs` frames the kernel marks with bit 0
//! of rbp at an interrupt or exception entry.
//!
//! Everything read here is guest-controlled and hostile: every translation
//! and read is checked, a chain never holds more than [`MAX_DEPTH`]
//! addresses, frames must move up the stack, and the first bad frame ends
//! the chain (never the VM). Pure logic over guest memory, run by the vCPU
//! thread that took the sample; it takes no lock.

use devices::GuestMemoryMmap;
use vm_memory::{Bytes, GuestAddress};

/// The most addresses one chain holds (the sampled IP included).
pub const MAX_DEPTH: usize = 64;
/// The most interrupt/exception frames (`pt_regs`) one chain crosses.
const MAX_REGS_FRAMES: usize = 4;
/// The farthest one frame may lie above the one before it on the same
/// stack (kernel stacks are 16 KiB; a larger hop is garbage).
const MAX_FRAME_HOP: u64 = 64 << 10;
/// `pt_regs` offsets: `bp` is the 5th slot, `ip` the 17th, `cs` the 18th.
const PT_REGS_BP: u64 = 4 * 8;
const PT_REGS_IP: u64 = 16 * 8;
const PT_REGS_CS: u64 = 17 * 8;

const PAGE_PRESENT: u64 = 1;
const PAGE_HUGE: u64 = 1 << 7;
const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
const CR0_PG: u64 = 1 << 31;
const CR4_LA57: u64 = 1 << 12;
const EFER_LMA: u64 = 1 << 10;

/// The paging state a translation needs (from the vCPU's special registers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Paging {
    pub cr0: u64,
    pub cr3: u64,
    pub cr4: u64,
    pub efer: u64,
}

impl Paging {
    /// Whether the vCPU runs with 64-bit paging (the only mode walked here).
    pub fn long_mode(&self) -> bool {
        self.cr0 & CR0_PG != 0 && self.efer & EFER_LMA != 0
    }

    fn levels(&self) -> u32 {
        if self.cr4 & CR4_LA57 != 0 {
            5
        } else {
            4
        }
    }
}

/// Translates the guest-virtual `va` to a guest-physical address through
/// the guest's page tables; `None` for anything not mapped, non-canonical,
/// outside guest memory, or a vCPU not in long mode.
pub fn translate(mem: &GuestMemoryMmap, paging: &Paging, va: u64) -> Option<u64> {
    if !paging.long_mode() {
        return None;
    }
    let levels = paging.levels();
    let bits = 12 + 9 * levels;
    // Canonical: the bits above the top index bit all equal it.
    let top = (va as i64) >> (bits - 1);
    if top != 0 && top != -1 {
        return None;
    }
    let mut table = paging.cr3 & ADDR_MASK;
    for level in (1..=levels).rev() {
        let shift = 12 + 9 * (level - 1);
        let index = (va >> shift) & 0x1ff;
        let entry: u64 = mem.read_obj(GuestAddress(table + index * 8)).ok()?;
        if entry & PAGE_PRESENT == 0 {
            return None;
        }
        // A huge page at the 1 GiB (level 3) or 2 MiB (level 2) level.
        if (level == 2 || level == 3) && entry & PAGE_HUGE != 0 {
            let size = 1u64 << shift;
            return Some((entry & ADDR_MASK & !(size - 1)) | (va & (size - 1)));
        }
        table = entry & ADDR_MASK;
    }
    Some(table | (va & 0xfff))
}

/// Reads an aligned 64-bit value at guest-virtual `va`.
fn read_u64(mem: &GuestMemoryMmap, paging: &Paging, va: u64) -> Option<u64> {
    if !va.is_multiple_of(8) {
        return None;
    }
    let pa = translate(mem, paging, va)?;
    mem.read_obj(GuestAddress(pa)).ok()
}

/// Reads the value `offset` bytes above guest-virtual `base`; none past the
/// top of the address space (the guest chose `base`).
fn read_at(mem: &GuestMemoryMmap, paging: &Paging, base: u64, offset: u64) -> Option<u64> {
    read_u64(mem, paging, base.checked_add(offset)?)
}

/// Whether `va` is in the upper (kernel) half of the address space.
fn kernel_half(va: u64) -> bool {
    va >> 63 == 1
}

/// Where a chain stopped, for the profiler's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChainEnd {
    /// rbp was 0, or the chain reached user mode: a complete chain.
    Complete,
    /// [`MAX_DEPTH`] reached.
    Depth,
    /// A frame that could not be followed (unmapped, misaligned, not above
    /// the last one, outside the kernel half...).
    BadFrame,
}

/// The call chain of a kernel-mode sample, leaf first: `rip`, then each
/// return address found by following `rbp`. `rsp` bounds the first frame.
pub fn kernel_chain(
    mem: &GuestMemoryMmap,
    paging: &Paging,
    rip: u64,
    rbp: u64,
    rsp: u64,
) -> (Vec<u64>, ChainEnd) {
    let mut chain = vec![rip];
    let mut fp = rbp;
    // The lowest address the next frame may have.
    let mut floor = rsp;
    let mut regs_frames = 0;
    while chain.len() < MAX_DEPTH {
        if fp == 0 {
            return (chain, ChainEnd::Complete);
        }
        if !kernel_half(fp) || fp < floor || fp - floor > MAX_FRAME_HOP {
            return (chain, ChainEnd::BadFrame);
        }
        if fp & 1 == 1 {
            // ENCODE_FRAME_POINTER: rbp = &pt_regs | 1 at an entry from an
            // interrupt or exception; the interrupted context goes on.
            regs_frames += 1;
            let regs = fp & !1;
            if regs_frames > MAX_REGS_FRAMES {
                return (chain, ChainEnd::BadFrame);
            }
            let (Some(ip), Some(bp), Some(cs)) = (
                read_at(mem, paging, regs, PT_REGS_IP),
                read_at(mem, paging, regs, PT_REGS_BP),
                read_at(mem, paging, regs, PT_REGS_CS),
            ) else {
                return (chain, ChainEnd::BadFrame);
            };
            if cs & 3 == 3 {
                // Entered from user mode: the kernel part ends here.
                return (chain, ChainEnd::Complete);
            }
            if !kernel_half(ip) {
                return (chain, ChainEnd::BadFrame);
            }
            chain.push(ip);
            // The interrupted code may run on another stack (an IRQ stack
            // is left here): the next frame starts its own climb.
            fp = bp;
            floor = bp;
            continue;
        }
        let (Some(next), Some(ret)) = (read_u64(mem, paging, fp), read_at(mem, paging, fp, 8))
        else {
            return (chain, ChainEnd::BadFrame);
        };
        if !kernel_half(ret) {
            return (chain, ChainEnd::BadFrame);
        }
        chain.push(ret);
        // The caller's frame must lie strictly above this one.
        floor = fp.saturating_add(16);
        fp = next;
    }
    (chain, ChainEnd::Depth)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guest memory with 4-level page tables mapping the kernel-half page
    /// `KBASE + i*4K` to physical `DATA + i*4K` for `i < PAGES`.
    const KBASE: u64 = 0xffff_c900_0000_0000;
    const PML4: u64 = 0x1000;
    const DATA: u64 = 0x10000;
    const PAGES: u64 = 8;

    fn mapped() -> (GuestMemoryMmap, Paging) {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let (pdpt, pd, pt) = (0x2000u64, 0x3000u64, 0x4000u64);
        let idx = |shift: u32| (KBASE >> shift) & 0x1ff;
        mem.write_obj(pdpt | 3, GuestAddress(PML4 + idx(39) * 8))
            .unwrap();
        mem.write_obj(pd | 3, GuestAddress(pdpt + idx(30) * 8))
            .unwrap();
        mem.write_obj(pt | 3, GuestAddress(pd + idx(21) * 8))
            .unwrap();
        for i in 0..PAGES {
            mem.write_obj((DATA + i * 4096) | 3, GuestAddress(pt + (idx(12) + i) * 8))
                .unwrap();
        }
        let paging = Paging {
            cr0: CR0_PG | 1,
            cr3: PML4,
            cr4: 0,
            efer: EFER_LMA | (1 << 8),
        };
        (mem, paging)
    }

    fn put(mem: &GuestMemoryMmap, va: u64, v: u64) {
        mem.write_obj(v, GuestAddress(DATA + (va - KBASE))).unwrap();
    }

    const TEXT: u64 = 0xffff_ffff_8100_0000;

    #[test]
    fn translates_small_and_huge_pages_and_refuses_the_rest() {
        let (mem, paging) = mapped();
        assert_eq!(translate(&mem, &paging, KBASE + 0x123), Some(DATA + 0x123));
        assert_eq!(
            translate(&mem, &paging, KBASE + 4096 * 3 + 8),
            Some(DATA + 4096 * 3 + 8)
        );
        assert_eq!(translate(&mem, &paging, KBASE + 4096 * PAGES), None);
        assert_eq!(translate(&mem, &paging, 0x0000_8000_0000_0000), None);
        let off = Paging { cr0: 0, ..paging };
        assert_eq!(translate(&mem, &off, KBASE), None, "paging off");
        // A 2 MiB page: a PD entry with PS set.
        let va = KBASE + (1 << 21);
        let pd = 0x3000u64;
        mem.write_obj(
            0x0020_0000u64 | 0x83,
            GuestAddress(pd + ((va >> 21) & 0x1ff) * 8),
        )
        .unwrap();
        assert_eq!(translate(&mem, &paging, va + 0x1234), Some(0x20_1234));
        // Page tables pointing outside guest memory.
        mem.write_obj(0xdead_0000_0000u64 | 3, GuestAddress(PML4))
            .unwrap();
        assert_eq!(translate(&mem, &paging, 0x1000), None);
    }

    #[test]
    fn follows_a_good_chain_to_its_end() {
        let (mem, paging) = mapped();
        let (f1, f2, f3) = (KBASE + 0x100, KBASE + 0x200, KBASE + 0x1300);
        put(&mem, f1, f2);
        put(&mem, f1 + 8, TEXT + 0x10);
        put(&mem, f2, f3);
        put(&mem, f2 + 8, TEXT + 0x20);
        put(&mem, f3, 0);
        put(&mem, f3 + 8, TEXT + 0x30);
        let (chain, end) = kernel_chain(&mem, &paging, TEXT + 1, f1, KBASE + 0x80);
        assert_eq!(chain, vec![TEXT + 1, TEXT + 0x10, TEXT + 0x20, TEXT + 0x30]);
        assert_eq!(end, ChainEnd::Complete);
    }

    #[test]
    fn hostile_frames_end_the_chain() {
        let (mem, paging) = mapped();
        let f = KBASE + 0x100;
        // A frame that points to itself: not above the last one.
        put(&mem, f, f);
        put(&mem, f + 8, TEXT);
        let (chain, end) = kernel_chain(&mem, &paging, TEXT, f, f);
        assert_eq!((chain.len(), end), (2, ChainEnd::BadFrame));
        // Two frames that point to each other.
        let g = KBASE + 0x200;
        put(&mem, f, g);
        put(&mem, g, f);
        put(&mem, g + 8, TEXT);
        let (chain, end) = kernel_chain(&mem, &paging, TEXT, f, f);
        assert_eq!((chain.len(), end), (3, ChainEnd::BadFrame));
        // Misaligned, unmapped, user-half and below-rsp frame pointers.
        for bad in [KBASE + 0x104, KBASE + 4096 * PAGES + 16, 0x7fff_0000_0000] {
            let (chain, end) = kernel_chain(&mem, &paging, TEXT, bad, KBASE);
            assert_eq!((chain.len(), end), (1, ChainEnd::BadFrame), "{bad:#x}");
        }
        let (_, end) = kernel_chain(&mem, &paging, TEXT, f, f + 8);
        assert_eq!(end, ChainEnd::BadFrame, "frame below rsp");
        // A frame whose next link lands far up the stack.
        put(&mem, f, f + MAX_FRAME_HOP + 64);
        let (chain, end) = kernel_chain(&mem, &paging, TEXT, f, f);
        assert_eq!((chain.len(), end), (2, ChainEnd::BadFrame));
        // A return address in the user half.
        put(&mem, f, 0);
        put(&mem, f + 8, 0x40_0000);
        let (chain, end) = kernel_chain(&mem, &paging, TEXT, f, f);
        assert_eq!((chain.len(), end), (1, ChainEnd::BadFrame));
    }

    #[test]
    fn frames_at_the_top_of_the_address_space_end_the_chain() {
        let (mem, paging) = mapped();
        for fp in [u64::MAX, u64::MAX - 7, u64::MAX - 15] {
            let (chain, end) = kernel_chain(&mem, &paging, TEXT, fp, KBASE);
            assert_eq!((chain, end), (vec![TEXT], ChainEnd::BadFrame), "{fp:#x}");
        }
    }

    #[test]
    fn a_long_chain_stops_at_the_depth_limit() {
        let (mem, paging) = mapped();
        // 100 frames, each 32 bytes above the last.
        let first = KBASE + 0x40;
        for i in 0..100u64 {
            let f = first + i * 32;
            put(&mem, f, f + 32);
            put(&mem, f + 8, TEXT + i);
        }
        let (chain, end) = kernel_chain(&mem, &paging, TEXT, first, first);
        assert_eq!((chain.len(), end), (MAX_DEPTH, ChainEnd::Depth));
    }

    #[test]
    fn crosses_interrupt_frames_and_stops_at_user_entry() {
        let (mem, paging) = mapped();
        // Interrupt handler frame -> pt_regs (kernel) -> interrupted frame.
        let (h, regs, inner) = (KBASE + 0x100, KBASE + 0x400, KBASE + 0x2000);
        put(&mem, h, regs | 1);
        put(&mem, h + 8, TEXT + 0x10);
        put(&mem, regs + PT_REGS_IP, TEXT + 0x500);
        put(&mem, regs + PT_REGS_BP, inner);
        put(&mem, regs + PT_REGS_CS, 0x10);
        put(&mem, inner, 0);
        put(&mem, inner + 8, TEXT + 0x600);
        let (chain, end) = kernel_chain(&mem, &paging, TEXT, h, h);
        assert_eq!(
            chain,
            vec![TEXT, TEXT + 0x10, TEXT + 0x500, TEXT + 0x600],
            "{chain:x?}"
        );
        assert_eq!(end, ChainEnd::Complete);
        // The same frame, entered from user mode: the chain ends there.
        put(&mem, regs + PT_REGS_CS, 0x33);
        let (chain, end) = kernel_chain(&mem, &paging, TEXT, h, h);
        assert_eq!((chain.len(), end), (2, ChainEnd::Complete));
        // pt_regs frames that lead to themselves stop after a few.
        put(&mem, regs + PT_REGS_CS, 0x10);
        put(&mem, regs + PT_REGS_BP, regs | 1);
        let (chain, end) = kernel_chain(&mem, &paging, TEXT, regs | 1, regs);
        assert_eq!(end, ChainEnd::BadFrame);
        assert!(chain.len() <= MAX_REGS_FRAMES + 1);
    }
}
