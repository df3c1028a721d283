// Attention over a block-paged KV pool for every row of a step at once, writing the step's keys
// and values into their slots as it goes (one launch per layer), and the write of appended rows.
// The CPU references, with the full contract, are in
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
//   paged_attention_*: the step's q heads, read from the q/k/v projection's output qkv
//                      [n, (num_heads + 2 kv_heads) * head_dim] (row stride row_stride, the pool's
//                      dtype) and normed (q_norm) and rotated at the row's position as each block
//                      loads its head (heads.cuh: what qkv_heads computes) -> out [n, num_heads *
//                      head_dim] in the pool's dtype (what the output projection reads: no cast
//                      after). Row r sees its sequence's past positions (those within the window)
//                      and the step rows its mask names (within the window, by their positions);
//                      scores are scale * q.k, soft-capped where cap > 0, softmax over them.
//                      Blocks of WARPS warps, grid (row, head, split): a row's keys (its past,
//                      then its step rows) are cut into consecutive ranges of KEYS_PER_SPLIT
//                      (split-K: a long context is walked by many blocks instead of one; a block
//                      past its row's last range returns at once); in a block each warp runs an
//                      online softmax over every WARPS-th key of its range, lane l holding dims l,
//                      l + 32, ... (head_dim at most 256, checked by the host), and the warps
//                      combine. A row of one range writes its output; with more, each range writes
//                      its (max, sum, unnormalized output) to `partials` and the last of a (row,
//                      head)'s ranges to finish combines them in range order and sets its counter
//                      back to zero. A row's result depends on its own keys only (how they are cut
//                      depends on their number alone), never on its batch-mates.
//                      The step's own keys and values: block (r, the first q head of kv group g,
//                      split 0) writes row r's k head g (normed with k_norm where the family has
//                      one, rotated at its position) and v head g (as it is) into row r's slot,
//                      rounded to the pool's dtype; no block reads a step row's slot (which
//                      another block may be writing in the same launch), each computes the step
//                      keys it sees from qkv the same way (heads.cuh, rounded as the pool stores
//                      them), so what it reads equals what the write leaves and what later steps
//                      read from the pool. Past keys are the only pool reads. (Padding rows all
//                      write the dummy slot and read it as their past: their outputs, which no
//                      one keeps, may read another padding row's keys.)
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

// A lane's dims of a head: lane + 32 i for i < per, below head_dim.
struct Lane {
    unsigned int lane, per, head_dim;
    __device__ bool holds(unsigned int i) const { return i < per && lane + 32 * i < head_dim; }
};

// One key into a warp's online softmax (max m, sum l, unnormalized output acc): `key` and `value`
// point at the lane's first dim of the key's and value's heads (dims 32 apart from there).
template <typename T>
__device__ __forceinline__ void attend_key(const Lane& at, const T* key, const T* value, const float* qv,
                                           float scale, float cap, float& m, float& l, float* acc) {
    float dot = 0.0f;
#pragma unroll
    for (unsigned int i = 0; i < MAX_PER_LANE; i++) {
        if (at.holds(i)) dot += qv[i] * load(key, 32 * i);
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
        const float v = at.holds(i) ? load(value, 32 * i) : 0.0f;
        acc[i] = acc[i] * correction + weight * v;
    }
    m = m_new;
}

