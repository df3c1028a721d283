//! N-gram chains of several requests looked up together, on the device where the target runs:
//! each request's history lives in a row of a pool there (`NgramHistories`), a step uploads only
//! what each history gained since its last lookup, and ONE launch drafts for every request
//! (`batch::ngram`, `cuda/ngram.cu`). A scheduler looks up its requests' chains here before they
//! plan their step (when the target runs on CUDA and at least `MIN_TOGETHER` requests draft by
//! n-gram); each request's `propose` then returns its chain (`NgramProposer::begin_chain`).
//!
//! Invariant: each request's chain is the one its own proposer drafts alone, token for token (the
//! lookup's reference is the proposer's rule, tested; a pool row holds exactly the request's
//! context after the step's appends). A chain is only drafted ahead: a `propose` it is not for
//! undoes it. A failed lookup drafts nothing ahead; each request then drafts alone.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use candle_core::Device;

use super::ngram::NgramProposer;
use super::IndexedTail;
use crate::batch::ngram::{ngram_step, NgramStep};
use crate::error::Result;

/// Fewest n-gram requests a step looks up on the device: below it, one upload, launch and
/// download cost more than the host's incremental lookups.
pub const MIN_TOGETHER: usize = 8;

/// One request's chain to look up: what its next `propose(context, max_tokens)` will ask for.
pub struct NgramJob<'a> {
    pub proposer: &'a mut NgramProposer,
    pub context: &'a [u32],
    pub max_tokens: usize,
    /// The request's drafting seconds: its share of the shared lookup's time is added.
    pub propose_s: &'a mut f64,
}

/// A new id per n-gram proposer: its row in the pool of each device it drafts on.
pub(crate) fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// One row of the pool: whose history it holds and how much of it.
struct Row {
    row: usize,
    /// Tokens of the request's context the row holds.
    held: usize,
    /// The newest of them, to notice a context that is not an extension of the held one.
    tail: IndexedTail,
}

/// The histories of one device's n-gram requests, `[rows, max_len]` tokens where the device is
/// (a host vector on the CPU, where the same steps run through the kernel's reference).
pub struct NgramHistories {
    device: Device,
    pool: Pool,
    rows: usize,
    max_len: usize,
    /// Proposer id -> its row.
    held: HashMap<u64, Row>,
    free: Vec<usize>,
}

enum Pool {
    Host(Vec<u32>),
    #[cfg(feature = "cuda")]
    Cuda(candle_core::cuda_backend::cudarc::driver::CudaSlice<u32>),
}

impl NgramHistories {
    fn new(device: &Device) -> Self {
        Self {
            device: device.clone(),
            pool: Pool::Host(Vec::new()),
            rows: 0,
            max_len: 0,
            held: HashMap::new(),
            free: Vec::new(),
        }
    }

    /// A pool of at least `rows` x `max_len`; when it grows, every row is uploaded again whole.
    fn reserve(&mut self, rows: usize, max_len: usize) -> Result<()> {
        if rows <= self.rows && max_len <= self.max_len {
            return Ok(());
        }
        let rows = rows.max(self.rows).next_power_of_two().max(MIN_TOGETHER);
        let max_len = max_len.max(self.max_len).next_multiple_of(1024);
        #[cfg(feature = "cuda")]
        if self.device.is_cuda() {
            self.pool = Pool::Cuda(crate::batch::cuda::zeroed_pool(&self.device, rows * max_len)?);
        }
        if !self.device.is_cuda() {
            self.pool = Pool::Host(vec![0; rows * max_len]);
        }
        self.free.extend(self.rows..rows);
        (self.rows, self.max_len) = (rows, max_len);
        for row in self.held.values_mut() {
            row.held = 0;
        }
        Ok(())
    }

