//! The grammar compile path (`ConstraintCompiler::compile`: the limits, then llguidance on the
//! compile thread) on structure-aware grammars (`specrs_fuzz::grammar_gen`), chosen by the first
//! byte: a JSON schema document with `$defs` chains, a Lark grammar with rule chains, a regex, a
//! choice, or (raw) the rest of the input as a JSON `GrammarSpec`, Lark text or regex text.
//!
//! Properties:
//! - no panic escapes and no stack overflows: each compile runs on a quarter of the compile
//!   thread's stack (`COMPILE_STACK_BYTES / 4`), so an input that passes the limits but needs more
//!   than that is a crash here, not just one that needs more than all of it;
//! - every refusal is an `Error::Config`;
//! - what compiles also runs: up to `WALK_TOKENS` tokens (the forced ones, else one the input
//!   picks from the mask) without an error ("whatever the check accepts must not fail later"),
//!   but for a stop on llguidance's limits on a grammar's work (items per parser row, work per
//!   token) or a mask llguidance could not decide exactly (it allowed a token its parser then
//!   refused: regexes past its lexer's exact reach), which no check before compiling bounds for
//!   every grammar: that must be the request's `Error::Config` naming the cause, never an
//!   internal error or a "token not allowed" blamed on the caller.
//!
//! The tokenizer is a small byte-level BPE (every byte, some JSON and repetition merges, EOS)
//! built at startup, so a mask costs microseconds and the target runs thousands of inputs a
//! second; it goes through the same `TextTokenizer` and token environment as a model's. Matcher
//! calls are armed with a 1 s time budget instead of `MATCHER_CALL_BUDGET`'s 10 s (the memory
//! budget is the product's).
#![no_main]

use std::sync::OnceLock;

use arbitrary::Unstructured;
use libfuzzer_sys::fuzz_target;
use serde_json::json;
use specrs_core::constraint::limits::COMPILE_STACK_BYTES;
use specrs_core::constraint::{ConstraintCompiler, GrammarSpec};
use specrs_core::tokenizer::TextTokenizer;
use specrs_core::Error;
use specrs_fuzz::grammar_gen;

/// Tokens walked after a successful compile.
const WALK_TOKENS: usize = 6;

/// A byte-level BPE tokenizer: the 256 bytes, merges for pieces grammars force (`{"`, `": `,
/// runs of `a`), and an EOS.
fn compiler() -> &'static ConstraintCompiler {
    static COMPILER: OnceLock<ConstraintCompiler> = OnceLock::new();
    COMPILER.get_or_init(|| {
        let merges = [
            ("{", "\""),
            ("\"", ":"),
            ("\":", "Ġ"),
            (",", "Ġ"),
            (",Ġ", "\""),
            ("\"", "}"),
            ("a", "a"),
            ("aa", "aa"),
            ("aaaa", "aaaa"),
            ("0", "0"),
            ("1", "2"),
            ("t", "r"),
            ("tr", "u"),
            ("tru", "e"),
            ("n", "u"),
            ("nu", "l"),
            ("nul", "l"),
            ("x", "x"),
            ("[", "\""),
            ("\"", "]"),
        ];
        let tokenizer = TextTokenizer::gpt2_style_for_tests(&merges, "<|endoftext|>").expect("the fuzz tokenizer");
        // A second per matcher call instead of ten: an input that forces bytes for ever (a
        // `ConfigError` naming the budget either way) costs a tenth of the time.
        specrs_core::constraint::set_matcher_call_budget_for_fuzzing(std::time::Duration::from_secs(1));
        ConstraintCompiler::new(&tokenizer).expect("a compiler for the fuzz tokenizer")
    })
}

/// The spec the input describes; `None` when it describes none (e.g. raw JSON that is no spec).
fn spec(mode: u8, rest: &[u8]) -> Option<GrammarSpec> {
    let mut u = Unstructured::new(rest);
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    let from_json = |value: serde_json::Value| match GrammarSpec::from_json(&value) {
        Ok(spec) => Some(spec),
        Err(Error::Config(_)) => None,
        Err(other) => panic!("GrammarSpec::from_json refused {value} with a non-config error: {other:?}"),
    };
    match mode % 8 {
        0 | 1 => grammar_gen::schema_document(&mut u).ok().and_then(|schema| from_json(json!({"json_schema": schema}))),
        2 | 3 => grammar_gen::lark(&mut u, 0).ok().map(GrammarSpec::Lark),
        4 => grammar_gen::regex(&mut u, 0).ok().map(GrammarSpec::Regex),
        5 => grammar_gen::choice(&mut u).ok().map(GrammarSpec::Choice),
        6 => serde_json::from_slice(rest).ok().and_then(from_json),
        _ => {
            let (&which, rest) = rest.split_first()?;
            Some(if which % 2 == 0 { GrammarSpec::Lark(text(rest)) } else { GrammarSpec::Regex(text(rest)) })
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let Some(spec) = spec(mode, rest) else { return };
    if std::env::var_os("SPECRS_FUZZ_PRINT").is_some() {
        eprintln!("{spec:?}"); // replaying one input: what it describes
    }
    let kind = spec.kind();
    let mut constraint = match compiler().compile_with_stack(&spec, COMPILE_STACK_BYTES / 4) {
        Ok(constraint) => constraint,
        Err(Error::Config(_)) => return,
        Err(other) => panic!("the {kind} was refused with a non-config error: {other:?}\n{spec:?}"),
    };
    // Walk: the forced tokens, else one the input's last bytes pick from the mask. The one error
    // allowed on the way is a stop on llguidance's own limits on the grammar's work (a 400 naming
    // it, which no check before compiling can rule out for every grammar).
    let mut picks = data.iter().rev();
    let mut taken = 0;
    while taken < WALK_TOKENS && !constraint.is_finished() {
        let forced = constraint.forced_tokens();
        let step = if forced.is_empty() {
            match constraint.allowed_tokens() {
                Ok(allowed) => {
                    let ids = allowed.token_ids();
                    vec![ids[usize::from(*picks.next().unwrap_or(&0)) % ids.len()]]
                }
                Err(e) if past_a_parser_limit(&e) => return,
                Err(e) => panic!("the {kind} compiled, then: {e}\n{spec:?}"),
            }
        } else {
            forced
        };
        match constraint.consume(&step) {
            Ok(()) => {}
            Err(e) if past_a_parser_limit(&e) => return,
            Err(e) => panic!("the {kind} compiled, then consuming {step:?}: {e}\n{spec:?}"),
        }
        taken += step.len();
    }
});

/// The request's error for a grammar that went past one of llguidance's limits mid-output, or
/// whose token mask llguidance could not compute exactly (it allowed a token its parser refuses).
fn past_a_parser_limit(error: &Error) -> bool {
    matches!(error, Error::Config(message) if message.contains("went past a limit of llguidance's parser")
        || message.contains("is past what llguidance's parser decides exactly"))
}
