//! Suffix-decoding chains of several requests looked up together, on the device where the target
//! runs: every request's tree and the engine's global tree are mirrored into one node pool there
//! (`SuffixMirror`: each tree in a region of its own), a step uploads only the nodes that changed
//! since the tree's last lookup (the tree logs them: `SuffixTree::mirror_changes`), and ONE
//! launch drafts for every request (`batch::suffix`, `cuda/suffix.cu`). A scheduler looks up its
//! requests' chains here before they plan their step (when the target runs on CUDA and at least
//! `MIN_TOGETHER` requests draft by suffix decoding); each request's `propose` then returns its
//! chain (`SuffixProposer::begin_chain`).
//!
//! Invariant: each request's chain is the one its own proposer drafts alone, token for token (the
//! lookup's reference walks the mirrored nodes by the proposer's rule, tested; a region holds
//! exactly its tree's nodes after the step's entries). A chain is only drafted ahead: a `propose`
//! it is not for drafts on the host. A failed lookup drafts nothing ahead (each request then
//! drafts alone) and forgets every region, so each tree is written whole at its next lookup.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::Device;

use super::suffix::{SuffixCache, SuffixProposer, SuffixTree};
use crate::batch::suffix::{suffix_step, SuffixStep, NODE_WORDS, NONE};
use crate::error::Result;

/// Fewest suffix requests a step looks up on the device: below it, one upload, launch and
/// download cost more than the host's walks (as for n-grams: `ngram_together::MIN_TOGETHER`).
pub const MIN_TOGETHER: usize = super::ngram_together::MIN_TOGETHER;

/// One request's chain to look up: what its next `propose(context, max_tokens)` will ask for.
pub struct SuffixJob<'a> {
    pub proposer: &'a mut SuffixProposer,
    pub context: &'a [u32],
    pub max_tokens: usize,
    /// The request's drafting seconds: its share of the shared lookup's time is added.
    pub propose_s: &'a mut f64,
}

/// Where a tree's nodes sit in the pool: slots `base..base + capacity`.
#[derive(Debug, Clone, Copy)]
struct Region {
    base: usize,
    capacity: usize,
}

/// The mirrored trees of one device: a pool of `slots` nodes `[slots, 3]` where the device is (a
/// host vector on the CPU, where the same steps run through the kernel's reference), regions
/// taken in order from its start; a region left behind (a tree grown past it, or gone) is
/// reclaimed when the pool is laid out anew, which drops every region.
pub struct SuffixMirror {
    device: Device,
    /// Whose log a tree keeps for this mirror (`SuffixTree::mirror_changes`).
    id: u64,
    pool: Pool,
    slots: usize,
    /// Slots taken by regions, live or left behind.
    used: usize,
    /// Tree id -> its region.
    regions: HashMap<u64, Region>,
}

enum Pool {
    Host(Vec<u32>),
    #[cfg(feature = "cuda")]
    Cuda(candle_core::cuda_backend::cudarc::driver::CudaSlice<u32>),
}

/// One sequence of a lookup: which trees (indices into the lookup's trees) and what it reads.
struct Lookup {
    local: usize,
    global: Option<usize>,
    chain: super::suffix::ChainLookup,
}

