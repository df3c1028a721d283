//! Captured steps (issue 43): a padded paged step's launches (embedding, every layer, the final
//! norm and the LM head) captured once per [`GraphKey`] as a CUDA graph and replayed for every later
//! step of that key, so a step costs its one upload, one graph launch and a copy of each output
//! instead of some 8 launches per layer.
//!
//! A key's first step runs eagerly (a shape seen once holds no graph). Its second gets an entry:
//! a static buffer of its own (the descriptor's words, room for carried words, the split-K
//! scratch) into which the step is written; the step runs eagerly over it (growing what the
//! launches grow once outside the capture, since a graph may free only what it allocated), then
//! its launches are recorded as a graph. Later steps write their words into that buffer and
//! replay. The graph's own allocations (its activations) come from the device's graph memory
//! pool at fixed addresses: that pool is the step's activation arena. A step runs eagerly
//! instead, counted by [`EagerReason`] (`/metrics`), when its shape is past the largest captured
//! one, when capturing its key would pass the memory budget (each graph counts its
//! [`activation_bytes`] estimate), when its key's entry is still held by the step before (its
//! carried words are being read), when its carried words outgrow the entry's room, or when
//! capture failed (the key then stays eager).
//!
//! Invariant: a replay's launches read only the entry's static buffer, the pool and the weights, at
//! the addresses they had when captured, and the words written before it are laid out as the
//! capture's were (`StepLayout`, checked): so a replayed step computes the eager step's outputs. An
//! entry serves one step at a time. On the CPU nothing is captured; `GraphMode::Emulated` (tests)
//! replays a key by running its launches again over the entry's buffer with the layout and plan
//! of its capture, which proves the invariant short of the device.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{Device, Tensor};

use crate::error::{Error, Result};
use crate::model::candle::paged_attention::{PagedStep, StepWords};
use crate::model::candle::step_buffer::StepBuffers;
use crate::model::candle::step_shape::StepShape;
use crate::model::forward::{Carried, Tap};

/// What a paged step's launches compute besides its rows: how many layers run, which hidden states
/// are kept, and whether logits are computed. Part of the key: a graph runs one plan.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct LaunchPlan {
    pub num_blocks: usize,
    pub taps: Vec<Tap>,
    pub logits: bool,
}

/// One captured graph's step: the padded shape, the block tables' width (the descriptor's layout
/// and the attention grid follow it) and the plan.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct GraphKey {
    pub shape: StepShape,
    pub table_width: usize,
    pub plan: LaunchPlan,
}

/// What a paged step's launches leave on the device, for every row of its shape (padding rows
/// included; the caller keeps the batch's, which come first).
pub(crate) struct StepTensors {
    /// `[rows, hidden]` f32 per tap of the plan, in its order.
    pub hidden: Vec<Tensor>,
    /// `[logit rows, vocab]` f32 when the plan computes logits.
    pub logits: Option<Tensor>,
}

impl StepTensors {
    /// Copies of every output (a replay's outputs are the graph's, overwritten by its next launch).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn copied(&self) -> Result<Self> {
        Ok(Self {
            hidden: self.hidden.iter().map(|t| t.copy()).collect::<candle_core::Result<_>>()?,
            logits: self.logits.as_ref().map(|t| t.copy()).transpose()?,
        })
    }
}

/// Whether steps are captured: not at all, as CUDA graphs, or (tests) emulated on the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GraphMode {
    #[default]
    Off,
    Device,
    #[cfg(test)]
    Emulated,
}

impl GraphMode {
    /// The mode's name in `Engine.step_graph_status()`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Device => "device",
            #[cfg(test)]
            Self::Emulated => "emulated",
        }
    }
}

/// Why a step of a model capturing graphs ran eagerly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EagerReason {
    /// The first step of its key (the next is captured).
    Warmup,
    /// Past the largest captured shape (prompt chunks, batches over 64 sequences).
    Shape,
    /// Capturing its key would pass the memory budget.
    Budget,
    /// Its key's entry is held by the step before it.
    Busy,
    /// Its carried words outgrow the entry's room.
    Room,
    /// Capture failed (the key stays eager).
    CaptureFailed,
}

