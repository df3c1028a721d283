//! Per-request latency metrics (TTFT, ITL, throughput) from token arrival times.
//!
//! Definitions match the anchor harness (`shared/anchors`): TTFT is request start to first token;
//! decode tokens/s is (n - 1) / (last token time - first token time); ITL is the gap between
//! consecutive tokens.

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
        let mut itls: Vec<f64> = self.token_times.windows(2).map(|w| secs(w[0], w[1])).collect();
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
}
