//! `SamplingParams::validate` over arbitrary field values, and what it promises: a validated
//! `SamplingParams` "can be handed to the sampler without further checks". So for finite logits
//! the sampled distribution is a distribution (finite, non-negative, summing to 1), and every
//! drawn token is in the vocabulary and has positive probability.
#![no_main]

use arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use specrs_core::sampler::{probabilities, Sampler};
use specrs_core::{Error, SamplingParams};

fn float(u: &mut Unstructured) -> Result<f32> {
    Ok(match u.int_in_range(0..=2)? {
        0 => *u.choose(&[
            0.0,
            -0.0,
            1.0,
            0.5,
            1e-45,
            1e-38,
            1e-30,
            1e-7,
            0.999_999_94,
            1.000_000_1,
            1e30,
            f32::MAX,
            f32::MIN_POSITIVE,
            f32::NAN,
            f32::INFINITY,
            -f32::INFINITY,
            -1.0,
        ])?,
        _ => u.arbitrary()?,
    })
}

fn params(u: &mut Unstructured) -> Result<SamplingParams> {
    Ok(SamplingParams {
        max_tokens: if u.arbitrary()? { u.int_in_range(0..=4)? } else { u.arbitrary()? },
        temperature: float(u)?,
        top_k: if u.arbitrary()? { u.int_in_range(0..=40)? } else { u.arbitrary()? },
        top_p: float(u)?,
        min_p: float(u)?,
        seed: u.arbitrary()?,
        ignore_eos: u.arbitrary()?,
        presence_penalty: float(u)?,
        frequency_penalty: float(u)?,
        repetition_penalty: float(u)?,
        logit_bias: vec![(u.int_in_range(0..=8)?, float(u)?)],
        min_tokens: u.int_in_range(0..=8)?,
        stop_token_ids: vec![u.int_in_range(0..=8)?],
        stop: u.arbitrary()?,
        include_stop_str_in_output: u.arbitrary()?,
        skip_special_tokens: u.arbitrary()?,
        spaces_between_special_tokens: u.arbitrary()?,
        truncate_prompt_tokens: u.arbitrary()?,
        bad_words: u.arbitrary()?,
        allowed_token_ids: if u.arbitrary()? { Some(vec![u.int_in_range(0..=8)?]) } else { None },
        logprobs: u.arbitrary()?,
        grammar: None,
        n: if u.arbitrary()? { u.int_in_range(0..=3)? } else { u.arbitrary()? },
    })
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let Ok(params) = params(&mut u) else { return };
    match params.validate() {
        Ok(()) => {}
        Err(Error::Config(_)) => return,
        Err(other) => panic!("{params:?} refused with a non-config error: {other:?}"),
    }
    let Ok(n) = u.int_in_range(1..=64usize) else { return };
    // Logits as a model emits them: finite, of any magnitude.
    let logits: Vec<f32> = (0..n)
        .map(|_| float(&mut u).map(|x| if x.is_finite() { x } else { 0.0 }))
        .collect::<Result<_>>()
        .unwrap_or_default();
    if logits.is_empty() {
        return;
    }
    let mut sampler = Sampler::new(params.seed);
    let token = sampler.sample(&logits, &params) as usize;
    assert!(token < logits.len(), "token {token} outside a vocabulary of {}", logits.len());
    if !params.is_greedy() {
        let probs = probabilities(&logits, &params);
        let total: f32 = probs.iter().sum();
        assert!(
            probs.iter().all(|p| p.is_finite() && *p >= 0.0) && (total - 1.0).abs() < 1e-3,
            "{params:?} on {logits:?} gave {probs:?}"
        );
        assert!(probs[token] > 0.0, "{params:?} on {logits:?} drew token {token} of probability 0: {probs:?}");
    }
});
