//! Until it is built, `moat-vmm` says so and fails, rather than pretend.

#[test]
fn refuses_to_pretend() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_moat-vmm")).output().expect("runs");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not part of this build yet"), "{out:?}");
}
