//! Conversions between tandem's state types and the `kvm-bindings` structures.
//!
//! This module owns the mapping field by field, so the vmm's save path is "ioctl, then
//! `from`" and its restore path is "`to_kvm`, then ioctl". It makes no KVM call. Converting
//! to KVM is fallible: a snapshot is hostile input, so byte areas of the wrong length and
//! lists longer than the kernel's arrays are refused here, before any ioctl sees them.
//!
//! Restore order that KVM needs (the vmm's job; as Firecracker and QEMU do it):
//! - VM, before any vCPU runs: `KVM_SET_PIT2`, `KVM_SET_CLOCK`, `KVM_SET_IRQCHIP` ×3
//!   (PIC master, PIC slave, IOAPIC);
//! - each vCPU, after `KVM_SET_CPUID2`: mp_state, regs, sregs, xsave (or fpu), xcrs,
//!   debug regs, LAPIC, MSRs, vcpu events (last: it may inject what the others prepared).

use kvm_bindings::{
    kvm_clock_data, kvm_debugregs, kvm_dtable, kvm_fpu, kvm_irqchip, kvm_irqchip__bindgen_ty_1,
    kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_pit_channel_state, kvm_pit_state2, kvm_regs,
    kvm_segment, kvm_sregs, kvm_vcpu_events, kvm_xcr, kvm_xcrs, kvm_xsave, Msrs,
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
};
use zerocopy::{FromBytes, IntoBytes};

use crate::vcpu::{
    DTable, DebugRegs, ExceptionEvent, Fpu, InterruptEvent, Msr, NmiEvent, Regs, Segment, SmiEvent,
    Sregs, VcpuEvents, VcpuState, Xcr,
};
use crate::vm::{ClockState, PitChannel, PitState, VmState, IRQCHIP_LEN};

/// Size of the LAPIC register page.
pub const LAPIC_LEN: usize = 1024;
/// Size of the legacy xsave area (`kvm_xsave.region`).
pub const XSAVE_LEN: usize = 4096;
const MAX_XCRS: usize = 16;

/// A saved state that KVM would not take.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KvmStateError {
    /// A byte area has the wrong length.
    #[error("{what} is {found} bytes, KVM takes {expected}")]
    Length {
        /// Which area.
        what: &'static str,
        /// Its length in the snapshot.
        found: usize,
        /// The length KVM takes.
        expected: usize,
    },
    /// A list is longer than the kernel's array.
    #[error("{what}: {found} entries, KVM takes at most {max}")]
    TooMany {
        /// Which list.
        what: &'static str,
        /// Entries in the snapshot.
        found: usize,
        /// The kernel's limit.
        max: usize,
    },
}

type Result<T> = std::result::Result<T, KvmStateError>;

fn exact<'a>(what: &'static str, bytes: &'a [u8], expected: usize) -> Result<&'a [u8]> {
    if bytes.len() == expected {
        Ok(bytes)
    } else {
        Err(KvmStateError::Length {
            what,
            found: bytes.len(),
            expected,
        })
    }
}

impl From<&kvm_regs> for Regs {
    fn from(r: &kvm_regs) -> Self {
        Regs {
            rax: r.rax,
            rbx: r.rbx,
            rcx: r.rcx,
            rdx: r.rdx,
            rsi: r.rsi,
            rdi: r.rdi,
            rsp: r.rsp,
            rbp: r.rbp,
            r8: r.r8,
            r9: r.r9,
            r10: r.r10,
            r11: r.r11,
            r12: r.r12,
            r13: r.r13,
            r14: r.r14,
            r15: r.r15,
            rip: r.rip,
            rflags: r.rflags,
        }
    }
}

impl From<&Regs> for kvm_regs {
    fn from(r: &Regs) -> Self {
        kvm_regs {
            rax: r.rax,
            rbx: r.rbx,
            rcx: r.rcx,
            rdx: r.rdx,
            rsi: r.rsi,
            rdi: r.rdi,
            rsp: r.rsp,
            rbp: r.rbp,
            r8: r.r8,
            r9: r.r9,
            r10: r.r10,
            r11: r.r11,
            r12: r.r12,
            r13: r.r13,
            r14: r.r14,
            r15: r.r15,
            rip: r.rip,
            rflags: r.rflags,
        }
    }
}

