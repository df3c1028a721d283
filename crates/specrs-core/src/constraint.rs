//! Constrained decoding: a request's output must belong to the language of a `GrammarSpec`
//! (JSON schema, JSON object, regex, Lark grammar, or a fixed choice), enforced by llguidance.
//!
//! A `ConstraintCompiler` is built once per tokenizer (it holds llguidance's token trie and
//! parser factory); `compile` turns one request's `GrammarSpec` into a `Constraint`, the request's
//! own matcher state. Speculative decoding uses a `Constraint` as: mask the logits of the next
//! position (`apply_to_logits` / `allowed_tokens`), cut a draft to the prefix the grammar allows
//! (`valid_prefix_len`, no state change), `consume` the tokens the target kept, `rollback` the ones
//! it took back, and splice in what the grammar forces anyway (`forced_tokens`). An engine keeps
//! the grammars it compiled (`cache`) and hands each request a copy, so a grammar asked for again
//! is not compiled again.
//!
//! Compiling runs on a thread of its own with a stack sized for the limits the input was measured
//! against first (`limits`), since llguidance's compilers recurse on the input's shape; and it
//! takes the matcher's first steps, so limits llguidance applies lazily fire there.
//!
//! Invariants:
//! - `compile` refuses input past a limit, a grammar llguidance cannot compile, one whose output
//!   can reach a rule that never ends (`productive`), and one whose first steps fail (the first mask, the tokens forced at the start, the mask after them) with
//!   an `Error::Config`; it never overflows a stack.
//! - Every matcher call runs within `MATCHER_CALL_BUDGET` of time (`deadline`) and keeps at most
//!   `MATCHER_CALL_MEMORY` of memory (`call_memory`), so no grammar holds the engine's step for
//!   longer or takes the server's memory.
//! - Mid-output, a matcher that stops on one of llguidance's limits on a grammar's work (items
//!   per parser row, work per token, the call budget: no check before compiling bounds them for
//!   every grammar) is an `Error::Config` naming the limit, the request's error; any other
//!   matcher failure is `Error::Internal`.
//! - The matcher's state is always that after exactly the tokens consumed and not rolled back.
//!   A failed `consume` or `rollback` changes nothing, so a bad call never poisons the request.
//! - `consume(t)` succeeds exactly when `valid_prefix_len(t) == t.len()`, and every token of
//!   `allowed_tokens()` passes `valid_prefix_len` alone.
//! - An EOS token ends the output: no token after an EOS is valid. Once the grammar has ended
//!   (`is_finished`), the mask allows EOS and nothing else.
//! - Token ids at or past the tokenizer's vocabulary (padding rows of a model's logits) are never
//!   allowed.

pub mod cache;
pub(crate) mod call_memory;
mod deadline;
pub mod grammar_spec;
pub mod limits;
mod productive;
mod token_env;

pub use cache::{GrammarCache, GrammarSource};
pub use call_memory::MATCHER_CALL_MEMORY;
pub use deadline::{set_matcher_call_budget_for_fuzzing, MATCHER_CALL_BUDGET};
pub use grammar_spec::{GrammarSpec, GRAMMAR_SPEC_KEYS};

use llguidance::api::StopReason;
use llguidance::toktrie::{SimpleVob, TokEnv};
use llguidance::{Matcher, ParserFactory};

use crate::error::{catch_panic, panic_error, Error, Result};
use crate::tokenizer::TextTokenizer;

/// Compiles grammars for one tokenizer. Build it once per model and share it: building it walks
/// the whole vocabulary; `compile` does not.
pub struct ConstraintCompiler {
    factory: ParserFactory,
}

impl ConstraintCompiler {
    /// The compiler for `tokenizer`'s vocabulary and EOS ids. Fails (`Error::Config`) for a
    /// tokenizer whose token bytes cannot be known or that has no EOS token.
    pub fn new(tokenizer: &TextTokenizer) -> Result<Self> {
        let tok_env = token_env::token_env(tokenizer)?;
        let mut factory = catch_panic(|| ParserFactory::new_simple(&tok_env))
            .map_err(|panic| Error::Internal(format!("building the grammar parser factory panicked: {panic}")))?
            .map_err(|e| Error::Internal(format!("building the grammar parser factory: {e:#}")))?;
        // llguidance would print grammar warnings on stderr; a server reports errors, not noise.
        factory.quiet();
        Ok(Self { factory })
    }

