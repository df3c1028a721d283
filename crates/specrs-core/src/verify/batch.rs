//! The one verification contract: every sequence's drafts of a step, flattened and ragged, with
//! what each sequence's rule reads (per-row noise for the coupled form, the sequential stream's
//! uniforms and draft probabilities for rejection sampling), and the verdicts a verifier returns.
//!
//! Logit rows follow the forward's own order: sequence s's rows are its root row (the newest
//! context token) then one row per draft node in node order, so the step's logits `[R, V]` are the
//! verifier's input as they are. A chain is the tree with `parents[i] = i - 1`; plain decoding is a
//! sequence without nodes (one row).
//!
//! Invariant: a batch that passes `check` is one any verifier can walk without indexing out of
//! bounds: offsets are monotone and match every array's length, parents come before their children
//! within their sequence, q rows exist, and every rejection sequence has the uniforms its longest
//! walk reads (`SeqRule::uniforms_needed`).

use crate::config::SamplingParams;
use crate::error::{Error, Result};

/// `prob_rows` entry of a node without a q row: its draft is one-hot.
pub const NO_ROW: u32 = u32::MAX;

/// How a sequence's draft is decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Argmax per row, the lowest index on ties.
    Greedy,
    /// The target token of each row is drawn with that row's `RowNoise`; a child equal to it is
    /// accepted (verify.rs's header: rejection sampling with a one-hot q, in coupled form).
    Coupled,
    /// Rejection sampling with draft probabilities, reading the sequential stream's uniforms.
    Rejection,
}

/// One sequence's rule: its mode and the sampling filters its distributions use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SeqRule {
    pub mode: Mode,
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    /// Rejection only: the draft was declared a tree (`Draft.parents.is_some()`), so it runs the
    /// tree's arithmetic even when it is chain-shaped (plan §1.3: the chain's and the tree's f32
    /// arithmetics differ, and both are kept bitwise).
    pub declared_tree: bool,
}

impl SeqRule {
    /// The rule `params` gives a draft with (`has_probs`) or without draft probabilities.
    pub fn new(params: &SamplingParams, has_probs: bool, declared_tree: bool) -> Self {
        let mode = if params.is_greedy() {
            Mode::Greedy
        } else if has_probs {
            Mode::Rejection
        } else {
            Mode::Coupled
        };
        Self {
            mode,
            temperature: params.temperature,
            top_k: params.top_k as u32,
            top_p: params.top_p,
            min_p: params.min_p,
            declared_tree,
        }
    }

    /// How many sequential uniforms a rejection walk over `num_nodes` nodes may read: one per
    /// child tried and one per draw. A chain reads at most n + 1. A declared tree may read up to
    /// 2n + 1: as in today's walk, a recovered token equal to one of the node's children accepts
    /// that child and the walk goes on (only reachable through the rounding fallback that draws
    /// from p), so each node on the path may draw once besides its tested children.
    pub fn uniforms_needed(&self, num_nodes: usize) -> usize {
        match (self.mode, self.declared_tree) {
            (Mode::Rejection, false) => num_nodes + 1,
            (Mode::Rejection, true) => 2 * num_nodes + 1,
            _ => 0,
        }
    }

    /// The sampling parameters `sampler::probabilities` reads.
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k as usize,
            top_p: self.top_p,
            min_p: self.min_p,
            ..Default::default()
        }
    }
}

/// The noise a logit row's token is drawn with (the position the row's token is emitted at).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RowNoise {
    /// The inverse-CDF uniform of that position (`Sampler::uniform_at`).
    Uniform(f32),
}

/// One step's drafts of every sequence, flattened. S sequences, N nodes, R = N + S logit rows.
#[derive(Debug, Clone, Copy)]
pub struct VerifyBatch<'a> {
    pub vocab_size: usize,
    /// `[S + 1]`. Sequence s owns nodes `node_offsets[s]..node_offsets[s + 1]` and logit rows
    /// `node_offsets[s] + s ..= node_offsets[s + 1] + s` (root row first).
    pub node_offsets: &'a [u32],
    /// `[N]` each node's draft token.
    pub draft_ids: &'a [u32],
    /// `[N]` parent within its sequence, -1 = the root; parents before children. Siblings should
    /// be distinct: of two equal siblings only the first can be accepted (as today's walks).
    pub parents: &'a [i32],
    /// `[S]` how sequence s is decided.
    pub rules: &'a [SeqRule],
    /// `[R]` per logit row, the noise of the position its token is drawn at (root: the sequence's
    /// position; node i: position + depth(i) + 1). Read by coupled sequences only; greedy and
    /// rejection sequences may leave theirs at any value.
    pub row_noise: &'a [RowNoise],
    /// `[S + 1]` offsets into `uniforms`: a rejection sequence gets `SeqRule::uniforms_needed`
    /// values of its sequential stream, in order (the most its walk reads); others get none.
    pub uniform_offsets: &'a [u32],
    pub uniforms: &'a [f32],
    /// `[N]` (empty when no sequence uses rejection) index of node i's q row in `draft_probs`, or
    /// `NO_ROW` (a one-hot q).
    pub prob_rows: &'a [u32],
    /// `[Q, V]` draft distributions.
    pub draft_probs: &'a [f32],
}