impl From<&kvm_segment> for Segment {
    fn from(s: &kvm_segment) -> Self {
        Segment {
            base: s.base,
            limit: s.limit,
            selector: s.selector,
            type_: s.type_,
            present: s.present,
            dpl: s.dpl,
            db: s.db,
            s: s.s,
            l: s.l,
            g: s.g,
            avl: s.avl,
            unusable: s.unusable,
        }
    }
}

impl From<&Segment> for kvm_segment {
    fn from(s: &Segment) -> Self {
        kvm_segment {
            base: s.base,
            limit: s.limit,
            selector: s.selector,
            type_: s.type_,
            present: s.present,
            dpl: s.dpl,
            db: s.db,
            s: s.s,
            l: s.l,
            g: s.g,
            avl: s.avl,
            unusable: s.unusable,
            padding: 0,
        }
    }
}

impl From<&kvm_dtable> for DTable {
    fn from(d: &kvm_dtable) -> Self {
        DTable {
            base: d.base,
            limit: d.limit,
        }
    }
}

impl From<&DTable> for kvm_dtable {
    fn from(d: &DTable) -> Self {
        kvm_dtable {
            base: d.base,
            limit: d.limit,
            padding: [0; 3],
        }
    }
}

impl From<&kvm_sregs> for Sregs {
    fn from(s: &kvm_sregs) -> Self {
        Sregs {
            cs: (&s.cs).into(),
            ds: (&s.ds).into(),
            es: (&s.es).into(),
            fs: (&s.fs).into(),
            gs: (&s.gs).into(),
            ss: (&s.ss).into(),
            tr: (&s.tr).into(),
            ldt: (&s.ldt).into(),
            gdt: (&s.gdt).into(),
            idt: (&s.idt).into(),
            cr0: s.cr0,
            cr2: s.cr2,
            cr3: s.cr3,
            cr4: s.cr4,
            cr8: s.cr8,
            efer: s.efer,
            apic_base: s.apic_base,
            interrupt_bitmap: s.interrupt_bitmap,
        }
    }
}

impl From<&Sregs> for kvm_sregs {
    fn from(s: &Sregs) -> Self {
        kvm_sregs {
            cs: (&s.cs).into(),
            ds: (&s.ds).into(),
            es: (&s.es).into(),
            fs: (&s.fs).into(),
            gs: (&s.gs).into(),
            ss: (&s.ss).into(),
            tr: (&s.tr).into(),
            ldt: (&s.ldt).into(),
            gdt: (&s.gdt).into(),
            idt: (&s.idt).into(),
            cr0: s.cr0,
            cr2: s.cr2,
            cr3: s.cr3,
            cr4: s.cr4,
            cr8: s.cr8,
            efer: s.efer,
            apic_base: s.apic_base,
            interrupt_bitmap: s.interrupt_bitmap,
        }
    }
}

impl From<&kvm_fpu> for Fpu {
    fn from(f: &kvm_fpu) -> Self {
        Fpu {
            fpr: f.fpr.as_flattened().to_vec(),
            fcw: f.fcw,
            fsw: f.fsw,
            ftwx: f.ftwx,
            last_opcode: f.last_opcode,
            last_ip: f.last_ip,
            last_dp: f.last_dp,
            xmm: f.xmm.as_flattened().to_vec(),
            mxcsr: f.mxcsr,
        }
    }
}

impl TryFrom<&Fpu> for kvm_fpu {
    type Error = KvmStateError;

    fn try_from(f: &Fpu) -> Result<Self> {
        let mut k = kvm_fpu {
            fcw: f.fcw,
            fsw: f.fsw,
            ftwx: f.ftwx,
            last_opcode: f.last_opcode,
            last_ip: f.last_ip,
            last_dp: f.last_dp,
            mxcsr: f.mxcsr,
            ..Default::default()
        };
        k.fpr
            .as_flattened_mut()
            .copy_from_slice(exact("FPU registers", &f.fpr, 8 * 16)?);
        k.xmm
            .as_flattened_mut()
            .copy_from_slice(exact("XMM registers", &f.xmm, 16 * 16)?);
        Ok(k)
    }
}

/// The valid entries of `kvm_xcrs`.
pub fn xcrs_from_kvm(x: &kvm_xcrs) -> Vec<Xcr> {
    let n = (x.nr_xcrs as usize).min(MAX_XCRS);
    x.xcrs[..n]
        .iter()
        .map(|e| Xcr {
            xcr: e.xcr,
            value: e.value,
        })
        .collect()
}

