//! The paged KV layout (kv_cache/paged.rs) against the contiguous one: the same random script of
//! forwards (trees, chains) / truncate / keep of a random accepted path / release and refeed
//! (preemption) / share a prefix, over a few sequences at once, gives the same logits and hidden
//! states under both layouts, for block sizes 1 and 16, on the tiny GGUF model of every family
//! (tests/golden/gguf/; Gemma 3's with its sliding window) and SmolLM2 (real weights), on the CPU
//! decoder (host pool) bitwise. On the candle decoder (a device pool on the CPU, attended by
//! `paged_attention.rs` for the whole step), on the f32 HF directory of every family
//! (tests/golden/hf/), within 1e-4: the attention's f32 sums run in another order.
//! After the sequences go, every block is back in the pool; running out of blocks is a
//! `ContextLength` error naming `max_kv_tokens`, never a panic.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::Device;

use specrs_core::error::Error;
use specrs_core::gguf::GgufFile;
use specrs_core::kv_cache::{KvCache, KvLayout, PagedPool};
use specrs_core::model::candle::decoder::Decoder;
use specrs_core::model::{self, hf_dir, CausalLm, ForwardBatch, LogitRows, SeqRows, Tap};
use specrs_core::spec_config::SpeculativeConfig;
use specrs_core::{Engine, SamplingParams};

use crate::common;
use crate::common::rng::Rng;

const FAMILIES: [&str; 6] = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"];
const NUM_SEQS: usize = 3;

fn tiny(family: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../../tests/golden/gguf/{family}-q8_0.gguf"))
}

fn cpu_model(path: &Path) -> Box<dyn CausalLm> {
    model::loader::load(&mut GgufFile::open(path).unwrap(), &Device::Cpu).unwrap()
}

/// `family`'s tiny f32 Hugging Face directory.
fn tiny_hf(family: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../../tests/golden/hf/{family}"))
}

/// candle/decoder.rs on the CPU for `family`'s tiny f32 HF directory. (Its GGUF twin multiplies
/// by q8_0 weights, quantizing each activation row first, so a last-bit difference in attention
/// can move a logit by a quantization step: no tolerance to test within.)
fn candle_model(family: &str) -> Decoder {
    let (config, mut weights) = hf_dir::open(&tiny_hf(family), &Device::Cpu).unwrap();
    Decoder::from_hf(&mut weights, config).unwrap()
}

/// Logits and every tap of one forward over `caches`.
fn forward(model: &dyn CausalLm, batch: &ForwardBatch, caches: &mut [KvCache]) -> Vec<Vec<Vec<f32>>> {
    let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
    let out = model.forward_batch(batch, &mut refs).unwrap();
    std::iter::once(&out.logits).chain(&out.hidden).map(|t| t.to_vec2::<f32>().unwrap()).collect()
}

/// Two forwards' outputs agree: bitwise (`tolerance` None) or within `tolerance`.
fn assert_same(paged: &[Vec<Vec<f32>>], contiguous: &[Vec<Vec<f32>>], tolerance: Option<f32>, what: &str) {
    let flat = |x: &[Vec<Vec<f32>>]| x.iter().flatten().flatten().copied().collect::<Vec<f32>>();
    let (a, b) = (flat(paged), flat(contiguous));
    assert_eq!(a.len(), b.len(), "{what}");
    match tolerance {
        None => assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{what}: not bitwise equal"),
        Some(tolerance) => {
            let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            assert!(diff <= tolerance, "{what}: differ by {diff} > {tolerance}");
        }
    }
}

