//! The engine's grammar cache (`specrs_core::constraint::cache`) on the real SmolLM2 model and
//! tokenizer: a grammar checked and then started, or asked for by several requests, is compiled
//! once (the engine's `num_grammar_compiles` / `num_grammar_cache_hits`); specs that differ in any
//! way, even only in the order of a schema's properties, never share an entry; what one request's
//! matcher does never reaches the next request's start; a failing spec is never kept and fails the
//! same way every time; the cache keeps the most recently used entries within its bounds.

use serde_json::{json, Value};
use specrs_core::constraint::{Constraint, GrammarCache, GrammarSource, GrammarSpec};
use specrs_core::{Engine, Error, SamplingParams};

use crate::common;
use crate::common::constraint_fixture::fixture;

/// An engine of its own for each test, so that its counters count that test's compiles alone.
fn engine() -> Engine {
    Engine::load(common::smollm2_path(), "cpu").expect("load SmolLM2")
}

/// (compiles, cache hits) so far.
fn counts(engine: &Engine) -> (usize, usize) {
    let m = engine.metrics().unwrap();
    (m.num_grammar_compiles, m.num_grammar_cache_hits)
}

fn spec(value: Value) -> GrammarSpec {
    GrammarSpec::from_json(&value).expect("grammar spec")
}

/// A schema whose first property is named `key`.
fn schema_with(key: &str) -> Value {
    json!({
        "type": "object",
        "properties": {key: {"type": "string"}, "age": {"type": "integer"}},
        "required": [key, "age"],
        "additionalProperties": false
    })
}

fn prompt(engine: &Engine) -> Vec<u32> {
    engine.tokenizer().encode("Maria is 34. As JSON:", false).unwrap()
}

/// The first mask and forced tokens: what a constraint at the start of the output gives.
fn start_state(constraint: &mut Constraint) -> (Vec<u32>, Vec<u32>) {
    (constraint.allowed_tokens().unwrap().token_ids(), constraint.forced_tokens())
}

/// `spec` compiled afresh, by a compiler no cache sits in front of.
fn fresh(spec: &GrammarSpec) -> Constraint {
    fixture().compiler.compile(spec).expect("compile")
}

#[test]
fn a_checked_grammar_is_not_compiled_again_when_its_request_starts() {
    let engine = engine();
    let params = SamplingParams {
        grammar: Some(spec(json!({"json_schema": schema_with("checked")}))),
        ..SamplingParams::greedy(24)
    };
    engine.check_grammar(&params).unwrap();
    let first = engine.generate(prompt(&engine), params.clone(), None).unwrap();
    assert_eq!(counts(&engine), (1, 1), "check then start: one compile, one hit");
    // A second request with the same schema (sent as a string of JSON, as clients may) compiles
    // nothing and decodes the same.
    let again = spec(json!({"json_schema": schema_with("checked").to_string()}));
    let second = engine.generate(prompt(&engine), SamplingParams { grammar: Some(again), ..params }, None).unwrap();
    assert_eq!(counts(&engine), (1, 2), "a second request: no compile");
    assert_eq!(second.token_ids, first.token_ids);
    assert!(first.text.starts_with("{\"checked\": \""), "{}", first.text);
}

#[test]
fn requests_with_the_same_schema_compile_it_once() {
    let engine = engine();
    let params = SamplingParams {
        grammar: Some(spec(json!({"json_schema": schema_with("shared")}))),
        ..SamplingParams::greedy(8)
    };
    let sessions: Vec<_> = (0..3).map(|_| engine.start(prompt(&engine), params.clone(), None).unwrap()).collect();
    assert_eq!(counts(&engine), (1, 2));
    drop(sessions);
}

#[test]
fn specs_that_differ_never_share_an_entry() {
    let engine = engine();
    // The same properties in another order: `GrammarSpec`'s `==` takes them for equal (a JSON
    // object's keys are a map), but llguidance writes the properties in the order given.
    let name_first = json!({"type": "object", "properties": {"name": {"type": "string"}, "town": {"type": "string"}},
                            "required": ["name", "town"], "additionalProperties": false});
    let town_first = json!({"type": "object", "properties": {"town": {"type": "string"}, "name": {"type": "string"}},
                            "required": ["name", "town"], "additionalProperties": false});
    let specs = [
        spec(json!({"json_schema": name_first})),
        spec(json!({"json_schema": town_first})),
        spec(json!({"regex": "order-[0-9]+"})),
        spec(json!({"regex": "order-[a-z]+"})),
        spec(json!({"choice": ["order-1", "order-2"]})),
        spec(json!({"grammar": "start: \"order-\" /[0-9]+/"})),
    ];
    assert_eq!(specs[0], specs[1], "GrammarSpec's == ignores the order of properties");
    for spec in &specs {
        engine.compile_grammar(spec).unwrap();
    }
    assert_eq!(counts(&engine), (specs.len(), 0), "each spec compiled once");
    // Each spec, asked for again, starts as its own fresh compile does, and never as another's.
    for spec in &specs {
        let mut cached = engine.compile_grammar(spec).unwrap();
        assert_eq!(start_state(&mut cached), start_state(&mut fresh(spec)), "{spec:?}");
    }
    assert_eq!(counts(&engine), (specs.len(), specs.len()));
    let mut name = engine.compile_grammar(&specs[0]).unwrap();
    let mut town = engine.compile_grammar(&specs[1]).unwrap();
    let decode = |ids: &[u32]| fixture().tokenizer.decode(ids, false).unwrap();
    assert!(decode(&name.forced_tokens()).starts_with("{\"name\""));
    assert!(decode(&town.forced_tokens()).starts_with("{\"town\""));
}

