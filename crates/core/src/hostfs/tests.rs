use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};

use super::*;

const MIB: u64 = 1 << 20;
const MIB_BYTES: usize = 1 << 20;

/// One raw archive entry: name, type, link target, data.
type RawEntry<'a> = (&'a [u8], tar::EntryType, &'a [u8], &'a [u8]);

/// A shared root with its own home and data directory beside it.
struct Fixture {
    _top: tempfile::TempDir,
    root: PathBuf,
    outside: PathBuf,
    roots: HostRoots,
}

fn fixture(limit: u64) -> Fixture {
    let top = tempfile::tempdir().expect("tempdir");
    let base = top.path().canonicalize().expect("canonical");
    let root = base.join("root");
    let outside = base.join("outside");
    let home = root.join("home");
    let data = root.join("state/moat");
    for dir in [&root, &outside, &data, &home.join(".ssh"), &home.join(".local"), &root.join("proj")] {
        std::fs::create_dir_all(dir).expect("mkdir");
    }
    std::fs::write(home.join(".ssh/id_ed25519"), "secret").expect("write");
    std::fs::write(outside.join("secret"), "secret").expect("write");
    let roots =
        HostRoots::open_with_home(std::slice::from_ref(&root), &base.join("data"), limit, Some(home)).expect("opens");
    // The data directory under the root is found by identity, not by name:
    // point the guard at it.
    let roots = HostRoots { data_dir: FileId::of_path(&data), ..roots };
    Fixture { _top: top, root, outside, roots }
}

fn refused(result: Result<impl std::fmt::Debug, impl std::fmt::Display>, needle: &str) {
    let err = result.expect_err("refused").to_string();
    assert!(err.contains(needle), "{err:?} should say {needle:?}");
}

#[test]
fn explicit_roots_that_are_the_system_are_refused() {
    for bad in ["/", "/etc", "/usr/lib", "/proc", "/var", "/run", "/root"] {
        refused(roots_from(Some(bad.into()), None, Some(Path::new("/home/u"))), "system");
    }
    refused(roots_from(Some("relative/dir".into()), None, None), "not an absolute path");
    refused(roots_from(Some("/no/such/dir".into()), None, None), "/no/such/dir");
    let dir = tempfile::tempdir().expect("tempdir");
    let list = std::env::join_paths([dir.path(), dir.path()]).expect("joins");
    assert_eq!(roots_from(Some(list), None, None).expect("fine").len(), 2);
    // A home's hidden directories, named or through a link, are never a root.
    let home = dir.path().canonicalize().expect("canonical");
    std::fs::create_dir_all(home.join(".ssh")).expect("mkdir");
    std::fs::create_dir_all(home.join(".config/autostart")).expect("mkdir");
    std::fs::create_dir_all(home.join("src")).expect("mkdir");
    symlink(home.join(".ssh"), home.join("src/proj")).expect("symlink");
    for (bad, why) in [
        (home.join(".ssh"), "is in a hidden directory of a home"),
        (home.join(".config/autostart"), "is in a hidden directory of a home"),
        (home.join("src/proj"), "is a link into a hidden directory of a home"),
    ] {
        refused(roots_from(Some(bad.clone().into()), None, Some(&home)), why);
    }
    assert_eq!(roots_from(Some(home.join("src").into()), None, Some(&home)).expect("fine"), [home.join("src")]);
}

#[test]
fn the_working_directory_is_a_root_only_when_it_is_a_project() {
    let home = tempfile::tempdir().expect("tempdir");
    let home = home.path().canonicalize().expect("canonical");
    std::fs::create_dir_all(home.join(".config/x")).expect("mkdir");
    std::fs::create_dir_all(home.join("src/proj")).expect("mkdir");
    for cwd in [PathBuf::from("/"), home.clone(), home.join(".config/x"), "/etc".into(), "/usr/share".into()] {
        let roots = roots_from(None, Some(cwd.clone()), Some(&home)).expect("no error");
        assert!(roots.is_empty(), "{} must not be shared by default", cwd.display());
    }
    let roots = roots_from(None, Some(home.join("src/proj")), Some(&home)).expect("fine");
    assert_eq!(roots, [home.join("src/proj")]);
    // /root is a home like another when it is ours.
    assert!(!is_system(Path::new("/root/x"), Some(Path::new("/root"))));
    assert!(is_system(Path::new("/root/x"), Some(Path::new("/home/u"))));
}

#[test]
fn sources_are_resolved_beneath_the_root_without_following_links() {
    let f = fixture(MIB);
    std::fs::write(f.root.join("proj/a.txt"), "a").expect("write");
    symlink(&f.outside, f.root.join("proj/out")).expect("symlink");
    symlink("../../outside/secret", f.root.join("proj/rel")).expect("symlink");
    symlink(&f.outside, f.root.join("linkdir")).expect("symlink");
    assert_eq!(f.roots.open_source(&f.root.join("proj/a.txt")).expect("inside").kind, SourceKind::File);
    assert_eq!(f.roots.open_source(&f.root).expect("the root itself").kind, SourceKind::Dir);
    refused(f.roots.open_source(&f.root.join("proj/out")), "symlink");
    refused(f.roots.open_source(&f.root.join("proj/rel")), "symlink");
    refused(f.roots.open_source(&f.root.join("linkdir/secret")), "symlink");
    refused(f.roots.open_source(&f.root.join("proj/../../outside/secret")), "`..`");
    refused(f.roots.open_source(&f.outside.join("secret")), "outside the shared directories");
    refused(f.roots.open_source(Path::new("relative")), "absolute");
    refused(f.roots.open_source(Path::new("/etc/shadow")), "MOAT_ROOTS");
    refused(f.roots.open_source(&f.root.join("home/.ssh/id_ed25519")), "hidden directory");
    refused(f.roots.open_source(&f.root.join("state/moat")), "data directory");
    refused(f.roots.open_source(&f.root.join("state/moat/x")), "data directory");
    // The guard is the directory's identity, not its name.
    std::fs::rename(f.root.join("state/moat"), f.root.join("moved")).expect("rename");
    refused(f.roots.open_source(&f.root.join("moved")), "data directory");
}

