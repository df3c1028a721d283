//! Per-step proposer cost at growing context lengths: `cargo bench --bench proposer_cost`.
//!
//! One decode step = the context grows by one token, then `propose(context, 8)`. The n-gram proposer
//! indexes only the new token; the two references rescan the whole context every step, as a
//! stateless prompt lookup must. Streams are repeated phrases with noise over a 49152-token vocab,
//! so matches are frequent but not guaranteed (a noisy last token forces a full miss scan).
//! The suffix-decoding proposer is timed the same way (fresh global cache, so only this request's
//! own tokens are in its tree).

use std::hint::black_box;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use specrs_core::proposer::ngram::NgramProposer;
use specrs_core::proposer::suffix::{SuffixCache, SuffixParams, SuffixProposer};
use specrs_core::proposer::Proposer;

const VOCAB: u64 = 49152;
const MAX_TOKENS: usize = 8;
const MIN_N: usize = 2;
const MAX_N: usize = 5;
const CONTEXT_LENGTHS: [usize; 3] = [1024, 4096, 32768];
const STEPS: usize = 2000;
const RUNS: usize = 3;

/// xorshift64*: deterministic, dependency-free randomness.
struct Rng(u64);

impl Rng {
    fn below(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) % bound
    }
}

/// A token id skewed towards small ids (common tokens), like a real tokenizer's.
fn token(rng: &mut Rng) -> u32 {
    let bound = rng.below(VOCAB) + 1;
    rng.below(bound) as u32
}

/// Text-like tokens: phrases from a bank (recently used ones favoured, as in code or edited prose),
/// each token replaced by a random one 5% of the time, with occasional runs of fresh tokens.
fn token_stream(len: usize) -> Vec<u32> {
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let phrases: Vec<Vec<u32>> = (0..300).map(|_| (0..5 + rng.below(36)).map(|_| token(&mut rng)).collect()).collect();
    let mut recent: Vec<usize> = Vec::new();
    let mut stream = Vec::with_capacity(len);
    while stream.len() < len {
        let phrase = if !recent.is_empty() && rng.below(10) < 7 {
            recent[rng.below(recent.len() as u64) as usize]
        } else {
            rng.below(phrases.len() as u64) as usize
        };
        recent.push(phrase);
        if recent.len() > 20 {
            recent.remove(0);
        }
        for &t in &phrases[phrase] {
            stream.push(if rng.below(100) < 5 { token(&mut rng) } else { t });
        }
        if rng.below(10) < 3 {
            for _ in 0..1 + rng.below(10) {
                stream.push(token(&mut rng));
            }
        }
    }
    stream.truncate(len);
    stream
}

/// Stateless reference, the simplest correct rescan: for each n (longest first), walk back from
/// the end and stop at the most recent earlier occurrence. Cheap when a match is recent, O(len) per
/// n on a miss.
fn rescan_backward(context: &[u32]) -> Vec<u32> {
    let len = context.len();
    for n in (MIN_N..=MAX_N).rev() {
        if n >= len {
            continue;
        }
        let suffix = &context[len - n..];
        for end in (n..len).rev() {
            if &context[end - n..end] == suffix {
                return context[end..len.min(end + MAX_TOKENS)].to_vec();
            }
        }
    }
    Vec::new()
}

/// Stateless reference with vLLM's cost profile: one pass over every position of the context each
/// step (vLLM's KMP always scans it all), keeping the longest suffix match seen, the latest on ties.
fn rescan_full(context: &[u32]) -> Vec<u32> {
    let len = context.len();
    let (mut best_n, mut best_end) = (0, 0);
    for end in 1..len {
        let mut n = 0;
        while n < MAX_N && n < end && context[end - 1 - n] == context[len - 1 - n] {
            n += 1;
        }
        if n >= MIN_N && n >= best_n {
            (best_n, best_end) = (n, end);
        }
    }
    if best_n == 0 {
        return Vec::new();
    }
    context[best_end..len.min(best_end + MAX_TOKENS)].to_vec()
}

