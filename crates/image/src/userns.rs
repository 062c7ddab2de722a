//! Building as a user other than root (issue U1): the root file system is
//! made by `mmdebstrap --mode=unshare`, as root of a user namespace that
//! maps the user's subordinate range, so its files are owned by those ids
//! (sandbox root is the range's first id, as rootless jails map it). The
//! user itself cannot read, copy or remove most of them; what must, runs
//! through mmdebstrap's own `--unshare-helper`, as root of a namespace with
//! that same mapping. mmdebstrap is a build dependency already, and its
//! helper is the one that made the tree, so the two cannot map differently.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use moat_core::hostuser::HostUser;
use moat_core::image::{JAIL_ID_COUNT, TreeDigest, TreeEntry};

use crate::host::run;
use crate::rootfs;

/// `program` run as root of the build's user namespace.
pub fn command(program: &str) -> Command {
    let mut command = Command::new("mmdebstrap");
    command.args(["--unshare-helper", program]);
    command
}

/// The host id a rootless build's tree starts at (its sandbox root), once
/// the user can build: a subordinate range of [`JAIL_ID_COUNT`] ids that
/// starts at the same id for users and groups, and `newuidmap` to map it.
/// The error says what to change.
pub fn base(user: &HostUser) -> Result<u32> {
    let name = user.display_name();
    let Some((uids, gids)) = user.ids else {
        bail!(
            "user {name} has no subordinate id range of {JAIL_ID_COUNT} ids in /etc/subuid and /etc/subgid, which a \
             rootless image build owns its files with; as root, run `moat setup --user {name}`, or `usermod \
             --add-subuids N-M --add-subgids N-M {name}` with a free range"
        );
    };
    if uids.start != gids.start {
        bail!(
            "user {name}'s subordinate uids start at {} and its gids at {}: an image's files are owned from one \
             id for both; as root, give {name} ranges that start at the same id (/etc/subuid, /etc/subgid)",
            uids.start,
            gids.start
        );
    }
    if let Some(problem) = user.jail_problem() {
        bail!("{problem}");
    }
    Ok(uids.start)
}

/// Checks that mmdebstrap mapped the tree's root onto `base`: it takes the
/// user's first line in `/etc/subuid`, moat the first with enough ids.
pub fn check_owner(tree: &Path, base: u32) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(tree).with_context(|| format!("reading {}", tree.display()))?;
    if (meta.uid(), meta.gid()) != (base, base) {
        bail!(
            "mmdebstrap made {} owned by {}:{}, but rootless jails map sandbox root to {base}: put the range of \
             {JAIL_ID_COUNT} ids first among this user's lines in /etc/subuid and /etc/subgid",
            tree.display(),
            meta.uid(),
            meta.gid()
        );
    }
    Ok(())
}

/// Makes `dest` an ext4 image of `tree` with the ids as the sandbox sees
/// them (0 for root, 1000 for `user`): mkfs.ext4 reads the tree from inside
/// the namespace. The namespace's root is not the user and cannot create
/// files in the user's directories, so the user makes the file, writable by
/// all for the run. No one else may find it meanwhile: it has a random
/// name of 128 bits in a directory others may pass through but not list
/// (mode 0711), and it takes its own name, the user's alone (0644), only
/// once mkfs has closed it. (One who opened it for writing while it could
/// be would keep that descriptor past any later chmod.)
pub fn make_ext4(tree: &Path, dest: &Path) -> Result<()> {
    let dir = dest.parent().context("the image file has no directory")?;
    let mode = std::fs::metadata(dir)?.permissions();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))?;
    let made = make_hidden(tree, dir, dest);
    std::fs::set_permissions(dir, mode)?;
    made
}

