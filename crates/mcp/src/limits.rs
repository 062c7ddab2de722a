//! The size limit on one incoming MCP message, and the answer a message
//! over it gets, the same over stdio ([`crate::stdio`]) and HTTP
//! ([`crate::http`]).
//!
//! A message over the limit is never parsed, nor held whole: its bytes are
//! fed through an [`IdScanner`], which finds the JSON-RPC `id` wherever it
//! sits in the object while keeping only a few bytes, so that the client
//! gets an error for the request it sent instead of waiting for ever.

use serde_json::{Value, json};

/// The largest message moat-mcp accepts, in bytes: a stdio line (its
/// newline included) or an HTTP request body. 16 MiB, as rmcp's own
/// default for a line and for a streamed HTTP event; `write_file` content
/// beyond a few MiB belongs in `copy_to_sandbox` anyway.
pub const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

/// JSON-RPC "Invalid Request", the code of an oversized message.
pub const INVALID_REQUEST: i64 = -32600;

/// JSON-RPC "Parse error", the code of a message that is not JSON.
pub const PARSE_ERROR: i64 = -32700;

/// The words of the answer to a message of at least `seen` bytes.
pub fn too_large_message(seen: usize) -> String {
    format!(
        "Request too large: {seen} bytes or more, over moat-mcp's limit of {MAX_MESSAGE_BYTES} bytes (16 MiB) \
         per message; it was not processed. To put a large file into a sandbox use copy_to_sandbox (it copies \
         from a host path without passing the content through MCP), or write the file in pieces of a few MiB"
    )
}

/// The JSON-RPC error response to an oversized message with `id` (null
/// when the message had none that could be found).
pub fn too_large_response(id: Option<Value>, seen: usize) -> Value {
    json!({
        "jsonrpc": "2.0",
        "id": id.unwrap_or(Value::Null),
        "error": {
            "code": INVALID_REQUEST,
            "message": too_large_message(seen),
            "data": { "limit_bytes": MAX_MESSAGE_BYTES, "use_instead": "copy_to_sandbox" },
        },
    })
}

/// A JSON-RPC error response with `code` and `message`.
pub fn error_response(id: Option<Value>, code: i64, message: String) -> Value {
    json!({ "jsonrpc": "2.0", "id": id.unwrap_or(Value::Null), "error": { "code": code, "message": message } })
}

/// The longest member name or `id` value kept while scanning; an `id`
/// longer than this is not reported (JSON-RPC ids are short).
const MAX_TOKEN: usize = 256;

/// Finds the top-level `"id"` of a JSON object fed in pieces, in bounded
/// memory. Anything not an object, or an id that is not a number or a
/// string, yields no id.
#[derive(Debug, Default)]
pub struct IdScanner {
    depth: u32,
    in_string: bool,
    escaped: bool,
    /// The current top-level string (a member name or value), while short.
    token: Vec<u8>,
    token_overflow: bool,
    /// The last complete top-level string (a member name once `:` follows).
    last_string: Option<Vec<u8>>,
    /// Bytes of the id's value while it is read.
    value: Option<Vec<u8>>,
    found: Option<Value>,
    /// The input is not an object: nothing to find.
    done: bool,
    started: bool,
}

