//! Turning local failures into the typed errors the agent sends.

use std::io;

use moat_proto::{ErrorKind, WireError};

/// A wire error for an I/O failure on `what` (usually a path), with the kind
/// a client can branch on and a message that says what to do.
pub fn io_error(what: &str, err: &io::Error) -> WireError {
    use io::ErrorKind as Io;
    let (kind, hint) = match err.kind() {
        Io::NotFound => (ErrorKind::NotFound, "no such file or directory"),
        Io::IsADirectory => (ErrorKind::IsADirectory, "is a directory; use a directory operation (list, tar) instead"),
        Io::NotADirectory => (ErrorKind::NotADirectory, "a component of the path is not a directory"),
        Io::DirectoryNotEmpty => (ErrorKind::DirectoryNotEmpty, "directory not empty; remove it recursively"),
        Io::PermissionDenied => (ErrorKind::PermissionDenied, "permission denied"),
        Io::ReadOnlyFilesystem => (ErrorKind::PermissionDenied, "read-only file system"),
        Io::AlreadyExists => (ErrorKind::AlreadyExists, "already exists"),
        Io::StorageFull | Io::QuotaExceeded => {
            (ErrorKind::NoSpace, "no space left on the sandbox's disk; delete files")
        }
        Io::FileTooLarge => (ErrorKind::TooLarge, "file too large"),
        Io::InvalidFilename => (ErrorKind::InvalidPath, "name too long or invalid"),
        Io::CrossesDevices => (ErrorKind::InvalidRequest, "cannot move a directory across file systems"),
        Io::ConnectionRefused => (ErrorKind::ConnectionRefused, "connection refused"),
        Io::InvalidInput | Io::InvalidData => (ErrorKind::InvalidRequest, "invalid input"),
        _ => (ErrorKind::Io, "I/O error"),
    };
    WireError::new(kind, format!("{what}: {hint} ({err})"))
}

/// A wire error for a request the agent refuses before doing anything.
pub fn invalid(message: impl Into<String>) -> WireError {
    WireError::new(ErrorKind::InvalidRequest, message)
}

/// A wire error for a path the agent refuses to use.
pub fn bad_path(path: &str, why: &str) -> WireError {
    WireError::new(ErrorKind::InvalidPath, format!("{path:?}: {why}"))
}

/// The largest path the agent accepts, in bytes (Linux's `PATH_MAX`).
const PATH_MAX: usize = 4096;

/// Checks that a path from a request is usable: absolute, no NUL byte, not
/// longer than `PATH_MAX`.
pub fn check_path(path: &str) -> Result<&std::path::Path, WireError> {
    if path.is_empty() {
        return Err(bad_path(path, "empty path; give an absolute path such as /home/user/file.txt"));
    }
    if !path.starts_with('/') {
        return Err(bad_path(path, "relative path; give an absolute path such as /home/user/file.txt"));
    }
    if path.contains('\0') {
        return Err(bad_path(path, "contains a NUL byte, which no Linux path may hold"));
    }
    if path.len() > PATH_MAX {
        let head: String = path.chars().take(40).collect();
        return Err(bad_path(&head, "longer than 4096 bytes"));
    }
    Ok(std::path::Path::new(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_checked() {
        assert!(check_path("/a/b").is_ok());
        for bad in ["", "a/b", "/a\0b"] {
            assert_eq!(check_path(bad).expect_err(bad).kind, ErrorKind::InvalidPath);
        }
        let long = format!("/{}", "x".repeat(5000));
        assert_eq!(check_path(&long).expect_err("too long").kind, ErrorKind::InvalidPath);
        // A multi-byte character across the cut must not panic.
        let long = format!("/{}{}", "x".repeat(38), "é".repeat(3000));
        assert_eq!(check_path(&long).expect_err("too long").kind, ErrorKind::InvalidPath);
    }

    #[test]
    fn io_errors_keep_their_kind() {
        let e = io_error("/nope", &io::Error::from_raw_os_error(libc::ENOENT));
        assert_eq!(e.kind, ErrorKind::NotFound);
        assert!(e.message.starts_with("/nope: no such file"), "{}", e.message);
    }
}
