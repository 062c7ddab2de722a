//! Tasks: a project imported into a fresh sandbox, worked on, and turned
//! into a patch.
//!
//! `task_start` copies a host project tree (only from shared roots, see
//! [`crate::hostfs`]) into
//! `/workspace` of a new sandbox and commits it as the baseline;
//! `task_diff` shows everything changed since; `task_finish` saves the patch
//! and the log of every command run into a retained record under
//! `<data>/tasks/<id>/` and destroys the sandbox.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{ConfigError, IoError, TaskError};
use crate::runtime::Runtime;

/// Output kept per command in the execution log.
pub const LOG_OUTPUT_BYTES: usize = 4096;

/// The most commands a task's execution log keeps (the newest): with each
/// entry's command and output clipped to [`LOG_OUTPUT_BYTES`], a task's
/// log holds at most about 12 MiB of the host's memory, and of its record.
pub const LOG_ENTRIES: usize = 1024;

/// One command run during a task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogEntry {
    pub command: String,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub started_at: u64,
    pub duration_ms: u64,
    /// The first [`LOG_OUTPUT_BYTES`] of the command, of stdout and of
    /// stderr; `truncated` says whether any was cut.
    pub stdout: String,
    pub stderr: String,
    pub truncated: bool,
}

/// A task in progress.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Task {
    pub id: String,
    pub sandbox_id: String,
    /// The host path the project came from.
    pub source: String,
    pub runtime: Runtime,
    /// The version of the runtime's toolchain in the sandbox, when it has it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_version: Option<String>,
    pub files: u64,
    pub started_at: u64,
}

/// Files changed, lines added and removed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiffSummary {
    pub files_changed: u64,
    pub insertions: u64,
    pub deletions: u64,
    /// `path (+added -removed)`, or `path (binary)`.
    pub files: Vec<String>,
}

/// The most files a summary (or a task's top-level listing) names; the
/// rest are counted.
pub const MAX_LISTED: usize = 1000;

impl DiffSummary {
    /// Parses `git diff --numstat -z` (without renames: one record per
    /// file, `added TAB removed TAB path NUL`). It comes from the sandbox:
    /// figures that are not plain counts are taken as a binary file's, sums
    /// saturate, and at most [`MAX_LISTED`] files are named.
    pub fn from_numstat(numstat: &str) -> Self {
        let mut summary = Self::default();
        let count =
            |field: &str| field.bytes().all(|b| b.is_ascii_digit()).then(|| field.parse::<u64>().ok()).flatten();
        for record in numstat.split('\0') {
            let mut fields = record.splitn(3, '\t');
            let (Some(added), Some(removed), Some(path)) = (fields.next(), fields.next(), fields.next()) else {
                continue;
            };
            summary.files_changed = summary.files_changed.saturating_add(1);
            let named = summary.files.len() < MAX_LISTED;
            // A sandbox names its files as it likes: a long name is cut.
            let mut end = path.len().min(MAX_PATH_SHOWN);
            while !path.is_char_boundary(end) {
                end -= 1;
            }
            let path = if end < path.len() { format!("{}…", &path[..end]) } else { path.to_owned() };
            match (count(added), count(removed)) {
                (Some(a), Some(r)) => {
                    summary.insertions = summary.insertions.saturating_add(a);
                    summary.deletions = summary.deletions.saturating_add(r);
                    if named {
                        summary.files.push(format!("{path} (+{a} -{r})"));
                    }
                }
                _ if named => summary.files.push(format!("{path} (binary)")),
                _ => {}
            }
        }
        let unnamed = summary.files_changed.saturating_sub(summary.files.len() as u64);
        if unnamed > 0 {
            summary.files.push(format!("… and {unnamed} more files"));
        }
        summary
    }
}

/// A finished task, retained under `<data>/tasks/<id>/`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskRecord {
    pub task: Task,
    pub finished_at: u64,
    pub patch_path: PathBuf,
    pub log_path: PathBuf,
    pub summary: DiffSummary,
    /// The sandbox was kept running (`keep_sandbox`).
    pub sandbox_kept: bool,
}

/// The directory holding task records.
pub fn tasks_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("tasks")
}

/// The largest `record.json` read: a summary names at most
/// [`MAX_LISTED`] paths of at most [`MAX_PATH_SHOWN`] bytes each, which
/// JSON escapes to at most six bytes each (a control byte as `\u00XX`):
/// about 3 MiB.
pub const RECORD_MAX: u64 = 8 << 20;

/// The most of one path a summary keeps, in bytes.
pub const MAX_PATH_SHOWN: usize = 512;

/// The default of `MOAT_TASK_RECORDS_MIB`: what the retained records may
/// hold in all.
pub const DEFAULT_RECORDS_MIB: u64 = 2048;

