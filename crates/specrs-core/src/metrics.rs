//! Metrics: per-request latency (TTFT, ITL, throughput) from token arrival times, speculative
//! decoding counters with vLLM's names, their engine-wide sums, and the expected-speedup model.
//!
//! Every decode step of a speculating request that verified no draft counts as idle, by reason
//! (`IdleReason`), and the request's metrics say why in words (`idle_reason`), so speculation that
//! did nothing is never mistaken for speculation that did not help.
//!
//! Latency definitions match the anchor harness (`shared/anchors`): TTFT is request start to
//! first token; decode tokens/s is (n - 1) / (last token time - first token time); ITL is the gap
//! between consecutive tokens (tokens accepted together arrive together, so their gap is 0).
//! Acceptance follows vLLM: a draft is one step with at least one guessed token;
//! mean_acceptance_length = 1 + accepted / drafts; acceptance_rate = accepted / draft tokens.
//! Invariant: the engine-wide sums take fixed memory however long the engine serves (inter-token
//! gaps go into a fixed-size histogram; means stay exact).

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
    /// Why the request's speculation stood idle in most of its idle steps, in words with the
    /// figures behind it (None when it never did, or without speculation).
    pub idle_reason: Option<String>,
    pub spec: SpecDecodeMetrics,
    /// Per drafter, for a proposer that picks one per step ("auto"); empty otherwise.
    pub drafters: Vec<DrafterCounts>,
}

/// One drafter's share of a request's drafts ("auto": `proposer/auto.rs`).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct DrafterCounts {
    /// "suffix", "ngram", "draft_model".
    pub name: &'static str,
    pub num_drafts: usize,
    pub num_draft_tokens: usize,
    pub num_accepted_tokens: usize,
}

/// Why a decode step of a speculating request verified no draft.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdleReason {
    /// The adaptive length (or the tree chooser) predicted that no draft pays at the acceptance
    /// and costs it knows.
    Cost,
    /// The proposer found nothing to draft (no n-gram or suffix match).
    NoDraft,
    /// The scheduler's load budget granted the request no draft rows this step.
    Load,
    /// Too few tokens left before max_tokens for a draft.
    MaxTokens,
    /// The request's grammar forbade the whole draft.
    Grammar,
}

impl IdleReason {
    pub const ALL: [IdleReason; 5] =
        [IdleReason::Cost, IdleReason::NoDraft, IdleReason::Load, IdleReason::MaxTokens, IdleReason::Grammar];

