// Batched n-gram (prompt lookup) on the device: one block per sequence.
// The CPU reference, with the matching rule, is crates/specrs-core/src/batch/ngram.rs: for n from
// max_n down to min_n, the most recent earlier occurrence of the history's last n tokens, and up
// to k tokens that followed it. Threads test candidate end positions in parallel; a block-wide
// max picks the most recent. Compiled at run time with NVRTC (no headers). blockDim.x must be BLOCK.

#define BLOCK 256

extern "C" __global__ void ngram_kernel(
    const unsigned int* histories,   // [batch, max_len]
    const unsigned int* lengths,     // [batch]
    unsigned int max_len,
    unsigned int min_n,
    unsigned int max_n,
    unsigned int k,
    unsigned int* drafts,            // [batch, k] out (0-padded)
    unsigned int* draft_lengths)     // [batch] out
{
    __shared__ int scratch[BLOCK];
    unsigned int s = blockIdx.x;
    const unsigned int* history = histories + (size_t)s * max_len;
    unsigned int len = lengths[s];
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
    for (unsigned int i = threadIdx.x; i < k; i += BLOCK)
        drafts[(size_t)s * k + i] = i < count ? history[found_end + i] : 0u;
    if (threadIdx.x == 0) draft_lengths[s] = count;
}