impl EagerReason {
    pub const ALL: [EagerReason; 6] =
        [Self::Warmup, Self::Shape, Self::Budget, Self::Busy, Self::Room, Self::CaptureFailed];

    /// The reason's label in `/metrics`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Warmup => "warmup",
            Self::Shape => "shape",
            Self::Budget => "budget",
            Self::Busy => "busy",
            Self::Room => "room",
            Self::CaptureFailed => "capture_failed",
        }
    }
}

/// Where a model's captured steps stand (`Engine::step_graph_status`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GraphStatus {
    pub mode: GraphMode,
    /// The most bytes the graphs may hold, by their estimates ([`activation_bytes`]).
    pub budget_bytes: usize,
    /// The captured graphs' estimates, summed.
    pub used_bytes: usize,
    pub num_graphs: usize,
    /// Nodes of the captured graphs (kernels, copies, allocations), summed; 0 when emulated.
    pub num_graph_nodes: usize,
    pub num_captures: u64,
    pub num_replays: u64,
    /// Steps run eagerly, by reason (every reason listed).
    pub num_eager: BTreeMap<EagerReason, u64>,
    /// Why the last failed capture failed.
    pub capture_error: Option<String>,
}

/// A model's captured steps.
#[derive(Default)]
pub(crate) struct StepGraphs {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    mode: GraphMode,
    budget_bytes: usize,
    used_bytes: usize,
    entries: HashMap<GraphKey, Arc<Entry>>,
    /// Keys whose first step ran (the next is captured).
    warmed: HashSet<GraphKey>,
    /// Keys that stay eager, and why (`Busy` while another step captures the key).
    refused: HashMap<GraphKey, EagerReason>,
    num_captures: u64,
    num_replays: u64,
    num_eager: BTreeMap<EagerReason, u64>,
    capture_error: Option<String>,
}

/// A captured key: its static buffer (a paged step laid out as the key), whether a step holds it,
/// and its graph (device) with the outputs the graph writes.
struct Entry {
    step: PagedStep,
    busy: AtomicBool,
    #[cfg(feature = "cuda")]
    graph: Mutex<Option<device::Captured>>,
}

/// An entry held by one step, released when dropped (its carried words read).
struct Held(Arc<Entry>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.busy.store(false, Ordering::Release);
    }
}

/// What to do with one step.
enum Plan {
    Eager,
    Capture(GraphKey),
    Replay(Held),
}

impl StepGraphs {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Captures steps in `mode` within `budget_bytes`; entries captured before are dropped.
    pub(crate) fn set(&self, mode: GraphMode, budget_bytes: usize) {
        *self.state() = State { mode, budget_bytes, ..State::default() };
    }

    pub(crate) fn mode(&self) -> GraphMode {
        self.state().mode
    }

    pub(crate) fn status(&self) -> GraphStatus {
        let state = self.state();
        let mut num_eager: BTreeMap<EagerReason, u64> = EagerReason::ALL.into_iter().map(|r| (r, 0)).collect();
        num_eager.extend(state.num_eager.iter().map(|(&r, &n)| (r, n)));
        GraphStatus {
            mode: state.mode,
            budget_bytes: state.budget_bytes,
            used_bytes: state.used_bytes,
            num_graphs: state.entries.len(),
            num_graph_nodes: state.entries.values().map(|e| e.num_nodes()).sum(),
            num_captures: state.num_captures,
            num_replays: state.num_replays,
            num_eager,
            capture_error: state.capture_error.clone(),
        }
    }

