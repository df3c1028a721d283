//! Chain or tree, and how big: per step, the subset of the proposer's tree to verify that
//! maximizes expected tokens per unit of time, from the measured verification cost curve and this
//! request's measured acceptance per depth and sibling rank.
//!
//! Model: a node at depth d with sibling rank r is accepted, given its parent was, with
//! probability a(d, r), estimated from this request's verified trees (discounted counts, shrunk
//! towards the rank's rate over all depths, whose Beta prior favours rank 0). A node's value is the probability that verification reaches
//! it: the product of a over its path. Verifying a set S of nodes yields 1 + sum of their values
//! tokens (one target token always) for v(|S| + 1) single-token steps (v(n) = t(n)/t(1), the
//! forward's cost over n rows on this device). Nodes are taken best value first, each only after
//! its parent and its higher-ranked siblings (the kept set stays a tree whose siblings are a
//! prefix of the proposer's order, which recursive rejection sampling needs), and the size with
//! the best ratio wins, which may be zero nodes (no draft), a chain (only rank-0 nodes) or a tree.
//! A steep cost curve (a CPU at batch 1) makes every extra row expensive and favours short chains;
//! a flat one (a GPU, where rows are nearly free until compute-bound) favours wide trees.
//!
//! Before drafting, the same rule on a predicted tree (the full `top_k`-ary tree, valued by the
//! estimates alone, plus the drafting cost of a model-based proposer per level) says how deep a
//! tree to ask for, and whether to draft at all.
//!
//! Invariant: the chooser only removes nodes from a draft, so it changes speed, never output
//! (tree verification is exact for any tree, verify/tree.rs).

use crate::costs::DraftCost;
use crate::proposer::tree::{depths, sibling_ranks};

/// Per-request acceptance by (depth, rank) and the cost curve.
#[derive(Debug, Clone)]
pub struct TreeChooser {
    /// `[max_rows]`: v(n) = t(n) / t(1) for n = 1..=max_rows.
    cost_ratios: Vec<f64>,
    /// Drafting time over t(1) per tree level (per tree, for a block drafter, whose one forward
    /// drafts every level): the engine's figure at first, then this request's measured one
    /// (`observe_timing`); free for model-free proposers.
    draft_cost: DraftCost,
    /// `[depth][rank]` discounted accepted counts and trials (the parent was accepted).
    accepted: Vec<Vec<f64>>,
    trials: Vec<Vec<f64>>,
    /// Whether a draft of this request has been verified yet.
    observed: bool,
}

/// Weight old evidence keeps at each verified or skipped draft: a memory of about 10 drafts.
const DISCOUNT: f64 = 0.9;
/// Trials' worth of weight the rank's pooled rate has in each (depth, rank) estimate.
const POOLED_WEIGHT: f64 = 2.0;

/// What the chooser picked for one step.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// Draft indices to verify (increasing; closed under parents and sibling prefixes).
    pub keep: Vec<usize>,
    /// Expected tokens this step yields, 1 + the kept values.
    pub expected_tokens: f64,
}

impl TreeChooser {
    /// `verify_costs_s`: `[t(1), t(2), ...]`, seconds of one forward over n rows; `draft_cost`:
    /// drafting time over t(1) per tree level (or per tree).
    pub fn new(verify_costs_s: &[f64], draft_cost: DraftCost) -> Self {
        Self {
            cost_ratios: verify_costs_s.iter().map(|t| t / verify_costs_s[0]).collect(),
            draft_cost,
            accepted: Vec::new(),
            trials: Vec::new(),
            observed: false,
        }
    }

