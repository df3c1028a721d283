//! Metrics: per-request latency (TTFT, ITL, throughput) from token arrival times, speculative
//! decoding counters with vLLM's names, their engine-wide sums, and the expected-speedup model.
//!
//! Latency definitions match the anchor harness (`shared/anchors`): TTFT is request start to
//! first token; decode tokens/s is (n - 1) / (last token time - first token time); ITL is the gap
//! between consecutive tokens (tokens accepted together arrive together, so their gap is 0).
//! Acceptance follows vLLM: a draft is one step with at least one guessed token;
//! mean_acceptance_length = 1 + accepted / drafts; acceptance_rate = accepted / draft tokens.

use std::time::Instant;

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RequestMetrics {
    pub num_prompt_tokens: usize,
    pub num_generated_tokens: usize,
    /// Target-model forward passes, prefill included.
    pub num_forward_passes: usize,
    pub ttft_s: f64,
    pub e2e_s: f64,
    pub itl_s_mean: f64,
    pub itl_s_p50: f64,
    pub itl_s_p99: f64,
    pub decode_tokens_per_s: f64,
    pub prefill_tokens_per_s: f64,
    /// The proposer's method ("ngram", "suffix", "custom"), None without speculation.
    pub spec_method: Option<String>,
    /// k: the most tokens one step may guess (0 without speculation).
    pub num_speculative_tokens: usize,
    /// Where the adaptive draft length's verification curve and draft cost came from
    /// ("measured", "cached", "config", "extrapolated", "prior"; None without the policy or, for
    /// the draft cost, with a model-free proposer).
    pub verify_cost_source: Option<&'static str>,
    pub draft_cost_source: Option<&'static str>,
    pub spec: SpecDecodeMetrics,
}

/// Speculative decoding counters and where decode time went.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct SpecDecodeMetrics {
    pub num_drafts: usize,
    pub num_draft_tokens: usize,
    pub num_accepted_tokens: usize,
    /// `[k]`: how often the token at each draft position was accepted.
    pub num_accepted_tokens_per_pos: Vec<usize>,
    /// Decode steps after the prefill (with or without a draft).
    pub num_decode_steps: usize,
    /// Seconds in the proposer.
    pub propose_s: f64,
    /// Seconds in decode-step target forwards.
    pub forward_s: f64,
    /// Seconds choosing tokens from the logits (acceptance, recovery, plain sampling).
    pub verify_s: f64,
}

impl SpecDecodeMetrics {
    /// Records one draft of `num_draft_tokens` of which the first `num_accepted_tokens` passed.
    pub fn observe_draft(&mut self, num_draft_tokens: usize, num_accepted_tokens: usize) {
        self.num_drafts += 1;
        self.num_draft_tokens += num_draft_tokens;
        self.num_accepted_tokens += num_accepted_tokens;
        if self.num_accepted_tokens_per_pos.len() < num_accepted_tokens {
            self.num_accepted_tokens_per_pos.resize(num_accepted_tokens, 0);
        }
        for count in &mut self.num_accepted_tokens_per_pos[..num_accepted_tokens] {
            *count += 1;
        }
    }

    pub fn add(&mut self, other: &SpecDecodeMetrics) {
        self.num_drafts += other.num_drafts;
        self.num_draft_tokens += other.num_draft_tokens;
        self.num_accepted_tokens += other.num_accepted_tokens;
        if self.num_accepted_tokens_per_pos.len() < other.num_accepted_tokens_per_pos.len() {
            self.num_accepted_tokens_per_pos.resize(other.num_accepted_tokens_per_pos.len(), 0);
        }
        for (sum, &count) in self.num_accepted_tokens_per_pos.iter_mut().zip(&other.num_accepted_tokens_per_pos) {
            *sum += count;
        }
        self.num_decode_steps += other.num_decode_steps;
        self.propose_s += other.propose_s;
        self.forward_s += other.forward_s;
        self.verify_s += other.verify_s;
    }

    /// 1 + accepted / drafts (1.0 with no drafts: every step yields one token).
    pub fn mean_acceptance_length(&self) -> f64 {
        1.0 + ratio(self.num_accepted_tokens, self.num_drafts)
    }

    /// accepted / draft tokens.
    pub fn acceptance_rate(&self) -> f64 {
        ratio(self.num_accepted_tokens, self.num_draft_tokens)
    }