/// The most the retained task records may hold in all, in bytes
/// (`MOAT_TASK_RECORDS_MIB`, 1–1048576 MiB; [`DEFAULT_RECORDS_MIB`] unset).
pub fn records_limit_from_env() -> Result<u64, ConfigError> {
    crate::hostfs::mib_from_env("MOAT_TASK_RECORDS_MIB", DEFAULT_RECORDS_MIB)
}

/// What the retained records hold now, in bytes: the files of each record
/// directory (its patch, log and `record.json`), by their size, links not
/// followed.
pub fn records_size(data_dir: &Path) -> u64 {
    std::fs::read_dir(tasks_dir(data_dir))
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter(|dir| dir.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|dir| std::fs::read_dir(dir.path()).ok())
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|file| file.metadata().ok())
        .map(|meta| meta.len())
        .fold(0, u64::saturating_add)
}

/// Whether a record of `needed` bytes fits beside the retained ones within
/// `limit`: a model finishing tasks in a loop keeps no more than the
/// operator allows in moat's data directory. The refusal says how to make
/// room; the task stays in progress.
pub fn room_for_record(data_dir: &Path, id: &str, needed: u64, limit: u64) -> Result<(), TaskError> {
    let held = records_size(data_dir);
    if held.saturating_add(needed) <= limit {
        return Ok(());
    }
    let mib = |bytes: u64| bytes.div_ceil(1 << 20);
    Err(TaskError::RecordsFull(format!(
        "task {id}'s record needs {} MiB, and the retained task records hold {} MiB of the {} MiB this server \
         keeps (MOAT_TASK_RECORDS_MIB, in {}); remove records you no longer need with remove_task (list_tasks \
         names them), then finish the task again: it stays in progress, its sandbox and work kept",
        mib(needed),
        mib(held),
        mib(limit),
        tasks_dir(data_dir).display()
    )))
}

/// Every retained record, oldest first.
pub fn records(data_dir: &Path) -> Vec<TaskRecord> {
    let mut records: Vec<TaskRecord> = std::fs::read_dir(tasks_dir(data_dir))
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| read_record(&e.path()))
        .collect();
    records.sort_by_key(|r| r.task.started_at);
    records
}

/// The record of task `id`, if it is retained.
pub fn record(data_dir: &Path, id: &str) -> Option<TaskRecord> {
    valid_task_id(id).then(|| read_record(&tasks_dir(data_dir).join(id))).flatten()
}

/// Whether `id` can name a task: `task-` and letters, digits and dashes,
/// at most 32 bytes (so it names a directory beneath the tasks' and only
/// that).
fn valid_task_id(id: &str) -> bool {
    id.starts_with("task-") && id.len() <= 32 && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
}

/// A record directory's `record.json`: a regular file of at most
/// [`RECORD_MAX`] bytes ([`crate::hostfs::read_small_file`]).
fn read_record(dir: &Path) -> Option<TaskRecord> {
    let dir = std::fs::File::open(dir).ok()?;
    serde_json::from_slice(&crate::hostfs::read_small_file(&dir, "record.json", RECORD_MAX)?).ok()
}

/// Removes a record and its patch and log.
pub fn remove_record(data_dir: &Path, id: &str) -> Result<(), TaskError> {
    let dir = tasks_dir(data_dir).join(id);
    if !valid_task_id(id) || !dir.join("record.json").exists() {
        let known: Vec<String> = records(data_dir).into_iter().map(|r| r.task.id).collect();
        return Err(TaskError::UnknownTask { id: id.into(), known });
    }
    std::fs::remove_dir_all(&dir)
        .map_err(|source| IoError { id: id.into(), what: "removing the task record".into(), source }.into())
}

/// Whether a task source names a Git remote rather than a host path.
pub fn is_git_url(source: &str) -> bool {
    ["https://", "http://", "ssh://", "git://", "git@"].iter().any(|p| source.starts_with(p))
        || crate::net::gitssh::SshRemote::parse(source).is_some()
}