#[test]
fn without_roots_every_host_path_is_refused_naming_moat_roots() {
    let roots = HostRoots::open_with_home(&[], Path::new("/nonexistent"), MIB, None).expect("opens");
    refused(roots.open_source(Path::new("/etc/shadow")), "MOAT_ROOTS");
    refused(roots.destination(Path::new("/tmp/x")), "MOAT_ROOTS");
}

#[test]
fn destinations_are_new_names_never_links() {
    let f = fixture(MIB);
    std::fs::write(f.root.join("exists"), "x").expect("write");
    symlink(f.outside.join("new"), f.root.join("dangling")).expect("symlink");
    refused(f.roots.destination(&f.root.join("exists")), "exists");
    refused(f.roots.destination(&f.root.join("dangling")), "exists");
    refused(f.roots.destination(&f.root), "exists");
    symlink(&f.outside, f.root.join("via")).expect("symlink");
    refused(f.roots.destination(&f.root.join("via/new")), "symlink");
    let dest = f.roots.destination(&f.root.join("proj/new.txt")).expect("new");
    let (staged, _file) = dest.stage_file().expect("staged");
    assert!(!f.root.join("proj/new.txt").exists(), "nothing at the name before the commit");
    staged.commit().expect("committed");
    assert!(f.root.join("proj/new.txt").is_file());
    let names: Vec<_> =
        std::fs::read_dir(f.root.join("proj")).expect("ls").map(|e| e.expect("entry").file_name()).collect();
    assert_eq!(names, ["new.txt"], "no staging left");
    assert!(!f.outside.join("new").exists());
}

/// An archive whose names and links are written raw, as a hostile agent would.
fn hostile_tar(entries: &[RawEntry<'_>]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for (name, kind, link, data) in entries {
        let mut header = tar::Header::new_old();
        header.as_old_mut().name[..name.len()].copy_from_slice(name);
        header.as_old_mut().linkname[..link.len()].copy_from_slice(link);
        header.set_entry_type(*kind);
        header.set_mode(0o4755);
        header.set_size(data.len() as u64);
        header.set_cksum();
        builder.append(&header, *data).expect("append");
    }
    builder.into_inner().expect("finish")
}

fn unpack_into(f: &Fixture, name: &str, archive: &[u8]) -> Result<CopySummary, HostPathError> {
    unpack_from(f, name, archive)
}

/// Unpacks as `copy_from_sandbox` does: into a staged directory, named on success.
fn unpack_from(f: &Fixture, name: &str, input: impl std::io::Read) -> Result<CopySummary, HostPathError> {
    let dest = f.roots.destination(&f.root.join(name)).expect("new");
    let (staged, dir) = dest.stage_dir().expect("mkdir");
    let summary = unpack(input, Sink::Dir(dir), f.roots.copy_limit())?;
    staged.commit()?;
    Ok(summary)
}

fn unpack_file(f: &Fixture, name: &str, archive: &[u8]) -> Result<CopySummary, HostPathError> {
    let dest = f.roots.destination(&f.root.join(name)).expect("new");
    let (staged, file) = dest.stage_file().expect("file");
    let summary = unpack(archive, Sink::File(file), f.roots.copy_limit())?;
    staged.commit()?;
    Ok(summary)
}

#[test]
fn links_that_lead_out_of_the_copy_are_not_kept_whatever_the_chain() {
    use tar::EntryType::{Directory, Regular, Symlink};
    let f = fixture(MIB);
    let archive = hostile_tar(&[
        (b"./", Directory, b"", b""),
        (b"./x", Symlink, b".", b""),
        (b"./p", Symlink, b"x/x/x/x/x/x/x/x/../../../../../../../../outside/escaped", b""),
        (b"./abs", Symlink, b"/etc/passwd", b""),
        (b"./a", Symlink, b"b", b""),
        (b"./b", Symlink, b"c/../..", b""),
        (b"./c", Directory, b"", b""),
        (b"./ok", Symlink, b"c/f", b""),
        (b"./c/f", Regular, b"", b"data"),
        (b"./dangling", Symlink, b"nothing/../..", b""),
        (b"./d", Symlink, b"../outside", b""),
        (b"./d/evil", Regular, b"", b"evil"),
    ]);
    let summary = unpack_into(&f, "out", &archive).expect("unpacks");
    let out = f.root.join("out");
    for gone in ["p", "abs", "a", "b", "dangling"] {
        assert!(std::fs::symlink_metadata(out.join(gone)).is_err(), "{gone} must not be kept");
        assert!(summary.skipped.iter().any(|s| s.starts_with(&format!("{gone}: "))), "{gone} listed: {summary:?}");
    }
    assert_eq!(std::fs::read_link(out.join("x")).expect("x kept"), Path::new("."));
    assert_eq!(std::fs::read_to_string(out.join("ok")).expect("ok kept"), "data");
    // `d/evil` made a real directory; the link `d` could not replace it.
    assert!(std::fs::symlink_metadata(out.join("d")).expect("d").is_dir());
    assert!(!f.outside.join("evil").exists() && !f.outside.join("escaped").exists());
    // A second copy onto a name inside the first is a new file, never a link's target.
    refused(f.roots.destination(&out.join("x/x/c/f")), "symlink");
    let summary = unpack_into(&f, "out/p", &hostile_tar(&[(b"f", Regular, b"", b"x")])).expect("new dir");
    assert_eq!(summary.files, 1);
    assert!(!f.outside.join("escaped").exists());
}