fn new_suffix_proposer() -> SuffixProposer {
    let params =
        SuffixParams { max_tree_depth: 24, max_cached_requests: 10000, max_spec_factor: 1.0, min_token_prob: 0.1 };
    SuffixProposer::new(params, Arc::new(Mutex::new(SuffixCache::new(24, 10000))))
}

/// Time of the first `propose` on `context` (the prefill: indexing the whole prompt), in ms.
fn prefill_ms(mut proposer: impl Proposer, context: &[u32]) -> f64 {
    let timer = Instant::now();
    black_box(proposer.propose(context, MAX_TOKENS).unwrap());
    timer.elapsed().as_secs_f64() * 1e3
}

/// Best-of-`RUNS` mean time per step, in microseconds, for `STEPS` steps starting at `start` tokens.
/// `prepare` builds fresh per-run state and sees the initial context (untimed: that is the prefill).
fn per_step_us<S>(
    stream: &[u32],
    start: usize,
    mut prepare: impl FnMut(&[u32]) -> S,
    mut step: impl FnMut(&mut S, &[u32]) -> Vec<u32>,
) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..RUNS {
        let mut state = prepare(&stream[..start]);
        let timer = Instant::now();
        for i in 1..=STEPS {
            black_box(step(&mut state, black_box(&stream[..start + i])));
        }
        best = best.min(timer.elapsed().as_secs_f64() * 1e6 / STEPS as f64);
    }
    best
}

fn main() {
    let stream = token_stream(CONTEXT_LENGTHS[CONTEXT_LENGTHS.len() - 1] + STEPS);

    // The incremental proposer must agree with both stateless references (sampled: checking every
    // length would cost more than the benchmark).
    let mut check = NgramProposer::new(MIN_N, MAX_N);
    let mut hits = 0;
    for len in 1..stream.len() {
        let draft = check.propose(&stream[..len], MAX_TOKENS).unwrap().token_ids;
        if len < 2048 || len % 17 == 0 {
            assert_eq!(draft, rescan_backward(&stream[..len]), "mismatch at length {len}");
            assert_eq!(draft, rescan_full(&stream[..len]), "mismatch at length {len}");
        }
        hits += usize::from(!draft.is_empty());
    }

    println!("proposer_cost: n in {MIN_N}..={MAX_N}, k={MAX_TOKENS}, vocab {VOCAB}, {STEPS} steps of 1 new token");
    println!("  ngram draft non-empty at {:.0}% of steps", 100.0 * hits as f64 / (stream.len() - 1) as f64);
    println!(
        "{:>8} | {:>14} | {:>16} | {:>14} | {:>14} | {:>13} | {:>14} | {:>17}",
        "context",
        "ngram step us",
        "ngram prefill ms",
        "rescan back us",
        "rescan full us",
        "ngram speedup",
        "suffix step us",
        "suffix prefill ms"
    );
    for &start in &CONTEXT_LENGTHS {
        let ngram = per_step_us(
            &stream,
            start,
            |context| {
                let mut proposer = NgramProposer::new(MIN_N, MAX_N);
                proposer.propose(context, MAX_TOKENS).unwrap();
                proposer
            },
            |proposer, context| proposer.propose(context, MAX_TOKENS).unwrap().token_ids,
        );
        let ngram_prefill = prefill_ms(NgramProposer::new(MIN_N, MAX_N), &stream[..start]);
        let back = per_step_us(&stream, start, |_| (), |_, context| rescan_backward(context));
        let full = per_step_us(&stream, start, |_| (), |_, context| rescan_full(context));
        // Against the faster of the two stateless references.
        let speedup = back.min(full) / ngram;
        let suffix = per_step_us(
            &stream,
            start,
            |context| {
                let mut proposer = new_suffix_proposer();
                proposer.propose(context, MAX_TOKENS).unwrap();
                proposer
            },
            |proposer, context| proposer.propose(context, MAX_TOKENS).unwrap().token_ids,
        );
        let suffix_prefill = prefill_ms(new_suffix_proposer(), &stream[..start]);
        println!(
            "{:>8} | {:>14.3} | {:>16.3} | {:>14.2} | {:>14.2} | {:>12.0}x | {:>14.3} | {:>17.3}",
            start, ngram, ngram_prefill, back, full, speedup, suffix, suffix_prefill
        );
    }
}