/// A `kvm_xcrs` holding `xcrs`.
pub fn xcrs_to_kvm(xcrs: &[Xcr]) -> Result<kvm_xcrs> {
    if xcrs.len() > MAX_XCRS {
        return Err(KvmStateError::TooMany {
            what: "XCRs",
            found: xcrs.len(),
            max: MAX_XCRS,
        });
    }
    let mut k = kvm_xcrs {
        nr_xcrs: xcrs.len() as u32,
        ..Default::default()
    };
    for (slot, x) in k.xcrs.iter_mut().zip(xcrs) {
        *slot = kvm_xcr {
            xcr: x.xcr,
            reserved: 0,
            value: x.value,
        };
    }
    Ok(k)
}

/// The MSRs of a `KVM_GET_MSRS` answer (`Msrs::as_slice()`).
pub fn msrs_from_kvm(entries: &[kvm_msr_entry]) -> Vec<Msr> {
    entries
        .iter()
        .map(|e| Msr {
            index: e.index,
            data: e.data,
        })
        .collect()
}

/// A `kvm_msrs` for `KVM_SET_MSRS`.
pub fn msrs_to_kvm(msrs: &[Msr]) -> Result<Msrs> {
    let entries: Vec<kvm_msr_entry> = msrs
        .iter()
        .map(|m| kvm_msr_entry {
            index: m.index,
            reserved: 0,
            data: m.data,
        })
        .collect();
    Msrs::from_entries(&entries).map_err(|_| KvmStateError::TooMany {
        what: "MSRs",
        found: msrs.len(),
        max: kvm_bindings::KVM_MAX_MSR_ENTRIES,
    })
}

/// The LAPIC register page as bytes.
pub fn lapic_from_kvm(l: &kvm_lapic_state) -> Vec<u8> {
    l.regs.as_bytes().to_vec()
}

/// A `kvm_lapic_state` from exactly [`LAPIC_LEN`] bytes.
pub fn lapic_to_kvm(bytes: &[u8]) -> Result<kvm_lapic_state> {
    let bytes = exact("LAPIC page", bytes, LAPIC_LEN)?;
    let mut l = kvm_lapic_state::default();
    for (r, b) in l.regs.iter_mut().zip(bytes) {
        *r = std::os::raw::c_char::from_ne_bytes([*b]);
    }
    Ok(l)
}

/// The legacy xsave area as bytes.
pub fn xsave_from_kvm(x: &kvm_xsave) -> Vec<u8> {
    x.region.as_bytes().to_vec()
}

/// A `kvm_xsave` from exactly [`XSAVE_LEN`] bytes (a larger area needs `KVM_SET_XSAVE2`).
pub fn xsave_to_kvm(bytes: &[u8]) -> Result<kvm_xsave> {
    let bytes = exact("xsave area", bytes, XSAVE_LEN)?;
    let mut x = kvm_xsave::default();
    for (w, b) in x.region.iter_mut().zip(bytes.as_chunks::<4>().0) {
        *w = u32::from_ne_bytes(*b);
    }
    Ok(x)
}

impl From<&kvm_vcpu_events> for VcpuEvents {
    fn from(e: &kvm_vcpu_events) -> Self {
        VcpuEvents {
            exception: ExceptionEvent {
                injected: e.exception.injected,
                nr: e.exception.nr,
                has_error_code: e.exception.has_error_code,
                pending: e.exception.pending,
                error_code: e.exception.error_code,
            },
            interrupt: InterruptEvent {
                injected: e.interrupt.injected,
                nr: e.interrupt.nr,
                soft: e.interrupt.soft,
                shadow: e.interrupt.shadow,
            },
            nmi: NmiEvent {
                injected: e.nmi.injected,
                pending: e.nmi.pending,
                masked: e.nmi.masked,
            },
            sipi_vector: e.sipi_vector,
            flags: e.flags,
            smi: SmiEvent {
                smm: e.smi.smm,
                pending: e.smi.pending,
                smm_inside_nmi: e.smi.smm_inside_nmi,
                latched_init: e.smi.latched_init,
            },
            triple_fault_pending: e.triple_fault.pending,
            exception_has_payload: e.exception_has_payload,
            exception_payload: e.exception_payload,
        }
    }
}

