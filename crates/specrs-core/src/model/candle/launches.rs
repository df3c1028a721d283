//! The candle decoder's launch budget, counted on the CPU through the code the GPU runs: every op
//! that launches a kernel on CUDA writes a fresh output buffer (or, in place, the KV pool), so a
//! layer's launches are the buffers its ops write. The process's allocator
//! (`constraint/call_memory.rs`) counts, under test, the allocations of at least [`MIN_BUFFER`]
//! bytes on the calling thread — candle's CPU ops
//! allocate their output there, while views, shapes and tensor handles stay far smaller, and
//! ops whose CPU internals allocate what their launch does not (candle's CPU matmul packs its
//! operands) and the one in-place op (the paged KV write) are counted as one launch each where
//! they are dispatched (`call_memory::count_as`). Uploads are counted where the decoder makes
//! them (`model::candle::upload`).
//!
//! Invariant: a budget here only goes down; a new op in the decoder's step fails the test that
//! covers its path, with the count it reached.

use std::cell::Cell;

use candle_core::{DType, Device};

use crate::constraint::call_memory::{buffers_allocated, count_as};
use crate::kv_cache::KvCache;
use crate::model::candle::decoder::{Decoder, WeightFormat};
use crate::model::candle::UPLOADS;
use crate::model::config::DecoderConfig;
use crate::model::forward::{ForwardBatch, SeqRows, Tap};
use crate::model::llama_config::LlamaConfig;
use crate::model::{CausalLm, LogitRows};

/// The smallest output any op of the test model's step writes is 2 KiB (attention's, bf16, at
/// 4 rows); tensor handles, shapes and the step's descriptor are well under 1 KiB.
const MIN_BUFFER: usize = 1024;

/// `(family, launches per layer, launches outside the layers)` of a decode or verify step over a
/// paged device pool (issue 42's goal: 8 per layer). A layer: 4 GEMMs (q/k/v, o, gate/up,
/// down), the attention (writing the step's keys and values into their slots, k normed where the
/// family norms it and rotated, straight from the projection, and normalizing and rotating each q
/// head as it loads it), `act_mul` and two `add_rms_norm`s; Gemma 3 adds its two sandwich norms. Outside: the embedding
/// gather, the first layer's norm, the logit rows' gather and final norm, the LM head and its
/// cast to f32; Gemma 3 adds its embedding scale and the final soft-cap's three ops.
const PAGED_BUDGET: [(&str, usize, usize); 3] = [("llama", 8, 6), ("qwen3", 8, 6), ("gemma3", 10, 10)];

thread_local! {
    /// Dense weights run candle's matmul on the CPU as on CUDA, not specrs' CPU kernels (whose
    /// widening and narrowing of the activations are the CPU's own buffers).
    pub(crate) static GPU_GEMMS: Cell<bool> = const { Cell::new(false) };
}

/// One GEMM: candle's CPU matmul packs its operands in buffers of its own; cuBLAS launches one
/// kernel.
pub(crate) fn one_launch<T>(gemm: impl FnOnce() -> T) -> T {
    count_as(1, gemm)
}

/// A bf16 model of `family`'s graph whose every op output is at least [`MIN_BUFFER`] bytes at 4
/// rows (Gemma 3 with its sliding window, soft-caps and scaled embedding).
pub(super) fn model(family: &str) -> Decoder {
    let config = LlamaConfig::from_json(
        r#"{"vocab_size": 97, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
            "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 256}"#,
    )
    .unwrap();
    let mut config = DecoderConfig::from_llama(&config);
    config.architecture = family.into();
    if family == "gemma3" {
        (config.sliding_window, config.sliding_layers) = (Some(8), vec![true, false, true]);
        (config.attn_logit_softcap, config.final_logit_softcap) = (Some(50.0), Some(30.0));
        (config.gelu, config.embed_scale) = (true, Some(16.0));
    }
    Decoder::random_of(config, 7, WeightFormat::Dense(DType::BF16), &Device::Cpu).unwrap()
}

