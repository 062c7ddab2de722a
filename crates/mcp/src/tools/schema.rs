//! Each tool's `inputSchema` derived from its argument type with
//! `schemars`, in the form `testdata/tools.json` writes schemas. Calls are
//! checked against it ([`crate::arguments`]), and the test below holds it
//! equal to the contract, so the bounds in the types (core's constants)
//! are the ones the contract states.
//!
//! What [`normalize`] changes, and why each change loses nothing the
//! contract or the argument check relies on:
//!
//! - `$schema` and the root `title` are dropped: they name the dialect
//!   and the Rust type, not anything about the arguments.
//! - `description` is dropped everywhere: prose for the model, which
//!   `tools/list` serves from the contract; no check reads it.
//! - An optional argument (`Option<T>`), which schemars writes as
//!   `"type": [T, "null"]` (an `enum` with `null` in it, or `anyOf` of the
//!   schema and `{"type": "null"}`), becomes plain `T`: moat takes `null`
//!   as "not given" for every argument (as some clients send it), which is
//!   what leaving the argument out means in the contract; whether it may be
//!   left out is `required`, compared as is.
//! - `format` of an unsigned integer (`uint8` … `uint64`) is dropped when
//!   the schema's `minimum` and `maximum` lie within that width: it states
//!   the Rust type's width, and every value the bounds admit then fits it
//!   (an integer argument without such bounds keeps its `format`, which
//!   the contract does not have, and the test fails).
//! - `required` is sorted: JSON Schema reads it as a set.

use schemars::JsonSchema;
use schemars::generate::SchemaSettings;
use serde_json::{Map, Value};

/// The `inputSchema` of a tool whose arguments are `T`.
pub(crate) fn input_schema<T: JsonSchema>() -> Map<String, Value> {
    let generator = SchemaSettings::draft2020_12()
        .with(|settings| {
            settings.meta_schema = None;
            settings.inline_subschemas = true;
        })
        .into_generator();
    let mut schema = generator.into_root_schema_for::<T>().to_value();
    normalize(&mut schema);
    match schema {
        Value::Object(map) => map,
        _ => Map::new(),
    }
}

/// A derived schema in the contract's form (see the module's notes).
fn normalize(schema: &mut Value) {
    let Value::Object(map) = schema else { return };
    map.remove("$schema");
    map.remove("title");
    if let Some(Value::Object(properties)) = map.get_mut("properties") {
        for property in properties.values_mut() {
            normalize_property(property);
        }
    }
    if let Some(Value::Array(required)) = map.get_mut("required") {
        required.sort_by(|a, b| a.as_str().cmp(&b.as_str()));
    }
    strip_descriptions(schema);
}

fn normalize_property(property: &mut Value) {
    // `anyOf: [schema, {"type": "null"}]`: the schema.
    if let Some(Value::Array(any_of)) = property.get("anyOf")
        && any_of.len() == 2
        && any_of[1] == serde_json::json!({ "type": "null" })
    {
        let mut inner = any_of[0].clone();
        if let (Value::Object(inner_map), Value::Object(outer)) = (&mut inner, &*property) {
            for (key, value) in outer.iter().filter(|(key, _)| key.as_str() != "anyOf") {
                inner_map.insert(key.clone(), value.clone());
            }
        }
        *property = inner;
    }
    let Value::Object(map) = property else { return };
    if let Some(Value::Array(types)) = map.get_mut("type") {
        types.retain(|t| t != "null");
        if let [only] = types.as_slice() {
            let only = only.clone();
            map.insert("type".into(), only);
        }
    }
    if let Some(Value::Array(values)) = map.get_mut("enum") {
        values.retain(|v| !v.is_null());
    }
    let width = match map.get("format").and_then(Value::as_str) {
        Some("uint8") => Some(u64::from(u8::MAX)),
        Some("uint16") => Some(u64::from(u16::MAX)),
        Some("uint32") => Some(u64::from(u32::MAX)),
        Some("uint64") => Some(u64::MAX),
        _ => None,
    };
    let minimum = map.get("minimum").and_then(Value::as_u64);
    let maximum = map.get("maximum").and_then(Value::as_u64).unwrap_or(u64::MAX);
    if let Some(width) = width
        && minimum.is_some()
        && maximum <= width
    {
        map.remove("format");
    }
}

