//! The file tools: `read_file`, `write_file`, `list_files`, `make_dir`,
//! `move_file` and `delete_file`, each one request to the sandbox's agent.
//! Relative paths are taken as inside `/home/user`.

use base64::Engine;
use moat_core::limits::{MAX_LIST_DEPTH, MAX_READ_BYTES};
use moat_proto::{FileKind, ReadFileRequest, WriteFileRequest};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

use super::{
    CallContext, MAX_TEXT, Outcome, RichOutcome, SandboxRef, Session, Tool, ToolError, plain, rfc3339, sandbox_path,
};

/// How file content travels in JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
#[schemars(inline)]
enum Encoding {
    // Text as it is. (Plain comments: a doc comment on a variant would
    // turn the schema's `enum` into a `oneOf` of described constants.)
    #[default]
    Utf8,
    // Any bytes, base64-encoded.
    Base64,
}

/// The largest `offset` taken: file offsets are signed 64-bit numbers.
const MAX_OFFSET: u64 = u64::MAX >> 1;

/// The arguments of `read_file`.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(extend("additionalProperties" = false))]
pub(crate) struct ReadFile {
    path: String,
    encoding: Option<Encoding>,
    offset: Option<u64>,
    #[schemars(range(min = 1, max = MAX_READ_BYTES))]
    length: Option<u64>,
    #[serde(flatten)]
    sandbox: SandboxRef,
}

impl Tool for ReadFile {
    const NAME: &'static str = "read_file";

    async fn run(self, server: &Session<'_>, _context: &CallContext) -> RichOutcome {
        plain(read_file(server, self).await)
    }
}

/// The arguments of `write_file`.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(extend("additionalProperties" = false))]
pub(crate) struct WriteFile {
    path: String,
    content: String,
    encoding: Option<Encoding>,
    #[schemars(regex(pattern = "^0?[0-7]{3,4}$"))]
    mode: Option<String>,
    #[serde(flatten)]
    sandbox: SandboxRef,
}

impl Tool for WriteFile {
    const NAME: &'static str = "write_file";

    async fn run(self, server: &Session<'_>, _context: &CallContext) -> RichOutcome {
        plain(write_file(server, self).await)
    }
}

/// The arguments of `list_files`.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(extend("additionalProperties" = false))]
pub(crate) struct ListFiles {
    path: Option<String>,
    #[schemars(range(min = 1, max = MAX_LIST_DEPTH))]
    depth: Option<u8>,
    #[serde(flatten)]
    sandbox: SandboxRef,
}

impl Tool for ListFiles {
    const NAME: &'static str = "list_files";

    async fn run(self, server: &Session<'_>, _context: &CallContext) -> RichOutcome {
        plain(list_files(server, self).await)
    }
}

/// The arguments of `make_dir`.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(extend("additionalProperties" = false))]
pub(crate) struct MakeDir {
    path: String,
    #[serde(flatten)]
    sandbox: SandboxRef,
}

impl Tool for MakeDir {
    const NAME: &'static str = "make_dir";

    async fn run(self, server: &Session<'_>, _context: &CallContext) -> RichOutcome {
        plain(make_dir(server, self).await)
    }
}

/// The arguments of `move_file`.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(extend("additionalProperties" = false))]
pub(crate) struct MoveFile {
    source: String,
    destination: String,
    overwrite: Option<bool>,
    #[serde(flatten)]
    sandbox: SandboxRef,
}

impl Tool for MoveFile {
    const NAME: &'static str = "move_file";

    async fn run(self, server: &Session<'_>, _context: &CallContext) -> RichOutcome {
        plain(move_file(server, self).await)
    }
}

/// The arguments of `delete_file`.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(extend("additionalProperties" = false))]
pub(crate) struct DeleteFile {
    path: String,
    recursive: Option<bool>,
    #[serde(flatten)]
    sandbox: SandboxRef,
}

impl Tool for DeleteFile {
    const NAME: &'static str = "delete_file";

    async fn run(self, server: &Session<'_>, _context: &CallContext) -> RichOutcome {
        plain(delete_file(server, self).await)
    }
}

