// Batched acceptance on the device: one block per sequence.
// The CPU reference, with the full contract, is crates/specrs-core/src/batch/accept.rs; this kernel
// computes the same function: greedy (temperature 0) or rejection sampling against
// softmax(logits / temperature), with the random draws passed in as `uniforms`.
// Compiled at run time with NVRTC after cuda/block.cuh (BLOCK, block_max, block_sum). blockDim.x
// must be BLOCK.

// -inf without math.h (NVRTC compiles without headers).
#define NEG_INF __int_as_float(0xff800000)

__device__ unsigned int block_min_index(unsigned int i, unsigned int* scratch) {
    scratch[threadIdx.x] = i;
    __syncthreads();
    for (int stride = BLOCK / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) scratch[threadIdx.x] = min(scratch[threadIdx.x], scratch[threadIdx.x + stride]);
        __syncthreads();
    }
    unsigned int result = scratch[0];
    __syncthreads();
    return result;
}

// Index of the largest logit; the lowest index wins ties (as argmax in sampler.rs).
__device__ unsigned int block_argmax(const float* row, unsigned int v, float* fscratch, unsigned int* uscratch) {
    float best = NEG_INF;
    for (unsigned int j = threadIdx.x; j < v; j += BLOCK) best = fmaxf(best, row[j]);
    best = block_max(best, fscratch);
    unsigned int first = 0xffffffffu;
    for (unsigned int j = threadIdx.x; j < v; j += BLOCK) {
        if (row[j] == best) { first = j; break; }
    }
    return block_min_index(first, uscratch);
}

// The max logit and the softmax denominator sum_j exp((x_j - max) / T) of one row.
__device__ void softmax_stats(const float* row, unsigned int v, float inv_t, float* max_out, float* total_out,
                              float* scratch) {
    float m = NEG_INF;
    for (unsigned int j = threadIdx.x; j < v; j += BLOCK) m = fmaxf(m, row[j]);
    m = block_max(m, scratch);
    float total = 0.0f;
    for (unsigned int j = threadIdx.x; j < v; j += BLOCK) total += expf((row[j] - m) * inv_t);
    *max_out = m;
    *total_out = block_sum(total, scratch);
}

// Target probability p_j = exp((x_j - max) / T) / total, as sampler::probabilities computes it.
__device__ float target_prob(const float* row, unsigned int j, float max, float inv_t, float total) {
    return expf((row[j] - max) * inv_t) / total;
}

// Weight of token j in the distribution a token is drawn from: the residual max(0, p - q) after a
// rejection of `rejected` (q one-hot without draft probabilities), or p itself (rejected < 0).
__device__ float draw_weight(const float* row, const float* q_row, int rejected, unsigned int j,
                             float max, float inv_t, float total, bool residual) {
    float p = target_prob(row, j, max, inv_t, total);
    if (!residual) return p;
    if (q_row != 0) return fmaxf(p - q_row[j], 0.0f);
    return (int)j == rejected ? 0.0f : p;
}

// One BLOCK-wide piece of an inverse-CDF scan, thread i holding weight w of index j: the first
// index whose running weight sum (from *offset) passes `goal` with a nonzero weight, or 0xffffffff
// when none in this piece does; then *offset gains the piece's weight and *last_nonzero rises to
// its last index with a nonzero weight.
__device__ unsigned int scan_piece(float w, unsigned int j, float* offset, float goal, unsigned int* last_nonzero,
                                   float* fscratch, unsigned int* uscratch) {
    // Inclusive scan of the piece (Hillis-Steele).
    fscratch[threadIdx.x] = w;
    __syncthreads();
    for (int stride = 1; stride < BLOCK; stride <<= 1) {
        float add = threadIdx.x >= stride ? fscratch[threadIdx.x - stride] : 0.0f;
        __syncthreads();
        fscratch[threadIdx.x] += add;
        __syncthreads();
    }
    float cumulative = *offset + fscratch[threadIdx.x];
    float piece_total = fscratch[BLOCK - 1];
    __syncthreads();
    unsigned int hit = (w > 0.0f && cumulative > goal) ? j : 0xffffffffu;
    hit = block_min_index(hit, uscratch);
    if (hit != 0xffffffffu) return hit;
    unsigned int nonzero = (w > 0.0f) ? j : 0u;
    // block max of `nonzero` through the min reduction on its complement
    unsigned int last = 0xffffffffu - block_min_index(0xffffffffu - nonzero, uscratch);
    if (last > *last_nonzero) *last_nonzero = last;
    *offset += piece_total;
    return 0xffffffffu;
}