#[test]
fn unsafe_entries_are_left_out_and_listed() {
    use tar::EntryType::{Block, Char, Fifo, Link, Regular};
    let f = fixture(MIB);
    let archive = hostile_tar(&[
        (b"../up", Regular, b"", b"x"),
        (b"/abs", Regular, b"", b"x"),
        (b"a/../../up2", Regular, b"", b"x"),
        (b"hard", Link, b"../outside/secret", b""),
        (b"dev", Char, b"", b""),
        (b"blk", Block, b"", b""),
        (b"fifo", Fifo, b"", b""),
        (b"suid", Regular, b"", b"#!/bin/sh\n"),
    ]);
    let summary = unpack_into(&f, "out", &archive).expect("unpacks");
    assert_eq!(summary.files, 1, "{summary:?}");
    assert_eq!(summary.skipped.len(), 7, "{summary:?}");
    let mode = std::fs::metadata(f.root.join("out/suid")).expect("suid").permissions().mode();
    assert_eq!(mode & 0o7777, 0o755, "set-id bits are dropped");
    let archive = hostile_tar(&[(b"open", Regular, b"", b"x")]);
    let mut archive = archive;
    // Mode 0666 written raw: others may not write what a sandbox sent.
    archive[100..108].copy_from_slice(b"0000666\0");
    let mut header = tar::Header::new_old();
    header.as_mut_bytes().copy_from_slice(&archive[..512]);
    header.set_cksum();
    archive[..512].copy_from_slice(header.as_bytes());
    unpack_into(&f, "modes", &archive).expect("unpacks");
    let mode = std::fs::metadata(f.root.join("modes/open")).expect("open").permissions().mode();
    assert_eq!(mode & 0o777, 0o644);
    assert!(!f.root.join("up").exists() && !Path::new("/abs").exists() && !f.root.join("out/hard").exists());
}

#[test]
fn copies_past_the_limit_are_refused_and_leave_nothing() {
    let f = fixture(MIB);
    let big = vec![7u8; MIB_BYTES + 1];
    let archive =
        hostile_tar(&[(b"small", tar::EntryType::Regular, b"", b"x"), (b"big", tar::EntryType::Regular, b"", &big)]);
    refused(unpack_into(&f, "out", &archive), "MOAT_COPY_MAX_MIB");
    assert!(!f.root.join("out").exists(), "a failed copy is removed");
    // Many empty entries count too.
    let names: Vec<Vec<u8>> = (0..300).map(|i| format!("e{i}").into_bytes()).collect();
    let entries: Vec<_> = names.iter().map(|n| (n.as_slice(), tar::EntryType::Regular, &b""[..], &b""[..])).collect();
    refused(unpack_into(&f, "many", &hostile_tar(&entries)), "MOAT_COPY_MAX_MIB");
}

#[test]
fn sparse_files_stay_sparse() {
    let f = fixture(64 * MIB);
    let mut data = vec![0u8; 32 * MIB_BYTES];
    data[5] = 1;
    let archive = hostile_tar(&[(b"sparse", tar::EntryType::Regular, b"", &data)]);
    unpack_into(&f, "out", &archive).expect("unpacks");
    let meta = std::fs::metadata(f.root.join("out/sparse")).expect("written");
    assert_eq!(meta.len(), 32 * MIB);
    assert!(meta.blocks() * 512 < MIB, "{} bytes allocated for a file of one non-zero byte", meta.blocks() * 512);
}

#[test]
fn a_single_file_copy_takes_exactly_one_regular_file() {
    let f = fixture(MIB);
    let archive = hostile_tar(&[(b"one", tar::EntryType::Regular, b"", b"hello")]);
    let summary = unpack_file(&f, "one", &archive).expect("copies");
    assert_eq!((summary.files, summary.bytes), (1, 5));
    assert_eq!(std::fs::read_to_string(f.root.join("one")).expect("read"), "hello");
    let archive = hostile_tar(&[(b"l", tar::EntryType::Symlink, b"/etc/shadow", b"")]);
    refused(unpack_file(&f, "two", &archive), "regular file");
    let staged = std::fs::read_dir(&f.root)
        .expect("ls")
        .filter(|e| e.as_ref().expect("entry").file_name().to_string_lossy().starts_with(".moat-copy"));
    assert_eq!(staged.count(), 0, "no staging left behind");
    assert!(!f.root.join("two").exists());
}

#[test]
fn packing_walks_by_descriptor_and_lists_what_it_leaves_out() {
    let f = fixture(MIB);
    let proj = f.root.join("proj");
    std::fs::create_dir_all(proj.join(".git")).expect("mkdir");
    std::fs::write(proj.join(".git/HEAD"), "ref").expect("write");
    std::fs::write(proj.join("main.py"), "print(1)").expect("write");
    // A vendored checkout's and a submodule's (any case) hold credentials too.
    for nested in ["vendor/lib/.git", "sub/.GIT"] {
        std::fs::create_dir_all(proj.join(nested)).expect("mkdir");
        std::fs::write(proj.join(nested).join("config"), "[remote \"origin\"]\n\turl = https://x:token@h/r\n")
            .expect("write");
    }
    symlink("/etc/passwd", proj.join("link")).expect("symlink");
    nix::unistd::mkfifo(&proj.join("fifo"), Mode::from_bits_truncate(0o600)).expect("fifo");
    let source = f.roots.open_source(&proj).expect("opens");
    let measured = measure(&f.roots, &source.fd, true).expect("fits");
    let mut archive = Vec::new();
    let packed = pack(&f.roots, &source.fd, true, &mut archive).expect("packs");
    assert_eq!(measured, PackSummary { top: measured.top.clone(), ..packed.clone() });
    assert_eq!(packed.files, 2, "{packed:?}");
    let git = "a Git directory (its config may hold credentials) is never copied into a sandbox";
    assert_eq!(
        packed.skipped,
        [
            "fifo: not a regular file, directory or symlink".to_owned(),
            format!("sub/.GIT: {git}"),
            format!("vendor/lib/.git: {git}")
        ]
    );
    assert!(!packed.top.contains(&".git".to_owned()));
    // Nor is anything in one named itself.
    for inside in [".git/config", ".git", "vendor/lib/.git/config", "sub/.GIT"] {
        let refused = f.roots.open_source(&proj.join(inside)).expect_err(inside);
        assert!(refused.to_string().contains("inside a Git directory"), "{inside}: {refused}");
    }
    let mut names = Vec::new();
    for entry in tar::Archive::new(archive.as_slice()).entries().expect("entries") {
        let entry = entry.expect("entry");
        names.push((entry.path().expect("path").display().to_string(), entry.header().entry_type()));
    }
    assert!(names.contains(&("link".into(), tar::EntryType::Symlink)), "{names:?}");
    // The home directory packed whole leaves its dot directories out, and
    // the root packed whole leaves moat's data directory out.
    let home = f.roots.open_source(&f.root.join("home")).expect("opens");
    let packed = pack(&f.roots, &home.fd, false, std::io::sink()).expect("packs");
    assert!(packed.skipped.iter().any(|s| s.starts_with(".ssh:")), "{packed:?}");
    let root = f.roots.open_source(&f.root).expect("opens");
    let packed = pack(&f.roots, &root.fd, false, std::io::sink()).expect("packs");
    assert!(packed.skipped.iter().any(|s| s.starts_with("state/moat:")), "{packed:?}");
    // Too large: refused by measuring, before anything is sent.
    std::fs::write(proj.join("big"), vec![1u8; MIB_BYTES]).expect("write");
    refused(measure(&f.roots, &source.fd, true), "MOAT_COPY_MAX_MIB");
}