impl IdScanner {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes the next bytes of the message.
    pub fn feed(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            if self.done {
                return;
            }
            self.step(byte);
        }
    }

    /// The id, once the scan saw it whole.
    pub fn id(&self) -> Option<Value> {
        self.found.clone()
    }

    fn step(&mut self, byte: u8) {
        if !self.started {
            if byte.is_ascii_whitespace() || matches!(byte, 0xEF | 0xBB | 0xBF) {
                return;
            }
            self.started = true;
            if byte != b'{' {
                self.done = true;
                return;
            }
            self.depth = 1;
            return;
        }
        if let Some(value) = self.value.as_mut() {
            // Reading the id's value: it ends at `,` or `}` outside a string.
            let ends = !self.in_string && self.depth == 1 && (byte == b',' || byte == b'}');
            if !ends {
                if value.len() >= MAX_TOKEN {
                    self.value = None;
                } else {
                    value.push(byte);
                }
                self.track_string(byte);
                return;
            }
            let parsed = serde_json::from_slice::<Value>(value).ok();
            self.found = parsed.filter(|v| v.is_number() || v.is_string());
            self.value = None;
            self.done = self.found.is_some();
            if byte == b'}' {
                self.done = true;
            }
            return;
        }
        if self.in_string {
            if self.depth == 1 {
                if self.token.len() < MAX_TOKEN {
                    self.token.push(byte);
                } else {
                    self.token_overflow = true;
                }
            }
            if self.escaped {
                self.escaped = false;
            } else if byte == b'\\' {
                self.escaped = true;
            } else if byte == b'"' {
                self.in_string = false;
                if self.depth == 1 {
                    let mut token = std::mem::take(&mut self.token);
                    token.pop();
                    self.last_string = (!self.token_overflow).then_some(token);
                    self.token_overflow = false;
                }
            }
            return;
        }
        match byte {
            b'"' => {
                self.in_string = true;
                self.token.clear();
            }
            b'{' | b'[' => self.depth += 1,
            b'}' | b']' => {
                self.depth = self.depth.saturating_sub(1);
                if self.depth == 0 {
                    self.done = true;
                }
            }
            // A member name followed by `:` (taken either way: a name is
            // used once).
            b':' if self.depth == 1 && self.last_string.take().as_deref() == Some(b"id".as_slice()) => {
                self.value = Some(Vec::new());
            }
            b',' if self.depth == 1 => self.last_string = None,
            _ => {}
        }
    }

    /// Keeps string state while an id value is read (a string id may hold
    /// `,` or `}`).
    fn track_string(&mut self, byte: u8) {
        if self.in_string {
            if self.escaped {
                self.escaped = false;
            } else if byte == b'\\' {
                self.escaped = true;
            } else if byte == b'"' {
                self.in_string = false;
            }
        } else if byte == b'"' {
            self.in_string = true;
        } else if byte == b'{' || byte == b'[' {
            self.depth += 1;
        } else if byte == b'}' || byte == b']' {
            self.depth = self.depth.saturating_sub(1);
        }
    }
}

/// The id of `head`, a message's first bytes or all of it.
pub fn find_id(head: &[u8]) -> Option<Value> {
    let mut scanner = IdScanner::new();
    scanner.feed(head);
    scanner.id()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_found_wherever_they_are() {
        assert_eq!(find_id(br#"{"jsonrpc":"2.0","id":7,"method":"x"}"#), Some(json!(7)));
        assert_eq!(
            find_id(br#" {"method":"x","params":{"id":1,"a":[1,{"id":2}]},"id":"a,}\"b"}"#),
            Some(json!("a,}\"b"))
        );
        assert_eq!(find_id(br#"{"params":{"content":"\"id\":3"},"id" : 9 }"#), Some(json!(9)));
        assert_eq!(find_id(br#"{"method":"notifications/x"}"#), None);
        assert_eq!(find_id(br#"[{"id":1}]"#), None);
        assert_eq!(find_id(br#"{"id":{"a":1},"x":1}"#), None);
        assert_eq!(find_id(br#"{"id":null}"#), None);
        assert_eq!(find_id(b"not json"), None);
        // Fed byte by byte, the same.
        let mut scanner = IdScanner::new();
        for b in br#"{"jsonrpc":"2.0","params":{"content":"xxxx"},"id":42}"# {
            scanner.feed(&[*b]);
        }
        assert_eq!(scanner.id(), Some(json!(42)));
    }

    #[test]
    fn the_answer_names_the_limit_and_the_tool_to_use() {
        let answer = too_large_response(Some(json!(3)), MAX_MESSAGE_BYTES + 1);
        assert_eq!(answer["id"], json!(3));
        assert_eq!(answer["error"]["code"], json!(INVALID_REQUEST));
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("16777216") && message.contains("copy_to_sandbox"), "{message}");
    }
}
