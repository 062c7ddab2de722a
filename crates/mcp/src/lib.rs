//! The MCP server of moat: maps the tools contract in `testdata/tools.json`
//! onto `moat-core`.
//!
//! Not built yet: the tools arrive with the MCP issue (M4). Until then this
//! crate holds nothing, and `moat-mcp` refuses to start rather than pretend.
