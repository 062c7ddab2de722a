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

fn refused(result: Result<impl std::fmt::Debug, CoreError>, needle: &str) {
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
    dest.create_file().expect("created");
    assert!(f.root.join("proj/new.txt").is_file());
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

fn unpack_into(f: &Fixture, name: &str, archive: &[u8]) -> Result<CopySummary, CoreError> {
    let dest = f.roots.destination(&f.root.join(name)).expect("new");
    let dir = dest.create_dir().expect("mkdir");
    let result = unpack(archive, Sink::Dir(dir), f.roots.copy_limit());
    if result.is_err() {
        dest.remove();
    }
    result
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
    let dest = f.roots.destination(&f.root.join("one")).expect("new");
    let archive = hostile_tar(&[(b"one", tar::EntryType::Regular, b"", b"hello")]);
    let summary = unpack(archive.as_slice(), Sink::File(dest.create_file().expect("file")), MIB).expect("copies");
    assert_eq!((summary.files, summary.bytes), (1, 5));
    assert_eq!(std::fs::read_to_string(f.root.join("one")).expect("read"), "hello");
    let dest = f.roots.destination(&f.root.join("two")).expect("new");
    let archive = hostile_tar(&[(b"l", tar::EntryType::Symlink, b"/etc/shadow", b"")]);
    refused(unpack(archive.as_slice(), Sink::File(dest.create_file().expect("file")), MIB), "regular file");
}

#[test]
fn packing_walks_by_descriptor_and_lists_what_it_leaves_out() {
    let f = fixture(MIB);
    let proj = f.root.join("proj");
    std::fs::create_dir_all(proj.join(".git")).expect("mkdir");
    std::fs::write(proj.join(".git/HEAD"), "ref").expect("write");
    std::fs::write(proj.join("main.py"), "print(1)").expect("write");
    symlink("/etc/passwd", proj.join("link")).expect("symlink");
    nix::unistd::mkfifo(&proj.join("fifo"), Mode::from_bits_truncate(0o600)).expect("fifo");
    let source = f.roots.open_source(&proj).expect("opens");
    let measured = measure(&f.roots, &source.fd, true).expect("fits");
    let mut archive = Vec::new();
    let packed = pack(&f.roots, &source.fd, true, &mut archive).expect("packs");
    assert_eq!(measured, PackSummary { top: measured.top.clone(), ..packed.clone() });
    assert_eq!(packed.files, 2, "{packed:?}");
    assert_eq!(packed.skipped, ["fifo: not a regular file, directory or symlink"]);
    assert!(!packed.top.contains(&".git".to_owned()));
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
