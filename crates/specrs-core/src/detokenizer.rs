//! Incremental, UTF-8-safe detokenization for streaming.
//!
//! A token can end in the middle of a multi-byte character, and some decoders change a token's
//! text depending on its neighbours (SentencePiece strips the first space). So each step decodes a
//! short window twice, with and without the newest tokens, and emits only the difference, holding
//! it back while the window ends in an incomplete character (U+FFFD).
//!
//! Invariant: the concatenation of everything `next` and `finish` return equals the text of the
//! generated tokens decoded in the context of the prompt.

use crate::error::Result;
use crate::tokenizer::TextTokenizer;

/// How many prompt tokens precede the first generated one in the first window (as vLLM does).
const PROMPT_CONTEXT_TOKENS: usize = 5;

pub struct IncrementalDetokenizer {
    /// Start of the decode window in the full sequence.
    prefix_offset: usize,
    /// End of the text already emitted.
    read_offset: usize,
}

impl IncrementalDetokenizer {
    pub fn new(prompt_len: usize) -> Self {
        Self { prefix_offset: prompt_len.saturating_sub(PROMPT_CONTEXT_TOKENS), read_offset: prompt_len }
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
        let emitted = tokenizer.decode(&all_ids[self.prefix_offset..self.read_offset], true)?;
        let window = tokenizer.decode(&all_ids[self.prefix_offset..], true)?;
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
}
