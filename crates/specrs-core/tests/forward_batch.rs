//! The forward contract's properties (model/forward.rs), the ones losslessness stands on, as
//! property tests over random batch compositions and tree shapes:
//! - invariance: a row's logits and hidden states are the same whatever else is in the forward
//!   (alone, beside 1-15 other sequences of random lengths, as a tree node, in a chain);
//! - a tree node's logits equal those of its root-to-node path run as a chain;
//! - `KvCache::keep` of a path leaves the cache a forward on that path alone builds;
//! - the `FinalNorm` tap through `lm_head` reproduces the logits.
//!
//! Bitwise on the CPU backend (`cpu/decoder.rs`): SmolLM2 (real weights) and the tiny GGUF model
//! of every family (tests/golden/gguf/, Gemma 3's with its sliding window), and the candle
//! backend (`candle/decoder.rs`) on the same GGUF files and the tiny HF safetensors models.
//! (Gemma 3 270M's real weights are checked through `Engine.forward_batch` in
//! tests/test_forward_batch.py, where its packaged file is found.)

use std::path::PathBuf;

use candle_core::{Device, Tensor};
use specrs_core::gguf::GgufFile;
use specrs_core::kv_cache::KvCache;
use specrs_core::model::candle::decoder::Decoder;
use specrs_core::model::{self, families, hf_dir, CausalLm, ForwardBatch, LogitRows, SeqRows, Tap};

use crate::common;
use crate::common::rng::Rng;

const FAMILIES: [&str; 6] = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"];

fn golden(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden").join(path)
}

/// The backend `model::load` picks on the CPU (cpu/decoder.rs for GGUF).
fn cpu_model(path: &PathBuf) -> Box<dyn CausalLm> {
    model::loader::load(&mut GgufFile::open(path).unwrap(), &Device::Cpu).unwrap()
}

fn candle_gguf_model(path: &PathBuf) -> Box<dyn CausalLm> {
    let mut gguf = GgufFile::open(path).unwrap();
    let architecture = gguf.get_str("general.architecture").unwrap().to_string();
    let config = families::from_gguf(&mut gguf, &architecture).unwrap();
    Box::new(Decoder::from_gguf(&mut gguf, config, &Device::Cpu).unwrap())
}

fn candle_hf_model(family: &str) -> Box<dyn CausalLm> {
    let (config, mut weights) = hf_dir::open(&golden(&format!("hf/{family}")), &Device::Cpu).unwrap();
    Box::new(Decoder::from_hf(&mut weights, config).unwrap())
}

fn taps(model: &dyn CausalLm) -> Vec<Tap> {
    let layers = model.info().num_layers;
    vec![Tap::Residual(0), Tap::Residual(layers / 2), Tap::Residual(layers), Tap::FinalNorm]
}

/// One sequence of a test batch: its prefix (already in its cache) and its new rows.
struct Seq {
    prefix: Vec<u32>,
    rows: SeqRows,
}

impl Seq {
    fn random(rng: &mut Rng, vocab: usize, max_prefix: usize, max_new: usize) -> Self {
        let n = 1 + rng.below(max_new);
        let rows = SeqRows::tree(rng.tokens(n, vocab), rng.parents(n, 4));
        let prefix_len = rng.below(max_prefix + 1);
        Self { prefix: rng.tokens(prefix_len, vocab), rows }
    }
}

fn prefilled(model: &dyn CausalLm, prefix: &[u32]) -> KvCache {
    let mut cache = model.new_cache(prefix.len() + 16).unwrap();
    if !prefix.is_empty() {
        model.forward_rows(prefix, &mut cache, LogitRows::None).unwrap();
    }
    cache
}

/// Per sequence: its logit rows `[rows, vocab]` and per tap its hidden rows `[rows, hidden]`.
type SeqOut = (Vec<Vec<f32>>, Vec<Vec<Vec<f32>>>);

