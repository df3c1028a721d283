//! Batched tree acceptance: for every sequence, which root-to-node path of its token tree the
//! target keeps and the target's next token (recovered where no child matches, or bonus after a
//! leaf).
//!
//! This is `verify::tree::verify_tree` for a batch of deterministic trees (no draft probabilities:
//! n-gram, suffix and the top-k trees of models and heads), with two changes that make it a pure
//! function a device kernel can reproduce: the random draws are inputs (`uniforms`, one per depth),
//! and the target distribution is softmax(logits / temperature) alone.
//!
//! The walk starts at the root (logits row 0; row i + 1 scores the token after node i). At depth
//! d, the current node's row gives the target token: its argmax (temperature 0), or
//! `draw_with(probabilities(row), uniforms[d])`. The first child (in node index order) whose draft
//! token equals it is accepted and becomes the current node; when none does, that target token is
//! the next token and the walk ends. A tree of n nodes is at most n deep, so the walk reads at most
//! uniforms 0..=n.
//!
//! Invariant: with `uniforms[s][d] = sampler.uniform_at(position + d)`, each sequence's result
//! equals `verify_tree` on the same tree with `draft_probs = None` and temperature-only sampling
//! parameters, driven by `sampler` at `position` (its coupled form draws depth d with
//! `draw_at(.., position + d)`, which is `draw_with(.., uniform_at(position + d))`).

use crate::config::SamplingParams;
use crate::error::{Error, Result};
use crate::sampler::{argmax, draw_with, probabilities};

/// One batch, row-major. `b` = batch, `n` = max nodes, `v` = vocab size.
pub struct TreeAcceptInput<'a> {
    pub batch: usize,
    pub max_nodes: usize,
    pub vocab_size: usize,
    /// `[b, n + 1, v]`: row 0 scores the token after the root (the newest context token), row
    /// i + 1 the token after node i.
    pub target_logits: &'a [f32],
    /// `[b, n]`; sequence s uses its first `num_nodes[s]`.
    pub draft_token_ids: &'a [u32],
    /// `[b, n]`: node i's parent, -1 = the root; parents come before their children
    /// (-1 <= parents[i] < i for the used nodes; the padding is not read).
    pub parents: &'a [i32],
    /// `[b]`, each <= n.
    pub num_nodes: &'a [u32],
    /// `[b]`; 0 = greedy.
    pub temperatures: &'a [f32],
    /// `[b, n + 1]` in [0, 1): uniform d decides depth d; unused by greedy sequences.
    pub uniforms: &'a [f32],
}

/// Per sequence: `num_accepted_tokens[s]` nodes kept (the path `accepted_nodes[s][..num_accepted]`,
/// root's child first), then `next_token_ids[s]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeAcceptOutput {
    /// `[b]`.
    pub num_accepted_tokens: Vec<u32>,
    /// `[b, n]`: node indices of the accepted path, padded with `u32::MAX`.
    pub accepted_nodes: Vec<u32>,
    /// `[b]`.
    pub next_token_ids: Vec<u32>,
}

/// Padding of `TreeAcceptOutput::accepted_nodes` past the accepted path.
pub const NO_NODE: u32 = u32::MAX;

