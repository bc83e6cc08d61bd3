//! Destination memory of owning loads.
//!
//! An owning load writes every byte of fresh memory once, so its cost is as much the kernel's page
//! faults as the copy: with 4 KiB pages, one trap per 4 KiB read. Two remedies:
//! - [`prefault`]: each reader thread faults in the slice it is about to fill with one system call
//!   (`MADV_POPULATE_WRITE`), instead of one trap per page during the copy.
//! - Transparent huge pages, on request ([`crate::LoadOptions::huge_pages`]): buffers are advised
//!   before their first byte lands, so a kernel with THP in `madvise` mode (the common default)
//!   maps 2 MiB per fault. Measured here: twice as fast an owning load, except right after other
//!   processes churned memory, when the kernel first compacts memory to find huge pages (a load of
//!   1.1 GiB then took 2.3 s instead of 0.6 s). Hence opt-in.

/// Below this a buffer cannot hold an aligned huge page; not worth a system call.
const HUGE_PAGE: usize = 2 << 20;

/// `MADV_POPULATE_WRITE` (Linux 5.14), spelled out for libc versions that lack the constant.
#[cfg(target_os = "linux")]
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// A zeroed byte buffer of `len` bytes for a load to fill; `huge`: advised for huge pages.
pub(crate) fn zeroed_bytes(len: usize, huge: bool) -> Vec<u8> {
    // Large zeroed vectors come from calloc, which maps zero pages without touching them, so the
    // advice still precedes every fault.
    let v = vec![0u8; len];
    if huge {
        advise_huge_pages(v.as_ptr(), len);
    }
    v
}

/// A zeroed `u64` buffer of `len` elements for a load to fill; `huge`: advised for huge pages.
pub(crate) fn zeroed_u64s(len: usize, huge: bool) -> Vec<u64> {
    let v = vec![0u64; len];
    if huge {
        advise_huge_pages(v.as_ptr().cast(), len.saturating_mul(8));
    }
    v
}

/// Asks for huge pages on the page-aligned interior of `[ptr, ptr + len)`. A hint: failure (no
/// THP, another OS) changes nothing but speed.
fn advise_huge_pages(ptr: *const u8, len: usize) {
    #[cfg(target_os = "linux")]
    if len >= 2 * HUGE_PAGE {
        // SAFETY: the range lies inside the live allocation behind `ptr`; MADV_HUGEPAGE only
        // changes how the kernel backs those pages, never their contents.
        unsafe { advise_interior(ptr, len, libc::MADV_HUGEPAGE) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len, HUGE_PAGE);
}

/// Faults in the pages of `buf` in one system call (Linux 5.14+), cheaper than one trap per page
/// when the load's copy touches them. A hint like the above: older kernels refuse it, harmlessly.
pub(crate) fn prefault(buf: &mut [u8]) {
    // SAFETY: the range lies inside `buf`, which we hold mutably; populating for write keeps the
    // contents.
    #[cfg(target_os = "linux")]
    unsafe {
        advise_interior(buf.as_ptr(), buf.len(), MADV_POPULATE_WRITE)
    };
    #[cfg(not(target_os = "linux"))]
    let _ = buf;
}

/// `madvise(advice)` on the whole 4 KiB pages inside `[ptr, ptr + len)`; errors are ignored, the
/// advice being a hint.
///
/// # Safety
/// `[ptr, ptr + len)` lies inside one live allocation, and `advice` keeps its contents.
#[cfg(target_os = "linux")]
unsafe fn advise_interior(ptr: *const u8, len: usize, advice: libc::c_int) {
    let page = 4096usize;
    let start = (ptr as usize).div_ceil(page) * page;
    let end = (ptr as usize + len) / page * page;
    if end > start {
        // SAFETY: by the caller's contract.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, advice) };
    }
}
