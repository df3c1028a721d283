// Element access for the dtypes activations and caches take (f32, bf16 as unsigned short, f16 as
// half_bits), shared by the kernel sources that include it (nvrtc.rs prepends it). NVRTC compiles
// with no headers, so bf16 and f16 are converted by hand (bf16 rounds to nearest even, as the
// `half` crate does).

__device__ __forceinline__ float load(const float* p, unsigned long long i) { return p[i]; }
__device__ __forceinline__ void store(float* p, unsigned long long i, float v) { p[i] = v; }

__device__ __forceinline__ float load(const unsigned short* p, unsigned long long i) {
    return __uint_as_float(((unsigned int)p[i]) << 16);
}
__device__ __forceinline__ unsigned short to_bf16(float v) {
    unsigned int u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
__device__ __forceinline__ void store(unsigned short* p, unsigned long long i, float v) { p[i] = to_bf16(v); }

// f16 travels as its own type tag so it overloads apart from bf16's unsigned short.
struct half_bits { unsigned short bits; };
__device__ __forceinline__ float load(const half_bits* p, unsigned long long i) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(p[i].bits));
    return f;
}
__device__ __forceinline__ void store(half_bits* p, unsigned long long i, float v) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    p[i].bits = h;
}

// v as the dtype stores it (an intermediate candle would have stored between two ops).
template <typename T>
__device__ __forceinline__ float round_as(float v) {
    T t;
    store(&t, 0, v);
    return load(&t, 0);
}
