//! Stop strings on the real SmolLM2 weights: a speculative request with stop strings returns
//! exactly plain decoding's output with the same stop strings (tokens, text, finish and stop
//! reason) with n-gram, suffix and layer-skip drafts at several k, also when the stop string
//! completes inside a draft that was accepted past it; and the suffix cache learns only the
//! emitted tokens.

use specrs_core::engine::{FinishReason, StopReason};
use specrs_core::{Engine, Generation, SamplingParams, SpeculativeConfig};

use crate::common;

/// Prompts whose answers repeat what came before, so drafts are accepted several tokens deep.
const PROMPTS: [&str; 2] = [
    "Repeat exactly: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat sat",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
];

const METHODS: [&str; 5] = [
    r#"{"method": "ngram", "num_speculative_tokens": 2, "adaptive_draft_length": false}"#,
    r#"{"method": "ngram", "num_speculative_tokens": 8, "adaptive_draft_length": false, "prompt_lookup_min": 1}"#,
    r#"{"method": "suffix", "num_speculative_tokens": 4, "adaptive_draft_length": false}"#,
    r#"{"method": "suffix", "num_speculative_tokens": 8, "adaptive_draft_length": false, "tree": true}"#,
    r#"{"method": "layer_skip", "num_speculative_tokens": 3, "exit_layer": 20, "adaptive_draft_length": false}"#,
];

const MAX_TOKENS: usize = 40;

fn engine() -> Engine {
    Engine::load(common::smollm2_path(), "cpu").unwrap()
}

fn greedy(stop: &[&str], include: bool) -> SamplingParams {
    SamplingParams {
        stop: stop.iter().map(|s| s.to_string()).collect(),
        include_stop_str_in_output: include,
        ignore_eos: true,
        ..SamplingParams::greedy(MAX_TOKENS)
    }
}

fn generate(engine: &Engine, prompt: &str, params: SamplingParams, config: Option<&str>) -> Generation {
    let ids = engine.tokenizer().encode(prompt, true).unwrap();
    let speculation = config.map(|c| engine.speculation(&SpeculativeConfig::from_json(c).unwrap(), None).unwrap());
    engine.generate(ids, params, speculation).unwrap()
}

/// Stop strings cut from `text`: whole words, and pieces that straddle token boundaries.
fn stops_in(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let piece = |from: usize, len: usize| chars[from..from + len].iter().collect::<String>();
    let n = chars.len();
    vec![piece(n / 3, 3), piece(n / 2, 4), piece(n - 6, 5)]
}

#[test]
fn speculative_output_with_stop_strings_is_plain_decodings() {
    let engine = engine();
    let mut num_cut_inside_a_draft = 0;
    let mut num_cases = 0;
    for prompt in PROMPTS {
        let plain = generate(&engine, prompt, greedy(&[], false), None);
        for stop in stops_in(&plain.text) {
            for include in [false, true] {
                let params = greedy(&[stop.as_str(), "\u{1F600}never"], include);
                let expected = generate(&engine, prompt, params.clone(), None);
                // Plain decoding ends at the stop string's first occurrence.
                let at = plain.text.find(&stop).unwrap();
                let end = if include { at + stop.len() } else { at };
                assert_eq!(expected.text, plain.text[..end], "{stop:?}");
                assert_eq!(expected.token_ids, plain.token_ids[..expected.token_ids.len()]);
                assert_eq!(
                    (expected.finish_reason, expected.stop_reason.clone()),
                    (Some(FinishReason::Stop), Some(StopReason::Text(stop.clone())))
                );
                for config in METHODS {
                    let got = generate(&engine, prompt, params.clone(), Some(config));
                    assert_eq!(got.token_ids, expected.token_ids, "{config} {stop:?}");
                    assert_eq!(got.text, expected.text, "{config} {stop:?}");
                    assert_eq!((got.finish_reason, &got.stop_reason), (expected.finish_reason, &expected.stop_reason));
                    // A step emits its accepted tokens and one more, unless a stop ended it early.
                    let m = &got.metrics;
                    let uncut = 1 + m.spec.num_decode_steps + m.spec.num_accepted_tokens;
                    num_cut_inside_a_draft += usize::from(m.num_generated_tokens < uncut);
                    num_cases += 1;
                }
            }
        }
    }
    assert!(num_cut_inside_a_draft > 0, "no stop string completed inside an accepted draft ({num_cases} cases)");
}

#[test]
fn the_suffix_cache_learns_only_the_emitted_tokens() {
    let engine = engine();
    let config = METHODS[2];
    let plain = generate(&engine, PROMPTS[0], greedy(&[], false), None);
    let stop = stops_in(&plain.text)[1].clone();
    let stopped = generate(&engine, PROMPTS[0], greedy(&[stop.as_str()], false), Some(config));
    assert!(stopped.token_ids.len() < plain.token_ids.len());
    let responses = engine.suffix_cache_responses().unwrap();
    assert_eq!(responses.len(), 1);
    assert_eq!(responses[0].1, vec![stopped.token_ids.clone()], "the cache holds exactly the emitted tokens");
}

#[test]
fn a_stop_token_ends_the_output_without_its_text_unless_included() {
    let engine = engine();
    let plain = generate(&engine, PROMPTS[1], greedy(&[], false), None);
    let token = plain.token_ids[10];
    let cut = plain.token_ids.iter().position(|&t| t == token).unwrap() + 1;
    let text_of = |ids: &[u32]| engine.tokenizer().decode(ids, true).unwrap();
    for include in [false, true] {
        let params = SamplingParams { stop_token_ids: vec![token], ..greedy(&[], include) };
        for config in [None, Some(METHODS[1])] {
            let got = generate(&engine, PROMPTS[1], params.clone(), config);
            assert_eq!(got.token_ids, plain.token_ids[..cut]);
            assert_eq!(got.stop_reason, Some(StopReason::TokenId(token)));
            let text_ids = if include { &plain.token_ids[..cut] } else { &plain.token_ids[..cut - 1] };
            let prompt_len = got.prompt_token_ids.len();
            // The text as decoded after the prompt (the first token's leading space included).
            let in_context = [got.prompt_token_ids.as_slice(), text_ids].concat();
            let expected = &text_of(&in_context)[text_of(&got.prompt_token_ids).len()..];
            assert_eq!(got.text, expected, "include={include} (prompt {prompt_len} tokens)");
        }
    }
}