impl TreeAcceptInput<'_> {
    /// Every shape and every used parent is checked once here, so the reference and the kernel can
    /// index freely.
    pub fn check(&self) -> Result<()> {
        self.check_with_logits(self.target_logits.len())
    }

    /// `check` for target logits that live elsewhere (a device tensor) and hold `num_logits` values.
    pub fn check_with_logits(&self, num_logits: usize) -> Result<()> {
        let (b, n, v) = (self.batch, self.max_nodes, self.vocab_size);
        let arrays = [
            ("target_logits", num_logits, b * (n + 1) * v),
            ("draft_token_ids", self.draft_token_ids.len(), b * n),
            ("parents", self.parents.len(), b * n),
            ("num_nodes", self.num_nodes.len(), b),
            ("temperatures", self.temperatures.len(), b),
            ("uniforms", self.uniforms.len(), b * (n + 1)),
        ];
        let mut wrong =
            super::shape_errors(&arrays, ("num_nodes", self.num_nodes, n, "max_nodes"), self.draft_token_ids, v);
        // Parents are only read where every array above has its shape.
        if wrong.is_empty() {
            let bad_parent = (0..b).find_map(|s| {
                let parents = &self.parents[s * n..s * n + self.num_nodes[s] as usize];
                parents.iter().enumerate().find(|&(i, &p)| p < -1 || p >= i as i32).map(|(i, &p)| (s, i, p))
            });
            if let Some((s, i, p)) = bad_parent {
                wrong.push(format!(
                    "parent {p} of node {i} in sequence {s} is invalid (parents are -1 for the root or an \
                     earlier node)"
                ));
            }
        }
        if wrong.is_empty() {
            Ok(())
        } else {
            Err(Error::Internal(format!("batched tree acceptance input: {}", wrong.join("; "))))
        }
    }
}

