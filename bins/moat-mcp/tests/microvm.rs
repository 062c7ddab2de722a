//! moat-mcp with `MOAT_BACKEND=vm`, end to end inside the nested test host:
//! this test binary runs itself in level 1, where it drives `moat-mcp` over
//! stdio with rmcp's MCP client (level 1 has no Python for the SDK tests):
//! create, run_command, run_code with a matplotlib PNG, a file round trip,
//! and a task from import to patch — all in real microVMs under moat-vmm.
//!
//! Ignored by plain `cargo test`; `cargo xtask test` provides the nested
//! test host's inputs.

use rmcp::ServiceExt;
use rmcp::model::{CallToolRequestParams, CallToolResult};
use rmcp::service::{RoleClient, RunningService};
use serde_json::{Value, json};

type Client = RunningService<RoleClient, ()>;

async fn call(client: &Client, tool: &str, args: Value) -> (Value, CallToolResult) {
    let arguments = args.as_object().cloned().unwrap_or_default();
    let result =
        client.call_tool(CallToolRequestParams::new(tool.to_owned()).with_arguments(arguments)).await.expect(tool);
    assert_ne!(result.is_error, Some(true), "{tool}: {:?}", result.content);
    (result.structured_content.clone().unwrap_or(Value::Null), result)
}

/// What runs inside level 1.
async fn session() {
    let project = std::path::Path::new("/tmp/mcp-vm-project");
    std::fs::create_dir_all(project).expect("project dir");
    std::fs::write(project.join("main.py"), "print('hello')\n").expect("project file");
    let mut command = tokio::process::Command::new("moat-mcp");
    command.env("MOAT_BACKEND", "vm").env("MOAT_ROOTS", "/tmp").env("MOAT_IDLE_SECONDS", "0");
    let transport = rmcp::transport::TokioChildProcess::new(command).expect("moat-mcp starts");
    let client: Client = ().serve(transport).await.expect("MCP session");

    let (sandbox, _) = call(&client, "create_sandbox", json!({ "memory_mib": 512 })).await;
    assert_eq!(sandbox["backend"], "vm", "{sandbox}");
    let (out, _) =
        call(&client, "run_command", json!({ "cmd": "uname -r; cat /proc/cpuinfo | grep -c processor" })).await;
    assert_eq!(out["exit_code"], 0, "{out}");
    assert!(out["stdout"].as_str().unwrap_or("").contains("cloud-amd64"), "{out}");

    let (out, result) = call(
        &client,
        "run_code",
        json!({ "code": "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()\n6 * 7", "timeout": 600 }),
    )
    .await;
    assert_eq!((out["text"].as_str(), &out["error"]), (Some("42"), &Value::Null), "{out}");
    let images = result.content.iter().filter(|c| c.as_image().is_some_and(|i| i.mime_type == "image/png")).count();
    assert_eq!(images, 1, "{:?}", result.content);

    let blob: String = (0..200_000).map(|i| char::from(b'a' + u8::try_from(i % 26).unwrap_or(0))).collect();
    call(&client, "write_file", json!({ "path": "notes/big.txt", "content": blob })).await;
    // Read back a page (100,000 characters) at a time, as a client does.
    let (mut back, mut offset) = (String::new(), 0);
    loop {
        let (page, _) = call(&client, "read_file", json!({ "path": "notes/big.txt", "offset": offset })).await;
        back.push_str(page["content"].as_str().expect("text"));
        match page["next_offset"].as_u64() {
            Some(next) if page["truncated"] == true => offset = next,
            _ => break,
        }
    }
    assert_eq!(back.len(), blob.len());
    assert!(back == blob, "the file came back changed");

    let (task, _) = call(&client, "task_start", json!({ "source": project.display().to_string() })).await;
    let task_id = task["task_id"].as_str().expect("task id").to_owned();
    call(&client, "run_command", json!({ "cmd": "cd /workspace && echo \"print('bye')\" >> main.py" })).await;
    let (diff, _) = call(&client, "task_diff", json!({ "task_id": task_id })).await;
    assert!(diff["diff"].as_str().unwrap_or("").contains("+print('bye')"), "{diff}");
    let (done, _) = call(&client, "task_finish", json!({ "task_id": task_id })).await;
    assert!(std::path::Path::new(done["patch_path"].as_str().unwrap_or("")).is_file(), "{done}");
    client.cancel().await.expect("the session closes");
}

#[test]
#[ignore = "needs the nested test host (image, binaries, QEMU, busybox-static); run by `cargo xtask test`"]
fn mcp_tools_work_in_microvms_in_the_nested_host() {
    if std::env::var_os("MOAT_TEST_IN_LEVEL1").is_some() {
        let runtime = tokio::runtime::Runtime::new().expect("runtime");
        runtime.block_on(session());
        return;
    }
    let (bundle, name) = moat_nested::bundle_with_this_program().expect("the level-1 bundle");
    let mut payload = moat_nested::Payload::new([
        name.as_str(),
        "--include-ignored",
        "--exact",
        "mcp_tools_work_in_microvms_in_the_nested_host",
    ]);
    payload.env.push(("MOAT_TEST_IN_LEVEL1".into(), "1".into()));
    // Several microVMs at once (a warm pool), their disks' overlays in
    // level 1's memory: more room than the default level 1.
    payload.machine.memory_mib = 4096;
    let out = moat_nested::run_in(&bundle, &payload).expect("level 1 runs the test");
    assert_eq!(out.code, 0, "MCP in microVMs failed:\n{}\n{}", out.stdout_text(), out.stderr_text());
}
