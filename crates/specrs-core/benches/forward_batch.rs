//! The batched forward against the forwards it replaces, on real GGUF models:
//! `cargo bench -p specrs-core --bench forward_batch -- NAME=PATH... [--out FILE.json]`
//! (benches/README.md has the command that finds SmolLM2 and Gemma 3 270M).
//!
//! - decode: B sequences, each with 512 tokens of its own context, decode one token each, as ONE
//!   batched forward (`forward_batch` over B caches) and as B separate single-sequence forwards;
//!   tokens/s of each, B in {1, 2, 4, 8, 16}. Every cache is truncated back to its context after
//!   each step, so all steps run at 512 tokens.
//! - tree: one forward over a token tree of n nodes (random shape, seeded) against a chain of n,
//!   both after a 512-token cache; n in {4, 8, 16, 32}.
//!
//! The two sides run in turn, A B A B, ROUNDS times, and each figure is the median; the ratio is
//! taken per round. Timings use the machine's cores as candle's pool does (all of them).

use std::time::Instant;

use candle_core::Device;
use specrs_core::gguf::GgufFile;
use specrs_core::kv_cache::KvCache;
use specrs_core::model::{self, CausalLm, ForwardBatch, LogitRows, SeqRows};

const CONTEXT: usize = 512;
const BATCH_SIZES: [usize; 5] = [1, 2, 4, 8, 16];
const TREE_SIZES: [usize; 4] = [4, 8, 16, 32];
const STEPS: usize = 8;
const ROUNDS: usize = 5;

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n as u64) as usize
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn prefilled(model: &dyn CausalLm, rng: &mut Rng) -> KvCache {
    let vocab = model.info().vocab_size;
    let context: Vec<u32> = (0..CONTEXT).map(|_| rng.below(vocab) as u32).collect();
    let mut cache = model.new_cache(CONTEXT + 64).unwrap();
    model.forward_rows(&context, &mut cache, LogitRows::None).unwrap();
    cache
}

/// Seconds for `STEPS` decode steps of every cache: one batched forward per step, or one forward
/// per sequence per step.
fn decode_s(model: &dyn CausalLm, caches: &mut [KvCache], batched: bool, rng: &mut Rng) -> f64 {
    let vocab = model.info().vocab_size;
    let t0 = Instant::now();
    for _ in 0..STEPS {
        let tokens: Vec<u32> = caches.iter().map(|_| rng.below(vocab) as u32).collect();
        if batched {
            let seqs: Vec<SeqRows> = tokens.iter().map(|&t| SeqRows::chain(vec![t], LogitRows::All)).collect();
            let lens: Vec<usize> = caches.iter().map(KvCache::len).collect();
            let batch = ForwardBatch::new(&seqs, &lens, vec![]).unwrap();
            let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
            model.forward_batch(&batch, &mut refs).unwrap();
        } else {
            for (cache, &token) in caches.iter_mut().zip(&tokens) {
                model.forward_rows(&[token], cache, LogitRows::All).unwrap();
            }
        }
        caches.iter_mut().for_each(|cache| cache.truncate(CONTEXT));
    }
    t0.elapsed().as_secs_f64()
}

fn tree_s(model: &dyn CausalLm, cache: &mut KvCache, rows: &SeqRows) -> f64 {
    let batch = ForwardBatch::new(std::slice::from_ref(rows), &[cache.len()], vec![]).unwrap();
    let t0 = Instant::now();
    model.forward_batch(&batch, &mut [cache]).unwrap();
    let elapsed = t0.elapsed().as_secs_f64();
    cache.truncate(CONTEXT);
    elapsed
}

fn bench(name: &str, model: &dyn CausalLm) -> serde_json::Value {
    let mut rng = Rng(0x5eed);
    let mut decode = Vec::new();
    for &b in &BATCH_SIZES {
        let mut caches: Vec<KvCache> = (0..b).map(|_| prefilled(model, &mut rng)).collect();
        decode_s(model, &mut caches, true, &mut rng); // warm-up
        let (mut batched, mut separate, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let tb = decode_s(model, &mut caches, true, &mut rng);
            let ts = decode_s(model, &mut caches, false, &mut rng);
            batched.push((b * STEPS) as f64 / tb);
            separate.push((b * STEPS) as f64 / ts);
            ratios.push(ts / tb);
        }
        let row = serde_json::json!({
            "batch_size": b,
            "batched_tokens_per_s": median(batched),
            "separate_tokens_per_s": median(separate),
            "speedup": median(ratios),
        });
        println!("{name} decode B={b:2}: {row}");
        decode.push(row);
    }
    let mut trees = Vec::new();
    let vocab = model.info().vocab_size;
    let mut cache = prefilled(model, &mut rng);
    for &n in &TREE_SIZES {
        let tokens: Vec<u32> = (0..n).map(|_| rng.below(vocab) as u32).collect();
        let parents: Vec<i32> = (0..n).map(|i| if i == 0 { -1 } else { rng.below(i) as i32 }).collect();
        let tree = SeqRows::tree(tokens.clone(), parents);
        let chain = SeqRows::chain(tokens, LogitRows::All);
        tree_s(model, &mut cache, &tree); // warm-up
        let (mut tree_t, mut chain_t, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let t = tree_s(model, &mut cache, &tree);
            let c = tree_s(model, &mut cache, &chain);
            tree_t.push(t);
            chain_t.push(c);
            ratios.push(t / c);
        }
        let row = serde_json::json!({
            "num_nodes": n,
            "tree_s": median(tree_t),
            "chain_s": median(chain_t),
            "tree_over_chain": median(ratios),
        });
        println!("{name} tree n={n:2}: {row}");
        trees.push(row);
    }
    serde_json::json!({ "model": name, "context": CONTEXT, "decode": decode, "tree": trees })
}

fn main() {
    let mut out_path = None;
    let mut models = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--out" {
            out_path = args.next();
        } else if let Some((name, path)) = arg.split_once('=') {
            models.push((name.to_string(), path.to_string()));
        }
        // Anything else is cargo's own (`--bench`).
    }
    assert!(!models.is_empty(), "usage: forward_batch NAME=MODEL.gguf... [--out FILE.json]");
    let results: Vec<serde_json::Value> = models
        .iter()
        .map(|(name, path)| {
            let model = model::loader::load(&mut GgufFile::open(path).unwrap(), &Device::Cpu).unwrap();
            bench(name, model.as_ref())
        })
        .collect();
    let report = serde_json::json!({
        "threads": candle_core::utils::get_num_threads(),
        "steps_per_round": STEPS,
        "rounds": ROUNDS,
        "results": results,
    });
    if let Some(path) = out_path {
        std::fs::write(&path, serde_json::to_string_pretty(&report).unwrap()).unwrap();
        println!("wrote {path}");
    }
}
