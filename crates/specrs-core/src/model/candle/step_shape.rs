//! The fixed shapes a step is padded to, so that one captured CUDA graph per shape can replay
//! every step of that shape (issue 43): 1, 2, 4, 8, 16, 32 or 64 sequences, each of up to 1, 2, 3,
//! 5, 9 or 17 rows (a decode; chains of k + 1 rows for k = 1, 2, 4, 8, 16; trees of as many
//! nodes). A padded step keeps the batch's rows first, in order, and lays its descriptor out by the
//! shape and its block tables' width alone (`PagedStep::new`): sequence entries past the batch's
//! are empty, and the padding rows, a sequence of their own, each see one key and write theirs in
//! the pool's dummy block, which no sequence holds (`PagedPool::dummy_slot`).
//!
//! Invariant: padding never changes a real row: its keys, mask and split-K ranges are the eager
//! step's, so on the CPU its logits and hidden states are bitwise the eager step's, and no slot a
//! sequence holds is written by a padding row.

use crate::model::forward::ForwardBatch;

/// Sequences per captured shape.
pub const BATCH_BUCKETS: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];
/// Rows per sequence per captured shape.
pub const ROW_BUCKETS: [usize; 6] = [1, 2, 3, 5, 9, 17];

/// A step's padded shape: `num_seqs` sequences of `rows_per_seq` rows each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StepShape {
    pub num_seqs: usize,
    pub rows_per_seq: usize,
}

impl StepShape {
    /// The smallest captured shape holding `batch` (its sequence count, and its longest
    /// sequence's rows); None for an empty batch or one past the largest (it runs eagerly).
    pub fn of(batch: &ForwardBatch) -> Option<Self> {
        let longest = (0..batch.num_seqs()).map(|s| batch.seq_range(s).len()).max()?;
        let num_seqs = BATCH_BUCKETS.into_iter().find(|&b| b >= batch.num_seqs())?;
        let rows_per_seq = ROW_BUCKETS.into_iter().find(|&r| r >= longest.max(1))?;
        Some(Self { num_seqs, rows_per_seq })
    }

    /// Rows of a step of this shape, padding included.
    pub fn num_rows(&self) -> usize {
        self.num_seqs * self.rows_per_seq
    }
}

/// How one step is padded: its shape, the pool's dummy slot, and the width every block table is
/// laid out at (the longest table's length, rounded up to a power of two).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Padding {
    pub shape: StepShape,
    pub dummy_slot: u32,
    pub table_width: usize,
}