// Held-out variants of the reported attacks.

/// A raw 512-byte GNU header: `name` (≤ 100 bytes), type byte, declared size.
fn gnu_header(name: &[u8], kind: u8, size: u64) -> Vec<u8> {
    let mut header = tar::Header::new_gnu();
    header.as_gnu_mut().expect("gnu").name[..name.len()].copy_from_slice(name);
    header.set_entry_type(tar::EntryType::new(kind));
    header.set_mode(0o644);
    header.set_size(size);
    header.set_cksum();
    header.as_bytes().to_vec()
}

/// `data` padded to a whole number of 512-byte blocks.
fn blocks(data: &[u8]) -> Vec<u8> {
    let mut out = data.to_vec();
    out.resize(data.len().div_ceil(512) * 512, 0);
    out
}

/// A GNU long-name entry (`L`) naming the entry that follows.
fn long_name(name: &[u8]) -> Vec<u8> {
    let mut out = gnu_header(b"././@LongLink", b'L', name.len() as u64 + 1);
    let mut data = name.to_vec();
    data.push(0);
    out.extend(blocks(&data));
    out
}

/// A reader that counts what it hands out.
struct Counted<R> {
    inner: R,
    read: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl<R: std::io::Read> std::io::Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(n)
    }
}

/// F-A: a GNU long name (or a PAX header) is read whole into memory by the
/// tar crate before `unpack` sees the entry, and is not charged against the
/// copy limit: with a 1 MiB limit the host holds a 32 MiB name (twice: the
/// name, and again in `skipped`). Scaled up, a sandbox exhausts host memory.
#[test]
fn long_names_are_bounded_by_the_copy_limit() {
    let f = fixture(MIB);
    let mut name = b"/".to_vec();
    name.resize(32 * MIB_BYTES, b'a');
    let mut archive = long_name(&name);
    archive.extend(gnu_header(b"x", b'0', 0));
    archive.extend([0u8; 1024]);
    let read = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let input = Counted { inner: archive.as_slice(), read: read.clone() };
    let result = unpack_from(&f, "out", input);
    let consumed = read.load(std::sync::atomic::Ordering::Relaxed);
    let listed: usize = result.as_ref().map(|s| s.skipped.iter().map(String::len).sum()).unwrap_or(0);
    assert!(
        consumed <= 2 * MIB && listed <= 64 << 10,
        "limit 1 MiB, yet {consumed} bytes of archive metadata were taken into memory and {listed} bytes listed"
    );
}

/// F-A (PAX variant): a local PAX header of 32 MiB.
#[test]
fn pax_headers_are_bounded_by_the_copy_limit() {
    let f = fixture(MIB);
    let payload = vec![b'a'; 32 * MIB_BYTES];
    let body_len = " comment=".len() + payload.len() + 1;
    let mut len = body_len + 1;
    while len != body_len + len.to_string().len() {
        len = body_len + len.to_string().len();
    }
    let mut record = format!("{len} comment=").into_bytes();
    record.extend(&payload);
    record.push(b'\n');
    let mut header = tar::Header::new_ustar();
    header.set_path("pax").expect("name");
    header.set_entry_type(tar::EntryType::XHeader);
    header.set_size(record.len() as u64);
    header.set_cksum();
    let mut archive = header.as_bytes().to_vec();
    archive.extend(blocks(&record));
    archive.extend(gnu_header(b"x", b'0', 0));
    archive.extend([0u8; 1024]);
    let read = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let result = unpack_from(&f, "out", Counted { inner: archive.as_slice(), read: read.clone() });
    let consumed = read.load(std::sync::atomic::Ordering::Relaxed);
    assert!(result.is_err() || consumed <= 2 * MIB, "limit 1 MiB, yet {consumed} bytes read for one empty file");
}

/// F-B: the directories an entry's name implies are made without being
/// charged: one entry (4 KiB of the limit) makes thousands of directories
/// (inodes, 4 KiB blocks each). The limit's bound on entries is bypassed.
#[test]
fn directories_a_name_implies_are_charged() {
    let f = fixture(MIB);
    let mut name = b"d/".repeat(3000);
    name.push(b'f');
    let mut archive = long_name(&name);
    archive.extend(gnu_header(b"x", b'0', 0));
    archive.extend([0u8; 1024]);
    unpack_into(&f, "out", &archive).ok();
    let mut dirs = 0u64;
    let flags = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    if let Ok(mut at) = nix::fcntl::open(&f.root.join("out"), flags, Mode::empty()) {
        while let Ok(next) = openat(&at, "d", flags, Mode::empty()) {
            dirs += 1;
            at = next;
        }
    }
    assert!(dirs <= MIB / ENTRY_COST, "{dirs} directories made within a limit of {} entries", MIB / ENTRY_COST);
}

/// F-C: a failed copy of a deep tree is not removed. `remove_beneath`
/// recurses with a descriptor open per level: past RLIMIT_NOFILE it stops
/// (EMFILE, the tree stays), and with a high limit the recursion overflows
/// the (tokio worker's) stack and aborts the whole server.
/// The tree is made by one entry; the copy then fails at the limit.
#[test]
fn a_failed_deep_copy_is_removed() {
    let f = fixture(MIB);
    let depth = 25_000;
    let mut name = b"d/".repeat(depth);
    name.push(b'f');
    let mut archive = long_name(&name);
    archive.extend(gnu_header(b"x", b'0', 0));
    archive.extend(gnu_header(b"big", b'0', 2 * MIB));
    archive.extend([0u8; 1024]);
    refused(unpack_into(&f, "out", &archive), "MOAT_COPY_MAX_MIB");
    assert!(!f.root.join("out").exists(), "the failed copy was left behind");
}

