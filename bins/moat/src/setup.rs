//! `moat setup [--user NAME]`: what root prepares once: the host's cgroups
//! (moves without a grace period, `moat_core::dynmods`) and, with `--user`,
//! what user NAME needs to run moat without root (docs/operations.md,
//! "Rootless").

use moat_core::cgroup::CgroupSupport;
use moat_core::dynmods::Enabled;
use moat_core::hostuser::{Range, free_range, subordinate};
use moat_core::image::{Image, JAIL_ID_COUNT};

use crate::Result;

/// `moat setup`: the host, then user `user` when one is named. The user is
/// checked before anything is changed.
pub fn run(user: Option<&str>, image: &str) -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        return Err(match user {
            Some(_) => {
                "`moat setup --user` prepares another user for rootless sandboxes and needs root: run it \
                        with sudo, once per user"
            }
            None => "`moat setup` changes how the host's cgroups lock and needs root: run it with sudo, once",
        }
        .into());
    }
    let user = user.map(account).transpose()?;
    host();
    user.map_or(Ok(()), |user| prepare(&user, image))
}

/// The account named `name`, which must exist and not be root.
fn account(name: &str) -> Result<nix::unistd::User> {
    let user = nix::unistd::User::from_name(name)?
        .ok_or_else(|| format!("there is no user {name:?} on this host (see `getent passwd`)"))?;
    if user.uid.is_root() {
        return Err("root needs no setup: it runs sandboxes as it is".into());
    }
    Ok(user)
}

/// Turns on the kernel's `favordynmods` so that a jail joining its
/// cgroups waits for no RCU grace period. Says what it did; a kernel
/// without the option is said, not an error (jails work without it).
fn host() {
    println!("cgroups: {}", tune_host());
}

/// [`moat_core::dynmods::enable`], said in words (for `moat setup` and
/// `moat doctor --fix`).
pub fn tune_host() -> String {
    match moat_core::dynmods::enable() {
        Ok(Enabled::Already) => "favordynmods is on (moves between cgroups wait for no grace period)".into(),
        Ok(Enabled::Remounted(at)) => format!(
            "remounted {} with favordynmods: moves between cgroups wait for no grace period until reboot",
            at.display()
        ),
        Ok(Enabled::Mounted) => "mounted cgroup v2 with favordynmods for a moment: moves between cgroups wait for \
                                 no grace period until reboot"
            .into(),
        Err(e) => format!("favordynmods stays off: {e}"),
    }
}

