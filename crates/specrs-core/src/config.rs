//! Per-request settings: `SamplingParams` (vLLM's names and defaults).
//!
//! Invariant: a `SamplingParams` that passed `validate()` can be handed to the sampler without
//! further checks; every rejection names the field and the valid range.

use crate::error::{Error, Result};

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Maximum number of tokens to generate (>= 1).
    pub max_tokens: usize,
    /// 0 means greedy (argmax); > 0 divides the logits before the softmax.
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
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self { max_tokens: 256, temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: None, ignore_eos: false }
    }
}

impl SamplingParams {
    pub fn greedy(max_tokens: usize) -> Self {
        Self { max_tokens, ..Self::default() }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// The distribution is softmax(logits / temperature) alone (or greedy): no top-k, top-p or
    /// min-p filter.
    pub fn is_temperature_only(&self) -> bool {
        self.top_k == 0 && self.top_p >= 1.0 && self.min_p <= 0.0
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
        ];
        for (params, field) in bad {
            let err = params.validate().unwrap_err();
            assert!(matches!(err, Error::Config(_)));
            assert!(err.to_string().contains(field), "{err}");
        }
        SamplingParams::default().validate().unwrap();
    }
}