impl SuffixMirror {
    fn new(device: &Device) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        Self {
            device: device.clone(),
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            pool: Pool::Host(Vec::new()),
            slots: 0,
            used: 0,
            regions: HashMap::new(),
        }
    }

    /// A region for every tree of `trees` that has none that holds it, laying the pool out anew
    /// (every region dropped) where they do not fit after the used slots. Returns each tree's
    /// region and whether it is new (its tree is written whole).
    fn place(&mut self, trees: &[&mut SuffixTree]) -> Result<Vec<(Region, bool)>> {
        let fits = |regions: &HashMap<u64, Region>, tree: &SuffixTree| {
            regions.get(&tree.mirror_id()).is_some_and(|r| r.capacity >= tree.num_slots())
        };
        let capacity = |tree: &SuffixTree| tree.num_slots().next_power_of_two().max(64);
        let wanted: usize = trees.iter().filter(|t| !fits(&self.regions, t)).map(|t| capacity(t)).sum();
        if self.used + wanted > self.slots {
            // Room for twice what this step's trees take, all of them placed anew.
            let slots = (2 * trees.iter().map(|t| capacity(t)).sum::<usize>()).max(self.slots);
            #[cfg(feature = "cuda")]
            if self.device.is_cuda() {
                self.pool = Pool::Cuda(crate::batch::cuda::zeroed_pool(&self.device, slots * NODE_WORDS)?);
            }
            if !self.device.is_cuda() {
                self.pool = Pool::Host(vec![0; slots * NODE_WORDS]);
            }
            (self.slots, self.used) = (slots, 0);
            self.regions.clear();
        }
        let mut placed = Vec::with_capacity(trees.len());
        for tree in trees {
            let fresh = !fits(&self.regions, tree);
            if fresh {
                let region = Region { base: self.used, capacity: capacity(tree) };
                self.used += region.capacity;
                self.regions.insert(tree.mirror_id(), region);
            }
            placed.push((self.regions[&tree.mirror_id()], fresh));
        }
        Ok(placed)
    }

    /// One step: every tree's changed nodes written, then each lookup's chain (in order).
    fn lookup(&mut self, trees: &mut [&mut SuffixTree], lookups: &[Lookup]) -> Result<Vec<Vec<u32>>> {
        let placed = self.place(trees)?;
        let mut step = SuffixStep::default();
        for lookup in lookups {
            let slots = |tree: usize, ids: &[u32]| -> Vec<u32> {
                ids.iter().map(|&id| (placed[tree].0.base + id as usize) as u32).collect()
            };
            let local = slots(lookup.local, &lookup.chain.local);
            let global = match (lookup.global, &lookup.chain.global) {
                (Some(tree), Some(ids)) => slots(tree, ids),
                _ => Vec::new(),
            };
            let chain = &lookup.chain;
            step.push(chain.max_tokens, chain.min_token_prob, &chain.limits, &local, &global)?;
        }
        // Last, as nothing after it but the launch may fail: reading a tree's changes clears its log.
        for (tree, &(region, fresh)) in trees.iter_mut().zip(&placed) {
            let at = |id: u32| if id == NONE { NONE } else { (region.base + id as usize) as u32 };
            for (id, [count, token, best]) in tree.mirror_changes(self.id, fresh) {
                step.write(at(id), [count, token, at(best)]);
            }
        }
        let out = match &mut self.pool {
            Pool::Host(pool) => step.check_pool(self.slots).map(|()| {
                crate::model::candle::count_upload();
                suffix_step(pool, &step.words())
            }),
            #[cfg(feature = "cuda")]
            Pool::Cuda(pool) => crate::batch::cuda::suffix_step_on_device(&self.device, pool, &step),
        };
        if out.is_err() {
            // What the pool holds is unknown now (and the trees' logs were read): every tree is
            // written whole at its next lookup.
            self.regions.clear();
        }
        Ok(step.drafts(&out?))
    }
}

/// Every device's mirror (one per device the process drafts on).
static MIRRORS: Mutex<Vec<SuffixMirror>> = Mutex::new(Vec::new());

fn mirrors() -> MutexGuard<'static, Vec<SuffixMirror>> {
    MIRRORS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Forgets tree `id`'s region (its request ended, or its tree was built anew); its slots are
/// reclaimed when the pool is laid out anew.
pub(crate) fn release(id: u64) {
    for mirror in mirrors().iter_mut() {
        mirror.regions.remove(&id);
    }
}

