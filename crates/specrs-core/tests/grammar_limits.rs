//! The grammar limits (`specrs_core::constraint::limits`) on the real SmolLM2 tokenizer: at each
//! limit an input compiles, on a quarter of the compile thread's stack (the margin the stack is
//! sized with); one step past it, it is an `Error::Config` naming the limit. The shapes that
//! crashed the process (a 5,000-`$ref` chain, a 5,000-rule Lark chain) and the ones that failed
//! at the first token (`a{1000000}`, `(x{1000}){1000}`, a 20,000-string choice, `$ref` cycles)
//! are refused when compiled; what compiles at a limit also runs.

use serde_json::{json, Map, Value};
use specrs_core::constraint::limits::{
    COMPILE_STACK_BYTES, MAX_CHOICES, MAX_CHOICE_BYTES, MAX_JSON_NESTING, MAX_LARK_DEPTH, MAX_LARK_RULES,
    MAX_PATTERN_MIN_LENGTH, MAX_REGEX_REPEAT, MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES,
};
use specrs_core::constraint::{Constraint, GrammarSpec};
use specrs_core::Error;

use crate::common::constraint_fixture::fixture;

/// Tokens a walk through a grammar at a limit takes before it must have run without error.
const WALK_TOKENS: usize = 64;

/// Compiles `spec` on a quarter of the compile thread's stack: what passes the limits must fit.
fn compiles(spec: GrammarSpec) -> Constraint {
    let stack = COMPILE_STACK_BYTES / 4;
    match fixture().compiler.compile_with_stack(&spec, stack) {
        Ok(constraint) => constraint,
        Err(e) => panic!("{} did not compile: {e}", describe(&spec)),
    }
}

/// The `Error::Config` message for `spec`, which must name `limit`.
fn refused(spec: GrammarSpec, limit: &str) -> String {
    match fixture().compiler.compile(&spec) {
        Err(Error::Config(message)) => {
            assert!(message.contains(limit), "{}: the message does not name {limit}: {message}", describe(&spec));
            message
        }
        Err(other) => panic!("{}: expected a config error naming {limit}, got {other:?}", describe(&spec)),
        Ok(_) => panic!("{} compiled; expected a config error naming {limit}", describe(&spec)),
    }
}

fn describe(spec: &GrammarSpec) -> String {
    let text = spec.to_json().to_string();
    let cut = text.char_indices().nth(100).map_or(text.len(), |(i, _)| i);
    format!("{}... ({} bytes)", &text[..cut], text.len())
}

/// Takes up to `WALK_TOKENS` tokens (the forced ones, else the longest allowed token that is not
/// EOS), failing on any error: what compiles at a limit must not fail later for the same reason.
fn walk(mut constraint: Constraint) {
    let tok = &fixture().tokenizer;
    let mut taken = 0;
    while taken < WALK_TOKENS && !constraint.is_finished() {
        let forced = constraint.forced_tokens();
        let step = if forced.is_empty() {
            let allowed = constraint.allowed_tokens().expect("mask").token_ids();
            let longest = allowed
                .iter()
                .filter(|&&t| !tok.eos_token_ids().contains(&t))
                .max_by_key(|&&t| tok.decode(&[t], false).map_or(0, |s| s.len()))
                .or(allowed.first())
                .copied()
                .expect("a mask is never empty");
            vec![longest]
        } else {
            forced
        };
        constraint.consume(&step).expect("consume an allowed token");
        taken += step.len();
    }
}

fn schema(value: Value) -> GrammarSpec {
    GrammarSpec::JsonSchema(value)
}

/// `n` definitions, each `hop(next)` for the `$ref` to the next one, the last a string; the root
/// refers to the first. Measured depth: root and `$defs` (2), each definition's levels down to its
/// `$ref`, and the last definition with its `type` (2).
fn ref_chain(n: usize, hop: impl Fn(Value) -> Value) -> Value {
    let mut defs = Map::new();
    for i in 0..n {
        defs.insert(format!("d{i}"), hop(json!({"$ref": format!("#/$defs/d{}", i + 1)})));
    }
    defs.insert(format!("d{n}"), json!({"type": "string"}));
    json!({"$defs": defs, "$ref": "#/$defs/d0"})
}

fn plain_hop(reference: Value) -> Value {
    reference
}

