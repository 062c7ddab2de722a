//! What core's integration tests share: the static agent, a `Moat` for a
//! backend, and running a shell script in a sandbox.

use std::path::PathBuf;

// Also used by moat-mcp-bin's rootless Python SDK test (by path).
mod uidwatch;
#[allow(unused_imports)]
pub use uidwatch::{Seen, UidWatch};

use moat_core::{BackendKind, EgressConfig, Moat, MoatConfig, SandboxSpec};
use moat_proto::ExecRequest;

/// The static agent: `$MOAT_AGENT`, else where `cargo xtask build` puts it.
pub fn agent() -> PathBuf {
    std::env::var_os("MOAT_AGENT").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/x86_64-unknown-linux-gnu/release/moat-agent"),
        PathBuf::from,
    )
}

/// A `Moat` on `backend` with the default data directory, tasks importing
/// from the target's temporary directory, and no pool.
pub async fn moat(backend: BackendKind, max_sandboxes: usize, egress: EgressConfig) -> Moat {
    Moat::new(config(backend, max_sandboxes, egress))
        .await
        .expect("moat starts (image built, agent built, running as root)")
}

/// The configuration [`moat`] starts with.
pub fn config(backend: BackendKind, max_sandboxes: usize, egress: EgressConfig) -> MoatConfig {
    MoatConfig {
        data_dir: moat_core::image::data_dir(),
        backend,
        agent: agent(),
        max_sandboxes,
        roots: vec![tmp_root()],
        copy_limit: moat_core::hostfs::DEFAULT_COPY_MAX_MIB << 20,
        task_records_limit: moat_core::task::DEFAULT_RECORDS_MIB << 20,
        pool_size: 0,
        pool_spec: SandboxSpec::default(),
        egress,
        // The test is the operator: it grants what it asks for.
        grants: moat_core::Grants::everything(),
        extra_ca: None,
        preview: moat_core::net::preview::PreviewHost::default(),
        max_memory_mib: None,
    }
}

/// Where tests make the host directories they share with sandboxes (a
/// root of their `Moat`): `$MOAT_TEST_TMPDIR` (the unprivileged account's
/// own, in its run), else the target's temporary directory.
pub fn tmp_root() -> PathBuf {
    std::env::var_os("MOAT_TEST_TMPDIR").map_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")), PathBuf::from)
}

/// The unprivileged account rootless tests run as, prepared by `moat
/// setup --user` (subordinate ids, delegated cgroups, its copy of the
/// image), and a directory of its own holding copies of what it runs.
#[allow(dead_code)]
pub struct Account {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
    /// The first of its subordinate uids: its sandboxes' root.
    pub subids: u32,
    /// Its own directory (removed on drop), with copies of the test
    /// binary and agent: a checkout may lie where it cannot reach.
    pub dir: tempfile::TempDir,
}

/// Looks up the account `cargo xtask test` made and prepared (`moat
/// setup --user`), named in `$MOAT_TEST_ACCOUNT`, and gives it copies of
/// what it runs.
#[allow(dead_code)]
pub fn rootless_account() -> Account {
    use std::os::unix::fs::PermissionsExt;
    let name = std::env::var("MOAT_TEST_ACCOUNT")
        .expect("MOAT_TEST_ACCOUNT names the unprivileged account (made and set up by `cargo xtask test`)");
    let user = nix::unistd::User::from_name(&name).ok().flatten().expect("the account exists");
    let bin_dir = std::env::var_os("MOAT_BIN_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/debug"), PathBuf::from);
    let subuid = std::fs::read_to_string("/etc/subuid").expect("/etc/subuid, written by setup");
    let range = moat_core::hostuser::subordinate(&subuid, user.uid.as_raw(), Some(&name)).expect("a range");
    let dir = tempfile::Builder::new().prefix("moat-rootless-").tempdir().expect("a directory");
    for path in [dir.path().to_path_buf(), dir.path().join("tmp")] {
        std::fs::create_dir_all(&path).expect("mkdir");
        std::os::unix::fs::chown(&path, Some(user.uid.as_raw()), Some(user.gid.as_raw())).expect("chown");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    let copies = [
        (std::env::current_exe().expect("this test binary"), "tests"),
        (agent(), "moat-agent"),
        (bin_dir.join("moat"), "moat"),
    ];
    for (from, name) in copies {
        std::fs::copy(&from, dir.path().join(name)).expect("copies what the account runs");
    }
    Account { name, uid: user.uid.as_raw(), gid: user.gid.as_raw(), home: user.dir, subids: range.start, dir }
}

#[allow(dead_code)]
impl Account {
    /// This test binary (its copy) run as the account.
    pub fn test_binary(&self) -> std::process::Command {
        self.run(&self.dir.path().join("tests"))
    }

    /// The `moat` binary (its copy) run as the account.
    pub fn moat(&self) -> std::process::Command {
        self.run(&self.dir.path().join("moat"))
    }

    /// `program` run as the account, with a clean environment of its own.
    fn run(&self, program: &std::path::Path) -> std::process::Command {
        let mut command = std::process::Command::new("setpriv");
        command
            .arg(format!("--reuid={}", self.uid))
            .arg(format!("--regid={}", self.gid))
            .arg("--init-groups")
            .arg(program)
            .env_clear()
            .env("HOME", &self.home)
            .env("USER", &self.name)
            .env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
            .env("MOAT_AGENT", self.dir.path().join("moat-agent"))
            .env("MOAT_TEST_TMPDIR", self.dir.path().join("tmp"))
            .current_dir(self.dir.path());
        command
    }
}

/// Runs `script` with `bash -c` in sandbox `id`: stdout then stderr, and
/// the exit code.
pub async fn sh(moat: &Moat, id: &str, script: &str) -> (String, Option<i32>) {
    let out = moat.run(id, ExecRequest::shell(script)).await.expect("runs");
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (text, out.status.code)
}

/// A level-1 shell snippet that writes `/l1.sh`, which runs its arguments
/// as after a switch_root: in a mount namespace of its own (run it under
/// `unshare -m --propagation private`), a tmpfs holding level 1's tree
/// through bind mounts is moved over `/` and made the root. Level 1's own
/// root is its initramfs (rootfs), which pivot_root(2) refuses (that is
/// why switch_root exists), and a chroot may not create user namespaces:
/// jails' monitors and passt need a root they can pivot from. A host's
/// real root needs none of it.
// Not every test binary that shares this module runs level 1.
#[allow(dead_code)]
pub const L1_SWITCH_ROOT: &str = r#"mkdir -p /l1
cat > /l1.sh <<'EOF'
mount -t tmpfs tmpfs /l1
for d in /*; do
    case "$d" in /l1) continue ;; esac
    if [ -L "$d" ]; then cp -a "$d" /l1/
    elif [ -d "$d" ]; then mkdir -p "/l1$d" && mount -o rbind "$d" "/l1$d"
    elif [ -f "$d" ]; then cp -a "$d" /l1/
    fi
done
cd /l1
mount -o move /l1 /
exec chroot . "$@"
EOF"#;
