//! Splitting a CPU kernel's output across cores with candle's spinning barrier pool.
//!
//! Why not rayon: a decode step launches ~250 short parallel regions (7 matmuls and one attention
//! per layer); rayon parks idle workers and the wake-ups cost more than the work. candle's pool
//! spins between regions, and the quantized matmuls candle still runs use the same pool, so the
//! two never compete for the cores.
//!
//! Invariant: every chunk is written by exactly one worker, and which worker does it never changes
//! the result.

/// Calls `f(index, chunk)` for each `chunk_len`-sized chunk of `out` (the last may be shorter),
/// in parallel.
pub fn for_each_chunk_mut<F>(out: &mut [f32], chunk_len: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    assert!(chunk_len > 0, "for_each_chunk_mut: chunks of 0 values");
    let total = out.len();
    let num_chunks = total.div_ceil(chunk_len);
    let base = SharedPtr(out.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(num_chunks, |range| {
        for index in range {
            let start = index * chunk_len;
            let len = chunk_len.min(total - start);
            // SAFETY: chunks are disjoint and each index is handed to exactly one worker, and
            // `out` outlives the call (execute_chunked returns after all workers finish).
            let chunk = unsafe { std::slice::from_raw_parts_mut(base.get().add(start), len) };
            f(index, chunk);
        }
    });
}

/// Calls `f(task)` for each task in `0..num_tasks`, in parallel; the tasks share nothing the
/// caller has not made disjoint.
pub fn for_each_task<F>(num_tasks: usize, f: F)
where
    F: Fn(usize) + Sync,
{
    candle_core::utils::barrier_pool().execute_chunked(num_tasks, |range| range.for_each(&f));
}

/// An output buffer handed to parallel workers, each of which writes only its own part.
#[derive(Clone, Copy)]
pub struct SharedPtr(pub *mut f32);
// SAFETY: only used to hand disjoint parts of an output to workers (`for_each_chunk_mut`, and
// the callers of `for_each_task` that say which part each task writes).
unsafe impl Send for SharedPtr {}
unsafe impl Sync for SharedPtr {}

impl SharedPtr {
    pub fn get(self) -> *mut f32 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_chunk_is_visited_once() {
        let mut out = vec![0f32; 1003];
        for_each_chunk_mut(&mut out, 10, |index, chunk| {
            for x in chunk.iter_mut() {
                *x += index as f32 + 1.0;
            }
        });
        for (i, x) in out.iter().enumerate() {
            assert_eq!(*x, (i / 10) as f32 + 1.0);
        }
    }
}