fn property_hop(reference: Value) -> Value {
    json!({"type": "object", "properties": {"a": reference}, "required": ["a"]})
}

fn items_hop(reference: Value) -> Value {
    json!({"type": "array", "items": reference, "maxItems": 2})
}

fn any_of_hop(reference: Value) -> Value {
    json!({"anyOf": [reference, {"type": "null"}]})
}

/// `{"type": "array", "items": ...}` `levels` deep around a string: nesting 1 + levels.
fn nested_items(levels: usize) -> Value {
    let mut s = json!({"type": "string"});
    for _ in 0..levels {
        s = json!({"type": "array", "items": s});
    }
    s
}

/// `start` naming `r0`, each `r{i}` naming the next inside `brackets` groups, the last a literal.
/// Measured depth: start (1) + n rules of 1 + brackets + the last (1).
fn lark_rule_chain(n: usize, brackets: usize) -> String {
    let mut g = String::from("start: r0\n");
    for i in 0..n {
        g += &format!("r{i}: {}r{}{}\n", "(".repeat(brackets), i + 1, ")".repeat(brackets));
    }
    g + &format!("r{n}: \"x\"\n")
}

/// The same chain through terminals (their compiler recursion is llguidance's `do_token`).
fn lark_terminal_chain(n: usize) -> String {
    let mut g = String::from("start: T0\n");
    for i in 0..n {
        g += &format!("T{i}: T{}\n", i + 1);
    }
    g + &format!("T{n}: \"x\"\n")
}

#[test]
fn the_reported_crash_shapes_are_refused_not_a_crash() {
    // A flat 178 KB schema whose $defs chain 5,000 $refs overflowed an 8 MiB stack.
    let chain = ref_chain(5_000, plain_hop);
    assert!(chain.to_string().len() > 150_000);
    refused(schema(chain), "MAX_SCHEMA_DEPTH");
    refused(GrammarSpec::Lark(lark_rule_chain(5_000, 0)), "MAX_LARK_DEPTH");
    refused(GrammarSpec::Lark(lark_terminal_chain(5_000)), "MAX_LARK_DEPTH");
}

#[test]
fn schema_depth_at_the_limit_compiles_and_one_hop_more_is_refused() {
    // (levels per hop, hop): the chain's measured depth is 4 + per_hop * n.
    let hops: [(usize, fn(Value) -> Value); 4] = [(1, plain_hop), (3, property_hop), (2, items_hop), (3, any_of_hop)];
    for (per_hop, hop) in hops {
        let n = (MAX_SCHEMA_DEPTH - 4) / per_hop;
        walk(compiles(schema(ref_chain(n, hop))));
        let message = refused(schema(ref_chain(n + 1, hop)), "MAX_SCHEMA_DEPTH");
        assert!(message.contains(&format!("recurse {} levels", 4 + per_hop * (n + 1))), "{message}");
    }
}

#[test]
fn json_nesting_at_the_limit_compiles_and_one_level_more_is_refused() {
    walk(compiles(schema(nested_items(MAX_JSON_NESTING - 1))));
    refused(schema(nested_items(MAX_JSON_NESTING)), "MAX_JSON_NESTING");
    // Through from_json (what the server and Python pass) it is refused before being copied.
    match GrammarSpec::from_json(&json!({"json_schema": nested_items(MAX_JSON_NESTING)})) {
        Err(Error::Config(message)) => assert!(message.contains("MAX_JSON_NESTING = 64"), "{message}"),
        other => panic!("{other:?}"),
    }
    let text = nested_items(MAX_JSON_NESTING).to_string();
    assert!(matches!(GrammarSpec::from_json(&json!({"json_schema": text})), Err(Error::Config(_))));
}

#[test]
fn schema_size_at_the_limit_compiles_and_one_value_more_is_refused() {
    // {"enum": [...]}: the object, the array and its items.
    let values = |n: usize| json!({"enum": (0..n).map(|i| json!(i)).collect::<Vec<_>>()});
    compiles(schema(values(MAX_SCHEMA_NODES - 2)));
    refused(schema(values(MAX_SCHEMA_NODES - 1)), "MAX_SCHEMA_NODES");
}

