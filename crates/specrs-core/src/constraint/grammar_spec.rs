//! `GrammarSpec`: what a request's output must match, as the API layer receives it.
//!
//! Invariant: `from_json` accepts exactly one of the keys `json_schema`, `json_object`, `regex`,
//! `grammar` (Lark text) and `choice`, with the right JSON type; every rejection names the key.
//! A schema's nesting is checked here, before anything copies it (`limits::MAX_JSON_NESTING`);
//! the other limits and whether a schema, regex or grammar is well-formed are checked when it is
//! compiled (`ConstraintCompiler::compile`).

use llguidance::api::TopLevelGrammar;
use serde_json::{Map, Value};

use super::limits::check_nesting;
use crate::error::{Error, Result};

/// The keys `GrammarSpec::from_json` reads, one per variant.
pub const GRAMMAR_SPEC_KEYS: [&str; 5] = ["json_schema", "json_object", "regex", "grammar", "choice"];

/// The language a constrained request's output must belong to.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// JSON matching this JSON Schema (an object, or `true`/`false`), in specrs' one-line layout
    /// (`with_json_layout`) unless the schema's `x-guidance` sets another.
    JsonSchema(Value),
    /// Any JSON object.
    JsonObject,
    /// Text matching this regular expression (Rust `regex` syntax), anchored at both ends.
    Regex(String),
    /// Text in the language of this grammar, in llguidance's Lark dialect (rule `start`).
    Lark(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
}

impl GrammarSpec {
    /// Reads `{"json_schema": {...}}` (the schema may also be a string of JSON),
    /// `{"json_object": true}`, `{"regex": "..."}`, `{"grammar": "lark text"}` or
    /// `{"choice": ["a", "b"]}`.
    pub fn from_json(value: &Value) -> Result<Self> {
        let Value::Object(map) = value else {
            return Err(Error::config(format!(
                "a grammar must be a JSON object with one of the keys {} (got {})",
                GRAMMAR_SPEC_KEYS.join(", "),
                shorten(value)
            )));
        };
        let (key, value) = single_entry(map)?;
        match key {
            "json_schema" => match value {
                Value::Object(_) | Value::Bool(_) => {
                    check_nesting(value, "the JSON schema")?;
                    Ok(Self::JsonSchema(value.clone()))
                }
                Value::String(text) => match serde_json::from_str::<Value>(text) {
                    Ok(schema @ (Value::Object(_) | Value::Bool(_))) => {
                        check_nesting(&schema, "the JSON schema")?;
                        Ok(Self::JsonSchema(schema))
                    }
                    Ok(other) => Err(Error::config(format!(
                        "\"json_schema\" must be a JSON Schema object (got the string of {})",
                        shorten(&other)
                    ))),
                    Err(e) => Err(Error::config(format!("\"json_schema\" is a string but not valid JSON: {e}"))),
                },
                other => Err(Error::config(format!(
                    "\"json_schema\" must be a JSON Schema object, e.g. {{\"type\": \"object\"}} (got {})",
                    shorten(other)
                ))),
            },
            "json_object" => match value {
                Value::Bool(true) => Ok(Self::JsonObject),
                other => Err(Error::config(format!(
                    "\"json_object\" must be true (got {}); leave the grammar out for unconstrained output",
                    shorten(other)
                ))),
            },
            "regex" => match value {
                Value::String(rx) if !rx.is_empty() => Ok(Self::Regex(rx.clone())),
                other => Err(Error::config(format!(
                    "\"regex\" must be a non-empty string such as \"[0-9]+\" (got {})",
                    shorten(other)
                ))),
            },
            "grammar" => match value {
                Value::String(lark) if !lark.trim().is_empty() => Ok(Self::Lark(lark.clone())),
                other => Err(Error::config(format!(
                    "\"grammar\" must be the non-empty text of a Lark grammar, e.g. \"start: \\\"yes\\\" | \\\"no\\\"\" \
                     (got {})",
                    shorten(other)
                ))),
            },
            "choice" => {
                let Value::Array(items) = value else {
                    return Err(Error::config(format!(
                        "\"choice\" must be a list of strings such as [\"yes\", \"no\"] (got {})",
                        shorten(value)
                    )));
                };
                let choices = items
                    .iter()
                    .enumerate()
                    .map(|(i, item)| match item {
                        Value::String(s) => Ok(s.clone()),
                        other => {
                            Err(Error::config(format!("\"choice\"[{i}] must be a string (got {})", shorten(other))))
                        }
                    })
                    .collect::<Result<Vec<_>>>()?;
                let spec = Self::Choice(choices);
                spec.check_choices()?;
                Ok(spec)
            }
            unknown => Err(Error::config(format!(
                "unknown grammar key \"{unknown}\"; use exactly one of {}",
                GRAMMAR_SPEC_KEYS.join(", ")
            ))),
        }
    }

