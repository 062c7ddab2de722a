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
    /// The summary of `patch` (`git diff` without renames), read from the
    /// patch itself as `git apply` reads it: each `diff --git` section
    /// outside a hunk is a file, and each hunk's lines are counted by its
    /// `@@` header, so no line of a file's content passes for a file. It
    /// comes from the sandbox, whose `git` may say anything: a summary made
    /// by another run (`--numstat`) could name files the patch does not
    /// hold, and hide those it does. What `git apply` would make that a
    /// host program acts on by itself (`.envrc`, `.vscode/tasks.json`, a
    /// `.pth` in `site-packages`: [`crate::hostfs::acted_on_path`]), a symlink and
    /// an executable file are said beside the file. Sums saturate, at most
    /// [`MAX_LISTED`] files are named, each name cut at [`MAX_PATH_SHOWN`].
    pub fn from_patch(patch: &str) -> Self {
        let mut summary = Self::default();
        let mut file: Option<PatchFile> = None;
        // Lines left in the hunk being read: old side, new side.
        let (mut old, mut new) = (0u64, 0u64);
        for line in patch.split('\n') {
            if old > 0 || new > 0 {
                let Some(file) = file.as_mut() else { break };
                match line.as_bytes().first() {
                    Some(b'+') => {
                        new = new.saturating_sub(1);
                        file.added = file.added.saturating_add(1);
                    }
                    Some(b'-') => {
                        old = old.saturating_sub(1);
                        file.removed = file.removed.saturating_add(1);
                    }
                    Some(b'\\') => {}
                    // Context; `git apply` takes an empty line for one too.
                    _ => (old, new) = (old.saturating_sub(1), new.saturating_sub(1)),
                }
                continue;
            }
            if let Some(paths) = line.strip_prefix("diff --git ") {
                if let Some(done) = file.take() {
                    summary.add(done);
                }
                file = Some(PatchFile { path: diff_git_path(paths), ..PatchFile::default() });
                continue;
            }
            let Some(file) = file.as_mut() else { continue };
            if let Some(ranges) = line.strip_prefix("@@ -") {
                (old, new) = hunk_lengths(ranges);
            } else if let Some(path) = line.strip_prefix("+++ ").and_then(|p| side_path(p, "b/")) {
                file.path = path;
            } else if let Some(path) = line.strip_prefix("--- ").and_then(|p| side_path(p, "a/")) {
                file.path = path;
            } else if let Some(mode) = line.strip_prefix("new file mode ").or_else(|| line.strip_prefix("new mode ")) {
                file.mode = Some(mode.trim().to_owned());
            } else if line.starts_with("Binary files ") || line == "GIT binary patch" {
                file.binary = true;
            }
        }
        if let Some(done) = file {
            summary.add(done);
        }
        let unnamed = summary.files_changed.saturating_sub(summary.files.len() as u64);
        if unnamed > 0 {
            summary.files.push(format!("… and {unnamed} more files"));
        }
        summary
    }

    fn add(&mut self, file: PatchFile) {
        self.files_changed = self.files_changed.saturating_add(1);
        self.insertions = self.insertions.saturating_add(file.added);
        self.deletions = self.deletions.saturating_add(file.removed);
        if self.files.len() >= MAX_LISTED {
            return;
        }
        let mut notes =
            vec![if file.binary { "binary".to_owned() } else { format!("+{} -{}", file.added, file.removed) }];
        match file.mode.as_deref() {
            Some("120000") => notes.push("a symlink".into()),
            Some("100755") => notes.push("executable".into()),
            _ => {}
        }
        let parts: Vec<&str> = file.path.split('/').collect();
        if let Some((_, what)) = crate::hostfs::acted_on_path(&parts) {
            notes.push(format!("a host program acts on it by itself: {what}"));
        }
        // A sandbox names its files as it likes: a long name is cut.
        let path = &file.path;
        let mut end = path.len().min(MAX_PATH_SHOWN);
        while !path.is_char_boundary(end) {
            end -= 1;
        }
        let shown = if end < path.len() { format!("{}…", &path[..end]) } else { path.clone() };
        self.files.push(format!("{shown} ({})", notes.join("; ")));
    }
}