#[test]
fn lark_depth_at_the_limit_compiles_and_one_level_more_is_refused() {
    // Plain chains (1 per rule), and rules nesting their reference in 28 groups (29 per rule,
    // llguidance's parser allows 30 levels).
    for brackets in [0, 28] {
        let per_rule = 1 + brackets;
        let n = (MAX_LARK_DEPTH - 2) / per_rule;
        walk(compiles(GrammarSpec::Lark(lark_rule_chain(n, brackets))));
        let message = refused(GrammarSpec::Lark(lark_rule_chain(n + 1, brackets)), "MAX_LARK_DEPTH");
        assert!(message.contains(&format!("recurse {} levels", 2 + per_rule * (n + 1))), "{message}");
    }
    compiles(GrammarSpec::Lark(lark_terminal_chain(MAX_LARK_DEPTH - 2)));
    refused(GrammarSpec::Lark(lark_terminal_chain(MAX_LARK_DEPTH - 1)), "MAX_LARK_DEPTH");
}

#[test]
fn lark_rule_count_at_the_limit_compiles_and_one_more_is_refused() {
    // start names 99 groups in sequence, each a choice of 100 rules: 1 + 99 + 9,900 definitions.
    // (One rule choosing among all of them would overflow the parser's rows instead.)
    let grouped = |extra: usize| {
        let groups = (MAX_LARK_RULES - 1) / 101;
        let mut g = format!("start: {}\n", (0..groups).map(|k| format!("g{k}")).collect::<Vec<_>>().join(" "));
        for k in 0..groups {
            let per_group = 100 + if k == groups - 1 { extra } else { 0 };
            let rules: Vec<String> = (0..per_group).map(|j| format!("r{k}x{j}")).collect();
            g += &format!("g{k}: {}\n", rules.join(" | "));
            for rule in &rules {
                g += &format!("{rule}: \"{rule} \"\n");
            }
        }
        g
    };
    assert_eq!((MAX_LARK_RULES - 1) % 101, 0, "the test's grammar has exactly MAX_LARK_RULES definitions");
    walk(compiles(GrammarSpec::Lark(grouped(0))));
    refused(GrammarSpec::Lark(grouped(1)), "MAX_LARK_RULES");
}

#[test]
fn regex_repetitions_at_the_limit_run_and_past_it_are_refused() {
    let limit = MAX_REGEX_REPEAT;
    walk(compiles(GrammarSpec::Regex(format!("a{{{limit}}}"))));
    walk(compiles(GrammarSpec::Regex("(x{100}){100}".into())));
    walk(compiles(GrammarSpec::Regex(format!("[0-9]a{{{limit}}}"))));
    refused(GrammarSpec::Regex(format!("a{{{}}}", limit + 1)), "MAX_REGEX_REPEAT");
    refused(GrammarSpec::Regex("(x{101}){100}".into()), "MAX_REGEX_REPEAT");
    // The reported ones: accepted by the old check, failing at the first token.
    refused(GrammarSpec::Regex("a{1000000}".into()), "MAX_REGEX_REPEAT");
    refused(GrammarSpec::Regex("(x{1000}){1000}".into()), "MAX_REGEX_REPEAT");
    // The same in a schema's pattern and in a Lark grammar.
    refused(schema(json!({"type": "string", "pattern": "^a{1000000}$"})), "MAX_REGEX_REPEAT");
    refused(GrammarSpec::Lark("start: /a{1000000}/".into()), "MAX_REGEX_REPEAT");
    refused(GrammarSpec::Lark("start: \"a\"~1000000".into()), "MAX_REGEX_REPEAT");
}

#[test]
fn a_patterned_strings_min_length_at_the_limit_runs_and_past_it_is_refused() {
    // Inside an object the intersection of pattern and length is forced after the first field:
    // at 500 characters this failed mid-output.
    let object = |min_length: u64| {
        json!({"type": "object", "properties": {"x": {"type": "integer"},
            "y": {"type": "string", "pattern": "^a*$", "minLength": min_length}}, "required": ["x", "y"]})
    };
    walk(compiles(schema(object(MAX_PATTERN_MIN_LENGTH))));
    refused(schema(object(MAX_PATTERN_MIN_LENGTH + 1)), "MAX_PATTERN_MIN_LENGTH");
    refused(schema(object(500)), "MAX_PATTERN_MIN_LENGTH");
    // Without a pattern the length stays free.
    compiles(schema(json!({"type": "string", "minLength": 100_000})));
}