fn strip_descriptions(schema: &mut Value) {
    match schema {
        Value::Object(map) => {
            // A property may be named "description"; only the keyword goes.
            if !map.get("description").is_some_and(Value::is_object) {
                map.remove("description");
            }
            map.values_mut().for_each(strip_descriptions);
        }
        Value::Array(items) => items.iter_mut().for_each(strip_descriptions),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::{HANDLERS, SCHEMAS};

    /// The contract's `inputSchema` of each tool, in the same form.
    fn contract() -> Vec<(String, Value)> {
        let tools = crate::contract_tools().expect("tools.json is valid");
        tools
            .into_iter()
            .map(|tool| {
                let mut schema = Value::Object(tool.input_schema.as_ref().clone());
                if let Some(Value::Array(required)) = schema.get_mut("required") {
                    required.sort_by(|a, b| a.as_str().cmp(&b.as_str()));
                }
                strip_descriptions(&mut schema);
                (tool.name.to_string(), schema)
            })
            .collect()
    }

    /// Where `derived` and `contract` differ, one line each, both ways.
    fn differences(at: &str, derived: &Value, contract: &Value, out: &mut Vec<String>) {
        match (derived, contract) {
            (Value::Object(d), Value::Object(c)) => {
                for (key, value) in d {
                    match c.get(key) {
                        Some(other) => differences(&format!("{at}.{key}"), value, other, out),
                        None => out.push(format!("{at}.{key}: in the Rust type ({value}), not in the contract")),
                    }
                }
                for (key, value) in c {
                    if !d.contains_key(key) {
                        out.push(format!("{at}.{key}: in the contract ({value}), not in the Rust type"));
                    }
                }
            }
            _ if derived == contract => {}
            _ => out.push(format!("{at}: the Rust type says {derived}, the contract {contract}")),
        }
    }

    #[test]
    fn every_tool_of_the_contract_has_a_handler() {
        let contract: Vec<String> = contract().into_iter().map(|(name, _)| name).collect();
        let handled: Vec<&str> = HANDLERS.iter().map(|h| h.name).collect();
        assert_eq!(contract.len(), 19);
        assert_eq!(handled, contract, "HANDLERS lists the contract's tools, in its order, once each");
        let tools = crate::contract_tools().expect("tools.json is valid");
        assert!(tools.iter().all(|t| t.description.is_some() && t.annotations.is_some()));
    }

    #[test]
    fn each_input_schema_derived_from_the_rust_types_is_the_contracts() {
        let mut wrong = Vec::new();
        for (name, schema) in contract() {
            let Some(index) = HANDLERS.iter().position(|h| h.name == name) else {
                wrong.push(format!("{name}: in the contract, no handler"));
                continue;
            };
            differences(&name, &Value::Object(SCHEMAS[index].clone()), &schema, &mut wrong);
        }
        assert!(wrong.is_empty(), "the Rust argument types and testdata/tools.json differ:\n{}", wrong.join("\n"));
    }

    #[test]
    fn an_unknown_argument_is_refused_with_the_allowed_names() {
        let index = HANDLERS.iter().position(|h| h.name == "run_command").expect("run_command");
        let args = serde_json::json!({ "cmd": "ls", "bogus": 1 });
        let refused = crate::arguments::check("run_command", &SCHEMAS[index], &args).expect_err("refused");
        assert_eq!(
            refused,
            "run_command has no argument \"bogus\"; its arguments are: background, cmd, cwd, env, sandbox_id, stdin, timeout"
        );
        // serde alone would take it: `deny_unknown_fields` does not work
        // with the flattened `SandboxRef`, so the check by name is needed.
        assert_eq!((HANDLERS[index].read)(args), Ok(()));
        let index = HANDLERS.iter().position(|h| h.name == "list_sandboxes").expect("list_sandboxes");
        let refused = crate::arguments::check("list_sandboxes", &SCHEMAS[index], &serde_json::json!({ "all": true }));
        assert_eq!(refused, Err("list_sandboxes has no argument \"all\"; its arguments are: none".into()));
    }

    #[test]
    fn wrong_types_say_what_was_given_and_what_is_taken() {
        let check = |tool: &str, args: Value| {
            let index = HANDLERS.iter().position(|h| h.name == tool).expect("a tool");
            crate::arguments::check(tool, &SCHEMAS[index], &args).expect_err("refused")
        };
        assert_eq!(check("run_command", serde_json::json!({ "cmd": 5 })), "cmd must be a string, not an integer");
        assert_eq!(
            check("create_sandbox", serde_json::json!({ "env": ["A=b"] })),
            "env must be an object, not an array"
        );
        assert_eq!(
            check("run_command", serde_json::json!({ "cmd": "ls", "env": "A=b" })),
            "env must be an object, not a string",
            "env is read the same way in run_command as in create_sandbox"
        );
        assert_eq!(
            check("create_sandbox", serde_json::json!({ "cpus": 17 })),
            "cpus must be an integer from 1 to 16, got 17"
        );
        assert_eq!(
            check("read_file", serde_json::json!({ "path": "a", "encoding": "hex" })),
            "encoding must be utf8 or base64, not \"hex\""
        );
    }

    #[test]
    fn the_comparison_sees_a_difference_either_way() {
        let contract = serde_json::json!({ "properties": { "a": { "type": "integer", "maximum": 5 } } });
        let mut out = Vec::new();
        differences("t", &serde_json::json!({ "properties": {} }), &contract, &mut out);
        differences("t", &serde_json::json!({ "properties": { "a": { "type": "integer" } } }), &contract, &mut out);
        let derived = serde_json::json!({ "properties": { "a": { "type": "integer", "maximum": 6 } } });
        differences("t", &derived, &contract, &mut out);
        differences("t", &serde_json::json!({ "properties": { "a": {}, "b": {} } }), &contract, &mut out);
        assert_eq!(out.len(), 6, "{out:#?}");
    }

    #[test]
    fn an_integer_keeps_its_width_unless_its_bounds_lie_within_it() {
        let mut narrow = serde_json::json!({ "type": ["integer", "null"], "format": "uint8", "minimum": 0 });
        normalize_property(&mut narrow);
        assert_eq!(narrow["format"], "uint8", "no maximum: the width still says something");
        narrow["maximum"] = 5.into();
        normalize_property(&mut narrow);
        assert_eq!(narrow, serde_json::json!({ "type": "integer", "minimum": 0, "maximum": 5 }));
    }
}
