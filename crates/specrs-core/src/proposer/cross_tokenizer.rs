//! Drafts from a model whose tokenizer differs from the target's (`"method": "draft_model"` with
//! such a draft): the draft model continues the context's text in its own tokens, and the text it
//! writes becomes target tokens (transformers' Universal Assisted Decoding, vLLM's token-level
//! intersection).
//!
//! Each step: the context (target ids, without the target's BOS) becomes draft ids of its text
//! (`DraftEncoding`: the draft's encoding of the text, with its own BOS if it asks for one); the
//! draft model (its own KV cache over those draft ids, rolled back to what it shares with them)
//! drafts greedily; the draft ids past the context are decoded to the continuation text; and
//! `target_tokens_after` turns that text into the target tokens it fully determines.
//!
//! Cost per step is O(new tokens), not O(context): `DraftEncoding` keeps the text and its draft
//! ids across steps, decodes only the new target tokens and encodes again only the last few draft
//! tokens' text with them; every decode reads a few tokens before the ones it needs
//! (`LOOKBEHIND`). Where that would not give what encoding the whole text gives (a merge reaching
//! further back, a decoding that is not prefix-stable), it encodes the whole text instead.
//!
//! The boundary rule (`target_tokens_after`): the last `WINDOW` context tokens are encoded again
//! together with the continuation, and the draft exists only if they come back unchanged (the
//! continuation does not merge into the context's last tokens); of the new tokens, the last one and
//! any whitespace-only ones before it are dropped, since text after the continuation could still
//! merge with them (a word that goes on, a run of spaces that splits before the next word).
//!
//! Invariant: the draft is deterministic given the request's contexts so far (greedy in the
//! draft's space, no q rows), so the verifier's one-hot check is exact for greedy and sampled
//! requests alike; a wrong guess at a boundary costs acceptance, never output.

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
/// Tokens decoded before the ones whose text is wanted: a decoder may treat the first token it
/// sees differently (SentencePiece strips its leading space), so the text of a token is read
/// after a few others, as in the whole text.
const LOOKBEHIND: usize = 4;
/// Draft tokens at the end of the context's draft ids encoded again with the new text (a merge
/// across the old end reaches back this far at most before the whole text is encoded again).
const DRAFT_TAIL: usize = 8;
/// Of those, the first ones must come back unchanged for the tail's encoding to be kept.
const DRAFT_OVERLAP: usize = 2;

/// A draft model with a tokenizer of its own, drafting for the target's.
pub struct CrossTokenizerProposer {
    cache: DraftCache,
    /// Draft positions the cache was allocated for (`begin`).
    capacity: usize,
    target_tokenizer: Arc<TextTokenizer>,
    draft_tokenizer: Arc<TextTokenizer>,
    encoding: DraftEncoding,
}

/// The draft's tokens for a request's context (target ids), kept across its steps so a step
/// decodes and encodes only around what is new. Invariant: `draft_ids` is the draft's encoding of
/// `text`, the target's decoding of `target_ids` (each as of the step that wrote it: a later merge
/// further back than `DRAFT_TAIL` draft tokens is not redone, which costs acceptance only).
pub struct DraftEncoding {
    target: Arc<TextTokenizer>,
    draft: Arc<TextTokenizer>,
    /// Target ids (without the target's BOS) whose text is `text`.
    target_ids: Vec<u32>,
    text: String,
    /// The draft's ids of `text`, its BOS first when it asks for one.
    draft_ids: Vec<u32>,
    /// Each draft id's first byte in `text` (0 for the BOS).
    draft_starts: Vec<usize>,
    /// Leading draft ids that are not text (the draft's BOS).
    num_bos: usize,
    /// How many times the whole text was decoded and encoded (the first step, and each fallback).
    num_whole_encodes: usize,
}

impl DraftEncoding {
    pub fn new(target: Arc<TextTokenizer>, draft: Arc<TextTokenizer>) -> Self {
        Self {
            target,
            draft,
            target_ids: Vec::new(),
            text: String::new(),
            draft_ids: Vec::new(),
            draft_starts: Vec::new(),
            num_bos: 0,
            num_whole_encodes: 0,
        }
    }

    /// Forgets the previous request's context.
    pub fn reset(&mut self) {
        self.target_ids.clear();
        self.text.clear();
        self.draft_ids.clear();
        self.draft_starts.clear();
    }

    pub fn num_whole_encodes(&self) -> usize {
        self.num_whole_encodes
    }

    /// The draft's ids of `body`'s text (`body`: target ids without the target's BOS): what
    /// `encode_whole` gives, computed from what the previous call kept when `body` extends it.
    pub fn update(&mut self, body: &[u32]) -> Result<Vec<u32>> {
        if let Some(ids) = self.extend(body)? {
            return Ok(ids);
        }
        self.num_whole_encodes += 1;
        let text = self.target.decode(body, false)?;
        let (ids, starts) = self.draft.encode_with_starts(&text)?;
        let with_bos = self.draft.with_bos(ids);
        self.num_bos = with_bos.len() - starts.len();
        self.draft_starts = std::iter::repeat_n(0, self.num_bos).chain(starts).collect();
        self.draft_ids = with_bos;
        self.target_ids = body.to_vec();
        self.text = text;
        Ok(self.draft_ids.clone())
    }