/// Looks up `jobs`' chains together on `device` (one step of its mirror) and hands each proposer
/// its chain. Returns how many chains were drafted ahead (0 where the lookup failed: each request
/// then drafts alone).
pub fn draft_suffixes_together(device: &Device, mut jobs: Vec<SuffixJob<'_>>) -> usize {
    if jobs.is_empty() {
        return 0;
    }
    let t0 = std::time::Instant::now();
    // The global caches the jobs read, each locked once (in address order) for the whole lookup,
    // as a proposer drafting alone holds its cache while it drafts.
    let mut caches: Vec<Arc<Mutex<SuffixCache>>> =
        jobs.iter().filter_map(|job| job.proposer.global_cache().cloned()).collect();
    caches.sort_by_key(|cache| Arc::as_ptr(cache) as usize);
    caches.dedup_by(|a, b| Arc::ptr_eq(a, b));
    let mut guards: Vec<MutexGuard<SuffixCache>> =
        caches.iter().map(|cache| SuffixProposer::lock_global(cache)).collect();
    // Each job's lookup (None: the rule drafts nothing) and the cache whose tree it reads.
    let chains: Vec<Option<(Option<usize>, super::suffix::ChainLookup)>> = jobs
        .iter_mut()
        .map(|job| {
            let cache = job
                .proposer
                .global_cache()
                .map(|cache| caches.iter().position(|c| Arc::ptr_eq(c, cache)).expect("collected above"));
            let chain = job.proposer.chain_lookup(job.context, job.max_tokens, cache.map(|at| &*guards[at]))?;
            Some((cache, chain))
        })
        .collect();
    // The lookup's trees: the global ones that hold responses (those a chain reads the matches
    // of), then the requests' own.
    let mut trees: Vec<&mut SuffixTree> = Vec::new();
    let mut tree_of_cache: Vec<Option<usize>> = Vec::new();
    for guard in guards.iter_mut() {
        tree_of_cache.push(guard.tree_if_used().map(|tree| {
            trees.push(tree);
            trees.len() - 1
        }));
    }
    let mut lookups = Vec::new();
    let mut drafted_by: Vec<Option<usize>> = Vec::with_capacity(jobs.len());
    for (job, chain) in jobs.iter_mut().zip(chains) {
        let Some((global, chain)) = chain else {
            drafted_by.push(None);
            continue;
        };
        drafted_by.push(Some(lookups.len()));
        let global = global.and_then(|cache| tree_of_cache[cache]);
        lookups.push(Lookup { local: trees.len(), global, chain });
        trees.push(job.proposer.local_tree());
    }
    let drafts = {
        let mut all = mirrors();
        let at = match all.iter().position(|m| m.device.same_device(device)) {
            Some(at) => at,
            None => {
                all.push(SuffixMirror::new(device));
                all.len() - 1
            }
        };
        all[at].lookup(&mut trees, &lookups)
    };
    drop(trees);
    drop(guards);
    let Ok(mut drafts) = drafts else { return 0 };
    let num_jobs = jobs.len();
    let share = t0.elapsed().as_secs_f64() / num_jobs as f64;
    for (job, by) in jobs.into_iter().zip(drafted_by) {
        let chain = by.map(|i| std::mem::take(&mut drafts[i])).unwrap_or_default();
        job.proposer.begin_chain(job.context, job.max_tokens, chain);
        *job.propose_s += share;
    }
    num_jobs
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;
    use crate::model::candle::UPLOADS;
    use crate::proposer::Proposer;
    use crate::spec_config::SuffixParams;

    /// Requests whose contexts grow by a few tokens a step look their chains up together on the
    /// CPU's mirror (one request's context rewritten, one joining late, two finishing into the
    /// global tree, whose responses then evict each other): each `propose` returns the chain a
    /// twin proposer drafts alone on the same context and cache, and each step uploads once.
    #[test]
    fn chains_looked_up_together_are_each_requests_own() {
        chains_looked_up_together_on(&Device::Cpu);
    }

    /// The same on a GPU, where one is present (the kernel against the proposer's rule).
    #[cfg(feature = "cuda")]
    #[test]
    fn chains_looked_up_together_on_a_gpu_are_each_requests_own() {
        if crate::nvrtc::gpu_present() {
            chains_looked_up_together_on(&crate::nvrtc::open(0).unwrap());
        }
    }

    fn chains_looked_up_together_on(device: &Device) {
        let params =
            SuffixParams { max_tree_depth: 7, max_cached_requests: 2, max_spec_factor: 1.5, min_token_prob: 0.05 };
        let cache = Arc::new(Mutex::new(SuffixCache::new(7, 2)));
        let new = || SuffixProposer::new(params.clone(), cache.clone());
        let mut contexts: Vec<Vec<u32>> =
            (0..6).map(|s| (0..10 + 3 * s).map(|i| (i * (s + 1) % 4) as u32).collect()).collect();
        let (mut proposers, mut twins): (Vec<SuffixProposer>, Vec<SuffixProposer>) =
            (0..6).map(|_| (new(), new())).unzip();
        let mut finished = [false; 6];
        let (mut state, mut from_global) = (11u64, 0);
        for step in 0..14 {
            for (s, context) in contexts.iter_mut().enumerate() {
                if step == 5 && s == 2 {
                    context.reverse(); // not an extension: its tree is built anew
                }
                for _ in 0..1 + (s + step) % 3 {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    context.push(((state >> 33) % 4) as u32);
                }
            }
            // Requests 0 and 3 finish after steps 3 and 8 (their responses enter the global tree;
            // the third response evicts the first); request 5 joins at step 4.
            for (s, at) in [(0, 3), (3, 8), (1, 11)] {
                if step == at + 1 {
                    proposers[s].finish(&contexts[s][4..]);
                    finished[s] = true;
                }
            }
            let active: Vec<usize> = (0..6).filter(|&s| !finished[s] && (s != 5 || step >= 4)).collect();
            let mut times = vec![0.0; 6];
            let uploads = UPLOADS.with(Cell::get);
            let jobs: Vec<SuffixJob> = proposers
                .iter_mut()
                .zip(&contexts)
                .zip(times.iter_mut())
                .enumerate()
                .filter(|(s, _)| active.contains(s))
                .map(|(_, ((proposer, context), propose_s))| SuffixJob { proposer, context, max_tokens: 5, propose_s })
                .collect();
            assert_eq!(draft_suffixes_together(device, jobs), active.len());
            assert_eq!(UPLOADS.with(Cell::get) - uploads, 1, "step {step}: one upload");
            for &s in &active {
                let alone = twins[s].propose(&contexts[s], 5).unwrap().token_ids;
                let ahead = proposers[s].ahead.clone().expect("looked up ahead");
                assert_eq!(ahead.2, alone, "step {step}, request {s}");
                assert_eq!(proposers[s].propose(&contexts[s], 5).unwrap().token_ids, alone);
                assert!(times[s] > 0.0);
                // Drafted from the global tree where the request's own holds no such chain.
                let mut local =
                    SuffixProposer::new(SuffixParams { max_cached_requests: 0, ..params.clone() }, cache.clone());
                from_global += usize::from(local.propose(&contexts[s], 5).unwrap().token_ids != alone);
            }
        }
        assert!(from_global > 0, "some chains came from the global tree");
        assert_eq!(cache.lock().unwrap().num_cached_requests(), 2);
        // A chain for another call is not used: the proposer drafts on the host.
        let context = contexts[4].clone();
        proposers[4].begin_chain(&context, 5, vec![9, 9]);
        assert_eq!(
            proposers[4].propose(&context, 4).unwrap().token_ids,
            twins[4].propose(&context, 4).unwrap().token_ids
        );
    }

    /// After every step the pool holds each tree's every live node as the tree does (count, token,
    /// best child), however the trees changed in between: a request's appends, whole responses
    /// inserted into the global tree and evicted from it, and a best child overtaken.
    #[test]
    fn the_pool_holds_every_live_node_after_each_step() {
        let mut mirror = SuffixMirror::new(&Device::Cpu);
        let (mut local, mut global) = (SuffixTree::new(5), SuffixTree::new(5));
        let mut responses: std::collections::VecDeque<Vec<u32>> = Default::default();
        let mut state = 5u64;
        let mut next = |n: u64| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 33) % n) as u32
        };
        for step in 0..40 {
            let appended: Vec<u32> = (0..1 + next(3)).map(|_| next(3)).collect();
            local.extend(&appended);
            let response: Vec<u32> = (0..3 + next(6)).map(|_| next(3)).collect();
            global.insert(&response);
            responses.push_back(response);
            if step % 3 == 2 {
                global.remove(&responses.pop_front().unwrap());
            }
            let uploads = UPLOADS.with(Cell::get);
            mirror.lookup(&mut [&mut global, &mut local], &[]).unwrap();
            assert_eq!(UPLOADS.with(Cell::get) - uploads, 1);
            let pool = match &mirror.pool {
                Pool::Host(pool) => pool,
                #[cfg(feature = "cuda")]
                Pool::Cuda(_) => unreachable!("the CPU's mirror"),
            };
            for tree in [&mut global, &mut local] {
                let base = mirror.regions[&tree.mirror_id()].base;
                for id in 0..tree.num_slots() as u32 {
                    let [count, token, best] = tree.mirror_entry(id);
                    if count > 0 {
                        let best = if best == NONE { NONE } else { base as u32 + best };
                        let held = &pool[(base + id as usize) * NODE_WORDS..][..NODE_WORDS];
                        assert_eq!(held, [count, token, best], "step {step}, node {id}");
                    }
                }
            }
        }
    }

    /// A mirror whose pool is full lays it out anew and writes every tree of the step whole; a
    /// tree grown past its region moves to a new one; regions of released trees are dropped.
    #[test]
    fn a_full_pool_is_laid_out_anew_and_its_trees_written_whole() {
        let mut mirror = SuffixMirror::new(&Device::Cpu);
        let mut a = SuffixTree::new(4);
        let mut b = SuffixTree::new(4);
        a.extend(&[1, 2, 3]);
        b.extend(&[4, 5]);
        let placed = mirror.place(&[&mut a, &mut b]).unwrap();
        assert!(placed.iter().all(|&(_, fresh)| fresh));
        assert_eq!(mirror.slots, 256, "twice the two regions of 64");
        let mut c = SuffixTree::new(4);
        c.extend(&[6]);
        // a and b fit where they are; c takes the next 64 slots.
        let placed = mirror.place(&[&mut a, &mut b, &mut c]).unwrap();
        assert_eq!(
            placed.iter().map(|&(r, fresh)| (r.base, fresh)).collect::<Vec<_>>(),
            [(0, false), (64, false), (128, true)]
        );
        // a grows past 64 slots: it moves to a new region of 128, which does not fit: all anew.
        a.extend(&(0..40).collect::<Vec<u32>>());
        assert!(a.num_slots() > 64);
        let placed = mirror.place(&[&mut a, &mut c]).unwrap();
        assert_eq!(
            placed.iter().map(|&(r, fresh)| (r.base, r.capacity, fresh)).collect::<Vec<_>>(),
            [(0, 256, true), (256, 64, true)]
        );
        assert_eq!(mirror.slots, 640);
        assert!(!mirror.regions.contains_key(&b.mirror_id()), "b was not in the step");
    }
}