/// The most bytes one `read_file` answer carries: [`MAX_TEXT`] characters
/// of text, each up to 4 bytes of UTF-8 (cut to the characters after
/// reading), or as many bytes as [`MAX_TEXT`] characters of base64 hold.
fn read_cap(base64: bool) -> usize {
    if base64 { MAX_TEXT / 4 * 3 } else { MAX_TEXT * 4 }
}

/// What of `bytes` (read from `offset`) one answer carries: at most
/// [`MAX_TEXT`] characters of text (a character cut by the end of the read
/// is left for the next one), or the bytes themselves for base64. Returns
/// the content and how many bytes it covers.
fn answer_of(bytes: Vec<u8>, base64: bool, path: &str) -> Result<(String, usize), ToolError> {
    if base64 {
        let kept = &bytes[..bytes.len().min(read_cap(true))];
        return Ok((base64::engine::general_purpose::STANDARD.encode(kept), kept.len()));
    }
    let valid = match std::str::from_utf8(&bytes) {
        Ok(text) => text,
        // A character the read's end cut in two: the next read starts there.
        Err(e) if e.error_len().is_none() && e.valid_up_to() > 0 => {
            std::str::from_utf8(&bytes[..e.valid_up_to()]).unwrap_or_default()
        }
        Err(_) => return Err(ToolError(format!("{path} is not UTF-8 text; read it with encoding base64"))),
    };
    let end = valid.char_indices().nth(MAX_TEXT).map_or(valid.len(), |(at, _)| at);
    Ok((valid[..end].to_owned(), end))
}

async fn read_file(server: &Session<'_>, args: ReadFile) -> Outcome {
    let path = sandbox_path(&args.path);
    let base64 = args.encoding.unwrap_or_default() == Encoding::Base64;
    let offset = args.offset.unwrap_or(0);
    if offset > MAX_OFFSET {
        return Err(ToolError(format!("offset must be an integer from 0 to {MAX_OFFSET}, got {offset}")));
    }
    let id = args.sandbox.resolve(server).await?;
    // What was asked, and never more than one answer carries.
    let length = args.length.unwrap_or(MAX_READ_BYTES).min(read_cap(base64) as u64);
    let read = |client: moat_proto::AgentClient<moat_proto::UnixConnector>| {
        let path = path.clone();
        async move {
            let info = client.stat(path.clone()).await?;
            let bytes = client.read_file(ReadFileRequest { path, offset, length: Some(length) }).await?;
            Ok((info, bytes))
        }
    };
    let (info, bytes) = server.moat.with_agent(&id, read).await?;
    let (content, covered) = answer_of(bytes, base64, &path)?;
    let next = offset + covered as u64;
    let mut answer = json!({
        "path": path, "content": content, "encoding": if base64 { "base64" } else { "utf8" },
        "size": info.size, "offset": offset, "length": covered,
        "truncated": next < info.size,
    });
    if answer["truncated"] == true {
        answer["next_offset"] = json!(next);
    }
    Ok(answer)
}

async fn write_file(server: &Session<'_>, args: WriteFile) -> Outcome {
    let path = sandbox_path(&args.path);
    let content = args.content;
    let bytes = match args.encoding.unwrap_or_default() {
        Encoding::Utf8 => content.into_bytes(),
        Encoding::Base64 => base64::engine::general_purpose::STANDARD
            .decode(content)
            .map_err(|e| ToolError(format!("content is not valid base64 ({e}); send the bytes base64-encoded")))?,
    };
    let mode = match args.mode {
        None => None,
        Some(m) => Some(
            u32::from_str_radix(m.trim_start_matches("0o"), 8)
                .map_err(|_| ToolError(format!("mode {m:?} is not an octal permission such as 644 or 755")))?,
        ),
    };
    let id = args.sandbox.resolve(server).await?;
    let req = WriteFileRequest { path: path.clone(), mode, create_parents: true, owner: Some("user".into()) };
    let written = server
        .moat
        .with_agent(&id, |client| async move { client.write_file(req, &mut bytes.as_slice()).await })
        .await?;
    Ok(json!({ "path": path, "bytes": written }))
}

