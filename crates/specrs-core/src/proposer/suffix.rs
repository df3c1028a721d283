//! SuffixDecoding (Oliaro et al., arXiv 2411.04975), the proposer behind `"method": "suffix"`: it
//! guesses the continuation of the context's longest recent suffix by following the most frequent
//! path in count tries over this request's tokens and over previous responses.
//!
//! Shape: every request owns a [`SuffixTree`] over its prompt and generated tokens (indexed
//! incrementally, O(depth) per new token); the engine shares one [`SuffixCache`], a tree over the
//! last `max_cached_requests` finished responses. Both trees are queried each step and the draft
//! with the higher score wins. The matching and scoring rules follow Snowflake's arctic-inference
//! (`csrc/suffix_decoding/suffix_tree.cc`, `arctic_inference/suffix_decoding/cache.py`), which
//! vLLM's `vllm/v1/spec_decode/suffix_decoding.py` calls; see [`SuffixProposer`] for the rules.
//!
//! On CUDA a batch's chains are looked up together on the device (`suffix_together.rs`) over a
//! mirror of these trees: a mirrored tree logs the nodes whose count, token or best child change,
//! so a step uploads only those.
//!
//! Tree drafts (`propose_tree`) are SuffixDecoding's tree speculation: from the winning chain's
//! match node, the continuations most likely under the counts, best first by cumulative
//! probability, with the chain itself as the rank-0 path.
//!
//! Invariant: every node's count is the number of occurrences of its token string (a substring of
//! at most `max_depth` tokens) in the sequences the tree currently holds, and a node exists exactly
//! when that count is positive. So a tree's nodes depend only on the multiset of sequences it holds,
//! never on the order they came and went in, which is what bounds the cache's memory.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{Draft, IndexedTail, Proposer, TreeLimits};
use crate::error::Result;
pub use crate::spec_config::SuffixParams;

// "No node": the end of a sibling list, a missing child, or a best child not yet known (the
// device mirror's pool means the same by it: its entries carry the arena's links as they are).
use crate::batch::suffix::NONE;
/// The root (the empty string) is always node 0.
const ROOT: u32 = 0;

/// One trie node: the string it stands for is the tokens on the path from the root. Nodes live in
/// an arena and link to each other by index, so the tree costs no allocation per node.
#[derive(Debug, Clone, Copy)]
struct Node {
    /// Occurrences of this node's string in the indexed sequences.
    count: u32,
    /// The last token of this node's string (the edge from its parent).
    token: u32,
    /// Children as a doubly linked list (unordered), so a child unlinks in O(1) when pruned.
    first_child: u32,
    next_sibling: u32,
    prev_sibling: u32,
    /// The child with the highest count (ties: smallest token), or NONE when there are no children
    /// or when a decrement made it unknown; [`NodeArena::best_child`] recomputes it on demand.
    best_child: u32,
    /// Whether this node's child edges are in the tree's edge map (see `SuffixTree::edges`).
    wide: bool,
}

impl Node {
    fn new(token: u32) -> Self {
        Self {
            count: 0,
            token,
            first_child: NONE,
            next_sibling: NONE,
            prev_sibling: NONE,
            best_child: NONE,
            wide: false,
        }
    }
}

/// Does child `a` win the greedy step over child `b`? Higher count first, then the smaller token,
/// so drafts are deterministic. (arctic keeps siblings sorted by count and takes the head; its
/// order among equal counts depends on update history, so this tie rule is ours.)
fn beats(a: &Node, b: &Node) -> bool {
    a.count > b.count || (a.count == b.count && a.token < b.token)
}

/// How far one greedy walk may go.
#[derive(Debug, Clone, Copy)]
struct DraftLimits {
    max_tokens: usize,
    max_spec_factor: f32,
    min_token_prob: f32,
}

impl DraftLimits {
    /// Tokens a match of `match_len` may propose: `min(max_tokens, floor(match_len * factor))`.
    /// arctic computes `match_len * max_spec_factor + max_spec_offset + 1e-6` (float, then double)
    /// and truncates; vLLM leaves the offset at 0, so it is not a setting here.
    fn for_match(&self, match_len: usize) -> usize {
        let cap = (f64::from(match_len as f32 * self.max_spec_factor) + 1e-6) as usize;
        cap.min(self.max_tokens)
    }
}

/// The node arena plus the greedy walk, apart from the edge map so a tree can walk its nodes while
/// reading its own match lists.
#[derive(Debug)]
struct NodeArena {
    nodes: Vec<Node>,
    /// Released slots, reused before the arena grows.
    free: Vec<u32>,
    /// The nodes whose count, token or best child changed since a device mirror last read them
    /// (`suffix_together.rs`); None until a mirror reads the tree, so a tree no device mirrors
    /// logs nothing.
    log: Option<ChangeLog>,
}

/// What a device mirror has not read yet: each changed node once.
#[derive(Debug, Default)]
struct ChangeLog {
    /// The mirror that read the tree last (a mirror of another device must read it whole).
    owner: u64,
    changed: Vec<u32>,
    marked: Vec<bool>,
}

impl NodeArena {
    fn new() -> Self {
        Self { nodes: vec![Node::new(0)], free: Vec::new(), log: None }
    }

    /// Notes that node `id`'s mirror entry changed (where a mirror reads this tree).
    fn mark(&mut self, id: u32) {
        if let Some(log) = &mut self.log {
            let i = id as usize;
            if i >= log.marked.len() {
                log.marked.resize(i + 1, false);
            }
            if !log.marked[i] {
                log.marked[i] = true;
                log.changed.push(id);
            }
        }
    }

    /// Node `id` as a device mirror holds it: `[count, token, best child or NONE]` (a free slot,
    /// count 0, has no child a walk could reach).
    fn mirror_entry(&mut self, id: u32) -> [u32; 3] {
        let node = self.nodes[id as usize];
        let best = if node.count == 0 { NONE } else { self.best_child(id) };
        [node.count, node.token, best]
    }

