//! Speculation budgeted by load: how many draft tokens each request of a batched step gets.
//!
//! Why: one forward's time grows with its rows. Alone, a request's spare rows are nearly free (a
//! decode step on a CPU is bound by reading the weights, so 5 rows cost ~1.8 single-row steps), and
//! its own policy (`draft_length.rs`) drafts whenever that pays. In a full batch the weights are
//! already read for the other requests' rows, each extra row costs its full compute, and a draft
//! token that is accepted with probability 0.3 buys less than the time it takes from everyone.
//! vLLM keeps k fixed whatever the load; here each step spends draft rows where they buy the most
//! tokens per second of the whole batch, and none once they stop paying.
//!
//! Model: a step with R rows takes T(R) seconds (`BatchCost`, measured: one forward over R rows
//! on a 512-token context) plus, for model-based drafts, c_i * T(1) per draft token of request i
//! (per draft, for a block drafter: its first draft token carries the whole forward).
//! Request i with per-token acceptance a_i yields 1 + a_i + ... + a_i^d tokens from a d-token
//! draft, so its j-th draft token adds a_i^j expected tokens. `grant` adds draft tokens one at a
//! time, each time the one with the largest gain per unit of its cost, and keeps the prefix of
//! that order with the most expected tokens per second; ties go to the earlier request.
//!
//! Invariants: a grant never exceeds the request's own wish (speculation off stays off, a fixed k
//! is a cap, its own adaptive choice is a cap); a pinned request (one whose output would change
//! with its draft length, see engine/scheduler.rs) gets its wish whole; the total never exceeds
//! `max_draft_rows`. This only shortens drafts of requests whose tokens do not depend on them, so
//! it changes speed, never output.

use crate::costs::DraftCost;

/// What one decoding request would draft alone this step, and what the budget needs to price it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DraftWish {
    /// The draft length the request would ask its proposer for alone (0: none).
    pub max_tokens: usize,
    /// Its measured per-token acceptance (the prior until it has drafted).
    pub acceptance: f64,
    /// c: its drafting time over T(1), per token or per draft (free for model-free proposers).
    pub draft_cost: DraftCost,
    /// Granted whole, whatever the load.
    pub pinned: bool,
}

/// T(R): seconds of one forward over R rows, from a measured curve `[T(1), ..., T(n)]` extended
/// past its end along its last slope.
#[derive(Debug, Clone)]
pub struct BatchCost {
    costs_s: Vec<f64>,
}

impl BatchCost {
    /// `costs_s`: `[T(1), ..., T(n)]`, n >= 1, each > 0. Kept non-decreasing (a forward over more
    /// rows never costs less), as the verification curve is.
    pub fn new(costs_s: &[f64]) -> Option<Self> {
        if costs_s.is_empty() || costs_s.iter().any(|t| !t.is_finite() || *t <= 0.0) {
            return None;
        }
        let mut costs_s = costs_s.to_vec();
        for i in 1..costs_s.len() {
            costs_s[i] = costs_s[i].max(costs_s[i - 1]);
        }
        Some(Self { costs_s })
    }

    /// T(rows) in seconds (T(0) = 0).
    pub fn time_s(&self, rows: usize) -> f64 {
        let n = self.costs_s.len();
        match rows {
            0 => 0.0,
            r if r <= n => self.costs_s[r - 1],
            r => {
                let slope = if n >= 2 { self.costs_s[n - 1] - self.costs_s[n - 2] } else { self.costs_s[0] };
                self.costs_s[n - 1] + slope * (r - n) as f64
            }
        }
    }

    /// Rows measured (the curve is extrapolated past them).
    pub fn num_measured(&self) -> usize {
        self.costs_s.len()
    }
}

