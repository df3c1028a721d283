//! Cost-aware draft length: before each draft, the length that maximizes expected tokens per unit
//! of cost, from this request's measured acceptance, the engine's measured verification cost
//! curve and the draft's measured cost.
//!
//! Why: on a CPU, verifying n tokens costs v(n) = t(n)/t(1) > 1 single-token steps (about 1.4 at
//! n = 2 and 2.4 at n = 5 for SmolLM2 on 2 cores), so a long draft that is mostly rejected is
//! slower than no draft at all. With per-token acceptance a (each draft token passes with
//! probability a given the ones before it passed), a draft of m tokens yields
//! (1 - a^(m+1)) / (1 - a) tokens for a cost of v(m+1); the best m may be 0 (stop speculating).
//!
//! Drafting itself costs time for model-based proposers (a draft model forward per token): the
//! draft cost per token, c (in units of t(1)), adds m * c to the cost of an m-token draft; a block
//! drafter (PARD, DFlash, DSpark: one forward per draft) adds c whatever m (`costs::DraftCost`). The
//! length is the proposer's `max_tokens`, so a draft that would not pay is never computed. Both
//! cost figures are measured once per engine (not per request), so the chosen lengths, and with
//! them a seeded request's sampled tokens, do not depend on timing noise.
//!
//! The estimate forgets old evidence (each draft or skipped draft discounts it), so a request
//! whose text turns repetitive later gets drafts again after a run of rejections. Before a
//! request's first verified draft the estimate is the prior alone, which knows nothing of this
//! request's text: a proposer that costs nothing to run (c = 0: ngram, suffix) then tries its best
//! positive length whatever the verification costs say, and so does a draft whose acceptance its
//! engine has not measured yet (`AcceptancePrior::exploring`, `engine/acceptance_prior.rs`); once
//! it has, a draft model, whose first draft would read the whole prompt, drafts only if the prior
//! (the engine's measured acceptance) says it pays.
//!
//! A draft with a cache of its own first reads the context it has not read (the whole prompt
//! before its first draft: `catch_up_steps` target steps, tens for a 0.5B draft on a CPU), once,
//! not per token. A request pays that only where its speedup over the tokens max_tokens leaves
//! wins it back (`pays_back`), judged before its first draft at the engine's acceptance by depth,
//! since a draft's first tokens pass more often than one per-token figure says.
//!
//! Invariant: this only shortens drafts, so it changes speed, never output.

use crate::costs::DraftCost;

/// Per-request acceptance estimate and the verification cost curve.
#[derive(Debug, Clone)]
pub struct DraftLengthPolicy {
    /// `[k + 1]`: v(n) = t(n) / t(1) for n = 1..=k+1.
    verify_cost_ratios: Vec<f64>,
    /// Discounted count of accepted draft tokens.
    accepted: f64,
    /// Discounted count of drafts that ended in a rejection (each one failed trial).
    rejections: f64,
    /// c: drafting time over t(1) (per token or per draft), measured once per engine and config.
    draft_cost: DraftCost,
    /// Whether a draft of this request has been verified yet.
    observed: bool,
    prior: AcceptancePrior,
}

/// What the policy assumes of the per-token acceptance before the request's own drafts say.
#[derive(Debug, Clone, PartialEq)]
pub struct AcceptancePrior {
    /// Beta pseudo-counts: accepted tokens and rejections.
    accepted: f64,
    rejected: f64,
    /// Try the first draft whatever the prior predicts (nobody has measured this draft yet).
    explore: bool,
    /// The engine's measured acceptance at draft depths 1, 2, ... (of the drafts that reached a
    /// depth, those whose token there passed), as deep as it saw enough drafts: what a request's
    /// catch-up is weighed with (`pays_back`). A draft's first tokens pass more often than its
    /// later ones, which one per-token figure spreads evenly, underrating short drafts.
    by_depth: Vec<f64>,
}

/// The pseudo-counts' total: as much evidence as two drafts.
const PRIOR_WEIGHT: f64 = 2.0;

