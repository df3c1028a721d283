//! The real SmolLM2 tokenizer (built from the installed GGUF's metadata, path in
//! `SPECRS_FUZZ_MODEL`; `make fuzz` sets it) on arbitrary input. By the first byte:
//! - text (0): encode -> ids in the vocabulary, and decode(encode(text)) == text (byte-level BPE
//!   is lossless; special tokens written in the text come back as written), but for the bytes
//!   the vocabulary has no token for, which BPE drops as llama.cpp does (SmolLM2 lacks some: ASCII
//!   control bytes 0x04, 0x06, 0x13, 0x14, 0x16, 0x1d and rare UTF-8 lead bytes);
//! - ids (1): decode of arbitrary ids is Ok exactly when every id is in the vocabulary, else a
//!   `ConfigError`;
//! - streaming (2): the incremental detokenizer fed generated ids 1-3 at a time emits, in total,
//!   the text of the generated tokens decoded after the prompt.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use specrs_core::detokenizer::IncrementalDetokenizer;
use specrs_core::gguf::GgufFile;
use specrs_core::tokenizer::TextTokenizer;
use specrs_core::Error;

/// GPT-2's byte-level alphabet: the character that stands for each byte in a token's text.
fn byte_char(byte: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
    if printable(byte) {
        return char::from(byte);
    }
    let rank = (0..byte).filter(|&b| !printable(b)).count() as u32;
    char::from_u32(256 + rank).unwrap()
}

/// The tokenizer, and the bytes it has no token for (`[256]`, true = dropped by BPE).
fn tokenizer() -> &'static (TextTokenizer, Vec<bool>) {
    static TOKENIZER: OnceLock<(TextTokenizer, Vec<bool>)> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let path = std::env::var("SPECRS_FUZZ_MODEL")
            .expect("set SPECRS_FUZZ_MODEL to the SmolLM2 GGUF path (make fuzz does: see fuzz/run.sh)");
        let tok = TextTokenizer::from_gguf(&GgufFile::open(&path).expect("open SPECRS_FUZZ_MODEL")).expect("tokenizer");
        let single: std::collections::HashSet<String> =
            (0..tok.vocab_size() as u32).filter_map(|id| tok.token_text(id)).collect();
        let dropped = (0..=255u8).map(|b| !single.contains(&byte_char(b).to_string())).collect();
        (tok, dropped)
    })
}

fn ids(bytes: &[u8], modulus: u32) -> Vec<u32> {
    bytes.chunks_exact(2).map(|c| u32::from(u16::from_le_bytes([c[0], c[1]])) * 7 % modulus).collect()
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let (tok, dropped) = tokenizer();
    let vocab = tok.vocab_size() as u32;
    match mode % 3 {
        0 => {
            let text = String::from_utf8_lossy(rest);
            let encoded = tok.encode(&text, false).expect("encode");
            assert!(encoded.iter().all(|&id| id < vocab), "{text:?} -> {encoded:?}");
            let decoded = tok.decode(&encoded, false).expect("decode of encoded ids");
            let kept: Vec<u8> = text.bytes().filter(|&b| !dropped[b as usize]).collect();
            assert_eq!(decoded, String::from_utf8_lossy(&kept), "round trip through {encoded:?}");
            let _ = tok.encode(&text, true).expect("encode with special tokens");
        }
        1 => {
            let ids = ids(rest, vocab + 64);
            for skip in [false, true] {
                match tok.decode(&ids, skip) {
                    Ok(_) => assert!(ids.iter().all(|&id| id < vocab)),
                    Err(Error::Config(_)) => assert!(ids.iter().any(|&id| id >= vocab)),
                    Err(other) => panic!("decode of {ids:?}: {other:?}"),
                }
            }
        }
        _ => {
            let Some((&prompt_len, rest)) = rest.split_first() else { return };
            let all = ids(rest, vocab);
            let prompt_len = usize::from(prompt_len % 16).clamp(1, all.len().max(1)).min(all.len());
            if prompt_len == 0 {
                return;
            }
            let mut detok = IncrementalDetokenizer::new(prompt_len, true, true);
            let mut emitted = String::new();
            let mut end = prompt_len;
            let mut step = 1;
            while end < all.len() {
                end = (end + step).min(all.len());
                step = step % 3 + 1;
                emitted += &detok.next(tok, &all[..end]).expect("detokenize");
            }
            emitted += &detok.finish(tok, &all).expect("finish");
            // The text after the prompt, when the prompt's own text is a prefix of the whole (a
            // character split across the prompt's end is rewritten, by design).
            let start = prompt_len.saturating_sub(5);
            let before = tok.decode(&all[start..prompt_len], true).unwrap();
            let whole = tok.decode(&all[start..], true).unwrap();
            if let Some(after) = whole.strip_prefix(before.as_str()) {
                assert_eq!(emitted, after, "streamed text of {all:?} (prompt {prompt_len})");
            }
        }
    }
});
