//! What core's integration tests share: the static agent, a `Moat` for a
//! backend, and running a shell script in a sandbox.

use std::path::PathBuf;

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
        roots: vec![PathBuf::from(env!("CARGO_TARGET_TMPDIR"))],
        copy_limit: moat_core::hostfs::DEFAULT_COPY_MAX_MIB << 20,
        pool_size: 0,
        pool_spec: SandboxSpec::default(),
        egress,
        // The test is the operator: it grants what it asks for.
        grants: moat_core::Grants::everything(),
        extra_ca: None,
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