/// `(launches, uploads)` of one step of `seqs` (each after a prefill of its own) run through
/// `exit_layer` layers, on paged caches when `paged`. One thread runs it all, its ops' parallel
/// loops included, so what it allocates does not depend on how rayon splits the work.
fn step_launches(model: &Decoder, seqs: &[SeqRows], exit_layer: usize, paged: bool) -> (usize, usize) {
    let one_thread = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    one_thread.install(|| {
        GPU_GEMMS.with(|gpu| gpu.set(true));
        let pool = model.new_paged_pool(16, 64).unwrap();
        let mut caches: Vec<KvCache> = seqs
            .iter()
            .map(|_| if paged { KvCache::paged(&pool, 256) } else { model.new_cache(64).unwrap() })
            .collect();
        for (s, cache) in caches.iter_mut().enumerate() {
            let prompt: Vec<u32> = (0..20 + 3 * s as u32).map(|i| (i * 13 + 1) % 97).collect();
            model.forward_rows(&prompt, cache, LogitRows::Last).unwrap();
        }
        let pasts: Vec<usize> = caches.iter().map(KvCache::len).collect();
        let mut batch = ForwardBatch::new(seqs, &pasts, Vec::<Tap>::new()).unwrap();
        batch.exit_layer = Some(exit_layer);
        let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
        model.forward_batch(&batch, &mut refs).unwrap(); // warm: the kernels' first-call scratch
        for (cache, &past) in refs.iter_mut().zip(&pasts) {
            cache.truncate(past);
        }
        let uploads = UPLOADS.with(Cell::get);
        let launches = buffers_allocated(MIN_BUFFER, || {
            model.forward_batch(&batch, &mut refs).unwrap();
        });
        GPU_GEMMS.with(|gpu| gpu.set(false));
        (launches, UPLOADS.with(Cell::get) - uploads)
    })
}

/// The steps the budget covers: decode of 4 sequences, a k = 4 verify of 4 chains, and 2 trees.
fn steps() -> Vec<(&'static str, Vec<SeqRows>)> {
    let chain = |n: u32, s: u32| SeqRows::chain((0..n).map(|i| (i * 7 + s) % 97).collect(), LogitRows::All);
    let tree = |s: u32| SeqRows::tree((0..6).map(|i| (i * 11 + s) % 97).collect(), vec![-1, 0, 0, 1, 1, 2]);
    vec![
        ("decode", (0..4).map(|s| chain(1, s)).collect()),
        ("verify k=4", (0..4).map(|s| chain(5, s)).collect()),
        ("tree verify", (0..2).map(tree).collect()),
    ]
}

/// `(per layer, outside the layers, uploads)`: a step through two layers less one through one
/// (each run's last layer ends alike), the rest, and the step's uploads.
fn layer_launches(model: &Decoder, seqs: &[SeqRows], paged: bool) -> (usize, usize, usize) {
    let ((one, _), (two, uploads)) = (step_launches(model, seqs, 1, paged), step_launches(model, seqs, 2, paged));
    (two - one, one - (two - one), uploads)
}

#[test]
fn a_paged_step_launches_within_its_budget_and_uploads_once() {
    for (family, layer_budget, outside_budget) in PAGED_BUDGET {
        let model = model(family);
        for (name, seqs) in steps() {
            let (per_layer, outside, uploads) = layer_launches(&model, &seqs, true);
            assert!(per_layer <= layer_budget, "{family} {name}: {per_layer} launches per layer > {layer_budget}");
            assert!(
                outside <= outside_budget,
                "{family} {name}: {outside} launches outside the layers > {outside_budget}"
            );
            assert_eq!(uploads, 1, "{family} {name}: a paged step uploads its descriptor alone");
        }
    }
}

/// The count is the one the budget reads: the contiguous path's per-sequence appends, casts and
/// concatenation are seen, and so are its three uploads (tokens, positions, logit rows).
#[test]
fn the_count_sees_the_contiguous_paths_extra_ops_and_uploads() {
    let model = model("llama");
    for (name, seqs) in steps() {
        let (paged, _, _) = layer_launches(&model, &seqs, true);
        let (contiguous, _, uploads) = layer_launches(&model, &seqs, false);
        assert!(contiguous >= paged + 2 * seqs.len(), "{name}: contiguous {contiguous}, paged {paged}");
        assert_eq!(uploads, 3, "{name}");
    }
}
