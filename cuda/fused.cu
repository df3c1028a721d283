// Fused decoder-block kernels: one launch where candle runs two to four.
// The CPU references, with the full contract, are in crates/specrs-core/src/model/candle/fused.rs
// (each op's `cpu_fwd`): the same f32 arithmetic, rounded once to the activation dtype.
//   add_rms_norm_*: x' = x + delta (rounded to the dtype, as the residual stream is stored), and
//                   rms_norm(x') * weight; out[0] = x', out[1] = the normed row. One block per row.
//   qkv_heads_*:    the q/k/v projection's output [n, (H + 2 KV) * hd] -> heads [H + 2 KV, n, hd] in
//                   f32: q and k heads RMS-normed per head where the family has q/k norms, then
//                   rotated (RoPE, halves or interleaved pairs, the first rope_dims of a head) at the
//                   row's position read on the device (heads.cuh); v heads copied. One block per
//                   (head, row).
//   act_mul_*:      act(gate) * up with act = SiLU or GELU (tanh form), the activation rounded to the
//                   dtype first (as candle stores it between its two ops); gate and up are row-strided
//                   views (the halves of a fused gate/up matmul's output). A grid-stride loop.
// Compiled at run time with NVRTC after cuda/block.cuh (BLOCK, block_sum), cuda/dtype.cuh
// (load/store per dtype) and cuda/heads.cuh (one head normed and rotated: qkv_heads' arithmetic).
// blockDim.x must be BLOCK.

template <typename T>
__device__ void add_rms_norm(const T* x, const T* delta, const T* weight, T* out,
                             unsigned int rows, unsigned int hidden, float eps) {
    __shared__ float scratch[BLOCK];
    const unsigned long long row = blockIdx.x;
    const unsigned long long base = row * hidden;
    T* sum_out = out;                                  // [rows, hidden]: x + delta
    T* norm_out = out + (unsigned long long)rows * hidden;  // [rows, hidden]: its rms norm
    float squares = 0.0f;
    for (unsigned int j = threadIdx.x; j < hidden; j += BLOCK) {
        store(sum_out, base + j, load(x, base + j) + load(delta, base + j));
        float v = load(sum_out, base + j);  // the stored (rounded) value, as the residual holds it
        squares += v * v;
    }
    const float m = sqrtf(block_sum(squares, scratch) / (float)hidden + eps);
    for (unsigned int j = threadIdx.x; j < hidden; j += BLOCK) {
        store(norm_out, base + j, load(sum_out, base + j) / m * load(weight, j));
    }
}

template <typename T>
__device__ void act_mul(const T* gate, unsigned long long gate_stride, const T* up, unsigned long long up_stride,
                        T* out, unsigned int rows, unsigned int width, unsigned int gelu) {
    const unsigned long long total = (unsigned long long)rows * width;
    for (unsigned long long i = (unsigned long long)blockIdx.x * BLOCK + threadIdx.x; i < total;
         i += (unsigned long long)gridDim.x * BLOCK) {
        const unsigned long long r = i / width, c = i % width;
        const float g = load(gate, r * gate_stride + c);
        float a;
        if (gelu) {
            a = 0.5f * g * (1.0f + tanhf(0.7978845608f * g * (1.0f + 0.044715f * g * g)));
        } else {
            a = g / (1.0f + expf(-g));
        }
        store(out, i, round_as<T>(a) * load(up, r * up_stride + c));
    }
}

template <typename T>
__device__ void qkv_heads(const T* qkv, unsigned long long row_stride, const unsigned int* positions,
                          const float* q_norm, const float* k_norm, unsigned int has_q_norm, unsigned int has_k_norm,
                          const float* cos, const float* sin, float* out, unsigned int n, unsigned int num_heads,
                          unsigned int num_kv_heads, unsigned int head_dim, unsigned int rope_dims,
                          unsigned int interleaved, float eps) {
    __shared__ float row[1024];  // one head's values (head_dim <= 1024, checked by the host)
    __shared__ float scratch[BLOCK];
    const unsigned int head = blockIdx.x / n, r = blockIdx.x % n;
    const bool is_q = head < num_heads, is_k = !is_q && head < num_heads + num_kv_heads;
    const T* src = qkv + (unsigned long long)r * row_stride + (unsigned long long)head * head_dim;
    const float* norm = is_q && has_q_norm ? q_norm : (is_k && has_k_norm ? k_norm : 0);
    float* dst = out + ((unsigned long long)head * n + r) * head_dim;
    head_values(src, norm, is_q || is_k, positions[r], cos, sin, head_dim, rope_dims, interleaved, eps, row, scratch,
                dst);
}

#define INSTANTIATE(SUFFIX, T)                                                                      \
extern "C" __global__ void add_rms_norm_##SUFFIX(const T* x, const T* delta, const T* weight, T* out, \
                                                 unsigned int rows, unsigned int hidden, float eps) { \
    add_rms_norm<T>(x, delta, weight, out, rows, hidden, eps);                                     \
}                                                                                                   \
extern "C" __global__ void act_mul_##SUFFIX(const T* gate, unsigned long long gate_stride, const T* up, \
                                            unsigned long long up_stride, T* out, unsigned int rows, \
                                            unsigned int width, unsigned int gelu) {               \
    act_mul<T>(gate, gate_stride, up, up_stride, out, rows, width, gelu);                          \
}                                                                                                   \
extern "C" __global__ void qkv_heads_##SUFFIX(const T* qkv, unsigned long long row_stride,           \
        const unsigned int* positions, const float* q_norm, const float* k_norm, unsigned int has_q_norm, \
        unsigned int has_k_norm, const float* cos, const float* sin, float* out, unsigned int n,     \
        unsigned int num_heads, unsigned int num_kv_heads, unsigned int head_dim, unsigned int rope_dims, \
        unsigned int interleaved, float eps) {                                                      \
    qkv_heads<T>(qkv, row_stride, positions, q_norm, k_norm, has_q_norm, has_k_norm, cos, sin, out, n, \
                 num_heads, num_kv_heads, head_dim, rope_dims, interleaved, eps);                   \
}

INSTANTIATE(f32, float)
INSTANTIATE(bf16, unsigned short)
INSTANTIATE(f16, half_bits)
