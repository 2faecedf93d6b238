//! Guest RAM: its mappings, the KVM memory slots that expose them to the
//! guest, and the dirty log that migration and COLO read.
//!
//! Two sources say which pages changed, and [`GuestRam::dirty_pages`] ORs
//! them, slot by slot:
//! - KVM's dirty log (`KVM_GET_DIRTY_LOG`): the pages the vCPUs wrote, once
//!   [`GuestRam::start_dirty_log`] has re-registered every slot with
//!   `KVM_MEM_LOG_DIRTY_PAGES`. Where KVM offers
//!   `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2` (this host does) reading does not
//!   reset the log: [`GuestRam::clear_dirty`] resets a range and
//!   write-protects it again, so a caller clears a range just before it
//!   copies it, and a write after the copy is seen in the next round.
//!   Where KVM also offers `KVM_DIRTY_LOG_INITIALLY_SET`,
//!   [`GuestRam::start_dirty_log_all_dirty`] starts the log with every
//!   page dirty and nothing write-protected: the stall of protecting all
//!   of memory at once (milliseconds per GiB, vCPUs included) becomes a
//!   clear per chunk, spread over the first copy.
//! - the device bitmap of each region (`AtomicBitmap`): the pages a device
//!   wrote through vm-memory (RX buffers, used rings, disk reads), which
//!   KVM never sees. Reading it resets it.
//!
//! Shared (`Arc`) by the VMM thread, the migration and COLO threads: every
//! method takes `&self`; only the logging flag and the slot flags change, under
//! one lock, and nothing here ever blocks a vCPU (KVM's log is read by ioctl
//! while the guest runs).

use std::sync::Mutex;

use kvm_bindings::{
    kvm_clear_dirty_log, kvm_enable_cap, kvm_userspace_memory_region, KVMIO,
    KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2, KVM_DIRTY_LOG_INITIALLY_SET,
    KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE, KVM_MEM_LOG_DIRTY_PAGES,
};
use kvm_ioctls::VmFd;
use std::sync::Arc;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::ioctl::ioctl_with_ref;
use vmm_sys_util::ioctl_iowr_nr;

use crate::boot::layout;
use crate::kvm_util::{kvm_op, KvmOp};
use devices::GuestMemoryMmap;

/// Bytes per page of the dirty log.
pub const PAGE_SIZE: u64 = 4096;

ioctl_iowr_nr!(KVM_CLEAR_DIRTY_LOG, KVMIO, 0xc0, kvm_clear_dirty_log);

/// Guest-memory errors.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("cannot allocate {mib} MiB of guest memory: {source}")]
    Allocate {
        mib: u64,
        source: vm_memory::mmap::FromRangesError,
    },
    #[error("guest memory: {0}")]
    Access(#[from] vm_memory::GuestMemoryError),
    #[error(transparent)]
    Kvm(#[from] KvmOp),
    #[error("slot {0} is not a slot of this VM")]
    NoSlot(u32),
    #[error("pages {first}..{end} are outside slot {slot} ({pages} pages)")]
    Range {
        slot: u32,
        first: u64,
        end: u64,
        pages: u64,
    },
}

/// One KVM memory slot: a region of guest RAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub id: u32,
    pub gpa: u64,
    pub bytes: u64,
    host: u64,
}

impl Slot {
    /// Pages in the slot.
    pub fn pages(&self) -> u64 {
        self.bytes.div_ceil(PAGE_SIZE)
    }
}

/// The dirty pages of one slot: bit `i` of `bits` (64 pages per word, low
/// bit first) is page `i`, at `gpa + i * PAGE_SIZE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirtyBitmap {
    pub slot: u32,
    pub gpa: u64,
    pub pages: u64,
    pub bits: Vec<u64>,
}

impl DirtyBitmap {
    /// How many pages are dirty.
    pub fn count(&self) -> u64 {
        count_bits(&self.bits)
    }

    /// The guest addresses of the dirty pages.
    pub fn addresses(&self) -> impl Iterator<Item = u64> + '_ {
        self.bits.iter().enumerate().flat_map(move |(w, &word)| {
            (0..64)
                .filter(move |b| word & (1 << b) != 0)
                .map(move |b| self.gpa + (w as u64 * 64 + b) * PAGE_SIZE)
        })
    }
}

