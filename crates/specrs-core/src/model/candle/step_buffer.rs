//! Static buffers for a step: a forward writes its one upload into a device buffer it takes from a
//! small free list (in place, one host-to-device copy) and gives back when the step ends, so in
//! steady state every step's descriptor lives at the same device address, as a captured CUDA
//! graph's inputs must (issue 43), and no step allocates a descriptor; a captured step's entry
//! (`step_graphs.rs`) holds its buffer for good and rewrites it for every replay. The split-K
//! attention's scratch (partial results and per-(row, head) counters) lives beside it, grown when
//! a step needs more and kept for the next, so no layer allocates it or zeroes its counters.
//!
//! Invariant: a buffer is held by one step at a time (taken under the lock, given back on drop),
//! so forwards running at once (a request's step beside the cost worker's timing) never share one;
//! a step's words are written before any op of its forward reads them (the copy is ordered before
//! them on the device's stream); the scratch's counters are zero between launches (zeroed when
//! allocated; the attention kernel's last split of a (row, head) sets its counter back).

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Tensor};

use crate::error::Result;

/// Buffers kept for reuse; a step that finds none free allocates its own.
const MAX_FREE: usize = 4;
/// The smallest buffer, in u32 words (a decode step of a few sequences fits).
const MIN_WORDS: usize = 1024;

/// One model's free step buffers.
#[derive(Default)]
pub(crate) struct StepBuffers {
    free: Mutex<Vec<Held>>,
}

/// A buffer of the free list: the descriptor's words (`[capacity]` u32 on the model's device) and
/// the split-K scratch kept with them.
struct Held {
    words: Tensor,
    scratch: Option<SplitScratch>,
}

/// The split-K attention's scratch: `partials [len]` f32 (each range's max, sum and unnormalized
/// output) and `counters [len]` u32 (ranges finished per (row, head), zero between launches).
#[derive(Clone)]
pub(crate) struct SplitScratch {
    pub(crate) partials: Tensor,
    pub(crate) counters: Tensor,
}

/// A step's descriptor in a taken buffer; the buffer goes back to its free list when dropped.
pub(crate) struct StepDescriptor {
    /// The whole buffer; the step's words are its first.
    words: Option<Tensor>,
    /// The scratch this buffer kept, grown by `split_scratch` (layers of one forward run in turn).
    scratch: Mutex<Option<SplitScratch>>,
    owner: Arc<StepBuffers>,
}

impl StepBuffers {
    /// `words` written into a free buffer on `device` (or a new one) that holds them and `room`
    /// words after them (for work after the forward: `section`): ONE upload.
    pub(crate) fn write(self: &Arc<Self>, words: &[u32], room: usize, device: &Device) -> Result<StepDescriptor> {
        let needed = words.len() + room;
        let taken = {
            let mut free = self.free.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            let fits = free.iter().position(|b| b.words.elem_count() >= needed && b.words.device().same_device(device));
            fits.map(|at| free.swap_remove(at))
        };
        let held = match taken {
            Some(held) => held,
            None => Held {
                words: Tensor::zeros(needed.max(MIN_WORDS).next_power_of_two(), DType::U32, device)?,
                scratch: None,
            },
        };
        let descriptor =
            StepDescriptor { words: Some(held.words), scratch: Mutex::new(held.scratch), owner: Arc::clone(self) };
        descriptor.rewrite(words)?;
        Ok(descriptor)
    }
}

impl StepDescriptor {
    /// Writes `words` at the start of the buffer (again, for a captured step's static buffer,
    /// whose address its graph holds): one upload, nothing allocated.
    pub(crate) fn rewrite(&self, words: &[u32]) -> Result<()> {
        let buffer = self.words.as_ref().expect("held until dropped");
        if words.len() > buffer.elem_count() {
            return Err(crate::error::Error::Internal(format!(
                "{} step words for a buffer of {}",
                words.len(),
                buffer.elem_count()
            )));
        }
        super::count_upload();
        buffer.inplace_op1(&WriteWords(words))?;
        Ok(())
    }

    /// Words the buffer holds.
    pub(crate) fn capacity(&self) -> usize {
        self.words.as_ref().expect("held until dropped").elem_count()
    }

    /// Words `start..start + len` of the buffer (past the written words: the room `write` kept).
    pub(crate) fn section(&self, start: usize, len: usize) -> Result<Tensor> {
        Ok(self.words.as_ref().expect("held until dropped").narrow(0, start, len)?)
    }

    /// Split-K scratch of at least `partials` f32 and `counters` u32 on the step's device: what
    /// this buffer kept from earlier steps, or (too small) new buffers of the next power of two,
    /// their counters zeroed. Every layer of the forward gets the same buffers.
    #[cfg_attr(not(any(test, feature = "cuda")), allow(dead_code))]
    pub(crate) fn split_scratch(&self, partials: usize, counters: usize) -> Result<SplitScratch> {
        let mut scratch = self.scratch.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let fits = |s: &SplitScratch| s.partials.elem_count() >= partials && s.counters.elem_count() >= counters;
        if let Some(held) = scratch.as_ref().filter(|s| fits(s)) {
            return Ok(held.clone());
        }
        let device = self.words.as_ref().expect("held until dropped").device();
        let grown = SplitScratch {
            partials: Tensor::zeros(partials.max(1).next_power_of_two(), DType::F32, device)?,
            counters: Tensor::zeros(counters.max(1).next_power_of_two(), DType::U32, device)?,
        };
        *scratch = Some(grown.clone());
        Ok(grown)
    }
}

