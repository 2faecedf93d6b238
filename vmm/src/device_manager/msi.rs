//! KVM's interrupt routes for virtio-pci: each MSI-X vector of a device is
//! an irqfd on a GSI of its own (from 24 up, above the IOAPIC's pins), and
//! the GSI's route carries the message the guest programmed. KVM takes the
//! whole routing table at once (`KVM_SET_GSI_ROUTING`), so this module
//! keeps it: the default routes of the PIC and IOAPIC pins (what KVM had
//! before the first change) and the MSI ones. It also moves a device's
//! queue-notify ioeventfds when the guest moves its BAR.
//!
//! Built on the VMM thread; called afterwards from the vCPU thread that
//! writes a device's MSI-X table or configuration space (under that
//! device's lock, then this table's). Never panics on what the guest
//! wrote: a route KVM refuses is an error the transport logs.

use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, Mutex};

use devices::virtio::pci::{MsiRoutes, NotifyArea, NOTIFY_MULTIPLIER};
use kvm_bindings::{
    kvm_irq_routing_entry, KvmIrqRouting, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE, KVM_IRQ_ROUTING_IRQCHIP, KVM_IRQ_ROUTING_MSI,
};
use kvm_ioctls::{IoEventAddress, NoDatamatch, VmFd};
use vmm_sys_util::eventfd::EventFd;

/// The first GSI MSI vectors take (0-23 are the IOAPIC's pins).
const FIRST_MSI_GSI: u32 = 24;
/// KVM's limit on routes (KVM_MAX_IRQ_ROUTES).
const MAX_GSI: u32 = 4096;

/// The VM's routing table.
pub struct GsiRouting {
    vm: Arc<VmFd>,
    table: Mutex<Table>,
}

struct Table {
    msi: BTreeMap<u32, (u64, u32)>,
    next: u32,
}

fn irqchip(gsi: u32, chip: u32, pin: u32) -> kvm_irq_routing_entry {
    let mut e = kvm_irq_routing_entry {
        gsi,
        type_: KVM_IRQ_ROUTING_IRQCHIP,
        ..Default::default()
    };
    e.u.irqchip.irqchip = chip;
    e.u.irqchip.pin = pin;
    e
}

/// KVM's default routes on x86: GSIs 0-15 to the PICs and the IOAPIC,
/// 16-23 to the IOAPIC.
fn default_routes() -> Vec<kvm_irq_routing_entry> {
    let mut v = Vec::new();
    for gsi in 0..24 {
        v.push(irqchip(gsi, KVM_IRQCHIP_IOAPIC, gsi));
        if gsi < 8 {
            v.push(irqchip(gsi, KVM_IRQCHIP_PIC_MASTER, gsi));
        } else if gsi < 16 {
            v.push(irqchip(gsi, KVM_IRQCHIP_PIC_SLAVE, gsi - 8));
        }
    }
    v
}

impl GsiRouting {
    /// The table of `vm`, as KVM set it up with the irqchip.
    pub fn new(vm: Arc<VmFd>) -> Arc<GsiRouting> {
        Arc::new(GsiRouting {
            vm,
            table: Mutex::new(Table {
                msi: BTreeMap::new(),
                next: FIRST_MSI_GSI,
            }),
        })
    }

    /// Takes `n` GSIs for a device's vectors; `None` when KVM has no more.
    pub fn allocate(&self, n: u32) -> Option<u32> {
        let mut t = devices::sync::lock(&self.table);
        let first = t.next;
        let end = first.checked_add(n).filter(|&e| e <= MAX_GSI)?;
        t.next = end;
        Some(first)
    }

    /// Routes `gsi` to the MSI message (`address`, `data`) and hands KVM
    /// the whole table.
    fn set_msi(&self, gsi: u32, address: u64, data: u32) -> io::Result<()> {
        let mut t = devices::sync::lock(&self.table);
        t.msi.insert(gsi, (address, data));
        let mut entries = default_routes();
        for (&gsi, &(address, data)) in &t.msi {
            let mut e = kvm_irq_routing_entry {
                gsi,
                type_: KVM_IRQ_ROUTING_MSI,
                ..Default::default()
            };
            e.u.msi.address_lo = address as u32;
            e.u.msi.address_hi = (address >> 32) as u32;
            e.u.msi.data = data;
            entries.push(e);
        }
        let routing = KvmIrqRouting::from_entries(&entries)
            .map_err(|e| io::Error::other(format!("routing table: {e:?}")))?;
        self.vm
            .set_gsi_routing(&routing)
            .map_err(|e| io::Error::from_raw_os_error(e.errno()))
    }
}

/// A device's vectors: vector `v` is GSI `first + v`.
pub struct DeviceRoutes {
    pub routing: Arc<GsiRouting>,
    pub first: u32,
}

impl MsiRoutes for DeviceRoutes {
    fn set(&mut self, vector: usize, address: u64, data: u32) -> io::Result<()> {
        let gsi = u32::try_from(vector)
            .ok()
            .and_then(|v| self.first.checked_add(v))
            .ok_or_else(|| io::Error::other("vector out of range"))?;
        self.routing.set_msi(gsi, address, data)
    }
}

/// A device's queue-notify ioeventfds, registered where its notify area
/// is now.
pub struct NotifyEvents {
    pub vm: Arc<VmFd>,
    /// Queue `n`'s eventfd.
    pub evts: Vec<EventFd>,
    pub at: Option<u64>,
}

impl NotifyEvents {
    fn addr(at: u64, queue: usize) -> IoEventAddress {
        IoEventAddress::Mmio(at + queue as u64 * u64::from(NOTIFY_MULTIPLIER))
    }
}

impl NotifyArea for NotifyEvents {
    fn moved(&mut self, at: Option<u64>) -> io::Result<()> {
        let errno = |e: vmm_sys_util::errno::Error| io::Error::from_raw_os_error(e.errno());
        if let Some(old) = self.at.take() {
            for (q, evt) in self.evts.iter().enumerate() {
                self.vm
                    .unregister_ioevent(evt, &Self::addr(old, q), NoDatamatch)
                    .map_err(errno)?;
            }
        }
        if let Some(new) = at {
            for (q, evt) in self.evts.iter().enumerate() {
                self.vm
                    .register_ioevent(evt, &Self::addr(new, q), NoDatamatch)
                    .map_err(errno)?;
            }
            self.at = Some(new);
        }
        Ok(())
    }
}
