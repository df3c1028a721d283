//! Sessions stepped together (`step_together`: every session's plan in one target forward) yield
//! exactly the tokens each yields stepped alone, on the real SmolLM2 weights: greedy and seeded
//! sampling, with and without speculation, with prompts of different lengths, chunked prefill,
//! and sessions finishing at different steps.

use specrs_core::{step_together, Engine, SamplingParams, Session, SpeculativeConfig};

use crate::common;

const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Speculative decoding verifies a draft in one forward pass. Speculative decoding",
    "List three colors: red, green,",
];

/// Per request: (prompt, params, speculative config JSON or None, prefill chunk).
fn requests() -> Vec<(&'static str, SamplingParams, Option<&'static str>, Option<usize>)> {
    let sampled = |seed| SamplingParams {
        max_tokens: 24,
        temperature: 0.8,
        top_p: 0.95,
        seed: Some(seed),
        ..SamplingParams::greedy(24)
    };
    vec![
        (PROMPTS[0], SamplingParams::greedy(20), None, None),
        (
            PROMPTS[2],
            SamplingParams::greedy(32),
            Some(r#"{"method": "ngram", "num_speculative_tokens": 4, "adaptive_draft_length": false}"#),
            Some(5),
        ),
        (
            PROMPTS[1],
            sampled(7),
            Some(r#"{"method": "suffix", "num_speculative_tokens": 5, "adaptive_draft_length": false}"#),
            None,
        ),
        (PROMPTS[3], sampled(11), None, Some(3)),
        (
            PROMPTS[2],
            SamplingParams::greedy(28),
            Some(
                r#"{"method": "layer_skip", "num_speculative_tokens": 3, "exit_layer": 20, "adaptive_draft_length": false}"#,
            ),
            None,
        ),
    ]
}

fn start(engine: &Engine) -> Vec<Session> {
    requests()
        .into_iter()
        .map(|(prompt, params, config, chunk)| {
            let ids = engine.tokenizer().encode(prompt, true).unwrap();
            let speculation =
                config.map(|c| engine.speculation(&SpeculativeConfig::from_json(c).unwrap(), None).unwrap());
            let mut session = engine.start(ids, params, speculation).unwrap();
            session.set_prefill_chunk(chunk).unwrap();
            session
        })
        .collect()
}

#[test]
fn sessions_stepped_together_yield_what_they_yield_alone() {
    // One engine per run: suffix decoding's engine-wide tree learns from finished requests, so a
    // second run on one engine would draft (and, sampling, draw) differently.
    let engine = Engine::load(common::smollm2_path(), "cpu").unwrap();
    let mut alone = start(&engine);
    for session in &mut alone {
        while !session.is_finished() {
            session.step().unwrap();
        }
    }
    let engine = Engine::load(common::smollm2_path(), "cpu").unwrap();
    let mut together = start(&engine);
    let mut num_batched_steps = 0;
    while together.iter().any(|s| !s.is_finished()) {
        let mut refs: Vec<&mut Session> = together.iter_mut().collect();
        for result in step_together(&mut refs).unwrap() {
            result.unwrap();
        }
        num_batched_steps += 1;
    }
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a.generated_ids(), t.generated_ids(), "request {i}");
        assert_eq!(a.result().text, t.result().text, "request {i}");
        let (am, tm) = (a.metrics().spec, t.metrics().spec);
        assert_eq!((am.num_drafts, am.num_accepted_tokens), (tm.num_drafts, tm.num_accepted_tokens), "request {i}");
    }
    let total_alone: usize = alone.iter().map(|s| s.metrics().num_forward_passes).sum();
    assert!(num_batched_steps < total_alone, "{num_batched_steps} batched steps vs {total_alone} forwards alone");
    // Speculation ran: the layer-skip request drafts every step, the others where they match.
    let drafts: Vec<usize> = alone.iter().map(|s| s.metrics().spec.num_drafts).collect();
    assert!(drafts[1] > 0 && drafts[2] > 0 && drafts[4] > 0, "drafts per request: {drafts:?}");
}

#[test]
fn sessions_of_different_engines_are_refused() {
    let a = Engine::load(common::smollm2_path(), "cpu").unwrap();
    let b = Engine::load(common::smollm2_path(), "cpu").unwrap();
    let ids = a.tokenizer().encode(PROMPTS[0], true).unwrap();
    let mut x = a.start(ids.clone(), SamplingParams::greedy(4), None).unwrap();
    let mut y = b.start(ids, SamplingParams::greedy(4), None).unwrap();
    let err = step_together(&mut [&mut x, &mut y]).expect_err("refused");
    assert!(err.to_string().contains("one engine"), "{err}");
}