/// One forward over `seqs` (each cache prefilled with its prefix), split back per sequence.
fn run(model: &dyn CausalLm, seqs: &[&SeqRows], prefixes: &[&[u32]], taps: &[Tap]) -> Vec<SeqOut> {
    let mut caches: Vec<KvCache> = prefixes.iter().map(|p| prefilled(model, p)).collect();
    let lens: Vec<usize> = caches.iter().map(KvCache::len).collect();
    let owned: Vec<SeqRows> = seqs.iter().map(|s| (*s).clone()).collect();
    let batch = ForwardBatch::new(&owned, &lens, taps.to_vec()).unwrap();
    let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
    let out = model.forward_batch(&batch, &mut refs).unwrap();
    let logits = out.logits.to_vec2::<f32>().unwrap();
    let hidden: Vec<Vec<Vec<f32>>> = out.hidden.iter().map(|h| h.to_vec2::<f32>().unwrap()).collect();
    let mut logit_at = 0;
    (0..batch.num_seqs())
        .map(|s| {
            let num_logits = seqs[s].logit_rows.len();
            let seq_logits = logits[logit_at..logit_at + num_logits].to_vec();
            logit_at += num_logits;
            let seq_hidden = hidden.iter().map(|h| h[batch.seq_range(s)].to_vec()).collect();
            (seq_logits, seq_hidden)
        })
        .collect()
}

/// Largest |a - b| over two row sets of the same shape.
fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter().zip(b).flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs())).fold(0.0, f32::max)
}

fn assert_bitwise(what: &str, a: &[Vec<f32>], b: &[Vec<f32>]) {
    let same = a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()));
    assert!(same, "{what}: not bitwise equal (max |diff| {})", max_diff(a, b));
}

fn assert_same(what: &str, got: &SeqOut, want: &SeqOut) {
    assert_bitwise(&format!("{what} logits"), &got.0, &want.0);
    for (tap, (g, w)) in got.1.iter().zip(&want.1).enumerate() {
        assert_bitwise(&format!("{what} tap {tap}"), g, w);
    }
}

/// Every property on `model`, bitwise.
fn check_properties(name: &str, model: &dyn CausalLm, rounds: usize, seed: u64) {
    let mut rng = Rng(seed);
    let vocab = model.info().vocab_size;
    let taps = taps(model);
    for round in 0..rounds {
        // Invariance: each sequence alone, then inside a batch with 1-15 others.
        let num_seqs = 2 + rng.below(15);
        let seqs: Vec<Seq> = (0..num_seqs).map(|_| Seq::random(&mut rng, vocab, 40, 8)).collect();
        let rows: Vec<&SeqRows> = seqs.iter().map(|s| &s.rows).collect();
        let prefixes: Vec<&[u32]> = seqs.iter().map(|s| s.prefix.as_slice()).collect();
        let together = run(model, &rows, &prefixes, &taps);
        for (s, seq) in seqs.iter().enumerate() {
            let alone = run(model, &[&seq.rows], &[&seq.prefix], &taps);
            let what = format!("{name} round {round}: sequence {s} of {num_seqs} (prefix {})", seq.prefix.len());
            assert_same(&what, &together[s], &alone[0]);
        }

        // A tree node equals its root-to-node path as a chain; the path kept in the cache then
        // continues as a cache built from the path alone.
        let seq = &seqs[0];
        let batch = ForwardBatch::new(std::slice::from_ref(&seq.rows), &[seq.prefix.len()], vec![]).unwrap();
        let node = rng.below(seq.rows.tokens.len());
        let path = batch.path(0, node);
        let path_tokens: Vec<u32> = path.iter().map(|&i| seq.rows.tokens[i]).collect();
        let tree = run(model, &[&seq.rows], &[&seq.prefix], &taps);
        let chain = run(model, &[&SeqRows::chain(path_tokens.clone(), LogitRows::All)], &[&seq.prefix], &taps);
        let pick = |out: &SeqOut, row: usize| -> SeqOut {
            (vec![out.0[row].clone()], out.1.iter().map(|h| vec![h[row].clone()]).collect())
        };
        let what = format!("{name} round {round}: tree node {node} vs its path {path:?}");
        assert_same(&what, &pick(&tree[0], node), &pick(&chain[0], path.len() - 1));

        let num_next = 1 + rng.below(3);
        let next = rng.tokens(num_next, vocab);
        let mut kept = prefilled(model, &seq.prefix);
        model.forward_batch(&batch, &mut [&mut kept]).unwrap();
        kept.keep(seq.prefix.len(), &path).unwrap();
        let mut fresh = prefilled(model, &[seq.prefix.clone(), path_tokens].concat());
        assert_eq!(kept.len(), fresh.len());
        let after_keep = model.forward(&next, &mut kept).unwrap().to_vec2::<f32>().unwrap();
        let after_fresh = model.forward(&next, &mut fresh).unwrap().to_vec2::<f32>().unwrap();
        let what = format!("{name} round {round}: forward after keep({path:?})");
        assert_bitwise(&what, &after_keep, &after_fresh);

        // The final-norm tap through the LM head is the logits; a vocabulary subset is their columns.
        let final_norm = Tensor::new(together[0].1[3].clone(), &Device::Cpu).unwrap();
        let head = model.lm_head(&final_norm, None).unwrap().to_vec2::<f32>().unwrap();
        assert_bitwise(&format!("{name}: lm_head(final norm)"), &head, &together[0].0);
        let subset = [3u32, 0, (vocab - 1) as u32];
        let sub = model.lm_head(&final_norm, Some(&subset)).unwrap().to_vec2::<f32>().unwrap();
        for (row, full) in sub.iter().zip(&head) {
            assert_eq!(row, &subset.iter().map(|&t| full[t as usize]).collect::<Vec<_>>());
        }
    }
}

