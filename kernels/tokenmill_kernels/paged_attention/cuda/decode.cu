// Paged decode attention: one new token per request attends to that request's cached keys.
//
// Same semantics as _decode_kernel in ../triton.py: only requests whose query
// length is 1 are computed (others return at once and their output rows are
// left alone); the query at position p sees keys at positions <= p (and
// > p - sliding_window when sliding_window > 0) read through the block table.
//
// Grid: (num_reqs, num_heads), one thread block of NUM_WARPS warps per
// (request, query head). Each warp walks every NUM_WARPS-th key with its own
// online softmax; lane l holds head dims l, l + 32, ... so a key row is read
// with coalesced 32-wide loads and its dot product is a warp shuffle reduction.
// The warps' partial results are merged through shared memory at the end.
//
// Compiled by NVRTC through CuPy (kernels/paged_attention/cuda.py). No CUDA
// header is included, so it compiles with CuPy's bundled NVRTC alone: half and
// bfloat16 values travel as 16-bit integers and are converted explicitly.

#define NUM_WARPS 4
#define WARP_SIZE 32
// Finite stand-in for -inf as a running maximum: exp(NEG_LARGE - m) is 0, never NaN.
#define NEG_LARGE (-1.0e30f)

struct F32 {
    typedef float storage;
    static __device__ __forceinline__ float load(float x) { return x; }
    static __device__ __forceinline__ float store(float x) { return x; }
};

struct F16 {
    typedef unsigned short storage;
    static __device__ __forceinline__ float load(unsigned short x) {
        float f;
        asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(x));
        return f;
    }
    static __device__ __forceinline__ unsigned short store(float f) {
        unsigned short x;
        asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(x) : "f"(f));
        return x;
    }
};

struct BF16 {
    typedef unsigned short storage;
    static __device__ __forceinline__ float load(unsigned short x) {
        return __uint_as_float(((unsigned int)x) << 16);
    }
    static __device__ __forceinline__ unsigned short store(float f) {
        unsigned int bits = __float_as_uint(f);
        if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays NaN
        bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest, ties to even
        return (unsigned short)(bits >> 16);
    }
};

template <typename T, int HEAD_DIM>
__device__ __forceinline__ void paged_attention_decode(
    typename T::storage* __restrict__ out,
    const typename T::storage* __restrict__ query,
    const typename T::storage* __restrict__ key_cache,
    const typename T::storage* __restrict__ value_cache,
    const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens,
    const int* __restrict__ query_start_loc,
    const long long* __restrict__ positions,
    float scale,
    int sliding_window,  // 0: no window
    int num_heads,
    int num_kv_heads,
    int block_size,
    long long stride_query_token,
    long long stride_query_head,
    long long stride_out_token,
    long long stride_out_head,
    long long stride_cache_block,
    long long stride_cache_offset,
    long long stride_cache_head,
    long long stride_block_tables) {
    constexpr int PER_LANE = HEAD_DIM / WARP_SIZE;
    const int req = blockIdx.x;
    const int head = blockIdx.y;
    const int warp = threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;

    const int token = query_start_loc[req];
    if (query_start_loc[req + 1] - token != 1) return;  // a prefill chunk or a padding request
    const long long pos = positions[token];
    const int kv_head = head / (num_heads / num_kv_heads);
    const long long hi = min((long long)seq_lens[req], pos + 1);
    const long long lo = sliding_window > 0 ? max(pos - sliding_window + 1, 0LL) : 0LL;

    const typename T::storage* q_row = query + token * stride_query_token + head * stride_query_head;
    float q[PER_LANE];
    float acc[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        q[i] = T::load(q_row[lane + i * WARP_SIZE]) * scale;
        acc[i] = 0.0f;
    }
    float m = NEG_LARGE;
    float l = 0.0f;
    const int* block_table = block_tables + req * stride_block_tables;
    for (long long key = lo + warp; key < hi; key += NUM_WARPS) {
        const long long block = block_table[key / block_size];
        const long long base =
            block * stride_cache_block + (key % block_size) * stride_cache_offset + kv_head * stride_cache_head;
        float score = 0.0f;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) score += q[i] * T::load(key_cache[base + lane + i * WARP_SIZE]);
#pragma unroll
        for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) score += __shfl_xor_sync(0xffffffffu, score, offset);
        const float m_new = fmaxf(m, score);
        const float alpha = __expf(m - m_new);
        const float p = __expf(score - m_new);
        l = l * alpha + p;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) acc[i] = acc[i] * alpha + p * T::load(value_cache[base + lane + i * WARP_SIZE]);
        m = m_new;
    }

    __shared__ float warp_m[NUM_WARPS];
    __shared__ float warp_l[NUM_WARPS];
    __shared__ float warp_acc[NUM_WARPS][HEAD_DIM];
    if (lane == 0) {
        warp_m[warp] = m;
        warp_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) warp_acc[warp][lane + i * WARP_SIZE] = acc[i];
    __syncthreads();

    float m_max = NEG_LARGE;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) m_max = fmaxf(m_max, warp_m[w]);
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) total += warp_l[w] * __expf(warp_m[w] - m_max);
    const float inv_total = total > 0.0f ? 1.0f / total : 0.0f;  // an empty sequence writes zeros
    typename T::storage* out_row = out + token * stride_out_token + head * stride_out_head;
    for (int d = threadIdx.x; d < HEAD_DIM; d += NUM_WARPS * WARP_SIZE) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) sum += warp_acc[w][d] * __expf(warp_m[w] - m_max);
        out_row[d] = T::store(sum * inv_total);
    }
}