/// The script on `model` with blocks of `block_size`, checking every forward (bitwise, or within
/// `tolerance`).
fn paged_equals_contiguous(
    name: &str,
    model: &dyn CausalLm,
    block_size: usize,
    num_steps: usize,
    seed: u64,
    tolerance: Option<f32>,
) {
    let info = model.info();
    let (vocab, layers) = (info.vocab_size, info.num_layers);
    let max_len = info.context_length.min(96);
    let num_blocks = NUM_SEQS * max_len.div_ceil(block_size) + 4;
    let pool = model.new_paged_pool(block_size, num_blocks).unwrap();
    let taps = vec![Tap::Residual(layers / 2), Tap::FinalNorm];
    let mut rng = Rng(seed);
    let mut paged: Vec<KvCache> = (0..NUM_SEQS).map(|_| KvCache::paged(&pool, info.context_length)).collect();
    let mut contiguous: Vec<KvCache> = (0..NUM_SEQS).map(|_| model.new_cache(1).unwrap()).collect();
    // The tokens each sequence's cache holds, to refeed after a release.
    let mut held: Vec<Vec<u32>> = vec![Vec::new(); NUM_SEQS];
    for step in 0..num_steps {
        let what = format!("{name}, block size {block_size}, step {step}");
        let seqs: Vec<SeqRows> = (0..NUM_SEQS)
            .map(|s| {
                let n = 1 + rng.below(if held[s].is_empty() { 20 } else { 8 });
                SeqRows::tree(rng.tokens(n, vocab), rng.parents(n, 3))
            })
            .collect();
        let lens: Vec<usize> = held.iter().map(Vec::len).collect();
        let batch = ForwardBatch::new(&seqs, &lens, taps.clone()).unwrap();
        let (p, c) = (forward(model, &batch, &mut paged), forward(model, &batch, &mut contiguous));
        assert_same(&p, &c, tolerance, &format!("{what}: forward"));
        for s in 0..NUM_SEQS {
            let past = lens[s];
            match rng.below(4) {
                // A verify step: keep a random node's root-to-node path.
                0 | 1 => {
                    let path = batch.path(s, rng.below(seqs[s].tokens.len()));
                    paged[s].keep(past, &path).unwrap();
                    contiguous[s].keep(past, &path).unwrap();
                    held[s].extend(path.iter().map(|&row| seqs[s].tokens[row]));
                }
                // Rejected drafts, perhaps into the old positions (up to the tree's first row,
                // the one row after the cache every tree has).
                2 => {
                    let len = past.saturating_sub(rng.below(6)) + rng.below(2);
                    paged[s].truncate(len);
                    contiguous[s].truncate(len);
                    held[s].push(seqs[s].tokens[0]);
                    held[s].truncate(len);
                }
                _ => {
                    // Preemption: everything goes, then the held tokens are fed again.
                    let tokens: Vec<u32> = held[s].clone();
                    paged[s].release();
                    contiguous[s].release();
                    if !tokens.is_empty() {
                        let refeed = ForwardBatch::chain(&tokens, 0, LogitRows::Last).unwrap();
                        let (p, c) = (&mut paged[s..s + 1], &mut contiguous[s..s + 1]);
                        let (p, c) = (forward(model, &refeed, p), forward(model, &refeed, c));
                        assert_same(&p, &c, tolerance, &format!("{what}: refeed {s}"));
                    }
                    held[s] = tokens;
                }
            }
            assert_eq!(paged[s].len(), held[s].len(), "{what}: sequence {s}");
            assert_eq!(contiguous[s].len(), held[s].len(), "{what}: sequence {s}");
        }
        // Now and then a sequence becomes a sample of another's prompt (shared blocks).
        if rng.below(3) == 0 {
            let (from, to) = (rng.below(NUM_SEQS), rng.below(NUM_SEQS));
            if from != to {
                let len = rng.below(held[from].len() + 1);
                for caches in [&mut paged, &mut contiguous] {
                    caches[to].release();
                    let (source, target) = pair(caches, from, to);
                    target.copy_prefix_from(source, len).unwrap();
                }
                held[to] = held[from][..len].to_vec();
            }
        }
        for s in 0..NUM_SEQS {
            if held[s].len() + 8 > max_len {
                let len = rng.below(held[s].len());
                paged[s].truncate(len);
                contiguous[s].truncate(len);
                held[s].truncate(len);
            }
        }
    }
    drop(paged);
    assert_eq!(pool.num_free(), num_blocks, "{name}: every block is back in the pool");
}

/// `(&caches[a], &mut caches[b])`, `a != b`.
fn pair(caches: &mut [KvCache], a: usize, b: usize) -> (&KvCache, &mut KvCache) {
    if a < b {
        let (left, right) = caches.split_at_mut(b);
        (&left[a], &mut right[0])
    } else {
        let (left, right) = caches.split_at_mut(a);
        (&right[0], &mut left[b])
    }
}

#[test]
fn paged_equals_contiguous_on_the_tiny_families() {
    for (f, family) in FAMILIES.iter().enumerate() {
        let model = cpu_model(&tiny(family));
        for block_size in [1, 16] {
            paged_equals_contiguous(family, model.as_ref(), block_size, 24, 0x5eed + f as u64, None);
        }
    }
}

