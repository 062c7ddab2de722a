//! `moat-mcp`: the MCP server. Not built yet (issue M4).

use std::process::ExitCode;

fn main() -> ExitCode {
    eprintln!("moat-mcp: the MCP tools are not part of this build yet; use the agent directly (see README.md)");
    ExitCode::from(2)
}