impl From<&VcpuEvents> for kvm_vcpu_events {
    fn from(e: &VcpuEvents) -> Self {
        let mut k = kvm_vcpu_events {
            sipi_vector: e.sipi_vector,
            flags: e.flags,
            exception_has_payload: e.exception_has_payload,
            exception_payload: e.exception_payload,
            ..Default::default()
        };
        k.exception.injected = e.exception.injected;
        k.exception.nr = e.exception.nr;
        k.exception.has_error_code = e.exception.has_error_code;
        k.exception.pending = e.exception.pending;
        k.exception.error_code = e.exception.error_code;
        k.interrupt.injected = e.interrupt.injected;
        k.interrupt.nr = e.interrupt.nr;
        k.interrupt.soft = e.interrupt.soft;
        k.interrupt.shadow = e.interrupt.shadow;
        k.nmi.injected = e.nmi.injected;
        k.nmi.pending = e.nmi.pending;
        k.nmi.masked = e.nmi.masked;
        k.smi.smm = e.smi.smm;
        k.smi.pending = e.smi.pending;
        k.smi.smm_inside_nmi = e.smi.smm_inside_nmi;
        k.smi.latched_init = e.smi.latched_init;
        k.triple_fault.pending = e.triple_fault_pending;
        k
    }
}

impl From<&kvm_debugregs> for DebugRegs {
    fn from(d: &kvm_debugregs) -> Self {
        DebugRegs {
            db: d.db,
            dr6: d.dr6,
            dr7: d.dr7,
            flags: d.flags,
        }
    }
}

impl From<&DebugRegs> for kvm_debugregs {
    fn from(d: &DebugRegs) -> Self {
        kvm_debugregs {
            db: d.db,
            dr6: d.dr6,
            dr7: d.dr7,
            flags: d.flags,
            reserved: [0; 9],
        }
    }
}

/// One vCPU's state as the `KVM_GET_*` ioctls return it.
#[allow(missing_docs)]
#[derive(Debug, Default)]
pub struct KvmVcpuState {
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    pub fpu: kvm_fpu,
    pub xsave: kvm_xsave,
    pub xcrs: kvm_xcrs,
    pub msrs: Vec<kvm_msr_entry>,
    pub lapic: kvm_lapic_state,
    pub mp_state: kvm_mp_state,
    pub events: kvm_vcpu_events,
    pub debugregs: kvm_debugregs,
}

// By hand: `kvm_xsave` ends in a flexible array (empty here: the legacy
// 4 KiB area is all KVM_GET_XSAVE fills), so it derives no `Clone`.
impl Clone for KvmVcpuState {
    fn clone(&self) -> Self {
        KvmVcpuState {
            xsave: kvm_xsave {
                region: self.xsave.region,
                ..Default::default()
            },
            msrs: self.msrs.clone(),
            ..*self
        }
    }
}

impl VcpuState {
    /// Converts what the vmm read from KVM for vCPU `id`.
    pub fn from_kvm(id: u32, k: &KvmVcpuState) -> Self {
        VcpuState {
            id,
            regs: (&k.regs).into(),
            sregs: (&k.sregs).into(),
            fpu: (&k.fpu).into(),
            xsave: xsave_from_kvm(&k.xsave),
            xcrs: xcrs_from_kvm(&k.xcrs),
            msrs: msrs_from_kvm(&k.msrs),
            lapic: lapic_from_kvm(&k.lapic),
            mp_state: k.mp_state.mp_state,
            events: (&k.events).into(),
            debugregs: (&k.debugregs).into(),
        }
    }

    /// Converts back for the `KVM_SET_*` ioctls; refuses areas of the wrong size.
    pub fn to_kvm(&self) -> Result<KvmVcpuState> {
        // Fail on the first bad field before building anything.
        let fpu = kvm_fpu::try_from(&self.fpu)?;
        let xsave = xsave_to_kvm(&self.xsave)?;
        let xcrs = xcrs_to_kvm(&self.xcrs)?;
        let lapic = lapic_to_kvm(&self.lapic)?;
        msrs_to_kvm(&self.msrs)?;
        Ok(KvmVcpuState {
            regs: (&self.regs).into(),
            sregs: (&self.sregs).into(),
            fpu,
            xsave,
            xcrs,
            msrs: self
                .msrs
                .iter()
                .map(|m| kvm_msr_entry {
                    index: m.index,
                    reserved: 0,
                    data: m.data,
                })
                .collect(),
            lapic,
            mp_state: kvm_mp_state {
                mp_state: self.mp_state,
            },
            events: (&self.events).into(),
            debugregs: (&self.debugregs).into(),
        })
    }
}

/// The chip area of a `kvm_irqchip` as bytes.
pub fn irqchip_from_kvm(chip: &kvm_irqchip) -> Vec<u8> {
    chip.chip.as_bytes().to_vec()
}