#[test]
fn choices_at_the_limit_run_and_past_it_are_refused() {
    let choices = |n: usize, width: usize| GrammarSpec::Choice((0..n).map(|i| format!("c{i:0width$}")).collect());
    // A shared prefix keeps every choice alive in the parser's rows while it is forced.
    walk(compiles(choices(MAX_CHOICES, 8)));
    refused(choices(MAX_CHOICES + 1, 8), "MAX_CHOICES");
    refused(choices(20_000, 8), "MAX_CHOICES");
    let long = |n: usize| GrammarSpec::Choice(vec!["x".repeat(n)]);
    compiles(long(MAX_CHOICE_BYTES));
    refused(long(MAX_CHOICE_BYTES + 1), "MAX_CHOICE_BYTES");
}

#[test]
fn ref_cycles_and_schemas_without_an_instance_are_config_errors() {
    for cyclic in [
        json!({"$ref": "#"}),
        json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
        json!({"allOf": [{"$ref": "#"}]}),
    ] {
        let message = refused(schema(cyclic), "no finite instance");
        assert!(message.contains("$ref") || message.contains("allOf"), "{message}");
    }
    // An object that must contain itself, forever: forced without end.
    for endless in [
        json!({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
        json!({"type": "array", "items": {"$ref": "#"}, "minItems": 1}),
    ] {
        refused(schema(endless), "no finite instance");
    }
    // Recursion with a way out is fine.
    let tree = json!({"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v"]}}, "$ref": "#/$defs/node"});
    walk(compiles(schema(tree)));
    walk(compiles(schema(json!({"anyOf": [{"$ref": "#"}, {"type": "null"}]}))));
}

/// Found by the `grammar_compile` fuzz target (`fuzz/regressions/grammar_compile/self-requiring-
/// behind-a-choice`): an object that requires itself behind a choice compiled (its start can be
/// followed), then, once the output took that branch, the forced `{"a": {"a": ...` ran into
/// llguidance's limit on forced tokens: an internal error mid-output. Now refused when compiling.
#[test]
fn a_self_requiring_object_behind_a_choice_is_refused_when_compiling() {
    let d3 = json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/d3"}}, "required": ["a"]});
    let behind = [
        json!({"anyOf": [{"type": "array", "items": {"$ref": "#/$defs/d3"}}, {"type": "null"}]}),
        json!({"type": "object", "properties": {"x": {"$ref": "#/$defs/d3"}}}),
    ];
    for mut shape in behind {
        shape["$defs"] = json!({"d3": d3});
        let message = refused(schema(shape), "no finite instance");
        assert!(message.contains("`#/$defs/d3`") && message.contains("required property `a`"), "{message}");
    }
    // The same with a way out (null allowed inside) compiles and runs.
    let d3 = json!({"type": ["object", "null"], "properties": {"a": {"$ref": "#/$defs/d3"}}, "required": ["a"]});
    let ok =
        json!({"$defs": {"d3": d3}, "type": "object", "properties": {"x": {"$ref": "#/$defs/d3"}}, "required": ["x"]});
    walk(compiles(schema(ok)));
}

/// Found by the `grammar_compile` fuzz target (`fuzz/regressions/grammar_compile/`): llguidance
/// compiled this, then its matcher panicked mid-output ("grammar stack empty for non-root
/// grammar"), an internal error at a token; now refused when compiling.
#[test]
fn ignore_beside_a_nested_json_grammar_is_refused_when_compiling() {
    let body =
        "start: r0\nr0: /bab/ r1 r1\nr1: %json {\"type\":\"object\",\"properties\":{\"p0\":{\"type\":\"string\"}},\
                \"required\":[\"p0\"],\"additionalProperties\":false} | \"end\"\n";
    let message = refused(GrammarSpec::Lark(format!("{body}%ignore /[ \\t]+/\n")), "%ignore");
    assert!(message.contains("nested grammar"), "{message}");
    walk(compiles(GrammarSpec::Lark(body.to_string())));
}

