//! How the scheduler counts target KV memory: in positions under the contiguous layout (bounded
//! by `max_kv_tokens`), in blocks of the engine's pool under the paged one (bounded by the pool,
//! and by `max_kv_tokens` rounded down to whole blocks). A sequence's next rows cost what its
//! store will take for them: as many positions, or the blocks past the ones it holds.
//!
//! Invariant: what the scheduler grants a step fits what is left, in the unit the store
//! allocates, so a paged pool never runs out under the scheduler (out of blocks would fail a
//! request; the scheduler preempts instead). Shared prefix blocks count once: the pool's held
//! blocks are the measure, not a sum over sequences.

use std::sync::Arc;

use super::Engine;
use crate::error::{Error, Result};
use crate::kv_cache::PagedPool;

pub(crate) enum KvAccount {
    /// Positions; `budget` None: no bound but each request's context.
    Positions { budget: Option<usize> },
    /// Blocks of the engine's pool; `budget` <= the pool's blocks.
    Blocks { pool: Arc<PagedPool>, budget: usize },
}

impl KvAccount {
    /// The account of `engine`'s layout under the scheduler's `max_kv_tokens`.
    pub(crate) fn of(engine: &Engine, max_kv_tokens: Option<usize>) -> Result<Self> {
        let Some(pool) = engine.kv_pool() else { return Ok(KvAccount::Positions { budget: max_kv_tokens }) };
        let budget =
            max_kv_tokens.map_or(pool.num_blocks(), |tokens| (tokens / pool.block_size()).min(pool.num_blocks()));
        if budget == 0 {
            return Err(Error::config(format!(
                "max_kv_tokens ({}) is less than one block of the paged KV cache ({} positions): raise it to a \
                 multiple of the block size",
                max_kv_tokens.unwrap_or(0),
                pool.block_size()
            )));
        }
        Ok(KvAccount::Blocks { pool: pool.clone(), budget })
    }

    /// Units the scheduler may hand out in all (`usize::MAX`: no bound).
    pub(crate) fn budget(&self) -> usize {
        match self {
            KvAccount::Positions { budget } => budget.unwrap_or(usize::MAX),
            KvAccount::Blocks { budget, .. } => *budget,
        }
    }

    /// Units held now, given the positions each running sequence holds.
    pub(crate) fn held(&self, lens: impl Iterator<Item = usize>) -> usize {
        match self {
            KvAccount::Positions { .. } => lens.sum(),
            KvAccount::Blocks { pool, .. } => pool.num_blocks() - pool.num_free(),
        }
    }

    /// Units a sequence holding `len` positions takes to hold `rows` more.
    pub(crate) fn growth(&self, len: usize, rows: usize) -> usize {
        match self {
            KvAccount::Positions { .. } => rows,
            KvAccount::Blocks { pool, .. } => pool.blocks_for(len + rows) - pool.blocks_for(len),
        }
    }

    /// Units a new sequence of `len` positions takes when its first `shared_len` are another
    /// sequence's (`share_prefix`): a copy under the contiguous layout, the full blocks shared
    /// by reference under the paged one.
    pub(crate) fn new_sequence_cost(&self, len: usize, shared_len: usize) -> usize {
        match self {
            KvAccount::Positions { .. } => len,
            KvAccount::Blocks { pool, .. } => pool.blocks_for(len) - shared_len / pool.block_size(),
        }
    }

    /// The most rows a sequence holding `len` positions can add within `units` more.
    pub(crate) fn rows_within(&self, len: usize, units: usize) -> usize {
        match self {
            KvAccount::Positions { .. } => units,
            KvAccount::Blocks { pool, .. } => {
                (pool.blocks_for(len).saturating_add(units)).saturating_mul(pool.block_size()) - len
            }
        }
    }

    /// A `ContextLength` error when a request of `needed` positions could never fit, even alone.
    pub(crate) fn check_fits_alone(&self, prompt_len: usize, max_tokens: usize) -> Result<()> {
        let needed = prompt_len + max_tokens;
        let (fits, max_kv) = match self {
            KvAccount::Positions { budget: None } => return Ok(()),
            KvAccount::Positions { budget: Some(budget) } => (needed <= *budget, *budget),
            KvAccount::Blocks { pool, budget } => (pool.blocks_for(needed) <= *budget, budget * pool.block_size()),
        };
        if fits {
            return Ok(());
        }
        Err(Error::ContextLength(format!(
            "this request needs up to {needed} KV positions ({prompt_len} in the prompt, {max_tokens} max_tokens) but \
             the scheduler holds at most {max_kv} (max_kv_tokens); shorten the prompt, lower max_tokens or raise \
             max_kv_tokens"
        )))
    }
}
