//! Create a sandbox, run Python in it, read a file back, destroy it.
//!
//! `cargo run -p moat-core --example hello` (as root, after `cargo xtask
//! build` and `cargo xtask image`).

#![allow(clippy::print_stdout)]

use moat_core::{Moat, MoatConfig, SandboxSpec};
use moat_proto::{ExecRequest, ReadFileRequest};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let moat = Moat::new(MoatConfig::from_env()?).await?;
    let sandbox = moat.create(SandboxSpec::default()).await?;
    println!("created {} ({} backend)", sandbox.id, sandbox.backend);

    let out = moat.run(&sandbox.id, ExecRequest::shell("python3 -c 'print(6 * 7)' | tee answer.txt")).await?;
    println!("python says {}", String::from_utf8_lossy(&out.stdout).trim());

    let client = moat.client(&sandbox.id).await?;
    let file =
        client.read_file(ReadFileRequest { path: "/home/user/answer.txt".into(), offset: 0, length: None }).await?;
    println!("answer.txt holds {:?}", String::from_utf8_lossy(&file));

    moat.destroy(&sandbox.id).await?;
    println!("destroyed");
    Ok(())
}