/// Found by the `grammar_compile` fuzz target (`fuzz/regressions/grammar_compile/unproductive-
/// rule-after-nested-lark`): a rule that derives only itself, reachable after a nested `%lark`
/// block, compiled and passed the first steps ("end" and the nested "x" can start); after "x" the
/// mask failed with NoExtensionBias, an internal error mid-output. Now refused when compiling,
/// naming the rule, however the rule is written.
#[test]
fn a_rule_that_never_ends_is_refused_when_compiling() {
    let dead_ends = [
        (
            "start: r0\nr0: %lark {\nstart: r0\nr0: \"x\"\nT0: T1 | /[a-z]/\nT1: \"t\"\n} r1 r0 | \"end\"\nr1: r1\n",
            "`r1`",
        ),
        ("start: \"a\" | \"b\" paren\nparen: \"(\" paren \")\"\n", "`paren`"),
        ("start: \"a\" | loop\nloop: \"x\" loop2\nloop2: \"y\" loop\n", "`loop`"),
    ];
    for (lark, rule) in dead_ends {
        let message = refused(GrammarSpec::Lark(lark.to_string()), "never ends");
        assert!(message.contains(rule), "{lark}: {message}");
    }
    // Recursion with a way out, and an optional rule, compile and run.
    for ok in
        ["start: \"a\" | \"b\" paren\nparen: \"(\" paren \")\" | \"x\"\n", "start: \"a\" opt? \"b\"\nopt: \"o\"*\n"]
    {
        walk(compiles(GrammarSpec::Lark(ok.to_string())));
    }
}

/// Found by the `grammar_compile` fuzz target: a chain of rules each of which may end where the
/// next starts (`r{i}: r{i+1} | "end"`) compiles (its first row is small), and after "end" all of
/// them complete at once, past llguidance's 2,000 items per parser row. No check before compiling
/// bounds a row for every grammar, so this failure is the request's: an `Error::Config` naming the
/// limit, not an internal error (a 500 from the server).
#[test]
fn a_parser_row_past_llguidances_limit_mid_output_is_a_config_error() {
    let mut lark = String::from("start: r0\n");
    for i in 0..1200 {
        lark += &format!("r{i}: r{} | \"end\"\n", i + 1);
    }
    lark += "r1200: \"x\"\n";
    let mut constraint = compiles(GrammarSpec::Lark(lark));
    let end = fixture().tokenizer.encode("end", false).expect("tokenize");
    let error = constraint.consume(&end).and_then(|()| constraint.allowed_tokens().map(|_| ()));
    match error {
        Err(Error::Config(message)) => {
            assert!(message.contains("items; max is") && message.contains("simplify"), "{message}")
        }
        other => panic!("expected a config error naming llguidance's row limit, got {:?}", other.map(|_| ())),
    }
    // A matcher that failed keeps failing the same way, never as an internal error.
    assert!(matches!(constraint.allowed_tokens(), Err(Error::Config(_))));
}

/// Found by the `grammar_compile` fuzz target: two greedy terminals back to back, the first of
/// which swallows what the second needs, made llguidance force one `b` after another without end,
/// inside one matcher call (minutes, then for ever). Every call now runs within
/// `MATCHER_CALL_BUDGET`: at the start of the output it is refused when compiling, and behind a
/// choice the request ends with a config error naming the budget. (This test waits the budget
/// twice; the outcome does not depend on the machine's speed, since the call never ends.)
#[test]
fn a_matcher_call_without_end_is_cancelled_at_the_call_budget() {
    let endless = "/b+b+/ /b+b+/";
    let message = refused(GrammarSpec::Lark(format!("start: {endless}\n")), "MATCHER_CALL_BUDGET");
    assert!(message.contains("cannot be followed from the start"), "{message}");

    let mut constraint = compiles(GrammarSpec::Lark(format!("start: \"a\" | \"c\" r0\nr0: {endless}\n")));
    let c = fixture().tokenizer.encode("c", false).expect("tokenize");
    let started = std::time::Instant::now();
    let error = constraint.consume(&c).and_then(|()| constraint.allowed_tokens().map(|_| ()));
    match error {
        Err(Error::Config(message)) => assert!(message.contains("MATCHER_CALL_BUDGET"), "{message}"),
        other => panic!("expected a config error naming the call budget, got {:?}", other.map(|_| ())),
    }
    println!("cancelled after {:?}", started.elapsed());
}

#[test]
fn every_limit_is_listed_once() {
    let names: Vec<&str> = specrs_core::constraint::limits::ALL.iter().map(|(name, _)| *name).collect();
    let mut unique = names.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), names.len());
    assert!(names.contains(&"MAX_SCHEMA_DEPTH") && names.contains(&"MAX_CHOICES"));
}
