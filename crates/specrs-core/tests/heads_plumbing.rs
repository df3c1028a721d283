//! The head proposer's bookkeeping, with oracle heads on the real default model: a recurrent head
//! that records every context row it is handed and drafts the tokens plain greedy decoding will
//! produce, and a parallel head that recognises the hidden state it is handed among the
//! teacher-forced ones. With drafts that are always right, every draft token is accepted, so the
//! paths random heads never reach (accepted positions re-read, caches kept) run at every step; and
//! the rows a head receives must be exactly the target's hidden states of each context position,
//! once each, in order (bitwise: the CPU backend's rows do not depend on the batch). Both run again
//! with token trees (EAGLE-2's dynamic tree; the right token is every node's first child), where
//! the session gathers the accepted path's rows for the head.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};
use specrs_core::engine::Speculation;
use specrs_core::kv_cache::{KvBytes, KvCache};
use specrs_core::model::Tap;
use specrs_core::proposer::draft_model::DraftDrawing;
use specrs_core::proposer::heads::layer::TreeRows;
use specrs_core::proposer::heads::{Head, HeadProposer, ParallelHead, RecurrentHead};
use specrs_core::spec_config::{TreeConfig, TreeMode, Verification};
use specrs_core::{Engine, Result, SamplingParams};

use crate::common;

const MAX_TOKENS: usize = 32;
const K: usize = 3;
const TREE_NODES: usize = 8;

/// Logits `[1, vocab]` that pick `token`.
fn one_hot(token: u32, vocab: usize) -> Result<Tensor> {
    let mut row = vec![0f32; vocab];
    row[token as usize] = 10.0;
    Ok(Tensor::from_vec(row, (1, vocab), &Device::Cpu)?)
}

/// Drafts `sequence` (the prompt and plain greedy decoding's output): its output "hidden state"
/// is the row's position p, whose logits pick `sequence[p + 2]` (row p pairs the target's state
/// at p with token p + 1, and predicts the token after that).
struct OracleRecurrent {
    sequence: Vec<u32>,
    vocab: usize,
    seen: Mutex<Vec<Extended>>,
}

/// What one `extend` was handed: its first position, the rows `[n, hidden]` flattened, and the
/// token after each row.
type Extended = (usize, Vec<f32>, Vec<u32>);

impl OracleRecurrent {
    fn positions(start: usize, n: usize) -> Result<Tensor> {
        let p: Vec<f32> = (start..start + n).map(|p| p as f32).collect();
        Ok(Tensor::from_vec(p, (n, 1), &Device::Cpu)?)
    }
}

impl RecurrentHead for OracleRecurrent {
    fn taps(&self) -> Vec<Tap> {
        vec![Tap::FinalNorm]
    }

    fn new_caches(&self, capacity: usize, _: &Arc<KvBytes>) -> Result<Vec<KvCache>> {
        Ok(vec![KvCache::on_device(1, 1, 1, capacity, 1 << 16, DType::F32, &Device::Cpu)?])
    }

    fn extend(&self, caches: &mut [KvCache], hidden: &Tensor, next: &[u32], start: usize) -> Result<Tensor> {
        let n = hidden.dim(0)?;
        assert_eq!(caches[0].len(), start, "the head's cache holds exactly the positions read before");
        caches[0].reserve(n)?;
        let zeros = Tensor::zeros((1, n, 1), DType::F32, &Device::Cpu)?;
        caches[0].append_tensors(0, &zeros, &zeros)?;
        caches[0].commit(n);
        self.seen.lock().unwrap().push((start, hidden.flatten_all()?.to_vec1()?, next.to_vec()));
        Self::positions(start, n)
    }

    fn step(&self, caches: &mut [KvCache], _: &Tensor, _: u32, _: usize, position: usize) -> Result<Tensor> {
        assert_eq!(caches[0].len(), position, "a draft row follows the rows before it");
        caches[0].reserve(1)?;
        let zeros = Tensor::zeros((1, 1, 1), DType::F32, &Device::Cpu)?;
        caches[0].append_tensors(0, &zeros, &zeros)?;
        caches[0].commit(1);
        Self::positions(position, 1)
    }

    fn drafts_trees(&self) -> bool {
        true
    }

    fn step_tree(
        &self,
        caches: &mut [KvCache],
        _: &Tensor,
        tokens: &[u32],
        _: usize,
        rows: &TreeRows,
    ) -> Result<Tensor> {
        let (n, past) = (tokens.len(), caches[0].len());
        assert!(rows.context <= past && rows.positions.len() == n, "tree rows follow the context");
        assert!(
            rows.ancestors.iter().flatten().all(|&a| (rows.context..past).contains(&a)),
            "ancestors are draft rows"
        );
        caches[0].reserve(n)?;
        let zeros = Tensor::zeros((1, n, 1), DType::F32, &Device::Cpu)?;
        caches[0].append_tensors(0, &zeros, &zeros)?;
        caches[0].commit(n);
        let p: Vec<f32> = rows.positions.iter().map(|&p| p as f32).collect();
        Ok(Tensor::from_vec(p, (n, 1), &Device::Cpu)?)
    }

    fn context_row_share(&self) -> f64 {
        1.0
    }

