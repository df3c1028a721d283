//! The limits on what a request may ask to constrain its output to, and the measurement of a
//! `GrammarSpec` against them before llguidance compiles it. The one place these numbers live
//! (README "Structured output" lists them; Python reads them as `specrs._specrs.GRAMMAR_LIMITS`).
//!
//! Why limits: llguidance's schema and Lark compilers recurse once per nesting level, `$ref` and
//! rule they follow, so a deep enough input overflows the stack (a crash no panic guard
//! catches); and some of its limits fire lazily, at a token long after compiling (a regex
//! `a{1000000}`, a choice of 20,000 strings). Invariants:
//! - `check` is iterative: measuring never recurses on the input, whatever its shape.
//! - Every refusal is an `Error::Config` naming the limit (its constant's name) and its value.
//! - What passes `check` compiles within `COMPILE_STACK_BYTES` of stack (the compile runs on a
//!   thread of that size: `ConstraintCompiler::compile`). The measured cost per level of
//!   llguidance's recursion is at most ~4.5 KiB (JSON schema) and ~3 KiB (Lark) in an optimized
//!   build, so `MAX_SCHEMA_DEPTH` and `MAX_LARK_DEPTH` levels need about 9 MiB; the stack is
//!   sized at 64 MiB, and the tests compile inputs at each limit on a quarter of it.

mod depth_graph;
mod json_schema;
mod lark;
mod regex;

use super::GrammarSpec;
use crate::error::{Error, Result};

pub(crate) use json_schema::check_nesting;

/// Arrays and objects nested in a JSON schema (`{}` is 1 level): deeper input is refused before
/// anything recurses on it. The server refuses tool parameter schemas and tool-call arguments
/// past it too (its recursive JSON Schema validator needs ~8 Python frames per level).
pub const MAX_JSON_NESTING: usize = 64;

/// JSON values in one schema document (objects, arrays and scalars): bounds the size measured and
/// compiled per request. llguidance's own compile budget is 50,000 steps.
pub const MAX_SCHEMA_NODES: usize = 50_000;

/// Levels llguidance's schema compiler can recurse through: nesting plus `$ref` hops along the
/// deepest path any compile order can take (a bound: each `$ref` target counted once, a group of
/// mutually referring targets counted whole).
pub const MAX_SCHEMA_DEPTH: usize = 2_048;

/// Rule and terminal definitions in a Lark grammar, `%import`s and `%lark` blocks included.
pub const MAX_LARK_RULES: usize = 10_000;

/// Levels llguidance's Lark compiler can recurse through: definitions naming each other, each
/// weighing 1 plus its bracket nesting (a bound like `MAX_SCHEMA_DEPTH`'s).
pub const MAX_LARK_DEPTH: usize = 2_048;

/// The count of one repetition (`{n}`, `{n,m}` in a regex; `~n..m` in Lark) and the product of
/// nested ones. llguidance expands them one byte at a time; at ~10^5-10^6 forced bytes a token
/// exhausts its lexer budget mid-output (`a{1000000}`, `(x{1000}){1000}`).
pub const MAX_REGEX_REPEAT: u64 = 10_000;

/// `minLength` of a JSON string schema that also has a `pattern` or `format`: llguidance
/// intersects the two, and forcing a run of the intersection exhausts its lexer budget from
/// about 500 characters (`{"pattern": "^a*$", "minLength": 500}` inside an object).
pub const MAX_PATTERN_MIN_LENGTH: u64 = 128;

/// Strings in a `choice`: each is an alternative in llguidance's parser, whose rows hold at most
/// 2,000 items (a longer choice failed at its first token).
pub const MAX_CHOICES: usize = 1_000;

/// Bytes of all of a `choice`'s strings together.
pub const MAX_CHOICE_BYTES: usize = 65_536;

/// Stack of the thread that compiles a grammar (see the invariants above).
pub const COMPILE_STACK_BYTES: usize = 64 << 20;

/// Every limit by its constant's name, for the Python side and the docs.
pub const ALL: [(&str, u64); 9] = [
    ("MAX_JSON_NESTING", MAX_JSON_NESTING as u64),
    ("MAX_SCHEMA_NODES", MAX_SCHEMA_NODES as u64),
    ("MAX_SCHEMA_DEPTH", MAX_SCHEMA_DEPTH as u64),
    ("MAX_LARK_RULES", MAX_LARK_RULES as u64),
    ("MAX_LARK_DEPTH", MAX_LARK_DEPTH as u64),
    ("MAX_REGEX_REPEAT", MAX_REGEX_REPEAT),
    ("MAX_PATTERN_MIN_LENGTH", MAX_PATTERN_MIN_LENGTH),
    ("MAX_CHOICES", MAX_CHOICES as u64),
    ("MAX_CHOICE_BYTES", MAX_CHOICE_BYTES as u64),
];

/// Measures `spec` against every limit.
pub(super) fn check(spec: &GrammarSpec) -> Result<()> {
    match spec {
        GrammarSpec::JsonSchema(schema) => json_schema::check(schema, "the JSON schema"),
        GrammarSpec::JsonObject => Ok(()),
        GrammarSpec::Regex(rx) => json_schema::check_regex(rx, "the regex"),
        GrammarSpec::Lark(text) => lark::check(text),
        GrammarSpec::Choice(choices) => {
            if choices.len() > MAX_CHOICES {
                return Err(too_many(
                    format!("\"choice\" lists {} strings", choices.len()),
                    "MAX_CHOICES",
                    MAX_CHOICES as u64,
                    "list fewer, or use a regex or a JSON schema enum",
                ));
            }
            let bytes: usize = choices.iter().map(String::len).sum();
            if bytes > MAX_CHOICE_BYTES {
                return Err(too_many(
                    format!("\"choice\"'s strings hold {bytes} bytes together"),
                    "MAX_CHOICE_BYTES",
                    MAX_CHOICE_BYTES as u64,
                    "use shorter or fewer strings",
                ));
            }
            Ok(())
        }
    }
}

/// The error for input past a limit: what was found, the limit by name and value, how to fix it.
fn too_many(found: String, limit: &str, value: u64, fix: &str) -> Error {
    Error::config(format!("{found}, over specrs' limit {limit} = {value}; {fix}"))
}

/// `text` cut to a length an error message can carry.
fn shorten(text: &str) -> String {
    const MAX_CHARS: usize = 60;
    match text.char_indices().nth(MAX_CHARS) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text.to_string(),
    }
}
