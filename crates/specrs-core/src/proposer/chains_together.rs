//! Draft-model chains of several requests drafted together: per depth, one forward of each draft
//! model over every request still drafting with it (the first over each request's unseen
//! context), so a draft model's weights are read once per depth for all of its requests, not
//! once per request. A scheduler drafts its requests' chains here before they plan their step;
//! each request's `propose` then returns its chain (`DraftModelProposer::begin_chain`).
//!
//! Invariant: each request's chain is the one it drafts alone, token for token and q row for q
//! row: it draws from its own sampler, and a row's logits do not depend on the other sequences
//! of a forward (model/forward.rs; bitwise on the CPU backend). A chain is only drafted ahead:
//! a `propose` it is not for undoes it. A failed shared forward undoes every chain of that
//! forward; each request then drafts alone and meets its own error, if any.

use std::sync::Arc;
use std::time::Instant;

use crate::proposer::draft_model::{DraftCache, DraftModelProposer};

/// One request's chain to draft: what its next `propose(context, max_tokens)` will ask for.
pub struct ChainJob<'a> {
    pub drafter: &'a mut DraftModelProposer,
    pub context: &'a [u32],
    pub max_tokens: usize,
    /// The request's drafting seconds: its share of the shared forwards' time is added.
    pub propose_s: &'a mut f64,
}

/// What `draft_chains_together` drafted: chains drafted in shared forwards, and those forwards.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChainsDrafted {
    pub num_chains: usize,
    pub num_forwards: usize,
}

/// Drafts `jobs` together, one forward per draft model and depth. A draft model with one job
/// drafts nothing here: its request's `propose` drafts it alone, as always.
pub fn draft_chains_together(mut jobs: Vec<ChainJob<'_>>) -> ChainsDrafted {
    let mut drafted = ChainsDrafted::default();
    while let Some(first) = jobs.first() {
        let model = first.drafter.cache.model.clone();
        let (group, rest): (Vec<ChainJob>, Vec<ChainJob>) =
            jobs.into_iter().partition(|job| Arc::ptr_eq(&job.drafter.cache.model, &model));
        jobs = rest;
        if group.len() > 1 {
            let group_drafted = draft_group(group);
            drafted.num_chains += group_drafted.num_chains;
            drafted.num_forwards += group_drafted.num_forwards;
        }
    }
    drafted
}