/// One file of a patch, as [`DiffSummary::from_patch`] reads it.
#[derive(Debug, Default)]
struct PatchFile {
    path: String,
    added: u64,
    removed: u64,
    binary: bool,
    /// Its mode, when the patch makes or changes one.
    mode: Option<String>,
}

/// The lengths of a hunk from its header after `@@ -`: `OLD[,N] +NEW[,M]
/// @@`; a length left out is 1. Anything else is an empty hunk.
fn hunk_lengths(ranges: &str) -> (u64, u64) {
    let mut sides = ranges.split(' ');
    let length = |side: Option<&str>| -> u64 {
        side.map_or(0, |side| match side.split_once(',') {
            Some((_, n)) => n.parse().unwrap_or(0),
            None => u64::from(side.parse::<u64>().is_ok()),
        })
    };
    let old = length(sides.next());
    let new = length(sides.next().and_then(|s| s.strip_prefix('+')));
    (old, new)
}

/// The path of a `diff --git a/P b/P` header (the two are one path
/// without renames), quoted as git quotes unusual names.
fn diff_git_path(paths: &str) -> String {
    if paths.starts_with('"') {
        return unquote(paths)
            .and_then(|p| p.strip_prefix("a/").map(str::to_owned))
            .unwrap_or_else(|| paths.to_owned());
    }
    // `a/P b/P`: P is half of what is left once `a/`, ` b/` are taken.
    let n = paths.len().saturating_sub(5) / 2;
    match (paths.get(2..2 + n), paths.get(2 + n..)) {
        (Some(path), Some(rest)) if paths.starts_with("a/") && rest.strip_prefix(" b/") == Some(path) => {
            path.to_owned()
        }
        _ => paths.to_owned(),
    }
}

/// The path of a `--- a/P` or `+++ b/P` line, `None` for `/dev/null`.
fn side_path(text: &str, prefix: &str) -> Option<String> {
    let text = text.trim_end_matches('\t');
    if text == "/dev/null" {
        return None;
    }
    let path = if text.starts_with('"') { unquote(text)? } else { text.to_owned() };
    path.strip_prefix(prefix).map(str::to_owned)
}

