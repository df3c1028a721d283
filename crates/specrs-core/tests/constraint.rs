//! Constrained decoding (`specrs_core::constraint`) on the real SmolLM2 tokenizer (byte-level BPE,
//! 49152 tokens): grammars walked token by token end in text of their language; forced tokens,
//! draft validation and rollback agree with the masks; bad grammars are configuration errors that
//! carry llguidance's reason; `GrammarSpec::from_json` names the key it rejects.
//!
//! A walk takes EOS as soon as the grammar allows it, and otherwise the lowest allowed token id
//! that differs from the previous token: always the lowest id would write `!!!...` inside a JSON
//! string forever, while this choice closes strings at once (`!` then `"`, which follows it).

use serde_json::{json, Value};
use specrs_core::constraint::{Constraint, ConstraintCompiler, GrammarSpec};
use specrs_core::tokenizer::TextTokenizer;
use specrs_core::Error;

use crate::common::constraint_fixture::fixture;

/// Longest walk a test grammar needs; a walk that has not finished by then is a failure.
const MAX_WALK_TOKENS: usize = 64;

fn compile(spec: Value) -> Constraint {
    let spec = GrammarSpec::from_json(&spec).expect("grammar spec");
    fixture().compiler.compile(&spec).expect("compile")
}

fn config_error(spec: Value) -> String {
    let spec = GrammarSpec::from_json(&spec).expect("grammar spec");
    match fixture().compiler.compile(&spec) {
        Ok(_) => panic!("{spec:?} compiled"),
        Err(Error::Config(message)) => message,
        Err(other) => panic!("{spec:?}: expected a config error, got {other:?}"),
    }
}

fn encode(text: &str) -> Vec<u32> {
    fixture().tokenizer.encode(text, false).unwrap()
}

fn decode(ids: &[u32]) -> String {
    fixture().tokenizer.decode(ids, false).unwrap()
}

fn is_eos(token: u32) -> bool {
    fixture().tokenizer.eos_token_ids().contains(&token)
}

fn eos() -> u32 {
    fixture().tokenizer.eos_token_ids()[0]
}

/// Walks `constraint` to its end (see the module doc for the choice of token); returns the text,
/// without the final EOS.
fn walk(constraint: &mut Constraint) -> String {
    let mut out: Vec<u32> = Vec::new();
    for _ in 0..MAX_WALK_TOKENS {
        let allowed = constraint.allowed_tokens().unwrap();
        assert!(allowed.count() > 0, "empty mask after {:?}", decode(&out));
        let ids = allowed.token_ids();
        // Closing tokens first, so objects and strings end; then a digit; then the lowest id.
        let closing = ["}", "\"", "]", "1"].map(|text| encode(text)[0]);
        let token = match ids.iter().find(|&&t| is_eos(t)) {
            Some(&eos) => eos,
            None => closing
                .into_iter()
                .find(|t| ids.contains(t) && Some(t) != out.last())
                .unwrap_or_else(|| *ids.iter().find(|&&t| Some(&t) != out.last()).unwrap_or(&ids[0])),
        };
        assert_eq!(constraint.valid_prefix_len(&[token]), 1, "a masked-in token is not valid alone");
        constraint.consume(&[token]).unwrap();
        if is_eos(token) {
            assert!(constraint.is_finished(), "consumed EOS but not finished after {:?}", decode(&out));
            return decode(&out);
        }
        out.push(token);
    }
    panic!("no EOS after {MAX_WALK_TOKENS} tokens: {:?}", decode(&out));
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": false
    })
}

#[test]
fn json_schema_walk_yields_a_matching_object() {
    let mut constraint = compile(json!({"json_schema": person_schema()}));
    let text = walk(&mut constraint);
    let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"));
    let object = value.as_object().unwrap_or_else(|| panic!("{text:?} is not an object"));
    assert!(object["name"].is_string(), "{text}");
    assert!(object["age"].is_i64(), "{text}");
    assert_eq!(object.len(), 2, "{text}");
    assert!(constraint.allowed_tokens().unwrap().token_ids().iter().all(|&t| is_eos(t)));
    assert!(constraint.forced_tokens().is_empty());
}