    /// The name in metrics and Prometheus labels.
    pub fn as_str(self) -> &'static str {
        match self {
            IdleReason::Cost => "cost",
            IdleReason::NoDraft => "no_draft",
            IdleReason::Load => "load",
            IdleReason::MaxTokens => "max_tokens",
            IdleReason::Grammar => "grammar",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
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
    /// Drafts verified as token trees (the rest of `num_drafts` were chains); with trees,
    /// `num_accepted_tokens_per_pos` counts accepted tokens per depth.
    pub num_tree_drafts: usize,
    /// Nodes verified in those trees.
    pub num_tree_draft_tokens: usize,
    /// Tokens accepted from them (the accepted depths, summed).
    pub num_tree_accepted_tokens: usize,
    /// Their depths, summed.
    pub tree_depth_sum: usize,
    /// Draft tokens a grammar forced (requests with a grammar and `grammar_drafts`; counted in
    /// `num_draft_tokens` too).
    pub num_grammar_draft_tokens: usize,
    /// Of those, accepted (counted in `num_accepted_tokens` too).
    pub num_grammar_accepted_tokens: usize,
    /// Proposer draft tokens cut before verification because the grammar forbids them.
    pub num_grammar_cut_tokens: usize,
    /// Decode steps with speculation on that verified no draft, by `IdleReason` (in `ALL`'s order).
    pub idle_steps: [usize; 5],
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

    /// Records that the last draft was a tree of `num_nodes` nodes and `depth` levels, whose
    /// accepted path was `num_accepted_tokens` deep.
    pub fn observe_tree(&mut self, num_nodes: usize, depth: usize, num_accepted_tokens: usize) {
        self.num_tree_drafts += 1;
        self.num_tree_draft_tokens += num_nodes;
        self.num_tree_accepted_tokens += num_accepted_tokens;
        self.tree_depth_sum += depth;
    }

    /// Records a decode step that verified no draft, and why.
    pub fn observe_idle(&mut self, reason: IdleReason) {
        self.idle_steps[reason.index()] += 1;
    }

    /// Decode steps that verified no draft.
    pub fn num_idle_steps(&self) -> usize {
        self.idle_steps.iter().sum()
    }

    /// Idle steps by reason, `(name, count)` for every reason.
    pub fn idle_steps_by_reason(&self) -> Vec<(&'static str, usize)> {
        IdleReason::ALL.iter().map(|r| (r.as_str(), self.idle_steps[r.index()])).collect()
    }

    /// The reason of most idle steps (the first in `ALL`'s order on a tie), if any.
    pub fn main_idle_reason(&self) -> Option<IdleReason> {
        let most = *self.idle_steps.iter().max()?;
        (most > 0).then(|| IdleReason::ALL[self.idle_steps.iter().position(|&n| n == most).expect("the max")])
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
        self.num_tree_drafts += other.num_tree_drafts;
        self.num_tree_draft_tokens += other.num_tree_draft_tokens;
        self.num_tree_accepted_tokens += other.num_tree_accepted_tokens;
        self.tree_depth_sum += other.tree_depth_sum;
        self.num_grammar_draft_tokens += other.num_grammar_draft_tokens;
        self.num_grammar_accepted_tokens += other.num_grammar_accepted_tokens;
        self.num_grammar_cut_tokens += other.num_grammar_cut_tokens;
        for (sum, count) in self.idle_steps.iter_mut().zip(other.idle_steps) {
            *sum += count;
        }
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

/// Engine-wide sums over finished requests, in memory that does not grow with the number of
/// requests or tokens served: TTFT as a sum and a count, inter-token gaps in a `LatencyHistogram`;
/// and the grammars compiled or taken from the grammar cache as requests start or are checked.
#[derive(Debug, Clone, Default)]
pub struct EngineMetrics {
    pub num_requests: usize,
    pub num_prompt_tokens: usize,
    pub num_generated_tokens: usize,
    pub spec: SpecDecodeMetrics,
    /// Sum of the time-to-first-token of every request that produced a token.
    pub ttft_s_sum: f64,
    /// Requests counted in `ttft_s_sum`.
    pub num_ttfts: usize,
    /// Every inter-token gap of every request.
    pub itls: LatencyHistogram,
    /// Grammars llguidance compiled (`Engine::compile_grammar`; failed compiles included).
    pub num_grammar_compiles: usize,
    /// Grammars a request or a check took from the engine's grammar cache instead of compiling.
    pub num_grammar_cache_hits: usize,
}

impl EngineMetrics {
    pub fn record(&mut self, request: &RequestMetrics, itls_s: &[f64]) {
        self.num_requests += 1;
        self.num_prompt_tokens += request.num_prompt_tokens;
        self.num_generated_tokens += request.num_generated_tokens;
        self.spec.add(&request.spec);
        if request.num_generated_tokens > 0 {
            self.ttft_s_sum += request.ttft_s;
            self.num_ttfts += 1;
        }
        for &gap in itls_s {
            self.itls.record(gap);
        }
    }

    pub fn ttft_s_mean(&self) -> f64 {
        if self.num_ttfts == 0 {
            0.0
        } else {
            self.ttft_s_sum / self.num_ttfts as f64
        }
    }

    /// Exact (a running sum over a count).
    pub fn itl_s_mean(&self) -> f64 {
        self.itls.mean()
    }

    /// Within `LatencyHistogram`'s accuracy of the exact nearest-rank percentile.
    pub fn itl_s_percentile(&self, q: f64) -> f64 {
        self.itls.percentile(q)
    }

    /// Decode tokens/s over all requests: gaps / time spent in gaps (exact).
    pub fn decode_tokens_per_s(&self) -> f64 {
        if self.itls.sum_s() > 0.0 {
            self.itls.count() as f64 / self.itls.sum_s()
        } else {
            0.0
        }
    }
}

/// Smallest gap a `LatencyHistogram` resolves (100 ns); smaller non-zero gaps land in its first bucket.
const HISTOGRAM_MIN_S: f64 = 1e-7;
/// Each bucket's upper edge over its lower edge: reporting a bucket's geometric middle is within
/// sqrt(1.02) - 1 < 1% of any value in it.
const HISTOGRAM_GROWTH: f64 = 1.02;
/// Buckets from 100 ns up to 1e4 s (1.02^1280 x 1e-7 s = 1.0e4 s); larger gaps land in the last one.
const HISTOGRAM_BUCKETS: usize = 1280;

/// Durations in fixed memory (1280 counters, about 10 KB, however many are recorded).
///
/// Invariant: `count`, `sum_s`, `min_s` and `max_s` are exact, so the mean is exact; zero gaps
/// (tokens accepted in the same step arrive together) are counted exactly; a non-zero duration
/// falls in a log-spaced bucket 2% wide, so a percentile is the nearest-rank percentile to within
/// 1% relative for durations between 100 ns and 10^4 s (clamped to the exact min and max, so a
/// single repeated value comes back exactly).
#[derive(Debug, Clone)]
pub struct LatencyHistogram {
    count: u64,
    sum_s: f64,
    min_s: f64,
    max_s: f64,
    num_zero: u64,
    /// `[HISTOGRAM_BUCKETS]`: bucket i holds durations in [MIN x GROWTH^i, MIN x GROWTH^(i+1)).
    buckets: Vec<u64>,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self {
            count: 0,
            sum_s: 0.0,
            min_s: f64::INFINITY,
            max_s: 0.0,
            num_zero: 0,
            buckets: vec![0; HISTOGRAM_BUCKETS],
        }
    }
}

impl LatencyHistogram {
    /// Adds one duration; negative or non-finite ones (a clock gone wrong) count as 0.
    pub fn record(&mut self, duration_s: f64) {
        let d = if duration_s.is_finite() && duration_s > 0.0 { duration_s } else { 0.0 };
        self.count += 1;
        self.sum_s += d;
        self.min_s = self.min_s.min(d);
        self.max_s = self.max_s.max(d);
        if d == 0.0 {
            self.num_zero += 1;
        } else {
            self.buckets[Self::bucket(d)] += 1;
        }
    }

    fn bucket(d: f64) -> usize {
        let i = ((d / HISTOGRAM_MIN_S).ln() / HISTOGRAM_GROWTH.ln()).floor();
        if i <= 0.0 {
            0
        } else {
            (i as usize).min(HISTOGRAM_BUCKETS - 1)
        }
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn sum_s(&self) -> f64 {
        self.sum_s
    }

    pub fn mean(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum_s / self.count as f64
        }
    }

    /// The nearest-rank `q` percentile (0 when empty), to the accuracy above.
    pub fn percentile(&self, q: f64) -> f64 {
        if self.count == 0 {
            return 0.0;
        }
        let rank = ((q * self.count as f64).ceil() as u64).clamp(1, self.count);
        if rank <= self.num_zero {
            return 0.0;
        }
        let mut seen = self.num_zero;
        for (i, &n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                let middle = HISTOGRAM_MIN_S * HISTOGRAM_GROWTH.powf(i as f64 + 0.5);
                return middle.clamp(self.min_s, self.max_s);
            }
        }
        self.max_s
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
        m.observe_idle(IdleReason::NoDraft);
        m.observe_idle(IdleReason::Cost);
        m.observe_idle(IdleReason::Cost);
        assert_eq!((m.num_idle_steps(), m.main_idle_reason()), (3, Some(IdleReason::Cost)));
        let mut sum = SpecDecodeMetrics::default();
        sum.add(&m);
        sum.add(&m);
        assert_eq!(sum.num_accepted_tokens_per_pos, vec![4, 4, 2]);
        assert_eq!(sum.idle_steps_by_reason()[..2], [("cost", 4), ("no_draft", 2)]);
        assert_eq!(SpecDecodeMetrics::default().main_idle_reason(), None);
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

    #[test]
    fn latency_histogram_percentiles_are_within_one_percent_in_fixed_memory() {
        let mut h = LatencyHistogram::default();
        // Gaps from 10 us to 2 s on a deterministic spread, plus zeros (tokens of one step).
        let mut exact: Vec<f64> = (0..100_000u64)
            .map(|i| if i % 7 == 0 { 0.0 } else { 1e-5 * (2e5f64).powf(((i * 7919) % 100_000) as f64 / 1e5) })
            .collect();
        for &gap in &exact {
            h.record(gap);
        }
        assert_eq!(h.buckets.len(), HISTOGRAM_BUCKETS, "the memory does not grow with the samples");
        exact.sort_by(f64::total_cmp);
        let exact_mean = exact.iter().sum::<f64>() / exact.len() as f64;
        assert!((h.mean() - exact_mean).abs() <= 1e-12 * exact_mean, "the mean is exact");
        for q in [0.01, 0.1, 0.14, 0.5, 0.9, 0.99, 0.999, 1.0] {
            let want = percentile(&exact, q);
            let got = h.percentile(q);
            if want == 0.0 {
                assert_eq!(got, 0.0, "zeros are exact (q = {q})");
            } else {
                assert!((got - want).abs() <= 0.01 * want, "q = {q}: {got} vs exact {want}");
            }
        }
        let mut one = LatencyHistogram::default();
        for _ in 0..10 {
            one.record(0.0123);
        }
        assert_eq!((one.percentile(0.5), one.percentile(0.99)), (0.0123, 0.0123), "clamped to min/max");
        assert_eq!(LatencyHistogram::default().percentile(0.5), 0.0);
    }

    #[test]
    fn engine_metrics_sum_requests_without_keeping_every_gap() {
        let mut m = EngineMetrics::default();
        let request = RequestMetrics { num_generated_tokens: 3, ttft_s: 0.5, ..Default::default() };
        m.record(&request, &[0.01, 0.03]);
        m.record(&request, &[0.02]);
        assert_eq!((m.num_requests, m.itls.count()), (2, 3));
        assert!((m.ttft_s_mean() - 0.5).abs() < 1e-12);
        assert!((m.itl_s_mean() - 0.02).abs() < 1e-12);
        assert!((m.decode_tokens_per_s() - 50.0).abs() < 1e-9);
        assert!((m.itl_s_percentile(0.5) - 0.02).abs() <= 0.01 * 0.02);
    }
}