#[test]
fn cpu_backend_is_bitwise_invariant_on_smollm2() {
    let model = cpu_model(&common::smollm2_path());
    check_properties("smollm2", model.as_ref(), 3, 17);
}

#[test]
fn cpu_backend_is_bitwise_invariant_on_every_tiny_family() {
    for (i, family) in FAMILIES.iter().enumerate() {
        let model = cpu_model(&golden(&format!("gguf/{family}-q8_0.gguf")));
        check_properties(family, model.as_ref(), 4, 100 + i as u64);
    }
}

/// On the CPU the candle backend runs specrs' kernels for Q8_0 and for dense weights
/// (`kernels/dense.rs`; candle's own gemm blocked dense matrices by shape, up to 1.5e-6 of the
/// largest value apart on these models), so it too is bitwise.
#[test]
fn candle_backend_is_bitwise_invariant_on_the_cpu() {
    for (i, family) in FAMILIES.iter().enumerate() {
        let gguf = candle_gguf_model(&golden(&format!("gguf/{family}-q8_0.gguf")));
        check_properties(&format!("{family} (candle, gguf)"), gguf.as_ref(), 2, 200 + i as u64);
        let hf = candle_hf_model(family);
        check_properties(&format!("{family} (candle, hf)"), hf.as_ref(), 2, 300 + i as u64);
    }
}

/// Early exit through the contract: the first blocks only, their caches written, the hidden
/// states of the blocks run available and the others refused.
#[test]
fn early_exit_runs_the_first_blocks_only() {
    let model = cpu_model(&golden("gguf/llama-q8_0.gguf"));
    let layers = model.info().num_layers;
    let tokens = [5u32, 9, 2];
    let mut full = model.new_cache(8).unwrap();
    let mut batch = ForwardBatch::chain(&tokens, 0, LogitRows::All).unwrap();
    batch.taps = vec![Tap::Residual(1)];
    let whole = model.forward_batch(&batch, &mut [&mut full]).unwrap();
    batch.exit_layer = Some(1);
    let mut early = model.new_cache(8).unwrap();
    let exited = model.forward_batch(&batch, &mut [&mut early]).unwrap();
    assert_eq!(whole.hidden[0].to_vec2::<f32>().unwrap(), exited.hidden[0].to_vec2::<f32>().unwrap());
    assert_eq!(early.len(), 3);
    batch.taps = vec![Tap::Residual(2)];
    let err = model.forward_batch(&batch, &mut [&mut model.new_cache(8).unwrap()]).unwrap_err();
    assert!(err.to_string().contains("0..=1"), "{err}");
    assert!(layers >= 2);
}