    /// vLLM's per-position rate: drafts whose i-th token was accepted, over all drafts (0 without).
    pub fn acceptance_rate_per_pos(&self) -> Vec<f64> {
        self.num_accepted_tokens_per_pos.iter().map(|&count| ratio(count, self.num_drafts)).collect()
    }

    /// Mean guessed tokens per draft.
    pub fn mean_draft_length(&self) -> f64 {
        ratio(self.num_draft_tokens, self.num_drafts)
    }
}

fn ratio(a: usize, b: usize) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Expected speedup over plain decoding, textbook form (Leviathan et al. 2023): with per-token
/// acceptance `a`, `k` draft tokens per step and total draft cost `c` per step relative to one
/// target step, (1 - a^(k+1)) / ((1 - a)(1 + c)). It assumes verifying k+1 tokens costs the same as
/// one step, which holds on a GPU at small batch and not on a CPU.
pub fn expected_speedup_textbook(a: f64, k: f64, c: f64) -> f64 {
    expected_tokens_per_step(a, k) / (1.0 + c)
}

/// The refined form: the same tokens per step divided by the measured verify cost
/// `v = t(k+1) / t(1)` plus the draft cost `c`.
pub fn expected_speedup_refined(a: f64, k: f64, c: f64, v: f64) -> f64 {
    expected_tokens_per_step(a, k) / (v + c)
}

/// v(k+1) from the curve `[v(1), v(2), ...]`, interpolated linearly for a fractional k (the mean
/// draft length) and clamped to the curve's last point.
pub fn verify_cost_at(verify_cost_ratios: &[f64], k: f64) -> f64 {
    let last = verify_cost_ratios.len().saturating_sub(1);
    let (low, frac) = ((k.floor() as usize).min(last), k - k.floor());
    verify_cost_ratios[low] * (1.0 - frac) + verify_cost_ratios[(low + 1).min(last)] * frac
}

/// (1 - a^(k+1)) / (1 - a): tokens per step when each draft token passes independently with
/// probability a.
fn expected_tokens_per_step(a: f64, k: f64) -> f64 {
    if (1.0 - a).abs() < 1e-9 {
        k + 1.0
    } else {
        (1.0 - a.powf(k + 1.0)) / (1.0 - a)
    }
}

/// Engine-wide sums over finished requests.
#[derive(Debug, Clone, Default)]
pub struct EngineMetrics {
    pub num_requests: usize,
    pub num_prompt_tokens: usize,
    pub num_generated_tokens: usize,
    pub spec: SpecDecodeMetrics,
    /// Time-to-first-token of every request.
    pub ttfts_s: Vec<f64>,
    /// Every inter-token gap of every request.
    pub itls_s: Vec<f64>,
}

impl EngineMetrics {
    pub fn record(&mut self, request: &RequestMetrics, itls_s: &[f64]) {
        self.num_requests += 1;
        self.num_prompt_tokens += request.num_prompt_tokens;
        self.num_generated_tokens += request.num_generated_tokens;
        self.spec.add(&request.spec);
        if request.num_generated_tokens > 0 {
            self.ttfts_s.push(request.ttft_s);
        }
        self.itls_s.extend_from_slice(itls_s);
    }

    pub fn ttft_s_mean(&self) -> f64 {
        mean(&self.ttfts_s)
    }

    pub fn itl_s_mean(&self) -> f64 {
        mean(&self.itls_s)
    }

    pub fn itl_s_percentile(&self, q: f64) -> f64 {
        let mut sorted = self.itls_s.clone();
        sorted.sort_by(f64::total_cmp);
        percentile(&sorted, q)
    }

    /// Decode tokens/s over all requests: gaps / time spent in gaps.
    pub fn decode_tokens_per_s(&self) -> f64 {
        let total: f64 = self.itls_s.iter().sum();
        if total > 0.0 {
            self.itls_s.len() as f64 / total
        } else {
            0.0
        }
    }
}

fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

/// Arrival time of every generated token of one request.
pub struct RequestTimer {
    start: Instant,
    token_times: Vec<Instant>,
}

impl Default for RequestTimer {
    fn default() -> Self {
        Self::new()
    }
}

impl RequestTimer {
    pub fn new() -> Self {
        Self { start: Instant::now(), token_times: Vec::new() }
    }