    /// Runs one paged step: eagerly, captured or replayed (see the module header). `key` is the
    /// step's when it is padded to a captured shape (None: past the largest), `words` its
    /// descriptor, `estimate` its key's [`activation_bytes`], and `launches` its launches over a
    /// written step. Returns the launches' outputs (the caller's own) and the step's carried words.
    pub(crate) fn run(
        &self,
        key: Option<GraphKey>,
        words: &StepWords,
        estimate: usize,
        buffers: &Arc<StepBuffers>,
        device: &Device,
        launches: impl Fn(&PagedStep) -> Result<StepTensors>,
    ) -> Result<(StepTensors, Option<Carried>)> {
        match self.plan(key, words, estimate) {
            Plan::Eager => {
                let step = PagedStep::write(words, 0, buffers, device)?;
                let tensors = launches(&step)?;
                Ok((tensors, step.into_carried()?))
            }
            Plan::Replay(held) => {
                held.0.ready(device)?;
                held.0.step.rewrite(words)?;
                let tensors = held.0.replay(device, &launches)?;
                self.state().num_replays += 1;
                Ok((tensors, carried(held, words)?))
            }
            Plan::Capture(key) => {
                // Room for carried words as long again as the first step's.
                let step = PagedStep::write(words, words.needed(), buffers, device)?;
                let entry = Arc::new(Entry {
                    step,
                    busy: AtomicBool::new(true),
                    #[cfg(feature = "cuda")]
                    graph: Mutex::new(None),
                });
                let held = Held(Arc::clone(&entry));
                // The step runs eagerly over the entry's own buffer first: its outputs, and what
                // the launches grow once (the split-K scratch) grown outside the capture, since a
                // graph may free only what it allocated. Then its launches are recorded.
                let tensors = launches(&entry.step)?;
                let recorded = entry.record(self.mode(), device, &launches);
                let mut state = self.state();
                match recorded {
                    Ok(()) => {
                        state.refused.remove(&key);
                        state.used_bytes += estimate;
                        state.num_captures += 1;
                        state.entries.insert(key, entry);
                    }
                    Err(e) => {
                        eprintln!("specrs: capturing a step of {key:?} failed; its steps run eagerly: {e}");
                        state.capture_error = Some(e.to_string());
                        state.refused.insert(key, EagerReason::CaptureFailed);
                        *state.num_eager.entry(EagerReason::CaptureFailed).or_default() += 1;
                    }
                }
                drop(state);
                Ok((tensors, carried(held, words)?))
            }
        }
    }

    /// The plan for a step of `key` (counted when eager).
    fn plan(&self, key: Option<GraphKey>, words: &StepWords, estimate: usize) -> Plan {
        let mut state = self.state();
        if state.mode == GraphMode::Off {
            return Plan::Eager;
        }
        let (plan, reason) = match key {
            None => (Plan::Eager, Some(EagerReason::Shape)),
            Some(key) => {
                if let Some(&reason) = state.refused.get(&key) {
                    (Plan::Eager, Some(reason))
                } else if let Some(entry) = state.entries.get(&key) {
                    if words.needed() > entry.step.capacity() {
                        (Plan::Eager, Some(EagerReason::Room))
                    } else if entry.busy.swap(true, Ordering::Acquire) {
                        (Plan::Eager, Some(EagerReason::Busy))
                    } else {
                        (Plan::Replay(Held(Arc::clone(entry))), None)
                    }
                } else if state.warmed.insert(key.clone()) {
                    (Plan::Eager, Some(EagerReason::Warmup))
                } else if state.used_bytes + estimate > state.budget_bytes {
                    state.refused.insert(key, EagerReason::Budget);
                    (Plan::Eager, Some(EagerReason::Budget))
                } else {
                    // Steps of the key on other threads run eagerly until the capture ends.
                    state.refused.insert(key.clone(), EagerReason::Busy);
                    (Plan::Capture(key), None)
                }
            }
        };
        if let Some(reason) = reason {
            *state.num_eager.entry(reason).or_default() += 1;
        }
        plan
    }
}

#[cfg(test)]
impl StepGraphs {
    /// Each captured entry's buffer address, in order (tests of static buffers).
    pub(crate) fn buffer_addresses(&self) -> Vec<usize> {
        let mut addresses: Vec<usize> = self.state().entries.values().map(|e| e.step.buffer_address()).collect();
        addresses.sort_unstable();
        addresses
    }
}