    /// The spec as `from_json` reads it.
    pub fn to_json(&self) -> Value {
        match self {
            Self::JsonSchema(schema) => serde_json::json!({ "json_schema": schema }),
            Self::JsonObject => serde_json::json!({ "json_object": true }),
            Self::Regex(rx) => serde_json::json!({ "regex": rx }),
            Self::Lark(lark) => serde_json::json!({ "grammar": lark }),
            Self::Choice(choices) => serde_json::json!({ "choice": choices }),
        }
    }

    /// What kind of grammar this is, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::JsonSchema(_) => "JSON schema",
            Self::JsonObject => "JSON object",
            Self::Regex(_) => "regex",
            Self::Lark(_) => "Lark grammar",
            Self::Choice(_) => "choice",
        }
    }

    /// The same language as llguidance's input. A choice becomes the Lark rule
    /// `start: "a" | "b"`; Lark string literals are JSON strings, so JSON escaping quotes them.
    pub(super) fn to_llguidance(&self) -> Result<TopLevelGrammar> {
        Ok(match self {
            Self::JsonSchema(schema) => TopLevelGrammar::from_json_schema(with_json_layout(schema.clone())),
            Self::JsonObject => {
                TopLevelGrammar::from_json_schema(with_json_layout(serde_json::json!({"type": "object"})))
            }
            Self::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Self::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
            Self::Choice(choices) => {
                self.check_choices()?;
                let alternatives: Vec<String> = choices.iter().map(|c| Value::from(c.as_str()).to_string()).collect();
                TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
            }
        })
    }

    fn check_choices(&self) -> Result<()> {
        let Self::Choice(choices) = self else { return Ok(()) };
        if choices.is_empty() {
            return Err(Error::config("\"choice\" must list at least one string, e.g. [\"yes\", \"no\"]"));
        }
        if let Some(i) = choices.iter().position(String::is_empty) {
            return Err(Error::config(format!(
                "\"choice\"[{i}] is the empty string; every choice needs at least one character"
            )));
        }
        Ok(())
    }
}

/// `schema` with specrs' JSON layout unless it sets its own (`x-guidance`): one line, with
/// `json.dumps`' separators (`{"key": value, "other": [1, 2]}`) and no other whitespace. A fixed
/// layout leaves one way to write the keys and punctuation a schema fixes, so the grammar forces
/// them (free drafts) instead of letting whitespace come between every two tokens.
fn with_json_layout(mut schema: Value) -> Value {
    if let Value::Object(map) = &mut schema {
        map.entry("x-guidance").or_insert_with(
            || serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// The one key of `map` and its value.
fn single_entry(map: &Map<String, Value>) -> Result<(&str, &Value)> {
    let mut entries = map.iter();
    match (entries.next(), entries.next()) {
        (Some((key, value)), None) => Ok((key.as_str(), value)),
        (None, _) => Err(Error::config(format!(
            "the grammar object is empty; give exactly one of {}",
            GRAMMAR_SPEC_KEYS.join(", ")
        ))),
        (Some(_), Some(_)) => {
            let mut keys: Vec<&str> = map.keys().map(String::as_str).collect();
            keys.sort_unstable(); // serde_json keeps insertion order here (llguidance's preserve_order)
            Err(Error::config(format!(
                "the grammar object has the keys {}; give exactly one of {}",
                keys.join(", "),
                GRAMMAR_SPEC_KEYS.join(", ")
            )))
        }
    }
}

/// `value` as JSON, cut to a length an error message can carry.
fn shorten(value: &Value) -> String {
    const MAX_CHARS: usize = 80;
    let text = value.to_string();
    match text.char_indices().nth(MAX_CHARS) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}