#[test]
fn a_request_advancing_its_matcher_leaves_the_next_request_at_the_start() {
    let engine = engine();
    let spec = spec(json!({"json_schema": schema_with("advanced")}));
    let mut first = engine.compile_grammar(&spec).unwrap();
    let fresh_start = start_state(&mut fresh(&spec));
    // The first request takes the forced tokens, then an allowed one, then rolls one back.
    let forced = first.forced_tokens();
    assert!(!forced.is_empty());
    first.consume(&forced).unwrap();
    let next = first.allowed_tokens().unwrap().token_ids()[0];
    first.consume(&[next]).unwrap();
    let forced_after = first.forced_tokens();
    first.consume(&forced_after).unwrap();
    first.rollback(1).unwrap();
    let first_state = start_state(&mut first);
    assert_ne!(first_state, fresh_start, "the first request moved on");
    // The next request starts where a fresh compile does, and starting it leaves the first as it was.
    let mut second = engine.compile_grammar(&spec).unwrap();
    assert_eq!(counts(&engine), (1, 1), "the second request is a hit");
    assert_eq!(start_state(&mut second), fresh_start);
    let forced = second.forced_tokens();
    second.consume(&forced).unwrap();
    assert_eq!(start_state(&mut first), first_state);
    let mut third = engine.compile_grammar(&spec).unwrap();
    assert_eq!(start_state(&mut third), fresh_start);
}

#[test]
fn a_failing_spec_is_never_kept_and_fails_alike_every_time() {
    let engine = engine();
    let bad = spec(
        json!({"json_schema": {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing-in-cache-test"}}}}),
    );
    let expected = match fixture().compiler.compile(&bad) {
        Err(Error::Config(message)) => message,
        other => panic!("expected a config error, got {:?}", other.err()),
    };
    let params = SamplingParams { grammar: Some(bad.clone()), ..SamplingParams::greedy(8) };
    for _ in 0..2 {
        match engine.check_grammar(&params) {
            Err(Error::Config(message)) => assert_eq!(message, expected),
            other => panic!("expected a config error, got {other:?}"),
        }
        match engine.start(prompt(&engine), params.clone(), None) {
            Err(Error::Config(message)) => assert_eq!(message, expected),
            other => panic!("expected a config error, got {:?}", other.err()),
        }
    }
    assert_eq!(counts(&engine), (4, 0), "compiled each time, never a hit");
}

/// `cache.get_or_compile(spec)` on the fixture's compiler; whether it compiled.
fn compiled(cache: &GrammarCache, spec: &GrammarSpec) -> bool {
    let (_, source) = cache.get_or_compile(spec, |spec| fixture().compiler.compile(spec)).unwrap();
    source == GrammarSource::Compiled
}

#[test]
fn the_least_recently_used_entry_goes_past_the_count() {
    let cache = GrammarCache::with_bounds(2, 1 << 20);
    let [a, b, c] = ["a+", "b+", "c+"].map(|rx| spec(json!({"regex": rx})));
    assert!(compiled(&cache, &a));
    assert!(compiled(&cache, &b));
    assert!(!compiled(&cache, &a), "a is kept");
    assert!(compiled(&cache, &c), "c is new");
    assert_eq!(cache.len(), 2);
    assert!(!compiled(&cache, &a), "a was used after b, so b went");
    assert!(compiled(&cache, &b), "b went");
    assert!(compiled(&cache, &c), "c was the least recently used when b came back");
}

#[test]
fn entries_stay_within_the_key_bytes() {
    let [short, long] = ["x+", "y{1,3}z+|yy"].map(|rx| spec(json!({"regex": rx})));
    let short_bytes = short.to_json().to_string().len();
    let long_bytes = long.to_json().to_string().len();
    // Room for the short key, not for both: the long one evicts it.
    let cache = GrammarCache::with_bounds(10, long_bytes + short_bytes - 1);
    assert!(compiled(&cache, &short));
    assert!(compiled(&cache, &long));
    assert_eq!(cache.len(), 1);
    assert!(!compiled(&cache, &long));
    assert!(compiled(&cache, &short), "the long key evicted the short one");
    // A key over the whole budget is compiled every time and never kept.
    let tiny = GrammarCache::with_bounds(10, short_bytes - 1);
    assert!(compiled(&tiny, &short));
    assert!(compiled(&tiny, &short));
    assert!(tiny.is_empty());
}
