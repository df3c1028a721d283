//! The cross-tokenizer boundary rule (`proposer::cross_tokenizer::target_tokens_after`) on the
//! real tokenizers of SmolLM2 (byte-level BPE) and Gemma 3 (SentencePiece with byte fallback), on
//! adversarial text: continuations that would merge into the context's last token, words cut
//! mid-way, runs of spaces and newlines, code indentation, characters Gemma spells in byte-fallback
//! tokens, special-token text. The rule's promise: whatever text follows, plain tokenization of
//! the whole starts with the context and then the drafted tokens, so a draft never holds a token
//! plain decoding of that text would not emit there. And `DraftEncoding`, the context in the
//! draft's tokens kept across steps: at every step of a growing context it equals the whole
//! text's encoding, while encoding the whole text only at the first step.

use specrs_core::gguf::GgufFile;
use std::sync::Arc;

use specrs_core::proposer::cross_tokenizer::{encode_whole, target_tokens_after, DraftEncoding};
use specrs_core::tokenizer::TextTokenizer;

use crate::common;

fn tokenizer(path: std::path::PathBuf) -> TextTokenizer {
    TextTokenizer::from_gguf(&GgufFile::open(path).expect("open the GGUF")).expect("its tokenizer")
}

/// (context text, continuation a draft wrote, texts that could follow it).
const CASES: &[(&str, &str, &[&str])] = &[
    ("The capital of France is", " Paris, and the river is the Sei", &["ne.", "", " ", "n"]),
    ("def add(a, b):\n", "    return a + b\n\n", &["", "def", "    x", "\n"]),
    ("Say hello", " wor", &["ld", "", "ds", " !"]),
    ("x =", " 1   ", &["", "+", "  y", "\n"]),
    ("Emoji:", " 🚀🧬 done", &["", "!", "ness", " 🚀"]),
    ("Accents:", " café naïve façade", &["", "s", " ñ"]),
    ("Tabs and lines:", "\n\n\tindent\t", &["", "x", "\n"]),
    ("Special:", " end<|im_end|><end_of_turn>next", &["", " word", "<|im_end|>"]),
    ("Numbers", " 12345678901234", &["5", "", ".0"]),
    ("Mid-word", "ization of everything", &["", "s", " else"]),
    // Whitespace runs before the open end: SmolLM2 splits "  \n\n" + "y" as "  \n" + "\n" + "y",
    // so a whitespace-only token before the last one is not determined either.
    ("Hello", " word  \n\n", &["", "y", "."]),
    ("Hello", " word \n\t", &["", "y", "."]),
    ("Hello", " word \n  ", &["", "  ", "y"]),
    ("Hello", " x = 1 \n\n\n", &["", "y", "  ", "."]),
];

fn check(tok: &TextTokenizer, name: &str) -> usize {
    let mut drafted_cases = 0;
    for (context_text, continuation, futures) in CASES {
        let context = tok.encode(context_text, true).unwrap();
        let drafted = target_tokens_after(tok, &context, continuation).unwrap();
        if drafted.is_empty() {
            continue;
        }
        drafted_cases += 1;
        let expected: Vec<u32> = context.iter().chain(&drafted).copied().collect();
        for future in *futures {
            let whole = tok.encode(&format!("{context_text}{continuation}{future}"), true).unwrap();
            assert!(
                whole.starts_with(&expected),
                "{name}: {context_text:?} + {continuation:?} + {future:?}: plain tokens {whole:?} do not start with \
                 the context's {context:?} and the draft's {drafted:?} ({:?})",
                tok.decode(&drafted, false).unwrap()
            );
        }
    }
    drafted_cases
}

#[test]
fn smollm2_drafts_only_tokens_the_text_determines() {
    let drafted = check(&tokenizer(common::smollm2_path()), "SmolLM2");
    assert!(drafted >= CASES.len() - 2, "the rule drafts most continuations, drafted {drafted} of {}", CASES.len());
}

#[test]
fn gemma3_drafts_only_tokens_the_text_determines() {
    let drafted = check(&tokenizer(common::gemma3_path()), "Gemma 3");
    assert!(drafted >= CASES.len() - 2, "the rule drafts most continuations, drafted {drafted} of {}", CASES.len());
}

#[test]
fn a_continuation_that_would_retokenize_the_context_is_not_drafted() {
    let tok = tokenizer(common::smollm2_path());
    // "Hel" then "lo": plain tokenization of "Hello" is one token, not "Hel" + ...
    let context = tok.encode("Say Hel", false).unwrap();
    let merged = tok.encode("Say Hello", false).unwrap();
    assert!(!merged.starts_with(&context), "the case must merge across the boundary: {context:?} {merged:?}");
    assert_eq!(target_tokens_after(&tok, &context, "lo there, friend").unwrap(), Vec::<u32>::new());
}

/// Text a context grows through: code (this crate's own source), prose with accents, emoji,
/// Chinese and Japanese (characters the byte-level tokens cut mid-way), runs of spaces and
/// newlines, special-token text.
fn growing_text() -> String {
    let prose = "Le café naïve à la façade — 東京の天気は晴れです。今天天气很好！🚀🧬 done.\n\n\tIndented   \
                 spaces,   then<|im_end|> and <end_of_turn> text. ";
    format!("{prose}{}{prose}", include_str!("../src/proposer/cross_tokenizer.rs"))
}

/// Grows a context over `growing_text` in `target`'s tokens, 1 to 5 tokens a step (as accepted
/// drafts grow it), and checks each step's draft ids against the whole text's encoding.
fn check_encoding_follows_whole(target: Arc<TextTokenizer>, draft: Arc<TextTokenizer>, name: &str) -> (usize, usize) {
    let body = target.encode(&growing_text(), false).unwrap();
    let mut encoding = DraftEncoding::new(target.clone(), draft.clone());
    let (mut len, mut steps, mut step) = (8, 0, 0);
    while len <= body.len() {
        let ids = encoding.update(&body[..len]).unwrap();
        let whole = encode_whole(&target, &draft, &body[..len]).unwrap();
        assert_eq!(
            ids,
            whole,
            "{name}: at {len} target tokens the kept encoding differs from the whole text's, after {:?}",
            target.decode(&body[len.saturating_sub(8)..len], false).unwrap()
        );
        steps += 1;
        step = step % 5 + 1;
        len += step;
    }
    (steps, encoding.num_whole_encodes())
}

#[test]
fn the_kept_draft_encoding_is_the_whole_texts_at_every_step() {
    let smollm2 = Arc::new(tokenizer(common::smollm2_path()));
    let gemma3 = Arc::new(tokenizer(common::gemma3_path()));
    for (target, draft, name) in
        [(&gemma3, &smollm2, "SmolLM2 drafting for Gemma 3"), (&smollm2, &gemma3, "Gemma 3 drafting for SmolLM2")]
    {
        let (steps, whole) = check_encoding_follows_whole(target.clone(), draft.clone(), name);
        // The whole text is encoded at the first step and where a step cannot reuse the kept
        // tail (a decoding cut inside a character, a merge reaching back past it): rarely.
        assert!(steps > 1000, "{name}: {steps} steps");
        assert!(whole * 20 <= steps, "{name}: the whole text was encoded {whole} times in {steps} steps");
        eprintln!("{name}: {steps} steps, whole text encoded {whole} times");
    }
}