/// Draft tokens per request for a step whose other rows (decode rows, prompt chunks, pinned
/// drafts excluded) number `fixed_rows`, with at most `max_draft_rows` draft rows in all.
pub fn grant(wishes: &[DraftWish], fixed_rows: usize, max_draft_rows: usize, cost: &BatchCost) -> Vec<usize> {
    let mut grants: Vec<usize> = vec![0; wishes.len()];
    let mut rows = fixed_rows;
    let mut left = max_draft_rows;
    let mut draft_time = 0.0;
    let mut tokens = 0.0; // expected tokens beyond the one each decoding request yields anyway
    for (i, wish) in wishes.iter().enumerate().filter(|(_, w)| w.pinned) {
        let granted = wish.max_tokens.min(left);
        grants[i] = granted;
        left -= granted;
        rows += granted;
        draft_time += wish.draft_cost.of(granted) * cost.time_s(1);
        tokens += (1..=granted).map(|j| wish.acceptance.powi(j as i32)).sum::<f64>();
    }
    let base_tokens = wishes.len() as f64;
    let rate = |tokens: f64, rows: usize, draft_time: f64| (base_tokens + tokens) / (cost.time_s(rows) + draft_time);

    // Greedy order: the next draft token with the largest gain per unit of its cost, where one
    // row costs ~1 (in units of T(1)) plus what it adds to its draft's cost (c per token; a
    // block drafter's first token carries its whole forward, the rest none).
    let mut trial = grants.clone();
    let mut best = (rate(tokens, rows, draft_time), trial.clone());
    while left > 0 {
        let next = wishes
            .iter()
            .enumerate()
            .filter(|(i, w)| !w.pinned && trial[*i] < w.max_tokens)
            .map(|(i, w)| (i, w.acceptance.powi(trial[i] as i32 + 1) / (1.0 + w.draft_cost.marginal(trial[i]))))
            .fold(None, |best: Option<(usize, f64)>, (i, value)| match best {
                Some((_, b)) if b >= value => best,
                _ => Some((i, value)),
            });
        let Some((i, _)) = next else { break };
        draft_time += wishes[i].draft_cost.marginal(trial[i]) * cost.time_s(1);
        trial[i] += 1;
        left -= 1;
        rows += 1;
        tokens += wishes[i].acceptance.powi(trial[i] as i32);
        let now = rate(tokens, rows, draft_time);
        if now > best.0 {
            best = (now, trial.clone());
        }
    }
    best.1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::costs::DraftCostUnit;

    fn wish(max_tokens: usize, acceptance: f64) -> DraftWish {
        DraftWish { max_tokens, acceptance, draft_cost: DraftCost::FREE, pinned: false }
    }

    /// A CPU-like curve: ~flat while the weights dominate, then linear in rows (the knee at 8).
    fn knee_curve() -> BatchCost {
        BatchCost::new(
            &(1..=64)
                .map(|r| 1.0 + if r <= 8 { 0.05 * r as f64 } else { 0.4 + 0.2 * (r - 8) as f64 })
                .collect::<Vec<_>>(),
        )
        .unwrap()
    }

    #[test]
    fn a_lone_request_with_nearly_free_rows_drafts_its_wish() {
        assert_eq!(grant(&[wish(4, 0.6)], 1, 64, &knee_curve()), vec![4]);
    }

    #[test]
    fn a_saturated_batch_gets_no_drafts() {
        // 32 decoding requests put the step far past the knee: a draft row costs 0.2 T(1) of the
        // whole batch and buys a_i <= 0.5 of a token for one request out of 32.
        let wishes = vec![wish(4, 0.5); 32];
        assert_eq!(grant(&wishes, 32, 64, &knee_curve()), vec![0; 32]);
    }

    #[test]
    fn rows_go_to_the_requests_that_accept_most() {
        // The rows left before the knee go to the request that accepts most; past it, a draft
        // accepted one time in ten does not pay.
        let mut wishes = vec![wish(4, 0.1); 4];
        wishes[3] = wish(4, 0.99);
        assert_eq!(grant(&wishes, 4, 64, &knee_curve()), vec![0, 0, 0, 4]);
    }

    #[test]
    fn wishes_pins_and_the_row_limit_are_caps() {
        let flat = BatchCost::new(&[1.0]).unwrap(); // slope 1.0 past the end: expensive rows
        let free = BatchCost::new(&[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]).unwrap();
        let pinned = DraftWish { pinned: true, ..wish(3, 0.0) };
        assert_eq!(grant(&[pinned, wish(2, 0.1)], 2, 64, &flat), vec![3, 0]);
        assert_eq!(grant(&[wish(0, 0.9), wish(2, 0.9)], 2, 64, &free), vec![0, 2]);
        assert_eq!(grant(&[wish(5, 0.9), wish(5, 0.9)], 2, 3, &free).iter().sum::<usize>(), 3);
    }

    #[test]
    fn drafting_cost_counts() {
        // A model-based draft whose tokens cost as much as a target step does not pay at a = 0.5.
        let free = BatchCost::new(&[1.0; 16]).unwrap();
        let costly = DraftWish { draft_cost: DraftCost::per_token(1.0), ..wish(4, 0.5) };
        assert_eq!(grant(&[costly], 1, 64, &free), vec![0]);
        assert_eq!(grant(&[wish(4, 0.5)], 1, 64, &free), vec![4]);
        // A block drafter's forward costing a target step pays once for its whole draft: at
        // a = 0.9 four tokens yield 4.1 for 2 steps, where per token they would cost 5.
        let block = |a| DraftWish { draft_cost: DraftCost { value: 1.0, unit: DraftCostUnit::Draft }, ..wish(4, a) };
        assert_eq!(grant(&[block(0.9)], 1, 64, &free), vec![4]);
        let per_token = DraftWish { draft_cost: DraftCost::per_token(1.0), ..wish(4, 0.9) };
        assert_eq!(grant(&[per_token], 1, 64, &free), vec![0]);
        // At a = 0.5 even the whole block (1.94 tokens for 2 steps) does not pay.
        assert_eq!(grant(&[block(0.5)], 1, 64, &free), vec![0]);
    }

    #[test]
    fn the_curve_is_extended_and_kept_monotone() {
        let cost = BatchCost::new(&[1.0, 0.9, 1.5]).unwrap();
        assert_eq!(cost.time_s(2), 1.0);
        assert!((cost.time_s(5) - 2.5).abs() < 1e-12);
        assert!(BatchCost::new(&[]).is_none() && BatchCost::new(&[0.0]).is_none());
    }
}