#[test]
fn json_object_walk_yields_an_object() {
    let text = walk(&mut compile(json!({"json_object": true})));
    let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"));
    assert!(value.is_object(), "{text}");
}

#[test]
fn forced_tokens_open_the_object() {
    // specrs' default JSON layout (one line, json.dumps separators) forces the first key.
    let mut compact = compile(json!({"json_schema": person_schema()}));
    let forced = compact.forced_tokens();
    let text = decode(&forced);
    // It stops where the tokenization is not fixed (`: "` may be one token or two).
    assert!(text.starts_with(r#"{"name":"#) && r#"{"name": ""#.starts_with(&text), "forced {text:?}");
    // Forced tokens are valid, the first one alone and all together.
    let allowed = compact.allowed_tokens().unwrap();
    assert!(allowed.contains(forced[0]));
    assert_eq!(compact.valid_prefix_len(&forced), forced.len());
    compact.consume(&forced).unwrap();

    // A schema that asks for flexible whitespace gets it: whitespace may open the object.
    let mut schema = person_schema();
    schema["x-guidance"] = json!({"whitespace_flexible": true});
    let mut flexible = compile(json!({"json_schema": schema}));
    assert!(flexible.forced_tokens().is_empty());
    assert!(flexible.allowed_tokens().unwrap().count() > 1);
}

#[test]
fn valid_prefix_len_cuts_drafts_without_changing_state() {
    let mut constraint = compile(json!({"json_schema": person_schema()}));
    let before = constraint.allowed_tokens().unwrap().token_ids();

    let good = encode(r#"{"name": "Ann", "age": 42}"#);
    assert_eq!(constraint.valid_prefix_len(&good), good.len());
    let mut good_then_eos = good.clone();
    good_then_eos.push(eos());
    assert_eq!(constraint.valid_prefix_len(&good_then_eos), good.len() + 1);
    // Nothing follows an EOS, not even another EOS.
    good_then_eos.push(eos());
    assert_eq!(constraint.valid_prefix_len(&good_then_eos), good.len() + 1);
    // An EOS before the object is complete is not allowed.
    assert_eq!(constraint.valid_prefix_len(&[good[0], eos()]), 1);

    let bad = encode(r#"{"name": 42}"#);
    let n = constraint.valid_prefix_len(&bad);
    assert!(n < bad.len(), "{bad:?}");
    assert!(r#"{"name": "#.starts_with(&decode(&bad[..n])), "valid prefix {:?}", decode(&bad[..n]));
    assert_eq!(decode(&bad[..=n]).trim_start_matches(r#"{"name":"#).trim_start(), "4", "cut at the number");

    // Ids past the vocabulary (a model's padding rows) are never valid.
    let vocab = fixture().compiler.vocab_size() as u32;
    assert_eq!(constraint.valid_prefix_len(&[good[0], vocab, good[1]]), 1);

    assert_eq!(constraint.allowed_tokens().unwrap().token_ids(), before, "validation changed the state");
    // And a full consume of the good draft still works.
    constraint.consume(&good).unwrap();
    constraint.consume(&[eos()]).unwrap();
    assert!(constraint.is_finished());
}

#[test]
fn rollback_restores_the_mask() {
    let mut constraint = compile(json!({"json_schema": person_schema()}));
    let good = encode(r#"{"name": "Ann", "age": 42}"#);
    let mut masks = vec![constraint.allowed_tokens().unwrap().token_ids()];
    for &t in &good {
        constraint.consume(&[t]).unwrap();
        masks.push(constraint.allowed_tokens().unwrap().token_ids());
    }
    assert_ne!(masks[0], masks[3]);
    // Back step by step, then in one go from the end.
    for k in (0..good.len()).rev() {
        constraint.rollback(1).unwrap();
        assert_eq!(constraint.allowed_tokens().unwrap().token_ids(), masks[k], "after rolling back to {k}");
    }
    constraint.consume(&good).unwrap();
    constraint.rollback(good.len() - 2).unwrap();
    assert_eq!(constraint.allowed_tokens().unwrap().token_ids(), masks[2]);

    // Rolling back more than was consumed fails and changes nothing.
    match constraint.rollback(3) {
        Err(Error::Config(message)) => assert!(message.contains("holds only the 2 tokens"), "{message}"),
        other => panic!("rollback past the start: {:?}", other.err()),
    }
    assert_eq!(constraint.allowed_tokens().unwrap().token_ids(), masks[2]);

    // Rollback across the end: the finished grammar takes tokens again.
    constraint.consume(&good[2..]).unwrap();
    constraint.consume(&[eos()]).unwrap();
    assert!(constraint.is_finished());
    constraint.rollback(2).unwrap();
    assert!(!constraint.is_finished());
    assert_eq!(constraint.allowed_tokens().unwrap().token_ids(), masks[good.len() - 1]);
}

#[test]
fn consume_rejects_forbidden_tokens_without_changing_state() {
    let mut constraint = compile(json!({"json_schema": person_schema()}));
    let before = constraint.allowed_tokens().unwrap().token_ids();
    let hello = encode("hello");
    match constraint.consume(&hello) {
        Err(Error::Config(message)) => {
            assert!(message.contains(&format!("token {}", hello[0])), "{message}");
            assert!(message.contains("JSON schema"), "{message}");
        }
        other => panic!("consumed a forbidden token: {:?}", other.err()),
    }
    let vocab = fixture().compiler.vocab_size() as u32;
    assert!(matches!(constraint.consume(&[vocab + 5]), Err(Error::Config(_))));
    assert_eq!(constraint.allowed_tokens().unwrap().token_ids(), before);
    // The constraint is still usable.
    assert!(serde_json::from_str::<Value>(&walk(&mut constraint)).is_ok());
}

#[test]
fn regex_walk_matches() {
    let mut constraint = compile(json!({"regex": "[0-9]{3}-[0-9]{4}"}));
    let text = walk(&mut constraint);
    let bytes = text.as_bytes();
    assert_eq!(bytes.len(), 8, "{text:?}");
    assert!(bytes.iter().enumerate().all(|(i, b)| if i == 3 { *b == b'-' } else { b.is_ascii_digit() }), "{text:?}");

    let mut constraint = compile(json!({"regex": "[0-9]{3}-[0-9]{4}"}));
    assert_eq!(constraint.valid_prefix_len(&encode("555-0123")), encode("555-0123").len());
    assert_eq!(constraint.valid_prefix_len(&encode("55a")), 2);
}

#[test]
fn choice_yields_one_of_the_choices() {
    let choices = json!({"choice": ["yes", "no"]});
    let text = walk(&mut compile(choices.clone()));
    assert!(text == "yes" || text == "no", "{text:?}");

    let mut constraint = compile(choices);
    let mut yes = encode("yes");
    yes.push(eos());
    assert_eq!(constraint.valid_prefix_len(&yes), yes.len());
    assert_eq!(constraint.valid_prefix_len(&encode("maybe")), 0);
    // Quotes and backslashes in a choice are text, not Lark syntax.
    let odd = r#"say "hi" \ bye"#;
    let mut constraint = compile(json!({"choice": [odd]}));
    assert_eq!(constraint.valid_prefix_len(&encode(odd)), encode(odd).len());
}

#[test]
fn lark_grammar_walk() {
    let lark = r#"
        start: greeting " " name
        greeting: "hello" | "hi"
        name: /[a-z]{2,4}/
    "#;
    let text = walk(&mut compile(json!({"grammar": lark})));
    let (greeting, name) = text.split_once(' ').unwrap_or_else(|| panic!("{text:?}"));
    assert!(greeting == "hello" || greeting == "hi", "{text:?}");
    assert!((2..=4).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_lowercase()), "{text:?}");
}

#[test]
fn bad_grammars_are_config_errors_with_llguidances_reason() {
    let schema = config_error(json!({"json_schema": {"type": "objekt"}}));
    assert!(schema.contains("invalid JSON schema") && schema.contains("objekt"), "{schema}");
    let regex = config_error(json!({"regex": "[0-9"}));
    assert!(regex.contains("invalid regex") && regex.contains("[0-9"), "{regex}");
    let lark = config_error(json!({"grammar": "start: missing_rule"}));
    assert!(lark.contains("invalid Lark grammar") && lark.contains("missing_rule"), "{lark}");
    println!("schema: {schema}\nregex: {regex}\nlark: {lark}");
}

#[test]
fn apply_to_logits_forbids_exactly_the_masked_out_tokens() {
    let mut constraint = compile(json!({"json_schema": person_schema()}));
    let forced = constraint.forced_tokens();
    constraint.consume(&forced).unwrap();
    let mask = constraint.allowed_tokens().unwrap();
    assert!(mask.count() > 1, "after the forced tokens a key or whitespace may follow");
    let vocab = fixture().compiler.vocab_size();
    // A model's logits row may be longer than the tokenizer's vocabulary.
    let mut logits: Vec<f32> = (0..vocab + 13).map(|i| i as f32 * 1e-3).collect();
    constraint.apply_to_logits(&mut logits).unwrap();
    for (id, &logit) in logits.iter().enumerate() {
        if id < vocab && mask.contains(id as u32) {
            assert_eq!(logit, id as f32 * 1e-3, "allowed token {id} changed");
        } else {
            assert_eq!(logit, f32::NEG_INFINITY, "forbidden token {id} kept");
        }
    }
    assert_eq!(logits.iter().filter(|l| l.is_finite()).count(), mask.count());
    // A shorter row is masked on its own length.
    let mut short = vec![0.0f32; 100];
    constraint.apply_to_logits(&mut short).unwrap();
    assert!(short.iter().enumerate().all(|(id, &l)| (l == 0.0) == mask.contains(id as u32)));
}

#[test]
fn a_tokenizer_without_byte_vocabulary_is_refused() {
    let numbered = TextTokenizer::numbered(100).unwrap();
    match ConstraintCompiler::new(&numbered) {
        Err(Error::Config(message)) => assert!(message.contains("byte-level"), "{message}"),
        other => panic!("expected a config error, got {:?}", other.err()),
    }
}

#[test]
fn grammar_spec_from_json() {
    let schema = person_schema();
    assert_eq!(
        GrammarSpec::from_json(&json!({"json_schema": schema})).unwrap(),
        GrammarSpec::JsonSchema(schema.clone())
    );
    assert_eq!(
        GrammarSpec::from_json(&json!({"json_schema": schema.to_string()})).unwrap(),
        GrammarSpec::JsonSchema(schema)
    );
    assert_eq!(GrammarSpec::from_json(&json!({"json_object": true})).unwrap(), GrammarSpec::JsonObject);
    assert_eq!(GrammarSpec::from_json(&json!({"regex": "a+"})).unwrap(), GrammarSpec::Regex("a+".into()));
    assert_eq!(
        GrammarSpec::from_json(&json!({"grammar": "start: \"a\""})).unwrap(),
        GrammarSpec::Lark("start: \"a\"".into())
    );
    assert_eq!(
        GrammarSpec::from_json(&json!({"choice": ["a", "b"]})).unwrap(),
        GrammarSpec::Choice(vec!["a".into(), "b".into()])
    );

    let rejected = |spec: Value, needle: &str| match GrammarSpec::from_json(&spec) {
        Err(Error::Config(message)) => assert!(message.contains(needle), "{spec}: {message}"),
        other => panic!("{spec}: expected a config error naming {needle:?}, got {other:?}"),
    };
    rejected(json!("regex"), "one of the keys");
    rejected(json!({}), "empty");
    rejected(json!({"regexp": "a"}), "\"regexp\"");
    rejected(json!({"regex": "a", "choice": ["a"]}), "choice, regex");
    rejected(json!({"regex": 5}), "\"regex\"");
    rejected(json!({"regex": ""}), "\"regex\"");
    rejected(json!({"grammar": ["start"]}), "\"grammar\"");
    rejected(json!({"json_object": false}), "\"json_object\"");
    rejected(json!({"json_schema": 3}), "\"json_schema\"");
    rejected(json!({"json_schema": "{not json"}), "\"json_schema\"");
    rejected(json!({"json_schema": "[1]"}), "\"json_schema\"");
    rejected(json!({"choice": "yes"}), "\"choice\"");
    rejected(json!({"choice": []}), "\"choice\"");
    rejected(json!({"choice": ["yes", 1]}), "\"choice\"[1]");
    rejected(json!({"choice": ["yes", ""]}), "\"choice\"[1]");
}
