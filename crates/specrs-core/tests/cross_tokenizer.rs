//! The cross-tokenizer boundary rule (`proposer::cross_tokenizer::target_tokens_after`) on the
//! real tokenizers of SmolLM2 (byte-level BPE) and Gemma 3 (SentencePiece with byte fallback), on
//! adversarial text: continuations that would merge into the context's last token, words cut
//! mid-way, runs of spaces and newlines, code indentation, characters Gemma spells in byte-fallback
//! tokens, special-token text. The rule's promise: whatever text follows, plain tokenization of
//! the whole starts with the context and then the drafted tokens, so a draft never holds a token
//! plain decoding of that text would not emit there.

use specrs_core::gguf::GgufFile;
use specrs_core::proposer::cross_tokenizer::target_tokens_after;
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