async fn list_files(server: &Session<'_>, args: ListFiles) -> Outcome {
    let path = sandbox_path(args.path.as_deref().unwrap_or("/home/user"));
    let depth = args.depth.unwrap_or(1);
    let id = args.sandbox.resolve(server).await?;
    let (entries, truncated) =
        server.moat.with_agent(&id, |client| async move { client.list_dir(path, depth).await }).await?;
    let entries: Vec<Value> = entries
        .iter()
        .map(|e| {
            json!({
                "name": e.name, "path": e.path,
                "type": match e.kind { FileKind::File => "file", FileKind::Dir => "dir", FileKind::Symlink => "symlink", FileKind::Other => "other" },
                "size": e.size, "mode": format!("{:o}", e.mode),
                "mtime": rfc3339(u64::try_from(e.mtime).unwrap_or(0)),
            })
        })
        .collect();
    Ok(json!({ "entries": entries, "truncated": truncated }))
}

async fn make_dir(server: &Session<'_>, args: MakeDir) -> Outcome {
    let path = sandbox_path(&args.path);
    let id = args.sandbox.resolve(server).await?;
    let made = path.clone();
    server.moat.with_agent(&id, |client| async move { client.make_dir(made, Some("user".into())).await }).await?;
    Ok(json!({ "ok": true, "message": format!("{path} exists") }))
}

async fn move_file(server: &Session<'_>, args: MoveFile) -> Outcome {
    let from = sandbox_path(&args.source);
    let to = sandbox_path(&args.destination);
    let overwrite = args.overwrite.unwrap_or(false);
    let id = args.sandbox.resolve(server).await?;
    let (source, destination) = (from.clone(), to.clone());
    server.moat.with_agent(&id, |client| async move { client.move_path(source, destination, overwrite).await }).await?;
    Ok(json!({ "ok": true, "message": format!("moved {from} to {to}") }))
}

async fn delete_file(server: &Session<'_>, args: DeleteFile) -> Outcome {
    let path = sandbox_path(&args.path);
    let recursive = args.recursive.unwrap_or(false);
    let id = args.sandbox.resolve(server).await?;
    let removed = path.clone();
    server.moat.with_agent(&id, |client| async move { client.remove(removed, recursive).await }).await?;
    Ok(json!({ "ok": true, "message": format!("deleted {path}") }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_holds_at_most_max_text_characters_and_says_how_many_bytes() {
        let text = "é".repeat(MAX_TEXT + 10);
        let (content, covered) = answer_of(text.clone().into_bytes(), false, "f").expect("text");
        assert_eq!(content.chars().count(), MAX_TEXT);
        assert_eq!(covered, MAX_TEXT * 2, "é is two bytes");
        let (content, covered) = answer_of(b"short".to_vec(), false, "f").expect("text");
        assert_eq!((content.as_str(), covered), ("short", 5));
    }

    #[test]
    fn a_character_cut_by_the_read_is_left_for_the_next_one() {
        // "aé" is a, then 0xc3 0xa9: a read of two bytes ends inside é.
        let (content, covered) = answer_of("aé".as_bytes()[..2].to_vec(), false, "f").expect("text");
        assert_eq!((content.as_str(), covered), ("a", 1));
        let err = answer_of(vec![b'a', 0xff, b'b'], false, "f").expect_err("not UTF-8");
        assert!(err.0.contains("encoding base64"), "{}", err.0);
        let err = answer_of(vec![0xc3], false, "f").expect_err("nothing whole to give");
        assert!(err.0.contains("not UTF-8"), "{}", err.0);
    }

    #[test]
    fn base64_answers_hold_at_most_max_text_characters() {
        let bytes = vec![7u8; read_cap(true) + 100];
        let (content, covered) = answer_of(bytes, true, "f").expect("bytes");
        assert_eq!(covered, read_cap(true));
        assert_eq!(content.len(), MAX_TEXT);
    }
}