    fn live(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    /// Bytes the arena holds (capacity, free slots included: they are not returned to the OS), and
    /// its change log where a mirror reads it.
    fn memory_bytes(&self) -> usize {
        let log = self.log.as_ref().map_or(0, |log| log.changed.capacity() * 4 + log.marked.capacity());
        self.nodes.capacity() * std::mem::size_of::<Node>() + self.free.capacity() * std::mem::size_of::<u32>() + log
    }

    /// A fresh node for `token`, linked first among `parent`'s children, with count 0.
    fn alloc_child(&mut self, parent: u32, token: u32) -> u32 {
        let id = match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize] = Node::new(token);
                id
            }
            None => {
                let id = u32::try_from(self.nodes.len()).ok().filter(|&id| id != NONE).expect("suffix tree node ids");
                self.nodes.push(Node::new(token));
                id
            }
        };
        let old_first = self.nodes[parent as usize].first_child;
        if old_first == NONE {
            // An only child is trivially the best one.
            self.nodes[parent as usize].best_child = id;
        } else {
            self.nodes[old_first as usize].prev_sibling = id;
        }
        self.nodes[id as usize].next_sibling = old_first;
        self.nodes[parent as usize].first_child = id;
        self.mark(id);
        self.mark(parent);
        id
    }

    /// Unlinks `child` (count 0) from `parent` and frees its slot.
    fn release_child(&mut self, parent: u32, child: u32) {
        let Node { next_sibling, prev_sibling, .. } = self.nodes[child as usize];
        if prev_sibling == NONE {
            self.nodes[parent as usize].first_child = next_sibling;
        } else {
            self.nodes[prev_sibling as usize].next_sibling = next_sibling;
        }
        if next_sibling != NONE {
            self.nodes[next_sibling as usize].prev_sibling = prev_sibling;
        }
        self.free.push(child);
    }

    /// One more occurrence of `child`; a count only rises here, so the best child can only become
    /// `child` itself.
    fn increment(&mut self, parent: u32, child: u32) {
        self.mark(child);
        self.mark(parent);
        self.nodes[child as usize].count += 1;
        let best = self.nodes[parent as usize].best_child;
        if best != NONE && best != child && beats(&self.nodes[child as usize], &self.nodes[best as usize]) {
            self.nodes[parent as usize].best_child = child;
        }
    }

    /// One fewer occurrence of `child`; returns whether it reached 0 (the caller prunes it).
    fn decrement(&mut self, parent: u32, child: u32) -> bool {
        self.mark(child);
        self.mark(parent);
        let node = &mut self.nodes[child as usize];
        node.count -= 1;
        let emptied = node.count == 0;
        if self.nodes[parent as usize].best_child == child {
            // Some sibling may now beat it; find out lazily, only if a draft ever asks.
            self.nodes[parent as usize].best_child = NONE;
        }
        emptied
    }

    /// The greedy child of `id` (NONE at a leaf), rescanning the children if a decrement left it
    /// unknown.
    fn best_child(&mut self, id: u32) -> u32 {
        let node = self.nodes[id as usize];
        if node.best_child != NONE || node.first_child == NONE {
            return node.best_child;
        }
        let mut best = node.first_child;
        let mut child = self.nodes[best as usize].next_sibling;
        while child != NONE {
            if beats(&self.nodes[child as usize], &self.nodes[best as usize]) {
                best = child;
            }
            child = self.nodes[child as usize].next_sibling;
        }
        self.nodes[id as usize].best_child = best;
        best
    }

    /// The greedy path below `start` (arctic's `_speculate_path`): step to the best child while the
    /// draft is shorter than `limit`, multiplying the running probability by count(child) /
    /// count(node); stop before the token whose running probability falls below `min_token_prob`,
    /// or at a leaf (which also ends every path at the tree's depth). Appends the tokens to `out`
    /// and returns the draft's score, the sum of the running probabilities of its tokens.
    fn greedy_path(&mut self, start: u32, limit: usize, min_token_prob: f32, out: &mut Vec<u32>) -> f32 {
        let mut prob = 1.0f32;
        let mut score = 0.0f32;
        let mut node = start;
        while out.len() < limit {
            let child = self.best_child(node);
            if child == NONE {
                break;
            }
            let (child_node, parent_count) = (self.nodes[child as usize], self.nodes[node as usize].count);
            prob *= child_node.count as f32 / parent_count as f32;
            if prob < min_token_prob {
                break;
            }
            out.push(child_node.token);
            score += prob;
            node = child;
        }
        score
    }

    /// arctic's `speculate`: `matches[m]` is the node of the context's last m tokens, for every
    /// match length m in `1..matches.len()` (index 0, the root, is skipped). arctic tries every match
    /// length, not only the longest, and keeps the draft with the highest score; ties go to the
    /// longer match (`>=`). Leaves the winning tokens in `out` and returns where they came from.
    fn best_draft(
        &mut self,
        matches: &[u32],
        limits: DraftLimits,
        out: &mut Vec<u32>,
        scratch: &mut Vec<u32>,
    ) -> BestMatch {
        out.clear();
        let mut best = BestMatch { node: ROOT, match_len: 0, score: 0.0 };
        for (match_len, &node) in matches.iter().enumerate().skip(1) {
            scratch.clear();
            let score = self.greedy_path(node, limits.for_match(match_len), limits.min_token_prob, scratch);
            if score >= best.score {
                best = BestMatch { node, match_len, score };
                std::mem::swap(out, scratch);
            }
        }
        best
    }

    /// The token tree below match node `start`, whose greedy path of `chain_len` tokens won the
    /// chain comparison: that path first (draft indices `0..chain_len`, each the first child of
    /// its parent), then the other continuations best first by cumulative probability, as
    /// arctic's `_speculate_tree` (a child's probability is count(child) / count(parent), and the
    /// cumulative probability multiplies along the path). A node is drafted only after its parent,
    /// with cumulative probability at least `min_token_prob`, at depth below `depth_limit`, at most
    /// `limits.max_children` children per node and `limits.max_nodes` in all. Ties go to the earlier
    /// parent, then as in `beats`, so siblings come in the greedy walk's order of preference.
    /// Returns `(token_ids, parents)` as in `Draft`.
    fn grow_tree(
        &mut self,
        start: u32,
        chain_len: usize,
        depth_limit: usize,
        min_token_prob: f32,
        limits: TreeLimits,
    ) -> (Vec<u32>, Vec<i32>) {
        let mut token_ids = Vec::new();
        let mut parents = Vec::new();
        // The rank-0 path: the greedy walk again, over the same counts, so the same tokens.
        let mut path: Vec<(u32, f32)> = Vec::with_capacity(chain_len); // (node, cumulative probability)
        let (mut node, mut prob) = (start, 1.0f32);
        while path.len() < chain_len.min(limits.max_nodes) {
            let child = self.best_child(node);
            if child == NONE {
                break;
            }
            // The same expression as `greedy_path`, so the probabilities compare equal.
            prob *= self.nodes[child as usize].count as f32 / self.nodes[node as usize].count as f32;
            token_ids.push(self.nodes[child as usize].token);
            parents.push(path.len() as i32 - 1);
            path.push((child, prob));
            node = child;
        }
        // Alternatives branch off the root (depth 0) and off each path node (depth i + 1). A node
        // gets all its children pushed at once, cut to the slots left, so no parent overfills.
        let mut frontier = BinaryHeap::new();
        for depth in 0..=path.len() {
            let (node, prob) = if depth == 0 { (start, 1.0) } else { path[depth - 1] };
            if depth < depth_limit {
                let at = Placement { parent: depth as i32 - 1, depth, min_token_prob };
                let taken = path.get(depth).map(|&(child, _)| child);
                let room = limits.max_children.saturating_sub(usize::from(taken.is_some()));
                self.push_children(node, prob, at, taken, room, &mut frontier);
            }
        }
        while token_ids.len() < limits.max_nodes {
            let Some(candidate) = frontier.pop() else { break };
            let index = token_ids.len() as i32;
            token_ids.push(candidate.token);
            parents.push(candidate.parent);
            let depth = candidate.depth + 1;
            if depth < depth_limit {
                let at = Placement { parent: index, depth, min_token_prob };
                self.push_children(candidate.node, candidate.prob, at, None, limits.max_children, &mut frontier);
            }
        }
        (token_ids, parents)
    }

    /// Adds to `frontier` the best `room` children of `node` (cumulative probability `prob`) but
    /// `taken`, those whose cumulative probability reaches `at.min_token_prob`. Children past the
    /// best `room` could never be drafted (their parent's slots would be full first), so the heap
    /// stays at most `max_nodes * max_children` long however wide the node is.
    fn push_children(
        &self,
        node: u32,
        prob: f32,
        at: Placement,
        taken: Option<u32>,
        room: usize,
        frontier: &mut BinaryHeap<Candidate>,
    ) {
        let parent_count = self.nodes[node as usize].count;
        let mut children = Vec::new();
        let mut child = self.nodes[node as usize].first_child;
        while child != NONE {
            let Node { count, token, next_sibling, .. } = self.nodes[child as usize];
            let child_prob = prob * (count as f32 / parent_count as f32);
            if Some(child) != taken && child_prob >= at.min_token_prob {
                children.push(Candidate {
                    prob: child_prob,
                    parent: at.parent,
                    count,
                    token,
                    node: child,
                    depth: at.depth,
                });
            }
            child = next_sibling;
        }
        children.sort_unstable_by(|a, b| b.cmp(a));
        children.truncate(room);
        frontier.extend(children);
    }
}

/// Where the winning greedy draft of one tree starts: its match node and length, and its score.
#[derive(Debug, Clone, Copy)]
struct BestMatch {
    node: u32,
    match_len: usize,
    score: f32,
}

/// Where the children being pushed onto a tree's frontier go: their parent's draft index (-1: the
/// root), their depth, and the cumulative probability they must reach.
#[derive(Debug, Clone, Copy)]
struct Placement {
    parent: i32,
    depth: usize,
    min_token_prob: f32,
}

/// A node that may join a tree draft: its cumulative probability, its parent's draft index, and
/// the trie node it stands for.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    prob: f32,
    parent: i32,
    count: u32,
    token: u32,
    node: u32,
    depth: usize,
}

impl Ord for Candidate {
    /// Greater = drafted first: higher cumulative probability, then the earlier parent, then as
    /// in `beats` (higher count, smaller token), so the order is total and deterministic.
    fn cmp(&self, other: &Self) -> Ordering {
        self.prob
            .total_cmp(&other.prob)
            .then_with(|| other.parent.cmp(&self.parent))
            .then_with(|| self.count.cmp(&other.count))
            .then_with(|| other.token.cmp(&self.token))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

/// fmix64 over the packed (parent, token) edge key; the plain key would put every child of one
/// token in the same bucket.
#[derive(Default)]
struct EdgeHasher(u64);

impl Hasher for EdgeHasher {
    fn finish(&self) -> u64 {
        let mut x = self.0;
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 33;
        x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        x ^ (x >> 33)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(byte);
        }
    }
    fn write_u64(&mut self, key: u64) {
        self.0 = key;
    }
}

/// (parent << 32 | token) -> child, for the children of wide nodes.
type EdgeMap = HashMap<u64, u32, BuildHasherDefault<EdgeHasher>>;

fn edge_key(parent: u32, token: u32) -> u64 {
    u64::from(parent) << 32 | u64::from(token)
}

/// A node whose child list grows past this many children becomes wide: its edges go into the edge
/// map. Below it, scanning the list is cheaper than a hash probe, because most trie nodes (the
/// deep ones) have 0 or 1 children and the parent was touched one token ago, so it is in cache,
/// while a probe into a large map is a cache miss.
const WIDE_FANOUT: usize = 8;

/// A depth-bounded suffix tree (count trie of all substrings of length <= max_tree_depth) with
/// per-node occurrence counts.
///
/// It holds any number of whole sequences ([`insert`](Self::insert) / [`remove`](Self::remove))
/// plus one open sequence that grows by [`append`](Self::append) in O(max_depth) per token: the
/// tree keeps the nodes of the open sequence's last 0..max_depth-1 tokens (its active suffixes),
/// and a new token extends each of them by one edge. Memory: 28 bytes per node, plus an edge-map
/// entry for each child of a wide node; a sequence of n tokens adds up to n * max_depth nodes
/// (fewer where text repeats). arctic compresses
/// single-child chains to reach O(n) nodes; this trie does not.
#[derive(Debug)]
pub struct SuffixTree {
    max_depth: usize,
    arena: NodeArena,
    /// Child edges of wide nodes (the root and other high fan-out nodes); narrow nodes' children
    /// are found by scanning their list.
    edges: EdgeMap,
    /// `open_suffixes[len]` = node of the open sequence's last `len` tokens, for len in
    /// 0..=min(appended, max_depth - 1); these are exactly the nodes a new token extends.
    open_suffixes: Vec<u32>,
    /// Spare buffer for rebuilding a suffix list (keeps `append` allocation-free).
    next_suffixes: Vec<u32>,
    /// Tokens of all held sequences (the root's count, as u64).
    num_tokens: u64,
    /// Unique per tree: a device mirror's key for it.
    mirror_id: u64,
}

impl SuffixTree {
    pub fn new(max_depth: usize) -> Self {
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Self {
            mirror_id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            max_depth,
            arena: NodeArena::new(),
            edges: EdgeMap::default(),
            open_suffixes: vec![ROOT],
            next_suffixes: Vec::with_capacity(max_depth + 1),
            num_tokens: 0,
        }
    }