    /// Records `count` tokens that became available now.
    pub fn tokens_arrived(&mut self, count: usize) {
        let now = Instant::now();
        self.token_times.extend(std::iter::repeat_n(now, count));
    }

    /// Gaps between consecutive tokens.
    pub fn itls_s(&self) -> Vec<f64> {
        self.token_times.windows(2).map(|w| w[1].duration_since(w[0]).as_secs_f64()).collect()
    }

    pub fn metrics(&self, num_prompt_tokens: usize, num_forward_passes: usize) -> RequestMetrics {
        let n = self.token_times.len();
        let secs = |a: Instant, b: Instant| b.duration_since(a).as_secs_f64();
        let mut m =
            RequestMetrics { num_prompt_tokens, num_generated_tokens: n, num_forward_passes, ..Default::default() };
        let (Some(&first), Some(&last)) = (self.token_times.first(), self.token_times.last()) else {
            return m;
        };
        m.ttft_s = secs(self.start, first);
        m.e2e_s = secs(self.start, last);
        m.prefill_tokens_per_s = if m.ttft_s > 0.0 { num_prompt_tokens as f64 / m.ttft_s } else { 0.0 };
        let mut itls = self.itls_s();
        if !itls.is_empty() {
            let decode_s = secs(first, last);
            m.itl_s_mean = decode_s / itls.len() as f64;
            m.decode_tokens_per_s = if decode_s > 0.0 { itls.len() as f64 / decode_s } else { 0.0 };
            itls.sort_by(f64::total_cmp);
            m.itl_s_p50 = percentile(&itls, 0.50);
            m.itl_s_p99 = percentile(&itls, 0.99);
        }
        m
    }
}

/// Nearest-rank percentile of sorted values.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(|x| x as f64).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&[3.0], 0.99), 3.0);
    }

    #[test]
    fn counts_tokens_and_intervals() {
        let mut t = RequestTimer::new();
        t.tokens_arrived(1);
        std::thread::sleep(std::time::Duration::from_millis(5));
        t.tokens_arrived(2);
        let m = t.metrics(10, 2);
        assert_eq!(m.num_generated_tokens, 3);
        assert!(m.itl_s_mean > 0.002 && m.decode_tokens_per_s > 0.0);
        assert!(m.e2e_s >= m.ttft_s);
    }

    #[test]
    fn acceptance_counters_follow_vllm() {
        let mut m = SpecDecodeMetrics::default();
        m.observe_draft(4, 2);
        m.observe_draft(4, 0);
        m.observe_draft(3, 3);
        assert_eq!(m.num_accepted_tokens_per_pos, vec![2, 2, 1]);
        assert_eq!(m.mean_acceptance_length(), 1.0 + 5.0 / 3.0);
        assert_eq!(m.acceptance_rate(), 5.0 / 11.0);
        assert_eq!(m.acceptance_rate_per_pos(), vec![2.0 / 3.0, 2.0 / 3.0, 1.0 / 3.0]);
        let mut sum = SpecDecodeMetrics::default();
        sum.add(&m);
        sum.add(&m);
        assert_eq!(sum.num_accepted_tokens_per_pos, vec![4, 4, 2]);
        assert_eq!(SpecDecodeMetrics::default().mean_acceptance_length(), 1.0);
    }

    #[test]
    fn speedup_model_limits() {
        // a = 0: one token per step; a = 1: k + 1 tokens per step.
        assert_eq!(expected_speedup_textbook(0.0, 4.0, 0.0), 1.0);
        assert!((expected_speedup_textbook(1.0, 4.0, 0.0) - 5.0).abs() < 1e-9);
        // a = 0.5, k = 2: 1 + 0.5 + 0.25 tokens per step.
        assert!((expected_speedup_textbook(0.5, 2.0, 0.25) - 1.75 / 1.25).abs() < 1e-12);
        assert!((expected_speedup_refined(0.5, 2.0, 0.0, 1.4) - 1.75 / 1.4).abs() < 1e-12);
        let curve = [1.0, 1.4, 1.6, 2.0];
        assert_eq!(verify_cost_at(&curve, 1.0), 1.4);
        assert!((verify_cost_at(&curve, 1.5) - 1.5).abs() < 1e-12);
        assert_eq!(verify_cost_at(&curve, 7.0), 2.0);
    }
}