// Inverse-CDF draw (sampler::draw_with): the first index whose running weight sum passes
// uniform * total weight, skipping zero weights; the last nonzero index if rounding runs past it.
__device__ unsigned int block_draw(const float* row, const float* q_row, int rejected, unsigned int v,
                                   float max, float inv_t, float total, bool residual, float uniform,
                                   float* fscratch, unsigned int* uscratch) {
    float mass = 0.0f;
    for (unsigned int j = threadIdx.x; j < v; j += BLOCK)
        mass += draw_weight(row, q_row, rejected, j, max, inv_t, total, residual);
    mass = block_sum(mass, fscratch);
    float target = uniform * mass;
    float offset = 0.0f;
    unsigned int last_nonzero = 0;
    for (unsigned int base = 0; base < v; base += BLOCK) {
        unsigned int j = base + threadIdx.x;
        float w = j < v ? draw_weight(row, q_row, rejected, j, max, inv_t, total, residual) : 0.0f;
        unsigned int hit = scan_piece(w, j, &offset, target, &last_nonzero, fscratch, uscratch);
        if (hit != 0xffffffffu) return hit;
    }
    return last_nonzero;
}

extern "C" __global__ void accept_kernel(
    const float* target_logits,             // [batch, k + 1, v]
    const unsigned int* draft_token_ids,    // [batch, k]
    const unsigned int* num_draft_tokens,   // [batch]
    const float* draft_probs,               // [batch, k, v], read only when has_draft_probs
    const float* temperatures,              // [batch]; 0 = greedy
    const float* uniforms,                  // [batch, k + 1]
    unsigned int k,
    unsigned int v,
    unsigned int has_draft_probs,
    unsigned int* num_accepted_tokens,      // [batch] out
    unsigned int* next_token_ids)           // [batch] out
{
    __shared__ float fscratch[BLOCK];
    __shared__ unsigned int uscratch[BLOCK];
    unsigned int s = blockIdx.x;
    const float* logits = target_logits + (size_t)s * (k + 1) * v;
    const unsigned int* drafts = draft_token_ids + (size_t)s * k;
    const float* u = uniforms + (size_t)s * (k + 1);
    unsigned int n = num_draft_tokens[s];
    float temperature = temperatures[s];
    unsigned int accepted = n;
    unsigned int next = 0;

    if (temperature <= 0.0f) {
        for (unsigned int i = 0; i <= n; i++) {
            unsigned int target = block_argmax(logits + (size_t)i * v, v, fscratch, uscratch);
            if (i == n || target != drafts[i]) { accepted = i; next = target; break; }
        }
    } else {
        float inv_t = 1.0f / temperature;
        bool done = false;
        for (unsigned int i = 0; i < n && !done; i++) {
            const float* row = logits + (size_t)i * v;
            const float* q_row = has_draft_probs ? draft_probs + ((size_t)s * k + i) * v : 0;
            float m, total;
            softmax_stats(row, v, inv_t, &m, &total, fscratch);
            unsigned int x = drafts[i];
            float p_x = target_prob(row, x, m, inv_t, total);
            float q_x = q_row != 0 ? q_row[x] : 1.0f;
            if (u[i] * q_x < p_x) continue;
            // Rejected: the recovered token comes from norm(max(0, p - q)), or from p when rounding
            // left no residual mass.
            float residual = 0.0f;
            for (unsigned int j = threadIdx.x; j < v; j += BLOCK)
                residual += draw_weight(row, q_row, (int)x, j, m, inv_t, total, true);
            residual = block_sum(residual, fscratch);
            accepted = i;
            next = block_draw(row, q_row, (int)x, v, m, inv_t, total, residual > 0.0f, u[i + 1], fscratch, uscratch);
            done = true;
        }
        if (!done) {
            const float* row = logits + (size_t)n * v;
            float m, total;
            softmax_stats(row, v, inv_t, &m, &total, fscratch);
            accepted = n;
            next = block_draw(row, 0, -1, v, m, inv_t, total, false, u[n], fscratch, uscratch);
        }
    }
    if (threadIdx.x == 0) {
        num_accepted_tokens[s] = accepted;
        next_token_ids[s] = next;
    }
}