    /// `update` from the kept state: None where it must encode the whole text (`body` does not
    /// extend what is kept, the decoding is not prefix-stable there, or the tail's encoding does
    /// not start with the kept tokens it overlaps).
    fn extend(&mut self, body: &[u32]) -> Result<Option<Vec<u32>>> {
        let known = self.target_ids.len();
        if known == 0 || !body.starts_with(&self.target_ids) {
            return Ok(None);
        }
        if body.len() == known {
            return Ok(Some(self.draft_ids.clone()));
        }
        let Some(new_text) = text_after(&self.target, body, known)? else { return Ok(None) };
        // Encode again from a draft token that starts a character of its own (byte-fallback
        // tokens of one character share its start), DRAFT_TAIL tokens back.
        let mut from = self.draft_ids.len().saturating_sub(DRAFT_TAIL);
        while from > self.num_bos && self.draft_starts[from] == self.draft_starts[from - 1] {
            from -= 1;
        }
        let overlap = (from + DRAFT_OVERLAP).min(self.draft_ids.len());
        if from <= self.num_bos || overlap == self.draft_ids.len() {
            return Ok(None);
        }
        let start = self.draft_starts[from];
        if !self.text.is_char_boundary(start) {
            return Ok(None);
        }
        let tail = format!("{}{new_text}", &self.text[start..]);
        let (tail_ids, tail_starts) = self.draft.encode_with_starts(&tail)?;
        if !tail_ids.starts_with(&self.draft_ids[from..overlap]) {
            return Ok(None);
        }
        let mut draft_ids = self.draft_ids[..from].to_vec();
        draft_ids.extend(&tail_ids);
        // A text ending inside a character (U+FFFD) is read again once the character is whole.
        if !new_text.ends_with('\u{FFFD}') {
            self.draft_ids.clone_from(&draft_ids);
            self.draft_starts.truncate(from);
            self.draft_starts.extend(tail_starts.iter().map(|s| start + s));
            self.target_ids.extend_from_slice(&body[known..]);
            self.text.push_str(&new_text);
        }
        Ok(Some(draft_ids))
    }
}

/// The draft's ids of `body`'s text encoded whole, each step anew: what `DraftEncoding::update`
/// computes incrementally (the reference its tests and benchmark compare with).
pub fn encode_whole(target: &TextTokenizer, draft: &TextTokenizer, body: &[u32]) -> Result<Vec<u32>> {
    draft.encode(&target.decode(body, false)?, true)
}

/// The text `ids[cut..]` adds after `ids[..cut]`, decoded from `LOOKBEHIND` tokens before `cut`;
/// None where that decoding does not extend the decoding of those tokens alone.
fn text_after(tokenizer: &TextTokenizer, ids: &[u32], cut: usize) -> Result<Option<String>> {
    let from = cut.saturating_sub(LOOKBEHIND);
    let before = tokenizer.decode(&ids[from..cut], false)?;
    let all = tokenizer.decode(&ids[from..], false)?;
    Ok(all.strip_prefix(&before).map(str::to_string))
}

impl CrossTokenizerProposer {
    pub fn new(
        draft: Arc<dyn CausalLm>,
        draft_tokenizer: Arc<TextTokenizer>,
        target_tokenizer: Arc<TextTokenizer>,
        max_model_len: Option<usize>,
        kv_bytes: Arc<KvBytes>,
    ) -> Self {
        let encoding = DraftEncoding::new(target_tokenizer.clone(), draft_tokenizer.clone());
        Self {
            cache: DraftCache::new(draft, max_model_len, kv_bytes),
            capacity: 0,
            target_tokenizer,
            draft_tokenizer,
            encoding,
        }
    }
}

impl Proposer for CrossTokenizerProposer {
    fn begin(&mut self, prompt: &[u32], params: &SamplingParams) -> Result<()> {
        // Draft tokens per target token vary with the text: the cache holds twice the target's
        // positions (within the draft's max_model_len); a context past it gets no drafts.
        self.capacity = 2 * (prompt.len() + params.max_tokens) + 16;
        self.encoding.reset();
        self.cache.begin(self.capacity)
    }

    fn propose(&mut self, context: &[u32], max_tokens: usize) -> Result<Draft> {
        if max_tokens == 0 || context.is_empty() {
            return Ok(Draft::default());
        }
        // The draft reads the context's text with its own BOS, not the target's BOS as text.
        let bos = self.target_tokenizer.bos_token_id();
        let body = if bos.is_some() && context.first().copied() == bos { &context[1..] } else { context };
        let draft_context = self.encoding.update(body)?;
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
        let mut token_ids =
            drafted_target_tokens(&self.target_tokenizer, &self.draft_tokenizer, context, &draft_context, &drafted)?;
        token_ids.truncate(max_tokens);
        Ok(Draft::tokens(token_ids))
    }

    fn observe(&mut self, _feedback: &Feedback<'_>) -> Result<()> {
        // The next `propose` encodes what the context gained; the cache keeps what it shares.
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

/// The target tokens after `context` (target ids) that the draft's `drafted` ids after
/// `draft_context` (its ids of the context's text) fully determine.
pub fn drafted_target_tokens(
    target: &TextTokenizer,
    draft: &TextTokenizer,
    context: &[u32],
    draft_context: &[u32],
    drafted: &[u32],
) -> Result<Vec<u32>> {
    match continuation_text(draft, draft_context, drafted)? {
        Some(continuation) => target_tokens_after(target, context, &continuation),
        None => Ok(Vec::new()),
    }
}

/// The text `drafted` (draft ids) adds after `draft_context`, without a trailing partial
/// character; None when decoding the whole does not extend the context's own text (a tokenizer
/// whose decoding is not prefix-stable there).
fn continuation_text(tokenizer: &TextTokenizer, draft_context: &[u32], drafted: &[u32]) -> Result<Option<String>> {
    let from = draft_context.len().saturating_sub(LOOKBEHIND);
    let ids = [&draft_context[from..], drafted].concat();
    let Some(continuation) = text_after(tokenizer, &ids, draft_context.len() - from)? else { return Ok(None) };
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
    let Some(window_text) = text_after(target, context, cut)? else { return Ok(Vec::new()) };
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
