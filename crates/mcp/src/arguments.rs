//! Tool arguments checked against the tool's `inputSchema` before the tool
//! runs: unknown names, wrong types, values out of range and oversized
//! arrays or maps each get a message naming the argument and what it
//! takes. The schema is the one derived from the tool's argument type
//! (`tools::schema`), which equals the contract's; checking here, by name,
//! is also what refuses unknown arguments, which serde cannot do for the
//! types that flatten `SandboxRef` in. The tools still check what a schema
//! cannot say (paths, names, grants).
//!
//! Only the schema keywords the contract uses are read: `type`,
//! `properties`, `required`, `enum`, `minimum`, `maximum`, `items`,
//! `maxItems`, `additionalProperties` and `maxProperties`.

use serde_json::{Map, Value};

/// Checks `args` (a tool's arguments) against `schema` (its `inputSchema`).
pub(crate) fn check(tool: &str, schema: &Map<String, Value>, args: &Value) -> Result<(), String> {
    let Some(args) = args.as_object() else {
        return Err(format!("the arguments of {tool} must be an object"));
    };
    let empty = Map::new();
    let properties = schema.get("properties").and_then(Value::as_object).unwrap_or(&empty);
    for (name, value) in args {
        let Some(property) = properties.get(name) else {
            let mut known: Vec<&str> = properties.keys().map(String::as_str).collect();
            known.sort_unstable();
            let known = if known.is_empty() { "none".to_owned() } else { known.join(", ") };
            return Err(format!("{tool} has no argument {:?}; its arguments are: {known}", clip(name)));
        };
        check_value(name, property, value)?;
    }
    for required in schema.get("required").and_then(Value::as_array).into_iter().flatten() {
        if let Some(name) = required.as_str()
            && args.get(name).is_none_or(Value::is_null)
        {
            return Err(format!("{name} is required"));
        }
    }
    Ok(())
}

/// A name from the input, shortened for a message.
fn clip(name: &str) -> String {
    match name.char_indices().nth(64) {
        Some((end, _)) => format!("{}…", &name[..end]),
        None => name.to_owned(),
    }
}

/// What a schema `type` is called in a message.
fn kind(schema: &Value) -> &str {
    match schema.get("type").and_then(Value::as_str) {
        Some("string") => "a string",
        Some("integer") => "an integer",
        Some("boolean") => "true or false",
        Some("array") => "an array",
        Some("object") => "an object",
        _ => "a value",
    }
}

