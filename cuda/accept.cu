// Batched acceptance on the device: one block per sequence.
// The CPU reference, with the full contract, is crates/specrs-core/src/batch/accept.rs; this kernel
// computes the same function: greedy (temperature 0) or rejection sampling against
// softmax(logits / temperature), with the random draws passed in as `uniforms`.
// Compiled at run time with NVRTC, so it uses no headers. blockDim.x must be BLOCK.

#define BLOCK 256
// -inf without math.h (NVRTC compiles without headers).
#define NEG_INF __int_as_float(0xff800000)

// Block-wide reductions through shared memory; every thread gets the result.
__device__ float block_max(float x, float* scratch) {
    scratch[threadIdx.x] = x;
    __syncthreads();
    for (int stride = BLOCK / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) scratch[threadIdx.x] = fmaxf(scratch[threadIdx.x], scratch[threadIdx.x + stride]);
        __syncthreads();
    }
    float result = scratch[0];
    __syncthreads();
    return result;
}

__device__ float block_sum(float x, float* scratch) {
    scratch[threadIdx.x] = x;
    __syncthreads();
    for (int stride = BLOCK / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) scratch[threadIdx.x] += scratch[threadIdx.x + stride];
        __syncthreads();
    }
    float result = scratch[0];
    __syncthreads();
    return result;
}

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
        // Inclusive scan of this chunk (Hillis-Steele).
        fscratch[threadIdx.x] = w;
        __syncthreads();
        for (int stride = 1; stride < BLOCK; stride <<= 1) {
            float add = threadIdx.x >= stride ? fscratch[threadIdx.x - stride] : 0.0f;
            __syncthreads();
            fscratch[threadIdx.x] += add;
            __syncthreads();
        }
        float cumulative = offset + fscratch[threadIdx.x];
        float chunk_total = fscratch[BLOCK - 1];
        __syncthreads();
        unsigned int hit = (w > 0.0f && cumulative > target) ? j : 0xffffffffu;
        hit = block_min_index(hit, uscratch);
        if (hit != 0xffffffffu) return hit;
        unsigned int nonzero = (w > 0.0f) ? j : 0u;
        // block max of `nonzero` through the min reduction on its complement
        unsigned int last = 0xffffffffu - block_min_index(0xffffffffu - nonzero, uscratch);
        if (last > last_nonzero) last_nonzero = last;
        offset += chunk_total;
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

// Batched tree acceptance (deterministic trees): one block per sequence. The CPU reference, with
// the full contract, is crates/specrs-core/src/batch/tree_accept.rs. From the root (row 0; row
// i + 1 scores the token after node i), depth d's target token is the row's argmax (temperature 0)
// or an inverse-CDF draw from softmax(row / temperature) with uniforms[d]; the first child (in node
// index order) carrying that token is accepted and the walk goes on from it; when none does, the
// target token is the next token.
extern "C" __global__ void tree_accept_kernel(
    const float* target_logits,             // [batch, n + 1, v]
    const unsigned int* draft_token_ids,    // [batch, n]
    const int* parents,                     // [batch, n]; -1 = the root, parents before children
    const unsigned int* num_nodes,          // [batch]
    const float* temperatures,              // [batch]; 0 = greedy
    const float* uniforms,                  // [batch, n + 1]
    unsigned int n,
    unsigned int v,
    unsigned int* num_accepted_tokens,      // [batch] out
    unsigned int* accepted_nodes,           // [batch, n] out: the path, padded with 0xffffffff
    unsigned int* next_token_ids)           // [batch] out
{
    __shared__ float fscratch[BLOCK];
    __shared__ unsigned int uscratch[BLOCK];
    unsigned int s = blockIdx.x;
    const float* logits = target_logits + (size_t)s * (n + 1) * v;
    const unsigned int* drafts = draft_token_ids + (size_t)s * n;
    const int* tree = parents + (size_t)s * n;
    const float* u = uniforms + (size_t)s * (n + 1);
    unsigned int* path = accepted_nodes + (size_t)s * n;
    unsigned int count = num_nodes[s];
    float temperature = temperatures[s];
    float inv_t = temperature > 0.0f ? 1.0f / temperature : 0.0f;
    int current = -1;  // the root
    unsigned int depth = 0;
    unsigned int next = 0;

    // A tree of count nodes is at most count deep: the walk ends by depth count.
    for (; depth <= count; depth++) {
        const float* row = logits + (size_t)(current + 1) * v;
        unsigned int target;
        if (temperature <= 0.0f) {
            target = block_argmax(row, v, fscratch, uscratch);
        } else {
            float m, total;
            softmax_stats(row, v, inv_t, &m, &total, fscratch);
            target = block_draw(row, 0, -1, v, m, inv_t, total, false, u[depth], fscratch, uscratch);
        }
        // The lowest-index child of `current` carrying the target token.
        unsigned int child = 0xffffffffu;
        for (unsigned int i = threadIdx.x; i < count; i += BLOCK) {
            if (tree[i] == current && drafts[i] == target) { child = i; break; }
        }
        child = block_min_index(child, uscratch);
        if (child == 0xffffffffu) { next = target; break; }
        if (threadIdx.x == 0) path[depth] = child;
        current = (int)child;
    }
    // Entries below depth hold the path (written by thread 0 above); the rest is padding.
    for (unsigned int i = depth + threadIdx.x; i < n; i += BLOCK) path[i] = 0xffffffffu;
    if (threadIdx.x == 0) {
        num_accepted_tokens[s] = depth;
        next_token_ids[s] = next;
    }
}
