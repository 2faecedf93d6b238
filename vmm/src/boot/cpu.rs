//! The vCPU state a 64-bit Linux entry point expects: long mode with an
//! identity-mapped first GiB, flat segments, RSI pointing at boot_params.
//! Also the per-vCPU MSR and local APIC set-up every vCPU gets.

use crate::kvm_util::{kvm_op, KvmOp};
use devices::GuestMemoryMmap;
use kvm_bindings::{kvm_fpu, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs, Msrs};
use kvm_ioctls::VcpuFd;
use vm_memory::{Bytes, GuestAddress};

use super::layout::*;

/// Errors from setting up a vCPU for boot.
#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    #[error("cannot write boot page tables or GDT: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
    #[error(transparent)]
    Kvm(#[from] KvmOp),
    #[error("KVM set only {0} of the boot MSRs")]
    Msrs(usize),
}

const X86_CR0_PE: u64 = 0x1;
const X86_CR0_ET: u64 = 0x10;
const X86_CR0_PG: u64 = 0x8000_0000;
const X86_CR4_PAE: u64 = 0x20;
const EFER_LME: u64 = 0x100;
const EFER_LMA: u64 = 0x400;

/// A GDT descriptor from flags, base and limit (Intel SDM vol. 3, 3.4.5).
const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << (56 - 24))
        | ((flags as u64 & 0x0000_f0ff) << 40)
        | ((limit as u64 & 0x000f_0000) << (48 - 16))
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
}

fn segment(entry: u64, index: u8) -> kvm_segment {
    let g = ((entry >> 55) & 1) as u8;
    let raw_limit = (((entry >> 32) & 0x000f_0000) | (entry & 0xffff)) as u32;
    kvm_segment {
        base: ((entry >> 16) & 0x00ff_ffff) | ((entry >> 32) & 0xff00_0000),
        limit: if g == 1 {
            (raw_limit << 12) | 0xfff
        } else {
            raw_limit
        },
        selector: u16::from(index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g,
        avl: ((entry >> 52) & 1) as u8,
        padding: 0,
        unusable: if ((entry >> 47) & 1) == 1 { 0 } else { 1 },
    }
}

/// Writes GDT, IDT and page tables, and puts the boot vCPU in long mode.
pub fn setup_long_mode(mem: &GuestMemoryMmap, sregs: &mut kvm_sregs) -> Result<(), CpuError> {
    let gdt = [
        gdt_entry(0, 0, 0),            // null
        gdt_entry(0xa09b, 0, 0xfffff), // code, 64-bit
        gdt_entry(0xc093, 0, 0xfffff), // data
        gdt_entry(0x808b, 0, 0xfffff), // TSS
    ];
    for (i, e) in gdt.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(GDT_START + i as u64 * 8))?;
    }
    mem.write_obj(0u64, GuestAddress(IDT_START))?;

    let code = segment(gdt[1], 1);
    let data = segment(gdt[2], 2);
    let tss = segment(gdt[3], 3);
    sregs.gdt.base = GDT_START;
    sregs.gdt.limit = (gdt.len() * 8 - 1) as u16;
    sregs.idt.base = IDT_START;
    sregs.idt.limit = 7;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;

    // Identity map of the first GiB with 2 MiB pages: enough for the entry
    // code, which builds its own tables before it touches anything else.
    mem.write_obj(PDPTE_START | 0x03, GuestAddress(PML4_START))?;
    mem.write_obj(PDE_START | 0x03, GuestAddress(PDPTE_START))?;
    for i in 0..512u64 {
        mem.write_obj((i << 21) | 0x83, GuestAddress(PDE_START + i * 8))?;
    }
    sregs.cr3 = PML4_START;
    sregs.cr4 |= X86_CR4_PAE;
    sregs.cr0 |= X86_CR0_PE | X86_CR0_ET | X86_CR0_PG;
    sregs.efer |= EFER_LME | EFER_LMA;
    Ok(())
}