/// The CPU reference of `tree_accept_kernel` in `cuda/accept.cu`.
pub fn tree_accept(input: &TreeAcceptInput) -> Result<TreeAcceptOutput> {
    input.check()?;
    let (n, v) = (input.max_nodes, input.vocab_size);
    let mut out = TreeAcceptOutput {
        num_accepted_tokens: Vec::with_capacity(input.batch),
        accepted_nodes: vec![NO_NODE; input.batch * n],
        next_token_ids: Vec::with_capacity(input.batch),
    };
    for s in 0..input.batch {
        let logits = &input.target_logits[s * (n + 1) * v..(s + 1) * (n + 1) * v];
        let row = |r: usize| &logits[r * v..(r + 1) * v]; // r = 0: the root, i + 1: node i
        let count = input.num_nodes[s] as usize;
        let drafts = &input.draft_token_ids[s * n..s * n + count];
        let parents = &input.parents[s * n..s * n + count];
        let uniforms = &input.uniforms[s * (n + 1)..(s + 1) * (n + 1)];
        let temperature = input.temperatures[s];
        let params = SamplingParams { temperature, ..SamplingParams::default() };
        let path = &mut out.accepted_nodes[s * n..(s + 1) * n];
        let mut current: i32 = -1; // the root
        let mut depth = 0;
        let next = loop {
            let scores = row((current + 1) as usize);
            let target = if temperature <= 0.0 {
                argmax(scores)
            } else {
                draw_with(&probabilities(scores, &params), uniforms[depth])
            };
            // The first child in index order whose token is the target's.
            match (0..count).find(|&i| parents[i] == current && drafts[i] == target) {
                Some(child) => {
                    path[depth] = child as u32;
                    depth += 1;
                    current = child as i32;
                }
                None => break target,
            }
        };
        out.num_accepted_tokens.push(depth as u32);
        out.next_token_ids.push(next);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::accept::{accept, AcceptInput};
    use crate::sampler::Sampler;
    use crate::verify::tree::verify_tree;

    /// A small deterministic generator for test inputs.
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f32 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (self.0 >> 40) as f32 / (1u64 << 24) as f32
        }
        fn below(&mut self, n: usize) -> usize {
            ((self.next() * n as f32) as usize).min(n - 1)
        }
    }

    /// Random trees (`[b, n]` tokens and parents, `[b]` sizes from 0 to n) and their logits
    /// `[b, n + 1, v]`: two rows in three peak on the token of one of the row's children, so walks
    /// often go deep, stop at the root, or stop mid-tree.
    fn random_trees(b: usize, n: usize, v: usize, seed: u64) -> (Vec<f32>, Vec<u32>, Vec<i32>, Vec<u32>) {
        let mut rng = Lcg(seed);
        let (mut logits, mut drafts, mut parents, mut num_nodes) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for s in 0..b {
            let count = if s % 7 == 0 { 0 } else { 1 + rng.below(n) };
            num_nodes.push(count as u32);
            let first = parents.len();
            for i in 0..n {
                // Sometimes a chain link, sometimes any earlier node or the root; padding is -1.
                let parent = if i >= count {
                    -1
                } else if i > 0 && rng.next() < 0.4 {
                    i as i32 - 1
                } else {
                    rng.below(i + 1) as i32 - 1
                };
                parents.push(parent);
                drafts.push(rng.below(v) as u32);
            }
            for r in 0..=n {
                let kids: Vec<usize> = (0..count).filter(|&i| parents[first + i] == r as i32 - 1).collect();
                let peak = (!kids.is_empty() && rng.next() < 0.67).then(|| drafts[first + kids[rng.below(kids.len())]]);
                logits.extend((0..v).map(|t| rng.next() * 2.0 + if peak == Some(t as u32) { 9.0 } else { 0.0 }));
            }
        }
        (logits, drafts, parents, num_nodes)
    }

    /// How a walk ended: at the root with children to choose from, mid-tree at a node with
    /// children, at a leaf (full acceptance), or at a root without children.
    fn ending(parents: &[i32], path: &[usize]) -> &'static str {
        let last = path.last().map_or(-1, |&node| node as i32);
        match (path.is_empty(), parents.contains(&last)) {
            (true, true) => "rejected at the root",
            (true, false) => "empty tree",
            (false, true) => "rejected mid-tree",
            (false, false) => "accepted to a leaf",
        }
    }

    fn check_against_verify_tree(temperatures: &[f32]) {
        let (b, n, v) = (96, 6, 12);
        let (logits, drafts, parents, num_nodes) = random_trees(b, n, v, 17);
        let temperatures: Vec<f32> = (0..b).map(|s| temperatures[s % temperatures.len()]).collect();
        let seeds: Vec<u64> = (0..b as u64).map(|s| 500 + s).collect();
        let positions: Vec<usize> = (0..b).map(|s| 30 + 3 * s).collect();
        let uniforms: Vec<f32> = (0..b)
            .flat_map(|s| {
                let sampler = Sampler::new(Some(seeds[s]));
                (0..=n).map(|d| sampler.uniform_at(positions[s] + d)).collect::<Vec<_>>()
            })
            .collect();
        let input = TreeAcceptInput {
            batch: b,
            max_nodes: n,
            vocab_size: v,
            target_logits: &logits,
            draft_token_ids: &drafts,
            parents: &parents,
            num_nodes: &num_nodes,
            temperatures: &temperatures,
            uniforms: &uniforms,
        };
        let out = tree_accept(&input).unwrap();
        let mut endings = std::collections::BTreeSet::new();
        for s in 0..b {
            let count = num_nodes[s] as usize;
            let rows = &logits[s * (n + 1) * v..][..(count + 1) * v];
            let tree_parents = &parents[s * n..s * n + count];
            let params = SamplingParams { temperature: temperatures[s], ..SamplingParams::default() };
            let mut sampler = Sampler::new(Some(seeds[s]));
            let expected = verify_tree(
                rows,
                v,
                &drafts[s * n..s * n + count],
                tree_parents,
                None,
                &params,
                &mut sampler,
                positions[s],
            )
            .unwrap();
            let accepted = out.num_accepted_tokens[s] as usize;
            let path: Vec<usize> = out.accepted_nodes[s * n..s * n + accepted].iter().map(|&i| i as usize).collect();
            assert_eq!(path, expected.accepted_path, "sequence {s}");
            assert!(out.accepted_nodes[s * n + accepted..(s + 1) * n].iter().all(|&i| i == NO_NODE), "sequence {s}");
            assert_eq!(out.next_token_ids[s], *expected.token_ids.last().unwrap(), "sequence {s}");
            endings.insert(ending(tree_parents, &path));
        }
        assert_eq!(endings.len(), 4, "every kind of walk must occur: {endings:?}");
    }

    #[test]
    fn equals_verify_tree_greedy() {
        check_against_verify_tree(&[0.0]);
    }

    #[test]
    fn equals_verify_tree_sampled() {
        check_against_verify_tree(&[0.7, 1.0, 1.5]);
    }

    #[test]
    fn equals_verify_tree_with_greedy_and_sampled_sequences_mixed() {
        check_against_verify_tree(&[0.0, 1.0, 0.0, 0.5]);
    }

    #[test]
    fn a_greedy_chain_equals_chain_acceptance() {
        // A chain (parent i - 1) is a draft: greedy tree acceptance is the chain's acceptance.
        let (b, n, v) = (40, 5, 10);
        let (logits, drafts, _, num_nodes) = random_trees(b, n, v, 3);
        let chain: Vec<i32> = (0..b).flat_map(|_| (0..n as i32).map(|i| i - 1)).collect();
        let (temperatures, uniforms) = (vec![0.0; b], vec![0.5; b * (n + 1)]);
        let tree = tree_accept(&TreeAcceptInput {
            batch: b,
            max_nodes: n,
            vocab_size: v,
            target_logits: &logits,
            draft_token_ids: &drafts,
            parents: &chain,
            num_nodes: &num_nodes,
            temperatures: &temperatures,
            uniforms: &uniforms,
        })
        .unwrap();
        let chain_out = accept(&AcceptInput {
            batch: b,
            max_draft_tokens: n,
            vocab_size: v,
            target_logits: &logits,
            draft_token_ids: &drafts,
            num_draft_tokens: &num_nodes,
            draft_probs: None,
            temperatures: &temperatures,
            uniforms: &uniforms,
        })
        .unwrap();
        assert!(tree.num_accepted_tokens.iter().any(|&a| a > 1), "no chain was accepted past its first node");
        assert_eq!(tree.num_accepted_tokens, chain_out.num_accepted_tokens);
        assert_eq!(tree.next_token_ids, chain_out.next_token_ids);
        for s in 0..b {
            let accepted = tree.num_accepted_tokens[s] as usize;
            assert_eq!(tree.accepted_nodes[s * n..s * n + accepted], (0..accepted as u32).collect::<Vec<_>>()[..]);
        }
    }

    #[test]
    fn bad_shapes_are_named() {
        let input = TreeAcceptInput {
            batch: 1,
            max_nodes: 2,
            vocab_size: 4,
            target_logits: &[0.0; 12],
            draft_token_ids: &[1, 9],
            parents: &[-1],
            num_nodes: &[3],
            temperatures: &[0.0],
            uniforms: &[0.5; 2],
        };
        let message = tree_accept(&input).unwrap_err().to_string();
        for expected in
            ["uniforms has 2 values, expected 3", "parents has 1 values, expected 2", "num_nodes 3", "draft token 9"]
        {
            assert!(message.contains(expected), "{message}");
        }
    }

    #[test]
    fn bad_parents_are_named() {
        // Node 1's parent is itself; node 2's is a later node; the padding (node 3) is not read.
        for (parents, bad) in [
            ([-1, 1, 0, 7], "parent 1 of node 1"),
            ([-1, 0, 3, 7], "parent 3 of node 2"),
            ([-2, 0, 0, 7], "parent -2 of node 0"),
        ] {
            let input = TreeAcceptInput {
                batch: 1,
                max_nodes: 4,
                vocab_size: 4,
                target_logits: &[0.0; 20],
                draft_token_ids: &[1, 2, 3, 0],
                parents: &parents,
                num_nodes: &[3],
                temperatures: &[0.0],
                uniforms: &[0.5; 5],
            };
            let message = tree_accept(&input).unwrap_err().to_string();
            assert!(message.contains(bad), "{message}");
        }
        let fine = TreeAcceptInput {
            batch: 1,
            max_nodes: 4,
            vocab_size: 4,
            target_logits: &[0.0; 20],
            draft_token_ids: &[1, 2, 3, 0],
            parents: &[-1, 0, 0, 7],
            num_nodes: &[3],
            temperatures: &[0.0],
            uniforms: &[0.5; 5],
        };
        // All-equal logits: the argmax is token 0, which no child of the root carries.
        let out = tree_accept(&fine).unwrap();
        assert_eq!((out.num_accepted_tokens, out.next_token_ids), (vec![0], vec![0]));
        assert_eq!(out.accepted_nodes, vec![NO_NODE; 4]);
    }
}