/// A `kvm_irqchip` for chip `chip_id` from exactly [`IRQCHIP_LEN`] bytes.
pub fn irqchip_to_kvm(chip_id: u32, bytes: &[u8]) -> Result<kvm_irqchip> {
    let what = match chip_id {
        KVM_IRQCHIP_PIC_MASTER => "PIC master state",
        KVM_IRQCHIP_PIC_SLAVE => "PIC slave state",
        _ => "IOAPIC state",
    };
    let bytes = exact(what, bytes, IRQCHIP_LEN)?;
    let chip =
        kvm_irqchip__bindgen_ty_1::read_from_bytes(bytes).map_err(|_| KvmStateError::Length {
            what,
            found: bytes.len(),
            expected: IRQCHIP_LEN,
        })?;
    Ok(kvm_irqchip {
        chip_id,
        pad: 0,
        chip,
    })
}

impl From<&kvm_pit_channel_state> for PitChannel {
    fn from(c: &kvm_pit_channel_state) -> Self {
        PitChannel {
            count: c.count,
            latched_count: c.latched_count,
            count_latched: c.count_latched,
            status_latched: c.status_latched,
            status: c.status,
            read_state: c.read_state,
            write_state: c.write_state,
            write_latch: c.write_latch,
            rw_mode: c.rw_mode,
            mode: c.mode,
            bcd: c.bcd,
            gate: c.gate,
            count_load_time: c.count_load_time,
        }
    }
}

impl From<&PitChannel> for kvm_pit_channel_state {
    fn from(c: &PitChannel) -> Self {
        kvm_pit_channel_state {
            count: c.count,
            latched_count: c.latched_count,
            count_latched: c.count_latched,
            status_latched: c.status_latched,
            status: c.status,
            read_state: c.read_state,
            write_state: c.write_state,
            write_latch: c.write_latch,
            rw_mode: c.rw_mode,
            mode: c.mode,
            bcd: c.bcd,
            gate: c.gate,
            count_load_time: c.count_load_time,
        }
    }
}

impl From<&kvm_pit_state2> for PitState {
    fn from(p: &kvm_pit_state2) -> Self {
        PitState {
            channels: p.channels.each_ref().map(PitChannel::from),
            flags: p.flags,
        }
    }
}

impl From<&PitState> for kvm_pit_state2 {
    fn from(p: &PitState) -> Self {
        kvm_pit_state2 {
            channels: p.channels.each_ref().map(kvm_pit_channel_state::from),
            flags: p.flags,
            reserved: [0; 9],
        }
    }
}

impl From<&kvm_clock_data> for ClockState {
    fn from(c: &kvm_clock_data) -> Self {
        ClockState {
            clock: c.clock,
            flags: c.flags,
            realtime: c.realtime,
            host_tsc: c.host_tsc,
        }
    }
}

impl From<&ClockState> for kvm_clock_data {
    fn from(c: &ClockState) -> Self {
        kvm_clock_data {
            clock: c.clock,
            flags: c.flags,
            realtime: c.realtime,
            host_tsc: c.host_tsc,
            ..Default::default()
        }
    }
}

/// The VM-wide state as the `KVM_GET_*` ioctls return it.
#[allow(missing_docs)]
#[derive(Clone)]
pub struct KvmVmState {
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
    pub pit: kvm_pit_state2,
    pub clock: kvm_clock_data,
}

impl VmState {
    /// Converts what the vmm read from KVM.
    pub fn from_kvm(k: &KvmVmState) -> Self {
        VmState {
            pic_master: irqchip_from_kvm(&k.pic_master),
            pic_slave: irqchip_from_kvm(&k.pic_slave),
            ioapic: irqchip_from_kvm(&k.ioapic),
            pit: (&k.pit).into(),
            clock: (&k.clock).into(),
        }
    }

    /// Converts back for the `KVM_SET_*` ioctls; refuses chips of the wrong size.
    pub fn to_kvm(&self) -> Result<KvmVmState> {
        Ok(KvmVmState {
            pic_master: irqchip_to_kvm(KVM_IRQCHIP_PIC_MASTER, &self.pic_master)?,
            pic_slave: irqchip_to_kvm(KVM_IRQCHIP_PIC_SLAVE, &self.pic_slave)?,
            ioapic: irqchip_to_kvm(KVM_IRQCHIP_IOAPIC, &self.ioapic)?,
            pit: (&self.pit).into(),
            clock: (&self.clock).into(),
        })
    }
}
