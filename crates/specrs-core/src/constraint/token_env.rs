//! The token environment llguidance matches grammars against, built from a `TextTokenizer`:
//! the bytes every token id stands for, the EOS ids, and a tokenizer for the text a grammar
//! forces.
//!
//! Invariant: token i's bytes are exactly what i contributes to a decoded text when it is not the
//! first token (no SentencePiece leading space is added or removed); control tokens get
//! llguidance's special-token marker byte (0xFF, never valid UTF-8) in front, so grammar text can
//! never produce them; an id whose bytes cannot be known gets no bytes, which llguidance never
//! allows. The trie covers exactly the tokenizer's `vocab_size()` ids.

use std::sync::Arc;

use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use tokenizers::normalizers::Sequence as NormalizerSequence;
use tokenizers::pre_tokenizers::metaspace::PrependScheme;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::{DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, Tokenizer};

use crate::error::{catch_panic, Error, Result};
use crate::tokenizer::TextTokenizer;

/// How the tokenizer's vocabulary strings map to bytes, read from its decoder.
enum VocabEncoding {
    /// GPT-2 byte-level BPE: each byte is one printable character.
    ByteLevel,
    /// SentencePiece: `space` stands for ' ', and `<0xNN>` pieces are single bytes.
    ByteFallback { space: char },
}

/// llguidance's view of one tokenizer. `tokenizer` is a copy of the `TextTokenizer`'s, changed
/// only so that it never adds a leading space: llguidance tokenizes text from the middle of the
/// output (the bytes a grammar forces).
struct SpecrsTokEnv {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for SpecrsTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        // Bytes that are not UTF-8 (a character split by the grammar) go to the trie's greedy
        // tokenizer; a tokenizer failure does too rather than panicking inside llguidance.
        self.trie.tokenize_with_greedy_fallback(s, |text| match self.tokenizer.encode_fast(text, false) {
            Ok(encoding) => encoding.get_ids().to_vec(),
            Err(_) => self.trie.greedy_tokenize(text.as_bytes()),
        })
    }
}

/// The token environment of `tokenizer`, shared by every grammar compiled for it.
pub(super) fn token_env(tokenizer: &TextTokenizer) -> Result<TokEnv> {
    let hf = tokenizer.hf_tokenizer();
    let encoding = vocab_encoding(hf)?;
    let vocab_size = tokenizer.vocab_size();
    let eos = tokenizer.eos_token_ids();
    let Some(&first_eos) = eos.first() else {
        return Err(Error::config(
            "constrained decoding needs an end-of-sequence token, and this model's tokenizer names none; \
             use a model whose tokenizer declares EOS (tokenizer.ggml.eos_token_id, or eos_token_id in \
             generation_config.json)",
        ));
    };
    if let Some(bad) = eos.iter().find(|&&id| id as usize >= vocab_size) {
        return Err(Error::config(format!(
            "the tokenizer's EOS token id {bad} is outside its vocabulary of {vocab_size} tokens; the model's \
             tokenizer files are inconsistent"
        )));
    }
    let words = token_bytes(hf, vocab_size, &encoding);
    let info = TokRxInfo::new(vocab_size as u32, first_eos);
    let trie = catch_panic(|| {
        let trie = TokTrie::from(&info, &words);
        if eos.len() > 1 {
            trie.with_eos_tokens(eos)
        } else {
            trie
        }
    })
    .map_err(|e| Error::Internal(format!("building the token trie for constrained decoding: {e}")))?;
    Ok(Arc::new(SpecrsTokEnv { trie, tokenizer: without_leading_space(hf.clone()) }))
}

fn vocab_encoding(hf: &Tokenizer) -> Result<VocabEncoding> {
    let mut byte_level = false;
    let mut byte_fallback = false;
    let mut space = ' ';
    let mut decoders: Vec<&DecoderWrapper> = hf.get_decoder().into_iter().collect();
    while let Some(decoder) = decoders.pop() {
        match decoder {
            DecoderWrapper::ByteLevel(_) => byte_level = true,
            DecoderWrapper::ByteFallback(_) => byte_fallback = true,
            DecoderWrapper::Sequence(seq) => decoders.extend(seq.get_decoders()),
            // The replaced pattern is private; its serialized form names it.
            DecoderWrapper::Replace(replace) if replace.content == " " => {
                let pattern = serde_json::to_value(replace).ok();
                let pattern = pattern.as_ref().and_then(|v| v["pattern"]["String"].as_str());
                if let Some(c) = pattern.and_then(single_char) {
                    space = c;
                }
            }
            _ => {}
        }
    }
    if byte_level {
        Ok(VocabEncoding::ByteLevel)
    } else if byte_fallback {
        Ok(VocabEncoding::ByteFallback { space })
    } else {
        Err(Error::config(
            "constrained decoding needs a byte-level BPE or byte-fallback SentencePiece tokenizer (it must know \
             the bytes of every token); this model's tokenizer is neither, so serve it without a grammar",
        ))
    }
}

