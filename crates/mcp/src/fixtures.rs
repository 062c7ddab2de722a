//! TEST ONLY: the diagnostic tools the official MCP conformance suite
//! probes a server through, listed and served only when
//! `MOAT_TEST_CONFORMANCE_TOOLS=1` (over `--http`, which the suite drives;
//! the server warns when it is set). Agents never see them: moat's tools
//! are its contract, `testdata/tools.json`.
//!
//! Each one lets the suite check a property of moat's own transport, which
//! no contract tool shows on demand:
//!
//! - `test_reconnection`: its response stream is closed after its first
//!   (priming) event, and the result reaches the client only through the
//!   event log, when it reconnects with `Last-Event-ID` (SEP-1699; the
//!   cut is made in [`crate::http`]);
//! - `test_missing_capability`: a tool that needs the client's `sampling`
//!   capability refuses a client that did not declare it with -32021 and
//!   the capability it needs, which streamable HTTP answers with 400
//!   (SEP-2575);
//! - `test_streaming_elicitation`: a call from a client that can elicit
//!   gets its result on the response stream with no request of the
//!   server's among it (moat asks clients for nothing);
//! - `test_logging_tool`: a call without a log level gets no
//!   `notifications/message` (moat sends none at all).

use rmcp::model::{CallToolResult, ClientCapabilities, ContentBlock, Tool};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as McpError, RoleServer};

/// The variable that turns the fixtures on.
pub const VAR: &str = "MOAT_TEST_CONFORMANCE_TOOLS";

/// The fixture whose response stream [`crate::http`] cuts.
pub const RECONNECTION: &str = "test_reconnection";

const FIXTURES: &[(&str, &str)] = &[
    (RECONNECTION, "TEST ONLY: answers after its response stream was closed; resume with Last-Event-ID"),
    ("test_missing_capability", "TEST ONLY: needs the client's sampling capability"),
    ("test_streaming_elicitation", "TEST ONLY: answers a client that can elicit on its response stream"),
    ("test_logging_tool", "TEST ONLY: sends log messages only to a call that asked for a log level"),
];

/// The fixtures as `tools/list` lists them.
pub fn tools() -> Vec<Tool> {
    FIXTURES
        .iter()
        .map(|(name, description)| {
            let schema = serde_json::json!({"type": "object", "properties": {}, "additionalProperties": false});
            let serde_json::Value::Object(schema) = schema else { unreachable!("an object literal") };
            Tool::new(*name, *description, std::sync::Arc::new(schema))
        })
        .collect()
}

/// Whether `name` is a fixture.
pub fn is_fixture(name: &str) -> bool {
    FIXTURES.iter().any(|(fixture, _)| *fixture == name)
}

/// Calls fixture `name` (see the module's text).
pub fn call(name: &str, context: &RequestContext<RoleServer>) -> Result<CallToolResult, McpError> {
    let declared = context.client_capabilities();
    let text = match name {
        RECONNECTION => "Reconnection test completed successfully",
        "test_missing_capability" => {
            if declared.as_ref().is_none_or(|caps| caps.sampling.is_none()) {
                let mut needed = ClientCapabilities::default();
                needed.sampling = Some(Default::default());
                return Err(McpError::missing_required_client_capability(needed));
            }
            "the client declared sampling"
        }
        "test_streaming_elicitation" => "answered on the response stream; moat sends clients no requests",
        "test_logging_tool" => "no log level was asked for, so no log message was sent",
        _ => return Err(McpError::invalid_params(format!("{name:?} is not a conformance fixture"), None)),
    };
    Ok(CallToolResult::success(vec![ContentBlock::text(text)]))
}

/// Whether a JSON-RPC message is a `tools/call` of `tool`.
pub fn is_call_of(message: &[u8], tool: &str) -> bool {
    serde_json::from_slice::<serde_json::Value>(message).is_ok_and(|m| {
        m.get("method").and_then(serde_json::Value::as_str) == Some("tools/call")
            && m.pointer("/params/name").and_then(serde_json::Value::as_str) == Some(tool)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixtures_are_listed_with_object_schemas_and_found_by_name() {
        let tools = tools();
        assert_eq!(tools.len(), FIXTURES.len());
        assert!(tools.iter().all(|t| t.input_schema.get("type") == Some(&serde_json::json!("object"))));
        assert!(is_fixture("test_logging_tool") && !is_fixture("run_command"));
        let contract = crate::contract_tools().expect("the contract parses");
        assert!(contract.iter().all(|t| !is_fixture(&t.name)), "a fixture's name is a contract tool's");
    }

    #[test]
    fn only_a_call_of_the_named_tool_matches() {
        let call = br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"test_reconnection"}}"#;
        assert!(is_call_of(call, RECONNECTION));
        assert!(!is_call_of(call, "run_command"));
        assert!(!is_call_of(br#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#, RECONNECTION));
        assert!(!is_call_of(b"not json", RECONNECTION));
    }
}