    /// The acceptance estimate a(depth, rank): this cell's counts, shrunk towards the rank's rate
    /// pooled over all depths (worth `POOLED_WEIGHT` trials). Pooling is what lets a request that
    /// has only verified short drafts still value deeper nodes by what its shallow ones did (as
    /// the chain policy's one per-token rate does), instead of keeping them at the prior forever.
    pub fn acceptance(&self, depth: usize, rank: usize) -> f64 {
        let get = |table: &Vec<Vec<f64>>, d: usize| table.get(d).and_then(|row| row.get(rank)).copied().unwrap_or(0.0);
        // Prior of the pooled rate: rank 0 passes half the time, rank r about 1 / (r + 1) of that.
        let prior_accepted = 1.0 / (rank as f64 + 1.0);
        let prior_rejected = 1.0;
        let (pooled_accepted, pooled_trials) =
            (0..self.trials.len()).fold((0.0, 0.0), |(a, t), d| (a + get(&self.accepted, d), t + get(&self.trials, d)));
        let pooled = (pooled_accepted + prior_accepted) / (pooled_trials + prior_accepted + prior_rejected);
        let (accepted, trials) = (get(&self.accepted, depth), get(&self.trials, depth));
        (accepted + POOLED_WEIGHT * pooled) / (trials + POOLED_WEIGHT)
    }

    /// The nodes of a draft (`parents` as in `Draft::parents`) worth verifying this step.
    pub fn choose(&self, parents: &[i32]) -> Choice {
        let depths = depths(parents).unwrap_or_default();
        let ranks = sibling_ranks(parents);
        let values = self.values(parents, &depths, &ranks);
        let order = take_best_first(parents, &values);
        // Drafting is done by now: only verification costs. Before its first verified tree a
        // free proposer's tree is tried whatever the costs say (as `planned_depth` planned it):
        // dropping it would leave the chooser nothing to learn from, and on a steep cost curve
        // the request would never draft.
        let (n, expected_tokens) = self.best_size(&order, &values, self.may_skip(), |_| 0.0);
        let mut keep: Vec<usize> = order[..n].to_vec();
        keep.sort_unstable();
        Choice { keep, expected_tokens }
    }

    /// How deep a tree to ask the proposer for (0: do not draft), for a tree of at most
    /// `max_nodes` nodes, `max_children` per node and `max_depth` levels: the best size on the
    /// predicted full tree, with the drafting cost per level of the deepest node taken.
    pub fn planned_depth(&self, max_depth: usize, max_nodes: usize, max_children: usize) -> usize {
        // The predicted full tree values siblings no proposer may have (n-gram trees are mostly
        // chains, their siblings' estimates stay near the prior), which can crowd deep rank-0 nodes
        // out of the best set: the depth a chain alone would pay for counts too.
        let tree = self.planned_depth_of(full_tree(max_depth, max_nodes, max_children));
        tree.max(self.planned_depth_of(full_tree(max_depth, max_nodes, 1)))
    }

    fn planned_depth_of(&self, (parents, depths): (Vec<i32>, Vec<usize>)) -> usize {
        let ranks = sibling_ranks(&parents);
        let values = self.values(&parents, &depths, &ranks);
        let order = take_best_first(&parents, &values);
        let deepest = |n: usize| order[..n].iter().map(|&i| depths[i] + 1).max().unwrap_or(0);
        // Before any evidence, a free proposer tries its best positive size (as the chain policy
        // does): the prior alone knows nothing of this request's text.
        let (n, _) = self.best_size(&order, &values, self.may_skip(), |n| self.draft_cost.of(deepest(n)));
        deepest(n)
    }

    /// Records a verified tree: every node whose parent was reached is a trial for its (depth,
    /// rank), and the accepted path's nodes are successes.
    pub fn observe(&mut self, parents: &[i32], accepted_path: &[usize]) {
        self.forget();
        self.observed = true;
        let depths = depths(parents).unwrap_or_default();
        let ranks = sibling_ranks(parents);
        let mut reached = vec![false; parents.len()];
        accepted_path.iter().for_each(|&node| reached[node] = true);
        for node in 0..parents.len() {
            let parent_reached = parents[node] < 0 || reached[parents[node] as usize];
            if !parent_reached {
                continue;
            }
            let (d, r) = (depths[node], ranks[node]);
            if self.trials.len() <= d {
                self.trials.resize(d + 1, Vec::new());
                self.accepted.resize(d + 1, Vec::new());
            }
            if self.trials[d].len() <= r {
                self.trials[d].resize(r + 1, 0.0);
                self.accepted[d].resize(r + 1, 0.0);
            }
            self.trials[d][r] += 1.0;
            if reached[node] {
                self.accepted[d][r] += 1.0;
            }
        }
    }

