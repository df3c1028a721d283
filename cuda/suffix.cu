// Batched suffix-tree lookup on the device over trees mirrored there: one block per sequence. The
// CPU reference, with the rule, is crates/specrs-core/src/batch/suffix.rs (suffix_step), which
// also owns the descriptor's layout (SuffixStep):
//   header  [3]     num_seqs B, num_entries E, max_k
//   entries [E, 4]  slot, count, token, best child's slot (NONE at a leaf)
//   seqs    [B, 5]  max_tokens, min_token_prob's bits, L local matches, G global matches, where
//                   its lists start in `lists`
//   lists   [...]   per sequence: limits [L], local match slots [L], global match slots [G]
// The pool is [slots, 3] u32 (count, token, best child's slot). Every block first writes every
// entry (blocks write the same values to the same slots, so none reads a half-written tree: each
// has written them all itself before it walks; where a step writes many, a tree written whole,
// suffix_write_kernel writes them once, grid-stride, in a launch before, and suffix_kernel is told
// not to), then thread m of the first (second) half walks
// the greedy path from the local (global) match of length m (m >= 1) for its score; thread 0
// picks each tree's best (ties to the longer match; the global one only if strictly higher) and
// walks it again to write [length, tokens] into its row of out [B, 1 + max_k]. The walk's f32
// arithmetic is the reference's, op for op, with no contraction (__fmul_rn, __fdiv_rn,
// __fadd_rn), so scores and their ties match bit for bit. Compiled at run time with NVRTC (no
// headers). blockDim.x must be 2 * MAX_MATCHES.

#define MAX_MATCHES 64
#define HEADER_WORDS 3
#define ENTRY_WORDS 4
#define SEQ_WORDS 5
#define NONE 0xffffffffu

// The greedy path from `node`, at most `limit` tokens: its score; its tokens into `tokens` (when
// not null) and its length into *len.
__device__ float walk(const unsigned int* pool, unsigned int node, unsigned int limit, float min_token_prob,
                      unsigned int* tokens, unsigned int* len) {
    float prob = 1.0f, score = 0.0f;
    unsigned int n = 0;
    while (n < limit) {
        const unsigned int child = pool[3ull * node + 2];
        if (child == NONE) break;
        prob = __fmul_rn(prob, __fdiv_rn((float)pool[3ull * child], (float)pool[3ull * node]));
        if (prob < min_token_prob) break;
        if (tokens) tokens[n] = pool[3ull * child + 1];
        score = __fadd_rn(score, prob);
        n++;
        node = child;
    }
    *len = n;
    return score;
}

// Entries first..num_entries of the descriptor, every `stride`-th from `first` (each into its slot).
__device__ void write_entries(unsigned int* pool, const unsigned int* desc, unsigned long long first,
                              unsigned long long stride) {
    const unsigned long long num_entries = desc[1];
    const unsigned int* entries = desc + HEADER_WORDS;
    for (unsigned long long e = first; e < num_entries; e += stride) {
        const unsigned int* entry = entries + e * ENTRY_WORDS;
        unsigned int* node = pool + 3ull * entry[0];
        node[0] = entry[1];
        node[1] = entry[2];
        node[2] = entry[3];
    }
}

extern "C" __global__ void suffix_write_kernel(unsigned int* pool, const unsigned int* desc) {
    write_entries(pool, desc, (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x,
                  (unsigned long long)gridDim.x * blockDim.x);
}

extern "C" __global__ void suffix_kernel(
    unsigned int* pool,          // [slots, 3]: every mirrored tree's nodes
    const unsigned int* desc,    // the step descriptor above
    unsigned int* out,           // [B, 1 + max_k] out
    unsigned int entries_written)  // 1: suffix_write_kernel wrote the entries before
{
    __shared__ float scores[2 * MAX_MATCHES];
    const unsigned int num_seqs = desc[0], num_entries = desc[1], max_k = desc[2];
    const unsigned int* entries = desc + HEADER_WORDS;
    if (!entries_written) write_entries(pool, desc, threadIdx.x, blockDim.x);
    __syncthreads();
    const unsigned int* seqs = entries + (unsigned long long)num_entries * ENTRY_WORDS;
    const unsigned int* seq = seqs + SEQ_WORDS * blockIdx.x;
    const unsigned int* lists = seqs + SEQ_WORDS * num_seqs + seq[4];
    const float min_token_prob = __uint_as_float(seq[1]);
    const unsigned int num_local = seq[2], num_global = seq[3];
    const unsigned int* limits = lists;
    const unsigned int* local = lists + num_local;
    const unsigned int* global = local + num_local;
    const unsigned int half = threadIdx.x / MAX_MATCHES, m = threadIdx.x % MAX_MATCHES;
    const unsigned int num_matches = half == 0 ? num_local : num_global;
    const unsigned int* matches = half == 0 ? local : global;
    unsigned int len;
    scores[threadIdx.x] = m >= 1 && m < num_matches ? walk(pool, matches[m], limits[m], min_token_prob, 0, &len) : 0.0f;
    __syncthreads();
    if (threadIdx.x != 0) return;
    float local_score = 0.0f, global_score = 0.0f;
    unsigned int local_m = 0, global_m = 0;
    for (unsigned int i = 1; i < num_local; i++) {
        if (scores[i] >= local_score) {
            local_score = scores[i];
            local_m = i;
        }
    }
    for (unsigned int i = 1; i < num_global; i++) {
        if (scores[MAX_MATCHES + i] >= global_score) {
            global_score = scores[MAX_MATCHES + i];
            global_m = i;
        }
    }
    const bool from_global = global_score > local_score;
    const unsigned int best_m = from_global ? global_m : local_m;
    unsigned int* row = out + (unsigned long long)blockIdx.x * (1 + max_k);
    len = 0;
    if (best_m > 0) walk(pool, (from_global ? global : local)[best_m], limits[best_m], min_token_prob, row + 1, &len);
    row[0] = len;
}
