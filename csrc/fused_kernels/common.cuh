// Shared device helpers of the fused kernels: 16-byte vector loads/stores, dtype casts, row reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace megatron_fused {

// Throws with the launch error of the last kernel launch, if any (called after every launch).
inline void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// Elements each thread holds in registers for one row. A row of up to
// kElemsPerThread * row_threads elements is kept entirely in registers.
constexpr int kElemsPerThread = 16;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(uint8_t v) { return static_cast<float>(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Loads N contiguous elements of T starting at p into registers as float.
// Caller guarantees p is aligned to min(16, N * sizeof(T)) bytes.
template <int N, typename T>
__device__ __forceinline__ void load_as_float(const T* __restrict__ p, float (&out)[N]) {
  constexpr int kBytes = N * static_cast<int>(sizeof(T));
  if constexpr (kBytes % 16 == 0) {
    constexpr int kPerChunk = 16 / sizeof(T);
#pragma unroll
    for (int c = 0; c < kBytes / 16; ++c) {
      union { uint4 u; T t[kPerChunk]; } chunk;
      chunk.u = __ldg(reinterpret_cast<const uint4*>(p) + c);
#pragma unroll
      for (int k = 0; k < kPerChunk; ++k) out[c * kPerChunk + k] = to_float(chunk.t[k]);
    }
  } else if constexpr (kBytes == 8) {
    union { uint2 u; T t[N]; } chunk;
    chunk.u = __ldg(reinterpret_cast<const uint2*>(p));
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = to_float(chunk.t[k]);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = to_float(p[k]);
  }
}

// Stores N floats as T at p (same alignment contract as load_as_float).
template <int N, typename T>
__device__ __forceinline__ void store_from_float(T* __restrict__ p, const float (&in)[N]) {
  constexpr int kBytes = N * static_cast<int>(sizeof(T));
  if constexpr (kBytes % 16 == 0) {
    constexpr int kPerChunk = 16 / sizeof(T);
#pragma unroll
    for (int c = 0; c < kBytes / 16; ++c) {
      union { uint4 u; T t[kPerChunk]; } chunk;
#pragma unroll
      for (int k = 0; k < kPerChunk; ++k) chunk.t[k] = from_float<T>(in[c * kPerChunk + k]);
      reinterpret_cast<uint4*>(p)[c] = chunk.u;
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = from_float<T>(in[k]);
  }
}

struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Reduces v over the ROW_THREADS threads that own one row. For ROW_THREADS == 32
// a row is one warp (several rows per block, no shared memory). For larger rows a
// block owns exactly one row and `smem` needs ROW_THREADS / 32 floats; each call
// site must pass its own buffer (one __syncthreads per call, none before reuse).
template <int ROW_THREADS, typename Op>
__device__ __forceinline__ float row_reduce(float v, float* smem, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  if constexpr (ROW_THREADS > 32) {
    constexpr int kWarps = ROW_THREADS / 32;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    v = smem[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) v = op(v, smem[w]);
  }
  return v;
}

// Reduces several independent sums at once (one __syncthreads for all of them); same contract as row_reduce.
// smem needs N * ROW_THREADS / 32 floats.
template <int ROW_THREADS, int N>
__device__ __forceinline__ void row_reduce_sums(float (&v)[N], float* smem) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], offset);
  }
  if constexpr (ROW_THREADS > 32) {
    constexpr int kWarps = ROW_THREADS / 32;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) {
#pragma unroll
      for (int k = 0; k < N; ++k) smem[k * kWarps + warp] = v[k];
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < N; ++k) {
      v[k] = smem[k * kWarps];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) v[k] += smem[k * kWarps + w];
    }
  }
}

// Rows handled by one block of at least 128 threads.
template <int ROW_THREADS>
__host__ __device__ constexpr int rows_per_block() { return ROW_THREADS >= 128 ? 1 : 128 / ROW_THREADS; }

template <int ROW_THREADS>
__host__ __device__ constexpr int block_threads() { return ROW_THREADS * rows_per_block<ROW_THREADS>(); }

// Smallest supported row group (threads per row) whose registers hold n elements, or 0 if none does.
inline int row_threads_for(int n) {
  for (int t : {32, 128, 256, 512, 1024}) {
    if (n <= t * kElemsPerThread) return t;
  }
  return 0;
}

// Expands STMT once per supported row group with RT bound to it (RT chosen by row_threads_for(n)).
#define MEGATRON_DISPATCH_ROW_THREADS(n, ...)                                        \
  switch (::megatron_fused::row_threads_for(n)) {                                     \
    case 32: { constexpr int RT = 32; __VA_ARGS__; break; }                           \
    case 128: { constexpr int RT = 128; __VA_ARGS__; break; }                         \
    case 256: { constexpr int RT = 256; __VA_ARGS__; break; }                         \
    case 512: { constexpr int RT = 512; __VA_ARGS__; break; }                         \
    case 1024: { constexpr int RT = 1024; __VA_ARGS__; break; }                       \
    default: throw std::invalid_argument("row length " + std::to_string(n) + " exceeds 16384"); \
  }

}  // namespace megatron_fused