/// What `value` is, for a message (never the value itself, which may be
/// huge or secret).
fn what(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a fractional number",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn check_value(name: &str, schema: &Value, value: &Value) -> Result<(), String> {
    if value.is_null() {
        // Tools take null as "not given" (what some clients send).
        return Ok(());
    }
    let wrong = || format!("{} must be {}, not {}", clip(name), kind(schema), what(value));
    match schema.get("type").and_then(Value::as_str) {
        Some("string") => {
            let text = value.as_str().ok_or_else(wrong)?;
            if let Some(allowed) = schema.get("enum").and_then(Value::as_array)
                && !allowed.iter().any(|a| a.as_str() == Some(text))
            {
                let allowed: Vec<&str> = allowed.iter().filter_map(Value::as_str).collect();
                let list = match allowed.split_last() {
                    Some((last, [])) => (*last).to_owned(),
                    Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
                    None => "nothing".to_owned(),
                };
                return Err(format!("{} must be {list}, not {:?}", clip(name), clip(text)));
            }
        }
        Some("integer") => {
            let number = value.as_i64().map(i128::from).or_else(|| value.as_u64().map(i128::from)).ok_or_else(wrong)?;
            let min = schema.get("minimum").and_then(Value::as_i64).map(i128::from);
            let max = schema.get("maximum").and_then(Value::as_i64).map(i128::from);
            if min.is_some_and(|min| number < min) || max.is_some_and(|max| number > max) {
                let range = match (min, max) {
                    (Some(min), Some(max)) => format!("from {min} to {max}"),
                    (Some(min), None) => format!("at least {min}"),
                    (None, Some(max)) => format!("at most {max}"),
                    (None, None) => String::new(),
                };
                return Err(format!("{} must be an integer {range}, got {number}", clip(name)));
            }
        }
        Some("boolean") => {
            value.as_bool().ok_or_else(wrong)?;
        }
        Some("array") => {
            let items = value.as_array().ok_or_else(wrong)?;
            if let Some(max) = schema.get("maxItems").and_then(Value::as_u64)
                && u64::try_from(items.len()).unwrap_or(u64::MAX) > max
            {
                return Err(format!("{} takes at most {max} entries, got {}", clip(name), items.len()));
            }
            if let Some(item) = schema.get("items") {
                for (i, value) in items.iter().enumerate() {
                    if value.is_null() {
                        return Err(format!("{}[{i}] must be {}, not null", clip(name), kind(item)));
                    }
                    check_value(&format!("{}[{i}]", clip(name)), item, value)?;
                }
            }
        }
        Some("object") => {
            let map = value.as_object().ok_or_else(wrong)?;
            if let Some(max) = schema.get("maxProperties").and_then(Value::as_u64)
                && u64::try_from(map.len()).unwrap_or(u64::MAX) > max
            {
                return Err(format!("{} takes at most {max} entries, got {}", clip(name), map.len()));
            }
            if let Some(each) = schema.get("additionalProperties").filter(|s| s.is_object()) {
                for (key, value) in map {
                    if value.is_null() {
                        return Err(format!("{}.{} must be {}, not null", clip(name), clip(key), kind(each)));
                    }
                    check_value(&format!("{}.{}", clip(name), clip(key)), each, value)?;
                }
            }
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema_of(tool: &str) -> Map<String, Value> {
        let tools = crate::contract_tools().expect("the contract parses");
        let found = tools.into_iter().find(|t| t.name == tool).expect("a tool of the contract");
        found.input_schema.as_ref().clone()
    }

    fn error(tool: &str, args: Value) -> String {
        check(tool, &schema_of(tool), &args).expect_err("refused")
    }

    #[test]
    fn good_arguments_pass() {
        let schema = schema_of("run_command");
        check("run_command", &schema, &json!({"cmd": "ls", "timeout": 5, "env": {"A": "b"}, "cwd": null}))
            .expect("good");
        let schema = schema_of("create_sandbox");
        check("create_sandbox", &schema, &json!({"network": "filtered", "allow_hosts": ["pypi.org"], "cpus": 2}))
            .expect("good");
        check("list_sandboxes", &schema_of("list_sandboxes"), &json!({})).expect("good");
    }

    #[test]
    fn each_mistake_is_named() {
        assert_eq!(error("run_command", json!({"cmd": 5})), "cmd must be a string, not an integer");
        assert_eq!(error("run_command", json!({})), "cmd is required");
        assert!(
            error("run_command", json!({"command": "ls"})).contains("no argument \"command\"; its arguments are: ")
        );
        assert!(error("create_sandbox", json!({"cpus": 0})).contains("from 1 to 16, got 0"));
        assert!(error("create_sandbox", json!({"cpus": 1.5})).contains("not a fractional number"));
        assert!(
            error("create_sandbox", json!({"network": "wide"}))
                .contains("must be none, filtered or open, not \"wide\"")
        );
        assert_eq!(
            error("create_sandbox", json!({"allow_hosts": [1]})),
            "allow_hosts[0] must be a string, not an integer"
        );
        assert_eq!(
            error("run_command", json!({"cmd": "ls", "env": {"A": 1}})),
            "env.A must be a string, not an integer"
        );
        let hosts: Vec<String> = (0..100_000).map(|i| format!("h{i}.example")).collect();
        assert!(error("create_sandbox", json!({"allow_hosts": hosts})).contains("at most 256 entries, got 100000"));
        let env: Map<String, Value> = (0..10_000).map(|i| (format!("V{i}"), json!("x"))).collect();
        assert!(error("run_command", json!({"cmd": "ls", "env": env})).contains("at most 256 entries"));
        assert!(error("read_file", json!([1])).contains("must be an object"));
    }
}