    /// Records what drafting a tree `depth` levels deep took (`draft_s`) beside the verify forward
    /// over `rows` rows (`forward_s`): the draft cost per level (per tree, for a block drafter),
    /// in units of this request's own single-row step t(1) = forward_s / v(rows), follows it
    /// (`DraftCost::follow`). A tree level of a head or a draft model expands several frontier
    /// rows and ranks them on the host, which the per-token cost measured for chains
    /// underestimates. Only speed depends on it: the trees of such proposers are deterministic, so
    /// their outputs do not depend on their shape (the session follows no timing where a pinned
    /// cost must hold).
    pub fn observe_timing(&mut self, draft_s: f64, depth: usize, forward_s: f64, rows: usize) {
        self.draft_cost.follow(draft_s, depth, forward_s, rows, &self.cost_ratios);
    }

    /// Records a step that drafted nothing: the evidence ages, so drafting resumes after a while.
    pub fn skipped(&mut self) {
        self.forget();
    }

    /// Whether no draft may be the best choice: once this request has a verified tree, or when
    /// drafting costs time. Before that a free proposer's tree is always tried.
    fn may_skip(&self) -> bool {
        self.observed || !self.draft_cost.is_free()
    }

    fn forget(&mut self) {
        for table in [&mut self.accepted, &mut self.trials] {
            table.iter_mut().flatten().for_each(|x| *x *= DISCOUNT);
        }
    }

    /// Each node's value: the product of the acceptance estimates along its path.
    fn values(&self, parents: &[i32], depths: &[usize], ranks: &[usize]) -> Vec<f64> {
        let mut values = Vec::with_capacity(parents.len());
        for node in 0..parents.len() {
            let parent_value = if parents[node] < 0 { 1.0 } else { values[parents[node] as usize] };
            values.push(parent_value * self.acceptance(depths[node], ranks[node]));
        }
        values
    }

    /// The number of nodes (taken in `order`) with the best expected tokens per unit of cost
    /// (verification plus `extra_cost(n)`), and the expected tokens at it; 0 only if `may_skip`.
    fn best_size(
        &self,
        order: &[usize],
        values: &[f64],
        may_skip: bool,
        extra_cost: impl Fn(usize) -> f64,
    ) -> (usize, f64) {
        // (n, rate, expected tokens); no draft yields one token per step.
        let mut best = (0usize, if may_skip { 1.0 } else { 0.0 }, 1.0);
        let mut expected = 1.0;
        for n in 1..=order.len().min(self.cost_ratios.len().saturating_sub(1)) {
            expected += values[order[n - 1]];
            let rate = expected / (self.cost_ratios[n] + extra_cost(n));
            if rate > best.1 {
                best = (n, rate, expected);
            }
        }
        (best.0, best.2)
    }
}

/// Node indices in the order they are taken: highest value first among the nodes whose parent and
/// higher-ranked siblings are taken (ties: the earlier node).
fn take_best_first(parents: &[i32], values: &[f64]) -> Vec<usize> {
    let n = parents.len();
    let mut taken = vec![false; n];
    let mut order = Vec::with_capacity(n);
    // The previous sibling of each node, if any.
    let mut last_child: std::collections::HashMap<i32, usize> = std::collections::HashMap::new();
    let mut previous_sibling = vec![None; n];
    for (node, &parent) in parents.iter().enumerate() {
        previous_sibling[node] = last_child.insert(parent, node);
    }
    let available = |node: usize, taken: &[bool]| {
        !taken[node]
            && (parents[node] < 0 || taken[parents[node] as usize])
            && previous_sibling[node].is_none_or(|s: usize| taken[s])
    };
    while order.len() < n {
        let next =
            (0..n).filter(|&i| available(i, &taken)).max_by(|&a, &b| values[a].total_cmp(&values[b]).then(b.cmp(&a)));
        let Some(next) = next else { break };
        taken[next] = true;
        order.push(next);
    }
    order
}

