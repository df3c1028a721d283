//! Drafts from a model whose tokenizer differs from the target's (`"method": "draft_model"` with
//! such a draft): the draft model continues the context's text in its own tokens, and the text it
//! writes becomes target tokens (transformers' Universal Assisted Decoding, vLLM's token-level
//! intersection).
//!
//! Each step: the context (target ids, without the target's BOS) is decoded to text and encoded
//! with the draft's tokenizer (and its own BOS, if it asks for one); the draft model (its own KV
//! cache over those draft ids, rolled back to what it shares with them) drafts greedily; the draft
//! ids past the context are decoded to the continuation text; and `target_tokens_after` turns that
//! text into the target tokens it fully determines.
//!
//! The boundary rule (`target_tokens_after`): the last `WINDOW` context tokens are encoded again
//! together with the continuation, and the draft exists only if they come back unchanged (the
//! continuation does not merge into the context's last tokens); of the new tokens, the last one and
//! any whitespace-only ones before it are dropped, since text after the continuation could still
//! merge with them (a word that goes on, a run of spaces that splits before the next word).
//!
//! Invariant: the draft is deterministic given the context (greedy in the draft's space, no q
//! rows), so the verifier's one-hot check is exact for greedy and sampled requests alike; a
//! wrong guess at a boundary costs acceptance, never output.

use std::sync::Arc;

use crate::config::SamplingParams;
use crate::error::Result;
use crate::kv_cache::KvBytes;
use crate::model::{CausalLm, LogitRows};
use crate::proposer::draft_model::DraftCache;
use crate::proposer::{Draft, Feedback, Proposer};
use crate::sampler::argmax;
use crate::tokenizer::TextTokenizer;

/// Context tokens encoded again with the continuation to check the boundary between them.
const WINDOW: usize = 4;

/// A draft model with a tokenizer of its own, drafting for the target's.
pub struct CrossTokenizerProposer {
    cache: DraftCache,
    /// Draft positions the cache was allocated for (`begin`).
    capacity: usize,
    target_tokenizer: Arc<TextTokenizer>,
    draft_tokenizer: Arc<TextTokenizer>,
}

impl CrossTokenizerProposer {
    pub fn new(
        draft: Arc<dyn CausalLm>,
        draft_tokenizer: Arc<TextTokenizer>,
        target_tokenizer: Arc<TextTokenizer>,
        max_model_len: Option<usize>,
        kv_bytes: Arc<KvBytes>,
    ) -> Self {
        Self { cache: DraftCache::new(draft, max_model_len, kv_bytes), capacity: 0, target_tokenizer, draft_tokenizer }
    }
}

impl Proposer for CrossTokenizerProposer {
    fn begin(&mut self, prompt: &[u32], params: &SamplingParams) -> Result<()> {
        // Draft tokens per target token vary with the text: the cache holds twice the target's
        // positions (within the draft's max_model_len); a context past it gets no drafts.
        self.capacity = 2 * (prompt.len() + params.max_tokens) + 16;
        self.cache.begin(self.capacity)
    }

    fn propose(&mut self, context: &[u32], max_tokens: usize) -> Result<Draft> {
        if max_tokens == 0 || context.is_empty() {
            return Ok(Draft::default());
        }
        // The draft reads the context's text with its own BOS, not the target's BOS as text.
        let bos = self.target_tokenizer.bos_token_id();
        let body = if bos.is_some() && context.first().copied() == bos { &context[1..] } else { context };
        let text = self.target_tokenizer.decode(body, false)?;
        let draft_context = self.draft_tokenizer.encode(&text, true)?;
        // One draft token past the target's budget: the last target token is dropped.
        let num_draft = max_tokens + 1;
        let needed = draft_context.len() + num_draft - 1;
        if draft_context.is_empty() || needed > self.capacity || !self.cache.fits(needed) {
            return Ok(Draft::default());
        }
        let usable_vocab = self.draft_tokenizer.vocab_size();
        let unseen = self.cache.catch_up(&draft_context);
        let mut logits = self.cache.forward(&draft_context[unseen..], LogitRows::Last)?; // [draft_vocab]
        let mut drafted = Vec::with_capacity(num_draft);
        loop {
            drafted.push(argmax(&logits[..usable_vocab.min(logits.len())]));
            if drafted.len() == num_draft || self.draft_tokenizer.eos_token_ids().contains(drafted.last().unwrap()) {
                break;
            }
            logits = self.cache.forward(&drafted[drafted.len() - 1..], LogitRows::Last)?;
        }
        let Some(continuation) = continuation_text(&self.draft_tokenizer, &draft_context, &drafted)? else {
            return Ok(Draft::default());
        };
        let mut token_ids = target_tokens_after(&self.target_tokenizer, context, &continuation)?;
        token_ids.truncate(max_tokens);
        Ok(Draft::tokens(token_ids))
    }

    fn observe(&mut self, _feedback: &Feedback<'_>) -> Result<()> {
        // The next `propose` encodes the grown context again; the cache keeps what it shares.
        Ok(())
    }

    fn finish(&mut self, _generated: &[u32]) {
        self.cache.release();
    }

    fn kv_len(&self) -> Option<usize> {
        // Positions of the draft's own tokens, not the target's: not comparable with the target's.
        None
    }
}