/// F-D: with the home directory under a system directory (Fedora Atomic's
/// /var/home/u, or a service account's /var/lib/moat), every other
/// directory under it stops being a system directory.
#[test]
fn system_dirs_stay_system_when_home_is_beneath_one() {
    let home = Path::new("/var/home/u");
    for dir in ["/var/lib", "/var/log", "/var/spool/cron", "/var/lib/docker"] {
        assert!(is_system(Path::new(dir), Some(home)), "{dir} is treated as a project directory");
    }
    refused(roots_from(Some("/var/lib".into()), None, Some(home)), "system");
}

/// F-E: the data directory reached through a bind mount as a root (same
/// inode, another path) is not refused: the root itself is never compared
/// with the data directory's identity. Simulated as the fixture simulates
/// the data directory: by pointing the guard at the root's identity.
#[test]
fn a_root_that_is_the_data_directory_is_refused() {
    let f = fixture(MIB);
    let roots = HostRoots { data_dir: FileId::of_path(&f.root), ..f.roots };
    let f = Fixture { roots, ..f };
    refused(f.roots.open_source(&f.root), "data directory");
    refused(f.roots.destination(&f.root.join("new")), "data directory");
}

/// F-F: an entry named `.` (or empty, or `./`) that is a regular file or a
/// symlink is dropped without being listed.
#[test]
fn entries_named_dot_are_listed_when_left_out() {
    use tar::EntryType::{Regular, Symlink};
    let f = fixture(MIB);
    let archive = hostile_tar(&[(b".", Regular, b"", b"hidden data"), (b"./", Symlink, b"/etc", b"")]);
    let summary = unpack_into(&f, "out", &archive).expect("unpacks");
    assert_eq!(summary.skipped.len(), 2, "entries dropped in silence: {summary:?}");
}

#[test]
fn long_and_pax_names_with_dot_dot_are_refused() {
    let f = fixture(MIB);
    let mut archive = long_name(b"a/../../outside/viaL");
    archive.extend(gnu_header(b"ok", b'0', 1));
    archive.extend(blocks(b"x"));
    let mut header = tar::Header::new_ustar();
    header.set_path("ok2").expect("name");
    header.set_entry_type(tar::EntryType::Symlink);
    header.set_size(0);
    let mut builder = tar::Builder::new(Vec::new());
    builder.append_pax_extensions([("path", &b"../outside/viaPax"[..])]).expect("pax");
    let mut plain = tar::Header::new_ustar();
    plain.set_path("p").expect("name");
    plain.set_size(1);
    plain.set_cksum();
    builder.append(&plain, &b"y"[..]).expect("append");
    builder.append_pax_extensions([("linkpath", &b"../../outside/secret"[..])]).expect("pax");
    header.set_cksum();
    builder.append(&header, std::io::empty()).expect("append");
    archive.extend(builder.into_inner().expect("done"));
    let summary = unpack_into(&f, "out", &archive).expect("unpacks");
    assert!(!f.outside.join("viaL").exists() && !f.outside.join("viaPax").exists());
    assert!(std::fs::symlink_metadata(f.root.join("out/ok2")).is_err(), "{summary:?}");
    assert_eq!(summary.skipped.len(), 3, "{summary:?}");
}

#[test]
fn a_truncated_archive_fails() {
    let f = fixture(MIB);
    let mut archive = gnu_header(b"a", b'0', 4096);
    archive.extend(vec![1u8; 1000]);
    refused(unpack_into(&f, "out", &archive), "broken archive");
    assert!(!f.root.join("out").exists());
    refused(unpack_file(&f, "one", &archive), "broken archive");
    assert!(!f.root.join("one").exists());
}

