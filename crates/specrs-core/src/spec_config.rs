//! `SpeculativeConfig`: which proposer to run and how many tokens it may guess, parsed from the
//! same JSON object `vllm serve --speculative-config` takes (same key names, same defaults).
//!
//! Invariant: a parsed config is complete and valid (every method-specific default filled in,
//! every range checked), so proposers never re-validate. Every rejection names the key and the
//! fix; an unknown key or method names the closest valid one.

use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::proposer::suffix::SuffixParams;

/// The most tokens one step may guess; a verify forward over more rows costs more than it can win
/// on any model specrs runs.
pub const MAX_SPECULATIVE_TOKENS: usize = 64;

/// vLLM's keys, then specrs' own (`adaptive_draft_length`).
const KEYS: [&str; 9] = [
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
    "adaptive_draft_length",
];

const METHODS: [&str; 3] = ["ngram", "suffix", "custom"];

/// vLLM methods that need draft weights; they arrive with the draft-model family.
const LATER_METHODS: [&str; 7] = ["draft_model", "eagle", "eagle3", "mtp", "medusa", "mlp_speculator", "pard"];

#[derive(Debug, Clone, PartialEq)]
pub enum Method {
    /// Prompt lookup: continue the most recent earlier occurrence of the context's last n-gram.
    Ngram { prompt_lookup_min: usize, prompt_lookup_max: usize },
    /// SuffixDecoding: suffix trees over this request and previous responses.
    Suffix(SuffixParams),
    /// A proposer object supplied by the caller (Python `propose(context_ids, max_tokens)`).
    Custom,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SpeculativeConfig {
    pub method: Method,
    /// Upper bound on draft tokens per step (k).
    pub num_speculative_tokens: usize,
    /// Cut each draft to the length with the best expected tokens per verify cost (specrs'
    /// `draft_length` module; default on). Off: every draft is verified whole, as in vLLM.
    pub adaptive_draft_length: bool,
}

impl SpeculativeConfig {
    pub fn method_name(&self) -> &'static str {
        match self.method {
            Method::Ngram { .. } => "ngram",
            Method::Suffix(_) => "suffix",
            Method::Custom => "custom",
        }
    }

    /// Parses the JSON text of a vLLM-style speculative config.
    pub fn from_json(text: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(text).map_err(|e| {
            Error::config(format!(
                "speculative_config is not valid JSON ({e}); write it like \
                 '{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}'"
            ))
        })?;
        let Value::Object(map) = value else {
            return Err(Error::config("speculative_config must be a JSON object, e.g. {\"method\": \"suffix\"}"));
        };
        Self::from_map(&map)
    }