// Batched tree acceptance (deterministic trees) for a whole step in ONE launch. The CPU reference,
// with the full contract, is crates/specrs-core/src/batch/tree_accept.rs (tree_accept_packed), which
// also owns the packed descriptor's layout (PackedTrees):
//   header   [4]     num_seqs B, max_nodes N, num_rows R, vocab chunks C
//   seqs     [B, 2]  first_row, num_nodes (rows first_row ..= first_row + num_nodes: root, node i)
//   rows     [R, 5]  logit_row, draft token, parent (int; root: -2), temperature (float bits),
//                    uniform of the row's depth (float bits)
//   counters [R + 1] zero on upload: each row's chunk blocks done, then rows done
// Row i + 1 of a sequence scores the token after node i. A row's target token is its argmax
// (temperature 0) or an inverse-CDF draw from softmax(row / temperature) with its uniform: it
// depends on the row alone, so every row's target is computed at once, grid (R, C), each block
// reducing one vocabulary chunk; the last block of a row to finish combines the row's chunks into
// its target, and the last row to finish walks every sequence: from the root, the first child (in
// node index order) carrying the current row's target is accepted and the walk goes on from it;
// when none does, the target token is the next token.
#define HEADER_WORDS 4
#define SEQ_WORDS 2
#define ROW_WORDS 5
#define NO_NODE 0xffffffffu

// Whether this block is the last of `expected` blocks to arrive at `counter`; its and every
// earlier block's global writes are visible to it when it is (the threadFenceReduction pattern).
__device__ bool last_to_arrive(unsigned int* counter, unsigned int expected, unsigned int* flag) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *flag = atomicAdd(counter, 1u) == expected - 1;
    __syncthreads();
    return *flag != 0;
}

// Inverse-CDF draw inside [lo, hi) of a row with unnormalized weights exp((x - max) / T): the first
// index whose running sum (from `offset`, the weight of the chunks before) passes `goal`, skipping
// zero weights; the chunk's last nonzero index if rounding runs past it.
__device__ unsigned int chunk_draw(const float* row, unsigned int lo, unsigned int hi, float max, float inv_t,
                                   float offset, float goal, float* fscratch, unsigned int* uscratch) {
    unsigned int last_nonzero = lo;
    for (unsigned int base = lo; base < hi; base += BLOCK) {
        unsigned int j = base + threadIdx.x;
        float w = j < hi ? expf((row[j] - max) * inv_t) : 0.0f;
        unsigned int hit = scan_piece(w, j, &offset, goal, &last_nonzero, fscratch, uscratch);
        if (hit != NO_NODE) return hit;
    }
    return last_nonzero;
}

