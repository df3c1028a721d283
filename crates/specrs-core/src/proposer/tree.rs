//! Token trees: the shape of a tree draft, what a proposer is asked for, and the operations every
//! tree user shares (depths, sibling ranks, pruning to a subset, merging weighted continuations
//! into a best-first trie).
//!
//! A tree draft is `Draft::token_ids` with `Draft::parents`: `parents[i]` is the index of token
//! i's parent among the draft tokens, or -1 when its parent is the newest context token (the root,
//! which the verify forward runs first). Parents come before their children, and siblings come in
//! the proposer's order of preference (rank 0 = its best guess), which the tree chooser
//! (engine/tree_chooser.rs) reads as a signal and static trees (`speculative_token_tree`) index.
//! A chain is the tree whose token i has parent i - 1.
//!
//! Invariant: every operation here keeps parents before children and siblings in order, and a
//! subset it keeps is closed under parents (a kept node's ancestors are kept), so a pruned tree is
//! still a tree of the same draft.

use std::collections::HashMap;

use crate::error::{Error, Result};

/// What a tree draft may hold: at most `max_nodes` tokens, at most `max_children` children per
/// node; the depth limit is the proposer's `max_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeLimits {
    pub max_nodes: usize,
    pub max_children: usize,
}

/// Depth of each node below the root (0 for a child of the root). Errors when a parent does not
/// come before its child.
pub fn depths(parents: &[i32]) -> Result<Vec<usize>> {
    try_depths(parents).map_err(|(node, p)| {
        Error::Proposer(format!(
            "draft token {node} has parent {p}; a parent is -1 (the newest context token) or an earlier draft token's index"
        ))
    })
}

/// `depths`, or the first `(node, parent)` whose parent is neither -1 nor an earlier node (callers
/// word the error for what the nodes are: draft tokens, a forward's rows).
pub fn try_depths(parents: &[i32]) -> std::result::Result<Vec<usize>, (usize, i32)> {
    let mut depths = Vec::with_capacity(parents.len());
    for (node, &parent) in parents.iter().enumerate() {
        let depth = match parent {
            -1 => 0,
            p if p >= 0 && (p as usize) < node => depths[p as usize] + 1,
            p => return Err((node, p)),
        };
        depths.push(depth);
    }
    Ok(depths)
}

/// Rank of each node among its siblings (0 = the first child of its parent).
pub fn sibling_ranks(parents: &[i32]) -> Vec<usize> {
    let mut num_children: HashMap<i32, usize> = HashMap::new();
    parents
        .iter()
        .map(|&p| {
            let count = num_children.entry(p).or_insert(0);
            *count += 1;
            *count - 1
        })
        .collect()
}

/// `[num_nodes + 1]` child lists: entry 0 is the root's children, entry i + 1 node i's, in order.
pub fn children(parents: &[i32]) -> Vec<Vec<usize>> {
    let mut children = vec![Vec::new(); parents.len() + 1];
    for (node, &parent) in parents.iter().enumerate() {
        children[(parent + 1) as usize].push(node);
    }
    children
}

/// The nodes from the root to `node`, root's child first.
pub fn path_to(parents: &[i32], node: usize) -> Vec<usize> {
    let mut path = vec![node];
    let mut current = parents[node];
    while current >= 0 {
        path.push(current as usize);
        current = parents[current as usize];
    }
    path.reverse();
    path
}

/// The tokens from the root to `node` (inclusive) of a draft with `token_ids` and `parents`.
pub fn path_tokens(token_ids: &[u32], parents: &[i32], node: usize) -> Vec<u32> {
    path_to(parents, node).into_iter().map(|i| token_ids[i]).collect()
}

/// The rank-0 path: from the root, each node's first child (the proposer's best guess at every
/// step), root's child first. A chain keeps this path when the tree chooser cuts a tree to one.
pub fn first_path(parents: &[i32]) -> Vec<usize> {
    let children = children(parents);
    let mut path = Vec::new();
    let mut slot = 0;
    while let Some(&first) = children[slot].first() {
        path.push(first);
        slot = first + 1;
    }
    path
}

/// Each node's path of sibling ranks from the root (`[0, 1]`: the root's first child's second
/// child), the key vLLM's `speculative_token_tree` lists nodes by.
pub fn rank_paths(parents: &[i32]) -> Vec<Vec<usize>> {
    let ranks = sibling_ranks(parents);
    let mut paths: Vec<Vec<usize>> = Vec::with_capacity(parents.len());
    for (node, &parent) in parents.iter().enumerate() {
        let mut path = if parent >= 0 { paths[parent as usize].clone() } else { Vec::new() };
        path.push(ranks[node]);
        paths.push(path);
    }
    paths
}

/// Whether `keep` (node indices, increasing) holds each kept node's parent.
pub fn is_closed(parents: &[i32], keep: &[usize]) -> bool {
    let mut kept = vec![false; parents.len()];
    keep.iter().for_each(|&k| kept[k] = true);
    keep.iter().all(|&k| parents[k] < 0 || kept[parents[k] as usize])
}

/// The parents of the subtree `keep` (increasing, closed under parents), renumbered.
pub fn subset_parents(parents: &[i32], keep: &[usize]) -> Vec<i32> {
    let mut new_index = vec![-1i32; parents.len()];
    keep.iter().enumerate().for_each(|(i, &k)| new_index[k] = i as i32);
    keep.iter().map(|&k| if parents[k] < 0 { -1 } else { new_index[parents[k] as usize] }).collect()
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
    fn tree_helpers_agree_on_a_small_tree() {
        // root -> 0 -> 2 -> 4, root -> 1 -> 3, 0 -> 5
        let parents = [-1, -1, 0, 1, 2, 0];
        assert_eq!(depths(&parents).unwrap(), vec![0, 0, 1, 1, 2, 1]);
        assert_eq!(sibling_ranks(&parents), vec![0, 1, 0, 0, 0, 1]);
        assert_eq!(children(&parents), vec![vec![0, 1], vec![2, 5], vec![3], vec![4], vec![], vec![], vec![]]);
        assert_eq!(path_to(&parents, 4), vec![0, 2, 4]);
        assert_eq!(path_tokens(&[10, 11, 12, 13, 14, 15], &parents, 4), vec![10, 12, 14]);
        assert_eq!(first_path(&parents), vec![0, 2, 4]);
        assert_eq!(first_path(&[]), Vec::<usize>::new());
        assert_eq!(rank_paths(&parents)[5], vec![0, 1]);
        assert!(is_closed(&parents, &[0, 2, 4]));
        assert!(!is_closed(&parents, &[0, 4]));
        assert_eq!(subset_parents(&parents, &[0, 1, 5]), vec![-1, -1, 0]);
        assert!(depths(&[-1, 2, 0]).is_err());
    }

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
