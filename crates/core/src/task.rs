//! Tasks: a project imported into a fresh sandbox, worked on, and turned
//! into a patch.
//!
//! `task_start` copies a host project tree (only from allowed roots) into
//! `/workspace` of a new sandbox and commits it as the baseline;
//! `task_diff` shows everything changed since; `task_finish` saves the patch
//! and the log of every command run into a retained record under
//! `<data>/tasks/<id>/` and destroys the sandbox.

use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::CoreError;

/// The most a project import may hold.
pub const MAX_IMPORT_BYTES: u64 = 512 << 20;

/// Output kept per command in the execution log.
pub const LOG_OUTPUT_BYTES: usize = 4096;

/// What a project is written in, guessed from its files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Runtime {
    Python,
    Node,
    Go,
    Rust,
    Shell,
}

impl Runtime {
    /// Guesses from the names of the project's top-level files.
    pub fn detect(names: &[String]) -> Self {
        let has = |n: &str| names.iter().any(|name| name == n);
        if has("Cargo.toml") {
            Self::Rust
        } else if has("go.mod") {
            Self::Go
        } else if has("package.json") {
            Self::Node
        } else if has("pyproject.toml")
            || has("requirements.txt")
            || has("setup.py")
            || names.iter().any(|n| n.ends_with(".py"))
        {
            Self::Python
        } else {
            Self::Shell
        }
    }
}

/// One command run during a task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogEntry {
    pub command: String,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub started_at: u64,
    pub duration_ms: u64,
    /// The first [`LOG_OUTPUT_BYTES`] of stdout and of stderr.
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

