// Attention over a block-paged KV pool for every row of a step at once, and the write of the
// step's keys and values into their slots. The CPU references, with the full contract, are in
// crates/specrs-core/src/model/candle/paged_attention.rs (`PagedStep`, each op's `cpu_fwd`).
//
// The pool of one layer is [2, num_slots, kv_heads * head_dim] (keys, then values) in the cache's
// dtype; position c of a sequence is slot (table[c >> block_shift] << block_shift) | (c & mask).
// The step descriptor is one u32 array (uploaded once per forward, read by every layer):
//   row_seq[n] | row_pos[n] | row_slot[n] | seqs[4 * num_seqs] (past, first_row, num_rows,
//   table_start) | masks[n * mask_words] | tables[...] | (the decoder's sections: the rows'
//   tokens and logit rows, which no kernel here reads)
// where bit j of row r's mask says r sees its sequence's step row j (its ancestors and itself:
// a chain's row i sees rows 0..=i).
//   write_kv_*:        rows [2 * kv_heads, n, head_dim] f32 (k heads, then v heads) into the
//                      slots `slots[n]`, rounded to the pool's dtype (a sequence's appended rows).
//                      A grid-stride loop.
//   write_kv_heads_*:  a step's keys and values straight from the q/k/v projection's output qkv
//                      [n, (num_heads + 2 kv_heads) * head_dim] (row stride row_stride, the pool's
//                      dtype): each k head normed (k_norm, where the family has one) and rotated at
//                      its row's position (heads.cuh), each v head as it is, rounded to the pool's
//                      dtype into its row's slot. One block per (k or v head, row).
//   paged_attention_*: the step's q heads, read from the same qkv and normed (q_norm) and rotated
//                      at the row's position as each block loads its head (heads.cuh: what
//                      qkv_heads computes) -> out [n, num_heads * head_dim] in the
//                      pool's dtype (what the output projection reads: no cast after). Row r
//                      sees its sequence's past positions (those within the window) and the step
//                      rows its mask names (within the window, by their positions); scores are
//                      scale * q.k, soft-capped where cap > 0, softmax over them. Blocks of
//                      WARPS warps, grid (row, head, split): a row's keys (its past, then its step
//                      rows) are cut into consecutive ranges of KEYS_PER_SPLIT (split-K: a long
//                      context is walked by many blocks instead of one; a block past its row's
//                      last range returns at once); in a block each warp runs an online softmax
//                      over every WARPS-th key of its range, lane l holding dims l, l + 32, ...
//                      (head_dim at most 256, checked by the host), and the warps combine. A row
//                      of one range writes its output; with more, each range writes its (max,
//                      sum, unnormalized output) to `partials` and the last of a (row, head)'s
//                      ranges to finish combines them in range order and sets its counter back
//                      to zero. A row's result depends on its own keys only (how they are cut
//                      depends on their number alone), never on its batch-mates.
// Compiled at run time with NVRTC after cuda/block.cuh, cuda/dtype.cuh and cuda/heads.cuh; blocks
// of BLOCK threads.

#define WARPS 8
// The most dims a head may have (the host checks: `MAX_HEAD_DIM` in paged_attention.rs).
#define MAX_HEAD_DIM 256
#define MAX_PER_LANE 8
// Keys per split-K range (`model/candle/paged_attention.rs` sizes the grid with the same number).
#define KEYS_PER_SPLIT 128

template <typename T>
__device__ void write_kv(T* pool, const float* rows, const unsigned int* slots, unsigned int n,
                         unsigned int kv_heads, unsigned int head_dim, unsigned long long num_slots) {
    const unsigned long long row_len = (unsigned long long)kv_heads * head_dim;
    const unsigned long long total = 2ull * n * row_len;
    for (unsigned long long e = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned long long d = e % head_dim;
        const unsigned long long r = (e / head_dim) % n;
        const unsigned long long head = e / ((unsigned long long)head_dim * n);  // which * kv_heads + g
        const unsigned long long which = head / kv_heads, g = head % kv_heads;
        store(pool, (which * num_slots + slots[r]) * row_len + g * head_dim + d, rows[e]);
    }
}

