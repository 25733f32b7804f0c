// CUDA kernels: ALiBi + causal/explicit-mask softmax over attention scores (B, nh, sq, sk), forward and backward.
//
// One row (b, h, i) of sk scores is owned by ROW_THREADS threads (a warp for sk <= 512, a whole block
// above) and kept in registers: each thread holds kElemsPerThread = 16 values as ITEMS vectors of VEC
// elements, VEC = 8 (16-byte loads) when the row length and pointers allow it, else 1. Column of
// (item, thread, v) = (item * ROW_THREADS + thread) * VEC + v, so a warp's loads are contiguous.
// Statistics are fp32. Causal rows only read their first i + (sk - sq) + 1 columns.
#include "common.cuh"
#include "fused_kernels.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace megatron_fused {
namespace {

// Number of leading columns of row i that may be unmasked (all others are masked by the causal rule).
__device__ __forceinline__ int causal_limit(bool causal, int i, int sq, int sk) {
  if (!causal) return sk;
  const int limit = i + (sk - sq) + 1;
  return limit < 0 ? 0 : (limit > sk ? sk : limit);
}

template <typename T, int VEC, int ROW_THREADS>
__global__ void __launch_bounds__(block_threads<ROW_THREADS>())
alibi_softmax_forward_kernel(const T* __restrict__ x, const float* __restrict__ slopes,
                             const uint8_t* __restrict__ mask, int64_t mask_batch_stride,
                             T* __restrict__ probs, int64_t rows, int nh, int sq, int sk, float scale,
                             bool causal) {
  constexpr int ITEMS = kElemsPerThread / VEC;
  constexpr int RPB = rows_per_block<ROW_THREADS>();
  __shared__ float red_max[ROW_THREADS / 32];
  __shared__ float red_sum[ROW_THREADS / 32];

  const int tid = threadIdx.x % ROW_THREADS;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * RPB + threadIdx.x / ROW_THREADS;
  if (row >= rows) return;  // only possible when RPB > 1, i.e. a row is a single warp (no __syncthreads)
  const int i = static_cast<int>(row % sq);
  const int64_t bh = row / sq;
  const int h = static_cast<int>(bh % nh);
  const int64_t b = bh / nh;
  const int limit = causal_limit(causal, i, sq, sk);
  const float slope = slopes[h];
  const T* xrow = x + row * sk;
  const uint8_t* mrow = mask == nullptr ? nullptr : mask + b * mask_batch_stride + static_cast<int64_t>(i) * sk;
  T* prow = probs + row * sk;

  float vals[ITEMS][VEC];
  float local_max = -INFINITY;
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int base = (it * ROW_THREADS + tid) * VEC;
    if (base < limit) {
      load_as_float<VEC>(xrow + base, vals[it]);
      float m[VEC];
      if (mrow != nullptr) {
        load_as_float<VEC>(mrow + base, m);
      } else {
#pragma unroll
        for (int v = 0; v < VEC; ++v) m[v] = 0.f;
      }
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const int col = base + v;
        const bool keep = col < limit && m[v] == 0.f;
        vals[it][v] = keep ? fmaf(scale, vals[it][v], slope * static_cast<float>(col)) : -INFINITY;
        local_max = fmaxf(local_max, vals[it][v]);
      }
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) vals[it][v] = -INFINITY;
    }
  }
  const float row_max = row_reduce<ROW_THREADS>(local_max, red_max, MaxOp());

  // exp(-inf - max) == 0 keeps masked entries at zero; a fully masked row (max == -inf) becomes all zeros.
  const bool empty_row = row_max == -INFINITY;
  float local_sum = 0.f;
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      vals[it][v] = empty_row ? 0.f : __expf(vals[it][v] - row_max);
      local_sum += vals[it][v];
    }
  }
  const float row_sum = row_reduce<ROW_THREADS>(local_sum, red_sum, SumOp());
  // Fully masked row: row_sum == 0 -> write zeros instead of 0/0.
  const float inv = row_sum > 0.f ? 1.f / row_sum : 0.f;

#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int base = (it * ROW_THREADS + tid) * VEC;
    if (base < sk) {
      float out[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) out[v] = base < limit ? vals[it][v] * inv : 0.f;
      store_from_float<VEC>(prow + base, out);
    }
  }
}

template <typename T, int VEC, int ROW_THREADS>
__global__ void __launch_bounds__(block_threads<ROW_THREADS>())
alibi_softmax_backward_kernel(const T* __restrict__ grad_probs, const T* __restrict__ probs,
                              T* __restrict__ grad_x, int64_t rows, int sq, int sk, float scale, bool causal) {
  constexpr int ITEMS = kElemsPerThread / VEC;
  constexpr int RPB = rows_per_block<ROW_THREADS>();
  __shared__ float red_sum[ROW_THREADS / 32];

  const int tid = threadIdx.x % ROW_THREADS;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * RPB + threadIdx.x / ROW_THREADS;
  if (row >= rows) return;
  const int i = static_cast<int>(row % sq);
  const int limit = causal_limit(causal, i, sq, sk);
  const T* grow = grad_probs + row * sk;
  const T* prow = probs + row * sk;
  T* dxrow = grad_x + row * sk;

  float g[ITEMS][VEC];
  float p[ITEMS][VEC];
  float local_dot = 0.f;
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int base = (it * ROW_THREADS + tid) * VEC;
    if (base < limit) {
      load_as_float<VEC>(grow + base, g[it]);
      load_as_float<VEC>(prow + base, p[it]);
#pragma unroll
      for (int v = 0; v < VEC; ++v) local_dot += g[it][v] * p[it][v];
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) g[it][v] = p[it][v] = 0.f;
    }
  }
  const float dot = row_reduce<ROW_THREADS>(local_dot, red_sum, SumOp());

