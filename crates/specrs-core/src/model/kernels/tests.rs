//! Every kernel set this CPU runs against the reference set: quantized matmuls on random weights
//! of every `Format` (through `QLinear`, so each set's own dispatch is what runs), attention and
//! the exp loops; and `SPECRS_CPU_KERNELS`'s choices.
//!
//! Tolerances are the kernels' own documented ones: bitwise where a set keeps the reference's
//! summation order (Q5_0, Q8_0, Q4_K, Q6_K, attention, exp), 1e-4 relative for AVX2's Q4_0/Q4_1
//! (`qlinear.rs`'s test), and for repacked weights bitwise `repack::reference_dot` (their scalar
//! twin) plus, against the reference set, the activation-rounding bound of `repack.rs`'s test.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use half::f16;

use super::attention::{Attention, HeadShape, RowView};
use super::format::{Format, BLOCK};
use super::qlinear::QLinear;
use super::repack::{reference_dot, scalar_quantize, QuantizedActivations};
use super::{available_sets, choose, reference, KernelSet, CANDIDATES};
use crate::kv_cache::Slots;

const FORMATS: [(GgmlDType, Format); 6] = [
    (GgmlDType::Q4_0, Format::Q4_0),
    (GgmlDType::Q4_1, Format::Q4_1),
    (GgmlDType::Q5_0, Format::Q5_0),
    (GgmlDType::Q8_0, Format::Q8_0),
    (GgmlDType::Q4K, Format::Q4K),
    (GgmlDType::Q6K, Format::Q6K),
];

/// Reproducible values in [-1, 1) with an outlier every 97 (an LCG; `repack.rs`'s tests too).
pub(super) fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|i| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let v = ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            if i % 97 == 0 {
                v * 8.0
            } else {
                v
            }
        })
        .collect()
}

/// Σ |w_i| * (half an int8 step of x_i's 32-value block): how far int8 activations can move a
/// dot product (`repack.rs`'s bound).
fn activation_bound(weights: &[f32], xs: &[f32]) -> f32 {
    let steps =
        xs.chunks(BLOCK).flat_map(|c| std::iter::repeat_n(c.iter().fold(0f32, |m, v| m.max(v.abs())) / 254.0, BLOCK));
    weights.iter().zip(steps).map(|(w, step)| w.abs() * step).sum()
}

#[test]
fn every_set_gives_the_reference_sets_matmuls_on_every_format() {
    // 72 rows: a multiple of 8 (packed sets repack it); 70: not (every set reads the weights in
    // place, with its own dots); 512 inputs: two K-quant super-blocks.
    let in_f = 512;
    for ((dtype, format), out_f) in FORMATS.into_iter().flat_map(|f| [(f, 72), (f, 70)]) {
        let w = Tensor::from_vec(random(out_f * in_f, 7), (out_f, in_f), &Device::Cpu).unwrap();
        let q = Arc::new(QTensor::quantize(&w, dtype).unwrap());
        let ggml = q.data().unwrap().into_owned();
        let dense: Vec<f32> = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let row_bytes = ggml.len() / out_f;
        let reference = QLinear::with_kernels(q.clone(), &reference::KERNELS).unwrap();
        for set in available_sets() {
            let linear = QLinear::with_kernels(q.clone(), set).unwrap();
            let repacked = matches!(linear, QLinear::Repacked { .. });
            assert_eq!(
                repacked,
                set.packed.is_some() && out_f % 8 == 0,
                "{}: repacks its weights iff it has packed kernels and whole tiles",
                set.name
            );
            // 1 row: decoding (`qdot_features`); 3 and 9: verification groups (9 > ROW_GROUP).
            for num_rows in [1, 3, 9] {
                let x = random(num_rows * in_f, 100 + num_rows as u64);
                let ours = linear.forward_rows(&x, num_rows).unwrap();
                let want = reference.forward_rows(&x, num_rows).unwrap();
                let acts = QuantizedActivations::new(&x, num_rows, in_f, scalar_quantize);
                for (i, (&a, &b)) in ours.iter().zip(&want).enumerate() {
                    let (row, f) = (i / out_f, i % out_f);
                    let what = format!("{} {format:?} rows={num_rows} row {row} feature {f}: {a} vs {b}", set.name);
                    if repacked {
                        let twin = reference_dot(format, &ggml[f * row_bytes..][..row_bytes], &acts, row);
                        assert_eq!(a, twin, "{what} (packed twin {twin})");
                        // Both round the activations to int8 (different blocks for Q8_K): each
                        // within its rounding of the exact product, so of each other.
                        let xs = &x[row * in_f..][..in_f];
                        let bound = activation_bound(&dense[f * in_f..][..in_f], xs);
                        let k_bound = if matches!(format, Format::Q4K | Format::Q6K) { 8.0 * bound } else { bound };
                        assert!((a - b).abs() <= bound + k_bound + 1e-3 * (1.0 + b.abs()), "{what}");
                    } else if matches!(format, Format::Q4_0 | Format::Q4_1) {
                        assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{what}");
                    } else {
                        assert_eq!(a, b, "{what}");
                    }
                }
            }
        }
    }
}

