// Cross entropy over (rows, vocab) logits in their own dtype: one read of the logits in forward, one read and
// one write in backward, fp32 math throughout, no fp32 copy of the logits.
//
// The logits may be one rank's slice [vocab_start, vocab_start + vocab) of a total_vocab-wide vocabulary
// (tensor parallelism); with one rank vocab_start = 0 and total_vocab = vocab. Per row r with global target t:
//   forward:  lse_r = log(sum_v exp(z_v)) over the slice,  predicted_r = z_(t - vocab_start) if t is in the slice,
//             else 0 (the caller combines the ranks' values: loss = logsumexp_ranks(lse) - sum_ranks(predicted));
//   backward: grad_z_v = g_r * (exp(z_v - lse_r) - [v + vocab_start == t])  with the combined lse_r.
// A row whose target is ignore_index has predicted 0 and a zero gradient; any other target outside
// [0, total_vocab) gives a NaN predicted value (and NaN gradients), so a bad label cannot pass silently.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common.cuh"
#include "fused_kernels.h"

namespace megatron_fused {
namespace {

constexpr int kThreads = 512;
constexpr int kVec = 8;  // elements per vector access (16 bytes of bf16/fp16, two 16-byte chunks of fp32)

// Plain (non-__ldg) vector load: the backward may write the same buffer it reads (in place).
template <typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[kVec]) {
  constexpr int kBytes = kVec * static_cast<int>(sizeof(T));
  constexpr int kPerChunk = 16 / sizeof(T);
#pragma unroll
  for (int c = 0; c < kBytes / 16; ++c) {
    union { uint4 u; T t[kPerChunk]; } chunk;
    chunk.u = reinterpret_cast<const uint4*>(p)[c];
#pragma unroll
    for (int k = 0; k < kPerChunk; ++k) out[c * kPerChunk + k] = to_float(chunk.t[k]);
  }
}

// Running (max, sum of exp(x - max)) of one thread; merge() combines two such pairs.
struct OnlineSum {
  float max = -INFINITY;
  float sum = 0.f;

  __device__ __forceinline__ void merge(float other_max, float other_sum) {
    const float m = fmaxf(max, other_max);
    if (m == -INFINITY) return;  // both empty (or all -inf)
    sum = sum * __expf(max - m) + other_sum * __expf(other_max - m);
    max = m;
  }
};

// Block-wide merge of every thread's OnlineSum; all threads get the result.
__device__ __forceinline__ OnlineSum block_merge(OnlineSum s) {
  __shared__ float smax[kThreads / 32];
  __shared__ float ssum[kThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float m = __shfl_xor_sync(0xffffffffu, s.max, offset);
    const float v = __shfl_xor_sync(0xffffffffu, s.sum, offset);
    s.merge(m, v);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    smax[warp] = s.max;
    ssum[warp] = s.sum;
  }
  __syncthreads();
  OnlineSum total;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) total.merge(smax[w], ssum[w]);
  return total;
}

template <typename T, bool VECTORIZED>
__global__ void __launch_bounds__(kThreads) cross_entropy_forward_kernel(
    const T* __restrict__ logits, const int64_t* __restrict__ target, float* __restrict__ lse,
    float* __restrict__ predicted, int64_t vocab, int64_t vocab_start, int64_t total_vocab, int64_t ignore_index) {
  const int64_t row = blockIdx.x;
  const T* z = logits + row * vocab;
  OnlineSum s;
  if constexpr (VECTORIZED) {
    for (int64_t i = static_cast<int64_t>(threadIdx.x) * kVec; i < vocab; i += kThreads * kVec) {
      float v[kVec];
      load_as_float<kVec>(z + i, v);
      float m = v[0];
#pragma unroll
      for (int k = 1; k < kVec; ++k) m = fmaxf(m, v[k]);
      float part = 0.f;
#pragma unroll
      for (int k = 0; k < kVec; ++k) part += __expf(v[k] - m);
      s.merge(m, part);
    }
  } else {
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) s.merge(to_float(z[i]), 1.f);
  }
  const OnlineSum total = block_merge(s);
  if (threadIdx.x == 0) {
    lse[row] = total.max + logf(total.sum);
    const int64_t t = target[row];
    const int64_t local = t - vocab_start;
    if (t == ignore_index) {
      predicted[row] = 0.f;
    } else if (t < 0 || t >= total_vocab) {
      predicted[row] = NAN;
    } else {
      predicted[row] = local >= 0 && local < vocab ? to_float(z[local]) : 0.f;
    }
  }
}

