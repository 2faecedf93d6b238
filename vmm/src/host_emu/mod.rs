//! Host emulation: what kind of KVM this host has, and the workarounds a
//! guest needs because of it, all in this folder.
//!
//! On hosts whose KVM is `kvm_pvm` (no VT-x/AMD-V: the guest kernel is run by
//! KVM's instruction emulator) a stock Linux guest cannot boot as is. The
//! adjustments live here (the kernel parameters, [`HostKind`]), in
//! [`cpuid`] (the CPUID the guest sees) and in [`emulation`] (instructions
//! KVM's emulator gives up on, completed by tandem: [`fpu`]'s control moves,
//! [`x87`]'s arithmetic on [`x87_float`]'s numbers, operands decoded by
//! [`modrm`]). They apply only when [`HostKind::Emulated`] is detected: the
//! emulator is entered only through [`internal_error`], behind that
//! check, so behaviour on a host with hardware virtualization is unchanged.
//!
//! Runs on the VMM thread (detection, CPUID) and on each vCPU thread (the
//! emulator, on that vCPU's exit). Never does: enter the emulator on a
//! hardware host, or change guest state beyond the instruction at RIP.

use std::path::Path;

pub mod cpuid;
pub mod emulation;
pub mod fpu;
pub mod modrm;
pub mod x87;
pub mod x87_float;

/// The gate to the instruction emulator, on a vCPU's KVM internal error:
/// on an emulated host (`host`: [`HostKind::probe`]'s answer, not the
/// override's), [`emulation::handle_internal_error`] completes what
/// it can; on a host with VT-x/AMD-V the emulator is never entered and the
/// error is the vCPU's end.
pub fn internal_error(
    host: HostKind,
    vcpu: &mut kvm_ioctls::VcpuFd,
    mem: &devices::GuestMemoryMmap,
    rom: Option<&crate::boot::firmware::Firmware>,
) -> Result<(), emulation::EmulationError> {
    match host {
        HostKind::Emulated => emulation::handle_internal_error(vcpu, mem, rom),
        HostKind::Hardware => Err(emulation::EmulationError::Hardware {
            suberror: emulation::internal_suberror(vcpu),
        }),
    }
}

/// The kind of KVM this host runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostKind {
    /// KVM on VT-x or AMD-V.
    Hardware,
    /// `kvm_pvm`: guest kernel code is instruction-emulated.
    Emulated,
}

impl HostKind {
    /// Detects the host kind: `kvm_pvm` loaded means emulated. The variable
    /// `TANDEM_HOST_KIND=hardware|emulated` overrides the detection.
    pub fn detect() -> HostKind {
        match std::env::var("TANDEM_HOST_KIND").as_deref() {
            Ok("hardware") => return HostKind::Hardware,
            Ok("emulated") => return HostKind::Emulated,
            _ => {}
        }
        HostKind::probe()
    }

    /// The host's own kind, whatever `TANDEM_HOST_KIND` says: what the
    /// emulator's gate ([`internal_error`]) checks, so that it is never
    /// entered on a host with VT-x/AMD-V (and still is on `kvm_pvm` when a
    /// measurement overrides the kind to get the stock command line).
    pub fn probe() -> HostKind {
        if Path::new("/sys/module/kvm_pvm").exists() {
            HostKind::Emulated
        } else {
            HostKind::Hardware
        }
    }

    /// Kernel parameters the guest needs on this host, appended to every
    /// command line. Each one, and why:
    /// - `noxsave`, `clearcpuid=smap,popcnt,rdrand,rdseed,rdpid,cx16`,
    ///   `nofsgsbase`, `noinvpcid`: keep the kernel off instructions the
    ///   emulator cannot run (XSAVE/XRSTOR, CLAC/STAC, POPCNT,
    ///   RDRAND/RDSEED/RDPID, CMPXCHG16B, RD/WRFSBASE, INVPCID).
    /// - `clearcpuid=...,erms,fsrm`: without "enhanced REP MOVSB/STOSB" the
    ///   kernel copies and clears memory with `rep movsq`/`rep stosq`, which
    ///   the emulator runs 8 bytes per step instead of 1 (memcpy, memset and
    ///   clear_page were 8% of a boot's samples with them).
    /// - `noreplace-smp`: an SMP kernel on one vCPU otherwise rewrites every
    ///   LOCK prefix of its text at boot, one emulated `text_poke` each (4%
    ///   of a boot's samples); the prefixes cost nothing extra under emulation.
    /// - `tandem_syscall_fixup`: the guest-kernel patch in
    ///   `resources/kernel/0001-*.patch` completes user SYSCALLs that fault at
    ///   their entry point (ignored by kernels without the patch).
    /// - `io_delay=none`: every port-0x80 delay write would be an exit.
    /// - `GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX,...` (an environment variable
    ///   of `/init`, inherited by everything it starts): guest user code runs
    ///   natively and sees the host's AVX (CPUID and XGETBV are not
    ///   intercepted), but a `noxsave` kernel saves only the low 128 bits of
    ///   each vector register when it switches tasks. glibc's AVX string
    ///   functions then lose the upper half of a YMM register whenever
    ///   another task runs between a load and its store (a fresh page's
    ///   fault is such a window): 156 of 200 loads came back with zeros in
    ///   a two-task check here, and a freshly started `sha256sum` printed
    ///   zero bytes in 2 of 8 runs of the snapshot test. Programs that use
    ///   AVX by themselves are not covered (docs/host-kvm.md).
    ///
    /// Not appended: `tandem_pte_flush` (patch `resources/kernel/0002-*.patch`),
    /// an opt-in mitigation for the host fault in docs/host-kvm.md;
    /// it did not change the measured rate, so it costs nothing by default.
    pub fn guest_params(self) -> &'static str {
        match self {
            HostKind::Hardware => "",
            HostKind::Emulated => {
                "noxsave clearcpuid=smap,popcnt,rdrand,rdseed,rdpid,cx16,erms,fsrm nofsgsbase \
                 noinvpcid noreplace-smp tandem_syscall_fixup io_delay=none \
                 GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX,-AVX2,-AVX_Fast_Unaligned_Load,-FMA,\
                 -AVX512F,-AVX512VL,-AVX512BW,-AVX512DQ,-AVX512CD"
            }
        }
    }
}