/// The step's carried words, read from the entry's buffer: the entry stays held until they are
/// dropped.
fn carried(held: Held, words: &StepWords) -> Result<Option<Carried>> {
    let Some(section) = held.0.step.carried_section(words)? else { return Ok(None) };
    Ok(Some(Carried { words: section, _buffer: Box::new(held) }))
}

impl Entry {
    /// Records the entry's launches as a CUDA graph (device; nothing to record when emulated).
    fn record(
        &self,
        mode: GraphMode,
        device: &Device,
        launches: &dyn Fn(&PagedStep) -> Result<StepTensors>,
    ) -> Result<()> {
        match mode {
            GraphMode::Off => Err(Error::Internal("capture with graphs off".into())),
            #[cfg(test)]
            GraphMode::Emulated => Ok(()),
            GraphMode::Device => {
                #[cfg(feature = "cuda")]
                {
                    let captured = device::capture(device, || launches(&self.step))?;
                    *self.graph.lock().unwrap_or_else(|p| p.into_inner()) = Some(captured);
                    Ok(())
                }
                #[cfg(not(feature = "cuda"))]
                {
                    let _ = (device, launches);
                    Err(Error::Device("CUDA graphs need a CUDA build of specrs".into()))
                }
            }
        }
    }

    /// Orders what this thread writes into the entry's buffer after the entry's last replay,
    /// which may have run on another thread's stream (device; nothing to order when emulated).
    fn ready(&self, device: &Device) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(captured) = self.graph.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            return captured.after_last_replay(device);
        }
        let _ = device;
        Ok(())
    }

    /// A later step of the entry's key, its words already written: the graph launched and its
    /// outputs copied (device), or the launches run again over the entry's step (emulated).
    fn replay(&self, device: &Device, launches: &dyn Fn(&PagedStep) -> Result<StepTensors>) -> Result<StepTensors> {
        #[cfg(feature = "cuda")]
        if let Some(captured) = self.graph.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            return captured.replay(device);
        }
        let _ = device;
        launches(&self.step)
    }

    fn num_nodes(&self) -> usize {
        #[cfg(feature = "cuda")]
        if let Some(captured) = self.graph.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            return captured.num_nodes;
        }
        0
    }
}

/// An upper estimate of the device memory a captured step of `rows` rows (`logit_rows` of them
/// with logits, `taps` hidden states kept) holds: one layer's activations at once (the residual
/// and its norm, the q/k/v projection, the attention output, gate/up and their product) in
/// `dtype_bytes`, the taps and logits in f32 and the LM head's output before its cast.
pub(crate) fn activation_bytes(
    rows: usize,
    logit_rows: usize,
    taps: usize,
    dims: ActivationDims,
    dtype_bytes: usize,
) -> usize {
    let ActivationDims { hidden, qkv, attention, ffn, vocab } = dims;
    let layer = rows * dtype_bytes * (3 * hidden + qkv + attention + 3 * ffn);
    let kept = rows * taps * hidden * 4;
    let logits = logit_rows * vocab * (dtype_bytes + 4);
    layer + kept + logits
}

/// The widths [`activation_bytes`] reads: the hidden size, the q/k/v projection's, the attention
/// output's, the feed-forward's and the vocabulary.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ActivationDims {
    pub hidden: usize,
    pub qkv: usize,
    pub attention: usize,
    pub ffn: usize,
    pub vocab: usize,
}

#[cfg(feature = "cuda")]
mod device {
    //! CUDA graph capture and replay over cudarc.

    use candle_core::cuda_backend::cudarc::driver::{sys, CudaEvent, CudaGraph, CudaStream};
    use candle_core::Device;

    use super::StepTensors;
    use crate::error::{Error, Result};