    pub fn max_depth(&self) -> usize {
        self.max_depth
    }

    /// Its key in a device mirror (`suffix_together.rs`): unique per tree, so a tree built anew
    /// (a rewritten context, a replaced cache) is mirrored anew.
    pub(crate) fn mirror_id(&self) -> u64 {
        self.mirror_id
    }

    /// Node slots a mirror holds for it (free ones included: the arena's length).
    pub(crate) fn num_slots(&self) -> usize {
        self.arena.nodes.len()
    }

    /// Node `id` as a mirror holds it (`[count, token, best child or NONE]`).
    #[cfg(test)]
    pub(crate) fn mirror_entry(&mut self, id: u32) -> [u32; 3] {
        self.arena.mirror_entry(id)
    }

    /// The nodes mirror `owner` must write to hold this tree, each `(slot, [count, token, best
    /// child or NONE])`: every slot when `whole` or when another mirror (or none) read it last,
    /// else the nodes changed since `owner` read it. Logs changes from here on for `owner`.
    pub(crate) fn mirror_changes(&mut self, owner: u64, whole: bool) -> Vec<(u32, [u32; 3])> {
        let arena = &mut self.arena;
        let whole = whole || arena.log.as_ref().is_none_or(|log| log.owner != owner);
        let ids: Vec<u32> = if whole {
            arena.log = Some(ChangeLog { owner, ..ChangeLog::default() });
            (0..arena.nodes.len() as u32).collect()
        } else {
            let log = arena.log.as_mut().expect("read by owner");
            for &id in &log.changed {
                log.marked[id as usize] = false;
            }
            std::mem::take(&mut log.changed)
        };
        ids.into_iter().map(|id| (id, arena.mirror_entry(id))).collect()
    }

    /// Distinct non-empty substrings (of at most `max_depth` tokens) in the held sequences: the
    /// nodes besides the root.
    pub fn num_nodes(&self) -> usize {
        self.arena.live() - 1
    }

    /// Bytes held: the node arena, the wide nodes' edge map (key, value and a control byte per
    /// bucket) and the open sequence's suffix lists.
    pub fn memory_bytes(&self) -> usize {
        let edge_bucket = std::mem::size_of::<(u64, u32)>() + 1;
        self.arena.memory_bytes()
            + self.edges.capacity() * edge_bucket
            + (self.open_suffixes.capacity() + self.next_suffixes.capacity()) * std::mem::size_of::<u32>()
    }

    /// Occurrences of `pattern` in the held sequences (0 if longer than `max_depth`); the empty
    /// pattern counts every token.
    pub fn count(&self, pattern: &[u32]) -> u64 {
        if pattern.is_empty() {
            return self.num_tokens;
        }
        match self.find(pattern) {
            Some(node) => u64::from(self.arena.nodes[node as usize].count),
            None => 0,
        }
    }

    /// Appends one token to the open sequence: O(max_depth) edge lookups, no rescan.
    pub fn append(&mut self, token: u32) {
        let mut suffixes = std::mem::take(&mut self.open_suffixes);
        self.index_token(&mut suffixes, token);
        self.open_suffixes = suffixes;
    }

    /// Appends tokens to the open sequence one at a time.
    pub fn extend(&mut self, tokens: &[u32]) {
        for &token in tokens {
            self.append(token);
        }
    }

    /// Adds a whole sequence, independent of the open one (its substrings do not join across).
    pub fn insert(&mut self, sequence: &[u32]) {
        let mut suffixes = Vec::with_capacity(self.max_depth + 1);
        suffixes.push(ROOT);
        for &token in sequence {
            self.index_token(&mut suffixes, token);
        }
    }

    /// Removes a sequence added by [`insert`](Self::insert): every substring occurrence is
    /// decremented and nodes whose count reaches 0 are freed, leaving the tree exactly as if the
    /// sequence had never been inserted.
    ///
    /// Panics if `sequence` is not currently held (the counts would go negative).
    pub fn remove(&mut self, sequence: &[u32]) {
        self.num_tokens -= sequence.len() as u64;
        for start in 0..sequence.len() {
            let end = sequence.len().min(start + self.max_depth);
            let mut parent = ROOT;
            for &token in &sequence[start..end] {
                let child = self.child(parent, token).expect("SuffixTree::remove: sequence is not in the tree");
                if self.arena.decrement(parent, child) {
                    // Count 0 here means count 0 on the rest of this path too (a child never
                    // outnumbers its parent), so the loop frees the whole dead chain.
                    if self.arena.nodes[parent as usize].wide {
                        self.edges.remove(&edge_key(parent, token));
                    }
                    self.arena.release_child(parent, child);
                }
                parent = child;
            }
        }
    }

    /// Extends every suffix in `suffixes` (the nodes of a sequence's last 0..max_depth-1 tokens)
    /// by `token`, counting one more occurrence of each extended string, and leaves the new suffix
    /// list in `suffixes`.
    fn index_token(&mut self, suffixes: &mut Vec<u32>, token: u32) {
        self.num_tokens += 1;
        let mut next = std::mem::take(&mut self.next_suffixes);
        next.clear();
        next.push(ROOT);
        if self.max_depth > 0 {
            for &parent in suffixes.iter() {
                let child = self.child_or_insert(parent, token);
                self.arena.increment(parent, child);
                // A string of max_depth tokens is indexed but never extended.
                if next.len() < self.max_depth {
                    next.push(child);
                }
            }
        }
        std::mem::swap(suffixes, &mut next);
        self.next_suffixes = next;
    }

    fn child(&self, parent: u32, token: u32) -> Option<u32> {
        let nodes = &self.arena.nodes;
        if nodes[parent as usize].wide {
            return self.edges.get(&edge_key(parent, token)).copied();
        }
        let mut child = nodes[parent as usize].first_child;
        while child != NONE && nodes[child as usize].token != token {
            child = nodes[child as usize].next_sibling;
        }
        (child != NONE).then_some(child)
    }

    /// The child of `parent` for `token`, created (count 0) if missing.
    fn child_or_insert(&mut self, parent: u32, token: u32) -> u32 {
        if self.arena.nodes[parent as usize].wide {
            let arena = &mut self.arena;
            return *self.edges.entry(edge_key(parent, token)).or_insert_with(|| arena.alloc_child(parent, token));
        }
        let mut fanout = 0;
        let mut child = self.arena.nodes[parent as usize].first_child;
        while child != NONE {
            let node = &self.arena.nodes[child as usize];
            if node.token == token {
                return child;
            }
            fanout += 1;
            child = node.next_sibling;
        }
        let child = self.arena.alloc_child(parent, token);
        if fanout + 1 > WIDE_FANOUT {
            // Stays wide until freed, so the map never flip-flops around the threshold.
            self.arena.nodes[parent as usize].wide = true;
            let mut sibling = child;
            while sibling != NONE {
                let node = &self.arena.nodes[sibling as usize];
                self.edges.insert(edge_key(parent, node.token), sibling);
                sibling = node.next_sibling;
            }
        }
        child
    }

    fn find(&self, pattern: &[u32]) -> Option<u32> {
        pattern.iter().try_fold(ROOT, |node, &token| self.child(node, token))
    }

    /// Like `index_token` for a read-only query: `matches` (nodes of the context's last
    /// 0..=L tokens, L < max_depth) becomes the list for the context plus `token`. It stops at the
    /// first string the tree lacks, since every longer suffix contains it.
    fn advance_matches(&self, matches: &mut Vec<u32>, next: &mut Vec<u32>, token: u32) {
        next.clear();
        next.push(ROOT);
        for &node in matches.iter() {
            if next.len() >= self.max_depth {
                break;
            }
            match self.child(node, token) {
                Some(child) => next.push(child),
                None => break,
            }
        }
        std::mem::swap(matches, next);
    }
}

/// The Engine-wide tree over previous responses, FIFO-bounded by max_cached_requests (0 = disabled).
#[derive(Debug)]
pub struct SuffixCache {
    tree: SuffixTree,
    /// The cached responses, oldest first; kept so eviction can remove exactly what was inserted.
    responses: VecDeque<Vec<u32>>,
    max_cached_requests: usize,
    /// Bumped on every change to the tree, so proposers know their cached match nodes are stale.
    generation: u64,
}

impl SuffixCache {
    pub fn new(max_tree_depth: usize, max_cached_requests: usize) -> Self {
        Self { tree: SuffixTree::new(max_tree_depth), responses: VecDeque::new(), max_cached_requests, generation: 0 }
    }