/// One slot's dirty pages as each source saw them (same layout as
/// [`DirtyBitmap::bits`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotDirty {
    pub slot: Slot,
    /// Written by the vCPUs (KVM's log).
    pub kvm: Vec<u64>,
    /// Written by device emulation (vm-memory's bitmap).
    pub device: Vec<u64>,
}

impl SlotDirty {
    /// The pages either source saw.
    pub fn union(self) -> DirtyBitmap {
        let mut bits = self.kvm;
        or_into(&mut bits, &self.device);
        DirtyBitmap {
            slot: self.slot.id,
            gpa: self.slot.gpa,
            pages: self.slot.pages(),
            bits,
        }
    }
}

/// Set bits in a bitmap.
pub fn count_bits(bits: &[u64]) -> u64 {
    bits.iter().map(|w| u64::from(w.count_ones())).sum()
}

/// ORs `b` into `a` (the same slot's two sources), word by word.
pub fn or_into(a: &mut [u64], b: &[u64]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x |= y;
    }
}

/// What the dirty log is doing.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct LogState {
    on: bool,
    /// KVM keeps bits until `KVM_CLEAR_DIRTY_LOG` (manual protect).
    manual: bool,
    /// The log started with every page dirty and none write-protected
    /// (`KVM_DIRTY_LOG_INITIALLY_SET`): each page is protected when its
    /// range is first cleared.
    all_dirty: bool,
}

/// Guest RAM of one VM, registered with KVM.
pub struct GuestRam {
    mem: GuestMemoryMmap,
    slots: Vec<Slot>,
    vm: Arc<VmFd>,
    log: Mutex<LogState>,
}

impl GuestRam {
    /// Maps `size` bytes of guest RAM (below the MMIO gap, the rest above
    /// 4 GiB) and registers one KVM slot per region.
    pub fn new(vm: Arc<VmFd>, size: u64) -> Result<GuestRam, MemoryError> {
        let ranges: Vec<(GuestAddress, usize)> = layout::ram_ranges(size)
            .into_iter()
            .map(|(b, l)| (GuestAddress(b), l as usize))
            .collect();
        let mem =
            GuestMemoryMmap::from_ranges(&ranges).map_err(|source| MemoryError::Allocate {
                mib: size >> 20,
                source,
            })?;
        let mut slots = Vec::new();
        for (id, region) in mem.iter().enumerate() {
            let host = mem.get_host_address(region.start_addr())? as u64;
            slots.push(Slot {
                id: id as u32,
                gpa: region.start_addr().raw_value(),
                bytes: region.len(),
                host,
            });
        }
        let ram = GuestRam {
            mem,
            slots,
            vm,
            log: Mutex::new(LogState::default()),
        };
        for s in &ram.slots {
            ram.register(s, 0)?;
        }
        Ok(ram)
    }

    /// The memory, for devices and loaders (clones share the mappings).
    pub fn mem(&self) -> &GuestMemoryMmap {
        &self.mem
    }

    /// The KVM slots, in address order.
    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// Bytes of guest RAM.
    pub fn bytes(&self) -> u64 {
        self.slots.iter().map(|s| s.bytes).sum()
    }

    fn register(&self, s: &Slot, flags: u32) -> Result<(), KvmOp> {
        let r = kvm_userspace_memory_region {
            slot: s.id,
            flags,
            guest_phys_addr: s.gpa,
            memory_size: s.bytes,
            userspace_addr: s.host,
        };
        // SAFETY: the range is a live mapping owned by `self.mem`, which
        // lives as long as the VM (the slot is re-registered, never moved,
        // and the mapping is only dropped with the VM), and no other slot
        // aliases it.
        unsafe { self.vm.set_user_memory_region(r) }.map_err(kvm_op("register guest memory"))
    }

    /// Makes KVM forget every mapping it derived from guest memory (its
    /// shadow or nested page tables): each slot is deleted and registered
    /// again. Needed when the VMM has rewritten memory under a VM that has
    /// run (a revert, a COLO checkpoint): KVM does not see writes through
    /// the VMM's own mapping, and a vCPU would go on through page tables
    /// that are no longer in memory. The VM must be paused. A dirty log
    /// that is on stays on, from clean.
    pub fn forget_mappings(&self) -> Result<(), MemoryError> {
        let log = devices::sync::lock(&self.log);
        let flags = if log.on { KVM_MEM_LOG_DIRTY_PAGES } else { 0 };
        for s in &self.slots {
            let gone = Slot { bytes: 0, ..*s };
            self.register(&gone, 0)?;
            self.register(s, flags)?;
        }
        Ok(())
    }