impl Padding {
    /// The padding of a step of `shape` whose sequences have block tables `tables`.
    pub fn new(shape: StepShape, dummy_slot: u32, tables: &[&[u32]]) -> Self {
        let longest = tables.iter().map(|t| t.len()).max().unwrap_or(0);
        Self { shape, dummy_slot, table_width: longest.max(1).next_power_of_two() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::KvCache;
    use crate::model::candle::launches;
    use crate::model::forward::{SeqRows, Tap};
    use crate::model::{CausalLm, LogitRows};
    use candle_core::Tensor;

    fn bits(t: &Tensor) -> Vec<u32> {
        let t = t.to_dtype(candle_core::DType::F32).unwrap().flatten_all().unwrap();
        t.to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
    }

    /// A step padded to its shape computes the eager step's logits and hidden states bit for bit,
    /// on every family (Gemma 3 with its window and soft-caps), chains, a tree and a decode in one
    /// step; its padding rows write the pool's dummy block and no slot a sequence holds.
    #[test]
    fn a_padded_step_is_the_eager_step_and_writes_only_the_dummy_block() {
        for family in ["llama", "qwen3", "gemma3"] {
            let model = launches::model(family);
            let pool = model.new_paged_pool(16, 8).unwrap();
            let seqs = [
                SeqRows::chain(vec![5, 7, 9], LogitRows::All),
                SeqRows::tree(vec![11, 13, 17, 19, 23, 29], vec![-1, 0, 0, 1, 1, 2]),
                SeqRows::chain(vec![31], LogitRows::Last),
            ];
            let mut caches: Vec<KvCache> = (0..seqs.len()).map(|_| KvCache::paged(&pool, 64)).collect();
            for (s, cache) in caches.iter_mut().enumerate() {
                let prompt: Vec<u32> = (0..12 + 5 * s as u32).map(|i| (i * 13 + 1) % 97).collect();
                model.forward_rows(&prompt, cache, LogitRows::Last).unwrap();
            }
            let pasts: Vec<usize> = caches.iter().map(KvCache::len).collect();
            let batch = ForwardBatch::new(&seqs, &pasts, vec![Tap::Residual(1), Tap::FinalNorm]).unwrap();
            assert_eq!(StepShape::of(&batch), Some(StepShape { num_seqs: 4, rows_per_seq: 9 }));
            let dummy = pool.dummy_slot().unwrap() as usize;
            let mut run = |pad: bool| {
                model.pad_steps_to_shapes(pad);
                let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
                let out = model.forward_batch(&batch, &mut refs).unwrap();
                for (cache, &past) in refs.iter_mut().zip(&pasts) {
                    cache.truncate(past);
                }
                let layer = pool.device_layer(0).unwrap().clone(); // [2, slots, row_len]
                let held = bits(&layer.narrow(1, 0, dummy).unwrap());
                let dummy_block = bits(&layer.narrow(1, dummy, 16).unwrap());
                (out, held, dummy_block)
            };
            let (eager, eager_held, eager_dummy) = run(false);
            let (padded, padded_held, padded_dummy) = run(true);
            model.pad_steps_to_shapes(false);
            // Compared as booleans: a failure names what differs without printing every bit.
            assert_eq!(padded.logits.dims(), eager.logits.dims());
            assert!(bits(&padded.logits) == bits(&eager.logits), "{family}: the logits differ");
            for (tap, (p, e)) in batch.taps.iter().zip(padded.hidden.iter().zip(&eager.hidden)) {
                assert!(p.dims() == e.dims() && bits(p) == bits(e), "{family}: {tap:?} differs");
            }
            assert!(padded_held == eager_held, "{family}: a slot a sequence holds was written otherwise");
            assert!(eager_dummy.iter().all(|&b| b == 0), "{family}: an eager step leaves the dummy block");
            assert!(padded_dummy.iter().any(|&b| b != 0), "{family}: the padding rows wrote the dummy block");
        }
    }

    fn batch(rows: &[usize]) -> ForwardBatch {
        let seqs: Vec<SeqRows> = rows.iter().map(|&n| SeqRows::chain(vec![1; n], LogitRows::All)).collect();
        ForwardBatch::new(&seqs, &vec![3; rows.len()], Vec::new()).unwrap()
    }

    /// The smallest bucket that holds the batch, or none past the largest.
    #[test]
    fn a_batch_takes_the_smallest_shape_that_holds_it() {
        let shape = |rows: &[usize]| StepShape::of(&batch(rows)).map(|s| (s.num_seqs, s.rows_per_seq));
        assert_eq!(shape(&[1]), Some((1, 1)));
        assert_eq!(shape(&[5, 5, 5]), Some((4, 5)));
        assert_eq!(shape(&[1, 4, 2, 1, 1]), Some((8, 5)));
        assert_eq!(shape(&[17; 33]), Some((64, 17)));
        assert_eq!(shape(&[18]), None, "a sequence past the largest row bucket");
        assert_eq!(shape(&[1; 65]), None, "more sequences than the largest batch bucket");
        assert_eq!(shape(&[]), None);
        assert_eq!(StepShape { num_seqs: 8, rows_per_seq: 5 }.num_rows(), 40);
        let padding = Padding::new(StepShape { num_seqs: 2, rows_per_seq: 5 }, 64, &[&[0, 1, 2], &[3]]);
        assert_eq!(padding.table_width, 4);
    }
}
