//! Token trees as proposers draft them: what a proposer is asked for (`TreeLimits`) and the
//! best-first trie that merges weighted continuations into a tree draft. The index math every tree
//! user shares lives in `crate::tree` and is re-exported here so proposers keep their paths.
//!
//! A tree draft is `Draft::token_ids` with `Draft::parents` (see `crate::tree` for the shape).
//!
//! Invariant: a tree read out of the trie keeps parents before children and siblings best first,
//! within its `TreeLimits`.

use std::collections::HashMap;

pub use crate::tree::{
    children, depths, first_path, is_closed, path_to, path_tokens, rank_paths, sibling_ranks, subset_parents,
    try_depths,
};

/// What a tree draft may hold: at most `max_nodes` tokens, at most `max_children` children per
/// node; the depth limit is the proposer's `max_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeLimits {
    pub max_nodes: usize,
    pub max_children: usize,
}

/// A trie of weighted continuations of the context, read out best first: the tree a model-free
/// proposer drafts when it knows several continuations (n-gram: several earlier occurrences).
/// Suffix decoding already holds its continuations in a count trie and grows its tree there.
#[derive(Debug)]
pub struct ContinuationTrie {
    /// `(parent node, token) -> node`; node 0 is the root.
    edges: HashMap<(usize, u32), usize>,
    /// `[num_nodes]` token of each node (unused for the root).
    tokens: Vec<u32>,
    /// `[num_nodes]` summed weight of the continuations through each node.
    weights: Vec<f64>,
    /// `[num_nodes]` children of each node, in insertion order.
    child_lists: Vec<Vec<usize>>,
}

impl Default for ContinuationTrie {
    fn default() -> Self {
        Self::new()
    }
}

impl ContinuationTrie {
    pub fn new() -> Self {
        Self { edges: HashMap::new(), tokens: vec![0], weights: vec![0.0], child_lists: vec![Vec::new()] }
    }

    /// Adds one continuation (its first token follows the context) with weight `weight`.
    pub fn insert(&mut self, continuation: &[u32], weight: f64) {
        let mut node = 0;
        self.weights[0] += weight;
        for &token in continuation {
            node = match self.edges.get(&(node, token)) {
                Some(&child) => child,
                None => {
                    let child = self.tokens.len();
                    self.edges.insert((node, token), child);
                    self.tokens.push(token);
                    self.weights.push(0.0);
                    self.child_lists.push(Vec::new());
                    self.child_lists[node].push(child);
                    child
                }
            };
            self.weights[node] += weight;
        }
    }

    /// The best-first tree within `limits` and depth `max_depth`: nodes are taken in decreasing
    /// share of the root's weight (the estimated probability that the text goes through them),
    /// each only after its parent, at most `max_children` per parent. Returns
    /// `(token_ids, parents)` with parents before children and siblings in decreasing weight.
    pub fn best_first(&self, max_depth: usize, limits: TreeLimits) -> (Vec<u32>, Vec<i32>) {
        let mut frontier: Vec<(usize, i32, usize)> = Vec::new(); // (trie node, parent draft index, depth)
        let mut token_ids = Vec::new();
        let mut parents = Vec::new();
        let mut num_children = vec![0usize; 1];
        self.push_children(0, -1, 0, max_depth, &mut frontier);
        while token_ids.len() < limits.max_nodes {
            // Highest weight first; ties by trie order, so the tree is deterministic.
            let Some(best) = (0..frontier.len()).max_by(|&a, &b| {
                self.weights[frontier[a].0]
                    .total_cmp(&self.weights[frontier[b].0])
                    .then(frontier[b].0.cmp(&frontier[a].0))
            }) else {
                break;
            };
            let (node, parent, depth) = frontier.swap_remove(best);
            let slot = (parent + 1) as usize;
            if num_children[slot] >= limits.max_children {
                continue;
            }
            num_children[slot] += 1;
            let index = token_ids.len() as i32;
            token_ids.push(self.tokens[node]);
            parents.push(parent);
            num_children.push(0);
            self.push_children(node, index, depth + 1, max_depth, &mut frontier);
        }
        // Best first overall means siblings are already in decreasing weight.
        (token_ids, parents)
    }

    fn push_children(
        &self,
        node: usize,
        draft_index: i32,
        depth: usize,
        max_depth: usize,
        frontier: &mut Vec<(usize, i32, usize)>,
    ) {
        if depth >= max_depth {
            return;
        }
        frontier.extend(self.child_lists[node].iter().map(|&child| (child, draft_index, depth)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trie_reads_out_best_first_within_its_limits() {
        let mut trie = ContinuationTrie::new();
        trie.insert(&[1, 2, 3], 3.0);
        trie.insert(&[1, 2, 4], 1.0);
        trie.insert(&[5, 6], 2.0);
        let all = TreeLimits { max_nodes: 16, max_children: 4 };
        let (tokens, parents) = trie.best_first(8, all);
        // 1 (4.0), 2 (4.0), 3 (3.0), 5 (2.0), 6 (2.0), 4 (1.0)
        assert_eq!(tokens, vec![1, 2, 3, 5, 6, 4]);
        assert_eq!(parents, vec![-1, 0, 1, -1, 3, 1]);
        let (tokens, parents) = trie.best_first(2, TreeLimits { max_nodes: 3, max_children: 4 });
        assert_eq!((tokens, parents), (vec![1, 2, 5], vec![-1, 0, -1]));
        let (tokens, _) = trie.best_first(8, TreeLimits { max_nodes: 16, max_children: 1 });
        assert_eq!(tokens, vec![1, 2, 3]);
    }
}
