//! Token-tree index math: the shape of a token tree and the operations every tree user shares
//! (depths, children, sibling ranks, root-to-node paths, subsets closed under parents). Proposers,
//! the forward contract and the verifier all index trees through this module.
//!
//! A token tree is a list of tokens with `parents`: `parents[i]` is the index of token i's parent
//! among them, or -1 when its parent is the root (the newest context token, which the verify
//! forward runs first). Parents come before their children, and siblings come in the proposer's
//! order of preference (rank 0 = its best guess), which the tree chooser
//! (engine/tree_chooser.rs) reads as a signal and static trees (`speculative_token_tree`) index.
//! A chain is the tree whose token i has parent i - 1.
//!
//! Invariant: every operation here keeps parents before children and siblings in order, and a
//! subset it keeps is closed under parents (a kept node's ancestors are kept), so a pruned tree is
//! still a tree of the same draft.

use std::collections::HashMap;

use crate::error::{Error, Result};

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
}