/// The text `drafted` (draft ids) adds after `draft_context`, without a trailing partial
/// character; None when decoding the whole does not extend the context's own text (a tokenizer
/// whose decoding is not prefix-stable there).
fn continuation_text(tokenizer: &TextTokenizer, draft_context: &[u32], drafted: &[u32]) -> Result<Option<String>> {
    let before = tokenizer.decode(draft_context, false)?;
    let all = tokenizer.decode(&[draft_context, drafted].concat(), false)?;
    let Some(continuation) = all.strip_prefix(&before) else { return Ok(None) };
    // Byte-level tokens can end inside a UTF-8 character, which decodes as U+FFFD.
    Ok(Some(continuation.trim_end_matches('\u{FFFD}').to_string()))
}

/// The target tokens that `continuation` (text) fully determines after `context` (target ids):
/// see the module's boundary rule. Empty when the continuation would change the context's last
/// tokens or determines none.
pub fn target_tokens_after(target: &TextTokenizer, context: &[u32], continuation: &str) -> Result<Vec<u32>> {
    if continuation.is_empty() {
        return Ok(Vec::new());
    }
    let window = WINDOW.min(context.len());
    let cut = context.len() - window;
    let text = target.decode(context, false)?;
    let before = target.decode(&context[..cut], false)?;
    let Some(window_text) = text.strip_prefix(&before) else { return Ok(Vec::new()) };
    let ids = target.encode(&format!("{window_text}{continuation}"), false)?;
    if ids.len() <= window || ids[..window] != context[cut..] {
        return Ok(Vec::new());
    }
    let mut new = ids[window..].to_vec();
    new.pop();
    while let Some(&last) = new.last() {
        let whitespace = target.decode(&[last], false)?.chars().all(char::is_whitespace);
        if !whitespace {
            break;
        }
        new.pop();
    }
    Ok(new)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level BPE tokenizer (GPT-2's alphabet) with merges that cross what a draft would
    /// write: `he`+`llo`, spaces before words, a run of spaces, and a special token.
    fn target() -> TextTokenizer {
        let merges =
            [("h", "e"), ("l", "l"), ("ll", "o"), ("he", "llo"), ("Ġ", "w"), ("Ġw", "o"), ("Ġ", "Ġ"), ("ĠĠ", "Ġ")];
        TextTokenizer::gpt2_style_for_tests(&merges, "<|end|>").unwrap()
    }

    /// The rule's promise: whatever text follows the continuation, plain tokenization of the
    /// whole starts with the context and then the tokens the rule returned.
    fn check(tok: &TextTokenizer, context_text: &str, continuation: &str, futures: &[&str]) -> Vec<u32> {
        let context = tok.encode(context_text, false).unwrap();
        let drafted = target_tokens_after(tok, &context, continuation).unwrap();
        for future in futures {
            let whole = tok.encode(&format!("{context_text}{continuation}{future}"), false).unwrap();
            let expected: Vec<u32> = context.iter().chain(&drafted).copied().collect();
            assert!(
                whole.starts_with(&expected),
                "context {context_text:?} + {continuation:?} + {future:?}: plain tokens {whole:?} do not start with \
                 the context's {context:?} and the draft's {drafted:?}"
            );
        }
        drafted
    }

    #[test]
    fn tokens_the_text_determines_are_drafted_and_the_open_end_is_not() {
        let tok = target();
        // " hello wo": "he"+"llo" merge inside the continuation; " wo" may go on (" world").
        let drafted = check(&tok, "say", " hello wo", &["", "rld", "o", " ", "!"]);
        assert_eq!(tok.decode(&drafted, false).unwrap(), " hello", "{drafted:?}");
    }

    #[test]
    fn a_continuation_that_merges_into_the_context_is_not_drafted() {
        let tok = target();
        // The context ends in "he"; "llo" would merge with it into one token "hello".
        let context = tok.encode("he", false).unwrap();
        assert_eq!(target_tokens_after(&tok, &context, "llo there").unwrap(), Vec::<u32>::new());
        // Past the window the context's tokens are left alone: a draft after "he" + " x".
        let drafted = check(&tok, "he x", " hello wo", &["", "rld"]);
        assert_eq!(tok.decode(&drafted, false).unwrap(), " hello");
    }

    #[test]
    fn runs_of_spaces_and_partial_characters_stay_undrafted_until_determined() {
        let tok = target();
        // Three spaces then a word: "ĠĠĠ" may split before the word as "ĠĠ" + "Ġw...".
        let drafted = check(&tok, "a", "b   ", &["", "wo", "x", "   "]);
        assert!(tok.decode(&drafted, false).unwrap().trim().len() <= 1, "{drafted:?}");
        // A multi-byte character written in full, then one cut short (the draft decoder's U+FFFD
        // is trimmed before this rule sees it).
        check(&tok, "x", "é, ñ", &["", "ñ", " hello"]);
    }

    #[test]
    fn special_token_text_becomes_the_special_token() {
        let tok = target();
        let drafted = check(&tok, "hello", " wo<|end|>he", &["", "llo"]);
        assert!(drafted.contains(&(tok.vocab_size() as u32 - 1)), "{drafted:?}");
    }
}