    /// The drafts of `requests` (proposer id, context, k, [min_n, max_n]), in order: one step.
    fn lookup(&mut self, requests: &[(u64, &[u32], usize, [usize; 2])]) -> Result<Vec<Vec<u32>>> {
        let new_rows = requests.iter().filter(|(id, ..)| !self.held.contains_key(id)).count();
        let longest = requests.iter().map(|(_, context, ..)| context.len()).max().unwrap_or(0);
        self.reserve(self.held.len() + new_rows, longest)?;
        let mut step = NgramStep::default();
        for &(id, context, k, ns) in requests {
            if !self.held.contains_key(&id) {
                let row = self.free.pop().expect("reserve left a free row for every new request");
                self.held.insert(id, Row { row, held: 0, tail: IndexedTail::default() });
            }
            let row = self.held.get_mut(&id).expect("inserted above");
            let keep = if row.held <= context.len() && row.tail.agrees(context) { row.held } else { 0 };
            step.push(row.row, keep, &context[keep..], k, ns)?;
            row.held = context.len();
            row.tail.record(context);
        }
        let out = match &mut self.pool {
            Pool::Host(pool) => step.check_pool(self.rows, self.max_len).map(|()| {
                crate::model::candle::count_upload();
                ngram_step(pool, self.max_len, &step.words())
            }),
            #[cfg(feature = "cuda")]
            Pool::Cuda(pool) => crate::batch::cuda::ngram_step_on_device(&self.device, pool, self.max_len, &step),
        };
        if out.is_err() {
            // What the rows hold is unknown now: each is uploaded whole at its next lookup.
            for (id, ..) in requests {
                self.held.get_mut(id).expect("inserted above").held = 0;
            }
        }
        Ok(step.drafts(&out?))
    }

    fn release(&mut self, id: u64) {
        if let Some(row) = self.held.remove(&id) {
            self.free.push(row.row);
        }
    }
}

/// Every device's histories (one per device the process drafts on).
static HISTORIES: Mutex<Vec<NgramHistories>> = Mutex::new(Vec::new());

/// Frees proposer `id`'s rows (its request ended).
pub(crate) fn release(id: u64) {
    let mut all = HISTORIES.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    for histories in all.iter_mut() {
        histories.release(id);
    }
}