#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int base = (it * ROW_THREADS + tid) * VEC;
    if (base < sk) {
      float out[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) out[v] = scale * p[it][v] * (g[it][v] - dot);
      store_from_float<VEC>(dxrow + base, out);
    }
  }
}

template <int ROW_THREADS>
dim3 grid_for(int64_t rows) {
  constexpr int RPB = rows_per_block<ROW_THREADS>();
  return dim3(static_cast<unsigned>((rows + RPB - 1) / RPB));
}

template <typename T, int VEC, int ROW_THREADS>
void forward_launch(const void* x, const float* slopes, const uint8_t* mask, int64_t mask_batch_stride, void* probs,
                    int64_t rows, int nh, int sq, int sk, float scale, bool causal, cudaStream_t stream) {
  alibi_softmax_forward_kernel<T, VEC, ROW_THREADS>
      <<<grid_for<ROW_THREADS>(rows), block_threads<ROW_THREADS>(), 0, stream>>>(
          static_cast<const T*>(x), slopes, mask, mask_batch_stride, static_cast<T*>(probs), rows, nh, sq, sk,
          scale, causal);
}

template <typename T, int VEC, int ROW_THREADS>
void backward_launch(const void* grad_probs, const void* probs, void* grad_x, int64_t rows, int sq, int sk,
                     float scale, bool causal, cudaStream_t stream) {
  alibi_softmax_backward_kernel<T, VEC, ROW_THREADS>
      <<<grid_for<ROW_THREADS>(rows), block_threads<ROW_THREADS>(), 0, stream>>>(
          static_cast<const T*>(grad_probs), static_cast<const T*>(probs), static_cast<T*>(grad_x), rows, sq, sk,
          scale, causal);
}

template <typename T>
void forward_typed(const void* x, const float* slopes, const uint8_t* mask, int64_t mask_batch_stride, void* probs,
                   int64_t rows, int nh, int sq, int sk, float scale, bool causal, bool vectorized,
                   cudaStream_t stream) {
  MEGATRON_DISPATCH_ROW_THREADS(sk, {
    if (vectorized) forward_launch<T, 8, RT>(x, slopes, mask, mask_batch_stride, probs, rows, nh, sq, sk, scale, causal, stream);
    else forward_launch<T, 1, RT>(x, slopes, mask, mask_batch_stride, probs, rows, nh, sq, sk, scale, causal, stream);
  });
}

template <typename T>
void backward_typed(const void* grad_probs, const void* probs, void* grad_x, int64_t rows, int sq, int sk, float scale,
                    bool causal, bool vectorized, cudaStream_t stream) {
  MEGATRON_DISPATCH_ROW_THREADS(sk, {
    if (vectorized) backward_launch<T, 8, RT>(grad_probs, probs, grad_x, rows, sq, sk, scale, causal, stream);
    else backward_launch<T, 1, RT>(grad_probs, probs, grad_x, rows, sq, sk, scale, causal, stream);
  });
}

}  // namespace

void alibi_softmax_forward(DType dtype, const void* x, const float* slopes, const uint8_t* mask,
                           int64_t mask_batch_stride, void* probs, int64_t batch, int nh, int sq, int sk,
                           float scale, bool causal, bool vectorized, cudaStream_t stream) {
  const int64_t rows = batch * nh * sq;
  if (rows == 0 || sk == 0) return;
  switch (dtype) {
    case DType::kFloat16:
      forward_typed<__half>(x, slopes, mask, mask_batch_stride, probs, rows, nh, sq, sk, scale, causal, vectorized, stream);
      break;
    case DType::kBFloat16:
      forward_typed<__nv_bfloat16>(x, slopes, mask, mask_batch_stride, probs, rows, nh, sq, sk, scale, causal, vectorized,
                                   stream);
      break;
    default:
      throw std::invalid_argument("alibi_softmax_forward supports float16 and bfloat16 only");
  }
  check_launch("alibi_softmax_forward");
}

void alibi_softmax_backward(DType dtype, const void* grad_probs, const void* probs, void* grad_x, int64_t batch,
                            int nh, int sq, int sk, float scale, bool causal, bool vectorized, cudaStream_t stream) {
  const int64_t rows = batch * nh * sq;
  if (rows == 0 || sk == 0) return;
  switch (dtype) {
    case DType::kFloat16:
      backward_typed<__half>(grad_probs, probs, grad_x, rows, sq, sk, scale, causal, vectorized, stream);
      break;
    case DType::kBFloat16:
      backward_typed<__nv_bfloat16>(grad_probs, probs, grad_x, rows, sq, sk, scale, causal, vectorized, stream);
      break;
    default:
      throw std::invalid_argument("alibi_softmax_backward supports float16 and bfloat16 only");
  }
  check_launch("alibi_softmax_backward");
}

}  // namespace megatron_fused