    /// Number of token ids the compiled constraints know: the tokenizer's vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.factory.tok_env().tok_trie().vocab_size()
    }

    /// One request's constraint, at the start of the output. Input past a limit (`limits`), a
    /// malformed schema, regex or grammar (llguidance's own message), and one the matcher cannot
    /// start on are an `Error::Config`.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Constraint> {
        self.compile_with_stack(spec, limits::COMPILE_STACK_BYTES)
    }

    /// `compile` on a compile thread of `stack_bytes` of stack. For the tests and the fuzz target
    /// that show what passes the limits compiles within a fraction of `COMPILE_STACK_BYTES`.
    #[doc(hidden)]
    pub fn compile_with_stack(&self, spec: &GrammarSpec, stack_bytes: usize) -> Result<Constraint> {
        limits::check(spec)?;
        std::thread::scope(|scope| {
            let worker = std::thread::Builder::new()
                .name("specrs-grammar-compile".into())
                .stack_size(stack_bytes)
                .spawn_scoped(scope, || self.compile_here(spec))
                .map_err(|e| {
                    Error::Internal(format!("starting the grammar compile thread ({stack_bytes} bytes of stack): {e}"))
                })?;
            worker.join().unwrap_or_else(|panic| {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned());
                Err(panic_error(&format!("compiling the {} panicked: {}", spec.kind(), message.unwrap_or_default())))
            })
        })
    }

    /// The compile itself, on the compile thread.
    fn compile_here(&self, spec: &GrammarSpec) -> Result<Constraint> {
        let kind = spec.kind();
        let invalid = |message: String| {
            Error::config(format!("invalid {kind} for constrained decoding: {message}; fix the {kind} and resend"))
        };
        let grammar = spec.to_llguidance()?;
        // A grammar that makes llguidance panic is still the request's: a 400 naming it, not a 500.
        let parser = catch_panic(|| self.factory.create_parser(grammar))
            .map_err(|panic| invalid(format!("llguidance failed on it ({panic})")))?
            .map_err(|e| invalid(format!("{e:#}")))?;
        productive::check(parser.parser.grammar(), kind)?;
        let matcher = Matcher::new(Ok(parser)).into_cancellable();
        if let Some(message) = matcher.get_error() {
            return Err(invalid(message));
        }
        first_steps(&matcher).map_err(|message| {
            Error::config(format!(
                "the {kind} cannot be followed from the start of the output: llguidance stops with \"{message}\"{}; \
                 fix the {kind} and resend",
                why_the_matcher_stops(&message)
            ))
        })?;
        Ok(Constraint {
            matcher,
            tok_env: self.factory.tok_env().clone(),
            kind,
            consumed: 0,
            eos_after_end: false,
            last_mask: None,
        })
    }
}

/// Some of llguidance's limits (work per token, items per parser row) and an empty language show
/// only when the matcher runs. On a copy of `matcher`: the first mask, the tokens the grammar
/// forces at the start, and the mask after them.
fn first_steps(matcher: &Matcher) -> std::result::Result<(), String> {
    let mut probe = matcher.deep_clone();
    fn failed(probe: &Matcher, e: impl std::fmt::Display) -> String {
        probe.get_error().unwrap_or_else(|| format!("{e:#}"))
    }
    if probe.is_stopped() {
        return Ok(());
    }
    armed(&mut probe, |m| m.compute_mask()).map_err(|e| failed(&probe, e))?;
    let forced = armed(&mut probe, |m| m.compute_ff_tokens());
    if let Some(message) = probe.get_error() {
        return Err(message);
    }
    if !forced.is_empty() {
        armed(&mut probe, |m| m.consume_tokens(&forced)).map_err(|e| failed(&probe, e))?;
        if !probe.is_stopped() {
            armed(&mut probe, |m| m.compute_mask()).map_err(|e| failed(&probe, e))?;
        }
    }
    Ok(())
}

/// Runs `call` on `matcher` armed with the call budget (`deadline`): past it, the matcher is
/// cancelled and stays so.
fn armed<T>(matcher: &mut Matcher, call: impl FnOnce(&mut Matcher) -> T) -> T {
    let _armed = matcher.cancellation_handle().map(|handle| (deadline::arm(handle.clone()), call_memory::arm(handle)));
    call(matcher)
}

