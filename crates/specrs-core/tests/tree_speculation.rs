//! Tree speculation through `Session` on the real SmolLM2-135M weights:
//! - after every tree step, the target's KV cache is bitwise the cache a chain forward over the
//!   kept tokens alone builds (the accepted path moved into place, the rest dropped);
//! - the output equals plain greedy decoding, with trees actually verified (several children);
//! - a custom proposer's trees with wrong branches and the right one at every rank.

use specrs_core::kv_cache::KvCache;
use specrs_core::model::{ForwardBatch, LogitRows};
use specrs_core::proposer::{Draft, Proposer, TreeLimits};
use specrs_core::spec_config::SpeculativeConfig;
use specrs_core::{Engine, SamplingParams};

use crate::common;

fn engine() -> Engine {
    Engine::load(common::smollm2_path(), "cpu").expect("load SmolLM2")
}

const TEXT: &str = "List the planets: Mercury, Venus, Earth, Mars. Again: Mercury, Venus, Earth, Mars. Once more, \
    the list of the planets: Mercury, Venus,";

/// A cache holding `tokens`, built by one chain forward.
fn cache_of(engine: &Engine, tokens: &[u32]) -> KvCache {
    let model = engine.model();
    let mut cache = model.new_cache(tokens.len() + 1).unwrap();
    let batch = ForwardBatch::chain(tokens, 0, LogitRows::None).unwrap();
    model.forward_batch(&batch, &mut [&mut cache]).unwrap();
    cache
}

fn assert_same_cache(a: &KvCache, b: &KvCache, num_layers: usize) {
    assert_eq!(a.len(), b.len());
    for layer in 0..num_layers {
        let ((ka, va), (kb, vb)) = (a.layer(layer), b.layer(layer));
        // `[capacity, row_len]`: the held positions are the first len rows.
        let n = a.len() * (ka.len() / a.capacity());
        assert!(ka[..n] == kb[..n] && va[..n] == vb[..n], "layer {layer}: the kept cache differs");
    }
}

/// Runs `config` to the end, checking the cache after every step; returns (tokens, metrics).
fn run(
    engine: &Engine,
    config: &str,
    custom: Option<Box<dyn Proposer>>,
) -> (Vec<u32>, specrs_core::metrics::RequestMetrics) {
    let prompt = engine.tokenizer().encode(TEXT, false).unwrap();
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(40) };
    let config = SpeculativeConfig::from_json(config).unwrap();
    let speculation = engine.speculation(&config, custom).unwrap();
    let mut session = engine.start(prompt.clone(), params, Some(speculation)).unwrap();
    let num_layers = engine.model().info().num_layers;
    while !session.is_finished() {
        session.step().unwrap();
        if session.is_finished() {
            break;
        }
        let mut context = prompt.clone();
        context.extend_from_slice(session.generated_ids());
        let expected = cache_of(engine, &context[..context.len() - 1]);
        assert_same_cache(session.cache_mut(), &expected, num_layers);
    }
    let result = session.result();
    (result.token_ids, result.metrics)
}

/// Knows the greedy continuation; drafts a tree whose right branch sits at rank `step % 3` under
/// the root, beside wrong siblings, with a wrong token deeper down every third step.
struct OracleTree {
    prompt_len: usize,
    expected: Vec<u32>,
    step: usize,
}

impl Proposer for OracleTree {
    fn propose(&mut self, _context: &[u32], _max_tokens: usize) -> specrs_core::Result<Draft> {
        unreachable!("a tree config asks for trees")
    }

    fn propose_tree(&mut self, context: &[u32], max_depth: usize, limits: TreeLimits) -> specrs_core::Result<Draft> {
        let start = context.len() - self.prompt_len;
        let right: Vec<u32> = self.expected[start.min(self.expected.len())..].iter().take(max_depth).copied().collect();
        self.step += 1;
        let Some(&first) = right.first() else { return Ok(Draft::default()) };
        let rank = self.step % 3;
        let mut tokens = Vec::new();
        let mut parents = Vec::new();
        for r in 0..3 {
            tokens.push(if r == rank { first } else { (first + 1 + r as u32) % 49152 });
            parents.push(-1);
        }
        let mut parent = rank as i32;
        for (depth, &token) in right.iter().enumerate().skip(1) {
            if tokens.len() >= limits.max_nodes {
                break;
            }
            let wrong = self.step.is_multiple_of(3) && depth == 2;
            tokens.push(if wrong { token.wrapping_add(1) % 49152 } else { token });
            parents.push(parent);
            parent = tokens.len() as i32 - 1;
        }
        tokens.truncate(limits.max_nodes);
        parents.truncate(limits.max_nodes);
        Ok(Draft::tree(tokens, parents))
    }
}

#[test]
fn tree_steps_keep_the_path_cache_and_the_greedy_output() {
    let engine = engine();
    let (plain, _) = run(
        &engine,
        r#"{"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 9, "prompt_lookup_max": 9, "adaptive_draft_length": false}"#,
        None,
    );
    for config in [
        r#"{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "tree": true, "tree_top_k": 3}"#,
        r#"{"method": "suffix", "num_speculative_tokens": 8, "tree": true, "tree_depth": 4}"#,
        r#"{"method": "ngram", "num_speculative_tokens": 16, "prompt_lookup_min": 1, "tree": "auto"}"#,
    ] {
        let (tokens, metrics) = run(&engine, config, None);
        assert_eq!(tokens, plain, "{config}");
        assert!(metrics.spec.num_drafts > 0, "{config}: no drafts");
    }
    let prompt_len = engine.tokenizer().encode(TEXT, false).unwrap().len();
    let oracle = OracleTree { prompt_len, expected: plain.clone(), step: 0 };
    let config = r#"{"method": "custom", "num_speculative_tokens": 6, "tree": true, "tree_top_k": 3}"#;
    let (tokens, metrics) = run(&engine, config, Some(Box::new(oracle)));
    assert_eq!(tokens, plain);
    assert!(metrics.spec.num_tree_drafts > 5, "{:?}", metrics.spec);
    // The right branch at ranks 1 and 2 is found, deep paths are accepted.
    assert!(
        metrics.spec.num_tree_accepted_tokens as f64 / metrics.spec.num_tree_drafts as f64 > 1.5,
        "{:?}",
        metrics.spec
    );
}