    /// Whether the dirty log is on.
    pub fn logging(&self) -> bool {
        devices::sync::lock(&self.log).on
    }

    /// Turns the dirty log on: every slot is re-registered with
    /// `KVM_MEM_LOG_DIRTY_PAGES` (with manual protect where KVM offers it),
    /// and the device bitmaps start from empty. Every page counts as clean
    /// from here: the caller copies all of memory once first.
    pub fn start_dirty_log(&self) -> Result<(), MemoryError> {
        self.start_log(false).map(drop)
    }

    /// [`Self::start_dirty_log`] with KVM's log starting all dirty where
    /// KVM offers it (see the module doc): nothing is write-protected now,
    /// and every page reads dirty until its range is cleared. The caller
    /// clears each range ([`Self::clear_dirty`]) just before its first
    /// copy. Returns whether the log started so; if not, it started as
    /// [`Self::start_dirty_log`] does (all protected, all clean).
    pub fn start_dirty_log_all_dirty(&self) -> Result<bool, MemoryError> {
        self.start_log(true)
    }

    /// Whether the running log started all dirty.
    pub fn log_started_all_dirty(&self) -> bool {
        devices::sync::lock(&self.log).all_dirty
    }

    fn start_log(&self, want_all_dirty: bool) -> Result<bool, MemoryError> {
        let mut log = devices::sync::lock(&self.log);
        if log.on {
            return Ok(log.all_dirty);
        }
        let offered = self
            .vm
            .check_extension_raw(u64::from(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2));
        let manual = offered & KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE as i32 != 0;
        let all_dirty =
            want_all_dirty && manual && offered & KVM_DIRTY_LOG_INITIALLY_SET as i32 != 0;
        if manual {
            let mut flags = u64::from(KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE);
            if all_dirty {
                flags |= u64::from(KVM_DIRTY_LOG_INITIALLY_SET);
            }
            let cap = kvm_enable_cap {
                cap: KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
                args: [flags, 0, 0, 0],
                ..Default::default()
            };
            // KVM refuses the cap once a slot logs: enable it before.
            self.vm
                .enable_cap(&cap)
                .map_err(kvm_op("enable manual dirty-log protection"))?;
        }
        for s in &self.slots {
            self.register(s, KVM_MEM_LOG_DIRTY_PAGES)?;
        }
        for region in self.mem.iter() {
            vm_memory::MmapRegion::bitmap(region).reset();
        }
        *log = LogState {
            on: true,
            manual,
            all_dirty,
        };
        Ok(all_dirty)
    }

    /// Turns the dirty log off again (slots registered without logging).
    pub fn stop_dirty_log(&self) -> Result<(), MemoryError> {
        let mut log = devices::sync::lock(&self.log);
        if !log.on {
            return Ok(());
        }
        for s in &self.slots {
            self.register(s, 0)?;
        }
        log.on = false;
        Ok(())
    }

    /// The pages written since the log started or since they were last
    /// cleared (KVM) / read (devices), one bitmap per slot: KVM's log OR the
    /// device bitmap. Only device writes when the log is off.
    pub fn dirty_pages(&self) -> Result<Vec<DirtyBitmap>, MemoryError> {
        Ok(self.harvest()?.into_iter().map(SlotDirty::union).collect())
    }

    /// [`Self::dirty_pages`] with the two sources apart (for reports).
    pub fn harvest(&self) -> Result<Vec<SlotDirty>, MemoryError> {
        let log = *devices::sync::lock(&self.log);
        let mut out = Vec::with_capacity(self.slots.len());
        for (s, region) in self.slots.iter().zip(self.mem.iter()) {
            let words = s.pages().div_ceil(64) as usize;
            let mut kvm = if log.on {
                self.vm
                    .get_dirty_log(s.id, s.bytes as usize)
                    .map_err(kvm_op("read the dirty log"))?
            } else {
                vec![0; words]
            };
            kvm.resize(words, 0);
            let mut device = vm_memory::MmapRegion::bitmap(region).get_and_reset();
            device.resize(words, 0);
            out.push(SlotDirty {
                slot: *s,
                kvm,
                device,
            });
        }
        Ok(out)
    }