/// The candle decoder on a device pool (here the CPU device): one write and one attention op per
/// layer for the whole step, against its per-sequence contiguous path.
#[test]
fn a_device_pool_tracks_contiguous_on_the_candle_decoder() {
    for (f, family) in FAMILIES.iter().enumerate() {
        let model = candle_model(family);
        for block_size in [1, 16] {
            paged_equals_contiguous(family, &model, block_size, 16, 0xd0 + f as u64, Some(1e-4));
        }
    }
}

#[test]
fn paged_equals_contiguous_on_smollm2() {
    let model = cpu_model(&common::smollm2_path());
    for block_size in [1, 16] {
        paged_equals_contiguous("SmolLM2", model.as_ref(), block_size, 12, 0xb10c, None);
    }
}

/// Through the engine: speculative requests on a paged engine give the tokens of a contiguous
/// one and return every block; a request the pool cannot hold fails with a `ContextLength`
/// error naming max_kv_tokens, and the engine serves the next one.
#[test]
fn a_paged_engine_generates_what_a_contiguous_one_does() {
    let contiguous = Engine::load(common::smollm2_path(), "cpu").unwrap();
    let layout = KvLayout::Paged { block_size: 16, num_blocks: 8 };
    let paged = Engine::load(common::smollm2_path(), "cpu").unwrap().with_kv_layout(layout).unwrap();
    let pool: Arc<PagedPool> = paged.kv_pool().unwrap().clone();
    let text = "List the planets: Mercury, Venus, Earth, Mars. Again: Mercury, Venus, Earth, Mars. Again:";
    let prompt = paged.tokenizer().encode(text, false).unwrap();
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(24) };
    let configs = [
        None,
        Some(r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}"#),
        Some(
            r#"{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "tree": true, "tree_top_k": 3}"#,
        ),
    ];
    assert_same_tokens(&contiguous, &paged, &prompt, &params, &configs, "SmolLM2");
    let long: Vec<u32> = prompt.iter().cycle().take(8 * 16 + 1).copied().collect();
    let err = paged.generate(long, params.clone(), None).unwrap_err();
    assert!(matches!(err, Error::ContextLength(_)) && err.to_string().contains("max_kv_tokens"), "{err}");
    assert_eq!(pool.num_free(), 8);
    assert!(paged.generate(prompt, params, None).is_ok());
}

/// The candle decoder's engine on a device pool generates a contiguous engine's greedy tokens,
/// chains and trees, on every tiny family, and returns every block.
#[test]
fn a_device_paged_engine_generates_what_a_contiguous_one_does() {
    for family in FAMILIES {
        let engine = |layout: Option<KvLayout>| {
            let engine = Engine::load(tiny_hf(family), "cpu").unwrap();
            match layout {
                Some(layout) => engine.with_kv_layout(layout).unwrap(),
                None => engine,
            }
        };
        let contiguous = engine(None);
        let paged = engine(Some(KvLayout::Paged { block_size: 16, num_blocks: 16 }));
        let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(20) };
        let configs = [
            None,
            Some(r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}"#),
            Some(
                r#"{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "tree": true, "tree_top_k": 2}"#,
            ),
        ];
        assert_same_tokens(&contiguous, &paged, &[5, 9, 13, 5, 9, 13, 5, 9], &params, &configs, family);
    }
}

/// Each speculative config (None: plain decoding) makes `paged` generate from `prompt` the tokens
/// `contiguous` does, and every block of `paged`'s pool is back after each request.
fn assert_same_tokens(
    contiguous: &Engine,
    paged: &Engine,
    prompt: &[u32],
    params: &SamplingParams,
    configs: &[Option<&str>],
    what: &str,
) {
    let pool = paged.kv_pool().expect("a paged engine");
    for config in configs {
        let speculation = |engine: &Engine| {
            config.map(|c| engine.speculation(&SpeculativeConfig::from_json(c).unwrap(), None).unwrap())
        };
        let want = contiguous.generate(prompt.to_vec(), params.clone(), speculation(contiguous)).unwrap();
        let got = paged.generate(prompt.to_vec(), params.clone(), speculation(paged)).unwrap();
        assert_eq!(got.token_ids, want.token_ids, "{what} {config:?}");
        assert_eq!(pool.num_free(), pool.num_blocks(), "{what} {config:?}: the request returned its blocks");
    }
}
