//! Static buffers for a step's descriptor: a forward writes its one upload into a device buffer it
//! takes from a small free list (in place, one host-to-device copy) and gives back when the step
//! ends, so in steady state every step's descriptor lives at the same device address, as a
//! captured CUDA graph's inputs must (issue 43), and no step allocates a descriptor.
//!
//! Invariant: a buffer is held by one step at a time (taken under the lock, given back on drop),
//! so forwards running at once (a request's step beside the cost worker's timing) never share one;
//! a step's words are written before any op of its forward reads them (the copy is ordered before
//! them on the device's stream).

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Tensor};

use crate::error::Result;

/// Buffers kept for reuse; a step that finds none free allocates its own.
const MAX_FREE: usize = 4;
/// The smallest buffer, in u32 words (a decode step of a few sequences fits).
const MIN_WORDS: usize = 1024;

/// One model's free descriptor buffers (`[capacity]` u32 tensors on its device).
#[derive(Default)]
pub(crate) struct StepBuffers {
    free: Mutex<Vec<Tensor>>,
}

/// A step's descriptor in a taken buffer; the buffer goes back to its free list when dropped.
pub(crate) struct StepDescriptor {
    /// The whole buffer; the words are its first `len`.
    buffer: Option<Tensor>,
    len: usize,
    owner: Arc<StepBuffers>,
}

impl StepBuffers {
    /// `words` written into a free buffer of at least their length on `device` (or a new one):
    /// ONE upload.
    pub(crate) fn write(self: &Arc<Self>, words: &[u32], device: &Device) -> Result<StepDescriptor> {
        let taken = {
            let mut free = self.free.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            let fits = free.iter().position(|b| b.elem_count() >= words.len() && b.device().same_device(device));
            fits.map(|at| free.swap_remove(at))
        };
        let buffer = match taken {
            Some(buffer) => buffer,
            None => Tensor::zeros(words.len().max(MIN_WORDS).next_power_of_two(), DType::U32, device)?,
        };
        super::count_upload();
        buffer.inplace_op1(&WriteWords(words))?;
        Ok(StepDescriptor { buffer: Some(buffer), len: words.len(), owner: Arc::clone(self) })
    }
}

impl StepDescriptor {
    /// The words `[len]` u32, a view of the buffer.
    pub(crate) fn words(&self) -> Result<Tensor> {
        Ok(self.buffer.as_ref().expect("held until dropped").narrow(0, 0, self.len)?)
    }
}

impl Drop for StepDescriptor {
    fn drop(&mut self) {
        let Some(buffer) = self.buffer.take() else { return };
        let mut free = self.owner.free.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if free.len() < MAX_FREE {
            free.push(buffer);
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// The address of a CPU tensor's first word.
    fn address(tensor: &Tensor) -> usize {
        let (storage, layout) = tensor.storage_and_layout();
        let candle_core::Storage::Cpu(CpuStorage::U32(values)) = &*storage else { panic!("a CPU u32 tensor") };
        values[layout.start_offset()..].as_ptr() as usize
    }

    /// Successive steps write into the same buffer (one upload each); steps at once hold their
    /// own; a step longer than every free buffer gets a new one.
    #[test]
    fn steps_reuse_one_buffer_and_steps_at_once_never_share_it() {
        let buffers = Arc::new(StepBuffers::default());
        let device = Device::Cpu;
        let uploads = super::super::UPLOADS.with(Cell::get);
        let first = buffers.write(&[1, 2, 3], &device).unwrap();
        let at = address(&first.words().unwrap());
        assert_eq!(first.words().unwrap().to_vec1::<u32>().unwrap(), [1, 2, 3]);
        drop(first);
        for step in 0..3u32 {
            let words: Vec<u32> = (0..10 + step).collect();
            let descriptor = buffers.write(&words, &device).unwrap();
            assert_eq!(address(&descriptor.words().unwrap()), at, "step {step}: the same address");
            assert_eq!(descriptor.words().unwrap().to_vec1::<u32>().unwrap(), words);
        }
        assert_eq!(super::super::UPLOADS.with(Cell::get) - uploads, 4, "one upload per step");
        let held = buffers.write(&[7], &device).unwrap();
        let beside = buffers.write(&[8], &device).unwrap();
        assert_ne!(address(&held.words().unwrap()), address(&beside.words().unwrap()));
        assert_eq!(
            (held.words().unwrap().to_vec1::<u32>().unwrap(), beside.words().unwrap().to_vec1::<u32>().unwrap()),
            (vec![7], vec![8])
        );
        drop((held, beside));
        let long: Vec<u32> = (0..5000).collect();
        let grown = buffers.write(&long, &device).unwrap();
        assert_eq!(grown.words().unwrap().to_vec1::<u32>().unwrap(), long);
        assert!(buffers.free.lock().unwrap().len() <= MAX_FREE);
    }
}