/// The full tree of `max_children` children per node, breadth first, cut at `max_nodes` nodes and
/// `max_depth` levels: `(parents, depths)`.
fn full_tree(max_depth: usize, max_nodes: usize, max_children: usize) -> (Vec<i32>, Vec<usize>) {
    let mut parents = Vec::new();
    let mut depths = Vec::new();
    let mut level: Vec<i32> = vec![-1];
    for depth in 0..max_depth {
        let mut next = Vec::new();
        for &parent in &level {
            for _ in 0..max_children {
                if parents.len() >= max_nodes {
                    return (parents, depths);
                }
                next.push(parents.len() as i32);
                parents.push(parent);
                depths.push(depth);
            }
        }
        level = next;
    }
    (parents, depths)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::costs::DraftCostUnit;

    /// Trains a chooser on `steps` verified full trees (3 children per node, depth 3) where the
    /// rank-0 child is accepted with probability `a0` and rank 1 with `a1` (deterministically
    /// interleaved).
    fn trained(costs: &[f64], a0: f64, a1: f64) -> TreeChooser {
        let mut chooser = TreeChooser::new(costs, DraftCost::FREE);
        let (parents, _) = full_tree(3, 39, 3);
        let kids = crate::proposer::tree::children(&parents);
        for step in 0..40 {
            let mut path = Vec::new();
            let mut node = 0usize; // kids index: 0 = root
            for depth in 0..3 {
                let u = ((step * 7 + depth * 3) % 20) as f64 / 20.0;
                let pick = if u < a0 {
                    Some(0)
                } else if u < a0 + a1 {
                    Some(1)
                } else {
                    None
                };
                let Some(rank) = pick else { break };
                let child = kids[node][rank];
                path.push(child);
                node = child + 1;
            }
            chooser.observe(&parents, &path);
        }
        chooser
    }

    #[test]
    fn a_steep_cost_curve_picks_a_chain_and_a_flat_one_a_tree() {
        let (parents, _) = full_tree(3, 39, 3);
        // CPU-like: every row costs 40% of a step.
        let steep: Vec<f64> = (1..=40).map(|n| 1.0 + 0.4 * (n - 1) as f64).collect();
        let chooser = trained(&steep, 0.6, 0.25);
        let choice = chooser.choose(&parents);
        let ranks = sibling_ranks(&parents);
        assert!(!choice.keep.is_empty(), "acceptance 0.6 pays for a short draft");
        assert!(choice.keep.iter().all(|&i| ranks[i] == 0), "steep: a chain, got {:?}", choice.keep);
        // GPU-like: flat until 32 rows.
        let flat: Vec<f64> = (1..=40).map(|n| if n <= 32 { 1.0 + 0.001 * n as f64 } else { 2.0 }).collect();
        let chooser = trained(&flat, 0.6, 0.25);
        let choice = chooser.choose(&parents);
        assert!(choice.keep.iter().any(|&i| ranks[i] > 0), "flat: a tree, got {:?}", choice.keep);
        assert!(choice.keep.len() > 8);
        assert!(crate::proposer::tree::is_closed(&parents, &choice.keep));
        // No acceptance on the steep curve: no draft; on a flat one, a few rows still pay for the
        // estimate's remaining hope (the prior keeps it above 0).
        assert!(trained(&steep, 0.0, 0.0).choose(&parents).keep.is_empty());
        assert!(!trained(&flat, 0.0, 0.0).choose(&parents).keep.is_empty());
    }

    #[test]
    fn kept_sets_keep_sibling_prefixes_and_planning_stops_drafting_when_it_does_not_pay() {
        let mut chooser = TreeChooser::new(&[1.0, 1.01, 1.02, 1.03, 1.04, 1.05], DraftCost::FREE);
        // Rank 1 at the root always wins, rank 0 never.
        let parents = vec![-1, -1, 0, 1];
        for _ in 0..30 {
            chooser.observe(&parents, &[1, 3]);
        }
        let choice = chooser.choose(&parents);
        // Node 1 needs node 0 (its higher-ranked sibling) first.
        assert!(choice.keep.contains(&1) && choice.keep.contains(&0), "{:?}", choice.keep);
        assert!(chooser.planned_depth(4, 8, 2) >= 2);
        // Chains always accepted whole, siblings never seen: the planned depth follows the chain,
        // not the imagined siblings' prior.
        let gentle: Vec<f64> = (1..=17).map(|n| 1.0 + 0.08 * (n - 1) as f64).collect();
        let mut chains = TreeChooser::new(&gentle, DraftCost::FREE);
        for _ in 0..30 {
            chains.observe(&[-1, 0, 1, 2], &[0, 1, 2, 3]);
        }
        assert!(chains.planned_depth(8, 16, 4) >= 6, "{}", chains.planned_depth(8, 16, 4));
        // A draft costing a whole step per level never pays at 10% acceptance.
        let mut costly = TreeChooser::new(&[1.0, 1.3, 1.6, 1.9, 2.2], DraftCost::per_token(1.0));
        for _ in 0..30 {
            costly.observe(&[-1, 0], &[]);
        }
        assert_eq!(costly.planned_depth(4, 4, 1), 0);
    }

    #[test]
    fn a_free_proposers_first_tree_is_verified_on_any_cost_curve() {
        // So steep that the prior's tree never pays: the first tree is still verified (something
        // to learn from), and once it was, skipping is allowed again.
        let steep: Vec<f64> = (1..=9).map(|n| 1.0 + 2.0 * (n - 1) as f64).collect();
        let mut chooser = TreeChooser::new(&steep, DraftCost::FREE);
        let parents = vec![-1, -1, 0, 1];
        assert!(!chooser.choose(&parents).keep.is_empty());
        assert!(chooser.planned_depth(4, 8, 2) > 0);
        chooser.observe(&parents, &[]);
        assert!(chooser.choose(&parents).keep.is_empty());
        assert_eq!(chooser.planned_depth(4, 8, 2), 0);
        // A costly proposer planned by the prior alone: skipping stays allowed.
        assert_eq!(TreeChooser::new(&steep, DraftCost::per_token(1.0)).planned_depth(4, 8, 2), 0);
    }

    /// A block drafter's tree costs one forward however deep: a deep tree is planned where the
    /// same cost charged per level plans none, and its timing is kept per tree.
    #[test]
    fn a_block_drafters_tree_costs_one_forward_whatever_its_depth() {
        let flat = [1.0; 17];
        let per_draft = DraftCost { value: 1.5, unit: DraftCostUnit::Draft };
        let mut block = TreeChooser::new(&flat, per_draft);
        let mut per_level = TreeChooser::new(&flat, DraftCost::per_token(1.5));
        let chain: Vec<i32> = (-1..7).collect();
        for chooser in [&mut block, &mut per_level] {
            for _ in 0..30 {
                chooser.observe(&chain, &[0, 1, 2, 3, 4, 5, 6, 7]); // every level passes
            }
        }
        // ~9 tokens for 2.5 steps; per level, one token is ~2 for 2.5 and deeper is worse.
        assert_eq!(block.planned_depth(8, 8, 1), 8);
        assert_eq!(per_level.planned_depth(8, 8, 1), 0);
        // 8 levels in 0.4 s beside a 1 s forward over 1 row: 0.4 per tree, 0.05 per level.
        block.observe_timing(0.4, 8, 1.0, 1);
        per_level.observe_timing(0.4, 8, 1.0, 1);
        assert!((block.draft_cost.value - (0.7 * 1.5 + 0.3 * 0.4)).abs() < 1e-12);
        assert!((per_level.draft_cost.value - (0.7 * 1.5 + 0.3 * 0.05)).abs() < 1e-12);
        // A batched forward over more rows than the curve holds says nothing of t(1).
        let before = block.draft_cost;
        block.observe_timing(0.4, 8, 1.0, flat.len() + 1);
        assert_eq!(block.draft_cost, before);
    }
}