// One extern "C" entry point per (dtype, head_dim): names the launcher can build without C++ mangling.
#define DEFINE_DECODE_KERNEL(NAME, T, HEAD_DIM)                                                              \
    extern "C" __global__ void __launch_bounds__(NUM_WARPS * WARP_SIZE) NAME(                              \
        T::storage* __restrict__ out, const T::storage* __restrict__ query,                                  \
        const T::storage* __restrict__ key_cache, const T::storage* __restrict__ value_cache,                \
        const int* __restrict__ block_tables, const int* __restrict__ seq_lens,                              \
        const int* __restrict__ query_start_loc, const long long* __restrict__ positions, float scale,       \
        int sliding_window, int num_heads, int num_kv_heads, int block_size, long long stride_query_token,   \
        long long stride_query_head, long long stride_out_token, long long stride_out_head,                  \
        long long stride_cache_block, long long stride_cache_offset, long long stride_cache_head,            \
        long long stride_block_tables) {                                                                     \
        paged_attention_decode<T, HEAD_DIM>(                                                                 \
            out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, positions, scale,   \
            sliding_window, num_heads, num_kv_heads, block_size, stride_query_token, stride_query_head,      \
            stride_out_token, stride_out_head, stride_cache_block, stride_cache_offset, stride_cache_head,   \
            stride_block_tables);                                                                            \
    }

DEFINE_DECODE_KERNEL(paged_attention_decode_f32_d32, F32, 32)
DEFINE_DECODE_KERNEL(paged_attention_decode_f32_d64, F32, 64)
DEFINE_DECODE_KERNEL(paged_attention_decode_f32_d128, F32, 128)
DEFINE_DECODE_KERNEL(paged_attention_decode_f32_d256, F32, 256)
DEFINE_DECODE_KERNEL(paged_attention_decode_f16_d32, F16, 32)
DEFINE_DECODE_KERNEL(paged_attention_decode_f16_d64, F16, 64)
DEFINE_DECODE_KERNEL(paged_attention_decode_f16_d128, F16, 128)
DEFINE_DECODE_KERNEL(paged_attention_decode_f16_d256, F16, 256)
DEFINE_DECODE_KERNEL(paged_attention_decode_bf16_d32, BF16, 32)
DEFINE_DECODE_KERNEL(paged_attention_decode_bf16_d64, BF16, 64)
DEFINE_DECODE_KERNEL(paged_attention_decode_bf16_d128, BF16, 128)
DEFINE_DECODE_KERNEL(paged_attention_decode_bf16_d256, BF16, 256)
