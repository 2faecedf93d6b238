//! The one lock helper for tandem's shared device state (and, from `vmm`,
//! every other `std::sync::Mutex` it holds).
//!
//! Owns [`lock`]: it takes over a mutex poisoned by a thread that panicked
//! while holding it instead of panicking in turn. A poisoned lock here means
//! a device model or a VMM thread panicked mid-access; the state under every
//! such lock is left consistent at each step (a register, a queue index, a
//! counter), and one failed access must not take down every vCPU and the
//! VMM thread after it: the guest goes on, as on hardware after a device
//! misbehaves. Runs on whichever thread calls it; it must never be used
//! where a half-done update could be observed (keep such updates out of
//! these locks, or check them after taking one).

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, taking it over if a thread panicked while holding it.
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_poisoned_lock_is_taken_over() {
        let m = Arc::new(Mutex::new(7));
        let m2 = Arc::clone(&m);
        let _ = std::thread::spawn(move || {
            let _g = m2.lock();
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        *lock(&m) += 1;
        assert_eq!(*lock(&m), 8);
    }
}