impl Drop for StepDescriptor {
    fn drop(&mut self) {
        let Some(words) = self.words.take() else { return };
        let scratch = self.scratch.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
        let mut free = self.owner.free.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if free.len() < MAX_FREE {
            free.push(Held { words, scratch });
        }
    }
}

/// Writes its words at the start of a u32 tensor, in place.
struct WriteWords<'a>(&'a [u32]);

impl InplaceOp1 for WriteWords<'_> {
    fn name(&self) -> &'static str {
        "write-step-words"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let CpuStorage::U32(values) = storage else {
            return Err(candle_core::Error::Msg("a step buffer holds u32 words".into()));
        };
        let start = layout.start_offset();
        values[start..start + self.0.len()].copy_from_slice(self.0);
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, storage: &mut candle_core::CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::WrapErr;
        let stream = storage.device().cuda_stream();
        let start = layout.start_offset();
        let mut view = storage.as_cuda_slice_mut::<u32>()?.slice_mut(start..start + self.0.len());
        stream.memcpy_htod(self.0, &mut view).w()?;
        Ok(())
    }
}

/// The address of a CPU tensor's first element (tests of static buffers).
#[cfg(test)]
pub(crate) fn address(tensor: &Tensor) -> usize {
    let (storage, layout) = tensor.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(CpuStorage::U32(values)) => values[layout.start_offset()..].as_ptr() as usize,
        candle_core::Storage::Cpu(CpuStorage::F32(values)) => values[layout.start_offset()..].as_ptr() as usize,
        _ => panic!("a CPU u32 or f32 tensor"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// The split-K scratch stays with its buffer: every layer of a step and every later step get
    /// the same addresses; a step needing more grows it once (counters zeroed) and keeps the
    /// larger; a step held beside another has its own.
    #[test]
    fn the_split_scratch_is_kept_with_its_buffer_and_grown_once() {
        let buffers = Arc::new(StepBuffers::default());
        let device = Device::Cpu;
        let addresses = |s: &SplitScratch| (address(&s.partials), address(&s.counters));
        let step = buffers.write(&[1], 0, &device).unwrap();
        let first = step.split_scratch(100, 10).unwrap();
        assert_eq!((first.partials.elem_count(), first.counters.elem_count()), (128, 16));
        assert_eq!(first.counters.to_vec1::<u32>().unwrap(), vec![0; 16], "counters start at zero");
        for _layer in 0..3 {
            assert_eq!(addresses(&step.split_scratch(100, 10).unwrap()), addresses(&first), "every layer");
        }
        drop(step);
        let next = buffers.write(&[2, 3], 0, &device).unwrap();
        assert_eq!(addresses(&next.split_scratch(64, 16).unwrap()), addresses(&first), "the next step");
        let grown = next.split_scratch(300, 16).unwrap();
        assert_eq!(grown.partials.elem_count(), 512);
        assert_ne!(addresses(&grown), addresses(&first));
        let beside = buffers.write(&[4], 0, &device).unwrap();
        let beside_scratch = addresses(&beside.split_scratch(300, 16).unwrap());
        assert_ne!(beside_scratch, addresses(&grown), "a step at once");
        drop((next, beside));
        // Either freed buffer comes back with the scratch it grew: nothing is allocated again.
        let later = buffers.write(&[5], 0, &device).unwrap();
        let kept = addresses(&later.split_scratch(300, 16).unwrap());
        assert!(kept == addresses(&grown) || kept == beside_scratch, "a kept scratch, not a new one");
    }

    /// Successive steps write into the same buffer (one upload each); steps at once hold their
    /// own; a step longer than every free buffer gets a new one.
    #[test]
    fn steps_reuse_one_buffer_and_steps_at_once_never_share_it() {
        let buffers = Arc::new(StepBuffers::default());
        let device = Device::Cpu;
        let uploads = super::super::UPLOADS.with(Cell::get);
        let first = buffers.write(&[1, 2, 3], 0, &device).unwrap();
        let at = address(&first.section(0, 3).unwrap());
        assert_eq!(first.section(0, 3).unwrap().to_vec1::<u32>().unwrap(), [1, 2, 3]);
        drop(first);
        for step in 0..3u32 {
            let words: Vec<u32> = (0..10 + step).collect();
            let descriptor = buffers.write(&words, 0, &device).unwrap();
            assert_eq!(address(&descriptor.section(0, words.len()).unwrap()), at, "step {step}: the same address");
            assert_eq!(descriptor.section(0, words.len()).unwrap().to_vec1::<u32>().unwrap(), words);
        }
        assert_eq!(super::super::UPLOADS.with(Cell::get) - uploads, 4, "one upload per step");
        let held = buffers.write(&[7], 0, &device).unwrap();
        let beside = buffers.write(&[8], 0, &device).unwrap();
        assert_ne!(address(&held.section(0, 1).unwrap()), address(&beside.section(0, 1).unwrap()));
        assert_eq!(
            (
                held.section(0, 1).unwrap().to_vec1::<u32>().unwrap(),
                beside.section(0, 1).unwrap().to_vec1::<u32>().unwrap()
            ),
            (vec![7], vec![8])
        );
        drop((held, beside));
        let long: Vec<u32> = (0..5000).collect();
        let grown = buffers.write(&long, 0, &device).unwrap();
        assert_eq!(grown.section(0, long.len()).unwrap().to_vec1::<u32>().unwrap(), long);
        assert!(buffers.free.lock().unwrap().len() <= MAX_FREE);
    }
}