    /// [`Self::clear_dirty`] of every page of every slot.
    pub fn clear_all(&self) -> Result<(), MemoryError> {
        for s in &self.slots {
            self.clear_dirty(s.id, 0, s.pages())?;
        }
        Ok(())
    }

    /// Resets KVM's log for pages `first..first+count` of `slot` and
    /// write-protects them again, so that the next write is seen. Call it
    /// just before copying those pages. Without manual protection (KVM
    /// resets on read) there is nothing to do.
    pub fn clear_dirty(&self, slot: u32, first: u64, count: u64) -> Result<(), MemoryError> {
        let s = self.slot(slot)?;
        let range = clear_range(&s, first, count)?;
        let mut bitmap = vec![u64::MAX; (range.1 as usize).div_ceil(64)];
        self.clear_bits(slot, range, &mut bitmap)
    }

    /// Resets KVM's log (and write-protects again) only the pages whose
    /// bits are set in `mask`: bit `i` of `mask` is page `first + i` of
    /// `slot`, `first` a multiple of 64. What a migration round does just
    /// before it copies the pages of its own bitmap, so that a page written
    /// since that bitmap was read, and not in it, stays dirty in KVM's log.
    pub fn clear_dirty_mask(&self, slot: u32, first: u64, mask: &[u64]) -> Result<(), MemoryError> {
        let s = self.slot(slot)?;
        let count = mask.len() as u64 * 64;
        let range = clear_range(&s, first, count)?;
        if range.0 != first {
            return Err(MemoryError::Range {
                slot,
                first,
                end: first.saturating_add(count),
                pages: s.pages(),
            });
        }
        let mut bitmap = mask[..(range.1 as usize).div_ceil(64)].to_vec();
        self.clear_bits(slot, range, &mut bitmap)
    }

    fn slot(&self, slot: u32) -> Result<Slot, MemoryError> {
        self.slots
            .iter()
            .find(|s| s.id == slot)
            .copied()
            .ok_or(MemoryError::NoSlot(slot))
    }

    /// KVM_CLEAR_DIRTY_LOG of `range` (from [`clear_range`]) with `bitmap`.
    fn clear_bits(
        &self,
        slot: u32,
        range: (u64, u64),
        bitmap: &mut [u64],
    ) -> Result<(), MemoryError> {
        let log = *devices::sync::lock(&self.log);
        if !log.on || !log.manual || range.1 == 0 {
            return Ok(());
        }
        let mut arg = kvm_clear_dirty_log {
            slot,
            num_pages: range.1 as u32,
            first_page: range.0,
            ..Default::default()
        };
        arg.__bindgen_anon_1.dirty_bitmap = bitmap.as_mut_ptr().cast();
        // SAFETY: KVM reads `num_pages` bits from `dirty_bitmap`, a live
        // buffer of at least that many bits owned here; the other fields are
        // plain values checked against the slot above.
        let rc = unsafe { ioctl_with_ref(self.vm.as_ref(), KVM_CLEAR_DIRTY_LOG(), &arg) };
        if rc < 0 {
            return Err(MemoryError::Kvm(KvmOp {
                what: "clear the dirty log",
                source: kvm_ioctls::Error::last(),
            }));
        }
        Ok(())
    }
}

/// The range KVM_CLEAR_DIRTY_LOG takes for `first..first+count` of `s`:
/// the first page rounded down and the count rounded up to 64 pages (KVM's
/// rule), the count cut at the end of the slot.
pub fn clear_range(s: &Slot, first: u64, count: u64) -> Result<(u64, u64), MemoryError> {
    let pages = s.pages();
    let end = first.checked_add(count).filter(|&e| e <= pages);
    let Some(end) = end else {
        return Err(MemoryError::Range {
            slot: s.id,
            first,
            end: first.saturating_add(count),
            pages,
        });
    };
    let start = first / 64 * 64;
    let stop = end.div_ceil(64).saturating_mul(64).min(pages);
    Ok((start, stop - start))
}

/// Guest memory as a snapshot or migration reads it: copied out through
/// vm-memory's accessors (volatile copies), never as `&[u8]` over memory
/// a guest may be running on.
pub struct GuestPages<'a>(pub &'a GuestMemoryMmap);