impl AcceptancePrior {
    /// a = 0.5, knowing nothing (model-free proposers, whose first draft is free to try anyway).
    pub fn uninformed() -> Self {
        Self { accepted: PRIOR_WEIGHT / 2.0, rejected: PRIOR_WEIGHT / 2.0, explore: false, by_depth: Vec::new() }
    }

    /// a = 0.5, and the first draft is tried: the draft's acceptance is not measured yet.
    pub fn exploring() -> Self {
        Self { explore: true, ..Self::uninformed() }
    }

    /// The per-token acceptance its engine measured for this draft, and its acceptance at the
    /// first depths (`by_depth`; empty: the per-token figure at every depth).
    pub fn measured(acceptance: f64, by_depth: Vec<f64>) -> Self {
        let a = acceptance.clamp(0.0, 1.0);
        Self { accepted: a * PRIOR_WEIGHT, rejected: (1.0 - a) * PRIOR_WEIGHT, explore: false, by_depth }
    }
}

/// Weight kept by old evidence at each draft or skipped draft: an effective memory of ~10.
const DISCOUNT: f64 = 0.9;

impl DraftLengthPolicy {
    /// `verify_costs_s`: `[t(1), t(2), ..., t(k+1)]`, seconds of one forward over n tokens;
    /// `draft_cost`: c, drafting time over t(1) (`DraftCost::FREE` for model-free proposers).
    pub fn new(verify_costs_s: &[f64], draft_cost: DraftCost) -> Self {
        Self::with_prior(verify_costs_s, draft_cost, AcceptancePrior::uninformed())
    }

    /// `new` with what the policy assumes of the acceptance before this request's first draft.
    pub fn with_prior(verify_costs_s: &[f64], draft_cost: DraftCost, prior: AcceptancePrior) -> Self {
        Self {
            verify_cost_ratios: verify_costs_s.iter().map(|t| t / verify_costs_s[0]).collect(),
            accepted: 0.0,
            rejections: 0.0,
            draft_cost,
            observed: false,
            prior,
        }
    }

    /// Records one verified draft.
    pub fn observe(&mut self, num_draft_tokens: usize, num_accepted_tokens: usize) {
        self.forget();
        self.observed = true;
        self.accepted += num_accepted_tokens as f64;
        if num_accepted_tokens < num_draft_tokens {
            self.rejections += 1.0;
        }
    }

    /// Records a draft that `best_length` cut to nothing: its evidence ages, so drafting resumes
    /// after a while and the estimate can learn that acceptance changed.
    pub fn skipped(&mut self) {
        self.forget();
    }

    fn forget(&mut self) {
        self.accepted *= DISCOUNT;
        self.rejections *= DISCOUNT;
    }

    /// Posterior mean of the per-token acceptance: accepted tokens over accepted tokens plus
    /// rejections (the maximum-likelihood estimate for drafts cut short by a rejection).
    pub fn acceptance(&self) -> f64 {
        let prior = &self.prior;
        (self.accepted + prior.accepted) / (self.accepted + self.rejections + prior.accepted + prior.rejected)
    }

    /// c: drafting time over t(1), per token or per draft.
    pub fn draft_cost(&self) -> DraftCost {
        self.draft_cost
    }

    /// The draft length in 0..=max_len with the most expected tokens per unit of cost (drafting
    /// plus verification): how long a draft to ask the proposer for.
    pub fn best_length(&self, max_len: usize) -> usize {
        self.plan(max_len).length
    }

    /// `best_length`'s choice with the speedup it predicts: what "auto" compares drafters by.
    pub fn plan(&self, max_len: usize) -> Verdict {
        self.plan_with_overhead(max_len, 0.0)
    }

    /// `plan` for a draft that first costs `overhead` target steps whatever its length (a draft
    /// model catching up on context it has not read: "auto", `proposer/auto.rs`).
    pub fn plan_with_overhead(&self, max_len: usize, overhead: f64) -> Verdict {
        let (best, best_drafting) = self.best_rates(max_len, overhead, &[]);
        if self.observed || !(self.draft_cost.is_free() || self.prior.explore) {
            best
        } else {
            best_drafting
        }
    }