    /// `[n, vocab]`: row i picks the token two after its position.
    fn logits(&self, hidden: &Tensor, _: usize) -> Result<Tensor> {
        let rows = hidden.flatten_all()?.to_vec1::<f32>()?;
        let rows: Vec<Tensor> = rows
            .iter()
            .map(|&p| one_hot(self.sequence.get(p as usize + 2).copied().unwrap_or(0), self.vocab))
            .collect::<Result<_>>()?;
        Ok(Tensor::cat(&rows, 0)?)
    }
}

/// Recognises which position's teacher-forced final hidden state it is handed (bitwise) and
/// drafts the tokens that follow it in `sequence`.
struct OracleParallel {
    sequence: Vec<u32>,
    /// `[sequence.len(), hidden]` teacher-forced final-normed rows.
    hidden: Vec<Vec<f32>>,
    vocab: usize,
}

impl ParallelHead for OracleParallel {
    fn tap(&self) -> Tap {
        Tap::FinalNorm
    }

    fn num_heads(&self) -> usize {
        K
    }

    fn step(&self, i: usize, state: &Tensor, _: u32) -> Result<(Tensor, Tensor)> {
        let row = state.flatten_all()?.to_vec1::<f32>()?;
        let p = self.hidden.iter().position(|h| *h == row).expect("the state is a target hidden row, bitwise");
        Ok((one_hot(self.sequence.get(p + 2 + i).copied().unwrap_or(0), self.vocab)?, state.clone()))
    }
}

/// Chains of K, or trees K deep of up to `TREE_NODES` nodes with 3 children per node.
fn speculation(head: Head, engine: &Engine, tree: bool) -> Speculation {
    let vocab = engine.model().info().vocab_size;
    Speculation {
        method: "oracle",
        num_speculative_tokens: if tree { TREE_NODES } else { K },
        proposer: Box::new(HeadProposer::new(head, "oracle", vocab, DraftDrawing::COUPLED, Arc::default())),
        draft_length: None,
        tree: if tree {
            TreeConfig { mode: TreeMode::On, max_depth: K, max_children: 3, static_tree: None }
        } else {
            TreeConfig::off()
        },
        tree_chooser: None,
        schedule: None,
        draft_confidence_threshold: 0.0,
        grammar_drafts: true,
        one_hot_drafts: false,
        verification: Verification::Coupled,
        verify_cost_source: None,
        draft_cost_source: None,
        acceptance_recorder: None,
    }
}

#[test]
fn oracle_heads_get_every_draft_accepted_and_read_each_position_once() {
    let engine = Engine::load(common::smollm2_path(), "cpu").unwrap();
    let vocab = engine.model().info().vocab_size;
    let prompt = engine.tokenizer().encode("Speculative decoding drafts tokens that the model checks", false).unwrap();
    let params =
        SamplingParams { max_tokens: MAX_TOKENS, temperature: 0.0, ignore_eos: true, ..SamplingParams::default() };
    let plain = engine.generate(prompt.clone(), params.clone(), None).unwrap().token_ids;
    let sequence: Vec<u32> = prompt.iter().chain(&plain).copied().collect();
    let hidden = engine.hidden_states(&sequence, &[Tap::FinalNorm]).unwrap().remove(0);
    let width = engine.model().info().hidden_size;
    let rows: Vec<Vec<f32>> = hidden.chunks(width).map(<[f32]>::to_vec).collect();

    for tree in [false, true] {
        let recurrent = Arc::new(OracleRecurrent { sequence: sequence.clone(), vocab, seen: Mutex::default() });
        let parallel = Arc::new(OracleParallel { sequence: sequence.clone(), hidden: rows.clone(), vocab });
        for (name, head) in [("recurrent", Head::Recurrent(recurrent.clone())), ("parallel", Head::Parallel(parallel))]
        {
            let name = format!("{name}{}", if tree { " tree" } else { "" });
            let out = engine.generate(prompt.clone(), params.clone(), Some(speculation(head, &engine, tree))).unwrap();
            assert_eq!(out.token_ids, plain, "{name}");
            let spec = &out.metrics.spec;
            if tree {
                // Each tree's first path is right and as deep as the tree: all of it passes.
                assert!(spec.num_tree_drafts == spec.num_drafts && spec.num_drafts > 0, "{name}: {spec:?}");
                assert_eq!(spec.num_tree_accepted_tokens, spec.tree_depth_sum, "{name}: {spec:?}");
                assert!(spec.num_draft_tokens > spec.num_accepted_tokens, "{name}: the trees had siblings");
            } else {
                assert_eq!(spec.num_accepted_tokens, spec.num_draft_tokens, "{name}: an oracle's drafts all pass");
            }
            // Each step keeps K + 1 tokens, so the request takes about MAX_TOKENS / (K + 1) steps.
            assert!(spec.num_drafts <= MAX_TOKENS.div_ceil(K + 1) + 1, "{name}: {} drafts", spec.num_drafts);
        }

        // The recurrent head read positions 0.. in order, each once, each the target's own hidden
        // state of that position paired with the token after it.
        let mut next_position = 0;
        for (start, flat, next) in recurrent.seen.lock().unwrap().iter() {
            assert_eq!(*start, next_position, "rows arrive without gaps or overlap (tree: {tree})");
            for (i, row) in flat.chunks(width).enumerate() {
                assert!(row == rows[start + i].as_slice(), "position {}: not the target's hidden state", start + i);
                assert_eq!(next[i], sequence[start + i + 1]);
            }
            next_position += next.len();
        }
        assert!(
            next_position >= prompt.len() + MAX_TOKENS - K - 2,
            "the head read the whole request ({next_position})"
        );
    }
}
