// The device's read bandwidth: a read-only reduction over a buffer much larger than L2.
// Each thread sums four float4 loads per iteration (several loads in flight), a grid-stride loop
// covers the buffer, and each block writes one partial sum: the only writes, so the bytes moved
// are the bytes read. The host (crates/specrs-core/src/bandwidth.rs) times it with CUDA events.
// Compiled at run time with NVRTC, so it uses no headers. blockDim.x must be BLOCK.

#define BLOCK 256

extern "C" __global__ void read_sum_kernel(
    const float4* __restrict__ data,   // [n4]
    unsigned long long n4,
    float* __restrict__ partial)       // [gridDim.x] out
{
    __shared__ float scratch[BLOCK];
    const unsigned long long stride = (unsigned long long)gridDim.x * BLOCK;
    unsigned long long i = (unsigned long long)blockIdx.x * BLOCK + threadIdx.x;
    float acc = 0.0f;
    for (; i + 3 * stride < n4; i += 4 * stride) {
        float4 a = data[i], b = data[i + stride], c = data[i + 2 * stride], d = data[i + 3 * stride];
        acc += (a.x + a.y + a.z + a.w) + (b.x + b.y + b.z + b.w) + (c.x + c.y + c.z + c.w) + (d.x + d.y + d.z + d.w);
    }
    for (; i < n4; i += stride) {
        float4 a = data[i];
        acc += a.x + a.y + a.z + a.w;
    }
    scratch[threadIdx.x] = acc;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) scratch[threadIdx.x] += scratch[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = scratch[0];
}