    /// Target steps a draft spends reading `unseen` context rows it has not read (the prompt
    /// before its first draft, the tokens of the steps it sat out) before its next draft: its
    /// first drafted token's forward covers one row, each other row costs `row_share` of c times
    /// what a row adds to a forward (the verification curve's slope).
    pub fn catch_up_steps(&self, unseen: usize, row_share: f64) -> f64 {
        self.draft_cost.value * row_share * unseen.saturating_sub(1) as f64 * self.cost_per_row()
    }

    /// Whether drafting (at most `max_len` tokens a draft), over the `remaining` tokens the
    /// request may still yield (at most that many), wins back `catch_up` target steps spent before
    /// its next draft: plain decoding takes R steps for them, drafting `catch_up + R / speedup`;
    /// with the speedup weighed. Before the request's first draft the speedup is the best at the
    /// engine's acceptance by depth (`AcceptancePrior::by_depth`), after it the request's own
    /// (`plan`). A first draft tried to measure the draft's acceptance
    /// (`AcceptancePrior::exploring`) is not judged: what it would win is what is being measured.
    pub fn pays_back(&self, max_len: usize, catch_up: f64, remaining: usize) -> (bool, f64) {
        let by_depth: &[f64] = if self.observed { &[] } else { &self.prior.by_depth };
        let speedup = self.best_rates(max_len, 0.0, by_depth).0.predicted_speedup;
        let exploring = !self.observed && self.prior.explore;
        (exploring || catch_up <= 0.0 || catch_up < remaining as f64 * (1.0 - 1.0 / speedup), speedup)
    }

    /// What one more row adds to a forward, in single-row steps: the verification curve's mean
    /// slope, (v(n) - 1) / (n - 1) over the curve it holds (0 for a one-point curve).
    pub fn cost_per_row(&self) -> f64 {
        let n = self.verify_cost_ratios.len();
        if n < 2 {
            return 0.0;
        }
        (self.verify_cost_ratios[n - 1] - 1.0) / (n - 1) as f64
    }

    /// Why `best_length(max_len)` is 0: the best draft length's predicted speedup and what it
    /// rests on (None when max_len allows no draft).
    pub fn verdict(&self, max_len: usize) -> Option<Verdict> {
        let (_, best_drafting) = self.best_rates(max_len, 0.0, &[]);
        (best_drafting.length > 0).then_some(best_drafting)
    }

    /// (the best length, 0 included; the best positive length), each with its predicted speedup:
    /// expected tokens per unit of cost over plain decoding's one token per step. The acceptance
    /// at depth d + 1 is `by_depth[d]` where it has one, the per-token estimate past it.
    fn best_rates(&self, max_len: usize, overhead: f64, by_depth: &[f64]) -> (Verdict, Verdict) {
        let a = self.acceptance();
        let c = self.draft_cost;
        let max_len = max_len.min(self.verify_cost_ratios.len().saturating_sub(1));
        let verdict = |length: usize, predicted_speedup: f64| Verdict {
            length,
            predicted_speedup,
            acceptance: a,
            observed: self.observed,
            verify_cost_ratio: self.verify_cost_ratios[length],
            draft_cost: c,
        };
        let mut best = verdict(0, 1.0); // no draft: one token for one step
        let mut best_drafting = verdict(0, 0.0);
        let mut expected_tokens = 1.0;
        let mut pass_all = 1.0;
        for m in 1..=max_len {
            pass_all *= by_depth.get(m - 1).copied().unwrap_or(a);
            expected_tokens += pass_all;
            let rate = expected_tokens / (self.verify_cost_ratios[m] + c.of(m) + overhead);
            if rate > best.predicted_speedup {
                best = verdict(m, rate);
            }
            if rate > best_drafting.predicted_speedup {
                best_drafting = verdict(m, rate);
            }
        }
        (best, best_drafting)
    }
}