template <typename T, bool VECTORIZED>
__global__ void __launch_bounds__(kThreads) cross_entropy_backward_kernel(
    const float* __restrict__ grad_loss, const T* logits, const int64_t* __restrict__ target,
    const float* __restrict__ lse, T* grad_logits, int64_t vocab, int64_t vocab_start, int64_t total_vocab,
    int64_t ignore_index) {
  const int64_t row = blockIdx.x;
  const int64_t t = target[row];
  const float g = t == ignore_index ? 0.f : (t < 0 || t >= total_vocab ? NAN : grad_loss[row]);
  const int64_t local = t - vocab_start;  // outside [0, vocab) when another rank holds the target
  const float row_lse = lse[row];
  const T* z = logits + row * vocab;
  T* dz = grad_logits + row * vocab;
  if constexpr (VECTORIZED) {
    for (int64_t i = static_cast<int64_t>(threadIdx.x) * kVec; i < vocab; i += kThreads * kVec) {
      float v[kVec];
      load_vec(z + i, v);
#pragma unroll
      for (int k = 0; k < kVec; ++k) v[k] = g * (__expf(v[k] - row_lse) - (i + k == local ? 1.f : 0.f));
      store_from_float<kVec>(dz + i, v);
    }
  } else {
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
      dz[i] = from_float<T>(g * (__expf(to_float(z[i]) - row_lse) - (i == local ? 1.f : 0.f)));
    }
  }
}

template <typename T>
void launch_forward(const void* logits, const int64_t* target, float* lse, float* predicted, int64_t rows,
                    const VocabSlice& slice, bool vectorized, cudaStream_t stream) {
  const auto* z = static_cast<const T*>(logits);
  auto kernel = vectorized ? cross_entropy_forward_kernel<T, true> : cross_entropy_forward_kernel<T, false>;
  kernel<<<rows, kThreads, 0, stream>>>(z, target, lse, predicted, slice.vocab, slice.vocab_start, slice.total_vocab,
                                        slice.ignore_index);
}

template <typename T>
void launch_backward(const float* grad_loss, const void* logits, const int64_t* target, const float* lse,
                     void* grad_logits, int64_t rows, const VocabSlice& slice, bool vectorized, cudaStream_t stream) {
  const auto* z = static_cast<const T*>(logits);
  auto* dz = static_cast<T*>(grad_logits);
  auto kernel = vectorized ? cross_entropy_backward_kernel<T, true> : cross_entropy_backward_kernel<T, false>;
  kernel<<<rows, kThreads, 0, stream>>>(grad_loss, z, target, lse, dz, slice.vocab, slice.vocab_start,
                                        slice.total_vocab, slice.ignore_index);
}

}  // namespace

void cross_entropy_forward(DType dtype, const void* logits, const int64_t* target, float* lse, float* predicted,
                           int64_t rows, const VocabSlice& slice, bool vectorized, cudaStream_t stream) {
  if (rows == 0) return;
  switch (dtype) {
    case DType::kFloat32:
      launch_forward<float>(logits, target, lse, predicted, rows, slice, vectorized, stream);
      break;
    case DType::kFloat16:
      launch_forward<__half>(logits, target, lse, predicted, rows, slice, vectorized, stream);
      break;
    case DType::kBFloat16:
      launch_forward<__nv_bfloat16>(logits, target, lse, predicted, rows, slice, vectorized, stream);
      break;
  }
  check_launch("cross_entropy_forward");
}

void cross_entropy_backward(DType dtype, const float* grad_loss, const void* logits, const int64_t* target,
                            const float* lse, void* grad_logits, int64_t rows, const VocabSlice& slice,
                            bool vectorized, cudaStream_t stream) {
  if (rows == 0) return;
  switch (dtype) {
    case DType::kFloat32:
      launch_backward<float>(grad_loss, logits, target, lse, grad_logits, rows, slice, vectorized, stream);
      break;
    case DType::kFloat16:
      launch_backward<__half>(grad_loss, logits, target, lse, grad_logits, rows, slice, vectorized, stream);
      break;
    case DType::kBFloat16:
      launch_backward<__nv_bfloat16>(grad_loss, logits, target, lse, grad_logits, rows, slice, vectorized, stream);
      break;
  }
  check_launch("cross_entropy_backward");
}

}  // namespace megatron_fused
