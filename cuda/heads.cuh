// One q or k head of the q/k/v projection's output normed and rotated, shared by the kernels that
// read heads (cuda/fused.cu's qkv_heads; cuda/paged_attention.cu's paged_attention, for its q heads
// and the step's k heads it writes and reads). The CPU reference of a head is
// `HeadTables::head` in crates/specrs-core/src/model/candle/fused.rs: the same f32 arithmetic.
// Compiled at run time with NVRTC after cuda/block.cuh and cuda/dtype.cuh; blockDim.x must be
// BLOCK.

// The block loads the head_dim values at `src` into `row` (shared, head_dim floats), RMS-norms
// them with `norm` where it is not null, rotates the first rope_dims dims at `position` where
// `rotate` (RoPE: halves, or interleaved pairs; candle's rope / rope_i term for term), and stores
// each result at out[j]. `scratch` is shared, BLOCK floats. Every thread of the block must call it.
template <typename T, typename O>
__device__ void head_values(const T* src, const float* norm, bool rotate, unsigned int position,
                            const float* cos, const float* sin, unsigned int head_dim, unsigned int rope_dims,
                            unsigned int interleaved, float eps, float* row, float* scratch, O* out) {
    for (unsigned int j = threadIdx.x; j < head_dim; j += BLOCK) row[j] = load(src, j);
    __syncthreads();
    if (norm) {
        float squares = 0.0f;
        for (unsigned int j = threadIdx.x; j < head_dim; j += BLOCK) squares += row[j] * row[j];
        const float m = sqrtf(block_sum(squares, scratch) / (float)head_dim + eps);
        for (unsigned int j = threadIdx.x; j < head_dim; j += BLOCK) row[j] = row[j] / m * norm[j];
        __syncthreads();
    }
    const unsigned int half = rope_dims / 2;
    const unsigned long long table = (unsigned long long)position * half;
    for (unsigned int j = threadIdx.x; j < head_dim; j += BLOCK) {
        float v = row[j];
        if (rotate && j < rope_dims) {
            if (interleaved) {
                const unsigned int i = j / 2;
                const float c = cos[table + i], s = sin[table + i];
                v = (j % 2 == 0) ? row[j] * c - row[j + 1] * s : row[j - 1] * s + row[j] * c;
            } else {
                const unsigned int i = j % half;
                const float c = cos[table + i], s = sin[table + i];
                v = (j < half) ? row[j] * c - row[j + half] * s : row[j - half] * s + row[j] * c;
            }
        }
        store(out, j, v);
    }
}
