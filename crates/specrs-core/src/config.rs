//! Per-request settings: `SamplingParams` (vLLM's names and defaults: temperature 1, 16 tokens).
//!
//! Invariant: a `SamplingParams` that passed `validate()` can be handed to the sampler without
//! further checks; every rejection names the field and the valid range.

use crate::constraint::GrammarSpec;
use crate::error::{Error, Result};

/// The most alternatives `logprobs` may ask for per token (OpenAI's `top_logprobs` limit).
pub const MAX_LOGPROBS: usize = 20;

/// The most samples `n` may ask for (OpenAI's limit).
pub const MAX_SAMPLES: usize = 128;

/// vLLM's `truncate_prompt_tokens` value that keeps as many prompt tokens as the context holds.
pub const TRUNCATE_TO_CONTEXT: i64 = -1;

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Maximum number of tokens to generate (>= 1; vLLM's default, 16).
    pub max_tokens: usize,
    /// 0 means greedy (argmax); > 0 divides the logits before the softmax (vLLM's default, 1).
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 disables the filter.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability mass reaches top_p; 1.0 disables it.
    pub top_p: f32,
    /// Drop tokens whose probability is below min_p times the top token's; 0 disables it.
    pub min_p: f32,
    /// Seed of the request's random generator; None draws one from the OS.
    pub seed: Option<u64>,
    /// Keep generating past end-of-sequence tokens (benchmarks and golden tests).
    pub ignore_eos: bool,
    /// Subtracted once from the logit of every token the output already holds (vLLM, OpenAI).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time the output holds it.
    pub frequency_penalty: f32,
    /// vLLM's: the logit of a token in the prompt or the output is divided by this when positive,
    /// multiplied when negative; 1 disables it.
    pub repetition_penalty: f32,
    /// Added to the logits of these tokens (OpenAI's `logit_bias`, -100..=100).
    pub logit_bias: Vec<(u32, f32)>,
    /// End-of-sequence and `stop_token_ids` cannot end the output before this many tokens.
    pub min_tokens: usize,
    /// Tokens that end the output like an end-of-sequence token (kept as its last token; its
    /// text is left out unless `include_stop_str_in_output`, as vLLM does).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end the output (vLLM's and OpenAI's `stop`), matched on the detokenized text
    /// as tokens are committed: the output ends with the token that completes the first one, and
    /// its text ends right before it (`engine/output_text.rs`).
    pub stop: Vec<String>,
    /// Keep the stop string (or the text of the stop token) at the end of the text.
    pub include_stop_str_in_output: bool,
    /// Leave special tokens (control tokens such as `<|im_end|>`) out of the text.
    pub skip_special_tokens: bool,
    /// With `skip_special_tokens` off: false writes a special token that follows another one as
    /// its bare text, without the space a decoder may put before it (vLLM's fast detokenizer).
    pub spaces_between_special_tokens: bool,
    /// Some(k): keep only the last k prompt tokens (vLLM's left truncation); `TRUNCATE_TO_CONTEXT`
    /// (-1): as many as the model's context holds.
    pub truncate_prompt_tokens: Option<i64>,
    /// Words the output must not contain (vLLM's `bad_words`): each is tokenized with and without
    /// a leading space, and the last token of a sequence is banned wherever the output ends with
    /// the rest of it.
    pub bad_words: Vec<String>,
    /// Some(ids): only these tokens may be generated (vLLM's `allowed_token_ids`).
    pub allowed_token_ids: Option<Vec<u32>>,
    /// Some(n): return each emitted token's log-probability and the n most likely alternatives.
    pub logprobs: Option<usize>,
    /// The language the output must belong to (JSON schema, regex, Lark grammar, choice).
    pub grammar: Option<GrammarSpec>,
    /// Samples of the prompt to return (OpenAI's and vLLM's `n`). A session runs one: several
    /// are added together with `Scheduler::add_samples`, which shares their prompt's prefill.
    pub n: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_tokens: 16,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            ignore_eos: false,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            include_stop_str_in_output: false,
            skip_special_tokens: true,
            spaces_between_special_tokens: true,
            truncate_prompt_tokens: None,
            bad_words: Vec::new(),
            allowed_token_ids: None,
            logprobs: None,
            grammar: None,
            n: 1,
        }
    }
}

