//! Token trees from the model-based proposers (EAGLE-2's dynamic tree): hidden-state heads on the
//! golden heads' tiny targets (`tests/golden/heads`, every format specrs reads) and a draft model
//! built from random weights.
//!
//! For each: the tree is valid within its limits and deterministic (no q, greedy or sampled); its
//! rank-0 path is the greedy chain draft of that length; a head's cache after `propose_tree` is
//! the one `propose` leaves (same length, same rows: the next drafts agree); a recurrent head's
//! tree rows compute what a chain run of their path computes; a draft model that drafted a tree
//! and was told the accepted path drafts next what a fresh draft model given that context does.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use specrs_core::model::candle::decoder::{Decoder, WeightFormat};
use specrs_core::model::llama_config::LlamaConfig;
use specrs_core::model::{CausalLm, ForwardBatch, LogitRows};
use specrs_core::proposer::draft_model::{DraftDrawing, DraftModelProposer};
use specrs_core::proposer::heads::layer::TreeRows;
use specrs_core::proposer::heads::{Head, HeadProposer};
use specrs_core::proposer::tree::{first_path, path_to, sibling_ranks};
use specrs_core::proposer::{Draft, Feedback, Proposer, TreeLimits};
use specrs_core::spec_config::HeadMethod;
use specrs_core::{Engine, SamplingParams, SpeculativeConfig};

