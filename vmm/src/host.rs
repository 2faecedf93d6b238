//! What kind of KVM this host has, and what a guest needs because of it.
//!
//! On hosts whose KVM is `kvm_pvm` (no VT-x/AMD-V: the guest kernel is run by
//! KVM's instruction emulator) a stock Linux guest cannot boot as is. The
//! adjustments live here and in `emulation` and `cpuid`, and apply only when
//! [`HostKind::Emulated`] is detected, so behaviour on a host with hardware
//! virtualization is unchanged.

use std::path::Path;

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
    ///   AVX by themselves are not covered (README, known issues).
    ///
    /// Not appended: `tandem_pte_flush` (patch `resources/kernel/0002-*.patch`),
    /// an opt-in mitigation for the host fault in the README's known issues;
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