    /// Caches a finished response, first evicting the oldest ones so at most
    /// `max_cached_requests` remain. Does nothing when the cache is disabled.
    pub fn insert_response(&mut self, tokens: &[u32]) {
        if self.max_cached_requests == 0 {
            return;
        }
        while self.responses.len() >= self.max_cached_requests {
            if let Some(oldest) = self.responses.pop_front() {
                self.tree.remove(&oldest);
            }
        }
        self.tree.insert(tokens);
        self.responses.push_back(tokens.to_vec());
        self.generation += 1;
    }

    /// Its tree and whether it holds any response (a proposer reads it only then), for the
    /// device lookup.
    pub(crate) fn tree_if_used(&mut self) -> Option<&mut SuffixTree> {
        (!self.responses.is_empty()).then_some(&mut self.tree)
    }

    pub fn num_cached_requests(&self) -> usize {
        self.responses.len()
    }

    pub fn max_tree_depth(&self) -> usize {
        self.tree.max_depth()
    }

    pub fn max_cached_requests(&self) -> usize {
        self.max_cached_requests
    }

    /// The cached responses, oldest first. Inserting them in this order into an empty cache of the
    /// same limits rebuilds this cache: the same responses, and (by the tree's invariant) the same
    /// nodes with the same counts, hence the same drafts; only the arena's layout may differ.
    pub fn responses(&self) -> impl ExactSizeIterator<Item = &[u32]> {
        self.responses.iter().map(Vec::as_slice)
    }

    /// Takes `other`'s contents in place (a loaded cache), with a generation newer than both, so
    /// proposers holding match nodes of the old tree rebuild them before reading the new one.
    pub fn replace_with(&mut self, other: SuffixCache) {
        let generation = self.generation.max(other.generation) + 1;
        *self = other;
        self.generation = generation;
    }

    pub fn num_nodes(&self) -> usize {
        self.tree.num_nodes()
    }

    /// Bytes held by the tree and the cached responses.
    pub fn memory_bytes(&self) -> usize {
        self.tree.memory_bytes()
            + self.responses.iter().map(|r| r.capacity() * std::mem::size_of::<u32>()).sum::<usize>()
    }
}

/// This request's match nodes in the global tree, carried across steps so a step only extends
/// them by its new tokens; valid while the cache's generation is unchanged.
#[derive(Debug, Default)]
struct GlobalMatches {
    generation: Option<u64>,
    /// Context length the nodes describe.
    context_len: usize,
    /// `nodes[len]` = node of the context's last `len` tokens, len in 0..=L (L < tree depth).
    nodes: Vec<u32>,
    spare: Vec<u32>,
}

/// One request's proposer: a per-request tree over prompt + generated tokens, plus the shared
/// global cache.
///
/// Each [`propose`](Proposer::propose) follows arctic-inference (`suffix_tree.cc`
/// `SuffixTree::speculate` / `_speculate_path`, `cache.py` `SuffixDecodingCache.speculate`) as
/// vLLM calls it (`suffix_decoding.py`: pattern = the last `max_tree_depth` context tokens,
/// `max_spec_offset` 0):
/// 1. pattern = the last min(len, max_tree_depth) context tokens; match lengths m run over
///    `1..pattern.len()` (so m <= max_tree_depth - 1), stopping at the first suffix a tree lacks.
/// 2. For each m, walk the greedy path from the match node (see `NodeArena::greedy_path`) for at
///    most min(max_tokens, floor(m * max_spec_factor)) tokens; the running probability is the
///    product of count(child) / count(node), and the walk stops before it drops below
///    `min_token_prob`. Score = sum of the running probabilities.
/// 3. Per tree keep the best-scoring draft over all m (ties: longer match); then the per-request
///    draft wins unless the global one scores strictly higher.
///
/// A tree ([`propose_tree`](Proposer::propose_tree), at most `max_depth` deep within `TreeLimits`)
/// starts as the chain of steps 1-3 with `max_tokens = min(max_depth, max_nodes)` and grows from
/// that chain's match node in the winning tree (see `NodeArena::grow_tree`): the chain is its
/// rank-0 path, then the other children of the match node and of the nodes drafted so far join
/// best first by cumulative probability (arctic's `_speculate_tree`), up to `max_nodes` tokens,
/// `max_children` per node, depth below min(max_depth, floor(m * max_spec_factor)), and cumulative
/// probability at least `min_token_prob`. Differences from arctic's tree speculation, on purpose:
/// - The chain is drafted whole before any branch, and the match length and the tree (per-request
///   or global) are the chain's choice. arctic takes nodes purely by probability and picks the
///   match by the tree's score, so a likelier branch can take the budget a deep node of the greedy
///   path needed, or a different match can win; its first path can then be shorter or other than
///   the chain. Here the tree holds the chain, so it never verifies less than the chain would, and
///   the tree chooser cutting it to its rank-0 path gets the chain exactly.
/// - Only one tree's counts grow the tree, not a merge of both: the two trees' counts are over
///   different sequences (this request vs. past responses), so their ratios are not one
///   distribution, and the chain already chose the better-scoring source.
/// - max_spec_factor bounds the depth, where arctic bounds the token count. The token budget here
///   is the engine's (`max_nodes`, sized to the verification cost), and a chain's length is its
///   depth, so the factor keeps the meaning it has for chains: how far a match of m tokens is
///   trusted to predict. Breadth is bounded by `min_token_prob` (the cumulative probabilities of
///   one depth sum to at most 1, so at most 1 / min_token_prob nodes per depth qualify).
///
/// Differences from arctic: ties between equal-count children go to the smaller token (see
/// `beats`); a response enters the global tree whole at [`finish`](Proposer::finish), where arctic
/// streams it in while it is generated (so there a request also matches its own partial response
/// in the global tree) and reserves its cache slot when the request starts.
pub struct SuffixProposer {
    params: SuffixParams,
    global: Arc<Mutex<SuffixCache>>,
    /// Per-request tree; its open sequence is `context[..indexed]`.
    local: SuffixTree,
    indexed: usize,
    /// The newest indexed tokens, to notice a context that took back tokens it showed.
    tail: IndexedTail,
    global_matches: GlobalMatches,
    local_draft: Vec<u32>,
    global_draft: Vec<u32>,
    scratch: Vec<u32>,
    finished: bool,
    /// The chain looked up ahead on the device for `propose(context, max_tokens)`: (context
    /// length, max_tokens, chain); `suffix_together.rs`.
    pub(super) ahead: Option<(usize, usize, Vec<u32>)>,
}

impl SuffixProposer {
    /// `params` come validated from the speculative config; `global` is the engine's shared cache.
    pub fn new(params: SuffixParams, global: Arc<Mutex<SuffixCache>>) -> Self {
        let local = SuffixTree::new(params.max_tree_depth);
        Self {
            params,
            global,
            local,
            indexed: 0,
            tail: IndexedTail::default(),
            global_matches: GlobalMatches::default(),
            local_draft: Vec::new(),
            global_draft: Vec::new(),
            scratch: Vec::new(),
            finished: false,
            ahead: None,
        }
    }

    /// The shared cache. A panic while it was locked may have left the tree half-updated, so a
    /// poisoned cache is emptied rather than trusted (drafts only cost speed). Everything that locks
    /// an engine-wide cache goes through here (saving it to disk too).
    pub(crate) fn lock_global(global: &Mutex<SuffixCache>) -> MutexGuard<'_, SuffixCache> {
        match global.lock() {
            Ok(guard) => guard,
            Err(poisoned) => {
                let mut guard = poisoned.into_inner();
                // A new generation too, so no proposer keeps match nodes from the old tree.
                let generation = guard.generation + 1;
                *guard = SuffixCache::new(guard.tree.max_depth(), guard.max_cached_requests);
                guard.generation = generation;
                global.clear_poison();
                guard
            }
        }
    }

