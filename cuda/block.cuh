// Threads per block and block-wide reductions, shared by the kernel sources that include it
// (nvrtc.rs prepends it: NVRTC compiles one string with no headers). blockDim.x must be BLOCK.

#define BLOCK 256

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
