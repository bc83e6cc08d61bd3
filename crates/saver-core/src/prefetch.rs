//! Cache hints: asking the CPU to start loading memory a loop is about to read at random.

/// Asks the CPU to start loading the `bytes` bytes at `addr`: every cache line they touch (a row
/// of more than 128 bytes spans three or more, and a line left out costs a full miss per row).
/// Only a hint: it reads nothing and cannot fault, whatever the address.
#[inline(always)]
pub(crate) fn prefetch_range(addr: u64, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        const LINE: u64 = 64;
        let end = addr.saturating_add(bytes.max(1) as u64 - 1);
        let mut line = addr & !(LINE - 1);
        while line <= end {
            // SAFETY: SSE is part of x86_64; a prefetch is a hint that never faults, whatever
            // the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line as *const i8) };
            line += LINE;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (addr, bytes);
}

/// `prefetch_range` of `bytes`.
#[inline(always)]
pub fn prefetch(bytes: &[u8]) {
    prefetch_range(bytes.as_ptr() as u64, bytes.len());
}