    /// Brings `state`, this request's match nodes in `cache`'s tree, up to date with `context`
    /// and returns them (`[len]`: the node of the context's last len tokens).
    fn global_matches<'a>(state: &'a mut GlobalMatches, cache: &SuffixCache, context: &[u32]) -> &'a [u32] {
        let tree = &cache.tree;
        // Only the last depth - 1 tokens decide the match nodes, so a stale or far-behind state is
        // rebuilt from those; otherwise only the new tokens are fed.
        let window = tree.max_depth.saturating_sub(1);
        if state.generation != Some(cache.generation) || context.len() - state.context_len > window {
            state.generation = Some(cache.generation);
            state.nodes.clear();
            state.nodes.push(ROOT);
            state.context_len = context.len() - window.min(context.len());
        }
        for &token in &context[state.context_len..] {
            tree.advance_matches(&mut state.nodes, &mut state.spare, token);
        }
        state.context_len = context.len();
        &state.nodes
    }

    /// Brings this request's tree up to date with `context`.
    fn index(&mut self, context: &[u32]) {
        if context.len() < self.indexed || !self.tail.agrees(context) {
            // The context grows, or takes back tokens it showed unverified (a grammar's forced
            // run the target rejected): then this request's tree starts over.
            super::suffix_together::release(self.local.mirror_id());
            self.local = SuffixTree::new(self.params.max_tree_depth);
            self.indexed = 0;
            self.global_matches = GlobalMatches::default();
        }
        self.local.extend(&context[self.indexed..]);
        self.indexed = context.len();
        self.tail.record(context);
    }

    /// How far a chain of at most `max_tokens` tokens may go from each match.
    fn draft_limits(&self, max_tokens: usize) -> DraftLimits {
        DraftLimits {
            max_tokens,
            max_spec_factor: self.params.max_spec_factor,
            min_token_prob: self.params.min_token_prob,
        }
    }

    /// The draft for `context`: the chain of at most `max_tokens` tokens, or with `tree`, the tree
    /// at most `max_tokens` deep grown from the chain's match (see [`SuffixProposer`]).
    fn speculate(&mut self, context: &[u32], max_tokens: usize, tree: Option<TreeLimits>) -> Draft {
        self.index(context);
        let pattern_len = context.len().min(self.params.max_tree_depth);
        // A tree's chain is what `propose` would draft within the node budget, so the tree chooser
        // cutting the tree to its rank-0 path gets exactly the chain.
        let chain_tokens = tree.map_or(max_tokens, |limits| max_tokens.min(limits.max_nodes));
        if chain_tokens == 0 || pattern_len < 2 || tree.is_some_and(|limits| limits.max_children == 0) {
            return Draft::tokens(Vec::new());
        }
        let limits = self.draft_limits(chain_tokens);
        // Depth bound of the tree's other branches: the chain's rule without the node budget.
        let depth_limits = DraftLimits { max_tokens, ..limits };
        // The local tree holds exactly the context, so its open suffixes are the match nodes for
        // every m: no lookups.
        let local = &mut self.local;
        let local_matches = &local.open_suffixes[..pattern_len];
        let local_best = local.arena.best_draft(local_matches, limits, &mut self.local_draft, &mut self.scratch);
        if self.params.max_cached_requests > 0 {
            // Held until the tree is grown: another request finishing in between would change the
            // counts the chain was chosen by.
            let mut cache = Self::lock_global(&self.global);
            let cache = &mut *cache;
            if !cache.responses.is_empty() {
                let matches = Self::global_matches(&mut self.global_matches, cache, context);
                let matches = &matches[..pattern_len.min(matches.len())];
                let global_best =
                    cache.tree.arena.best_draft(matches, limits, &mut self.global_draft, &mut self.scratch);
                if global_best.score > local_best.score {
                    return shape_draft(&mut cache.tree.arena, global_best, &self.global_draft, tree, depth_limits);
                }
            }
        }
        shape_draft(&mut self.local.arena, local_best, &self.local_draft, tree, depth_limits)
    }
}

/// What the device lookup of one request's chain reads (`suffix_together.rs`).
pub(crate) struct ChainLookup {
    /// The chain's most tokens per match length (`[pattern_len]`; index 0, the root, unused).
    pub limits: Vec<u32>,
    /// The request tree's match nodes (`[pattern_len]`, index 0 the root).
    pub local: Vec<u32>,
    /// The global tree's (at most `pattern_len`), None where the proposer does not read it.
    pub global: Option<Vec<u32>>,
    pub max_tokens: usize,
    pub min_token_prob: f32,
}

impl SuffixProposer {
    /// Keeps `chain`, looked up on the device by this proposer's rule (`suffix_together.rs`),
    /// for the next `propose(context, max_tokens)`.
    pub(crate) fn begin_chain(&mut self, context: &[u32], max_tokens: usize, chain: Vec<u32>) {
        self.ahead = Some((context.len(), max_tokens, chain));
    }

    /// For the device lookup of `propose(context, max_tokens)`: brings this request's tree up to
    /// date with `context` and returns what the lookup reads, the global tree's match nodes
    /// through `global` (this proposer's cache, locked by the caller: None where it holds no
    /// response); None where the rule drafts nothing.
    pub(crate) fn chain_lookup(
        &mut self,
        context: &[u32],
        max_tokens: usize,
        global: Option<&SuffixCache>,
    ) -> Option<ChainLookup> {
        self.index(context);
        let pattern_len = context.len().min(self.params.max_tree_depth);
        if max_tokens == 0 || pattern_len < 2 {
            return None;
        }
        let limits = self.draft_limits(max_tokens);
        let global = global.filter(|cache| !cache.responses.is_empty()).map(|cache| {
            let matches = Self::global_matches(&mut self.global_matches, cache, context);
            matches[..pattern_len.min(matches.len())].to_vec()
        });
        Some(ChainLookup {
            limits: (0..pattern_len).map(|m| limits.for_match(m) as u32).collect(),
            local: self.local.open_suffixes[..pattern_len].to_vec(),
            global,
            max_tokens,
            min_token_prob: self.params.min_token_prob,
        })
    }

    /// This request's tree (the device lookup mirrors it).
    pub(crate) fn local_tree(&mut self) -> &mut SuffixTree {
        &mut self.local
    }

    /// The engine's shared cache, None where this proposer reads none.
    pub(crate) fn global_cache(&self) -> Option<&Arc<Mutex<SuffixCache>>> {
        (self.params.max_cached_requests > 0).then_some(&self.global)
    }
}

/// The winning tree's draft: its chain as is, or with `tree`, the tree grown from the chain's
/// match, at most `depth_limits.for_match(match length)` deep.
fn shape_draft(
    arena: &mut NodeArena,
    best: BestMatch,
    chain: &[u32],
    tree: Option<TreeLimits>,
    depth_limits: DraftLimits,
) -> Draft {
    let Some(tree_limits) = tree else { return Draft::tokens(chain.to_vec()) };
    if chain.is_empty() {
        // No match continues with probability min_token_prob or more: neither can a branch.
        return Draft::tokens(Vec::new());
    }
    let depth_limit = depth_limits.for_match(best.match_len);
    let (token_ids, parents) =
        arena.grow_tree(best.node, chain.len(), depth_limit, depth_limits.min_token_prob, tree_limits);
    debug_assert_eq!(token_ids[..chain.len()], *chain, "the tree's rank-0 path is the chain");
    Draft::tree(token_ids, parents)
}

impl Drop for SuffixProposer {
    fn drop(&mut self) {
        super::suffix_together::release(self.local.mirror_id());
    }
}

impl Proposer for SuffixProposer {
    fn drafts_after_unverified_tokens(&self) -> bool {
        true
    }

    fn suffix_chain(&mut self) -> Option<&mut SuffixProposer> {
        Some(self)
    }

    fn propose(&mut self, context: &[u32], max_tokens: usize) -> Result<Draft> {
        if let Some((len, max, chain)) = self.ahead.take() {
            if (len, max) == (context.len(), max_tokens) {
                // The lookup indexed this context.
                return Ok(Draft::tokens(chain));
            }
        }
        Ok(self.speculate(context, max_tokens, None))
    }

    /// SuffixDecoding's tree speculation; see [`SuffixProposer`].
    fn propose_tree(&mut self, context: &[u32], max_depth: usize, limits: TreeLimits) -> Result<Draft> {
        self.ahead = None;
        Ok(self.speculate(context, max_depth, Some(limits)))
    }