// The rotary tables and q/k norms of a layer, as heads.cuh reads them.
struct HeadArgs {
    const float* cos;
    const float* sin;
    const float* norm;  // null: the family has no norm for these heads
    unsigned int rope_dims, interleaved;
    float eps;
};

template <typename T>
__device__ void write_kv_heads(T* pool, const T* qkv, unsigned long long row_stride, const unsigned int* desc,
                               HeadArgs k_args, unsigned int n, unsigned int num_heads, unsigned int kv_heads,
                               unsigned int head_dim, unsigned long long num_slots) {
    __shared__ float row[MAX_HEAD_DIM];
    __shared__ float scratch[BLOCK];
    const unsigned int head = blockIdx.x / n, r = blockIdx.x % n;  // k heads, then v heads
    const unsigned int* row_pos = desc + n;
    const unsigned int* row_slot = desc + 2 * n;
    const bool is_k = head < kv_heads;
    const unsigned int which = is_k ? 0 : 1, g = head % kv_heads;
    const unsigned long long row_len = (unsigned long long)kv_heads * head_dim;
    const T* src = qkv + (unsigned long long)r * row_stride + (unsigned long long)(num_heads + head) * head_dim;
    T* dst = pool + (which * num_slots + row_slot[r]) * row_len + (unsigned long long)g * head_dim;
    head_values(src, is_k ? k_args.norm : 0, is_k, row_pos[r], k_args.cos, k_args.sin, head_dim, k_args.rope_dims,
                k_args.interleaved, k_args.eps, row, scratch, dst);
}