impl migration::memory::PageSource for GuestPages<'_> {
    fn regions(&self) -> Vec<(u64, u64)> {
        self.0
            .iter()
            .map(|r| (r.start_addr().raw_value(), r.len()))
            .collect()
    }

    fn read_at(&self, gpa: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.0
            .read_slice(buf, GuestAddress(gpa))
            .map_err(std::io::Error::other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(pages: u64) -> Slot {
        Slot {
            id: 0,
            gpa: 0x10_0000,
            bytes: pages * PAGE_SIZE,
            host: 0,
        }
    }

    #[test]
    fn bitmaps_count_and_name_their_pages() {
        let b = DirtyBitmap {
            slot: 0,
            gpa: 0x10_0000,
            pages: 130,
            bits: vec![0b101, 0, 1 << 1],
        };
        assert_eq!(b.count(), 3);
        let addrs: Vec<u64> = b.addresses().collect();
        assert_eq!(
            addrs,
            vec![0x10_0000, 0x10_2000, 0x10_0000 + 129 * PAGE_SIZE]
        );
        let mut a = vec![0b001, 4];
        or_into(&mut a, &[0b110, 1]);
        assert_eq!(a, vec![0b111, 5]);
    }

    #[test]
    fn clear_ranges_follow_kvms_64_page_rule() {
        let s = slot(200);
        assert_eq!(clear_range(&s, 0, 1).unwrap(), (0, 64));
        assert_eq!(clear_range(&s, 65, 3).unwrap(), (64, 64));
        assert_eq!(
            clear_range(&s, 130, 70).unwrap(),
            (128, 72),
            "cut at the end"
        );
        assert_eq!(clear_range(&s, 200, 0).unwrap(), (192, 8));
        assert!(clear_range(&s, 199, 2).is_err(), "past the slot");
        assert!(clear_range(&s, u64::MAX, 2).is_err(), "overflow");
    }

    /// Needs /dev/kvm (creates a VM, runs no guest): a device write lands
    /// in the device bitmap and is reported once; the KVM log can be turned
    /// on, read, cleared and off.
    #[test]
    fn device_writes_are_reported_and_the_kvm_log_toggles() {
        use vm_memory::Bytes;
        let kvm = kvm_ioctls::Kvm::new().expect("/dev/kvm");
        let vm = Arc::new(kvm.create_vm().unwrap());
        let ram = GuestRam::new(vm, 16 << 20).unwrap();
        assert_eq!(ram.bytes(), 16 << 20);
        ram.start_dirty_log().unwrap();
        ram.mem().write_obj(7u64, GuestAddress(0x5008)).unwrap();
        let d = ram.dirty_pages().unwrap();
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].addresses().collect::<Vec<_>>(), vec![0x5000]);
        assert_eq!(ram.dirty_pages().unwrap()[0].count(), 0, "read resets");
        ram.clear_dirty(0, 0, 64).unwrap();
        assert!(ram.clear_dirty(3, 0, 1).is_err());
        ram.stop_dirty_log().unwrap();
        assert!(!ram.logging());
    }

    /// Needs /dev/kvm: where KVM offers `KVM_DIRTY_LOG_INITIALLY_SET` the
    /// log starts with every page dirty, and a cleared range reads clean
    /// from then on; a log started the usual way reads clean.
    #[test]
    fn a_log_started_all_dirty_reads_dirty_until_cleared() {
        let kvm = kvm_ioctls::Kvm::new().expect("/dev/kvm");
        let vm = Arc::new(kvm.create_vm().unwrap());
        let offered = vm.check_extension_raw(u64::from(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2))
            & (KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE | KVM_DIRTY_LOG_INITIALLY_SET) as i32;
        let ram = GuestRam::new(vm, 16 << 20).unwrap();
        let pages = (16 << 20) / PAGE_SIZE;
        let all = ram.start_dirty_log_all_dirty().unwrap();
        assert_eq!(all, offered == 3, "KVM offers {offered:#x}");
        assert_eq!(ram.log_started_all_dirty(), all);
        let expect = if all { pages } else { 0 };
        assert_eq!(ram.dirty_pages().unwrap()[0].count(), expect);
        ram.clear_dirty(0, 0, 64).unwrap();
        let expect = if all { pages - 64 } else { 0 };
        assert_eq!(ram.dirty_pages().unwrap()[0].count(), expect);
        ram.stop_dirty_log().unwrap();
        ram.start_dirty_log().unwrap();
        assert!(!ram.log_started_all_dirty());
        assert_eq!(ram.dirty_pages().unwrap()[0].count(), 0);
    }
}