    pub fn from_map(map: &Map<String, Value>) -> Result<Self> {
        for key in map.keys() {
            if !KEYS.contains(&key.as_str()) {
                return Err(Error::config(format!(
                    "unknown speculative_config key '{key}'; did you mean '{}'? (valid keys: {})",
                    closest(key, &KEYS),
                    KEYS.join(", ")
                )));
            }
        }
        let method = match map.get("method") {
            None => return Err(Error::config("speculative_config needs \"method\": one of ngram, suffix, custom")),
            Some(Value::String(m)) => m.as_str(),
            Some(other) => {
                return Err(Error::config(format!("\"method\" must be a string such as \"ngram\" (got {other})")))
            }
        };
        let method = if method == "[ngram]" { "ngram" } else { method };
        if LATER_METHODS.contains(&method) {
            return Err(Error::config(format!(
                "method '{method}' needs draft weights, which this build does not load yet; \
                 use 'ngram', 'suffix' or 'custom'"
            )));
        }
        if !METHODS.contains(&method) {
            return Err(Error::config(format!(
                "unknown speculative method '{method}'; did you mean '{}'? (methods: {})",
                closest(method, &METHODS),
                METHODS.join(", ")
            )));
        }
        let only_for = |prefix: &str, owner: &str| -> Result<()> {
            match map.keys().find(|k| k.starts_with(prefix)) {
                Some(k) if method != owner => Err(Error::config(format!(
                    "'{k}' applies to method '{owner}' only, not '{method}'; remove it or set \"method\": \"{owner}\""
                ))),
                _ => Ok(()),
            }
        };
        only_for("prompt_lookup_", "ngram")?;
        only_for("suffix_decoding_", "suffix")?;

        let num_speculative_tokens = optional_count(map, "num_speculative_tokens")?;
        if num_speculative_tokens == Some(0) || num_speculative_tokens > Some(MAX_SPECULATIVE_TOKENS) {
            return Err(Error::config(format!(
                "num_speculative_tokens must be in 1..={MAX_SPECULATIVE_TOKENS} (got {}); try 4",
                num_speculative_tokens.unwrap_or(0)
            )));
        }
        let required_k = || {
            num_speculative_tokens.ok_or_else(|| {
                Error::config(format!(
                    "method '{method}' needs \"num_speculative_tokens\" (how many tokens to guess per step), e.g. 4"
                ))
            })
        };
        let (method, num_speculative_tokens) = match method {
            "ngram" => {
                // vLLM: both missing -> 5 and 5; one missing -> equal to the other.
                let (min, max) =
                    match (optional_count(map, "prompt_lookup_min")?, optional_count(map, "prompt_lookup_max")?) {
                        (None, None) => (5, 5),
                        (Some(min), None) => (min, min),
                        (None, Some(max)) => (max, max),
                        (Some(min), Some(max)) => (min, max),
                    };
                if min == 0 {
                    return Err(Error::config("prompt_lookup_min must be >= 1 (got 0); try 2"));
                }
                if min > max {
                    return Err(Error::config(format!(
                        "prompt_lookup_min={min} must be <= prompt_lookup_max={max}; raise prompt_lookup_max or lower prompt_lookup_min"
                    )));
                }
                (Method::Ngram { prompt_lookup_min: min, prompt_lookup_max: max }, required_k()?)
            }
            "suffix" => {
                let max_tree_depth = optional_count(map, "suffix_decoding_max_tree_depth")?.unwrap_or(24);
                if max_tree_depth == 0 {
                    return Err(Error::config(
                        "suffix_decoding_max_tree_depth must be >= 1 (got 0); the default is 24",
                    ));
                }
                let max_cached_requests = optional_count(map, "suffix_decoding_max_cached_requests")?.unwrap_or(10_000);
                let max_spec_factor = optional_number(map, "suffix_decoding_max_spec_factor")?.unwrap_or(1.0);
                if max_spec_factor < 0.0 {
                    return Err(Error::config(format!(
                        "suffix_decoding_max_spec_factor must be >= 0 (got {max_spec_factor}); the default is 1.0"
                    )));
                }
                let min_token_prob = optional_number(map, "suffix_decoding_min_token_prob")?.unwrap_or(0.1);
                if !(0.0..=1.0).contains(&min_token_prob) {
                    return Err(Error::config(format!(
                        "suffix_decoding_min_token_prob must be in [0, 1] (got {min_token_prob}); the default is 0.1"
                    )));
                }
                let params = SuffixParams {
                    max_tree_depth,
                    max_cached_requests,
                    max_spec_factor: max_spec_factor as f32,
                    min_token_prob: min_token_prob as f32,
                };
                // vLLM: suffix decoding sizes its drafts itself; k defaults to the tree depth as a cap.
                (Method::Suffix(params), num_speculative_tokens.unwrap_or(max_tree_depth.min(MAX_SPECULATIVE_TOKENS)))
            }
            _ => (Method::Custom, required_k()?),
        };
        let adaptive_draft_length = match map.get("adaptive_draft_length") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(other) => {
                return Err(Error::config(format!("'adaptive_draft_length' must be true or false (got {other})")))
            }
        };
        Ok(Self { method, num_speculative_tokens, adaptive_draft_length })
    }

    /// The config as vLLM-style JSON, every default spelled out.
    pub fn to_json(&self) -> String {
        let mut map = Map::new();
        map.insert("method".into(), self.method_name().into());
        map.insert("num_speculative_tokens".into(), self.num_speculative_tokens.into());
        map.insert("adaptive_draft_length".into(), self.adaptive_draft_length.into());
        match &self.method {
            Method::Ngram { prompt_lookup_min, prompt_lookup_max } => {
                map.insert("prompt_lookup_min".into(), (*prompt_lookup_min).into());
                map.insert("prompt_lookup_max".into(), (*prompt_lookup_max).into());
            }
            Method::Suffix(p) => {
                map.insert("suffix_decoding_max_tree_depth".into(), p.max_tree_depth.into());
                map.insert("suffix_decoding_max_cached_requests".into(), p.max_cached_requests.into());
                map.insert("suffix_decoding_max_spec_factor".into(), f64::from(p.max_spec_factor).into());
                map.insert("suffix_decoding_min_token_prob".into(), f64::from(p.min_token_prob).into());
            }
            Method::Custom => {}
        }
        Value::Object(map).to_string()
    }
}