/// The chains of one draft model's jobs, in lockstep: a job leaves the forwards once its chain is
/// complete (at its length, or after a token below its confidence threshold).
fn draft_group(mut group: Vec<ChainJob<'_>>) -> ChainsDrafted {
    let t0 = Instant::now();
    // (job, the tokens its next forward feeds), in job order.
    let mut feeds: Vec<(usize, Vec<u32>)> = group
        .iter_mut()
        .enumerate()
        .filter_map(|(i, job)| job.drafter.begin_chain(job.context, job.max_tokens).map(|feed| (i, feed)))
        .collect();
    let began: Vec<usize> = feeds.iter().map(|(i, _)| *i).collect();
    let mut num_forwards = 0;
    while !feeds.is_empty() {
        let logits = {
            let live: Vec<usize> = feeds.iter().map(|(i, _)| *i).collect();
            let mut caches: Vec<&mut DraftCache> = group
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| live.contains(i))
                .map(|(_, job)| &mut job.drafter.cache)
                .collect();
            let tokens: Vec<&[u32]> = feeds.iter().map(|(_, feed)| feed.as_slice()).collect();
            DraftCache::forward_together(&mut caches, &tokens)
        };
        num_forwards += 1;
        let Ok(logits) = logits else {
            group.iter_mut().for_each(|job| job.drafter.undo_chain());
            return ChainsDrafted { num_chains: 0, num_forwards };
        };
        feeds = feeds
            .into_iter()
            .zip(logits)
            .filter_map(|((i, _), row)| group[i].drafter.chain_step(&row).map(|next| (i, vec![next])))
            .collect();
    }
    let share = t0.elapsed().as_secs_f64() / began.len().max(1) as f64;
    for &i in &began {
        *group[i].propose_s += share;
    }
    ChainsDrafted { num_chains: began.len(), num_forwards }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;
    use crate::config::SamplingParams;
    use crate::gguf::GgufFile;
    use crate::model::CausalLm;
    use crate::proposer::draft_model::DraftDrawing;
    use crate::proposer::{Draft, Feedback, Proposer};
    use crate::spec_config::Verification;

    /// The golden tiny llama (hidden 64, 2 layers) on the CPU decoder, whose rows are bitwise the
    /// same whatever else is in the forward.
    fn draft_model() -> Arc<dyn CausalLm> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/golden/gguf/llama-q8_0.gguf");
        Arc::from(crate::model::loader::load(&mut GgufFile::open(path).unwrap(), &Device::Cpu).unwrap())
    }

    /// (sampling settings, how its draft draws, context, max_tokens) of each request: sampled
    /// ones drawn for rejection sampling (q rows) and coupled, with a confidence threshold.
    fn requests() -> Vec<(SamplingParams, DraftDrawing, Vec<u32>, usize)> {
        let sampled = |seed| SamplingParams { temperature: 0.9, seed: Some(seed), ..SamplingParams::greedy(32) };
        let rejection = DraftDrawing { confidence_threshold: 0.0, verification: Verification::Rejection };
        let coupled_cut = DraftDrawing { confidence_threshold: 0.2, verification: Verification::Auto };
        vec![
            (SamplingParams::greedy(32), DraftDrawing::COUPLED, vec![1, 2, 3, 4, 5, 6, 7], 4),
            (sampled(7), rejection, vec![9, 8], 3),
            (sampled(8), coupled_cut, (0..40).map(|i| i % 45).collect(), 4),
            (SamplingParams::greedy(32), DraftDrawing::COUPLED, vec![30, 31, 32, 33], 1),
        ]
    }

    fn proposers(model: &Arc<dyn CausalLm>) -> Vec<DraftModelProposer> {
        requests()
            .iter()
            .map(|(params, drawing, context, _)| {
                let vocab = model.info().vocab_size;
                let mut p = DraftModelProposer::new(model.clone(), None, vocab, *drawing, Arc::default());
                p.begin(&context[..1], params).unwrap();
                p
            })
            .collect()
    }

    /// Two steps of each request: `draft` makes every request's chain, then each request keeps its
    /// first accepted tokens and its context grows by them.
    fn two_steps(mut draft: impl FnMut(&mut [DraftModelProposer], &[Vec<u32>], &[usize]) -> Vec<Draft>) -> Vec<Draft> {
        let model = draft_model();
        let mut proposers = proposers(&model);
        let mut contexts: Vec<Vec<u32>> = requests().into_iter().map(|r| r.2).collect();
        let lengths: Vec<usize> = requests().iter().map(|r| r.3).collect();
        let mut drafts = Vec::new();
        for _ in 0..2 {
            let step = draft(&mut proposers, &contexts, &lengths);
            for ((proposer, context), d) in proposers.iter_mut().zip(&mut contexts).zip(&step) {
                let kept = d.token_ids.len() / 2;
                proposer.observe(&Feedback::accepted(kept, &d.token_ids[..kept], &[])).unwrap();
                context.extend_from_slice(&d.token_ids[..kept]);
                context.push(7);
            }
            drafts.extend(step);
        }
        drafts
    }

    fn alone(proposers: &mut [DraftModelProposer], contexts: &[Vec<u32>], lengths: &[usize]) -> Vec<Draft> {
        proposers.iter_mut().zip(contexts).zip(lengths).map(|((p, c), &n)| p.propose(c, n).unwrap()).collect()
    }

    /// Every request's chain drafted together, `longer` tokens longer than `lengths`; what was
    /// drafted, and each request's drafting seconds.
    fn together(
        proposers: &mut [DraftModelProposer],
        contexts: &[Vec<u32>],
        lengths: &[usize],
        longer: usize,
    ) -> (ChainsDrafted, Vec<f64>) {
        let mut seconds = vec![0.0; proposers.len()];
        let jobs = proposers
            .iter_mut()
            .zip(contexts)
            .zip(lengths)
            .zip(&mut seconds)
            .map(|(((drafter, context), &n), propose_s)| ChainJob {
                drafter,
                context,
                max_tokens: n + longer,
                propose_s,
            })
            .collect();
        (draft_chains_together(jobs), seconds)
    }

    fn assert_same_drafts(expected: &[Draft], got: &[Draft]) {
        for (a, t) in expected.iter().zip(got) {
            assert_eq!((&a.token_ids, &a.probs), (&t.token_ids, &t.probs));
        }
    }

    #[test]
    fn chains_drafted_together_are_the_chains_drafted_alone_in_one_forward_per_depth() {
        let expected = two_steps(alone);
        let mut steps = Vec::new();
        let drafts = two_steps(|proposers, contexts, lengths| {
            let (drafted, seconds) = together(proposers, contexts, lengths, 0);
            assert!(seconds.iter().all(|&s| s > 0.0), "each request is charged its share: {seconds:?}");
            steps.push(drafted);
            alone(proposers, contexts, lengths)
        });
        assert_same_drafts(&expected, &drafts);
        assert!(expected.iter().any(|d| d.probs.is_some()), "sampled requests draft with q rows");
        // One forward per depth: as many as the longest chain, not one per request and token.
        assert_eq!(steps[0], ChainsDrafted { num_chains: 4, num_forwards: 4 });
        let longest = drafts[4..].iter().map(|d| d.token_ids.len()).max().unwrap();
        assert_eq!(steps[1], ChainsDrafted { num_chains: 4, num_forwards: longest });
    }

    #[test]
    fn a_chain_drafted_for_other_arguments_is_undone_and_drafted_again_as_alone() {
        let expected = two_steps(alone);
        // Every chain one token longer than the propose that follows asks for.
        let drafts = two_steps(|proposers, contexts, lengths| {
            together(proposers, contexts, lengths, 1);
            alone(proposers, contexts, lengths)
        });
        assert_same_drafts(&expected, &drafts);
    }

    #[test]
    fn a_draft_model_with_one_request_drafts_at_its_propose() {
        let model = draft_model();
        let mut proposers = proposers(&model);
        let mut seconds = 0.0;
        let context = requests()[0].2.clone();
        let job = ChainJob { drafter: &mut proposers[0], context: &context, max_tokens: 4, propose_s: &mut seconds };
        assert_eq!(draft_chains_together(vec![job]), ChainsDrafted::default());
        assert_eq!(proposers[0].kv_len(), Some(0), "nothing drafted ahead");
    }
}