/// What a verifier keeps, per sequence.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Verdicts {
    /// `[S + 1]` offsets into `accepted_nodes`.
    pub accepted_offsets: Vec<u32>,
    /// Node indices within their sequence, the root's child first.
    pub accepted_nodes: Vec<u32>,
    /// `[S]` the recovered or bonus token.
    pub next_tokens: Vec<u32>,
    /// `[S]` sequential uniforms read (rejection); the caller advances its stream by exactly this.
    pub uniforms_used: Vec<u32>,
}

impl Verdicts {
    /// Sequence s's accepted nodes.
    pub fn accepted(&self, s: usize) -> &[u32] {
        &self.accepted_nodes[self.accepted_offsets[s] as usize..self.accepted_offsets[s + 1] as usize]
    }
}

/// A `VerifyBatch`'s arrays, built one sequence at a time: what the step's one verification
/// gathers from its sessions (`engine/step_together.rs`), and a single sequence (`verify_one`).
#[derive(Debug, Clone, Default)]
pub struct VerifyBatchBuilder {
    vocab_size: usize,
    node_offsets: Vec<u32>,
    draft_ids: Vec<u32>,
    parents: Vec<i32>,
    rules: Vec<SeqRule>,
    row_noise: Vec<RowNoise>,
    uniform_offsets: Vec<u32>,
    uniforms: Vec<f32>,
    prob_rows: Vec<u32>,
    draft_probs: Vec<f32>,
}

impl VerifyBatchBuilder {
    pub fn new(vocab_size: usize) -> Self {
        Self { vocab_size, node_offsets: vec![0], uniform_offsets: vec![0], ..Self::default() }
    }

    /// Adds a sequence: its draft (`draft_ids`, `parents` within it), rule, `[n + 1]` row noise
    /// (root first), the sequential uniforms its rule reads, and its `[n, vocab]` q rows if any.
    pub fn push(
        &mut self,
        draft_ids: &[u32],
        parents: &[i32],
        rule: SeqRule,
        row_noise: &[RowNoise],
        uniforms: &[f32],
        draft_probs: Option<&[f32]>,
    ) {
        let q_base = (self.draft_probs.len() / self.vocab_size.max(1)) as u32;
        self.prob_rows.extend((0..draft_ids.len() as u32).map(|i| draft_probs.map_or(NO_ROW, |_| q_base + i)));
        self.draft_probs.extend_from_slice(draft_probs.unwrap_or(&[]));
        self.draft_ids.extend_from_slice(draft_ids);
        self.parents.extend_from_slice(parents);
        self.node_offsets.push(self.draft_ids.len() as u32);
        self.rules.push(rule);
        self.row_noise.extend_from_slice(row_noise);
        self.uniforms.extend_from_slice(uniforms);
        self.uniform_offsets.push(self.uniforms.len() as u32);
    }

    pub fn num_seqs(&self) -> usize {
        self.rules.len()
    }

    /// The batch over these arrays (`prob_rows` empty when no sequence has q rows).
    pub fn batch(&self) -> VerifyBatch<'_> {
        let prob_rows: &[u32] = if self.draft_probs.is_empty() { &[] } else { &self.prob_rows };
        VerifyBatch {
            vocab_size: self.vocab_size,
            node_offsets: &self.node_offsets,
            draft_ids: &self.draft_ids,
            parents: &self.parents,
            rules: &self.rules,
            row_noise: &self.row_noise,
            uniform_offsets: &self.uniform_offsets,
            uniforms: &self.uniforms,
            prob_rows,
            draft_probs: &self.draft_probs,
        }
    }
}

