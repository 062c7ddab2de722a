//! `docs/tools.md` is generated from `testdata/tools.json`; this test fails
//! when they drift. Regenerate with `MOAT_BLESS=1 cargo test -p moat-mcp --test contract`.

use serde_json::Value;

const DOC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/tools.md");

fn render() -> String {
    let contract: Value = serde_json::from_str(moat_mcp::CONTRACT).expect("tools.json parses");
    let mut out = String::from(
        "# Tools\n\n\
         Generated from `testdata/tools.json` (the contract `tools/list` returns) by\n\
         `MOAT_BLESS=1 cargo test -p moat-mcp --test contract`; do not edit by hand.\n\n\
         Every tool takes an optional `sandbox_id`; without it the session's current\n\
         sandbox is used, created with the defaults on first need. Mistakes the model\n\
         can fix come back as results with `isError: true` and a message saying what\n\
         to do. Text outputs are cut at 100,000 characters.\n\n\
         `git_clone` needs a sandbox with network `filtered` or `open`. A model may\n\
         ask only for what the operator grants: network up to `MOAT_ALLOW_NETWORK`\n\
         (`none` unless set), `allow_hosts` among the operator's hosts, and for one\n\
         sandbox at most `MOAT_MAX_CPUS`, `MOAT_MAX_SANDBOX_MEMORY_MIB`,\n\
         `MOAT_MAX_DISK_MIB` and `MOAT_MAX_TIMEOUT_SECONDS`; more is refused with the\n\
         variable that would allow it. Network policies, the\n\
         egress log and preview links are described in [network.md](network.md).\n",
    );
    for tool in contract["tools"].as_array().expect("tools") {
        let name = tool["name"].as_str().unwrap_or_default();
        out.push_str(&format!("\n## `{name}`\n\n{}\n\n", tool["description"].as_str().unwrap_or_default()));
        let a = &tool["annotations"];
        let flag = |k: &str| if a[k].as_bool().unwrap_or(false) { "yes" } else { "no" };
        out.push_str(&format!(
            "read-only: {}, destructive: {}, idempotent: {}, open world: {}\n\n",
            flag("readOnlyHint"),
            flag("destructiveHint"),
            flag("idempotentHint"),
            flag("openWorldHint")
        ));
        let required: Vec<&str> =
            tool["inputSchema"]["required"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
        let props = tool["inputSchema"]["properties"].as_object();
        if props.is_none_or(|p| p.is_empty()) {
            out.push_str("No arguments.\n");
        } else {
            out.push_str("| argument | type | required | description |\n|---|---|---|---|\n");
            for (arg, schema) in props.into_iter().flatten() {
                let ty = match &schema["type"] {
                    Value::String(t) => t.clone(),
                    Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(" or "),
                    _ => String::new(),
                };
                let mut desc = schema["description"].as_str().unwrap_or_default().to_owned();
                if let Some(values) = schema["enum"].as_array() {
                    let values: Vec<String> =
                        values.iter().map(|v| format!("`{}`", v.as_str().unwrap_or_default())).collect();
                    desc = format!("{desc} One of {}.", values.join(", ")).trim().to_owned();
                }
                if let (Some(min), Some(max)) = (schema["minimum"].as_u64(), schema["maximum"].as_u64()) {
                    desc = format!("{desc} {min}–{max}.").trim().to_owned();
                }
                let req = if required.contains(&arg.as_str()) { "yes" } else { "" };
                out.push_str(&format!("| `{arg}` | {ty} | {req} | {} |\n", desc.replace('|', "\\|")));
            }
        }
        if let Some(fields) = tool["outputSchema"]["properties"].as_object() {
            let names: Vec<String> = fields.keys().map(|k| format!("`{k}`")).collect();
            out.push_str(&format!("\nReturns: {}.\n", names.join(", ")));
        }
    }
    out
}

#[test]
fn docs_tools_md_is_generated_from_the_contract() {
    let rendered = render();
    if std::env::var_os("MOAT_BLESS").is_some() {
        std::fs::write(DOC, &rendered).expect("write docs/tools.md");
    }
    let current = std::fs::read_to_string(DOC).unwrap_or_default();
    assert!(
        current == rendered,
        "docs/tools.md is out of date with testdata/tools.json; run MOAT_BLESS=1 cargo test -p moat-mcp --test contract"
    );
}
