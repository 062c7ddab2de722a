//! The binaries' logs: `MOAT_LOG_LEVEL` and `MOAT_LOG_FILE`, read the same
//! way by `moat` and `moat-mcp`.
//!
//! A level is one of the five `tracing` has, in any case, or a name other
//! logging systems use for one of them (`WARNING`, `ERR`, `CRITICAL`…): an
//! operator copying a setting from another tool gets the level it meant,
//! not an exit. Logs go to stderr and, with `MOAT_LOG_FILE`, are appended
//! to that file too (created owner-only; no colours).

use std::path::Path;
use std::str::FromStr;

/// What `MOAT_LOG_LEVEL` may say, for error messages.
pub const LEVELS: &str =
    "error, warn, info, debug or trace, in any case (or warning, err, critical, fatal, notice, information)";

/// How much the binaries log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

impl LogLevel {
    /// The name `tracing`'s filters take.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Error => "error",
            Self::Warn => "warn",
            Self::Info => "info",
            Self::Debug => "debug",
            Self::Trace => "trace",
        }
    }
}

impl FromStr for LogLevel {
    type Err = String;

    /// Reads a level, in any case, with the other names it goes by.
    fn from_str(value: &str) -> Result<Self, String> {
        match value.trim().to_ascii_lowercase().as_str() {
            "error" | "err" | "critical" | "crit" | "fatal" | "alert" | "emerg" => Ok(Self::Error),
            "warn" | "warning" => Ok(Self::Warn),
            "info" | "information" | "notice" => Ok(Self::Info),
            "debug" => Ok(Self::Debug),
            "trace" => Ok(Self::Trace),
            _ => Err(format!("MOAT_LOG_LEVEL={value:?} is invalid: {LEVELS}")),
        }
    }
}

/// The target of records a binary has already said on stderr in its own
/// words (why it stops, where it serves): they go to the log file only.
pub const SAID: &str = "moat::said";

/// Opens `path` for appending the logs: never through a symlink (its last
/// name, so not `/dev/stderr` either: stderr gets the logs anyway), and
/// only a regular file of this process's own user that others may neither
/// read nor write (its group may read it), made owner-only when it is new. A log holds what
/// tool calls asked and what sandboxes said: a file someone else made
/// beforehand in a shared directory would hand them every line.
fn open_log_file(path: &Path) -> Result<std::fs::File, String> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let refuse = |why: String| format!("MOAT_LOG_FILE={}: {why}", path.display());
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| refuse(format!("cannot open it for appending ({e}); it must not be a symlink")))?;
    let meta = file.metadata().map_err(|e| refuse(format!("cannot read its metadata ({e})")))?;
    if !meta.file_type().is_file() {
        return Err(refuse("not a regular file".into()));
    }
    if meta.uid() != nix::unistd::geteuid().as_raw() {
        return Err(refuse(format!(
            "owned by uid {}, not by the user moat runs as; remove it, or name a file of your own",
            meta.uid()
        )));
    }
    // Group read is allowed (logrotate's `create 0640 root adm`); writing
    // by the group, or anything by others, is not.
    if meta.mode() & 0o027 != 0 {
        return Err(refuse(format!(
            "others may read or write it, or its group write it (mode {:o}); chmod 600 it, or name a new file",
            meta.mode() & 0o777
        )));
    }
    Ok(file)
}

/// Installs the process's logger: everything at `level` and above (and
/// each of `directives`, `target=level`, on top) to stderr, and appended
/// to `file` when one is given. Fails only when the file cannot be opened.
pub fn init(level: LogLevel, directives: &[&str], file: Option<&Path>) -> Result<(), String> {
    use tracing_subscriber::layer::{Layer, SubscriberExt};
    use tracing_subscriber::util::SubscriberInitExt;

    let file = match file {
        Some(path) => Some(open_log_file(path)?),
        None => None,
    };
    let mut filter = tracing_subscriber::EnvFilter::new(level.as_str());
    for directive in directives {
        if let Ok(directive) = directive.parse() {
            filter = filter.add_directive(directive);
        }
    }
    let to_file = file.map(|f| tracing_subscriber::fmt::layer().with_ansi(false).with_writer(std::sync::Mutex::new(f)));
    let not_said = tracing_subscriber::filter::filter_fn(|meta| meta.target() != SAID);
    tracing_subscriber::registry()
        .with(filter)
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_filter(not_said))
        .with(to_file)
        .try_init()
        .map_err(|e| format!("cannot install the logger: {e}"))
}

/// `MOAT_LOG_LEVEL` (`default` when unset or empty) and `MOAT_LOG_FILE`
/// from the environment; the error names the variable and what it may be.
pub fn from_env(default: LogLevel) -> Result<(LogLevel, Option<std::path::PathBuf>), String> {
    let level = match std::env::var("MOAT_LOG_LEVEL") {
        Ok(value) if !value.trim().is_empty() => value.parse()?,
        _ => default,
    };
    let file = std::env::var_os("MOAT_LOG_FILE").filter(|f| !f.is_empty()).map(std::path::PathBuf::from);
    Ok((level, file))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_file_is_ours_alone_and_never_a_link() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let new = dir.path().join("moat.log");
        open_log_file(&new).expect("a new file is made");
        assert_eq!(std::fs::metadata(&new).expect("stat").permissions().mode() & 0o777, 0o600);
        open_log_file(&new).expect("and appended to again");
        let target = dir.path().join("target");
        std::fs::write(&target, "").expect("write");
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let link = dir.path().join("link.log");
        std::os::unix::fs::symlink(&target, &link).expect("symlink");
        let err = open_log_file(&link).expect_err("a link");
        assert!(err.contains("must not be a symlink"), "{err}");
        let shared = dir.path().join("shared.log");
        std::fs::write(&shared, "").expect("write");
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let err = open_log_file(&shared).expect_err("readable by others");
        assert!(err.contains("others may read or write it, or its group write it (mode 644)"), "{err}");
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o640)).expect("chmod");
        open_log_file(&shared).expect("a log its group may read (logrotate's 0640)");
        if nix::unistd::geteuid().is_root() {
            std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o600)).expect("chmod");
            nix::unistd::chown(&shared, Some(nix::unistd::Uid::from_raw(4242)), None).expect("chown");
            let err = open_log_file(&shared).expect_err("someone else's");
            assert!(err.contains("owned by uid 4242"), "{err}");
        }
    }

    #[test]
    fn levels_are_read_in_any_case_and_by_their_other_names() {
        for (text, level) in [
            ("warn", LogLevel::Warn),
            ("WARNING", LogLevel::Warn),
            ("Warning", LogLevel::Warn),
            (" info ", LogLevel::Info),
            ("ERR", LogLevel::Error),
            ("CRITICAL", LogLevel::Error),
            ("fatal", LogLevel::Error),
            ("notice", LogLevel::Info),
            ("DEBUG", LogLevel::Debug),
            ("Trace", LogLevel::Trace),
        ] {
            assert_eq!(text.parse::<LogLevel>(), Ok(level), "{text}");
        }
        for text in ["loud", "", "warn,rmcp=debug", "5"] {
            let err = text.parse::<LogLevel>().expect_err(text);
            assert!(err.contains("MOAT_LOG_LEVEL") && err.contains("error, warn, info, debug or trace"), "{err}");
        }
    }
}