fn bad(message: String) -> Error {
    Error::Internal(format!("verify batch: {message}"))
}

impl VerifyBatch<'_> {
    pub fn num_seqs(&self) -> usize {
        self.rules.len()
    }

    pub fn num_rows(&self) -> usize {
        self.draft_ids.len() + self.rules.len()
    }

    /// Sequence s's nodes.
    pub fn nodes(&self, s: usize) -> std::ops::Range<usize> {
        self.node_offsets[s] as usize..self.node_offsets[s + 1] as usize
    }

    /// Sequence s's first (root) logit row.
    pub fn root_row(&self, s: usize) -> usize {
        self.node_offsets[s] as usize + s
    }

    /// Sequence s's uniforms.
    pub fn seq_uniforms(&self, s: usize) -> &[f32] {
        &self.uniforms[self.uniform_offsets[s] as usize..self.uniform_offsets[s + 1] as usize]
    }

    /// Checks the shapes and every index a walk reads against `num_logits` logit values (see the
    /// module header), naming what is wrong.
    pub fn check(&self, num_logits: usize) -> Result<()> {
        let (s_count, n, v) = (self.rules.len(), self.draft_ids.len(), self.vocab_size);
        if v == 0 {
            return Err(bad("vocab_size is 0".into()));
        }
        let expect = |what: &str, got: usize, expected: usize| {
            if got == expected {
                Ok(())
            } else {
                Err(bad(format!("{what} has {got} values, expected {expected}")))
            }
        };
        expect("node_offsets", self.node_offsets.len(), s_count + 1)?;
        expect("parents", self.parents.len(), n)?;
        expect("row_noise", self.row_noise.len(), n + s_count)?;
        expect("uniform_offsets", self.uniform_offsets.len(), s_count + 1)?;
        expect("logits", num_logits, (n + s_count) * v)?;
        if self.node_offsets[0] != 0 || self.node_offsets[s_count] as usize != n {
            return Err(bad(format!("node_offsets must run from 0 to {n}")));
        }
        if self.uniform_offsets[0] != 0 || self.uniform_offsets[s_count] as usize != self.uniforms.len() {
            return Err(bad(format!("uniform_offsets must run from 0 to {}", self.uniforms.len())));
        }
        let any_rejection = self.rules.iter().any(|r| r.mode == Mode::Rejection);
        if any_rejection {
            expect("prob_rows", self.prob_rows.len(), n)?;
        }
        if !self.draft_probs.len().is_multiple_of(v) {
            return Err(bad(format!("draft_probs has {} values, not a multiple of vocab {v}", self.draft_probs.len())));
        }
        let q_rows = self.draft_probs.len() / v;
        for s in 0..s_count {
            let (start, end) = (self.node_offsets[s] as usize, self.node_offsets[s + 1] as usize);
            if start > end {
                return Err(bad(format!("node_offsets decrease at sequence {s}")));
            }
            let (u_start, u_end) = (self.uniform_offsets[s] as usize, self.uniform_offsets[s + 1] as usize);
            if u_start > u_end {
                return Err(bad(format!("uniform_offsets decrease at sequence {s}")));
            }
            let rule = &self.rules[s];
            if rule.mode != Mode::Greedy && rule.temperature <= 0.0 {
                return Err(bad(format!("sequence {s} samples at temperature {}", rule.temperature)));
            }
            let count = end - start;
            let parents = &self.parents[start..end];
            for (i, &p) in parents.iter().enumerate() {
                if p < -1 || p >= i as i32 {
                    return Err(bad(format!(
                        "sequence {s}: node {i} has parent {p}; a parent is -1 or an earlier node"
                    )));
                }
            }
            for &t in &self.draft_ids[start..end] {
                if t as usize >= v {
                    return Err(bad(format!("sequence {s}: draft token {t} is outside vocab {v}")));
                }
            }
            if rule.mode == Mode::Rejection {
                expect(&format!("sequence {s}'s uniforms"), u_end - u_start, rule.uniforms_needed(count))?;
                if !rule.declared_tree && parents.iter().enumerate().any(|(i, &p)| p != i as i32 - 1) {
                    return Err(bad(format!("sequence {s}: a draft not declared a tree must be a chain")));
                }
                for &row in &self.prob_rows[start..end] {
                    if row != NO_ROW && row as usize >= q_rows {
                        return Err(bad(format!("sequence {s}: q row {row} of {q_rows}")));
                    }
                }
            }
        }
        Ok(())
    }
}
