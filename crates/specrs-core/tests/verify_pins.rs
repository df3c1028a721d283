//! Pins of today's verification outputs, bitwise: for synthetic logits from a fixed LCG, every
//! verification rule (greedy, coupled one-hot, rejection with draft probabilities, the empty draft
//! = plain sampling) on chains and trees, under several sampling filters, seeds and positions, the
//! exact accepted path, emitted tokens and the `sampler.uniform()` drawn afterwards (which pins how
//! far the sequential stream advanced). Asserted through the public `verify::verify` and
//! `verify::tree::verify_tree`, so a rewrite of the walks must keep every case.
//!
//! Invariant: pure f32 arithmetic and ChaCha8, no model and no CPU kernel, so the pins are the same
//! on every machine. The committed values live in tests/golden/pins/verify_pins.txt; regenerate
//! them (only for an intended change, saying why in the commit) with
//! `SPECRS_WRITE_PINS=1 cargo test --release -p specrs-core --test integration verify_pins::`.

use std::collections::BTreeMap;

use specrs_core::sampler::{argmax, Sampler};
use specrs_core::verify::{tree::verify_tree, verify};
use specrs_core::SamplingParams;

use crate::common::pins;

const PIN_FILE: &str = "verify_pins.txt";
const HEADER: &str = "verify_pins.rs: today's verification outputs (path, tokens, next sequential uniform's bits).\n\
    Regenerate: SPECRS_WRITE_PINS=1 cargo test --release -p specrs-core --test integration verify_pins::";