impl DiffSummary {
    /// Parses `git diff --numstat`.
    pub fn from_numstat(numstat: &str) -> Self {
        let mut summary = Self::default();
        for line in numstat.lines() {
            let mut fields = line.splitn(3, '\t');
            let (Some(added), Some(removed), Some(path)) = (fields.next(), fields.next(), fields.next()) else {
                continue;
            };
            summary.files_changed += 1;
            match (added.parse::<u64>(), removed.parse::<u64>()) {
                (Ok(a), Ok(r)) => {
                    summary.insertions += a;
                    summary.deletions += r;
                    summary.files.push(format!("{path} (+{a} -{r})"));
                }
                _ => summary.files.push(format!("{path} (binary)")),
            }
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

/// Every retained record, oldest first.
pub fn records(data_dir: &Path) -> Vec<TaskRecord> {
    let mut records: Vec<TaskRecord> = std::fs::read_dir(tasks_dir(data_dir))
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| std::fs::read_to_string(e.path().join("record.json")).ok())
        .filter_map(|text| serde_json::from_str(&text).ok())
        .collect();
    records.sort_by_key(|r| r.task.started_at);
    records
}

/// Removes a record and its patch and log.
pub fn remove_record(data_dir: &Path, id: &str) -> Result<(), CoreError> {
    let valid = id.starts_with("task-") && id.len() <= 32 && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
    let dir = tasks_dir(data_dir).join(id);
    if !valid || !dir.join("record.json").exists() {
        let known: Vec<String> = records(data_dir).into_iter().map(|r| r.task.id).collect();
        return Err(CoreError::UnknownTask { id: id.into(), known });
    }
    std::fs::remove_dir_all(&dir).map_err(|source| CoreError::Io {
        id: id.into(),
        what: "removing the task record".into(),
        source,
    })
}

/// The roots projects may be imported from: `$MOAT_ROOTS` (colon-separated)
/// or the current directory.
pub fn allowed_roots() -> Vec<PathBuf> {
    match std::env::var_os("MOAT_ROOTS").filter(|v| !v.is_empty()) {
        Some(roots) => std::env::split_paths(&roots).collect(),
        None => std::env::current_dir().into_iter().collect(),
    }
}

/// Checks that `path` may be imported: inside an allowed root, not `$HOME`
/// itself nor a dot directory in it. Returns it canonicalized.
pub fn check_import_path(path: &Path, roots: &[PathBuf]) -> Result<PathBuf, CoreError> {
    let path = check_host_path(path, roots)?;
    if !path.is_dir() {
        return Err(CoreError::ImportRefused(format!(
            "{} is not a directory; give a project directory",
            path.display()
        )));
    }
    Ok(path)
}

/// Checks that `path` (which may not exist yet, when it is a copy's
/// destination) lies inside an allowed root, and is not `$HOME` itself nor
/// inside a dot directory of it. Returns it with its parent canonicalized.
pub fn check_host_path(path: &Path, roots: &[PathBuf]) -> Result<PathBuf, CoreError> {
    let refuse = |why: String| Err(CoreError::ImportRefused(why));
    let path = match path.canonicalize() {
        Ok(path) => path,
        Err(_) => match (path.parent().and_then(|p| p.canonicalize().ok()), path.file_name()) {
            (Some(parent), Some(name)) if path.is_absolute() => parent.join(name),
            _ => return refuse(format!("{} does not exist or cannot be read (give an absolute path)", path.display())),
        },
    };
    if let Some(home) = std::env::var_os("HOME").map(PathBuf::from).and_then(|h| h.canonicalize().ok()) {
        if path == home {
            return refuse(format!("{} is the home directory; give a project directory inside it", path.display()));
        }
        if let Ok(rest) = path.strip_prefix(&home)
            && rest.components().next().is_some_and(|c| c.as_os_str().to_string_lossy().starts_with('.'))
        {
            return refuse(format!("{} is inside a hidden directory of the home directory", path.display()));
        }
    }
    let roots: Vec<PathBuf> = roots.iter().filter_map(|r| r.canonicalize().ok()).collect();
    if !roots.iter().any(|root| path.starts_with(root)) {
        let list = roots.iter().map(|r| r.display().to_string()).collect::<Vec<_>>().join(", ");
        return refuse(format!("{} is outside the allowed roots ({list}); set MOAT_ROOTS to allow it", path.display()));
    }
    Ok(path)
}

/// Tars the project at `root` (without its `.git`), refusing symlinks that
/// point outside it. Returns the archive, the number of files, and the
/// names of its top-level entries.
pub fn pack_project(root: &Path) -> Result<(Vec<u8>, u64, Vec<String>), CoreError> {
    let refuse = |why: String| CoreError::ImportRefused(why);
    let mut builder = tar::Builder::new(Vec::new());
    builder.follow_symlinks(false);
    let mut files = 0u64;
    let mut bytes = 0u64;
    let mut top = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let mut entries: Vec<_> = std::fs::read_dir(&dir)
            .map_err(|e| refuse(format!("cannot read {}: {e}", dir.display())))?
            .filter_map(Result::ok)
            .collect();
        entries.sort_by_key(std::fs::DirEntry::file_name);
        for entry in entries {
            let path = entry.path();
            let rel = path.strip_prefix(root).unwrap_or(&path).to_path_buf();
            if rel == Path::new(".git") {
                continue;
            }
            if dir == root {
                top.push(entry.file_name().to_string_lossy().into_owned());
            }
            let meta = std::fs::symlink_metadata(&path).map_err(|e| refuse(format!("{}: {e}", path.display())))?;
            if meta.file_type().is_symlink() {
                let target = std::fs::read_link(&path).map_err(|e| refuse(format!("{}: {e}", path.display())))?;
                if !stays_inside(&rel, &target) {
                    return Err(refuse(format!(
                        "the symlink {} points outside the project ({}); remove it or make it relative inside",
                        rel.display(),
                        target.display()
                    )));
                }
            } else if meta.is_dir() {
                stack.push(path.clone());
            } else if meta.is_file() {
                bytes += meta.len();
                if bytes > MAX_IMPORT_BYTES {
                    return Err(refuse(format!("the project is larger than {} MiB", MAX_IMPORT_BYTES >> 20)));
                }
            } else {
                continue;
            }
            builder
                .append_path_with_name(&path, &rel)
                .map_err(|e| refuse(format!("cannot archive {}: {e}", path.display())))?;
            files += 1;
        }
    }
    let archive = builder.into_inner().map_err(|e| refuse(format!("cannot finish the archive: {e}")))?;
    Ok((archive, files, top))
}

/// Whether a symlink at `link` (relative to the project root) with `target`
/// resolves inside the project, lexically.
pub fn stays_inside(link: &Path, target: &Path) -> bool {
    if target.is_absolute() {
        return false;
    }
    let mut depth: i64 = link.parent().map_or(0, |p| p.components().count() as i64);
    for component in target.components() {
        match component {
            Component::ParentDir => depth -= 1,
            Component::Normal(_) => depth += 1,
            _ => {}
        }
        if depth < 0 {
            return false;
        }
    }
    true
}

/// Unpacks an archive that came out of a sandbox into the new host
/// directory `dest`: entries that would land outside it, links that point
/// outside it, devices and set-id bits are refused or dropped. Returns
/// files and bytes written.
pub fn unpack_untrusted(archive: &[u8], dest: &Path) -> Result<(u64, u64), CoreError> {
    let refuse = |why: String| CoreError::ImportRefused(why);
    std::fs::create_dir_all(dest).map_err(|e| refuse(format!("cannot create {}: {e}", dest.display())))?;
    let mut archive = tar::Archive::new(archive);
    archive.set_preserve_permissions(false);
    archive.set_unpack_xattrs(false);
    let (mut files, mut bytes) = (0u64, 0u64);
    for entry in archive.entries().map_err(|e| refuse(format!("bad archive: {e}")))? {
        let mut entry = entry.map_err(|e| refuse(format!("bad archive entry: {e}")))?;
        let path = entry.path().map_err(|e| refuse(format!("bad entry name: {e}")))?.into_owned();
        let kind = entry.header().entry_type();
        let allowed = kind.is_file()
            || kind.is_dir()
            || (kind.is_symlink()
                && entry.link_name().ok().flatten().is_some_and(|target| stays_inside(&path, &target)));
        if !allowed {
            tracing::warn!(path = %path.display(), "skipped an entry that is not a file, directory or inside link");
            continue;
        }
        bytes += entry.header().size().unwrap_or(0);
        if entry.unpack_in(dest).map_err(|e| refuse(format!("cannot write {}: {e}", path.display())))? {
            files += 1;
        }
    }
    Ok((files, bytes))
}

/// Whether a task source names a Git remote rather than a host path.
pub fn is_git_url(source: &str) -> bool {
    ["https://", "http://", "ssh://", "git://", "git@"].iter().any(|p| source.starts_with(p))
}

/// Cuts `bytes` to [`LOG_OUTPUT_BYTES`] as text; the flag says whether it cut.
pub fn clip(bytes: &[u8]) -> (String, bool) {
    let cut = bytes.len() > LOG_OUTPUT_BYTES;
    (String::from_utf8_lossy(&bytes[..bytes.len().min(LOG_OUTPUT_BYTES)]).into_owned(), cut)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtimes_are_guessed_from_files() {
        let names = |list: &[&str]| list.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(Runtime::detect(&names(&["Cargo.toml", "src"])), Runtime::Rust);
        assert_eq!(Runtime::detect(&names(&["package.json"])), Runtime::Node);
        assert_eq!(Runtime::detect(&names(&["main.py"])), Runtime::Python);
        assert_eq!(Runtime::detect(&names(&["go.mod"])), Runtime::Go);
        assert_eq!(Runtime::detect(&names(&["run.sh"])), Runtime::Shell);
    }

    #[test]
    fn symlinks_that_leave_the_project_are_refused() {
        assert!(stays_inside(Path::new("a/link"), Path::new("../b")));
        assert!(!stays_inside(Path::new("a/link"), Path::new("../../etc/passwd")));
        assert!(!stays_inside(Path::new("link"), Path::new("/etc/passwd")));
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("ok.txt"), "x").expect("write");
        std::os::unix::fs::symlink("ok.txt", dir.path().join("inside")).expect("symlink");
        pack_project(dir.path()).expect("inside links are fine");
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("outside")).expect("symlink");
        let err = pack_project(dir.path()).expect_err("refused").to_string();
        assert!(err.contains("points outside the project"), "{err}");
    }

    #[test]
    fn imports_only_from_allowed_roots() {
        let root = tempfile::tempdir().expect("tempdir");
        let project = root.path().join("proj");
        std::fs::create_dir(&project).expect("mkdir");
        check_import_path(&project, &[root.path().to_path_buf()]).expect("inside");
        let other = tempfile::tempdir().expect("tempdir");
        let err = check_import_path(other.path(), &[root.path().to_path_buf()]).expect_err("outside").to_string();
        assert!(err.contains("outside the allowed roots"), "{err}");
        assert!(check_import_path(&root.path().join("missing"), &[root.path().to_path_buf()]).is_err());
    }

    #[test]
    fn numstat_summaries() {
        let s = DiffSummary::from_numstat("3\t1\tsrc/main.rs\n-\t-\timage.png\n0\t5\tgone.txt\n");
        assert_eq!((s.files_changed, s.insertions, s.deletions), (3, 3, 6));
        assert_eq!(s.files[1], "image.png (binary)");
    }
}
