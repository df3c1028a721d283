//! Incremental, UTF-8-safe detokenization for streaming.
//!
//! A token can end in the middle of a multi-byte character, and some decoders change a token's
//! text depending on its neighbours (SentencePiece strips the first space). So each step decodes a
//! short window twice, with and without the newest tokens, and emits only the difference, holding
//! it back while the window ends in an incomplete character (U+FFFD).
//!
//! `skip_special_tokens` leaves special tokens out of the text; without it, and without
//! `spaces_between_special_tokens`, a special token that follows a generated special token is its
//! bare text (vLLM's fast detokenizer: a decoder that joins tokens with spaces puts none there).
//!
//! Invariant: the concatenation of everything `next` and `finish` return equals the text of the
//! generated tokens decoded in the context of the prompt (but for those bare special tokens).

use crate::error::Result;
use crate::tokenizer::TextTokenizer;

/// How many prompt tokens precede the first generated one in the first window (as vLLM does).
const PROMPT_CONTEXT_TOKENS: usize = 5;

pub struct IncrementalDetokenizer {
    /// Start of the decode window in the full sequence.
    prefix_offset: usize,
    /// End of the text already emitted.
    read_offset: usize,
    prompt_len: usize,
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
}

impl IncrementalDetokenizer {
    pub fn new(prompt_len: usize, skip_special_tokens: bool, spaces_between_special_tokens: bool) -> Self {
        Self {
            prefix_offset: prompt_len.saturating_sub(PROMPT_CONTEXT_TOKENS),
            read_offset: prompt_len,
            prompt_len,
            skip_special_tokens,
            spaces_between_special_tokens,
        }
    }

    /// New text after the tokens appended to `all_ids` (prompt + generated) since the last call.
    pub fn next(&mut self, tokenizer: &TextTokenizer, all_ids: &[u32]) -> Result<String> {
        self.emit(tokenizer, all_ids, false)
    }

    /// The text still held back, emitted even if it ends in an incomplete character.
    pub fn finish(&mut self, tokenizer: &TextTokenizer, all_ids: &[u32]) -> Result<String> {
        self.emit(tokenizer, all_ids, true)
    }

    fn emit(&mut self, tokenizer: &TextTokenizer, all_ids: &[u32], flush: bool) -> Result<String> {
        if all_ids.len() <= self.read_offset {
            return Ok(String::new());
        }
        if let Some(bare) = self.bare_special_token(tokenizer, all_ids) {
            self.prefix_offset = self.read_offset;
            self.read_offset = all_ids.len();
            return Ok(bare);
        }
        let skip = self.skip_special_tokens;
        let emitted = tokenizer.decode(&all_ids[self.prefix_offset..self.read_offset], skip)?;
        let window = tokenizer.decode(&all_ids[self.prefix_offset..], skip)?;
        if !flush && window.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let delta = match window.strip_prefix(emitted.as_str()) {
            Some(rest) => rest.to_string(),
            // The newest tokens rewrote earlier text (rare): emit the part past the common prefix.
            None => {
                let common = emitted.char_indices().zip(window.chars()).take_while(|((_, a), b)| a == b).count();
                window.chars().skip(common).collect()
            }
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = all_ids.len();
        Ok(delta)
    }

    /// The bare text of the one new token when it is a special token after a generated special
    /// token and spaces between them are off (see the module header).
    fn bare_special_token(&self, tokenizer: &TextTokenizer, all_ids: &[u32]) -> Option<String> {
        let new = all_ids.len() - self.read_offset;
        if self.skip_special_tokens
            || self.spaces_between_special_tokens
            || new != 1
            || self.read_offset <= self.prompt_len
        {
            return None;
        }
        tokenizer.added_token_text(all_ids[self.read_offset - 1])?;
        tokenizer.added_token_text(all_ids[self.read_offset])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decodes `generated` after `prompt` one token at a time.
    fn stream(tokenizer: &TextTokenizer, prompt: &[u32], generated: &[u32], skip: bool, spaces: bool) -> String {
        let mut detokenizer = IncrementalDetokenizer::new(prompt.len(), skip, spaces);
        let mut ids = prompt.to_vec();
        let mut text = String::new();
        for &token in generated {
            ids.push(token);
            text.push_str(&detokenizer.next(tokenizer, &ids).unwrap());
        }
        text + &detokenizer.finish(tokenizer, &ids).unwrap()
    }

    #[test]
    fn special_tokens_skipped_kept_or_kept_without_spaces_between_them() {
        // The numbered tokenizer has no decoder: its tokens are joined with spaces.
        let mut tokenizer = TextTokenizer::numbered(8).unwrap();
        tokenizer.add_special_tokens(&["<a>", "<b>"]);
        let (a, b) = (8, 9);
        let generated = [1, 2, a, b];
        assert_eq!(stream(&tokenizer, &[3], &generated, true, true), " t1 t2");
        assert_eq!(stream(&tokenizer, &[3], &generated, false, true), " t1 t2 <a> <b>");
        assert_eq!(stream(&tokenizer, &[3], &generated, false, false), " t1 t2 <a><b>");
        // Only between two generated special tokens.
        assert_eq!(stream(&tokenizer, &[a], &[b], false, false), " <b>");
    }
}
