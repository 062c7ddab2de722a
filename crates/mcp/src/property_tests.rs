//! Property tests of the layer between the wire and the tools: for any
//! input, the argument check, the message parser and the id scanner
//! answer (a pass or an error that says what is wrong) and never panic.
//!
//! Inputs come from a seeded generator (so a failure names its seed and
//! reproduces) and from the kept corpus, `testdata/fuzz/tool-arguments.jsonl`:
//! one case per line, `{"tool", "arguments", "ok"}`, where `ok` is whether
//! the check passes. Add a line for every bug found.

use serde_json::{Map, Value, json};

use crate::limits::{INVALID_REQUEST, IdScanner, PARSE_ERROR};
use crate::stdio::{Parsed, parse};

const CORPUS: &str = include_str!("../../../testdata/fuzz/tool-arguments.jsonl");

/// xorshift64*: small, seeded, good enough to spread inputs.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % u64::try_from(n.max(1)).unwrap_or(1)).unwrap_or(0)
    }

    fn text(&mut self) -> String {
        const PIECES: &[&str] =
            &["a", "Z", "0", "-", "_", "/", ".", " ", "\"", "\\", "\n", "é", "😀", "\u{0}", "id", "..", "~", "$"];
        (0..self.below(12)).map(|_| PIECES[self.below(PIECES.len())]).collect()
    }

    fn value(&mut self, depth: u32) -> Value {
        let pick = if depth > 3 { self.below(6) } else { self.below(9) };
        match pick {
            0 => Value::Null,
            1 => Value::Bool(self.below(2) == 0),
            2 => json!(self.next() % 70_000),
            3 => json!(-i64::try_from(self.next() % 1000).unwrap_or(0)),
            4 => json!(f64::from(u32::try_from(self.next() % 1000).unwrap_or(0)) / 7.0),
            5 => Value::String(self.text()),
            6 => Value::Array((0..self.below(5)).map(|_| self.value(depth + 1)).collect()),
            7 => Value::Array(vec![Value::String("x".into()); self.below(600)]),
            _ => Value::Object((0..self.below(5)).map(|_| (self.text(), self.value(depth + 1))).collect()),
        }
    }
}

fn tools() -> Vec<rmcp::model::Tool> {
    crate::contract_tools().expect("the contract parses")
}

/// Arguments for `tool`: mostly its own names, some unknown ones.
fn arguments(rng: &mut Rng, tool: &rmcp::model::Tool) -> Value {
    let names: Vec<String> = tool
        .input_schema
        .get("properties")
        .and_then(Value::as_object)
        .map(|p| p.keys().cloned().collect())
        .unwrap_or_default();
    let mut args = Map::new();
    for _ in 0..rng.below(6) {
        let name =
            if names.is_empty() || rng.below(8) == 0 { rng.text() } else { names[rng.below(names.len())].clone() };
        args.insert(name, rng.value(0));
    }
    Value::Object(args)
}

#[test]
fn every_argument_set_passes_or_gets_a_clear_error() {
    let tools = tools();
    for seed in 1..=20_000u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let tool = &tools[rng.below(tools.len())];
        let args = arguments(&mut rng, tool);
        if let Err(message) = crate::arguments::check(&tool.name, &tool.input_schema, &args) {
            assert!(
                !message.is_empty()
                    && message.len() < 600
                    && (message.contains("must")
                        || message.contains("takes")
                        || message.contains("required")
                        || message.contains("no argument")),
                "seed {seed}: {} {args}: unclear error {message:?}",
                tool.name
            );
        }
    }
}

/// Arguments the check passes read into the tool's Rust type: a handler
/// never meets arguments its type cannot hold.
#[test]
fn every_argument_set_the_check_passes_reads_into_its_type() {
    let mut passed = 0;
    let mut cases: Vec<(String, Value)> = CORPUS
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .map(|case| (case["tool"].as_str().unwrap_or_default().to_owned(), case["arguments"].clone()))
        .collect();
    let tools = tools();
    for seed in 1..=20_000u64 {
        let mut rng = Rng(seed.wrapping_mul(0xA076_1D64_78BD_642F) | 1);
        let tool = &tools[rng.below(tools.len())];
        cases.push((tool.name.to_string(), arguments(&mut rng, tool)));
    }
    for (name, args) in cases {
        let index = crate::tools::HANDLERS.iter().position(|h| h.name == name).expect("a handler per tool");
        if crate::arguments::check(&name, &crate::tools::SCHEMAS[index], &args).is_ok() {
            passed += 1;
            let read = (crate::tools::HANDLERS[index].read)(args.clone());
            assert!(read.is_ok(), "{name} {args}: passed the check, but {read:?}");
        }
    }
    assert!(passed > 100, "only {passed} argument sets passed the check");
}

#[test]
fn the_corpus_keeps_its_verdicts() {
    let tools = tools();
    for (number, line) in CORPUS.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let case: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("corpus line {}: {e}", number + 1));
        let name = case["tool"].as_str().unwrap_or_default();
        let tool =
            tools.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("corpus line {}: tool {name}", number + 1));
        let verdict = crate::arguments::check(name, &tool.input_schema, &case["arguments"]);
        assert_eq!(verdict.is_ok(), case["ok"].as_bool() == Some(true), "corpus line {}: {verdict:?}", number + 1);
    }
}

#[test]
fn every_line_is_a_message_or_gets_an_answer() {
    let tools = tools();
    for seed in 1..=5_000u64 {
        let mut rng = Rng(seed.wrapping_mul(0xD1B5_4A32_D192_ED03) | 1);
        let tool = &tools[rng.below(tools.len())];
        let mut message = json!({
            "jsonrpc": "2.0",
            "id": seed,
            "method": "tools/call",
            "params": { "name": tool.name, "arguments": arguments(&mut rng, tool) },
        });
        // Break it in one of several ways, or not at all.
        let bytes = match rng.below(6) {
            0 => message.to_string().into_bytes(),
            1 => {
                message["params"]["arguments"] = rng.value(0);
                message.to_string().into_bytes()
            }
            2 => {
                message["method"] = rng.value(1);
                message.to_string().into_bytes()
            }
            3 => {
                let text = message.to_string();
                let cut = rng.below(text.len());
                text.as_bytes()[..cut].to_vec()
            }
            4 => (0..rng.below(64)).map(|_| u8::try_from(rng.next() & 0xff).unwrap_or(0)).collect(),
            _ => rng.value(0).to_string().into_bytes(),
        };
        match parse(&bytes) {
            Parsed::Message(_) | Parsed::Ignore => {}
            Parsed::Reply(answer) => {
                let code = answer["error"]["code"].as_i64();
                assert!(code == Some(INVALID_REQUEST) || code == Some(PARSE_ERROR), "seed {seed}: {answer}");
                assert!(answer["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "seed {seed}: {answer}");
            }
        }
        // The scanner finds the id of every well-formed request, however fed.
        if let Ok(value) = serde_json::from_slice::<Value>(&bytes)
            && let Some(id) = value.get("id").filter(|id| id.is_number() || id.is_string())
        {
            let mut scanner = IdScanner::new();
            for piece in bytes.chunks(rng.below(40) + 1) {
                scanner.feed(piece);
            }
            assert_eq!(scanner.id().as_ref(), Some(id), "seed {seed}: {}", String::from_utf8_lossy(&bytes));
        }
    }
}