    /// A captured step: its graph, the outputs its launches write, and its node count.
    pub(super) struct Captured {
        graph: CudaGraph,
        pub(super) outputs: StepTensors,
        pub(super) num_nodes: usize,
        /// Recorded after each replay's copies: the next rewrite of the entry's buffer waits for
        /// it, since a step of another thread (the cost worker's) runs on another stream.
        done: CudaEvent,
    }

    // SAFETY: a graph is used under its entry's lock only (cudarc's `CudaGraph` is not
    // internally synchronized, which the lock provides).
    unsafe impl Send for Captured {}
    unsafe impl Sync for Captured {}

    fn device_error(what: &str, e: impl std::fmt::Display) -> Error {
        Error::Device(format!("{what}: {e}"))
    }

    /// Records `launches` on the device's stream (thread-local mode: this thread's launches only;
    /// nothing runs) as a graph whose allocations come from the device's graph memory pool, at
    /// fixed addresses, freed at its next launch; its outputs hold values once it is launched.
    pub(super) fn capture(device: &Device, launches: impl FnOnce() -> Result<StepTensors>) -> Result<Captured> {
        let stream = stream_of(device)?;
        if !stream.context().has_async_alloc() {
            // Without stream-ordered allocation a captured step's buffers would be freed under it.
            return Err(Error::Device("the device has no stream-ordered allocator; steps run eagerly".into()));
        }
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| device_error("beginning a capture", e))?;
        let outputs = launches();
        // End the capture whatever the launches did, so the stream leaves capture mode.
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
        let outputs = outputs?;
        let graph = graph
            .map_err(|e| device_error("ending a capture", e))?
            .ok_or_else(|| Error::Device("the capture recorded no graph".into()))?;
        let mut num_nodes = 0usize;
        // SAFETY: the graph is alive; a null node array asks for the count alone.
        let counted = unsafe { sys::cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut num_nodes) };
        if counted != sys::CUresult::CUDA_SUCCESS {
            return Err(device_error("counting a graph's nodes", format!("{counted:?}")));
        }
        graph.upload().map_err(|e| device_error("uploading a graph", e))?;
        let done = stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| device_error("recording an event", e))?;
        Ok(Captured { graph, outputs, num_nodes, done })
    }

    /// The device's stream (candle's: each thread's own default stream).
    fn stream_of(device: &Device) -> Result<std::sync::Arc<CudaStream>> {
        match device {
            Device::Cuda(cuda) => Ok(cuda.cuda_stream()),
            _ => Err(Error::Internal("a CUDA graph on a device that is not CUDA".into())),
        }
    }

    impl Captured {
        /// Launches the graph (its words written before, on the same stream) and copies its
        /// outputs.
        pub(super) fn replay(&self, device: &Device) -> Result<StepTensors> {
            self.graph.launch().map_err(|e| device_error("launching a graph", e))?;
            let outputs = self.outputs.copied()?;
            self.done.record(&*stream_of(device)?).map_err(|e| device_error("recording an event", e))?;
            Ok(outputs)
        }

        /// This thread's stream waits for the last replay (its copies included) to end.
        pub(super) fn after_last_replay(&self, device: &Device) -> Result<()> {
            stream_of(device)?.wait(&self.done).map_err(|e| device_error("waiting for a replay", e))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;
    use crate::kv_cache::{KvCache, PagedPool};
    use crate::model::candle::decoder::Decoder;
    use crate::model::candle::{launches, UPLOADS};
    use crate::model::forward::{CarriedWords, ForwardBatch, ForwardOutput, SeqRows};
    use crate::model::{CausalLm, LogitRows};

    fn bits(t: &Tensor) -> Vec<u32> {
        let t = t.to_dtype(candle_core::DType::F32).unwrap().flatten_all().unwrap();
        t.to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
    }

    /// One model of a family over a pool of its own, and three requests' caches on it.
    struct Side {
        model: Decoder,
        pool: Arc<PagedPool>,
        caches: Vec<KvCache>,
    }

    impl Side {
        /// Steps padded to their shapes, captured in `mode` within `budget` bytes.
        fn new(family: &str, mode: GraphMode, budget: usize) -> Self {
            let model = launches::model(family);
            model.capture_steps(mode, budget);
            model.pad_steps_to_shapes(true);
            let pool = model.new_paged_pool(16, 24).unwrap();
            let caches = (0..3).map(|_| KvCache::paged(&pool, 256)).collect();
            Self { model, pool, caches }
        }

        /// One forward of `seqs` after the caches `which` (ascending), tapping a residual and the
        /// final norm, carrying `carried`; each cache then keeps `keep` of its new rows (all: None).
        fn step(
            &mut self,
            which: &[usize],
            seqs: &[SeqRows],
            carried: Option<CarriedWords>,
            keep: Option<usize>,
        ) -> ForwardOutput {
            let pasts: Vec<usize> = which.iter().map(|&c| self.caches[c].len()).collect();
            let mut batch = ForwardBatch::new(seqs, &pasts, vec![Tap::Residual(1), Tap::FinalNorm]).unwrap();
            batch.carried = carried;
            let mut refs: Vec<&mut KvCache> =
                self.caches.iter_mut().enumerate().filter(|(c, _)| which.contains(c)).map(|(_, cache)| cache).collect();
            let out = self.model.forward_batch(&batch, &mut refs).unwrap();
            if let Some(keep) = keep {
                for (cache, past) in refs.iter_mut().zip(pasts) {
                    cache.truncate(past + keep);
                }
            }
            out
        }

        /// Every layer of the pool, bit for bit.
        fn pool_bits(&self) -> Vec<u32> {
            (0..3).flat_map(|layer| bits(self.pool.device_layer(layer).unwrap())).collect()
        }

        fn status(&self) -> GraphStatus {
            self.model.step_graph_status().unwrap()
        }
    }

    /// The two sides' outputs and pools are bit for bit the same.
    fn assert_same(family: &str, what: &str, graphed: (&ForwardOutput, &Side), eager: (&ForwardOutput, &Side)) {
        let ((g, g_side), (e, e_side)) = (graphed, eager);
        assert!(bits(&g.logits) == bits(&e.logits), "{family} {what}: the logits differ");
        for (tap, (a, b)) in g.hidden.iter().zip(&e.hidden).enumerate() {
            assert!(a.dims() == b.dims() && bits(a) == bits(b), "{family} {what}: tap {tap} differs");
        }
        assert!(g_side.pool_bits() == e_side.pool_bits(), "{family} {what}: the pools differ");
    }

    fn eager_count(status: &GraphStatus, reason: EagerReason) -> u64 {
        status.num_eager[&reason]
    }

    /// The greedy next token of each logit row's sequence (its last row).
    fn next_tokens(out: &ForwardOutput, rows_per_seq: usize) -> Vec<u32> {
        let logits = out.logits.to_vec2::<f32>().unwrap();
        logits
            .chunks(rows_per_seq)
            .map(|rows| {
                let last = rows.last().unwrap();
                (0..last.len()).max_by(|&a, &b| last[a].total_cmp(&last[b])).unwrap() as u32
            })
            .collect()
    }

    /// Steps replayed from captured ones (emulated: the capture's launches run again over the
    /// entry's buffer, rewritten) compute the eager padded steps' logits, hidden states and pool
    /// writes bit for bit, on every family, over prompts (one past every shape), greedy decode
    /// steps of growing contexts and verify steps whose rows are partly kept: a key's first step
    /// runs eagerly, its second is captured, the rest replay, each writing its words into the
    /// entry's buffer (one upload, the same address every step).
    #[test]
    fn replayed_steps_compute_the_eager_steps() {
        for family in ["llama", "qwen3", "gemma3"] {
            let mut graphed = Side::new(family, GraphMode::Emulated, usize::MAX);
            let mut eager = Side::new(family, GraphMode::Off, usize::MAX);
            let mut last = vec![0u32; 3];
            for (c, len) in [(0, 12u32), (1, 20), (2, 7)] {
                let prompt: Vec<u32> = (0..len).map(|i| (i * 13 + c as u32 + 1) % 97).collect();
                let seqs = [SeqRows::chain(prompt, LogitRows::Last)];
                let (g, e) = (graphed.step(&[c], &seqs, None, None), eager.step(&[c], &seqs, None, None));
                assert_same(family, &format!("prompt {c}"), (&g, &graphed), (&e, &eager));
                last[c] = next_tokens(&e, 1)[0];
            }
            assert_eq!(eager_count(&graphed.status(), EagerReason::Shape), 1, "{family}: the 20-token prompt");
            let mut addresses = Vec::new();
            for d in 0..6 {
                let seqs: Vec<SeqRows> = last.iter().map(|&t| SeqRows::chain(vec![t], LogitRows::Last)).collect();
                let (before, uploads) = (graphed.status(), UPLOADS.with(Cell::get));
                let g = graphed.step(&[0, 1, 2], &seqs, None, None);
                assert_eq!(UPLOADS.with(Cell::get) - uploads, 1, "{family} decode {d}: one upload");
                let e = eager.step(&[0, 1, 2], &seqs, None, None);
                assert_same(family, &format!("decode {d}"), (&g, &graphed), (&e, &eager));
                let after = graphed.status();
                let moved = (
                    eager_count(&after, EagerReason::Warmup) - eager_count(&before, EagerReason::Warmup),
                    after.num_captures - before.num_captures,
                    after.num_replays - before.num_replays,
                );
                let expected = match d {
                    0 => (1, 0, 0),
                    1 => (0, 1, 0),
                    _ => (0, 0, 1),
                };
                assert_eq!(moved, expected, "{family} decode {d}: (warmups, captures, replays)");
                addresses.push(graphed.model.graph_buffer_addresses());
                last = next_tokens(&e, 1);
            }
            assert!(addresses[1].len() == 1 && addresses[1..].iter().all(|a| a == &addresses[1]), "{addresses:?}");
            for v in 0..5 {
                // Chains of 3 and a tree of 5 (its path to node 3 kept), each keeping 2 rows.
                let chain = |t: u32| SeqRows::chain(vec![t, (t + 1) % 97, (t + 2) % 97], LogitRows::All);
                let seqs = vec![
                    chain(last[0]),
                    SeqRows::tree(vec![last[1], 3, 4, 5, 6], vec![-1, 0, 0, 1, 1]),
                    chain(last[2]),
                ];
                let g = graphed.step(&[0, 1, 2], &seqs, None, Some(2));
                let e = eager.step(&[0, 1, 2], &seqs, None, Some(2));
                assert_same(family, &format!("verify {v}"), (&g, &graphed), (&e, &eager));
                let logits = e.logits.to_vec2::<f32>().unwrap();
                let argmax = |row: &Vec<f32>| (0..row.len()).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap() as u32;
                last = vec![argmax(&logits[1]), argmax(&logits[4]), argmax(&logits[9])];
            }
            let status = graphed.status();
            assert!(status.num_graphs >= 2 && status.num_replays >= 6, "{family}: {status:?}");
            assert!(status.used_bytes > 0, "{family}: each graph counts its estimate: {status:?}");
        }
    }

    /// A step whose key's entry is still held (the step before kept its carried words) runs
    /// eagerly, as does one whose carried words outgrow the entry's room, and a budget below a
    /// key's estimate keeps the key eager: each computes the eager step, and a replay's carried
    /// words read back from the entry's buffer as written.
    #[test]
    fn held_outgrown_and_over_budget_keys_run_eagerly() {
        let family = "llama";
        let mut graphed = Side::new(family, GraphMode::Emulated, usize::MAX);
        let mut eager = Side::new(family, GraphMode::Off, usize::MAX);
        let decode =
            |t: u32| -> Vec<SeqRows> { (0..3).map(|s| SeqRows::chain(vec![(t + s) % 97], LogitRows::Last)).collect() };
        let carry = |n: u32| Some(CarriedWords { words: (0..n).map(|w| w * 3 + 1).collect(), room: 4 });
        let mut both = |t: u32, carried: u32| {
            let g = graphed.step(&[0, 1, 2], &decode(t), carry(carried), None);
            let e = eager.step(&[0, 1, 2], &decode(t), carry(carried), None);
            assert_same(family, &format!("step {t}"), (&g, &graphed), (&e, &eager));
            (g, graphed.status())
        };
        both(0, 8); // warmup
        both(1, 8); // captured
        let (held, status) = both(2, 8);
        assert_eq!(status.num_replays, 1);
        let words = held.carried.as_ref().unwrap().words.narrow(0, 0, 8).unwrap().to_vec1::<u32>().unwrap();
        assert_eq!(words, carry(8).unwrap().words, "the carried words, from the entry's buffer");
        let (_, status) = both(3, 8);
        assert_eq!((status.num_replays, eager_count(&status, EagerReason::Busy)), (1, 1), "held: {status:?}");
        drop(held);
        let (_, status) = both(4, 8);
        assert_eq!(status.num_replays, 2, "released: {status:?}");
        let (_, status) = both(5, 5000);
        assert_eq!(eager_count(&status, EagerReason::Room), 1, "outgrown: {status:?}");

        let mut graphed = Side::new(family, GraphMode::Emulated, 1);
        let mut eager = Side::new(family, GraphMode::Off, usize::MAX);
        for t in 0..4 {
            let g = graphed.step(&[0, 1, 2], &decode(t), None, None);
            let e = eager.step(&[0, 1, 2], &decode(t), None, None);
            assert_same(family, &format!("over budget {t}"), (&g, &graphed), (&e, &eager));
        }
        let status = graphed.status();
        assert_eq!(
            (eager_count(&status, EagerReason::Warmup), eager_count(&status, EagerReason::Budget), status.num_graphs),
            (1, 3, 0),
            "{status:?}"
        );
        assert_eq!((status.used_bytes, status.budget_bytes), (0, 1));
    }

    /// While one step captures a key, another step of it (another thread's) runs eagerly, counted
    /// as busy; a key's first step is its warmup.
    #[test]
    fn a_key_being_captured_is_busy_for_other_steps() {
        let graphs = StepGraphs::default();
        graphs.set(GraphMode::Emulated, usize::MAX);
        let batch = ForwardBatch::new(&[SeqRows::chain(vec![1], LogitRows::Last)], &[3], Vec::new()).unwrap();
        let words = StepWords::of(&batch, &[3], &[&[0]], 16, None).unwrap();
        let plan = LaunchPlan { num_blocks: 1, taps: Vec::new(), logits: true };
        let key = GraphKey { shape: StepShape { num_seqs: 1, rows_per_seq: 1 }, table_width: 1, plan };
        assert!(matches!(graphs.plan(Some(key.clone()), &words, 0), Plan::Eager));
        assert!(matches!(graphs.plan(Some(key.clone()), &words, 0), Plan::Capture(_)));
        assert!(matches!(graphs.plan(Some(key), &words, 0), Plan::Eager));
        let status = graphs.status();
        assert_eq!((status.num_eager[&EagerReason::Warmup], status.num_eager[&EagerReason::Busy]), (1, 1));
    }

    /// The estimate counts one layer's activations, the taps and the logits of every row.
    #[test]
    fn the_activation_estimate_adds_a_layers_tensors_the_taps_and_the_logits() {
        let dims = ActivationDims { hidden: 4096, qkv: 6144, attention: 4096, ffn: 14336, vocab: 128_256 };
        // Llama-3-8B's shape, bf16, a k = 4 verify of 8 sequences (40 rows) with logits for all.
        let bytes = activation_bytes(40, 40, 1, dims, 2);
        let layer = 40 * 2 * (3 * 4096 + 6144 + 4096 + 3 * 14336);
        assert_eq!(bytes, layer + 40 * 4096 * 4 + 40 * 128_256 * 6);
        assert_eq!(activation_bytes(40, 0, 0, dims, 2), layer, "no logits, no taps");
    }
}