/// Prepares `user` for rootless sandboxes: a subordinate id range
/// (picked and added with usermod(8) when it has none), a delegated cgroup
/// subtree in every hierarchy, and a copy of root's image `image` in its
/// data directory with the rootfs owned in its range. Says what it did.
fn prepare(user: &nix::unistd::User, image: &str) -> Result<()> {
    let name = user.name.as_str();
    let (uid, gid) = (user.uid.as_raw(), user.gid.as_raw());

    let read = |file: &str| std::fs::read_to_string(file).unwrap_or_default();
    let found = || {
        let (subuid, subgid) = (read("/etc/subuid"), read("/etc/subgid"));
        (subordinate(&subuid, uid, Some(name)), subordinate(&subgid, uid, Some(name)), subuid, subgid)
    };
    let (mut uids, mut gids, subuid, subgid) = found();
    if uids.is_none() || gids.is_none() {
        // Only what is missing is added: from the start of the half there
        // is (a jail's image is owned from one id for uids and gids), else
        // from a range free in both files.
        let range = match (uids, gids) {
            (Some(have), None) if moat_core::hostuser::is_free(&subgid, have) => have,
            (None, Some(have)) if moat_core::hostuser::is_free(&subuid, have) => have,
            (Some(have), None) | (None, Some(have)) => {
                let (given, missing) = if uids.is_some() { ("uids", "/etc/subgid") } else { ("gids", "/etc/subuid") };
                let free = free_range(&subuid, &subgid).map_or_else(|| "N-M".to_owned(), show);
                return Err(format!(
                    "{name}'s subordinate {given} are {have}, and {missing} gives some of those ids to someone \
                     else; a jail's image is owned from one id for uids and gids: as root, give {name} both from \
                     one free start (`usermod --del-sub{given} {have} --add-subuids {free} --add-subgids {free} \
                     {name}`), then run this again",
                    have = show(have)
                )
                .into());
            }
            _ => free_range(&subuid, &subgid).ok_or("no free range of 65536 subordinate ids is left")?,
        };
        let span = format!("{}-{}", range.start, range.start + range.count - 1);
        let mut usermod = std::process::Command::new("usermod");
        if uids.is_none() {
            usermod.args(["--add-subuids", &span]);
        }
        if gids.is_none() {
            usermod.args(["--add-subgids", &span]);
        }
        let status = usermod
            .arg(name)
            .status()
            .map_err(|e| format!("cannot run usermod ({e}): install Debian's passwd package"))?;
        if !status.success() {
            return Err(format!("usermod adding the subordinate ids {span} to {name} failed ({status})").into());
        }
        println!("subordinate ids: gave {name} {span} (usermod)");
        (uids, gids, _, _) = found();
    }
    let (Some(uids), Some(gids)) = (uids, gids) else {
        return Err(format!(
            "{name} still has no subordinate range of {JAIL_ID_COUNT} ids in /etc/subuid and /etc/subgid"
        )
        .into());
    };
    if uids.start != gids.start {
        return Err(moat_core::hostuser::split_ranges(name, uids, gids).into());
    }
    println!("subordinate ids: {name} maps uids {} and gids {} (/etc/subuid, /etc/subgid)", show(uids), show(gids));
    for helper in ["newuidmap", "newgidmap"] {
        if moat_core::programs::find_program(helper).is_none() {
            println!("warning: {helper} is not installed; install it with `apt-get install uidmap`");
        }
    }

    match CgroupSupport::probe() {
        CgroupSupport::None => {
            println!("cgroups: this host has none; {name}'s sandboxes are refused unless MOAT_ALLOW_UNLIMITED=1");
        }
        support => {
            for delegated in moat_core::cgroup::delegate(&support, uid, gid)? {
                let what = if delegated.made { "made" } else { "kept" };
                println!("cgroups: {what} {} (owned by {name})", delegated.dir.display());
            }
            if support == CgroupSupport::V2 {
                println!(
                    "cgroups: on cgroup v2 a process may move only within a subtree it already runs in: start \
                     {name}'s moat below it, or, under systemd, in a delegated scope of its own (`systemd-run \
                     --user --scope -p Delegate=yes -- moat-mcp`, which `moat-mcp init` writes; \
                     docs/operations.md, \"Rootless\")"
                );
            }
        }
    }

    let source = Image::open(&moat_core::image::data_dir(), image)
        .map_err(|e| format!("root's image {image:?} cannot be copied for {name}: {e}"))?;
    // The user's directory: read and written through descriptors only
    // (moat_core::image::copy_for_user says why).
    let data = user.dir.join(moat_core::image::USER_DATA_DIR);
    let fresh = moat_core::image::user_copy_manifest(&user.dir, image).is_some_and(|copy| {
        copy.jail_id_base == uids.start
            && copy.artifacts == source.manifest.artifacts
            && copy.created == source.manifest.created
    });
    if fresh {
        println!("image {image:?}: {name}'s copy in {} is current", data.display());
    } else {
        let started = std::time::Instant::now();
        let copy = moat_core::image::copy_for_user(&source, &user.dir, uids.start, (uid, gid))?;
        println!(
            "image {image:?}: copied into {} with its files owned from id {} ({:.1} s)",
            copy.display(),
            uids.start,
            started.elapsed().as_secs_f64()
        );
    }
    println!(
        "{name} can now run moat without root; `moat doctor`, run as {name}, checks the rest (/dev/kvm for microVMs)"
    );
    Ok(())
}

fn show(range: Range) -> String {
    format!("{}-{}", range.start, range.start + range.count - 1)
}
