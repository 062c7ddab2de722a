//! `moat doctor --fix`: installs what moat needs and this host lacks, and
//! says what it did, or what to run where it cannot.

use moat_core::Image;
use moat_image::host::{ensure_packages, is_root, missing_packages};

/// The Debian packages moat uses at run time, each with a program it
/// provides: pasta and passt (network `open` for jails and microVMs), and
/// newuidmap (the subordinate ids of rootless jails, `moat setup --user`).
const RUNTIME_PACKAGES: &[(&str, &str)] = &[("passt", "pasta"), ("passt", "passt"), ("uidmap", "newuidmap")];

/// The host's ssh, which clones over SSH use (when `MOAT_ALLOW_SSH_KEY=1`).
const SSH_PACKAGES: &[(&str, &str)] = &[("openssh-client", "ssh")];

/// Fixes what it can, printing a line for each thing it looked at. Returns
/// whether nothing is left that it could not fix.
pub fn missing(image: &str) -> bool {
    let mut wanted = RUNTIME_PACKAGES.to_vec();
    if moat_core::EgressConfig::from_env().ssh_keys {
        wanted.extend_from_slice(SSH_PACKAGES);
    }
    let root = is_root();
    [packages(&wanted, root), tun(root), cgroup_moves(root), image_built(image, root)].iter().all(|fixed| *fixed)
}

/// The kernel's `favordynmods`, which `moat setup` turns on: speed only,
/// so a kernel without it, or a caller who is not root, leaves nothing
/// unfixed (the line says what to run).
fn cgroup_moves(root: bool) -> bool {
    use moat_core::dynmods::State;
    match (moat_core::dynmods::state(), root) {
        (State::On, _) => println!("fix: cgroup moves: favordynmods is on"),
        (State::NoCgroups, _) => println!("fix: cgroup moves: this host has no cgroups"),
        (State::Off | State::Unseen, false) => println!(
            "fix: cgroup moves: favordynmods is off or unseen, so each jail's start may wait for an RCU grace \
             period; as root, run `moat setup`"
        ),
        (State::Off | State::Unseen, true) => println!("fix: cgroup moves: {}", crate::setup::tune_host()),
    }
    true
}

fn packages(wanted: &[(&str, &str)], root: bool) -> bool {
    let missing = missing_packages(wanted);
    let mut names: Vec<&str> = wanted.iter().map(|(p, _)| *p).collect();
    names.dedup();
    if missing.is_empty() {
        println!("fix: host packages: none missing ({})", names.join(", "));
        return true;
    }
    if !root {
        println!(
            "fix: host packages: {} missing; as root, run: apt-get install -y {}",
            missing.join(", "),
            missing.join(" ")
        );
        return false;
    }
    match ensure_packages(wanted) {
        Ok(installed) => {
            println!("fix: host packages: installed {}", installed.join(", "));
            true
        }
        Err(e) => {
            println!("fix: host packages: installing {} failed: {e:#}", missing.join(", "));
            false
        }
    }
}

/// `/dev/net/tun` at Debian's usual mode 0666 (pasta runs as the
/// sandbox's unprivileged root, as root or not), made when it is missing.
fn tun(root: bool) -> bool {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let tun = moat_core::backend::jail::TUN;
    let Some(problem) = moat_core::backend::jail::tun_problem() else {
        return true;
    };
    if !root {
        println!("fix: {tun}: not fixed (it takes root): {problem}");
        return false;
    }
    let done = match std::fs::metadata(tun) {
        Ok(meta) if meta.file_type().is_char_device() => {
            let was = meta.permissions().mode() & 0o7777;
            std::fs::set_permissions(tun, std::fs::Permissions::from_mode(0o666))
                .map(|()| format!("was mode {was:04o}, which stops pasta; now 0666"))
        }
        Ok(_) => Err(std::io::Error::other("it is not a character device; remove it and run this again")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            make_tun(tun).map(|()| "made it (10:200, mode 0666)".into())
        }
        Err(e) => Err(e),
    };
    match done {
        Ok(what) => {
            println!("fix: {tun}: {what}");
            true
        }
        Err(e) => {
            println!("fix: {tun}: not fixed ({e}): {problem}");
            false
        }
    }
}

/// The tun device node, as udev makes it: character device 10:200.
fn make_tun(tun: &str) -> std::io::Result<()> {
    use nix::sys::stat::{Mode, SFlag, makedev, mknod};
    let path = std::path::Path::new(tun);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    mknod(path, SFlag::S_IFCHR, Mode::from_bits_truncate(0o666), makedev(10, 200))?;
    // The umask trimmed the mode mknod was given.
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o666))
}

/// The image, built when there is none (an image that is there is left
/// as it is: `moat image build` updates it).
fn image_built(name: &str, root: bool) -> bool {
    let data = moat_core::image::data_dir();
    let problem = match Image::open(&data, name) {
        Ok(image) => {
            println!("fix: image {name:?}: present at {} (`moat image build` updates it)", image.dir.display());
            return true;
        }
        Err(e) => e,
    };
    if !root {
        println!(
            "fix: image {name:?}: {problem}; as root, run `moat image build --name {name}`, then `moat setup --user \
             {}` to give this user a copy",
            moat_core::hostuser::HostUser::current().display_name()
        );
        return false;
    }
    let agent = match moat_core::moat::find_agent() {
        Ok(agent) => agent,
        Err(e) => {
            println!("fix: image {name:?}: cannot be built: {e}");
            return false;
        }
    };
    println!("fix: image {name:?}: {problem}; building it (several minutes: Debian's packages are downloaded)");
    match moat_image::build(name, false, &agent) {
        Ok(dir) => {
            println!("fix: image {name:?}: built at {}", dir.display());
            true
        }
        Err(e) => {
            let mut text = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(cause) = source {
                text.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            println!("fix: image {name:?}: {text}");
            false
        }
    }
}