template <typename T>
__device__ void paged_attention(const T* qkv, unsigned long long row_stride, HeadArgs q_args, HeadArgs k_args,
                                T* pool, const unsigned int* desc, T* out,
                                unsigned int n, unsigned int num_seqs, unsigned int mask_words,
                                unsigned int num_heads, unsigned int kv_heads, unsigned int head_dim,
                                unsigned long long num_slots, unsigned int block_shift, float scale,
                                float cap, unsigned int window, float* partials, unsigned int* counters) {
    __shared__ float warp_max[WARPS], warp_sum[WARPS];
    __shared__ float q_row[MAX_HEAD_DIM], q_head[MAX_HEAD_DIM], q_scratch[BLOCK];
    __shared__ float warp_acc[WARPS][32 * MAX_PER_LANE];
    __shared__ T step_key[MAX_HEAD_DIM];
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
    const unsigned long long v_offset = (unsigned long long)(num_heads + kv_heads + g) * head_dim;
    if (split == 0 && h % (num_heads / kv_heads) == 0) {
        // Row r's k and v heads of group g into its slot (see the header).
        const unsigned long long slot = row_slot[r];
        const T* src = qkv + (unsigned long long)r * row_stride;
        head_values(src + (unsigned long long)(num_heads + g) * head_dim, k_args.norm, true, p, k_args.cos,
                    k_args.sin, head_dim, k_args.rope_dims, k_args.interleaved, k_args.eps, q_row, q_scratch,
                    pool + slot * row_len + g * head_dim);
        T* v_dst = pool + (num_slots + slot) * row_len + g * head_dim;
        for (unsigned int j = threadIdx.x; j < head_dim; j += BLOCK) store(v_dst, j, load(src + v_offset, j));
        __syncthreads();  // q_row is the q head's next
    }
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
    const unsigned int t_start = split * KEYS_PER_SPLIT, t_end = min(num_keys, (split + 1) * KEYS_PER_SPLIT);
    const Lane lane_of = {lane, per, head_dim};
    // The past keys of the range, from the pool: key t to warp t % WARPS.
    for (unsigned int t = t_start + warp; t < min(t_end, num_past); t += WARPS) {
        const unsigned int c = first_key + t;
        const unsigned long long slot = ((unsigned long long)table[c >> block_shift] << block_shift) | (c & block_mask);
        attend_key(lane_of, keys + slot * row_len, values + slot * row_len, qv, scale, cap, m, l, acc);
    }
    // Then its step rows, in order, each to the same warp as its index says (after that warp's
    // past keys, as a walk over the pool would take them): the block computes the key as the
    // write does (every thread calls head_values: the conditions are the block's), the warp
    // reads it and the value from qkv.
    for (unsigned int t = max(t_start, num_past); t < t_end; t++) {
        const unsigned int j = t - num_past;
        if (((mask[j / 32] >> (j % 32)) & 1u) == 0) continue;
        if (window > 0 && p - row_pos[first + j] >= window) continue;
        const T* src = qkv + (unsigned long long)(first + j) * row_stride;
        head_values(src + (unsigned long long)(num_heads + g) * head_dim, k_args.norm, true, row_pos[first + j],
                    k_args.cos, k_args.sin, head_dim, k_args.rope_dims, k_args.interleaved, k_args.eps, q_row,
                    q_scratch, step_key);
        __syncthreads();
        if (warp == t % WARPS) {
            attend_key(lane_of, (const T*)step_key + lane, src + v_offset + lane, qv, scale, cap, m, l, acc);
        }
        __syncthreads();  // step_key and q_row are the next key's
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
extern "C" __global__ void paged_attention_##SUFFIX(const T* qkv, unsigned long long row_stride,        \
        const float* q_norm, unsigned int has_q_norm, const float* k_norm, unsigned int has_k_norm,   \
        const float* cos, const float* sin, unsigned int rope_dims, unsigned int interleaved,          \
        float eps, T* pool, const unsigned int* desc, T* out, unsigned int n, unsigned int num_seqs,   \
        unsigned int mask_words, unsigned int num_heads, unsigned int kv_heads, unsigned int head_dim, \
        unsigned long long num_slots, unsigned int block_shift, float scale, float cap,              \
        unsigned int window, float* partials, unsigned int* counters) {                               \
    const HeadArgs q_args = {cos, sin, has_q_norm ? q_norm : 0, rope_dims, interleaved, eps};          \
    const HeadArgs k_args = {cos, sin, has_k_norm ? k_norm : 0, rope_dims, interleaved, eps};          \
    paged_attention<T>(qkv, row_stride, q_args, k_args, pool, desc, out, n, num_seqs, mask_words,      \
                       num_heads, kv_heads, head_dim, num_slots, block_shift, scale, cap, window,     \
                       partials, counters);                                                           \
}

INSTANTIATE(f32, float)
INSTANTIATE(bf16, unsigned short)
INSTANTIATE(f16, half_bits)