/// A name git quoted C-style (`"a/x\ty"`); `None` if it is not one.
fn unquote(text: &str) -> Option<String> {
    let inner = text.strip_prefix('"')?;
    let mut bytes = Vec::new();
    let mut chars = inner.bytes();
    while let Some(b) = chars.next() {
        match b {
            b'"' => return Some(String::from_utf8_lossy(&bytes).into_owned()),
            b'\\' => {
                let escaped = chars.next()?;
                bytes.push(match escaped {
                    b'n' => b'\n',
                    b't' => b'\t',
                    b'a' => 7,
                    b'b' => 8,
                    b'f' => 12,
                    b'r' => b'\r',
                    b'v' => 11,
                    b'0'..=b'3' => {
                        let (two, three) = (chars.next()?, chars.next()?);
                        let digit = |d: u8| (b'0'..=b'7').contains(&d).then_some(d - b'0');
                        (escaped - b'0') * 64 + digit(two)? * 8 + digit(three)?
                    }
                    other => other,
                });
            }
            other => bytes.push(other),
        }
    }
    None
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

    /// A patch as `git diff --no-renames` writes one: a change, a binary
    /// file, a deletion, a new symlink, a script, a name git quotes.
    const PATCH: &str = "diff --git a/src/main.rs b/src/main.rs
index 1..2 100644
--- a/src/main.rs
+++ b/src/main.rs
@@ -1,3 +1,5 @@
 fn main() {
-    old();
+    new();
+    more();
+
 }
diff --git a/image.png b/image.png
new file mode 100644
Binary files /dev/null and b/image.png differ
diff --git a/gone.txt b/gone.txt
deleted file mode 100644
--- a/gone.txt
+++ /dev/null
@@ -1,2 +0,0 @@
-a
-b
\\ No newline at end of file
diff --git a/.envrc b/.envrc
new file mode 120000
--- /dev/null
+++ b/.envrc
@@ -0,0 +1 @@
+/etc/passwd
\\ No newline at end of file
diff --git a/run.sh b/run.sh
new file mode 100755
--- /dev/null
+++ b/run.sh
@@ -0,0 +1 @@
+echo hi
diff --git \"a/tab\\there\\303\\251\" \"b/tab\\there\\303\\251\"
new file mode 100644
--- /dev/null
+++ \"b/tab\\there\\303\\251\"
@@ -0,0 +1 @@
+x
";

    #[test]
    fn a_summary_is_read_from_the_patch_itself() {
        let s = DiffSummary::from_patch(PATCH);
        assert_eq!((s.files_changed, s.insertions, s.deletions), (6, 6, 3), "{s:?}");
        assert_eq!(
            s.files,
            [
                "src/main.rs (+3 -1)",
                "image.png (binary)",
                "gone.txt (+0 -2)",
                ".envrc (+1 -0; a symlink; a host program acts on it by itself: direnv runs it)",
                "run.sh (+1 -0; executable)",
                "tab\there\u{e9} (+1 -0)",
            ]
        );
    }

    /// The sandbox writes the patch (its git is its own): what the summary
    /// says is what the patch holds. A file's content that looks like a
    /// header is counted as content, as `git apply` counts it; a hunk that
    /// claims more lines than follow ends with the patch.
    #[test]
    fn no_line_of_a_files_content_passes_for_another_file() {
        let forged = "diff --git a/notes.md b/notes.md
--- a/notes.md
+++ b/notes.md
@@ -0,0 +1,3 @@
+diff --git a/.git/hooks/x b/.git/hooks/x
+@@ -0,0 +1,100 @@
+fine
diff --git a/.vscode/tasks.json b/.vscode/tasks.json
new file mode 100644
--- /dev/null
+++ b/.vscode/tasks.json
@@ -0,0 +1,9 @@
+{}
";
        let s = DiffSummary::from_patch(forged);
        assert_eq!((s.files_changed, s.insertions, s.deletions), (2, 4, 0), "{s:?}");
        assert_eq!(s.files[0], "notes.md (+3 -0)");
        assert!(s.files[1].starts_with(".vscode/tasks.json (+1 -0; a host program acts on it by itself"), "{s:?}");
        assert_eq!(DiffSummary::from_patch(""), DiffSummary::default());
        assert_eq!(DiffSummary::from_patch("not a patch\n@@ -1 +1 @@\n-x\n+y\n").files_changed, 0);
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
        let long = "é".repeat(MAX_PATH_SHOWN);
        let s = DiffSummary::from_patch(&format!("diff --git a/{long} b/{long}\n@@ -0,0 +1 @@\n+x\n"));
        assert!(s.files[0].len() < MAX_PATH_SHOWN + 32 && s.files[0].ends_with("… (+1 -0)"), "{}", s.files[0]);
    }

    #[test]
    fn a_patch_from_the_sandbox_cannot_overflow_or_flood_the_summary() {
        let huge = format!("diff --git a/a b/a\n@@ -0,0 +{m},{m} @@\n+x\n", m = u64::MAX);
        let s = DiffSummary::from_patch(&huge);
        assert_eq!((s.files_changed, s.insertions), (1, 1), "counted by the lines there, not the header's");
        let many: String =
            (0..MAX_LISTED + 5).map(|i| format!("diff --git a/f{i} b/f{i}\n@@ -1 +1 @@\n-a\n+b\n")).collect();
        let s = DiffSummary::from_patch(&many);
        assert_eq!((s.files_changed, s.files.len()), (MAX_LISTED as u64 + 5, MAX_LISTED + 1));
        assert_eq!((s.insertions, s.deletions), (MAX_LISTED as u64 + 5, MAX_LISTED as u64 + 5));
        assert_eq!(s.files[MAX_LISTED], "… and 5 more files");
    }
}