/// A fixed 64-bit LCG (Knuth's MMIX constants): the cases' only randomness.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 16
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// One logits row: coarse values for the small vocabulary (so equal maxima occur and the
    /// lowest-index tie rule is pinned), fine ones for the large, plus a boost on one favored
    /// token so drafts that pick it are often accepted and walks go deep.
    fn row(&mut self, vocab: usize) -> (Vec<f32>, u32) {
        let mut row: Vec<f32> = (0..vocab)
            .map(|_| {
                if vocab < 64 {
                    (self.below(24) as f32) * 0.25 - 3.0
                } else {
                    (self.next() % (1 << 24)) as f32 / (1 << 24) as f32 * 12.0 - 6.0
                }
            })
            .collect();
        let favored = self.below(vocab) as u32;
        row[favored as usize] = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) + [0.0, 3.0, 6.0][self.below(3)];
        (row, favored)
    }

    /// A normalized draft distribution that puts extra mass on `token`.
    fn q_row(&mut self, vocab: usize, token: u32) -> Vec<f32> {
        let mut q: Vec<f32> = (0..vocab).map(|_| (self.below(1000) + 1) as f32).collect();
        q[token as usize] += 200.0 * vocab as f32;
        let total: f32 = q.iter().sum();
        q.iter_mut().for_each(|x| *x /= total);
        q
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Rule {
    Greedy,
    Coupled,
    Rejection,
}

#[derive(Clone, Copy, PartialEq)]
enum Shape {
    Chain,
    Tree,
    /// A chain given to `verify_tree`: the tree's rejection arithmetic on a chain.
    ChainAsTree,
    /// The empty draft (plain sampling) through `verify`.
    Empty,
    /// The empty draft through `verify_tree`.
    EmptyTree,
}

/// One case's inputs: `n` nodes, logits `[n + 1, vocab]`, parents, and q rows for rejection.
struct Case {
    vocab: usize,
    ids: Vec<u32>,
    parents: Vec<i32>,
    logits: Vec<f32>,
    probs: Option<Vec<f32>>,
}

fn build(rng: &mut Lcg, vocab: usize, shape: Shape, rule: Rule) -> Case {
    let n = match shape {
        Shape::Empty | Shape::EmptyTree => 0,
        Shape::Chain | Shape::ChainAsTree => 1 + rng.below(6),
        Shape::Tree => 1 + rng.below(9),
    };
    let parents: Vec<i32> = (0..n)
        .map(|i| if shape != Shape::Tree || i == 0 { i as i32 - 1 } else { rng.below(i + 1) as i32 - 1 })
        .collect();
    // Rows: 0 for the root, i + 1 for node i; each row's favored token seeds its children.
    let rows: Vec<(Vec<f32>, u32)> = (0..=n).map(|_| rng.row(vocab)).collect();
    let mut ids = vec![0u32; n];
    for i in 0..n {
        let parent_row = (parents[i] + 1) as usize;
        let siblings: Vec<u32> = (0..i).filter(|&j| parents[j] == parents[i]).map(|j| ids[j]).collect();
        let favored = rows[parent_row].1;
        // The first child takes the favored token often; siblings stay distinct.
        let mut token = if siblings.is_empty() && rng.below(10) < 8 { favored } else { rng.below(vocab) as u32 };
        while siblings.contains(&token) {
            token = (token + 1) % vocab as u32;
        }
        ids[i] = token;
    }
    let logits: Vec<f32> = rows.iter().flat_map(|(r, _)| r.iter().copied()).collect();
    let probs = (rule == Rule::Rejection && n > 0).then(|| {
        // Row i is the distribution node i and its siblings were drawn from: siblings share the
        // first sibling's row (only that one is read by the tree walk).
        let mut q_rows: Vec<Vec<f32>> = Vec::with_capacity(n);
        for i in 0..n {
            let first_sibling = (0..i).find(|&j| parents[j] == parents[i]);
            let q = match first_sibling {
                Some(j) => q_rows[j].clone(),
                None => rng.q_row(vocab, ids[i]),
            };
            q_rows.push(q);
        }
        q_rows.concat()
    });
    Case { vocab, ids, parents, logits, probs }
}

fn params_set() -> Vec<(&'static str, SamplingParams)> {
    vec![
        ("t0.7", SamplingParams { temperature: 0.7, ..Default::default() }),
        ("t1.0k8", SamplingParams { temperature: 1.0, top_k: 8, ..Default::default() }),
        ("t0.9p0.8m0.05", SamplingParams { temperature: 0.9, top_p: 0.8, min_p: 0.05, ..Default::default() }),
    ]
}

/// Runs one case through today's public verifiers: "path=[..] tokens=[..] next=<bits of the
/// sequential uniform drawn afterwards>".
fn run(case: &Case, shape: Shape, params: &SamplingParams, seed: u64, position: usize) -> String {
    let mut sampler = Sampler::new(Some(seed));
    let probs = case.probs.as_deref();
    let (path, tokens) = match shape {
        Shape::Chain | Shape::Empty => {
            let v = verify(&case.logits, case.vocab, &case.ids, probs, params, &mut sampler, position).unwrap();
            ((0..v.num_accepted_tokens).collect::<Vec<_>>(), v.token_ids)
        }
        Shape::Tree | Shape::ChainAsTree | Shape::EmptyTree => {
            let v =
                verify_tree(&case.logits, case.vocab, &case.ids, &case.parents, probs, params, &mut sampler, position)
                    .unwrap();
            (v.accepted_path, v.token_ids)
        }
    };
    format!("path={path:?} tokens={tokens:?} next={:08x}", sampler.uniform().to_bits())
}

fn all_cases() -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let kinds: [(&str, Rule, Shape); 9] = [
        ("greedy_chain", Rule::Greedy, Shape::Chain),
        ("greedy_tree", Rule::Greedy, Shape::Tree),
        ("coupled_chain", Rule::Coupled, Shape::Chain),
        ("coupled_tree", Rule::Coupled, Shape::Tree),
        ("rejection_chain", Rule::Rejection, Shape::Chain),
        ("rejection_tree", Rule::Rejection, Shape::Tree),
        ("rejection_chain_as_tree", Rule::Rejection, Shape::ChainAsTree),
        ("plain_chain", Rule::Coupled, Shape::Empty),
        ("plain_tree", Rule::Coupled, Shape::EmptyTree),
    ];
    let greedy = [("greedy", SamplingParams { temperature: 0.0, ..Default::default() })];
    let sampled = params_set();
    for (kind, rule, shape) in kinds {
        let param_list: &[(&str, SamplingParams)] = if rule == Rule::Greedy { &greedy } else { &sampled };
        let vocabs: &[usize] = if rule == Rule::Greedy { &[37] } else { &[37, 4096] };
        for &vocab in vocabs {
            for seed in 1..=6u64 {
                for position in [0usize, 7, 300] {
                    for (name, params) in param_list {
                        let mut rng = Lcg(seed * 1_000_003 + position as u64 * 7919 + vocab as u64);
                        let case = build(&mut rng, vocab, shape, rule);
                        let key = format!("{kind}/v{vocab}/{name}/seed{seed}/pos{position}");
                        out.insert(key, run(&case, shape, params, seed, position));
                    }
                }
            }
        }
    }
    out
}

#[test]
fn verification_outputs_equal_the_pinned_ones() {
    let got = all_cases();
    // The cases exercise what they pin: deep acceptance, rejections and (greedy) both outcomes.
    let drafted: Vec<&String> = got.iter().filter(|(k, _)| !k.starts_with("plain")).map(|(_, v)| v).collect();
    let accepted = drafted.iter().filter(|v| !v.starts_with("path=[]")).count();
    assert!(
        accepted > drafted.len() / 4 && accepted < drafted.len() * 3 / 4,
        "{accepted} of {} drafted cases accept a draft",
        drafted.len()
    );
    pins::check(
        PIN_FILE,
        HEADER,
        "",
        &got,
        "SPECRS_WRITE_PINS=1 cargo test --release -p specrs-core --test integration verify_pins::",
    );
}

/// The synthetic logits have equal maxima (a favored token boosted by 0 ties the largest other
/// one), so the greedy pins also pin the lowest-index tie rule.
#[test]
fn greedy_cases_include_ties() {
    let mut rng = Lcg(1);
    let ties = (0..300)
        .filter(|_| {
            let (row, _) = rng.row(37);
            let best = argmax(&row) as usize;
            row.iter().enumerate().any(|(i, &x)| i != best && x == row[best])
        })
        .count();
    assert!(ties > 50, "only {ties} of 300 rows have a tie at the maximum");
}