/// [`make_ext4`]'s work in `dir`, while others cannot list it.
fn make_hidden(tree: &Path, dir: &Path, dest: &Path) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut secret = [0u8; 16];
    getrandom::fill(&mut secret).map_err(|e| anyhow::anyhow!("no random name for the image file: {e}"))?;
    let name: String = secret.iter().map(|b| format!("{b:02x}")).collect();
    let temp = dir.join(format!(".mkfs-{name}"));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&temp)
        .with_context(|| format!("creating {}", temp.display()))?;
    std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(0o666))?;
    let made = run(command("mkfs.ext4")
        .args(rootfs::ext4_args())
        .arg("-d")
        .arg(tree)
        .arg(&temp)
        .arg(rootfs::ext4_size())
        .stdout(Stdio::null()));
    std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(0o644))?;
    if let Err(e) = made {
        let _ = std::fs::remove_file(&temp);
        return Err(e.context("mkfs.ext4 in the build's user namespace"));
    }
    std::fs::rename(&temp, dest).with_context(|| format!("naming {}", dest.display()))?;
    Ok(())
}

/// The [`TreeDigest`] of a rootless build's `tree`, as a walk by root would
/// take it (host ids): find(1) lists it from inside the namespace, which
/// reads every directory, and each id moves back up by `base`.
pub fn digest_tree(tree: &Path, base: u32) -> std::io::Result<TreeDigest> {
    let out = command("find")
        .arg(tree)
        .args(["-mindepth", "1", "-printf", "%P\\0%y\\0%m\\0%U\\0%G\\0%s\\0"])
        .stderr(Stdio::piped())
        .output()?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!(
            "listing {} in the build's user namespace failed ({}): {}",
            tree.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    parse_listing(&out.stdout, base).map(TreeDigest::of)
}

/// find's `%P\0%y\0%m\0%U\0%G\0%s\0` records as tree entries, ids moved
/// from the namespace's (0…) to the host's (`base`…).
fn parse_listing(listing: &[u8], base: u32) -> std::io::Result<Vec<TreeEntry>> {
    let bad = |what: &str| std::io::Error::other(format!("find(1) listed {what}"));
    let fields: Vec<&[u8]> = listing.split(|b| *b == 0).collect();
    // The listing ends with a NUL: the last split is empty.
    let fields = fields.split_last().map_or(&[][..], |(_, rest)| rest);
    if !fields.len().is_multiple_of(6) {
        return Err(bad("a record with other than six fields"));
    }
    let number = |field: &[u8], radix: u32| {
        u64::from_str_radix(&String::from_utf8_lossy(field), radix).map_err(|_| bad("a field that is not a number"))
    };
    let host_id = |id: u64| {
        u32::try_from(id)
            .ok()
            .filter(|id| *id < JAIL_ID_COUNT)
            .map(|id| base + id)
            .ok_or_else(|| bad("an owner outside the subordinate range"))
    };
    fields
        .chunks(6)
        .map(|record| {
            let kind = match record[1] {
                b"f" => 0o100_000,
                b"d" => 0o040_000,
                b"l" => 0o120_000,
                b"c" => 0o020_000,
                b"b" => 0o060_000,
                b"p" => 0o010_000,
                b"s" => 0o140_000,
                _ => return Err(bad("an entry of unknown type")),
            };
            let permissions = u32::try_from(number(record[2], 8)?).map_err(|_| bad("a mode out of range"))?;
            Ok(TreeEntry {
                path: String::from_utf8_lossy(record[0]).into_owned(),
                mode: kind | permissions,
                uid: host_id(number(record[3], 10)?)?,
                gid: host_id(number(record[4], 10)?)?,
                size: if kind == 0o100_000 { number(record[5], 10)? } else { 0 },
            })
        })
        .collect()
}

/// Removes `path`, a tree the user owns that may hold a build's root file
/// system: what the namespace's root owns goes from inside it (find's
/// errors for the user's own entries are expected), the rest as the user.
pub fn remove_tree(path: &Path) -> std::io::Result<()> {
    if !path.exists() {
        return Ok(());
    }
    if std::fs::remove_dir_all(path).is_ok() {
        return Ok(());
    }
    let _ = command("find")
        .arg(path)
        .args(["-mindepth", "1", "-delete"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    std::fs::remove_dir_all(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listing_becomes_host_owned_entries() {
        let listing =
            b"etc\0d\x00755\x000\x000\x004096\0etc/shadow\0f\x00640\x000\x0042\x00501\0bin\0l\x00777\x000\x000\x007\0";
        let entries = parse_listing(listing, 100_000).expect("parses");
        assert_eq!(
            entries,
            vec![
                TreeEntry { path: "etc".into(), mode: 0o40755, uid: 100_000, gid: 100_000, size: 0 },
                TreeEntry { path: "etc/shadow".into(), mode: 0o100640, uid: 100_000, gid: 100_042, size: 501 },
                TreeEntry { path: "bin".into(), mode: 0o120777, uid: 100_000, gid: 100_000, size: 0 },
            ]
        );
    }

    #[test]
    fn a_listing_with_an_owner_outside_the_range_is_refused() {
        let listing = b"x\0f\x00644\x0065534\x000\x001\0";
        assert!(parse_listing(listing, 100_000).is_ok(), "65534 is inside a range of 65536");
        let listing = b"x\0f\x00644\x0065536\x000\x001\0";
        let err = parse_listing(listing, 100_000).expect_err("outside");
        assert!(err.to_string().contains("outside the subordinate range"), "{err}");
        assert!(parse_listing(b"x\0f\0", 0).is_err(), "a short record");
    }

    /// The listing taken from inside the namespace and root's walk agree
    /// on the same tree (here a tree root owns, listed by find as root).
    #[test]
    fn find_and_the_walk_digest_a_tree_alike() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        std::fs::create_dir_all(root.join("a/b")).expect("mkdir");
        std::fs::write(root.join("a/b/file"), b"hello").expect("write");
        std::fs::set_permissions(root.join("a/b/file"), std::fs::Permissions::from_mode(0o4755)).expect("chmod");
        std::os::unix::fs::symlink("a/b/file", root.join("link")).expect("symlink");
        let me = nix::unistd::geteuid().as_raw();
        let out = Command::new("find")
            .arg(root)
            .args(["-mindepth", "1", "-printf", "%P\\0%y\\0%m\\0%U\\0%G\\0%s\\0"])
            .output()
            .expect("find");
        // Listed as its own ids: a base of 0, when they are in range.
        if me < JAIL_ID_COUNT && nix::unistd::getegid().as_raw() < JAIL_ID_COUNT {
            let listed = TreeDigest::of(parse_listing(&out.stdout, 0).expect("parses"));
            assert_eq!(listed, moat_core::image::digest_tree(root).expect("walks"));
        }
    }

    /// As an unprivileged user with a subordinate range (the gate's
    /// rootless account): the image file is made under a random name in a
    /// directory others cannot list, and left the user's alone.
    #[test]
    #[ignore = "needs an unprivileged user with a subordinate range, mmdebstrap and mkfs.ext4"]
    fn a_rootless_ext4_is_made_where_no_one_else_finds_it() {
        if nix::unistd::geteuid().is_root() || base(&moat_core::hostuser::HostUser::current()).is_err() {
            eprintln!("skipped: not an unprivileged user with a subordinate range");
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let tree = dir.path().join("tree");
        std::fs::create_dir_all(tree.join("etc")).expect("mkdir");
        std::fs::write(tree.join("etc/hostname"), "sandbox\n").expect("write");
        let work = dir.path().join("work");
        std::fs::create_dir(&work).expect("mkdir");
        let dest = work.join("rootfs.ext4");
        make_ext4(&tree, &dest).expect("made");
        let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o777;
        assert_eq!((mode(&dest), mode(&work)), (0o644, 0o755));
        let names: Vec<_> = std::fs::read_dir(&work).expect("ls").map(|e| e.expect("entry").file_name()).collect();
        assert_eq!(names, ["rootfs.ext4"], "no temporary name is left");
    }
}