/// llguidance's error once a matcher call was cancelled: by `deadline`'s watchdog, or by
/// `call_memory`'s count.
const CANCELLED: &str = "operation cancelled";
/// llguidance's panic on `%ignore` beside a nested grammar, which the Lark check refuses up front
/// (`limits/lark.rs`); kept as the grammar's error should a shape slip past it.
const IGNORE_BESIDE_NESTED: &str = "grammar stack empty for non-root grammar";

/// Whether llguidance's matcher stopped on one of its own limits on a grammar's work (items per
/// parser row, work per token, forced tokens, a dead end), which no check before compiling can
/// bound in general (an ambiguous grammar's rows grow with the output): the request's grammar is
/// the cause, not the engine.
fn is_grammar_limit(message: &str) -> bool {
    [
        "ParserTooComplex",
        "LexerTooComplex",
        "NoExtensionBias",
        "items; max is",
        "Too many items",
        "too many expressions",
        "fuel",
        CANCELLED,
        IGNORE_BESIDE_NESTED,
    ]
    .iter()
    .any(|marker| message.contains(marker))
}

/// A hint at the usual cause of a matcher's stop, from llguidance's message.
fn why_the_matcher_stops(message: &str) -> String {
    if message.contains(CANCELLED) {
        return format!(
            " (one step of it ran past the matcher's budget per call, MATCHER_CALL_BUDGET = {} s of time or \
             MATCHER_CALL_MEMORY = {} MiB of memory: e.g. two greedy terminals back to back, the first of which \
             swallows what the second needs, like `/b+/ /b+/`)",
            MATCHER_CALL_BUDGET.as_secs(),
            MATCHER_CALL_MEMORY >> 20
        );
    }
    if message.contains(IGNORE_BESIDE_NESTED) {
        " (llguidance fails on %ignore beside a nested grammar: drop the %ignore)"
    } else if message.contains("NoExtensionBias") {
        " (it allows no output: e.g. a $ref cycle with nothing in between, or a schema made only of itself)"
    } else if message.contains("items; max is") {
        " (more rules are open at once than llguidance's parser keeps in one row: e.g. a rule with thousands of \
         alternatives, or a long chain of rules each of which may end where the next one does; group alternatives \
         into fewer rules, use one regex, or shorten the chain)"
    } else if ["Too many items", "too many expressions", "fuel"].iter().any(|m| message.contains(m)) {
        " (a token needs more work than the matcher allows per token: e.g. a required property that contains \
         itself, or a very long forced repetition)"
    } else {
        ""
    }
    .to_string()
}

/// The set of token ids a constraint allows at one position. Shape: one bit per id of the
/// tokenizer's vocabulary; ids past it are never allowed.
pub struct TokenMask {
    allowed: SimpleVob,
}

/// Whether `mask` allows `token` (an id past it is not allowed).
fn mask_allows(mask: &SimpleVob, token: u32) -> bool {
    (token as usize) < mask.len() && mask.is_allowed(token)
}

impl TokenMask {
    pub fn contains(&self, token: u32) -> bool {
        mask_allows(&self.allowed, token)
    }

    /// Number of allowed ids.
    pub fn count(&self) -> usize {
        self.allowed.num_set()
    }

    /// The allowed ids, ascending.
    pub fn token_ids(&self) -> Vec<u32> {
        self.allowed.to_list()
    }