/// F-H: `openat2(RESOLVE_BENEATH)` fails with EAGAIN when any rename on the
/// system races a `..` in the lookup; `resolves_beneath` takes that as
/// "leads out", so a link that stays inside the copy is dropped at random on
/// a busy host (and listed with a wrong reason).
#[test]
fn links_are_kept_while_the_host_renames_files() {
    use tar::EntryType::{Directory, Regular, Symlink};
    let f = fixture(64 * MIB);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let busy = f.outside.clone();
    let flag = stop.clone();
    let renamer = std::thread::spawn(move || {
        std::fs::write(busy.join("a"), "x").expect("write");
        while !flag.load(std::sync::atomic::Ordering::Relaxed) {
            let _ = std::fs::rename(busy.join("a"), busy.join("b"));
            let _ = std::fs::rename(busy.join("b"), busy.join("a"));
        }
    });
    let mut target = b"d/".repeat(15);
    target.extend(b"../".repeat(15));
    target.push(b'f');
    let target = target.as_slice();
    let mut d = b"d/".repeat(15);
    d.pop();
    let mut dropped = 0;
    for i in 0..100 {
        let archive = hostile_tar(&[
            (d.as_slice(), Directory, b"", b""),
            (b"f", Regular, b"", b"x"),
            (b"l", Symlink, target, b""),
        ]);
        let summary = unpack_into(&f, &format!("out{i}"), &archive).expect("unpacks");
        if !summary.skipped.is_empty() {
            dropped += 1;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    renamer.join().expect("joins");
    assert_eq!(dropped, 0, "a link inside the copy was dropped in {dropped} of 100 copies");
}

#[test]
fn ssh_keys_are_read_beneath_dot_ssh_or_a_root_and_nowhere_else() {
    let f = fixture(MIB);
    let key = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3Blbn\n-----END OPENSSH PRIVATE KEY-----\n";
    let ssh = f.root.join("home/.ssh");
    std::fs::write(ssh.join("id_ed25519"), key).expect("write");
    std::fs::write(f.root.join("proj/deploy_key"), key).expect("write");
    std::fs::write(f.outside.join("id_rsa"), key).expect("write");
    assert_eq!(f.roots.read_ssh_key(&ssh.join("id_ed25519")).expect("in ~/.ssh"), key.as_bytes());
    assert_eq!(f.roots.read_ssh_key(&f.root.join("proj/deploy_key")).expect("in a root"), key.as_bytes());
    refused(f.roots.read_ssh_key(&f.outside.join("id_rsa")), "beneath ~/.ssh or a directory in MOAT_ROOTS");
    // Links are not followed, in ~/.ssh as in a root.
    symlink(f.outside.join("id_rsa"), ssh.join("linked")).expect("symlink");
    refused(f.roots.read_ssh_key(&ssh.join("linked")), "symlink");
    std::fs::create_dir(ssh.join("sub")).expect("mkdir");
    refused(f.roots.read_ssh_key(&ssh.join("sub/../../../outside/id_rsa")), "`..`");
    refused(f.roots.read_ssh_key(&ssh.join("sub")), "not a file");
    // Another file is not read out as a key, and its text is in no error.
    std::fs::write(ssh.join("config"), "Host *\n  ProxyCommand secret-command\n").expect("write");
    let err = f.roots.read_ssh_key(&ssh.join("config")).expect_err("not a key").to_string();
    assert!(err.contains("not an SSH private key") && !err.contains("secret-command"), "{err}");
    std::fs::write(ssh.join("huge"), format!("{key}{}", "x".repeat(64 << 10))).expect("write");
    refused(f.roots.read_ssh_key(&ssh.join("huge")), "not an SSH private key");
}

/// Where others may write in a root's directory (a shared root), one who
/// renames a staged copy's private directory away and puts a tree of
/// their choosing at its name gets moat to remove, chmod or rename
/// nothing of it: the copy is reached through its directory's descriptor.
#[test]
fn a_staged_copy_swapped_for_another_tree_leaves_that_tree_alone() {
    let f = fixture(MIB);
    let staging = |dir: &Path| -> PathBuf {
        std::fs::read_dir(dir)
            .expect("ls")
            .map(|e| e.expect("entry").path())
            .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(".moat-copy")))
            .expect("a staging directory")
    };
    let swap = |at: &Path| {
        std::fs::rename(at, f.root.join("moved-away")).expect("renames the staging away");
        std::fs::create_dir_all(at.join("copy")).expect("another tree at its name");
        std::fs::write(at.join("copy/victim"), "theirs").expect("write");
        std::fs::set_permissions(at, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    };
    // A copy that fails: what is at the staging name is not removed.
    let dest = f.roots.destination(&f.root.join("failed")).expect("new");
    let (staged, _file) = dest.stage_file().expect("staged");
    let at = staging(&f.root);
    swap(&at);
    drop(staged);
    assert_eq!(std::fs::read_to_string(at.join("copy/victim")).expect("kept"), "theirs");
    assert!(!f.root.join("moved-away/copy").exists(), "the copy itself is removed where it went");
    std::fs::remove_dir_all(&at).expect("rm");
    std::fs::remove_dir_all(f.root.join("moved-away")).expect("rm");
    // A copy that is committed: its own directory is named, not the tree
    // at the staging name, which keeps its mode.
    let dest = f.roots.destination(&f.root.join("done")).expect("new");
    let (staged, dir) = dest.stage_dir().expect("staged");
    nix::sys::stat::mkdirat(&dir, "mine", Mode::from_bits_truncate(0o755)).expect("mkdirat");
    let at = staging(&f.root);
    swap(&at);
    staged.commit().expect("committed");
    assert!(f.root.join("done/mine").is_dir(), "the copy that was written is named");
    assert_eq!(std::fs::read_to_string(at.join("copy/victim")).expect("kept"), "theirs");
    assert_eq!(std::fs::metadata(&at).expect("stat").permissions().mode() & 0o777, 0o700, "their tree was chmodded");
}

#[test]
fn nothing_a_host_program_runs_by_itself_is_written() {
    use tar::EntryType::{Directory, Regular, Symlink};
    let f = fixture(MIB);
    std::fs::create_dir_all(f.root.join("proj/.git/hooks")).expect("mkdir");
    // As a destination, at any depth, in any case.
    for dest in ["proj/.git/hooks/pre-commit", "proj/.git/config2", "proj/.GIT/x", "new/.vscode", "proj/.mcp.json"] {
        refused(f.roots.destination(&f.root.join(dest)), "moat never writes a copy into or as");
    }
    refused(f.roots.destination(&f.root.join("proj/.claude/settings.json")), "Claude Code runs hooks from it");
    // Other version control systems' directories, as git's.
    for (dest, who) in [
        ("proj/.jj/repo/config.toml", "Jujutsu"),
        ("proj/.sl/hgrc", "Sapling"),
        ("proj/_darcs/prefs/defaults", "darcs"),
    ] {
        refused(f.roots.destination(&f.root.join(dest)), who);
    }
    assert!(f.roots.destination(&f.root.join("proj/.gitignore")).is_ok(), "other dot names are copied");
    // Inside a copied tree: left out and listed, the rest copied.
    let archive = hostile_tar(&[
        (b".git", Directory, b"", b""),
        (b".git/config", Regular, b"", b"[core]\n\tfsmonitor = touch /tmp/pwned\n"),
        (b"sub/.Git", Regular, b"", b"gitdir: ../g\n"),
        (b".claude/settings.json", Regular, b"", b"{}"),
        (b"a/.vscode/tasks.json", Regular, b"", b"{}"),
        (b".envrc", Regular, b"", b"touch /tmp/pwned\n"),
        (b"g/.git", Symlink, b"../sub", b""),
        (b".gitignore", Regular, b"", b"target\n"),
        (b"src/main.rs", Regular, b"", b"fn main() {}\n"),
        // A bare repository under any name: git runs its config's commands
        // in it; without its HEAD it is none.
        (b"bare/objects", Directory, b"", b""),
        (b"bare/refs", Directory, b"", b""),
        (b"bare/config", Regular, b"", b"[core]\n\tfsmonitor = touch /tmp/pwned\n\tbare = false\n"),
        (b"bare/HEAD", Regular, b"", b"ref: refs/heads/main\n"),
        (b"venv/lib/python3.11/site-packages/zz.PTH", Regular, b"", b"import os; os.system('touch /tmp/pwned')\n"),
        (b"src/__pycache__/main.cpython-311.pyc", Regular, b"", b"\x00"),
        (b".cargo/config.toml", Regular, b"", b"[build]\nrustc-wrapper = \"/tmp/w\"\n"),
        (b"web/.npmrc", Regular, b"", b"node-options=--require /tmp/x.js\n"),
        (b".gemini/settings.json", Regular, b"", b"{\"mcpServers\": {}}"),
        (b".pre-commit-config.yaml", Regular, b"", b"repos: []\n"),
        // A model checkpoint and a program named like git's file are data.
        (b"models/net.pth", Regular, b"", b"weights"),
        (b"bin/head", Regular, b"", b"\x7fELF"),
        // Names that merely look alike are copied.
        (b"README.HEAD.md", Regular, b"", b"x"),
        (b"path.pth.txt", Regular, b"", b"x"),
    ]);
    let summary = unpack_into(&f, "out", &archive).expect("unpacks");
    assert_eq!(summary.files, 7, "{summary:?}");
    assert_eq!(summary.skipped.len(), 14, "{summary:?}");
    assert!(summary.skipped.iter().any(|s| s.contains(".git/config: moat never writes .git from a sandbox")));
    for gone in [
        ".git",
        "sub/.Git",
        ".claude",
        "a/.vscode",
        ".envrc",
        "g/.git",
        "bare/HEAD",
        "venv/lib/python3.11/site-packages/zz.PTH",
        "src/__pycache__",
        ".cargo",
        "web/.npmrc",
        ".gemini",
        ".pre-commit-config.yaml",
    ] {
        assert!(std::fs::symlink_metadata(f.root.join("out").join(gone)).is_err(), "{gone} was written");
    }
    assert!(f.root.join("out/.gitignore").is_file() && f.root.join("out/src/main.rs").is_file());
    assert_eq!(acted_on(b".GiT"), acted_on(b".git"));
    assert_eq!(acted_on(b".github"), None);
    assert!(f.root.join("out/models/net.pth").is_file() && f.root.join("out/bin/head").is_file());
    assert!(acted_on_path(&[b"repo.git".as_slice(), b"HEAD"]).is_some());
    assert!(acted_on_path(&[b"HEAD".as_slice(), b"notes"]).is_none(), "a directory named HEAD holds no HEAD");
    assert!(acted_on_path(&[b"lib".as_slice(), b"Site-Packages", b"x.PTH"]).is_some());
    assert!(acted_on_path(&[b"checkpoints".as_slice(), b"x.pth"]).is_none());
    refused(f.roots.destination(&f.root.join("proj/site-packages/evil.pth")), "moat never writes a copy into");
    refused(f.roots.destination(&f.root.join("proj/.venv/lib/python3.12/site-packages")), "Python runs the .pth");
    assert!(acted_on_path(&[b"site-packages".as_slice(), b".pth"]).is_some(), "a file named .pth is one");
    refused(f.roots.destination(&f.root.join("proj/repo.git/HEAD")), "git takes a directory holding it");
    // A repository already on the host, under any name, and what is
    // beneath it: git runs the hooks and config commands there.
    for repo in ["proj/mirror.git", "proj/gitdir"] {
        for dir in ["hooks", "refs", "objects"] {
            std::fs::create_dir_all(f.root.join(repo).join(dir)).expect("mkdir");
        }
        std::fs::write(f.root.join(repo).join("HEAD"), "ref: refs/heads/main\n").expect("write");
    }
    for dest in
        ["proj/mirror.git/hooks/post-update", "proj/gitdir/hooks/pre-push", "proj/gitdir/info", "proj/mirror.git/x"]
    {
        refused(f.roots.destination(&f.root.join(dest)), "moat never writes a copy into a git repository");
    }
    std::fs::create_dir_all(f.root.join("proj/wt-admin/logs")).expect("mkdir");
    std::fs::write(f.root.join("proj/wt-admin/HEAD"), "0123\n").expect("write");
    std::fs::write(f.root.join("proj/wt-admin/commondir"), "../mirror.git\n").expect("write");
    refused(f.roots.destination(&f.root.join("proj/wt-admin/logs/x")), "a git worktree's own directory");
    // A working tree's files, and a directory that only looks alike, are not.
    std::fs::create_dir_all(f.root.join("proj/notes/objects")).expect("mkdir");
    std::fs::write(f.root.join("proj/notes/HEAD.txt"), "x").expect("write");
    assert!(f.roots.destination(&f.root.join("proj/notes/new.md")).is_ok(), "no HEAD: no repository");
    assert!(f.roots.destination(&f.root.join("proj/src.rs")).is_ok(), "a working tree beside its .git");
}

#[test]
fn every_accounts_home_is_guarded() {
    let f = fixture(MIB);
    // Another account's home under the root (as /home/alice is under a
    // root of /home, or is the working directory of a moat run as root).
    let alice = f.root.join("alice");
    std::fs::create_dir_all(alice.join(".ssh")).expect("mkdir");
    std::fs::write(alice.join(".ssh/id_ed25519"), "secret").expect("write");
    std::fs::write(alice.join("notes.txt"), "notes").expect("write");
    let homes = vec![FileId::of_path(&alice).expect("alice")];
    let roots = HostRoots { homes, ..f.roots };
    refused(roots.open_source(&alice.join(".ssh/id_ed25519")), "hidden directory of a home directory");
    refused(roots.destination(&alice.join(".profile")), "hidden directory of a home directory");
    assert!(roots.open_source(&alice.join("notes.txt")).is_ok());
    // The system's accounts are read from /etc/passwd: root's is there.
    if Path::new("/root").is_dir() {
        assert!(account_homes().contains(&PathBuf::from("/root")), "{:?}", account_homes());
    }
    assert!(!account_homes().contains(&PathBuf::from("/")), "/ is no one's home here");
}

/// A promise of all the room left: other tests write beside this one, so
/// the room read may be gone by the promise; read it again until it holds.
fn all_the_rest(dir: &std::fs::File) -> Promise {
    (0..100).find_map(|_| promise_room(dir, room_left(dir).expect("asked")).ok()).expect("the room left, promised")
}

#[test]
fn a_copy_never_takes_the_space_the_disk_keeps_free() {
    assert_eq!(disk_reserve(100 << 20), 5 << 20, "5 % of a small disk");
    assert_eq!(disk_reserve(1 << 40), 1 << 30, "at most 1 GiB of a large one");
    let f = fixture(MIB);
    let dir = std::fs::File::open(&f.root).expect("root");
    let stat = nix::sys::statvfs::fstatvfs(&dir).expect("statvfs");
    let free = stat.blocks_available() * stat.fragment_size();
    let room = room(&dir).expect("asked");
    // Other tests write and remove files on this file system meanwhile:
    // the two readings may differ by what they did between them.
    let slack = 256 * MIB;
    assert!(room <= free + slack && free.saturating_sub(room) <= (1 << 30) + slack, "{room} of {free}");
    // The limit a destination gets is the smaller of the two, and one that
    // the disk sets says so.
    let dest = f.roots.destination(&f.root.join("new")).expect("new");
    assert_eq!(dest.limit(1).0.bytes, 1);
    let (all, share) = dest.limit(u64::MAX);
    assert!(all.by_disk && all.bytes <= room, "{all:?} of {room}");
    // Copies at once share the room a window at a time: the first holds
    // its first window, the next sees the rest.
    assert_eq!(share.held(), all.bytes.min(COPY_WINDOW));
    let (next, next_share) = dest.limit(u64::MAX);
    assert!(next.by_disk && next.bytes + COPY_WINDOW <= all.bytes + slack, "{next:?} beside {all:?}");
    // As a copy goes it holds its next window from what the others leave:
    // none while a share holds all the rest, a whole one once it is gone.
    assert_eq!(share.renew(&dir, 0), 0, "its window written, it holds nothing");
    let rest = all_the_rest(&dir);
    assert!(share.renew(&dir, COPY_WINDOW) < MIB, "a window out of room others hold");
    drop(rest);
    assert_eq!(share.renew(&dir, COPY_WINDOW), COPY_WINDOW);
    drop((share, next_share));
    assert!(dest.limit(u64::MAX).0.bytes + slack >= all.bytes, "given back");
    // A microVM's disk overlay is promised its room the same way: none is
    // left while others hold it all, and what it holds is kept from copies.
    let everything = all_the_rest(&dir);
    assert_eq!(promise_room(&dir, MIB).expect_err("no room left"), 0);
    drop(everything);
    let disk = promise_room(&dir, 64 * MIB).expect("room for a small disk");
    assert!(room_left(&dir).expect("asked") + 64 * MIB <= room + slack, "the disk's share is kept from copies");
    let (beside, beside_share) = dest.limit(u64::MAX);
    assert!(beside.bytes + 64 * MIB <= room + slack, "{beside:?}: the disk's share is kept from copies");
    drop(beside_share);
    // Once its overlay holds 16 MiB, those are gone from the free space
    // and only the 48 it may still write are held: nothing counts twice.
    let overlay = f.root.join("overlay.img");
    std::fs::write(&overlay, vec![7u8; 16 << 20]).expect("written");
    std::fs::File::open(&overlay).and_then(|o| o.sync_all()).expect("synced");
    let held = |promise: &Promise| promises().shares.get(&promise.0).map(Share::left);
    assert_eq!(held(&disk), Some(64 * MIB));
    disk.filled_by(overlay.clone());
    assert_eq!(held(&disk), Some(48 * MIB), "what the overlay wrote is counted once, by the free space");
    drop(disk);
    std::fs::remove_file(&overlay).expect("rm");
    assert!(promise_room(&dir, u64::MAX).is_err(), "more than the disk has");
    // A share on another file system takes nothing from this one.
    let elsewhere = std::fs::File::open("/proc").expect("proc");
    let other = promise_room(&elsewhere, 1 << 40).expect("no room is known there: promised");
    assert!(promises().on(device(&dir)) < 1 << 40, "another file system's share counted here");
    drop(other);
    let archive = hostile_tar(&[(b"big", tar::EntryType::Regular, b"", &[7u8; 8192])]);
    let (staged, out) = dest.stage_dir().expect("staged");
    let err = unpack(&archive[..], Sink::Dir(out), Limit { bytes: 4096, by_disk: true }).expect_err("past the room");
    assert!(err.to_string().contains("less free space than moat keeps free (5 % of it, at most 1 GiB)"), "{err}");
    drop(staged);
    // A copy whose next window finds no room left stops there, before it
    // writes the entry that would pass it (a header that claims more than
    // a window, which is never read).
    let dest = f.roots.destination(&f.root.join("new")).expect("new");
    let (limit, share) = dest.limit(u64::MAX);
    share.renew(&dir, 0);
    let rest = all_the_rest(&dir);
    let mut big = Vec::new();
    {
        let mut builder = tar::Builder::new(&mut big);
        let mut header = tar::Header::new_gnu();
        header.set_size(COPY_WINDOW + MIB);
        header.set_mode(0o644);
        header.set_entry_type(tar::EntryType::Regular);
        builder.append_data(&mut header, "big", std::io::empty()).ok();
    }
    let (staged, out) = dest.stage_dir().expect("staged");
    let err = unpack_within(&big[..], Sink::Dir(out), limit, Some(&share)).expect_err("no window left");
    assert!(err.to_string().contains("less free space than moat keeps free"), "{err}");
    drop((staged, rest, share));
    assert!(!f.root.join("new").exists(), "nothing of it kept");
}

/// A small file moat reads from a host tree (a project's `.git/config`) is
/// reached through no link, as every other host path: a link planted on
/// the way leads the read nowhere.
#[test]
fn small_files_are_read_through_no_link() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    std::fs::create_dir_all(dir.path().join("real/.git")).expect("mkdir");
    std::fs::write(dir.path().join("real/.git/config"), "[remote \"origin\"]\n").expect("write");
    std::fs::create_dir_all(dir.path().join("linked/elsewhere")).expect("mkdir");
    std::fs::write(dir.path().join("linked/elsewhere/config"), "[remote \"origin\"]\n").expect("write");
    std::os::unix::fs::symlink("elsewhere", dir.path().join("linked/.git")).expect("symlink");
    std::os::unix::fs::symlink("../real/.git/config", dir.path().join("linked/elsewhere/link")).expect("symlink");
    let open = |p: &str| OwnedFd::from(std::fs::File::open(dir.path().join(p)).expect("open"));
    assert!(read_small(&open("real"), ".git/config").is_some(), "a plain file is read");
    assert_eq!(read_small(&open("linked"), ".git/config"), None, "a linked directory on the way");
    assert_eq!(read_small(&open("linked"), "elsewhere/link"), None, "a link as the file");
}