impl SamplingParams {
    pub fn greedy(max_tokens: usize) -> Self {
        Self { max_tokens, temperature: 0.0, ..Self::default() }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// The distribution is softmax(logits / temperature) alone (or greedy): no top-k, top-p or
    /// min-p filter.
    pub fn is_temperature_only(&self) -> bool {
        self.top_k == 0 && self.top_p >= 1.0 && self.min_p <= 0.0 && !self.changes_logits()
    }

    /// Whether the logits are changed before sampling (grammar, allowed_token_ids, bad_words,
    /// penalties, bias, min_tokens): then each verified row is processed on the host
    /// (`logits_processor.rs`).
    pub fn changes_logits(&self) -> bool {
        self.grammar.is_some()
            || self.allowed_token_ids.is_some()
            || !self.bad_words.is_empty()
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
            || !self.logit_bias.is_empty()
            || self.min_tokens > 0
    }

    pub fn validate(&self) -> Result<()> {
        if self.max_tokens == 0 {
            return Err(Error::config("max_tokens must be >= 1 (got 0)"));
        }
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(Error::config(format!(
                "temperature must be a finite number >= 0 (got {}); use 0 for greedy decoding",
                self.temperature
            )));
        }
        // The sampler scales logits by 1 / temperature; below f32's smallest normal number that
        // is infinite and every probability NaN.
        if self.temperature > 0.0 && self.temperature < f32::MIN_POSITIVE {
            return Err(Error::config(format!(
                "temperature must be 0 (greedy) or at least {:e} (got {:e}); use 0 for greedy decoding",
                f32::MIN_POSITIVE,
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::config(format!(
                "top_p must be in (0, 1] (got {}); use 1.0 to disable nucleus sampling",
                self.top_p
            )));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(Error::config(format!("min_p must be in [0, 1] (got {}); use 0 to disable it", self.min_p)));
        }
        for (name, value) in
            [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)]
        {
            if !(-2.0..=2.0).contains(&value) {
                return Err(Error::config(format!("{name} must be in [-2, 2] (got {value}); use 0 to disable it")));
            }
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(Error::config(format!(
                "repetition_penalty must be a finite number > 0 (got {}); use 1 to disable it",
                self.repetition_penalty
            )));
        }
        if let Some((token, bias)) = self.logit_bias.iter().find(|(_, bias)| !(-100.0..=100.0).contains(bias)) {
            return Err(Error::config(format!("logit_bias of token {token} must be in [-100, 100] (got {bias})")));
        }
        if self.min_tokens > self.max_tokens {
            return Err(Error::config(format!(
                "min_tokens ({}) must not exceed max_tokens ({}); lower min_tokens or raise max_tokens",
                self.min_tokens, self.max_tokens
            )));
        }
        if !(1..=MAX_SAMPLES).contains(&self.n) {
            return Err(Error::config(format!(
                "n (samples of the prompt) must be in 1..={MAX_SAMPLES} (got {})",
                self.n
            )));
        }
        if let Some(n) = self.logprobs.filter(|&n| n > MAX_LOGPROBS) {
            return Err(Error::config(format!(
                "logprobs (top alternatives per token) must be in 0..={MAX_LOGPROBS} (got {n})"
            )));
        }
        if self.stop.iter().any(String::is_empty) {
            return Err(Error::config("stop strings must not be empty; remove the empty string from stop"));
        }
        if self.bad_words.iter().any(|w| w.trim().is_empty()) {
            return Err(Error::config("bad_words entries must hold a word; remove the empty or blank entry"));
        }
        if self.allowed_token_ids.as_ref().is_some_and(Vec::is_empty) {
            return Err(Error::config(
                "allowed_token_ids is empty, which allows no token; list at least one id, or pass None to allow all",
            ));
        }
        if let Some(k) = self.truncate_prompt_tokens.filter(|&k| k < 1 && k != TRUNCATE_TO_CONTEXT) {
            return Err(Error::config(format!(
                "truncate_prompt_tokens must be >= 1 (keep that many prompt tokens) or -1 (as many as the \
                 context holds) (got {k}); use None not to truncate"
            )));
        }
        Ok(())
    }

    /// The prompt this request runs on: `prompt` cut to its last `truncate_prompt_tokens` tokens
    /// (-1: to the `context_length`), or whole.
    pub fn truncated_prompt<'a>(&self, prompt: &'a [u32], context_length: usize) -> &'a [u32] {
        let keep = match self.truncate_prompt_tokens {
            None => return prompt,
            Some(TRUNCATE_TO_CONTEXT) => context_length,
            Some(k) => usize::try_from(k).unwrap_or(usize::MAX),
        };
        &prompt[prompt.len().saturating_sub(keep)..]
    }

    /// Token ids this request names (logit_bias, stop_token_ids, allowed_token_ids) outside a
    /// vocabulary of `vocab`.
    pub fn check_token_ids(&self, vocab: usize) -> Result<()> {
        let named = self.logit_bias.iter().map(|(t, _)| ("logit_bias", *t));
        let named = named.chain(self.stop_token_ids.iter().map(|&t| ("stop_token_ids", t)));
        let allowed = self.allowed_token_ids.iter().flatten();
        let named = named.chain(allowed.map(|&t| ("allowed_token_ids", t)));
        for (field, token) in named {
            if token as usize >= vocab {
                return Err(Error::config(format!(
                    "{field} names token id {token}, outside the vocabulary (ids are 0..{})",
                    vocab - 1
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_each_bad_field_by_name() {
        let bad = [
            (SamplingParams { max_tokens: 0, ..Default::default() }, "max_tokens"),
            (SamplingParams { temperature: -1.0, ..Default::default() }, "temperature"),
            (SamplingParams { temperature: f32::NAN, ..Default::default() }, "temperature"),
            // Found by fuzz/fuzz_targets/sampling_params.rs: 1 / 1e-45 is infinite, every probability NaN.
            (SamplingParams { temperature: 1e-45, ..Default::default() }, "temperature"),
            (SamplingParams { top_p: 0.0, ..Default::default() }, "top_p"),
            (SamplingParams { top_p: 1.5, ..Default::default() }, "top_p"),
            (SamplingParams { min_p: -0.1, ..Default::default() }, "min_p"),
            (SamplingParams { presence_penalty: 2.5, ..Default::default() }, "presence_penalty"),
            (SamplingParams { frequency_penalty: -3.0, ..Default::default() }, "frequency_penalty"),
            (SamplingParams { repetition_penalty: 0.0, ..Default::default() }, "repetition_penalty"),
            (SamplingParams { logit_bias: vec![(5, 101.0)], ..Default::default() }, "logit_bias"),
            (SamplingParams { min_tokens: 300, ..Default::default() }, "min_tokens"),
            (SamplingParams { logprobs: Some(21), ..Default::default() }, "logprobs"),
            (SamplingParams { n: 0, ..Default::default() }, "n (samples"),
            (SamplingParams { n: MAX_SAMPLES + 1, ..Default::default() }, "n (samples"),
            (SamplingParams { stop: vec!["".into()], ..Default::default() }, "stop"),
            (SamplingParams { bad_words: vec![" ".into()], ..Default::default() }, "bad_words"),
            (SamplingParams { allowed_token_ids: Some(vec![]), ..Default::default() }, "allowed_token_ids"),
            (SamplingParams { truncate_prompt_tokens: Some(0), ..Default::default() }, "truncate_prompt_tokens"),
            (SamplingParams { truncate_prompt_tokens: Some(-2), ..Default::default() }, "truncate_prompt_tokens"),
        ];
        for (params, field) in bad {
            let err = params.validate().unwrap_err();
            assert!(matches!(err, Error::Config(_)));
            assert!(err.to_string().contains(field), "{err}");
        }
        SamplingParams::default().validate().unwrap();
        let allowed = SamplingParams { allowed_token_ids: Some(vec![3, 9]), ..Default::default() };
        assert!(allowed.check_token_ids(9).unwrap_err().to_string().contains("allowed_token_ids names token id 9"));
        allowed.check_token_ids(10).unwrap();
    }

    #[test]
    fn vllms_defaults_sample_sixteen_tokens() {
        let d = SamplingParams::default();
        assert_eq!(
            (d.temperature, d.max_tokens, d.skip_special_tokens, d.spaces_between_special_tokens),
            (1.0, 16, true, true)
        );
        assert!(SamplingParams::greedy(5).is_greedy());
    }

    #[test]
    fn truncation_keeps_the_last_tokens() {
        let prompt = [1, 2, 3, 4, 5];
        let keep = |k| {
            SamplingParams { truncate_prompt_tokens: k, ..Default::default() }.truncated_prompt(&prompt, 4).to_vec()
        };
        assert_eq!(keep(None), prompt);
        assert_eq!(keep(Some(2)), [4, 5]);
        assert_eq!(keep(Some(9)), prompt);
        assert_eq!(keep(Some(TRUNCATE_TO_CONTEXT)), [2, 3, 4, 5]);
    }
}