fn single_char(s: &str) -> Option<char> {
    let mut chars = s.chars();
    match (chars.next(), chars.next()) {
        (Some(c), None) => Some(c),
        _ => None,
    }
}

/// The bytes of each of the `vocab_size` token ids (see the module invariant).
fn token_bytes(hf: &Tokenizer, vocab_size: usize, encoding: &VocabEncoding) -> Vec<Vec<u8>> {
    let byte_of_char = byte_level_chars();
    let mut words: Vec<Vec<u8>> = (0..vocab_size as u32)
        .map(|id| {
            let Some(piece) = hf.id_to_token(id) else { return Vec::new() };
            match encoding {
                // A character outside GPT-2's byte alphabet means the piece is not byte-level
                // text; such a token stays unusable rather than guessed.
                VocabEncoding::ByteLevel => {
                    piece.chars().map(&byte_of_char).collect::<Option<Vec<u8>>>().unwrap_or_default()
                }
                VocabEncoding::ByteFallback { space } => match byte_fallback_byte(&piece) {
                    Some(byte) => vec![byte],
                    None => piece.replace(*space, " ").into_bytes(),
                },
            }
        })
        .collect();
    // Added tokens are written as plain text in the vocabulary, whatever the model's encoding.
    for (id, added) in hf.get_added_tokens_decoder() {
        if let Some(word) = words.get_mut(id as usize) {
            *word = added.content.into_bytes();
            if added.special {
                word.insert(0, TokTrie::SPECIAL_TOKEN_MARKER);
            }
        }
    }
    words
}

/// The byte a SentencePiece `<0xNN>` piece stands for.
fn byte_fallback_byte(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// GPT-2's byte-to-character table, inverted: printable Latin-1 bytes stand for themselves, and
/// the other bytes, in order, for U+0100 onwards.
fn byte_level_chars() -> impl Fn(char) -> Option<u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut table = std::collections::HashMap::with_capacity(256);
    let mut next = 0x100u32;
    for byte in 0..=255u8 {
        let c = if printable(byte) {
            char::from(byte)
        } else {
            next += 1;
            char::from_u32(next - 1).unwrap_or(char::REPLACEMENT_CHARACTER)
        };
        table.insert(c, byte);
    }
    move |c| table.get(&c).copied()
}

/// `hf` without a SentencePiece leading space: no `Prepend` normalizer, and Metaspace never
/// prepends.
fn without_leading_space(mut hf: Tokenizer) -> Tokenizer {
    fn drop_prepend(n: NormalizerWrapper) -> Option<NormalizerWrapper> {
        match n {
            NormalizerWrapper::Prepend(_) => None,
            NormalizerWrapper::Sequence(seq) => {
                let kept: Vec<_> = seq.as_ref().iter().cloned().filter_map(drop_prepend).collect();
                (!kept.is_empty()).then(|| NormalizerWrapper::Sequence(NormalizerSequence::new(kept)))
            }
            other => Some(other),
        }
    }
    fn never_prepend(p: PreTokenizerWrapper) -> PreTokenizerWrapper {
        match p {
            PreTokenizerWrapper::Metaspace(mut m) => {
                m.set_prepend_scheme(PrependScheme::Never);
                PreTokenizerWrapper::Metaspace(m)
            }
            PreTokenizerWrapper::Sequence(seq) => PreTokenizerWrapper::Sequence(PreTokenizerSequence::new(
                seq.as_ref().iter().cloned().map(never_prepend).collect(),
            )),
            other => other,
        }
    }
    if let Some(n) = hf.get_normalizer().cloned() {
        // Setting a normalizer cannot fail: the result is only for the builder-style API.
        let _ = hf.with_normalizer(drop_prepend(n));
    }
    if let Some(p) = hf.get_pre_tokenizer().cloned() {
        hf.with_pre_tokenizer(Some(never_prepend(p)));
    }
    hf
}