extern "C" __global__ void tree_accept_kernel(
    const float* logits,                    // [forward rows, v]
    unsigned int* desc,                     // the packed descriptor above (its counters change)
    unsigned int* scratch,                  // [R, C, 2] chunk partials, then [R] row targets
    unsigned int v,
    unsigned int* out)                      // [B, 2 + N] out: num_accepted, next token, path
{
    __shared__ float fscratch[BLOCK];
    __shared__ unsigned int uscratch[BLOCK];
    __shared__ unsigned int flag;
    __shared__ unsigned int pick_chunk;
    __shared__ float pick_offset, pick_goal;
    unsigned int num_seqs = desc[0], max_nodes = desc[1], num_rows = desc[2];
    unsigned int chunks = gridDim.y;
    unsigned int r = blockIdx.x;
    const unsigned int* seqs = desc + HEADER_WORDS;
    const unsigned int* rows = seqs + SEQ_WORDS * num_seqs;
    unsigned int* row_done = desc + HEADER_WORDS + SEQ_WORDS * num_seqs + ROW_WORDS * num_rows;
    unsigned int* rows_done = row_done + num_rows;
    unsigned int* partials = scratch + (size_t)r * chunks * 2;
    unsigned int* targets = scratch + (size_t)num_rows * chunks * 2;
    const unsigned int* me = rows + (size_t)ROW_WORDS * r;
    const float* row = logits + (size_t)me[0] * v;
    float temperature = __uint_as_float(me[3]);
    float inv_t = temperature > 0.0f ? 1.0f / temperature : 0.0f;
    unsigned int chunk = (v + chunks - 1) / chunks;

    // 1. This block's chunk: its max, then its first index holding the max (greedy) or its
    //    softmax mass relative to its own max, sum exp((x - max) / T) (sampled).
    unsigned int lo = min(blockIdx.y * chunk, v), hi = min(lo + chunk, v);
    float m = NEG_INF;
    for (unsigned int j = lo + threadIdx.x; j < hi; j += BLOCK) m = fmaxf(m, row[j]);
    m = block_max(m, fscratch);
    unsigned int second;
    if (temperature <= 0.0f) {
        unsigned int first = NO_NODE;
        for (unsigned int j = lo + threadIdx.x; j < hi; j += BLOCK) {
            if (row[j] == m) { first = j; break; }
        }
        second = block_min_index(first, uscratch);
    } else {
        float total = 0.0f;
        for (unsigned int j = lo + threadIdx.x; j < hi; j += BLOCK) total += expf((row[j] - m) * inv_t);
        second = __float_as_uint(block_sum(total, fscratch));
    }
    if (threadIdx.x == 0) {
        partials[2 * blockIdx.y] = __float_as_uint(m);
        partials[2 * blockIdx.y + 1] = second;
    }
    if (!last_to_arrive(&row_done[r], chunks, &flag)) return;

    // 2. The row's last block: its chunks combined into the row's target token.
    const volatile unsigned int* parts = partials;
    float best = NEG_INF;
    for (unsigned int c = threadIdx.x; c < chunks; c += BLOCK) best = fmaxf(best, __uint_as_float(parts[2 * c]));
    best = block_max(best, fscratch);
    unsigned int target;
    if (temperature <= 0.0f) {
        // Chunks cover increasing ranges, so the lowest first index among the chunks holding the
        // max is the row's lowest (as argmax in sampler.rs).
        unsigned int first = NO_NODE;
        for (unsigned int c = threadIdx.x; c < chunks; c += BLOCK) {
            if (__uint_as_float(parts[2 * c]) == best) first = min(first, parts[2 * c + 1]);
        }
        target = block_min_index(first, uscratch);
    } else {
        // Chunk c's weight is its mass rescaled to the row's max; thread 0 finds, in order, the
        // chunk where the running weight passes uniform * total (the last nonzero one if rounding
        // runs past), then the block draws inside it.
        if (threadIdx.x == 0) {
            float total = 0.0f;
            for (unsigned int c = 0; c < chunks; c++)
                total += __uint_as_float(parts[2 * c + 1]) * expf((__uint_as_float(parts[2 * c]) - best) * inv_t);
            float goal = __uint_as_float(me[4]) * total;
            float offset = 0.0f, last_offset = 0.0f;
            unsigned int pick = NO_NODE, last_nonzero = 0;
            for (unsigned int c = 0; c < chunks && pick == NO_NODE; c++) {
                float w = __uint_as_float(parts[2 * c + 1]) * expf((__uint_as_float(parts[2 * c]) - best) * inv_t);
                if (w > 0.0f) {
                    if (offset + w > goal) pick = c;
                    last_nonzero = c;
                    last_offset = offset;
                }
                offset += w;
            }
            pick_chunk = pick != NO_NODE ? pick : last_nonzero;
            pick_offset = last_offset;
            pick_goal = goal;
        }
        __syncthreads();
        unsigned int c = pick_chunk;
        unsigned int c_lo = min(c * chunk, v), c_hi = min(c_lo + chunk, v);
        target = chunk_draw(row, c_lo, c_hi, best, inv_t, pick_offset, pick_goal, fscratch, uscratch);
    }
    if (threadIdx.x == 0) targets[r] = target;
    if (!last_to_arrive(rows_done, num_rows, &flag)) return;

    // 3. The last row's block: every sequence's walk, one thread each.
    const volatile unsigned int* row_targets = targets;
    for (unsigned int s = threadIdx.x; s < num_seqs; s += BLOCK) {
        unsigned int first_row = seqs[SEQ_WORDS * s], count = seqs[SEQ_WORDS * s + 1];
        unsigned int* o = out + (size_t)s * (2 + max_nodes);
        int current = -1;  // the root
        unsigned int depth = 0, next = 0;
        // A child's index exceeds its parent's, so the walk ends by depth count.
        for (;;) {
            unsigned int want = row_targets[first_row + (unsigned int)(current + 1)];
            unsigned int child = NO_NODE;
            for (unsigned int i = 0; i < count; i++) {
                const unsigned int* node = rows + (size_t)ROW_WORDS * (first_row + 1 + i);
                if ((int)node[2] == current && node[1] == want) { child = i; break; }
            }
            if (child == NO_NODE) { next = want; break; }
            o[2 + depth] = child;
            depth++;
            current = (int)child;
        }
        for (unsigned int i = depth; i < max_nodes; i++) o[2 + i] = NO_NODE;
        o[0] = depth;
        o[1] = next;
    }
}