const RECURRENT: [&str; 8] = [
    "eagle_llama",
    "eagle_qwen2",
    "eagle3_llama_speculators",
    "eagle3_llama_speculators_options",
    "eagle3_qwen2_specforge",
    "mtp_llama_deepseek",
    "mtp_llama_deepseek_2layers",
    "mtp_qwen2_mimo",
];
const PARALLEL: [&str; 4] = ["mlp_speculator_llama", "mlp_speculator_qwen2", "medusa_llama", "medusa_qwen2_vllm"];
const BLOCK: [&str; 3] = ["dflash_llama", "dflash_qwen3_options", "dspark_qwen3"];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The golden case `name`'s target engine, head and prompt.
fn golden(name: &str) -> (Engine, Head, Vec<u32>) {
    let path = repo_root().join("tests/golden/heads").join(name).join("reference.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let engine = Engine::load(repo_root().join(v["target"].as_str().unwrap()), "cpu").unwrap();
    let method = HeadMethod::from_name(v["method"].as_str().unwrap()).unwrap();
    let model = v["model"].as_str().map(|m| repo_root().join(m).display().to_string());
    let head = engine.head(method, model.as_deref(), None).unwrap().head;
    let prompt = v["prompt_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    (engine, head, prompt)
}

/// The target's hidden rows at `taps` (concatenated) of `tokens`, `[tokens.len(), width]`.
fn target_rows(engine: &Engine, tokens: &[u32], head: &Head) -> Vec<Tensor> {
    let mut batch = ForwardBatch::chain(tokens, 0, LogitRows::None).unwrap();
    batch.taps = head.taps();
    let mut cache = engine.model().new_cache(tokens.len()).unwrap();
    engine.model().forward_batch(&batch, &mut [&mut cache]).unwrap().hidden
}

/// A head proposer that has read the prompt's target rows (all but the newest token's), as a
/// session leaves it before its first draft.
fn primed(engine: &Engine, head: &Head, prompt: &[u32], params: &SamplingParams) -> HeadProposer {
    let vocab = engine.model().info().vocab_size;
    let mut proposer = HeadProposer::new(head.clone(), "test", vocab, DraftDrawing::COUPLED, Arc::default());
    proposer.record_logits();
    proposer.begin(prompt, params).unwrap();
    proposer.observe_hidden(0, &target_rows(engine, &prompt[..prompt.len() - 1], head)).unwrap();
    proposer
}

fn greedy() -> SamplingParams {
    SamplingParams::greedy(32)
}

fn tokens_of(draft: &Draft, nodes: &[usize]) -> Vec<u32> {
    nodes.iter().map(|&i| draft.token_ids[i]).collect()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

#[test]
fn head_trees_are_valid_and_lead_with_the_greedy_chain() {
    let limits = TreeLimits { max_nodes: 10, max_children: 3 };
    let depth = 4;
    for name in RECURRENT.iter().chain(&PARALLEL).chain(&BLOCK) {
        let (engine, head, prompt) = golden(name);
        let vocab = engine.model().info().vocab_size;
        let mut tree_proposer = primed(&engine, &head, &prompt, &greedy());
        let tree = tree_proposer.propose_tree(&prompt, depth, limits).unwrap();
        tree.validate(depth, Some(limits), vocab, name).unwrap();
        assert!(tree.is_tree() && tree.probs.is_none(), "{name}: {tree:?}");
        assert_eq!(tree.token_ids.len(), limits.max_nodes, "{name}: a tiny head's tree fills its budget");
        let path = first_path(&tree.parents());
        let mut chain_proposer = primed(&engine, &head, &prompt, &greedy());
        let chain = chain_proposer.propose(&prompt, path.len()).unwrap();
        assert_eq!(tokens_of(&tree, &path), chain.token_ids, "{name}: the rank-0 path is the greedy chain");
        assert_eq!(tree_proposer.kv_len(), chain_proposer.kv_len(), "{name}: the head's cache after a tree");

        // The caches hold the same rows: after the same next target rows, the same drafts with
        // the same logits.
        let mut context = prompt.clone();
        context.extend(&chain.token_ids[..1]);
        context.push(7);
        let rows = target_rows(&engine, &context[..context.len() - 1], &head);
        let new_rows: Vec<Tensor> = rows.iter().map(|r| r.narrow(0, prompt.len() - 1, 2).unwrap()).collect();
        let (_, _) = (tree_proposer.take_recorded(), chain_proposer.take_recorded());
        let mut next = Vec::new();
        for proposer in [&mut tree_proposer, &mut chain_proposer] {
            proposer.observe_hidden(prompt.len() - 1, &new_rows).unwrap();
            let draft = proposer.propose(&context, 3).unwrap();
            next.push((draft.token_ids, proposer.take_recorded()));
        }
        assert_eq!(next[0], next[1], "{name}: the drafts after a tree and after a chain");
    }
}

/// With one child per node the tree is the greedy chain itself; Medusa's nodes of one depth all get
/// the same children (its heads do not read the tokens before).
#[test]
fn narrow_trees_are_chains_and_medusa_trees_repeat_each_heads_top_k() {
    for name in ["eagle3_llama_speculators", "mtp_llama_deepseek_2layers", "mlp_speculator_llama", "medusa_llama"] {
        let (engine, head, prompt) = golden(name);
        let depth = 3;
        let chain = primed(&engine, &head, &prompt, &greedy()).propose(&prompt, depth).unwrap();
        let narrow = TreeLimits { max_nodes: 8, max_children: 1 };
        let tree = primed(&engine, &head, &prompt, &greedy()).propose_tree(&prompt, depth, narrow).unwrap();
        assert_eq!(tree, chain, "{name}");
    }
    let (engine, head, prompt) = golden("medusa_llama");
    let limits = TreeLimits { max_nodes: 40, max_children: 3 };
    let tree = primed(&engine, &head, &prompt, &greedy()).propose_tree(&prompt, 3, limits).unwrap();
    let parents = tree.parents();
    let children = specrs_core::proposer::tree::children(&parents);
    let depths = specrs_core::proposer::tree::depths(&parents).unwrap();
    for (a, b) in (0..parents.len()).flat_map(|a| (0..parents.len()).map(move |b| (a, b))) {
        if depths[a] == depths[b] && !children[a + 1].is_empty() && !children[b + 1].is_empty() {
            let (ka, kb) = (tokens_of(&tree, &children[a + 1]), tokens_of(&tree, &children[b + 1]));
            assert!(ka.starts_with(&kb) || kb.starts_with(&ka), "medusa: {ka:?} vs {kb:?}");
        }
    }
}

/// Sampled requests get deterministic trees too: the top-k of q after temperature / top-k.
#[test]
fn sampled_requests_get_deterministic_trees() {
    let sampled = SamplingParams { temperature: 0.8, top_k: 2, seed: Some(1), ..greedy() };
    let limits = TreeLimits { max_nodes: 12, max_children: 4 };
    for name in ["eagle_llama", "mlp_speculator_qwen2"] {
        let (engine, head, prompt) = golden(name);
        let vocab = engine.model().info().vocab_size;
        let tree = primed(&engine, &head, &prompt, &sampled).propose_tree(&prompt, 4, limits).unwrap();
        tree.validate(4, Some(limits), vocab, name).unwrap();
        assert!(tree.probs.is_none(), "{name}");
        // top_k 2 leaves two tokens with q > 0 per node.
        assert!(specrs_core::proposer::tree::children(&tree.parents()).iter().all(|c| c.len() <= 2), "{name}");
        let again = primed(&engine, &head, &prompt, &sampled).propose_tree(&prompt, 4, limits).unwrap();
        assert_eq!(tree, again, "{name}: no random draws");
    }
}

/// A tree's rows, run as one batched `step_tree` per depth, give the hidden states and logits a
/// chain run of each node's path gives (MTP with two layers: each step's rows in its own layer).
#[test]
fn recurrent_tree_rows_equal_chain_runs_of_their_paths() {
    // (token, parent) of a fixed tree: three children of the root, two of node 1, one of node 2,
    // then one and two below those.
    let nodes: [(u32, i32); 9] = [(5, -1), (17, -1), (42, -1), (7, 1), (9, 1), (11, 2), (3, 4), (4, 5), (8, 5)];
    let parents: Vec<i32> = nodes.iter().map(|n| n.1).collect();
    let depths = specrs_core::proposer::tree::depths(&parents).unwrap();
    for name in ["eagle_llama", "eagle3_llama_speculators", "mtp_llama_deepseek_2layers", "mtp_qwen2_mimo"] {
        let (engine, wrapped, prompt) = golden(name);
        let Head::Recurrent(head) = &wrapped else { panic!("{name} is recurrent") };
        let mut caches = head.new_caches(64, &Arc::default()).unwrap();
        let read = &prompt[..prompt.len() - 1];
        let taps = target_rows(&engine, read, &wrapped);
        let rows = Tensor::cat(&taps, 1).unwrap();
        let out = head.extend(&mut caches, &rows, &prompt[1..], 0).unwrap();
        let fed = read.len();
        let root = out.narrow(0, fed - 1, 1).unwrap();
        let context: Vec<usize> = caches.iter().map(|c| c.len()).collect();

        // The tree, one step_tree per depth.
        let mut outputs: Vec<Option<Tensor>> = vec![None; nodes.len()];
        let mut cache_row = vec![usize::MAX; nodes.len()];
        for depth in 0..=*depths.iter().max().unwrap() {
            let level: Vec<usize> = (0..nodes.len()).filter(|&x| depths[x] == depth).collect();
            let step = depth + 1;
            let layer = head.step_cache(step);
            let parent_hidden: Vec<Tensor> = level
                .iter()
                .map(|&x| if parents[x] < 0 { root.clone() } else { outputs[parents[x] as usize].clone().unwrap() })
                .collect();
            let hidden = Tensor::cat(&parent_hidden, 0).unwrap();
            let tokens: Vec<u32> = level.iter().map(|&x| nodes[x].0).collect();
            let ancestors: Vec<Vec<usize>> = level
                .iter()
                .map(|&x| {
                    let path = path_to(&parents, x);
                    path[..path.len() - 1]
                        .iter()
                        .filter(|&&a| head.step_cache(depths[a] + 1) == layer)
                        .map(|&a| cache_row[a])
                        .collect()
                })
                .collect();
            let positions = vec![fed + depth; level.len()];
            let first = caches[layer].len();
            let tree_rows = TreeRows { context: context[layer], positions: &positions, ancestors: &ancestors };
            let out = head.step_tree(&mut caches, &hidden, &tokens, step, &tree_rows).unwrap();
            for (i, &x) in level.iter().enumerate() {
                outputs[x] = Some(out.narrow(0, i, 1).unwrap());
                cache_row[x] = first + i;
            }
        }

        // Each node's path as a chain of `step`s from the context.
        let mut worst = 0f32;
        for x in 0..nodes.len() {
            for (cache, &len) in caches.iter_mut().zip(&context) {
                cache.truncate(len);
            }
            let mut hidden = root.clone();
            for (j, &a) in path_to(&parents, x).iter().enumerate() {
                hidden = head.step(&mut caches, &hidden, nodes[a].0, j + 1, fed + j).unwrap();
            }
            let tree_hidden = outputs[x].as_ref().unwrap();
            let step = depths[x] + 1;
            worst = worst.max(max_abs_diff(&hidden, tree_hidden));
            let logits = |h: &Tensor| head.logits(h, step).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for (a, b) in logits(&hidden).into_iter().zip(logits(tree_hidden)) {
                // Outside a draft vocabulary both are -inf.
                if a != b {
                    worst = worst.max((a - b).abs());
                }
            }
        }
        println!("{name:<28} max |tree - chain| over hidden states and logits: {worst:.2e}");
        assert!(worst < 1e-4, "{name}: {worst}");
    }
}

fn tiny_draft() -> Arc<dyn CausalLm> {
    let config = LlamaConfig::from_json(
        r#"{"vocab_size": 48, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}"#,
    )
    .unwrap();
    Arc::new(Decoder::random(&config, 11, WeightFormat::Dense(DType::F32), &Device::Cpu).unwrap())
}

fn draft_proposer(model: &Arc<dyn CausalLm>, prompt: &[u32], params: &SamplingParams) -> DraftModelProposer {
    let mut proposer = DraftModelProposer::new(model.clone(), None, 48, DraftDrawing::COUPLED, Arc::default());
    proposer.begin(prompt, params).unwrap();
    proposer
}

#[test]
fn draft_model_trees_lead_with_the_chain_and_keep_the_accepted_path() {
    let model = tiny_draft();
    let prompt: Vec<u32> = vec![1, 9, 4, 33, 12, 7, 20, 5];
    let limits = TreeLimits { max_nodes: 12, max_children: 3 };
    let depth = 4;
    let mut proposer = draft_proposer(&model, &prompt, &greedy());
    let tree = proposer.propose_tree(&prompt, depth, limits).unwrap();
    tree.validate(depth, Some(limits), 48, "draft_model").unwrap();
    assert!(tree.is_tree() && tree.probs.is_none() && tree.depth() > 1, "{tree:?}");
    let path = first_path(&tree.parents());
    let chain = draft_proposer(&model, &prompt, &greedy()).propose(&prompt, path.len()).unwrap();
    assert_eq!(tokens_of(&tree, &path), chain.token_ids, "the rank-0 path is the greedy chain");
    let narrow = TreeLimits { max_nodes: 8, max_children: 1 };
    let as_chain = draft_proposer(&model, &prompt, &greedy()).propose_tree(&prompt, depth, narrow).unwrap();
    assert_eq!(as_chain, draft_proposer(&model, &prompt, &greedy()).propose(&prompt, depth).unwrap());

    // Accept the deepest path through a rank-1 node (its rows must move in the cache), then the
    // target's own token.
    let parents = tree.parents();
    let ranks = sibling_ranks(&parents);
    let accepted = (0..parents.len())
        .map(|x| path_to(&parents, x))
        .filter(|p| p.iter().any(|&x| ranks[x] > 0))
        .max_by_key(|p| (p.len(), std::cmp::Reverse(p.clone())))
        .unwrap();
    assert!(accepted.len() >= 2, "{tree:?}");
    let mut appended = tokens_of(&tree, &accepted);
    appended.push(30);
    proposer.observe(&Feedback::accepted(accepted.len(), &appended, &accepted)).unwrap();
    let kept = proposer.kv_len().unwrap();
    // The accepted path's first node has a child, so it was expanded: its row stays.
    assert!((prompt.len() + 1..=prompt.len() + accepted.len()).contains(&kept), "{kept}");

    let mut context = prompt.clone();
    context.extend(&appended);
    let fresh = draft_proposer(&model, &prompt, &greedy()).propose_tree(&context, depth, limits).unwrap();
    let next = proposer.propose_tree(&context, depth, limits).unwrap();
    assert_eq!(next, fresh, "after the accepted path, the draft a fresh draft model makes");

    // Then a chain step after a tree: nothing accepted, the target's token only.
    proposer.observe(&Feedback::accepted(0, &[2], &[])).unwrap();
    assert_eq!(proposer.kv_len(), Some(context.len()));
    context.push(2);
    let fresh = draft_proposer(&model, &prompt, &greedy()).propose(&context, 3).unwrap();
    assert_eq!(proposer.propose(&context, 3).unwrap(), fresh);

    // Sampled: a deterministic tree of the top-k of q.
    let sampled = SamplingParams { temperature: 0.7, top_p: 0.9, seed: Some(3), ..greedy() };
    let tree = draft_proposer(&model, &prompt, &sampled).propose_tree(&prompt, depth, limits).unwrap();
    tree.validate(depth, Some(limits), 48, "draft_model").unwrap();
    assert!(tree.probs.is_none());
    assert_eq!(tree, draft_proposer(&model, &prompt, &sampled).propose_tree(&prompt, depth, limits).unwrap());
}

/// Through `Engine::generate` with `"tree": true`: every head's and a draft model's trees are
/// verified, and greedy output is plain greedy decoding.
#[test]
fn tree_speculation_with_every_head_and_a_draft_model_is_plain_greedy_decoding() {
    let params = SamplingParams { max_tokens: 24, ignore_eos: true, ..greedy() };
    let tree_keys = serde_json::json!({"num_speculative_tokens": 8, "tree": true, "tree_depth": 3, "tree_top_k": 3});
    let mut seen_draft_model = false;
    for name in RECURRENT.iter().chain(&PARALLEL).chain(&BLOCK) {
        let path = repo_root().join("tests/golden/heads").join(name).join("reference.json");
        let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let (engine, _, prompt) = golden(name);
        let plain = engine.generate(prompt.clone(), params.clone(), None).unwrap().token_ids;
        let mut config = tree_keys.clone();
        config["method"] = v["method"].clone();
        if let Some(model) = v["model"].as_str() {
            config["model"] = repo_root().join(model).display().to_string().into();
        }
        let mut runs = vec![(name.to_string(), SpeculativeConfig::from_json(&config.to_string()).unwrap(), None)];
        if !seen_draft_model {
            // A random draft model with a smaller vocabulary than the target's, as a custom proposer.
            seen_draft_model = true;
            let mut custom = tree_keys.clone();
            custom["method"] = "custom".into();
            let proposer: Box<dyn Proposer> = Box::new(DraftModelProposer::new(
                tiny_draft(),
                None,
                engine.model().info().vocab_size,
                DraftDrawing::COUPLED,
                Arc::default(),
            ));
            runs.push((
                "draft model".into(),
                SpeculativeConfig::from_json(&custom.to_string()).unwrap(),
                Some(proposer),
            ));
        }
        for (what, config, custom) in runs {
            let speculation = engine.speculation(&config, custom).unwrap();
            let out = engine.generate(prompt.clone(), params.clone(), Some(speculation)).unwrap();
            assert_eq!(out.token_ids, plain, "{what}");
            let spec = &out.metrics.spec;
            assert!(spec.num_tree_drafts > 0 && spec.num_tree_draft_tokens > spec.tree_depth_sum, "{what}: {spec:?}");
            println!(
                "{what:<34} {} tree drafts, {:.1} nodes, {:.2} accepted per tree",
                spec.num_tree_drafts,
                spec.num_tree_draft_tokens as f64 / spec.num_tree_drafts as f64,
                spec.num_tree_accepted_tokens as f64 / spec.num_tree_drafts as f64
            );
        }
    }
}
