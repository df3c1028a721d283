//! The token-tree keys of a speculative config: `"tree"` (false, true or "auto"), vLLM's
//! `speculative_token_tree` (a static tree), and specrs' `tree_depth` and `tree_top_k`.
//!
//! With a tree, `num_speculative_tokens` is the node budget: the draft tokens one step verifies
//! (vLLM's meaning for its static trees, where it must equal the tree's size), so a chain of k and
//! a tree of k nodes verify the same number of rows.
//!
//! Invariant: a parsed `TreeConfig` is complete (depth and fan-out filled in) and a static tree is
//! closed under parents and sibling prefixes (each listed node's parent and higher-ranked siblings
//! are listed), so pruning a draft to it keeps a tree any verifier can walk.

use serde_json::{Map, Value};

use super::{bounded_count, shown, MAX_SPECULATIVE_TOKENS};
use crate::error::{Error, Result};

/// The most children one node may get.
pub const MAX_TREE_TOP_K: usize = 16;

/// Whether drafts are token trees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TreeMode {
    /// Chains (the default).
    Off,
    /// Trees every step, verified whole (up to the budget and the static shape).
    On,
    /// Per step, the tree chooser picks the subtree (or chain, or nothing) with the best expected
    /// tokens per second (engine/tree_chooser.rs).
    Auto,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TreeConfig {
    pub mode: TreeMode,
    /// Levels below the newest token.
    pub max_depth: usize,
    /// Children per node.
    pub max_children: usize,
    /// vLLM's `speculative_token_tree`: each node as its path of sibling ranks from the root
    /// (`[0, 1]`: the second child of the first child); drafts are pruned to these nodes.
    pub static_tree: Option<Vec<Vec<usize>>>,
}

impl TreeConfig {
    pub fn off() -> Self {
        Self { mode: TreeMode::Off, max_depth: 0, max_children: 0, static_tree: None }
    }

    pub fn is_on(&self) -> bool {
        self.mode != TreeMode::Off
    }

    /// Parses the tree keys. `num_speculative_tokens` is what the config gave (None: not given);
    /// returns the config and the node budget a static tree implies.
    pub fn parse(map: &Map<String, Value>, num_speculative_tokens: Option<usize>) -> Result<(Self, Option<usize>)> {
        let static_tree = match map.get("speculative_token_tree") {
            None | Some(Value::Null) => None,
            Some(value) => Some(parse_static_tree(value)?),
        };
        let mode = match map.get("tree") {
            None | Some(Value::Null) => {
                if static_tree.is_some() {
                    TreeMode::On
                } else {
                    TreeMode::Off
                }
            }
            Some(Value::Bool(false)) => TreeMode::Off,
            Some(Value::Bool(true)) => TreeMode::On,
            Some(Value::String(s)) if s == "auto" => TreeMode::Auto,
            Some(other) => {
                return Err(Error::config(format!(
                    "'tree' must be false, true or \"auto\" (got {})",
                    shown(&other.to_string())
                )));
            }
        };
        let depth = bounded_count(map, "tree_depth", MAX_SPECULATIVE_TOKENS)?;
        let top_k = bounded_count(map, "tree_top_k", MAX_TREE_TOP_K)?;
        if mode == TreeMode::Off {
            if static_tree.is_some() {
                return Err(Error::config(
                    "speculative_token_tree is a tree but \"tree\" is false; remove one of them",
                ));
            }
            if let Some(key) = ["tree_depth", "tree_top_k"].into_iter().find(|k| map.contains_key(*k)) {
                return Err(Error::config(format!(
                    "'{key}' shapes token trees, which this config does not draft; set \"tree\": true or \"auto\", or remove it"
                )));
            }
            return Ok((Self::off(), None));
        }
        if depth == Some(0) || top_k == Some(0) {
            return Err(Error::config("tree_depth and tree_top_k must be at least 1; try 4"));
        }
        let Some(static_tree) = static_tree else {
            // Depth 0 = not given: `fill_depth` sets it to the budget once the method's is known.
            let config =
                Self { mode, max_depth: depth.unwrap_or(0), max_children: top_k.unwrap_or(4), static_tree: None };
            return Ok((config, None));
        };
        if let Some(k) = num_speculative_tokens.filter(|&k| k != static_tree.len()) {
            return Err(Error::config(format!(
                "num_speculative_tokens is {k} but speculative_token_tree has {} nodes; they must be equal (or leave num_speculative_tokens out)",
                static_tree.len()
            )));
        }
        let tree_depth = static_tree.iter().map(Vec::len).max().unwrap_or(1);
        let tree_top_k = static_tree.iter().flatten().max().map_or(1, |r| r + 1);
        if depth.is_some_and(|d| d != tree_depth) || top_k.is_some_and(|k| k != tree_top_k) {
            return Err(Error::config(format!(
                "speculative_token_tree is {tree_depth} deep with up to {tree_top_k} children per node; \
                 tree_depth and tree_top_k must match it (or be left out)"
            )));
        }
        let num_nodes = static_tree.len();
        let config = Self { mode, max_depth: tree_depth, max_children: tree_top_k, static_tree: Some(static_tree) };
        Ok((config, Some(num_nodes)))
    }

    /// With the node budget known: a depth left out becomes the budget, and none exceeds it.
    pub fn fill_depth(&mut self, num_speculative_tokens: usize) {
        if self.is_on() && (self.max_depth == 0 || self.max_depth > num_speculative_tokens) {
            self.max_depth = num_speculative_tokens;
        }
    }