fn optional_count(map: &Map<String, Value>, key: &str) -> Result<Option<usize>> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) if n.as_u64().is_some() => Ok(n.as_u64().map(|v| v as usize)),
        Some(other) => Err(Error::config(format!("'{key}' must be a whole number >= 0 (got {other})"))),
    }
}

fn optional_number(map: &Map<String, Value>, key: &str) -> Result<Option<f64>> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(other) => Err(Error::config(format!("'{key}' must be a number (got {other})"))),
    }
}

/// The candidate with the smallest edit distance to `word`.
fn closest<'a>(word: &str, candidates: &[&'a str]) -> &'a str {
    candidates.iter().copied().min_by_key(|c| edit_distance(word, c)).unwrap_or("")
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let substitution = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substitution.min(row[j] + 1).min(row[j + 1] + 1);
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<SpeculativeConfig> {
        SpeculativeConfig::from_json(text)
    }

    fn error(text: &str) -> String {
        let err = parse(text).unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err:?}");
        err.to_string()
    }

    #[test]
    fn fills_vllm_defaults() {
        let ngram = parse(r#"{"method": "ngram", "num_speculative_tokens": 4}"#).unwrap();
        assert_eq!(ngram.method, Method::Ngram { prompt_lookup_min: 5, prompt_lookup_max: 5 });
        let ngram = parse(r#"{"method": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_max": 4}"#).unwrap();
        assert_eq!(ngram.method, Method::Ngram { prompt_lookup_min: 4, prompt_lookup_max: 4 });
        let suffix = parse(r#"{"method": "suffix"}"#).unwrap();
        assert_eq!(suffix.num_speculative_tokens, 24);
        assert!(suffix.adaptive_draft_length);
        let fixed = parse(r#"{"method": "suffix", "adaptive_draft_length": false}"#).unwrap();
        assert!(!fixed.adaptive_draft_length);
        assert_eq!(
            suffix.method,
            Method::Suffix(SuffixParams {
                max_tree_depth: 24,
                max_cached_requests: 10_000,
                max_spec_factor: 1.0,
                min_token_prob: 0.1
            })
        );
        assert_eq!(SpeculativeConfig::from_json(&suffix.to_json()).unwrap(), suffix);
        assert_eq!(SpeculativeConfig::from_json(&ngram.to_json()).unwrap(), ngram);
    }

    #[test]
    fn bad_input_names_the_fix() {
        assert!(error(r#"{"method": "ngram", "num_spec_tokens": 4}"#).contains("'num_speculative_tokens'"));
        assert!(error(r#"{"method": "ngarm", "num_speculative_tokens": 4}"#).contains("'ngram'"));
        assert!(error(r#"{"method": "eagle", "num_speculative_tokens": 4}"#).contains("draft weights"));
        assert!(error(r#"{"method": "ngram", "num_speculative_tokens": 0}"#).contains("num_speculative_tokens"));
        assert!(error(r#"{"method": "ngram", "num_speculative_tokens": -2}"#).contains("num_speculative_tokens"));
        assert!(error(r#"{"method": "ngram", "num_speculative_tokens": 2.5}"#).contains("whole number"));
        assert!(error(r#"{"method": "ngram"}"#).contains("needs \"num_speculative_tokens\""));
        assert!(error(
            r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 4, "prompt_lookup_max": 2}"#
        )
        .contains("prompt_lookup_min=4 must be <= prompt_lookup_max=2"));
        assert!(error(r#"{"method": "suffix", "prompt_lookup_min": 2}"#).contains("applies to method 'ngram'"));
        assert!(error(r#"{"method": "suffix", "suffix_decoding_min_token_prob": 2}"#).contains("[0, 1]"));
        assert!(error(r#"{"num_speculative_tokens": 4}"#).contains("needs \"method\""));
        assert!(error(r#"{"method": "suffix", "adaptive_draft_length": 1}"#).contains("true or false"));
        assert!(error("[1, 2]").contains("JSON object"));
        assert!(error("{method: ngram}").contains("not valid JSON"));
    }

    #[test]
    fn edit_distance_counts_single_edits() {
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("same", "same"), 0);
    }
}
