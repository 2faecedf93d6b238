//! The one error of a failed KVM ioctl: what tandem was doing, and KVM's
//! error as its source. Every module's error enum wraps it
//! (`#[error(transparent)] Kvm(#[from] KvmOp)`), and [`kvm_op`] builds it
//! in a `map_err`. Pure data; no thread, no KVM call.

/// A KVM ioctl that failed.
#[derive(Debug, thiserror::Error)]
#[error("KVM: cannot {what}: {source}")]
pub struct KvmOp {
    /// What tandem asked KVM to do ("create a vCPU", "read MSRs", ...).
    pub what: &'static str,
    pub source: kvm_ioctls::Error,
}

/// `map_err(kvm_op("create a VM"))`: names the failed operation.
pub fn kvm_op(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> KvmOp {
    move |source| KvmOp { what, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_names_the_operation_and_keeps_the_source() {
        let e = kvm_op("create a VM")(kvm_ioctls::Error::new(libc::ENOMEM));
        assert!(
            e.to_string().starts_with("KVM: cannot create a VM: "),
            "{e}"
        );
        assert!(std::error::Error::source(&e).is_some());
    }
}