template <typename T>
__device__ void paged_attention(const T* qkv, unsigned long long row_stride, HeadArgs q_args, const T* pool,
                                const unsigned int* desc, T* out,
                                unsigned int n, unsigned int num_seqs, unsigned int mask_words,
                                unsigned int num_heads, unsigned int kv_heads, unsigned int head_dim,
                                unsigned long long num_slots, unsigned int block_shift, float scale,
                                float cap, unsigned int window, float* partials, unsigned int* counters) {
    __shared__ float warp_max[WARPS], warp_sum[WARPS];
    __shared__ float q_row[MAX_HEAD_DIM], q_head[MAX_HEAD_DIM], q_scratch[BLOCK];
    __shared__ float warp_acc[WARPS][32 * MAX_PER_LANE];
    const unsigned int r = blockIdx.x, h = blockIdx.y, split = blockIdx.z;
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned int* row_seq = desc;
    const unsigned int* row_pos = desc + n;
    const unsigned int* row_slot = desc + 2 * n;
    const unsigned int* seqs = desc + 3 * n;
    const unsigned int* masks = seqs + 4 * num_seqs;
    const unsigned int* tables = masks + (unsigned long long)n * mask_words;
    const unsigned int s = row_seq[r];
    const unsigned int past = seqs[4 * s], first = seqs[4 * s + 1], rows = seqs[4 * s + 2];
    const unsigned int* table = tables + seqs[4 * s + 3];
    const unsigned int* mask = masks + (unsigned long long)r * mask_words;
    const unsigned int p = row_pos[r];
    // Past keys from first_key on: a window of w sees positions p - w + 1..=p.
    const unsigned int first_key = (window > 0 && p + 1 > window) ? p + 1 - window : 0;
    const unsigned int num_past = past > first_key ? past - first_key : 0;
    const unsigned int g = h / (num_heads / kv_heads);
    const unsigned long long row_len = (unsigned long long)kv_heads * head_dim;
    // Lane l holds dims l + 32 i for i < per; dims past head_dim are zeros that add nothing.
    const unsigned int per = (head_dim + 31) / 32;
    const T* keys = pool + g * head_dim + lane;
    const T* values = pool + num_slots * row_len + g * head_dim + lane;
    // This block's range of the row's keys (t indexes its past keys, then its step rows).
    const unsigned int num_keys = num_past + rows;
    const unsigned int splits = (num_keys + KEYS_PER_SPLIT - 1) / KEYS_PER_SPLIT;
    if (split >= splits) return;  // the whole block: its row has fewer ranges than the grid
    // The row's q head, normed and rotated as qkv_heads does it, into shared memory.
    head_values(qkv + (unsigned long long)r * row_stride + (unsigned long long)h * head_dim, q_args.norm, true, p,
                q_args.cos, q_args.sin, head_dim, q_args.rope_dims, q_args.interleaved, q_args.eps, q_row, q_scratch,
                q_head);
    __syncthreads();
    float qv[MAX_PER_LANE], acc[MAX_PER_LANE];
    // Loops over the per-lane arrays run to MAX_PER_LANE, unrolled, so the arrays stay in registers.
#pragma unroll
    for (unsigned int i = 0; i < MAX_PER_LANE; i++) {
        qv[i] = i < per && lane + 32 * i < head_dim ? q_head[lane + 32 * i] : 0.0f;
        acc[i] = 0.0f;
    }
    const float neg_inf = __int_as_float(0xff800000);
    float m = neg_inf, l = 0.0f;
    const unsigned int block_mask = (1u << block_shift) - 1;
    const unsigned int t_end = min(num_keys, (split + 1) * KEYS_PER_SPLIT);
    for (unsigned int t = split * KEYS_PER_SPLIT + warp; t < t_end; t += WARPS) {
        unsigned long long slot;
        if (t < num_past) {
            const unsigned int c = first_key + t;
            slot = ((unsigned long long)table[c >> block_shift] << block_shift) | (c & block_mask);
        } else {
            // Uniform across the warp: every lane skips or runs the key together.
            const unsigned int j = t - num_past;
            if (((mask[j / 32] >> (j % 32)) & 1u) == 0) continue;
            if (window > 0 && p - row_pos[first + j] >= window) continue;
            slot = row_slot[first + j];
        }
        float dot = 0.0f;
#pragma unroll
        for (unsigned int i = 0; i < MAX_PER_LANE; i++) {
            if (i < per && lane + 32 * i < head_dim) dot += qv[i] * load(keys, slot * row_len + 32 * i);
        }
        for (int offset = 16; offset > 0; offset >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        float score = dot * scale;
        if (cap > 0.0f) score = cap * tanhf(score / cap);
        const float m_new = fmaxf(m, score);
        const float correction = expf(m - m_new);  // 0 on the first key (m = -inf)
        const float weight = expf(score - m_new);
        l = l * correction + weight;
#pragma unroll
        for (unsigned int i = 0; i < MAX_PER_LANE; i++) {
            const float v = i < per && lane + 32 * i < head_dim ? load(values, slot * row_len + 32 * i) : 0.0f;
            acc[i] = acc[i] * correction + weight * v;
        }
        m = m_new;
    }
    if (lane == 0) {
        warp_max[warp] = m;
        warp_sum[warp] = l;
    }
#pragma unroll
    for (unsigned int i = 0; i < MAX_PER_LANE; i++) {
        if (i < per) warp_acc[warp][lane + 32 * i] = acc[i];
    }
    __syncthreads();
    if (warp != 0) return;
    float total_max = neg_inf;
    for (int w = 0; w < WARPS; w++) total_max = fmaxf(total_max, warp_max[w]);
    float total = 0.0f;
    float scaled[WARPS];
    for (int w = 0; w < WARPS; w++) {
        scaled[w] = warp_sum[w] > 0.0f ? expf(warp_max[w] - total_max) : 0.0f;
        total += warp_sum[w] * scaled[w];
    }
    T* dst = out + ((unsigned long long)r * num_heads + h) * head_dim;
    if (splits == 1) {
        for (unsigned int i = 0; i < per; i++) {
            const unsigned int dim = lane + 32 * i;
            if (dim >= head_dim) break;
            float o = 0.0f;
            for (int w = 0; w < WARPS; w++) o += warp_acc[w][dim] * scaled[w];
            store(dst, dim, o / total);
        }
        return;
    }
    // Split-K: this split's max, sum and unnormalized output (relative to its max; a split with
    // no key has sum 0 and is skipped below), then the last split of (r, h) combines them all.
    const unsigned long long head_index = (unsigned long long)r * num_heads + h;
    const unsigned int stride = head_dim + 2;
    float* mine = partials + (head_index * gridDim.z + split) * stride;
    if (lane == 0) {
        mine[0] = total_max;
        mine[1] = total;
    }
    for (unsigned int dim = lane; dim < head_dim; dim += 32) {
        float o = 0.0f;
        for (int w = 0; w < WARPS; w++) o += warp_acc[w][dim] * scaled[w];
        mine[2 + dim] = o;
    }
    __threadfence();
    __syncwarp();
    unsigned int ticket = 0;
    if (lane == 0) ticket = atomicAdd(&counters[head_index], 1u);
    ticket = __shfl_sync(0xffffffffu, ticket, 0);
    if (ticket != splits - 1) return;
    if (lane == 0) counters[head_index] = 0;  // ready for the next layer's launch
    const volatile float* all = partials + head_index * gridDim.z * stride;
    float best = neg_inf;
    for (unsigned int z = 0; z < splits; z++) {
        if (all[z * stride + 1] > 0.0f) best = fmaxf(best, all[z * stride]);
    }
    float sum = 0.0f;
    for (unsigned int z = 0; z < splits; z++) {
        const float l_z = all[z * stride + 1];
        if (l_z > 0.0f) sum += l_z * expf(all[z * stride] - best);
    }
    for (unsigned int dim = lane; dim < head_dim; dim += 32) {
        float o = 0.0f;
        for (unsigned int z = 0; z < splits; z++) {
            if (all[z * stride + 1] > 0.0f) o += all[z * stride + 2 + dim] * expf(all[z * stride] - best);
        }
        store(dst, dim, o / sum);
    }
}

#define INSTANTIATE(SUFFIX, T)                                                                        \
extern "C" __global__ void write_kv_##SUFFIX(T* pool, const float* rows, const unsigned int* slots,     \
        unsigned int n, unsigned int kv_heads, unsigned int head_dim, unsigned long long num_slots) {  \
    write_kv<T>(pool, rows, slots, n, kv_heads, head_dim, num_slots);                                 \
}                                                                                                     \
extern "C" __global__ void write_kv_heads_##SUFFIX(T* pool, const T* qkv, unsigned long long row_stride, \
        const unsigned int* desc, const float* k_norm, unsigned int has_k_norm, const float* cos,      \
        const float* sin, unsigned int rope_dims, unsigned int interleaved, float eps, unsigned int n, \
        unsigned int num_heads, unsigned int kv_heads, unsigned int head_dim,                          \
        unsigned long long num_slots) {                                                               \
    const HeadArgs k_args = {cos, sin, has_k_norm ? k_norm : 0, rope_dims, interleaved, eps};          \
    write_kv_heads<T>(pool, qkv, row_stride, desc, k_args, n, num_heads, kv_heads, head_dim, num_slots); \
}                                                                                                     \
extern "C" __global__ void paged_attention_##SUFFIX(const T* qkv, unsigned long long row_stride,        \
        const float* q_norm, unsigned int has_q_norm, const float* cos, const float* sin,              \
        unsigned int rope_dims, unsigned int interleaved, float eps, const T* pool,                    \
        const unsigned int* desc, T* out, unsigned int n, unsigned int num_seqs,                       \
        unsigned int mask_words, unsigned int num_heads, unsigned int kv_heads, unsigned int head_dim, \
        unsigned long long num_slots, unsigned int block_shift, float scale, float cap,              \
        unsigned int window, float* partials, unsigned int* counters) {                               \
    const HeadArgs q_args = {cos, sin, has_q_norm ? q_norm : 0, rope_dims, interleaved, eps};          \
    paged_attention<T>(qkv, row_stride, q_args, pool, desc, out, n, num_seqs, mask_words, num_heads,   \
                       kv_heads, head_dim, num_slots, block_shift, scale, cap, window, partials,      \
                       counters);                                                                     \
}

INSTANTIATE(f32, float)
INSTANTIATE(bf16, unsigned short)
INSTANTIATE(f16, half_bits)