    /// The keys that recreate this tree config.
    pub fn to_json(&self, map: &mut Map<String, Value>) {
        let mode: Value = match self.mode {
            TreeMode::Off => return,
            TreeMode::On => true.into(),
            TreeMode::Auto => "auto".into(),
        };
        map.insert("tree".into(), mode);
        match &self.static_tree {
            Some(tree) => {
                map.insert("speculative_token_tree".into(), tree.clone().into());
            }
            None => {
                map.insert("tree_depth".into(), self.max_depth.into());
                map.insert("tree_top_k".into(), self.max_children.into());
            }
        }
    }
}

/// vLLM's `speculative_token_tree`: a list of tuples of sibling ranks, as a JSON list of lists or
/// as vLLM's string (`"[(0,), (1,), (0, 0)]"`).
fn parse_static_tree(value: &Value) -> Result<Vec<Vec<usize>>> {
    let bad = |what: String| {
        Error::config(format!(
            "speculative_token_tree must list each node as its path of child ranks from the root, \
             e.g. [[0], [1], [0, 0]] or \"[(0,), (1,), (0, 0)]\" ({what})"
        ))
    };
    let value = match value {
        Value::String(text) => {
            // A Python literal of tuples is JSON once tuples become lists and trailing commas go.
            let json = text.replace('(', "[").replace(')', "]").replace(",]", "]").replace(", ]", "]");
            serde_json::from_str::<Value>(&json).map_err(|e| bad(format!("not a list of tuples: {e}")))?
        }
        other => other.clone(),
    };
    let Value::Array(nodes) = value else { return Err(bad("not a list".into())) };
    if nodes.is_empty() || nodes.len() > MAX_SPECULATIVE_TOKENS {
        return Err(bad(format!("it has {} nodes; give 1 to {MAX_SPECULATIVE_TOKENS}", nodes.len())));
    }
    let mut paths: Vec<Vec<usize>> = Vec::with_capacity(nodes.len());
    for node in &nodes {
        let path: Vec<usize> = match node {
            Value::Array(ranks) if !ranks.is_empty() => ranks
                .iter()
                .map(|r| r.as_u64().filter(|&r| r < MAX_TREE_TOP_K as u64).map(|r| r as usize))
                .collect::<Option<_>>()
                .ok_or_else(|| bad(format!("{node} is not a list of ranks in 0..{MAX_TREE_TOP_K}")))?,
            _ => return Err(bad(format!("{node} is not a non-empty list"))),
        };
        if paths.contains(&path) {
            return Err(bad(format!("{node} is listed twice")));
        }
        let (&rank, parent) = path.split_last().expect("non-empty");
        if !parent.is_empty() && !paths.iter().any(|p| p == parent) {
            return Err(bad(format!("{node} comes before its parent {parent:?}; list parents first")));
        }
        if rank > 0 {
            let mut previous = parent.to_vec();
            previous.push(rank - 1);
            if !paths.contains(&previous) {
                return Err(bad(format!("{node} needs its higher-ranked sibling {previous:?} listed before it")));
            }
        }
        paths.push(path);
    }
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str, k: Option<usize>) -> Result<(TreeConfig, Option<usize>)> {
        let Value::Object(map) = serde_json::from_str(text).unwrap() else { panic!() };
        TreeConfig::parse(&map, k)
    }

    #[test]
    fn tree_keys_parse_with_defaults_and_errors_that_name_the_fix() {
        assert_eq!(parse("{}", Some(4)).unwrap().0, TreeConfig::off());
        let (mut auto, _) = parse(r#"{"tree": "auto"}"#, Some(8)).unwrap();
        auto.fill_depth(8);
        assert_eq!((auto.mode, auto.max_depth, auto.max_children), (TreeMode::Auto, 8, 4));
        let (mut on, _) = parse(r#"{"tree": true, "tree_depth": 3, "tree_top_k": 2}"#, Some(8)).unwrap();
        on.fill_depth(8);
        assert_eq!((on.mode, on.max_depth, on.max_children), (TreeMode::On, 3, 2));
        let (fixed, k) = parse(r#"{"speculative_token_tree": "[(0,), (1,), (0, 0), (0, 1)]"}"#, None).unwrap();
        assert_eq!(k, Some(4));
        assert_eq!((fixed.mode, fixed.max_depth, fixed.max_children), (TreeMode::On, 2, 2));
        assert_eq!(fixed.static_tree.unwrap()[3], vec![0, 1]);
        let list = parse(r#"{"speculative_token_tree": [[0], [0, 0]]}"#, Some(2)).unwrap().0;
        assert_eq!(list.static_tree.unwrap(), vec![vec![0], vec![0, 0]]);
        for (text, k, needle) in [
            (r#"{"tree": "yes"}"#, Some(4), "false, true or \"auto\""),
            (r#"{"tree_depth": 3}"#, Some(4), "set \"tree\""),
            (r#"{"tree": false, "speculative_token_tree": [[0]]}"#, Some(1), "remove one"),
            (r#"{"speculative_token_tree": [[0], [0, 0]]}"#, Some(3), "must be equal"),
            (r#"{"speculative_token_tree": [[0, 0], [0]]}"#, None, "list parents first"),
            (r#"{"speculative_token_tree": [[0], [2]]}"#, None, "higher-ranked sibling"),
            (r#"{"speculative_token_tree": "[(0,), (0,)]"}"#, None, "listed twice"),
            (r#"{"tree": true, "tree_top_k": 0}"#, Some(4), "at least 1"),
        ] {
            let err = parse(text, k).unwrap_err().to_string();
            assert!(err.contains(needle), "{text}: {err}");
        }
    }
}