/// The policy's judgement of its best draft length: what a request whose drafts stood idle for
/// cost reports (`metrics.rs`, `idle_reason`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Verdict {
    pub length: usize,
    /// Expected tokens per unit of cost over plain decoding's one per step.
    pub predicted_speedup: f64,
    /// The per-token acceptance it assumed: the request's measured one, or the prior before
    /// `observed`.
    pub acceptance: f64,
    pub observed: bool,
    /// v(length + 1).
    pub verify_cost_ratio: f64,
    pub draft_cost: DraftCost,
}

/// transformers' "heuristic" schedule for k: +2 after a fully accepted draft, -1 after any
/// rejection, within 1..=num_speculative_tokens; starts at num_speculative_tokens.
#[derive(Debug, Clone)]
pub struct HeuristicSchedule {
    current: usize,
    max: usize,
}

impl HeuristicSchedule {
    pub fn new(num_speculative_tokens: usize) -> Self {
        Self { current: num_speculative_tokens, max: num_speculative_tokens }
    }

    pub fn current(&self) -> usize {
        self.current
    }

    pub fn observe(&mut self, num_draft_tokens: usize, num_accepted_tokens: usize) {
        self.current = if num_accepted_tokens == num_draft_tokens {
            (self.current + 2).min(self.max)
        } else {
            self.current.saturating_sub(1).max(1)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::costs::DraftCostUnit;

    #[test]
    fn flat_cost_drafts_everything_steep_cost_drafts_little() {
        let mut flat = DraftLengthPolicy::new(&[1.0; 9], DraftCost::FREE);
        let mut steep = DraftLengthPolicy::new(&[1.0, 1.4, 1.6, 2.0, 2.4, 2.9, 3.1, 3.8, 4.4], DraftCost::FREE);
        for _ in 0..50 {
            flat.observe(4, 3); // a = 0.75
            steep.observe(4, 3);
        }
        assert_eq!(flat.best_length(8), 8);
        // a = 0.75: m = 2 gives 2.31 / 1.6 = 1.45, m = 1 gives 1.75 / 1.4 = 1.25, m = 3 1.15.
        assert_eq!(steep.best_length(8), 2);
        assert_eq!(steep.best_length(1), 1);
    }

    #[test]
    fn low_acceptance_stops_speculating() {
        let mut policy = DraftLengthPolicy::new(&[1.0, 1.4, 1.6, 2.0, 2.4], DraftCost::FREE);
        assert!(policy.best_length(4) >= 1, "the prior should let a new request try drafts");
        for _ in 0..20 {
            policy.observe(4, 0);
        }
        assert!(policy.acceptance() < 0.2);
        assert_eq!(policy.best_length(4), 0);
        // It says why: no length predicts a speedup at the acceptance it measured.
        let verdict = policy.verdict(4).unwrap();
        assert!(verdict.observed && verdict.acceptance < 0.2 && verdict.predicted_speedup < 1.0, "{verdict:?}");
        assert_eq!((verdict.length, verdict.verify_cost_ratio), (1, 1.4));
        assert_eq!(policy.verdict(0), None);
        // Skipped drafts age the evidence until a one-token draft is worth trying again.
        let skips = (1..100).find(|_| {
            policy.skipped();
            policy.best_length(4) > 0
        });
        assert!(matches!(skips, Some(10..=40)), "{skips:?}");
    }

    #[test]
    fn a_new_request_tries_a_free_draft_even_where_the_prior_says_it_would_not_pay() {
        // a = 0.5: m = 1 gives 1.5 / 1.6, m = 2 1.75 / 1.9; neither beats plain decoding.
        let mut policy = DraftLengthPolicy::new(&[1.0, 1.6, 1.9], DraftCost::FREE);
        assert_eq!(policy.best_length(2), 1);
        policy.observe(1, 0);
        assert_eq!(policy.best_length(2), 0);
        // A draft model's first draft reads the prompt: the prior decides.
        assert_eq!(DraftLengthPolicy::new(&[1.0, 1.6, 1.9], DraftCost::per_token(0.01)).best_length(2), 0);
    }

    /// Qwen2.5-Coder-0.5B drafting for 1.5B on this CPU (benches/README.md): c = 0.37 per token,
    /// v(2..5) = 1.14, 1.22, 1.33, 1.57, a = 0.9. At a = 0.5 no length pays, so a request that
    /// starts from the uninformed prior never drafts and never learns; exploring, it drafts once,
    /// and its own drafts keep it drafting; once the engine measured a = 0.9, requests start there.
    #[test]
    fn a_costly_draft_whose_acceptance_is_unmeasured_is_tried_once() {
        let curve = [1.0, 1.14, 1.22, 1.33, 1.57];
        let c = DraftCost::per_token(0.37);
        assert_eq!(DraftLengthPolicy::new(&curve, c).best_length(4), 0);
        let mut exploring = DraftLengthPolicy::with_prior(&curve, c, AcceptancePrior::exploring());
        assert_eq!(exploring.best_length(4), 1, "the best positive length at a = 0.5");
        exploring.observe(1, 1);
        for _ in 0..4 {
            exploring.observe(4, 4);
        }
        // a ~ 0.94: m = 3 gives 3.65 / 2.44 = 1.50, m = 4 4.43 / 3.05 = 1.45.
        assert_eq!(exploring.best_length(4), 3);
        // A request that explored and saw nothing accepted stops.
        let mut failing = DraftLengthPolicy::with_prior(&curve, c, AcceptancePrior::exploring());
        failing.observe(1, 0);
        assert_eq!(failing.best_length(4), 0);
        // The engine's measured acceptance as the prior: 0.9 drafts from the start (m = 3: 3.44 /
        // 2.44 = 1.41), 0.3 does not.
        assert_eq!(DraftLengthPolicy::with_prior(&curve, c, AcceptancePrior::measured(0.9, vec![])).best_length(4), 3);
        assert_eq!(DraftLengthPolicy::with_prior(&curve, c, AcceptancePrior::measured(0.3, vec![])).best_length(4), 0);
    }

    /// A draft that must first read what it has not (a prompt) drafts only where its speedup over
    /// the tokens left wins that reading back; a first draft tried to measure the draft's
    /// acceptance is not judged.
    #[test]
    fn a_draft_reads_a_long_prompt_only_where_the_tokens_left_win_it_back() {
        let curve = [1.0, 1.14, 1.22, 1.33, 1.57];
        let c = DraftCost::per_token(0.37);
        let measured = DraftLengthPolicy::with_prior(&curve, c, AcceptancePrior::measured(0.9, vec![]));
        // A row adds (1.57 - 1) / 4 = 0.1425 of a step: 401 unseen rows, 0.37 * 400 * 0.1425.
        let steps = measured.catch_up_steps(401, 1.0);
        assert!((steps - 21.09).abs() < 1e-9, "{steps}");
        assert_eq!(measured.catch_up_steps(1, 1.0), 0.0, "the draft's own forward reads the newest token");
        assert!((measured.catch_up_steps(401, 0.25) - steps / 4.0).abs() < 1e-9, "a head's cheaper rows");
        // m = 3 at 3.439 / 2.44 = 1.4094x saves 0.2905 of a step per token: 72.6 tokens pay 21.09.
        assert_eq!(measured.plan(4).length, 3);
        let (pays, speedup) = measured.pays_back(4, steps, 72);
        assert!(!pays && (speedup - 3.439 / 2.44).abs() < 1e-9, "{speedup}");
        assert!(measured.pays_back(4, steps, 73).0);
        assert!(measured.pays_back(4, 0.0, 1).0, "nothing to read");
        let exploring = DraftLengthPolicy::with_prior(&curve, c, AcceptancePrior::exploring());
        assert!(exploring.pays_back(4, steps, 1).0, "an unmeasured draft is tried");
        // The same per-token 0.72 with the first depths as a draft's pass (0.89, then 0.64): 1.14x
        // spread evenly; by depth, m = 2 at (1 + 0.89 + 0.5696) / 1.96 = 1.2549x, which 128 tokens
        // left win 26.0 steps with (21.09 needs 104 of them).
        let even = DraftLengthPolicy::with_prior(&curve, c, AcceptancePrior::measured(0.72, vec![]));
        let (pays, speedup) = even.pays_back(4, steps, 128);
        assert!(!pays && (speedup - (1.0 + 0.72 + 0.72 * 0.72) / 1.96).abs() < 1e-9, "{speedup}");
        let by_depth = DraftLengthPolicy::with_prior(&curve, c, AcceptancePrior::measured(0.72, vec![0.89, 0.64]));
        let (pays, speedup) = by_depth.pays_back(4, steps, 128);
        assert!(pays && (speedup - (1.0 + 0.89 + 0.89 * 0.64) / 1.96).abs() < 1e-9, "{speedup}");
        assert!(!by_depth.pays_back(4, steps, 100).0);
        // Once the request has drafted, its own acceptance decides.
        let mut observed = by_depth.clone();
        observed.observe(4, 1);
        assert_eq!(observed.pays_back(4, steps, 128).1, observed.plan(4).predicted_speedup.max(1.0));
    }

    #[test]
    fn draft_cost_shortens_drafts() {
        let mut free = DraftLengthPolicy::new(&[1.0; 9], DraftCost::FREE);
        let mut costly = DraftLengthPolicy::new(&[1.0; 9], DraftCost::per_token(0.3));
        let mut as_costly_as_the_target = DraftLengthPolicy::new(&[1.0; 9], DraftCost::per_token(1.0));
        for _ in 0..50 {
            for policy in [&mut free, &mut costly, &mut as_costly_as_the_target] {
                policy.observe(4, 3); // a ~ 0.74
            }
        }
        assert_eq!(free.best_length(8), 8);
        // c = 0.3: m = 2 gives 2.28 / 1.6 = 1.43, m = 3 2.69 / 1.9 = 1.41, m = 8 3.6 / 3.4 = 1.06.
        assert_eq!(costly.best_length(8), 2);
        assert_eq!(as_costly_as_the_target.best_length(8), 0);
    }

    /// A block drafter pays its one forward whatever the length: where a whole block costs a
    /// target step, a one-token draft does not pay (1.74 tokens for 2 steps) and the full block
    /// does (3.57 for 2), while the same cost spread over 8 tokens (c = 0.125 per token) would
    /// have priced the one-token draft at an eighth of its forward.
    #[test]
    fn a_block_drafters_short_drafts_cost_its_whole_forward() {
        let per_draft = DraftCost { value: 1.0, unit: DraftCostUnit::Draft };
        let mut block = DraftLengthPolicy::new(&[1.0; 9], per_draft);
        let mut spread_per_token = DraftLengthPolicy::new(&[1.0; 9], DraftCost::per_token(0.125));
        for _ in 0..50 {
            block.observe(4, 3); // a ~ 0.74
            spread_per_token.observe(4, 3);
        }
        assert_eq!(block.best_length(8), 8);
        assert_eq!(block.best_length(1), 0);
        let one = block.verdict(1).unwrap();
        assert!((one.predicted_speedup - 1.738 / 2.0).abs() < 0.01, "{one:?}");
        assert!(spread_per_token.plan(1).predicted_speedup > 1.5);
        assert_eq!((per_draft.of(0), per_draft.of(1), per_draft.of(8)), (0.0, 1.0, 1.0));
        assert_eq!((per_draft.marginal(0), per_draft.marginal(3)), (1.0, 0.0));
        assert_eq!(DraftCost::per_token(0.25).marginal(3), 0.25);
    }

    #[test]
    fn heuristic_schedule_grows_by_two_and_shrinks_by_one_within_bounds() {
        let mut schedule = HeuristicSchedule::new(5);
        let mut seen = vec![schedule.current()];
        for (drafted, accepted) in [(5, 1), (4, 0), (3, 3), (5, 5), (5, 0), (4, 0), (3, 0), (2, 0), (1, 0), (1, 1)] {
            schedule.observe(drafted, accepted);
            seen.push(schedule.current());
        }
        assert_eq!(seen, vec![5, 4, 3, 5, 5, 4, 3, 2, 1, 1, 3]);
    }
}