/// Looks up `jobs`' chains together on `device` (one step of its pool) and hands each proposer
/// its chain. Returns how many chains were drafted ahead (0 where the lookup failed: each request
/// then drafts alone).
pub fn draft_ngrams_together(device: &Device, jobs: Vec<NgramJob<'_>>) -> usize {
    if jobs.is_empty() {
        return 0;
    }
    let t0 = std::time::Instant::now();
    let requests: Vec<(u64, &[u32], usize, [usize; 2])> = jobs
        .iter()
        .map(|job| (job.proposer.id(), job.context, job.max_tokens, job.proposer.lookup_lengths()))
        .collect();
    let drafts = {
        let mut all = HISTORIES.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let at = match all.iter().position(|h| h.device.same_device(device)) {
            Some(at) => at,
            None => {
                all.push(NgramHistories::new(device));
                all.len() - 1
            }
        };
        all[at].lookup(&requests)
    };
    let Ok(drafts) = drafts else { return 0 };
    let num_jobs = jobs.len();
    let share = t0.elapsed().as_secs_f64() / num_jobs as f64;
    for (job, draft) in jobs.into_iter().zip(drafts) {
        job.proposer.begin_chain(job.context, job.max_tokens, draft);
        *job.propose_s += share;
    }
    num_jobs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::candle::UPLOADS;
    use crate::proposer::Proposer;
    use std::cell::Cell;

    /// Requests whose contexts grow by a few tokens a step (one rewritten, one joining late, one
    /// leaving) look their chains up together on the CPU's pool: each `propose` returns the chain
    /// a fresh proposer drafts on the same context, and each step uploads once, only the tokens
    /// the histories gained.
    #[test]
    fn chains_looked_up_together_are_each_requests_own() {
        let device = Device::Cpu;
        let mut contexts: Vec<Vec<u32>> =
            (0..5).map(|s| (0..20 + 3 * s).map(|i| (i * (s + 1) % 5) as u32).collect()).collect();
        let mut proposers: Vec<NgramProposer> = (0..5).map(|s| NgramProposer::new(1, 2 + s % 3)).collect();
        let mut histories = NgramHistories::new(&device);
        let mut state = 7u64;
        for step in 0..10 {
            for (s, context) in contexts.iter_mut().enumerate() {
                if step == 4 && s == 2 {
                    context.reverse(); // not an extension: its row is uploaded whole
                }
                for _ in 0..1 + (s + step) % 3 {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    context.push(((state >> 33) % 4) as u32);
                }
            }
            // Request 4 joins at step 3; request 0 leaves after step 6.
            let active: Vec<usize> = (0..5).filter(|&s| (s != 4 || step >= 3) && (s != 0 || step <= 6)).collect();
            if step == 7 {
                histories.release(proposers[0].id());
            }
            let requests: Vec<(u64, &[u32], usize, [usize; 2])> = active
                .iter()
                .map(|&s| (proposers[s].id(), &contexts[s][..], 4, proposers[s].lookup_lengths()))
                .collect();
            let uploads = UPLOADS.with(Cell::get);
            let drafts = histories.lookup(&requests).unwrap();
            assert_eq!(UPLOADS.with(Cell::get) - uploads, 1, "step {step}: one upload");
            for (&s, draft) in active.iter().zip(drafts) {
                let alone = NgramProposer::new(1, 2 + s % 3).propose(&contexts[s], 4).unwrap().token_ids;
                assert_eq!(draft, alone, "step {step}, request {s}");
                proposers[s].begin_chain(&contexts[s], 4, draft.clone());
                assert_eq!(proposers[s].propose(&contexts[s], 4).unwrap().token_ids, draft);
                let row = &histories.held[&proposers[s].id()];
                let pool = match &histories.pool {
                    Pool::Host(pool) => pool,
                    #[cfg(feature = "cuda")]
                    Pool::Cuda(_) => unreachable!("the histories of the CPU device"),
                };
                assert_eq!(&pool[row.row * histories.max_len..][..contexts[s].len()], &contexts[s][..]);
            }
        }
        assert_eq!(histories.held.len(), 4, "request 0's row was released");
        // A chain for another call is not used: the proposer drafts on the host.
        let context = contexts[1].clone();
        proposers[1].begin_chain(&context, 4, vec![9, 9]);
        assert_eq!(
            proposers[1].propose(&context, 3).unwrap().token_ids,
            NgramProposer::new(1, 3).propose(&context, 3).unwrap().token_ids
        );
    }

    /// `draft_ngrams_together` on the CPU's shared histories hands every proposer its chain.
    #[test]
    fn the_shared_histories_draft_ahead_for_every_job() {
        let contexts: Vec<Vec<u32>> = (0..3).map(|s| [1, 2, 3, 1, 2, s].to_vec()).collect();
        let mut proposers: Vec<NgramProposer> = (0..3).map(|_| NgramProposer::new(1, 3)).collect();
        let mut times = [0.0f64; 3];
        let jobs: Vec<NgramJob> = proposers
            .iter_mut()
            .zip(&contexts)
            .zip(&mut times)
            .map(|((proposer, context), propose_s)| NgramJob { proposer, context, max_tokens: 3, propose_s })
            .collect();
        assert_eq!(draft_ngrams_together(&Device::Cpu, jobs), 3);
        for (proposer, context) in proposers.iter_mut().zip(&contexts) {
            assert!(proposer.ahead.is_some());
            let expected = NgramProposer::new(1, 3).propose(context, 3).unwrap().token_ids;
            assert_eq!(proposer.propose(context, 3).unwrap().token_ids, expected);
        }
        assert!(times.iter().all(|&t| t > 0.0));
    }
}
