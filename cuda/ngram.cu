// Batched n-gram (prompt lookup) on the device over histories that stay there: one block per
// sequence. The CPU reference, with the matching rule, is crates/specrs-core/src/batch/ngram.rs
// (ngram_step), which also owns the descriptor's layout (NgramStep):
//   header  [2]     num_seqs B, max_k
//   seqs    [B, 7]  pool row, tokens kept, tokens appended, where they start in `appended`, k,
//                   min_n, max_n
//   appended [...]  the appended tokens
// A block first appends its sequence's tokens to its row of the pool (no two sequences share a
// row), then, for n from max_n down to min_n, finds the most recent earlier occurrence of the
// history's last n tokens and writes up to k tokens that followed it. Threads test candidate end
// positions in parallel; a block-wide max picks the most recent. Output [B, 1 + max_k]: the
// draft's length, then the draft (0-padded). Compiled at run time with NVRTC (no headers).
// blockDim.x must be BLOCK.

#define BLOCK 256
#define HEADER_WORDS 2
#define SEQ_WORDS 7

extern "C" __global__ void ngram_kernel(
    unsigned int* pool,              // [rows, max_len]: every sequence's history
    unsigned int max_len,
    const unsigned int* desc,        // the step descriptor above
    unsigned int* out)               // [B, 1 + max_k] out
{
    __shared__ int scratch[BLOCK];
    const unsigned int s = blockIdx.x;
    const unsigned int num_seqs = desc[0], max_k = desc[1];
    const unsigned int* seq = desc + HEADER_WORDS + SEQ_WORDS * s;
    const unsigned int keep = seq[1], num_new = seq[2], k = seq[4], min_n = seq[5], max_n = seq[6];
    const unsigned int* appended = desc + HEADER_WORDS + SEQ_WORDS * num_seqs + seq[3];
    unsigned int* history = pool + (size_t)seq[0] * max_len;
    for (unsigned int i = threadIdx.x; i < num_new; i += BLOCK) history[keep + i] = appended[i];
    __syncthreads();  // the appends are visible to the whole block
    const unsigned int len = keep + num_new;
    int found_end = -1;
    for (unsigned int n = max_n; n >= min_n && n > 0; n--) {
        if (n >= len) continue;
        // Candidate occurrences end at end in [n, len); the most recent match wins.
        int best = -1;
        for (unsigned int end = n + threadIdx.x; end < len; end += BLOCK) {
            bool match = true;
            for (unsigned int t = 0; t < n && match; t++) match = history[end - n + t] == history[len - n + t];
            if (match && (int)end > best) best = (int)end;
        }
        scratch[threadIdx.x] = best;
        __syncthreads();
        for (int stride = BLOCK / 2; stride > 0; stride >>= 1) {
            if (threadIdx.x < stride) scratch[threadIdx.x] = max(scratch[threadIdx.x], scratch[threadIdx.x + stride]);
            __syncthreads();
        }
        best = scratch[0];
        __syncthreads();
        if (best >= 0) { found_end = best; break; }
    }
    unsigned int count = 0;
    if (found_end >= 0) {
        unsigned int stop = min(len, (unsigned int)found_end + k);
        count = stop - (unsigned int)found_end;
    }
    unsigned int* mine = out + (size_t)s * (1 + max_k);
    for (unsigned int i = threadIdx.x; i < max_k; i += BLOCK) mine[1 + i] = i < count ? history[found_end + i] : 0u;
    if (threadIdx.x == 0) mine[0] = count;
}