/// Sets the boot vCPU's registers, segments and FPU for a 64-bit entry at `entry`.
pub fn setup_boot_vcpu(vcpu: &VcpuFd, mem: &GuestMemoryMmap, entry: u64) -> Result<(), CpuError> {
    let regs = kvm_regs {
        rflags: 0x2,
        rip: entry,
        rsp: BOOT_STACK_POINTER,
        rbp: BOOT_STACK_POINTER,
        rsi: ZERO_PAGE_START,
        ..Default::default()
    };
    vcpu.set_regs(&regs)
        .map_err(kvm_op("set the boot registers"))?;
    let mut sregs = vcpu
        .get_sregs()
        .map_err(kvm_op("read the segment registers"))?;
    setup_long_mode(mem, &mut sregs)?;
    vcpu.set_sregs(&sregs)
        .map_err(kvm_op("set the boot segment registers"))?;
    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu).map_err(kvm_op("set the FPU state"))?;
    Ok(())
}

const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
const MISC_ENABLE_FAST_STRING: u64 = 1;

/// The MSRs every vCPU starts with (as after a reset, fast strings on).
pub fn setup_msrs(vcpu: &VcpuFd) -> Result<(), CpuError> {
    let list = [
        (MSR_IA32_SYSENTER_CS, 0),
        (MSR_IA32_SYSENTER_ESP, 0),
        (MSR_IA32_SYSENTER_EIP, 0),
        (MSR_STAR, 0),
        (MSR_CSTAR, 0),
        (MSR_KERNEL_GS_BASE, 0),
        (MSR_SYSCALL_MASK, 0),
        (MSR_LSTAR, 0),
        (MSR_IA32_TSC, 0),
        (MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
    ];
    let entries: Vec<kvm_msr_entry> = list
        .iter()
        .map(|&(index, data)| kvm_msr_entry {
            index,
            data,
            ..Default::default()
        })
        .collect();
    let msrs = Msrs::from_entries(&entries).map_err(|_| CpuError::Msrs(0))?;
    let set = vcpu.set_msrs(&msrs).map_err(kvm_op("set the boot MSRs"))?;
    if set != entries.len() {
        return Err(CpuError::Msrs(set));
    }
    Ok(())
}

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

fn set_delivery_mode(reg: u32, mode: u32) -> u32 {
    (reg & !0x700) | (mode << 8)
}

/// Wires LINT0 to the PIC (ExtINT) and LINT1 to NMI, as firmware would.
pub fn setup_lapic(vcpu: &VcpuFd) -> Result<(), CpuError> {
    let mut lapic = vcpu.get_lapic().map_err(kvm_op("read the local APIC"))?;
    for (off, mode) in [(APIC_LVT0, APIC_MODE_EXTINT), (APIC_LVT1, APIC_MODE_NMI)] {
        let mut b = [0u8; 4];
        for (i, x) in b.iter_mut().enumerate() {
            *x = lapic.regs[off + i] as u8;
        }
        let v = set_delivery_mode(u32::from_le_bytes(b), mode).to_le_bytes();
        for (i, x) in v.iter().enumerate() {
            lapic.regs[off + i] = *x as _;
        }
    }
    vcpu.set_lapic(&lapic)
        .map_err(kvm_op("set the local APIC"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdt_entries_decode_to_flat_segments() {
        let code = segment(gdt_entry(0xa09b, 0, 0xfffff), 1);
        assert_eq!((code.base, code.limit, code.selector), (0, 0xffff_ffff, 8));
        assert_eq!(
            (code.l, code.db, code.present, code.s, code.type_),
            (1, 0, 1, 1, 0xb)
        );
        let data = segment(gdt_entry(0xc093, 0, 0xfffff), 2);
        assert_eq!((data.db, data.l, data.type_, data.selector), (1, 0, 3, 16));
        let null = segment(gdt_entry(0, 0, 0), 0);
        assert_eq!(null.unusable, 1);
    }

    #[test]
    fn delivery_mode_replaces_only_its_bits() {
        assert_eq!(set_delivery_mode(0x0001_0700, APIC_MODE_NMI), 0x0001_0400);
    }
}