/// Cuts `bytes` to at most [`LOG_OUTPUT_BYTES`] of text (invalid UTF-8
/// becomes U+FFFD, three bytes for each byte it replaces, so the text is
/// cut again, at a character's boundary); the flag says whether it cut.
pub fn clip(bytes: &[u8]) -> (String, bool) {
    let mut text = String::from_utf8_lossy(&bytes[..bytes.len().min(LOG_OUTPUT_BYTES)]).into_owned();
    let mut cut = bytes.len() > LOG_OUTPUT_BYTES;
    if text.len() > LOG_OUTPUT_BYTES {
        let mut end = LOG_OUTPUT_BYTES;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        cut = true;
    }
    (text, cut)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_output_is_clipped_as_text_whatever_its_bytes() {
        let (text, cut) = clip(&[0xff; LOG_OUTPUT_BYTES]);
        assert!(cut && text.len() <= LOG_OUTPUT_BYTES && text.chars().all(|c| c == '\u{fffd}'), "{}", text.len());
        let (text, cut) = clip(b"short");
        assert_eq!((text.as_str(), cut), ("short", false));
        let (text, cut) = clip(&vec![b'a'; LOG_OUTPUT_BYTES + 1]);
        assert!(cut && text.len() == LOG_OUTPUT_BYTES);
    }

    /// Records kept add up against the operator's limit; one past it is
    /// refused with how to make room, and fits once a record is removed.
    #[test]
    fn retained_records_stay_within_the_operators_limit() {
        let data = tempfile::tempdir().expect("tempdir");
        let record = |id: &str, patch: usize| {
            let dir = tasks_dir(data.path()).join(id);
            std::fs::create_dir_all(&dir).expect("mkdir");
            std::fs::write(dir.join("patch.diff"), vec![b'+'; patch]).expect("patch");
            std::fs::write(dir.join("log.json"), "[]").expect("log");
            std::fs::write(dir.join("record.json"), "{}").expect("record");
        };
        assert_eq!(records_size(data.path()), 0, "no tasks directory yet");
        record("task-a", 600 << 10);
        record("task-b", 300 << 10);
        // A link in a record counts as itself, not as what it names.
        let big = data.path().join("big");
        std::fs::write(&big, vec![0u8; 4 << 20]).expect("big");
        std::os::unix::fs::symlink(&big, tasks_dir(data.path()).join("task-b/extra")).expect("link");
        let held = records_size(data.path());
        assert!((900 << 10..(900 << 10) + 4096).contains(&held), "{held}");
        let limit = 1 << 20;
        room_for_record(data.path(), "task-c", (1 << 20) - held, limit).expect("fits exactly");
        let refused = room_for_record(data.path(), "task-c", 200 << 10, limit).expect_err("past the limit");
        let text = refused.to_string();
        assert!(
            text.contains("task task-c's record needs 1 MiB") && text.contains("hold 1 MiB of the 1 MiB"),
            "{text}"
        );
        assert!(text.contains("MOAT_TASK_RECORDS_MIB") && text.contains("remove_task"), "{text}");
        remove_record(data.path(), "task-a").expect("removed");
        room_for_record(data.path(), "task-c", 200 << 10, limit).expect("fits once a record is gone");
    }

    #[test]
    fn numstat_summaries() {
        let s = DiffSummary::from_numstat("3\t1\tsrc/main.rs\u{0}-\t-\timage.png\u{0}0\t5\tgone.txt\u{0}");
        assert_eq!((s.files_changed, s.insertions, s.deletions), (3, 3, 6));
        assert_eq!(s.files[1], "image.png (binary)");
        // A name with a newline or a tab is one name.
        let s = DiffSummary::from_numstat("1\t0\ta\nb\tc.txt\u{0}");
        assert_eq!((s.files_changed, s.files[0].as_str()), (1, "a\nb\tc.txt (+1 -0)"));
    }

    #[test]
    fn a_record_too_large_or_not_a_file_is_not_read() {
        let data = tempfile::tempdir().expect("tempdir");
        let dir = tasks_dir(data.path()).join("task-big");
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::File::create(dir.join("record.json")).and_then(|f| f.set_len(RECORD_MAX + 1)).expect("big");
        assert!(record(data.path(), "task-big").is_none());
        let fifo = tasks_dir(data.path()).join("task-fifo");
        std::fs::create_dir_all(&fifo).expect("mkdir");
        nix::unistd::mkfifo(&fifo.join("record.json"), nix::sys::stat::Mode::from_bits_truncate(0o600)).expect("fifo");
        assert!(records(data.path()).is_empty(), "a FIFO was waited on or a huge record read");
        assert!(record(data.path(), "../x").is_none());
        let s = DiffSummary::from_numstat(&format!("1\t0\t{}\0", "é".repeat(MAX_PATH_SHOWN)));
        assert!(s.files[0].len() < MAX_PATH_SHOWN + 32 && s.files[0].ends_with("… (+1 -0)"), "{}", s.files[0]);
    }

    #[test]
    fn a_numstat_from_the_sandbox_cannot_overflow_or_flood_the_summary() {
        let huge = format!("{m}\t{m}\ta\x00{m}\t{m}\tb\x00+5\t1\tc\x00", m = u64::MAX);
        let s = DiffSummary::from_numstat(&huge);
        assert_eq!((s.files_changed, s.insertions, s.deletions), (3, u64::MAX, u64::MAX));
        assert_eq!(s.files[2], "c (binary)", "only plain counts are counts");
        let many: String = (0..MAX_LISTED + 5).map(|i| format!("1\t1\tf{i}\u{0}")).collect();
        let s = DiffSummary::from_numstat(&many);
        assert_eq!((s.files_changed, s.files.len()), (MAX_LISTED as u64 + 5, MAX_LISTED + 1));
        assert_eq!(s.files[MAX_LISTED], "… and 5 more files");
    }
}