#[test]
fn every_set_gives_the_reference_sets_attention_and_exps() {
    let to_f16 = |x: Vec<f32>| x.into_iter().map(f16::from_f32).collect::<Vec<_>>();
    // 64 and 8: the vector kernels; 12: the reference's tail path, whatever the set.
    for head_dim in [64, 8, 12] {
        let shape = HeadShape { num_heads: 4, num_kv_heads: 2, head_dim };
        let attention = Attention { shape, scale: 0.125, window: Some(6) };
        let (past, n, kv_width) = (5, 4, 2 * head_dim);
        let q: Vec<f32> = random(n * 4 * head_dim, 1).iter().map(|v| v * 0.5).collect();
        let (k, v) = (to_f16(random((past + n) * kv_width, 2)), to_f16(random((past + n) * kv_width, 3)));
        // A chain and a tree node (the cache, then slots 7 and 8 as its ancestors and itself).
        let extra = [7, 8];
        let kv = Slots::Identity { k: &k, v: &v };
        let mut rows: Vec<RowView> = (0..n).map(|i| RowView { kv: &kv, prefix: past + i + 1, extra: &[] }).collect();
        rows[n - 1] = RowView { kv: &kv, prefix: past, extra: &extra };
        let want = attention.forward_rows_with(&reference::KERNELS, &q, &rows).unwrap();
        for set in available_sets() {
            assert_eq!(attention.forward_rows_with(set, &q, &rows).unwrap(), want, "{} head_dim {head_dim}", set.name);
        }
        // The same rows in blocks of 4 positions (a paged cache): the kernels walk runs of rows
        // that end at each block's end, and give the same bits.
        let block = 4 * kv_width;
        let blocks = Slots::Blocks { k: k.chunks(block).collect(), v: v.chunks(block).collect(), block_shift: 2 };
        let paged: Vec<RowView> = rows.iter().map(|r| RowView { kv: &blocks, ..*r }).collect();
        for set in available_sets() {
            let got = attention.forward_rows_with(set, &q, &paged).unwrap();
            assert_eq!(got, want, "{} head_dim {head_dim}, paged", set.name);
        }
    }
    let gate = random(1000, 4).iter().map(|v| v * 12.0).collect::<Vec<_>>();
    let up = random(1000, 5);
    let run = |set: &KernelSet| {
        let (mut exps, mut swiglu) = (gate.clone(), gate.clone());
        // SAFETY: the set runs on this CPU.
        unsafe {
            (set.softmax_exps)(&mut exps, 3.0);
            (set.swiglu)(&mut swiglu, &up);
        }
        (exps, swiglu)
    };
    let want = run(&reference::KERNELS);
    for set in available_sets() {
        assert!(run(set) == want, "{}: exp loops differ from the reference", set.name);
    }
}

#[test]
fn the_best_available_set_is_chosen_and_a_forced_one_is_checked() {
    let available = available_sets();
    assert_eq!(available.last().unwrap().name, "reference");
    assert_eq!(choose(None).unwrap().name, available[0].name);
    assert_eq!(choose(Some("")).unwrap().name, available[0].name);
    for set in &available {
        assert_eq!(choose(Some(set.name)).unwrap().name, set.name);
    }
    if available.iter().any(|s| s.name == "x86_avx2") {
        // The name benches/README.md's A/B runs use.
        assert_eq!(choose(Some("avx2")).unwrap().name, "x86_avx2");
    }
    let err = choose(Some("neon9")).unwrap_err();
    assert!(err.contains("SPECRS_CPU_KERNELS=neon9: no such kernel set") && err.contains("reference"), "{err}");
    for (runs, set) in CANDIDATES {
        if !runs() {
            let err = choose(Some(set.name)).unwrap_err();
            assert!(err.contains("this CPU does not run"), "{err}");
        }
    }
}
