//! Reserving a file's blocks before writing it (`fallocate`).

use std::fs::File;
use std::io::ErrorKind;
use std::os::fd::AsRawFd;

/// Reserves the file's blocks up front: writes into allocated extents are faster than into a
/// sparse file, and a full disk is reported before any byte is written. Falls back to a sparse
/// `set_len` where the filesystem cannot preallocate.
pub(crate) fn allocate(file: &File, len: u64) -> std::io::Result<()> {
    if len > 0 && reserve(file, 0, len)? {
        return Ok(());
    }
    file.set_len(len)
}

/// Reserves the blocks of bytes `offset..offset + len` of `file` (`fallocate`, growing the file
/// to cover them). `Ok(false)` where the filesystem cannot preallocate.
pub(crate) fn reserve(file: &File, offset: u64, len: u64) -> std::io::Result<bool> {
    let (Ok(offset), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
        return Err(std::io::Error::new(
            ErrorKind::InvalidInput,
            "a range past the largest file offset",
        ));
    };
    // SAFETY: a valid open descriptor and in-range arguments.
    if unsafe { libc::fallocate(file.as_raw_fd(), 0, offset, len) } == 0 {
        return Ok(true);
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => Ok(false),
        _ => Err(err),
    }
}