    fn finish(&mut self, generated: &[u32]) {
        self.ahead = None;
        if self.finished {
            return;
        }
        self.finished = true;
        super::suffix_together::release(self.local.mirror_id());
        if self.params.max_cached_requests > 0 {
            Self::lock_global(&self.global).insert_response(generated);
        }
        // The request is over: free its tree now rather than when the proposer drops.
        self.local = SuffixTree::new(self.params.max_tree_depth);
        self.indexed = 0;
        self.global_matches = GlobalMatches::default();
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::super::tree::{first_path, path_tokens};
    use super::*;

    /// splitmix64: deterministic test data without a dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn tokens(&mut self, len: usize, alphabet: usize) -> Vec<u32> {
            (0..len).map(|_| self.below(alphabet) as u32).collect()
        }
        /// `min_len + below(spread)` tokens.
        fn sequence(&mut self, min_len: usize, spread: usize, alphabet: usize) -> Vec<u32> {
            let len = min_len + self.below(spread);
            self.tokens(len, alphabet)
        }
    }

    /// Every (string, count) in the tree, read by walking it; also checks the links and cached
    /// best children are consistent.
    fn dump(tree: &SuffixTree) -> BTreeMap<Vec<u32>, u32> {
        let mut out = BTreeMap::new();
        let mut stack = vec![(ROOT, Vec::new())];
        let mut mapped_edges = 0;
        while let Some((id, path)) = stack.pop() {
            let node = tree.arena.nodes[id as usize];
            let mut child = node.first_child;
            let mut prev = NONE;
            let mut best: Option<u32> = None;
            let mut children = 0;
            while child != NONE {
                let c = tree.arena.nodes[child as usize];
                assert_eq!(c.prev_sibling, prev);
                assert!(c.count > 0, "zero-count node left in the tree");
                assert_eq!(tree.child(id, c.token), Some(child));
                assert_eq!(tree.edges.get(&edge_key(id, c.token)).copied(), node.wide.then_some(child));
                children += 1;
                if best.is_none_or(|b| beats(&c, &tree.arena.nodes[b as usize])) {
                    best = Some(child);
                }
                let mut child_path = path.clone();
                child_path.push(c.token);
                assert!(child_path.len() <= tree.max_depth);
                out.insert(child_path.clone(), c.count);
                stack.push((child, child_path));
                prev = child;
                child = c.next_sibling;
            }
            if node.best_child != NONE {
                assert_eq!(Some(node.best_child), best, "stale best child");
            }
            if node.wide {
                mapped_edges += children;
            }
        }
        assert_eq!(out.len(), tree.num_nodes());
        assert_eq!(tree.edges.len(), mapped_edges);
        out
    }

    /// Every substring of at most `depth` tokens with its occurrence count, by scanning.
    fn brute_force_counts(sequences: &[&[u32]], depth: usize) -> BTreeMap<Vec<u32>, u32> {
        let mut out = BTreeMap::new();
        for seq in sequences {
            for start in 0..seq.len() {
                for end in start + 1..=seq.len().min(start + depth) {
                    *out.entry(seq[start..end].to_vec()).or_insert(0) += 1;
                }
            }
        }
        out
    }

    fn occurrences(sequences: &[&[u32]], pattern: &[u32]) -> u32 {
        sequences.iter().map(|s| s.windows(pattern.len()).filter(|w| *w == pattern).count() as u32).sum()
    }

    /// The draft rules applied to raw sequences: counts by scanning, no tree.
    fn reference_speculate(
        sequences: &[&[u32]],
        depth: usize,
        pattern: &[u32],
        max_tokens: usize,
        params: &SuffixParams,
    ) -> (Vec<u32>, f32) {
        let mut best = (Vec::new(), 0.0f32);
        for match_len in 1..pattern.len() {
            let matched = &pattern[pattern.len() - match_len..];
            if match_len > depth || occurrences(sequences, matched) == 0 {
                break;
            }
            let cap = (f64::from(match_len as f32 * params.max_spec_factor) + 1e-6) as usize;
            let limit = cap.min(max_tokens);
            let mut current = matched.to_vec();
            let (mut draft, mut prob, mut score) = (Vec::new(), 1.0f32, 0.0f32);
            while draft.len() < limit && current.len() < depth {
                let mut next_counts: BTreeMap<u32, u32> = BTreeMap::new();
                for seq in sequences {
                    for i in 0..seq.len().saturating_sub(current.len()) {
                        if seq[i..i + current.len()] == current[..] {
                            *next_counts.entry(seq[i + current.len()]).or_insert(0) += 1;
                        }
                    }
                }
                // Highest count, then smallest token (BTreeMap iterates tokens ascending).
                let Some((token, count)) =
                    next_counts.into_iter().fold(None, |acc: Option<(u32, u32)>, (t, c)| match acc {
                        Some((_, best_count)) if best_count >= c => acc,
                        _ => Some((t, c)),
                    })
                else {
                    break;
                };
                prob *= count as f32 / occurrences(sequences, &current) as f32;
                if prob < params.min_token_prob {
                    break;
                }
                draft.push(token);
                score += prob;
                current.push(token);
            }
            if score >= best.1 {
                best = (draft, score);
            }
        }
        best
    }

    fn reference_propose(
        context: &[u32],
        responses: &[Vec<u32>],
        params: &SuffixParams,
        max_tokens: usize,
    ) -> Vec<u32> {
        let pattern = &context[context.len() - context.len().min(params.max_tree_depth)..];
        if max_tokens == 0 || pattern.len() < 2 {
            return Vec::new();
        }
        let local = reference_speculate(&[context], params.max_tree_depth, pattern, max_tokens, params);
        let cached: Vec<&[u32]> = responses.iter().map(|r| r.as_slice()).collect();
        let global = reference_speculate(&cached, params.max_tree_depth, pattern, max_tokens, params);
        if local.1 >= global.1 {
            local.0
        } else {
            global.0
        }
    }

    fn cache(params: &SuffixParams) -> Arc<Mutex<SuffixCache>> {
        Arc::new(Mutex::new(SuffixCache::new(params.max_tree_depth, params.max_cached_requests)))
    }

    fn params(
        max_tree_depth: usize,
        max_cached_requests: usize,
        max_spec_factor: f32,
        min_token_prob: f32,
    ) -> SuffixParams {
        SuffixParams { max_tree_depth, max_cached_requests, max_spec_factor, min_token_prob }
    }

    #[test]
    fn tree_counts_equal_substring_counts() {
        let mut rng = Rng(1);
        for depth in [1, 2, 3, 5, 8] {
            let mut tree = SuffixTree::new(depth);
            let a = rng.tokens(60, 3);
            // More than WIDE_FANOUT distinct tokens, so some nodes keep their edges in the map.
            let b = rng.tokens(80, 20);
            let open = rng.tokens(50, 3);
            tree.insert(&a);
            tree.extend(&open);
            tree.insert(&b);
            assert!(tree.arena.nodes[ROOT as usize].wide);
            let expected = brute_force_counts(&[&a, &b, &open], depth);
            assert_eq!(dump(&tree), expected);
            assert_eq!(tree.num_nodes(), expected.len());
            assert_eq!(tree.count(&[]), 190);
            for (pattern, &count) in &expected {
                assert_eq!(tree.count(pattern), u64::from(count));
            }
            assert_eq!(tree.count(&[99]), 0);
        }
    }

    #[test]
    fn incremental_append_equals_whole_insert() {
        let mut rng = Rng(2);
        for (len, alphabet, depth) in [(1, 2, 4), (200, 2, 6), (300, 5, 24), (100, 50, 3)] {
            let seq = rng.tokens(len, alphabet);
            let mut appended = SuffixTree::new(depth);
            for &t in &seq {
                appended.append(t);
            }
            let mut inserted = SuffixTree::new(depth);
            inserted.insert(&seq);
            assert_eq!(dump(&appended), dump(&inserted));
            assert_eq!(dump(&appended), brute_force_counts(&[&seq], depth));
        }
    }

    #[test]
    fn remove_leaves_the_tree_of_the_rest() {
        let mut rng = Rng(3);
        let seqs: Vec<Vec<u32>> = (0..6).map(|i| rng.tokens(20 + 7 * i, [3, 12][i % 2])).collect();
        let mut tree = SuffixTree::new(5);
        for s in &seqs {
            tree.insert(s);
        }
        for removed in [1, 4, 0] {
            tree.remove(&seqs[removed]);
        }
        let rest: Vec<&[u32]> = [2, 3, 5].iter().map(|&i| seqs[i].as_slice()).collect();
        assert_eq!(dump(&tree), brute_force_counts(&rest, 5));
        for s in &rest {
            tree.remove(s);
        }
        assert_eq!(tree.num_nodes(), 0);
        assert_eq!(tree.count(&[]), 0);
    }

    #[test]
    fn cache_memory_is_bounded_by_the_last_responses() {
        let mut rng = Rng(4);
        let limit = 4;
        let responses: Vec<Vec<u32>> = (0..15).map(|i| rng.sequence(10, 40, [4, 12][i % 2])).collect();
        let mut cache = SuffixCache::new(6, limit);
        for (i, r) in responses.iter().enumerate() {
            cache.insert_response(r);
            assert_eq!(cache.num_cached_requests(), (i + 1).min(limit));
        }
        let mut fresh = SuffixCache::new(6, limit);
        for r in &responses[responses.len() - limit..] {
            fresh.insert_response(r);
        }
        assert_eq!(cache.num_nodes(), fresh.num_nodes());
        assert_eq!(dump(&cache.tree), dump(&fresh.tree));
        // Slots freed by eviction are reused, so the arena stays near its peak.
        assert!(cache.tree.arena.nodes.len() <= 2 * fresh.tree.arena.nodes.len());
    }

    /// The claim suffix_store.rs rests on: a cache rebuilt from its responses (oldest first) has
    /// the original's nodes and counts, even after evictions and wide nodes left the original's
    /// arena, free list and edge map shaped by its history.
    #[test]
    fn cache_rebuilt_from_its_responses_equals_the_original() {
        let mut rng = Rng(5);
        let mut original = SuffixCache::new(6, 5);
        for i in 0..23 {
            original.insert_response(&rng.sequence(5, 60, [3, 20, 40][i % 3]));
        }
        let mut rebuilt = SuffixCache::new(original.max_tree_depth(), original.max_cached_requests());
        for r in original.responses() {
            rebuilt.insert_response(r);
        }
        assert_eq!(rebuilt.responses().collect::<Vec<_>>(), original.responses().collect::<Vec<_>>());
        assert_eq!(dump(&rebuilt.tree), dump(&original.tree));
        assert_eq!(rebuilt.tree.count(&[]), original.tree.count(&[]));
    }

    /// A proposer holding match nodes of the old tree must not read them in the new one: the
    /// generation after `replace_with` is new even when both caches had the same generation.
    #[test]
    fn replaced_cache_invalidates_match_nodes() {
        let p = SuffixParams::default();
        let global = cache_with(&p, &[vec![5, 6, 7, 8, 9, 10]]);
        let mut proposer = SuffixProposer::new(p.clone(), global.clone());
        assert_eq!(proposer.propose(&[5, 6], 4).unwrap().token_ids, vec![7]);
        let mut loaded = SuffixCache::new(p.max_tree_depth, p.max_cached_requests);
        loaded.insert_response(&[1, 2, 3, 4, 5, 6, 40, 41, 42]);
        let before = (global.lock().unwrap().generation, loaded.generation);
        assert_eq!(before.0, before.1);
        global.lock().unwrap().replace_with(loaded);
        assert!(global.lock().unwrap().generation > before.0);
        let context = [5, 6, 40];
        let expected = reference_propose(&context, &[vec![1, 2, 3, 4, 5, 6, 40, 41, 42]], &p, 4);
        assert_eq!(expected, vec![41, 42]);
        assert_eq!(proposer.propose(&context, 4).unwrap().token_ids, expected);
    }

    #[test]
    fn zero_cached_requests_disables_the_cache() {
        let mut cache = SuffixCache::new(24, 0);
        cache.insert_response(&[1, 2, 3, 1, 2, 3]);
        assert_eq!(cache.num_cached_requests(), 0);
        assert_eq!(cache.num_nodes(), 0);

        let p = params(24, 0, 1.0, 0.1);
        let global = cache_with(&p, &[]);
        let mut proposer = SuffixProposer::new(p, global.clone());
        proposer.propose(&[5, 6, 7], 4).unwrap();
        proposer.finish(&[6, 7]);
        assert_eq!(global.lock().unwrap().num_nodes(), 0);
    }

    fn cache_with(p: &SuffixParams, responses: &[Vec<u32>]) -> Arc<Mutex<SuffixCache>> {
        let global = cache(p);
        for r in responses {
            global.lock().unwrap().insert_response(r);
        }
        global
    }

    /// Grows a random context a few tokens at a time and checks every draft against the
    /// reference; `finish_every` > 0 also finishes requests into the cache mid-run (evictions and
    /// stale match nodes included).
    fn check_against_reference(p: SuffixParams, seed: u64, alphabet: usize, responses: usize, finish_every: usize) {
        let mut rng = Rng(seed);
        let mut cached: Vec<Vec<u32>> = Vec::new();
        let global = cache(&p);
        for _ in 0..responses {
            let r = rng.sequence(5, 60, alphabet);
            global.lock().unwrap().insert_response(&r);
            cached.push(r);
        }
        let limit = p.max_cached_requests;
        let keep = |cached: &Vec<Vec<u32>>| cached[cached.len() - cached.len().min(limit)..].to_vec();
        let mut proposer = SuffixProposer::new(p.clone(), global.clone());
        let mut context = rng.sequence(1, 30, alphabet);
        for step in 0..150 {
            let max_tokens = [0, 1, 3, 8, 30][rng.below(5)];
            let draft = proposer.propose(&context, max_tokens).unwrap();
            assert!(draft.probs.is_none());
            let expected = reference_propose(&context, &keep(&cached), &p, max_tokens);
            assert_eq!(draft.token_ids, expected, "step {step}, params {p:?}, max_tokens {max_tokens}");
            // Sometimes accept part of the draft, as verification would.
            let accepted = if draft.token_ids.is_empty() { 0 } else { rng.below(draft.token_ids.len() + 1) };
            context.extend_from_slice(&draft.token_ids[..accepted]);
            let fresh = 1 + rng.below(3);
            context.extend(rng.tokens(fresh, alphabet));
            if finish_every > 0 && step % finish_every == finish_every - 1 {
                let r = rng.sequence(5, 40, alphabet);
                let mut other = SuffixProposer::new(p.clone(), global.clone());
                other.finish(&r);
                if limit > 0 {
                    cached.push(r);
                }
            }
        }
    }

    #[test]
    fn proposals_equal_reference_local_only() {
        for (i, p) in [
            params(24, 0, 1.0, 0.1),
            params(4, 0, 1.0, 0.1),
            params(8, 0, 2.0, 0.0),
            params(6, 0, 0.5, 0.3),
            params(2, 0, 1.0, 0.1),
            params(24, 0, 1.0, 1.0),
        ]
        .into_iter()
        .enumerate()
        {
            check_against_reference(p.clone(), 10 + i as u64, 3, 0, 0);
            check_against_reference(p.clone(), 20 + i as u64, 6, 0, 0);
            check_against_reference(p, 60 + i as u64, 12, 0, 0);
        }
    }

    #[test]
    fn proposals_equal_reference_with_global_tree() {
        for (i, p) in [
            params(24, 10_000, 1.0, 0.1),
            params(5, 3, 1.0, 0.1),
            params(8, 2, 2.0, 0.05),
            params(6, 5, 1.5, 0.0),
            params(3, 1, 1.0, 0.2),
        ]
        .into_iter()
        .enumerate()
        {
            check_against_reference(p.clone(), 30 + i as u64, 3, 6, 0);
            check_against_reference(p.clone(), 40 + i as u64, 4, 6, 7);
            check_against_reference(p.clone(), 50 + i as u64, 2, 2, 3);
            check_against_reference(p, 70 + i as u64, 12, 8, 5);
        }
    }

    #[test]
    fn repeated_prompt_phrase_is_proposed() {
        let phrase = [101, 102, 103, 104, 105, 106, 107, 108];
        let mut prompt = vec![1, 2, 3];
        prompt.extend_from_slice(&phrase);
        prompt.extend_from_slice(&[9, 9, 4]);
        prompt.extend_from_slice(&phrase[..3]);
        let p = SuffixParams::default();
        let mut proposer = SuffixProposer::new(p.clone(), cache(&p));
        // Match of 3 tokens caps the draft at floor(1.0 * 3) = 3.
        assert_eq!(proposer.propose(&prompt, 8).unwrap().token_ids, vec![104, 105, 106]);
        prompt.extend_from_slice(&[104, 105]);
        assert_eq!(proposer.propose(&prompt, 8).unwrap().token_ids, vec![106, 107, 108, 9, 9]);
        assert_eq!(proposer.propose(&prompt, 2).unwrap().token_ids, vec![106, 107]);
    }

    #[test]
    fn previous_response_is_proposed_through_the_global_cache() {
        let p = SuffixParams::default();
        let global = cache(&p);
        let response = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59];
        let mut first = SuffixProposer::new(p.clone(), global.clone());
        first.propose(&[7, 8], 4).unwrap();
        first.finish(&response);
        first.finish(&response);
        assert_eq!(global.lock().unwrap().num_cached_requests(), 1, "finish caches once");

        let mut second = SuffixProposer::new(p, global);
        let mut context = vec![7, 7, 8, 50, 51, 52, 53];
        assert_eq!(second.propose(&context, 16).unwrap().token_ids, vec![54, 55, 56, 57]);
        context.extend_from_slice(&[54, 55, 56, 57]);
        assert_eq!(second.propose(&context, 16).unwrap().token_ids, vec![58, 59]);
    }

    #[test]
    fn greedy_step_takes_the_most_frequent_then_smallest_token() {
        let p = params(24, 0, 4.0, 0.0);
        let mut proposer = SuffixProposer::new(p.clone(), cache(&p));
        // After 1: 3 twice, 2 twice, 4 once; the tie goes to 2. ("9 1" never continues.)
        let context = [1, 3, 1, 2, 1, 4, 1, 3, 1, 2, 9, 1];
        assert_eq!(proposer.propose(&context, 1).unwrap().token_ids, vec![2]);
    }

    #[test]
    fn running_probability_stops_the_draft() {
        // After "1 2": "3" in 2 of 3 occurrences (the last one has no continuation), then
        // "1 2 3" -> 4 in 1 of 2 (tie with 5): running probability 2/3, then 1/3. ("8 1 2" never
        // continues, so no longer match competes.)
        let context = [1, 2, 3, 4, 0, 1, 2, 3, 5, 0, 8, 1, 2];
        for (min_token_prob, expected) in [(0.5, vec![3]), (0.3, vec![3, 4]), (0.7, vec![])] {
            let p = params(24, 0, 4.0, min_token_prob);
            let mut proposer = SuffixProposer::new(p.clone(), cache(&p));
            assert_eq!(proposer.propose(&context, 2).unwrap().token_ids, expected, "min {min_token_prob}");
        }
    }

    /// The tokens on a tree's rank-0 path.
    fn first_path_tokens(draft: &Draft) -> Vec<u32> {
        first_path(&draft.parents()).iter().map(|&node| draft.token_ids[node]).collect()
    }

    /// The tokens from the root to each node.
    fn paths(draft: &Draft) -> Vec<Vec<u32>> {
        let parents = draft.parents();
        (0..parents.len()).map(|node| path_tokens(&draft.token_ids, &parents, node)).collect()
    }

    fn tree(proposer: &mut SuffixProposer, context: &[u32], max_depth: usize, limits: TreeLimits) -> Draft {
        let draft = proposer.propose_tree(context, max_depth, limits).unwrap();
        draft.validate(max_depth, Some(limits), 1 << 20, "suffix").unwrap();
        assert!(draft.probs.is_none());
        draft
    }

    /// Whether `path` may grow from some match of the context in `sequences`: the match's last m
    /// tokens followed by `path` are indexed (at most `depth` tokens), `path` is within the match's
    /// depth limit, and its cumulative probability, count(match + path) / count(match) (the ratios
    /// telescope), reaches min_token_prob.
    fn grows_from_a_match(sequences: &[&[u32]], context: &[u32], path: &[u32], p: &SuffixParams) -> bool {
        let pattern = &context[context.len() - context.len().min(p.max_tree_depth)..];
        (1..pattern.len()).any(|m| {
            let matched = &pattern[pattern.len() - m..];
            let whole = [matched, path].concat();
            let depth_limit = (f64::from(m as f32 * p.max_spec_factor) + 1e-6) as usize;
            let (count, matched_count) = (occurrences(sequences, &whole), occurrences(sequences, matched));
            whole.len() <= p.max_tree_depth
                && path.len() <= depth_limit
                && count > 0
                && count as f32 / matched_count as f32 >= p.min_token_prob * (1.0 - 1e-5)
        })
    }

    /// Random growing contexts with a global cache, random tree limits: every tree is valid, its
    /// rank-0 path is the reference chain for min(depth, max_nodes) tokens, and every path grows
    /// from a match in the request's tokens or in the cached responses. Returns how many drafts
    /// branched.
    fn check_trees_against_reference(p: SuffixParams, seed: u64, alphabet: usize, responses: usize) -> usize {
        let shapes = [(1, 1), (1, 4), (5, 1), (4, 2), (8, 3), (16, 4), (3, 8), (64, 64)];
        let mut rng = Rng(seed);
        let global = cache(&p);
        let mut cached: Vec<Vec<u32>> = Vec::new();
        for _ in 0..responses {
            let r = rng.sequence(5, 60, alphabet);
            global.lock().unwrap().insert_response(&r);
            cached.push(r);
        }
        let kept = &cached[cached.len() - cached.len().min(p.max_cached_requests)..];
        let mut proposer = SuffixProposer::new(p.clone(), global);
        let mut context = rng.sequence(1, 30, alphabet);
        let mut num_trees = 0;
        for step in 0..120 {
            let max_depth = [0, 1, 3, 8, 30][rng.below(5)];
            let (max_nodes, max_children) = shapes[rng.below(shapes.len())];
            let limits = TreeLimits { max_nodes, max_children };
            let draft = tree(&mut proposer, &context, max_depth, limits);
            let what = format!("step {step}, params {p:?}, depth {max_depth}, limits {limits:?}");
            let chain = reference_propose(&context, kept, &p, max_depth.min(max_nodes));
            assert_eq!(first_path_tokens(&draft), chain, "{what}");
            let responses: Vec<&[u32]> = kept.iter().map(Vec::as_slice).collect();
            for path in paths(&draft) {
                let local = grows_from_a_match(&[&context], &context, &path, &p);
                assert!(local || grows_from_a_match(&responses, &context, &path, &p), "path {path:?}; {what}");
            }
            num_trees += usize::from(draft.is_tree());
            let first = first_path_tokens(&draft);
            let accepted = if first.is_empty() { 0 } else { rng.below(first.len() + 1) };
            context.extend_from_slice(&first[..accepted]);
            let fresh = 1 + rng.below(3);
            context.extend(rng.tokens(fresh, alphabet));
        }
        num_trees
    }

    #[test]
    fn tree_is_valid_starts_with_the_chain_and_grows_from_matches() {
        let mut num_trees = 0;
        for (i, p) in [
            params(24, 0, 1.0, 0.1),
            params(8, 0, 2.0, 0.0),
            params(6, 0, 0.5, 0.3),
            params(24, 10_000, 1.0, 0.1),
            params(5, 3, 1.0, 0.05),
            params(8, 2, 4.0, 0.0),
        ]
        .into_iter()
        .enumerate()
        {
            num_trees += check_trees_against_reference(p.clone(), 80 + i as u64, 3, 6);
            num_trees += check_trees_against_reference(p, 90 + i as u64, 8, 8);
        }
        assert!(num_trees > 100, "only {num_trees} drafts branched");
    }

    /// After "1 2": 3 three times, 4 twice, 5 once (and once nothing, at the end); after "1 2 x",
    /// always 0. "9 1 2" never continues, so the match of 2 tokens wins.
    const BRANCHING: [u32; 27] = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 2, 4, 0, 1, 2, 5, 0, 9, 1, 2];

    #[test]
    fn branches_join_best_first_by_cumulative_probability() {
        let p = params(24, 0, 4.0, 0.0);
        let limits = |max_nodes, max_children| TreeLimits { max_nodes, max_children };
        let mut proposer = SuffixProposer::new(p.clone(), cache(&p));
        assert_eq!(proposer.propose(&BRANCHING, 2).unwrap().token_ids, [3, 0]);
        // The chain 3 (3/7), 0 (3/7); then 4 (2/7) and below it 0 (2/7) before 5 (1/7).
        let draft = tree(&mut proposer, &BRANCHING, 2, limits(4, 4));
        assert_eq!((draft.token_ids, draft.parents), (vec![3, 0, 4, 0], Some(vec![-1, 0, -1, 2])));
        let draft = tree(&mut proposer, &BRANCHING, 2, limits(5, 4));
        assert_eq!((draft.token_ids, draft.parents), (vec![3, 0, 4, 0, 5], Some(vec![-1, 0, -1, 2, -1])));
        // Two children per node: 5 never gets in.
        let draft = tree(&mut proposer, &BRANCHING, 2, limits(8, 2));
        assert_eq!(draft.token_ids, [3, 0, 4, 0]);
        // 5's cumulative probability 1/7 is under min_token_prob.
        let p = params(24, 0, 4.0, 0.2);
        let draft = tree(&mut SuffixProposer::new(p.clone(), cache(&p)), &BRANCHING, 2, limits(8, 4));
        assert_eq!(draft.token_ids, [3, 0, 4, 0]);
    }

    #[test]
    fn spec_factor_bounds_the_depth_of_every_branch() {
        // Factor 0.5: the match of 2 tokens trusts 1 token ahead, so only the first tokens.
        let p = params(24, 0, 0.5, 0.0);
        let draft = tree(
            &mut SuffixProposer::new(p.clone(), cache(&p)),
            &BRANCHING,
            8,
            TreeLimits { max_nodes: 8, max_children: 4 },
        );
        assert_eq!((draft.depth(), draft.token_ids), (1, vec![3, 4, 5]));
    }

    #[test]
    fn tree_limits_of_one_degrade_to_a_chain() {
        let p = params(24, 0, 4.0, 0.0);
        let mut proposer = SuffixProposer::new(p.clone(), cache(&p));
        let draft = tree(&mut proposer, &BRANCHING, 2, TreeLimits { max_nodes: 8, max_children: 1 });
        assert_eq!((draft.token_ids, draft.parents), (vec![3, 0], None));
        let draft = tree(&mut proposer, &BRANCHING, 2, TreeLimits { max_nodes: 1, max_children: 4 });
        assert_eq!((draft.token_ids, draft.parents), (vec![3], None));
        // Depth 1: the chain's token first, then the other first tokens beside it.
        let draft = tree(&mut proposer, &BRANCHING, 1, TreeLimits { max_nodes: 8, max_children: 4 });
        assert_eq!((draft.depth(), draft.token_ids), (1, vec![3, 4, 5]));
        assert!(tree(&mut proposer, &BRANCHING, 0, TreeLimits { max_nodes: 8, max_children: 4 }).token_ids.is_empty());
        assert!(tree(&mut proposer, &BRANCHING, 2, TreeLimits { max_nodes: 8, max_children: 0 }).token_ids.is_empty());
    }

    #[test]
    fn tree_grows_from_the_global_cache_when_it_scores_higher() {
        let p = SuffixParams::default();
        let global = cache_with(&p, &[vec![50, 51, 52, 53, 54, 55, 56, 57], vec![50, 51, 52, 53, 60, 61, 62, 63]]);
        let context = [7, 7, 8, 50, 51, 52, 53];
        // The request's own tokens never continue "53"; the responses go on two ways (the tie
        // goes to the smaller token), 4 tokens deep for the match of 4.
        assert_eq!(
            SuffixProposer::new(p.clone(), global.clone()).propose(&context, 16).unwrap().token_ids,
            [54, 55, 56, 57]
        );
        let draft =
            tree(&mut SuffixProposer::new(p, global), &context, 16, TreeLimits { max_nodes: 16, max_children: 4 });
        assert_eq!(draft.token_ids, [54, 55, 56, 57, 60, 61, 62, 63]);
        assert_eq!(draft.parents, Some(vec![-1, 0, 1, 2, -1, 4, 5, 6]));
    }

    #[test]
    fn shrinking_context_restarts_the_request_tree() {
        let p = SuffixParams::default();
        let mut proposer = SuffixProposer::new(p.clone(), cache(&p));
        proposer.propose(&[1, 2, 3, 1, 2, 3, 1, 2], 4).unwrap();
        let context = [7, 8, 9, 7, 8];
        assert_eq!(proposer.propose(&context, 4).unwrap().token_ids, reference_propose(&context, &[], &p, 4));
    }
}