    /// Sets every forbidden entry of `logits` (`[n]`, n >= or < the vocabulary size) to -inf,
    /// leaving the allowed ones untouched.
    pub fn apply_to_logits(&self, logits: &mut [f32]) {
        const BITS: usize = 32; // SimpleVob's word size
        let in_vocab = logits.len().min(self.allowed.len());
        let (known, past_vocab) = logits.split_at_mut(in_vocab);
        past_vocab.fill(f32::NEG_INFINITY);
        for (chunk, &bits) in known.chunks_mut(BITS).zip(self.allowed.as_slice()) {
            if bits == u32::MAX {
                continue;
            }
            for (bit, logit) in chunk.iter_mut().enumerate() {
                if bits & (1 << bit) == 0 {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
    }
}

/// One request's position in its grammar (see the module invariants).
pub struct Constraint {
    matcher: Matcher,
    tok_env: TokEnv,
    /// `GrammarSpec::kind`, for error messages.
    kind: &'static str,
    /// Tokens the matcher holds: consumed and not rolled back.
    consumed: usize,
    /// An EOS consumed after the grammar had already ended. llguidance takes no token once its
    /// grammar can go no further, so this one is held here, where `rollback` can undo it.
    eos_after_end: bool,
    /// The mask `allowed_tokens` last gave at the current position (None once the position
    /// moved), so `consume` can tell a token the mask allowed from one the caller made up.
    last_mask: Option<SimpleVob>,
}

// The engine moves sessions, and so their constraints, across threads; one compiler serves all.
const _: () = {
    const fn send<T: Send>() {}
    const fn send_sync<T: Send + Sync>() {}
    send::<Constraint>();
    send_sync::<ConstraintCompiler>();
};

impl Constraint {
    /// An independent copy of a constraint nothing has run on yet (`cache`'s entries): its own
    /// parser, lexer caches and cancellation state (llguidance's `deep_clone`; a plain clone
    /// would share the lexer's state with the original), so what runs on the copy never reaches
    /// the original or another copy.
    fn copy_at_start(&self) -> Self {
        debug_assert!(self.consumed == 0 && !self.eos_after_end, "only a constraint at its start is copied");
        Self {
            matcher: self.matcher.deep_clone(),
            tok_env: self.tok_env.clone(),
            kind: self.kind,
            consumed: 0,
            eos_after_end: false,
            last_mask: None,
        }
    }

    /// Number of token ids the masks cover: the tokenizer's vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.tok_env.tok_trie().vocab_size()
    }

    /// The tokens the grammar allows at the next position. Never empty: once the grammar has
    /// ended (or an EOS was consumed), that is the EOS ids.
    pub fn allowed_tokens(&mut self) -> Result<TokenMask> {
        self.check_healthy()?;
        let allowed = if self.is_finished() {
            self.tok_env.tok_trie().eos_token_set()
        } else {
            armed(&mut self.matcher, |m| m.compute_mask()).map_err(|e| self.failed("computing the token mask", e))?
        };
        self.last_mask = Some(allowed.clone());
        Ok(TokenMask { allowed })
    }

    /// Sets the logits of the tokens the grammar forbids at the next position to -inf.
    /// `logits`: `[n]`, the model's row for that position; entries at or past the tokenizer's
    /// vocabulary size (a model's padding rows) are always forbidden.
    pub fn apply_to_logits(&mut self, logits: &mut [f32]) -> Result<()> {
        self.allowed_tokens()?.apply_to_logits(logits);
        Ok(())
    }

    /// How many leading tokens of `draft` the grammar allows from the current state, without
    /// changing it: the longest prefix `consume` would take. A prefix ends at its first EOS (an
    /// EOS is valid only where the grammar may end). 0 when the matcher has failed.
    pub fn valid_prefix_len(&mut self, draft: &[u32]) -> usize {
        // A draft the matcher could not check has no valid token; the matcher's error, if it
        // keeps one, fails the next consume.
        self.checked_prefix_len(draft).unwrap_or(0)
    }

    /// `valid_prefix_len`, with the matcher's failure as the error `failed` names (a grammar
    /// limit is the grammar's 400, not "token not allowed").
    fn checked_prefix_len(&mut self, draft: &[u32]) -> Result<usize> {
        if self.eos_consumed() || self.matcher.is_error() {
            return Ok(0);
        }
        if self.matcher.is_stopped() {
            // The grammar ended without an EOS: exactly one EOS may follow.
            return Ok(usize::from(draft.first().is_some_and(|&t| self.is_eos(t))));
        }
        // llguidance treats an id past its vocabulary as a fatal error; such an id is just invalid.
        let in_vocab = draft.iter().position(|&t| t as usize >= self.vocab_size()).unwrap_or(draft.len());
        let valid = armed(&mut self.matcher, |m| m.validate_tokens(&draft[..in_vocab]))
            .map_err(|e| self.failed("checking tokens before consuming them", e))?;
        Ok(valid.min(in_vocab))
    }

    /// Advances the grammar over `tokens` (the tokens the output kept). Fails, changing nothing,
    /// when the grammar does not allow all of them (`Error::Config` naming the first one).
    pub fn consume(&mut self, tokens: &[u32]) -> Result<()> {
        self.check_healthy()?;
        if tokens.is_empty() {
            return Ok(());
        }
        let valid = self.checked_prefix_len(tokens)?;
        if valid < tokens.len() {
            let why = if self.eos_consumed() || (valid > 0 && self.is_eos(tokens[valid - 1])) {
                "the output already ended with an EOS token"
            } else if self.is_finished() {
                "the grammar is complete and only an EOS token may follow"
            } else if valid == 0 && self.last_mask.as_ref().is_some_and(|mask| mask_allows(mask, tokens[0])) {
                // llguidance's mask over-approximates where its lexer gives up deciding a regex
                // exactly (a large or deeply nested pattern): it allowed this token, its parser
                // refuses it. The grammar is the cause, so it is the grammar's 400.
                return Err(Error::config(format!(
                    "the {} is past what llguidance's parser decides exactly: its token mask allowed token {} \
                     here and its parser then refused it (typically a large or deeply nested regex pattern); \
                     simplify the {} and resend",
                    self.kind, tokens[0], self.kind
                )));
            } else {
                "the grammar does not allow it there"
            };
            return Err(Error::config(format!(
                "token {} (index {valid} of the {} tokens to consume) breaks the {}: {why}; consume only tokens \
                 from allowed_tokens() or the first valid_prefix_len() tokens of a draft",
                tokens[valid],
                tokens.len(),
                self.kind
            )));
        }
        self.last_mask = None;
        if self.matcher.is_stopped() {
            // valid_prefix_len allowed exactly one EOS after the grammar's end.
            self.eos_after_end = true;
            return Ok(());
        }
        armed(&mut self.matcher, |m| m.consume_tokens(tokens))
            .map_err(|e| self.failed("consuming tokens it had validated", e))?;
        self.consumed += tokens.len();
        Ok(())
    }

    /// Undoes the last `n` consumed tokens (the draft tokens the target rejected). Fails, changing
    /// nothing, when fewer than `n` tokens are held.
    pub fn rollback(&mut self, n: usize) -> Result<()> {
        self.check_healthy()?;
        let held = self.consumed + usize::from(self.eos_after_end);
        if n > held {
            return Err(Error::config(format!(
                "cannot roll back {n} tokens: the {} constraint holds only the {held} tokens consumed since it \
                 was compiled",
                self.kind
            )));
        }
        self.last_mask = None;
        let from_matcher = n - usize::from(self.eos_after_end && n > 0);
        if from_matcher > 0 {
            armed(&mut self.matcher, |m| m.rollback(from_matcher)).map_err(|e| self.failed("rolling back", e))?;
            self.consumed -= from_matcher;
        }
        if n > 0 {
            self.eos_after_end = false;
        }
        Ok(())
    }

    /// The tokens the grammar forces next, whatever the model says (e.g. `{"` opening a JSON
    /// object), in the tokenizer's canonical tokenization; consuming them is always valid. Empty
    /// when nothing is forced, when the grammar has ended, or when the matcher has failed.
    pub fn forced_tokens(&mut self) -> Vec<u32> {
        if self.matcher.is_stopped() {
            return Vec::new();
        }
        armed(&mut self.matcher, |m| m.compute_ff_tokens())
    }

    /// Whether the output is complete: the grammar has ended (it accepts and no token but EOS may
    /// follow), or an EOS was consumed where the grammar accepts.
    pub fn is_finished(&self) -> bool {
        self.eos_after_end || (self.matcher.is_stopped() && self.matcher.stop_reason().is_ok())
    }

    fn eos_consumed(&self) -> bool {
        self.eos_after_end || self.matcher.stop_reason() == StopReason::EndOfSentence
    }

    fn is_eos(&self, token: u32) -> bool {
        self.tok_env.tok_trie().eos_tokens().contains(&token)
    }

    /// llguidance's matcher keeps its first error and fails every later call.
    fn check_healthy(&self) -> Result<()> {
        match self.matcher.get_error() {
            Some(_) => Err(self.failed("a step before this one", "")),
            None => Ok(()),
        }
    }

    /// The error for a matcher call that failed while `doing`: the grammar's (`Error::Config`,
    /// a 400 from the server) when llguidance stopped on one of its limits on the grammar's work
    /// (`is_grammar_limit`), the engine's (`Error::Internal`) otherwise.
    fn failed(&self, doing: &str, error: impl std::fmt::Display) -> Error {
        let kind = self.kind;
        let message = self.matcher.get_error().unwrap_or_else(|| format!("{error:#}"));
        if is_grammar_limit(&message) {
            Error::config(format!(
                "the {kind} went past a limit of llguidance's parser after {} output tokens: \"{message}\"{}; \
                 simplify the {kind} and resend",
                self.consumed,
                why_the_matcher_stops(&message)
            ))
        } else {
            Error::Internal(format!("the {kind} matcher failed ({doing}): {message}"))
        }
    }
}
