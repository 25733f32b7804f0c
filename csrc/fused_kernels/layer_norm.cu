// CUDA kernels: LayerNorm over the last dim with fp32 weight/bias/statistics and fp32/fp16/bf16 activations.
//
// Forward: one row of `hidden` elements per ROW_THREADS threads, held in registers (16 per thread),
// two-pass mean/variance in fp32 (exact, no Welford needed since the row is resident).
// Backward: the same row layout for grad_x = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = grad_y * w;
// each block walks a strided set of rows and accumulates grad_w = sum grad_y * xhat and
// grad_b = sum grad_y for its columns in registers, writes one partial row per row group, and a
// second kernel sums the partials over rows (deterministic, no atomics).
#include "common.cuh"
#include "fused_kernels.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace megatron_fused {
namespace {

template <typename T, int VEC, int ROW_THREADS>
__global__ void __launch_bounds__(block_threads<ROW_THREADS>())
layer_norm_forward_kernel(const T* __restrict__ x, const float* __restrict__ weight, const float* __restrict__ bias,
                          T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                          int64_t rows, int hidden, float eps) {
  constexpr int ITEMS = kElemsPerThread / VEC;
  constexpr int RPB = rows_per_block<ROW_THREADS>();
  __shared__ float red_mean[ROW_THREADS / 32];
  __shared__ float red_var[ROW_THREADS / 32];

  const int tid = threadIdx.x % ROW_THREADS;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * RPB + threadIdx.x / ROW_THREADS;
  if (row >= rows) return;  // RPB > 1 only for warp-sized rows, which never __syncthreads
  const T* xrow = x + row * hidden;
  T* yrow = y + row * hidden;

  float vals[ITEMS][VEC];
  float local = 0.f;
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int base = (it * ROW_THREADS + tid) * VEC;
    if (base < hidden) {
      load_as_float<VEC>(xrow + base, vals[it]);
#pragma unroll
      for (int v = 0; v < VEC; ++v) local += vals[it][v];
    }
  }
  const float inv_h = 1.f / static_cast<float>(hidden);
  const float mean = row_reduce<ROW_THREADS>(local, red_mean, SumOp()) * inv_h;

  local = 0.f;
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int base = (it * ROW_THREADS + tid) * VEC;
    if (base < hidden) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const float d = vals[it][v] - mean;
        local += d * d;
      }
    }
  }
  const float var = row_reduce<ROW_THREADS>(local, red_var, SumOp()) * inv_h;
  const float rstd = rsqrtf(var + eps);
  if (tid == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }

#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int base = (it * ROW_THREADS + tid) * VEC;
    if (base < hidden) {
      float w[VEC], b[VEC], out[VEC];
      load_as_float<VEC>(weight + base, w);
      load_as_float<VEC>(bias + base, b);
#pragma unroll
      for (int v = 0; v < VEC; ++v) out[v] = fmaf((vals[it][v] - mean) * rstd, w[v], b[v]);
      store_from_float<VEC>(yrow + base, out);
    }
  }
}

template <typename T, int VEC, int ROW_THREADS>
__global__ void __launch_bounds__(block_threads<ROW_THREADS>())
layer_norm_backward_kernel(const T* __restrict__ grad_y, const T* __restrict__ x, const float* __restrict__ weight,
                           const float* __restrict__ mean_in, const float* __restrict__ rstd_in, T* __restrict__ grad_x,
                           float* __restrict__ dw_part, float* __restrict__ db_part, int64_t rows, int hidden) {
  constexpr int ITEMS = kElemsPerThread / VEC;
  constexpr int RPB = rows_per_block<ROW_THREADS>();
  constexpr bool kReload = ROW_THREADS >= 1024;
  __shared__ float red[2 * (ROW_THREADS / 32)];

  const int tid = threadIdx.x % ROW_THREADS;
  const int64_t group = static_cast<int64_t>(blockIdx.x) * RPB + threadIdx.x / ROW_THREADS;
  const int64_t group_stride = static_cast<int64_t>(gridDim.x) * RPB;
  const float inv_h = 1.f / static_cast<float>(hidden);

  float dw_acc[ITEMS][VEC];
  float db_acc[ITEMS][VEC];
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
#pragma unroll
    for (int v = 0; v < VEC; ++v) dw_acc[it][v] = db_acc[it][v] = 0.f;
  }

  // For RPB == 1 every thread of the block runs the same trip count, so the __syncthreads inside
  // row_reduce stay uniform; for RPB > 1 rows are warps and row_reduce has no __syncthreads.
  for (int64_t row = group; row < rows; row += group_stride) {
    const T* xrow = x + row * hidden;
    const T* gyrow = grad_y + row * hidden;
    const float mean = mean_in[row];
    const float rstd = rstd_in[row];
    float xhat[ITEMS][VEC];
    float g[ITEMS][VEC];
    float sum_g = 0.f, sum_gx = 0.f;
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
      const int base = (it * ROW_THREADS + tid) * VEC;
      if (base < hidden) {
        float gy[VEC], w[VEC];
        load_as_float<VEC>(xrow + base, xhat[it]);
        load_as_float<VEC>(gyrow + base, gy);
        load_as_float<VEC>(weight + base, w);
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          xhat[it][v] = (xhat[it][v] - mean) * rstd;
          dw_acc[it][v] = fmaf(gy[v], xhat[it][v], dw_acc[it][v]);
          db_acc[it][v] += gy[v];
          g[it][v] = gy[v] * w[v];
          sum_g += g[it][v];
          sum_gx = fmaf(g[it][v], xhat[it][v], sum_gx);
        }
      }
    }
    float sums[2] = {sum_g, sum_gx};
    row_reduce_sums<ROW_THREADS, 2>(sums, red);
    const float mean_g = sums[0] * inv_h;
    const float mean_gx = sums[1] * inv_h;
    T* dxrow = grad_x + row * hidden;
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
      const int base = (it * ROW_THREADS + tid) * VEC;
      if (base < hidden) {
        float out[VEC];
        if constexpr (kReload) {
          // 1024-thread rows have 64 registers per thread: re-read x, grad_y, w (L1/L2-resident)
          // instead of keeping xhat and g live across the reduction, which would spill.
          float xr[VEC], gy[VEC], w[VEC];
          load_as_float<VEC>(xrow + base, xr);
          load_as_float<VEC>(gyrow + base, gy);
          load_as_float<VEC>(weight + base, w);
#pragma unroll
          for (int v = 0; v < VEC; ++v) {
            out[v] = rstd * (gy[v] * w[v] - mean_g - (xr[v] - mean) * rstd * mean_gx);
          }
        } else {
#pragma unroll
          for (int v = 0; v < VEC; ++v) out[v] = rstd * (g[it][v] - mean_g - xhat[it][v] * mean_gx);
        }
        store_from_float<VEC>(dxrow + base, out);
      }
    }
    // red is rewritten by the next row's reduction: wait until everyone has read it.
    if constexpr (ROW_THREADS > 32) __syncthreads();
  }

  float* dwrow = dw_part + group * hidden;
  float* dbrow = db_part + group * hidden;
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int base = (it * ROW_THREADS + tid) * VEC;
    if (base < hidden) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        dwrow[base + v] = dw_acc[it][v];
        dbrow[base + v] = db_acc[it][v];
      }
    }
  }
}

// grad_w[c] = sum_p dw_part[p, c] (same for grad_b). Block (32, 32): 32 columns, 32 partial rows at a
// time, four independent loads in flight per thread.
__global__ void __launch_bounds__(1024)
sum_partials_kernel(const float* __restrict__ dw_part, const float* __restrict__ db_part, float* __restrict__ grad_w,
                    float* __restrict__ grad_b, int64_t parts, int hidden) {
  __shared__ float sw[32][33];
  __shared__ float sb[32][33];
  const int col = blockIdx.x * 32 + threadIdx.x;
  float aw[4] = {0.f, 0.f, 0.f, 0.f}, ab[4] = {0.f, 0.f, 0.f, 0.f};
  if (col < hidden) {
    int64_t p = threadIdx.y;
    for (; p + 3 * 32 < parts; p += 4 * 32) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        aw[k] += dw_part[(p + k * 32) * hidden + col];
        ab[k] += db_part[(p + k * 32) * hidden + col];
      }
    }
    for (; p < parts; p += 32) {
      aw[0] += dw_part[p * hidden + col];
      ab[0] += db_part[p * hidden + col];
    }
  }
  sw[threadIdx.y][threadIdx.x] = (aw[0] + aw[1]) + (aw[2] + aw[3]);
  sb[threadIdx.y][threadIdx.x] = (ab[0] + ab[1]) + (ab[2] + ab[3]);
  __syncthreads();
  if (threadIdx.y == 0 && col < hidden) {
    float w = 0.f, b = 0.f;
    for (int r = 0; r < 32; ++r) {
      w += sw[r][threadIdx.x];
      b += sb[r][threadIdx.x];
    }
    grad_w[col] = w;
    grad_b[col] = b;
  }
}

// Row groups resident at once for the backward: enough bytes in flight to saturate HBM while keeping
// the (groups, hidden) partial buffers small (about 512 threads per SM).
int backward_groups(int64_t rows, int hidden, int num_sms) {
  const int rt = row_threads_for(hidden);
  const int threads = rt >= 128 ? rt : 128;
  const int rpb = rt >= 128 ? 1 : 128 / rt;
  const int64_t blocks_per_sm = threads >= 512 ? 1 : 512 / threads;
  const int64_t max_blocks = static_cast<int64_t>(num_sms > 0 ? num_sms : 1) * blocks_per_sm;
  const int64_t need = (rows + rpb - 1) / rpb;
  return static_cast<int>(need < max_blocks ? need : max_blocks);
}

template <typename T, int VEC>
void forward_typed(const void* x, const float* weight, const float* bias, void* y, float* mean, float* rstd,
                   int64_t rows, int hidden, float eps, cudaStream_t stream) {
  MEGATRON_DISPATCH_ROW_THREADS(hidden, {
    constexpr int RPB = rows_per_block<RT>();
    const dim3 grid(static_cast<unsigned>((rows + RPB - 1) / RPB));
    layer_norm_forward_kernel<T, VEC, RT><<<grid, block_threads<RT>(), 0, stream>>>(
        static_cast<const T*>(x), weight, bias, static_cast<T*>(y), mean, rstd, rows, hidden, eps);
  });
}

template <typename T, int VEC>
void backward_typed(const void* grad_y, const void* x, const float* weight, const float* mean, const float* rstd,
                    void* grad_x, float* dw_part, float* db_part, int64_t rows, int hidden, int num_sms,
                    cudaStream_t stream) {
  const int blocks = backward_groups(rows, hidden, num_sms);
  MEGATRON_DISPATCH_ROW_THREADS(hidden, {
    layer_norm_backward_kernel<T, VEC, RT><<<blocks, block_threads<RT>(), 0, stream>>>(
        static_cast<const T*>(grad_y), static_cast<const T*>(x), weight, mean, rstd, static_cast<T*>(grad_x), dw_part,
        db_part, rows, hidden);
  });
}

}  // namespace

int64_t layer_norm_backward_partial_rows(int64_t rows, int hidden, int num_sms) {
  if (rows == 0) return 0;
  const int rt = row_threads_for(hidden);
  const int rpb = rt >= 128 ? 1 : 128 / rt;
  return static_cast<int64_t>(backward_groups(rows, hidden, num_sms)) * rpb;
}

void layer_norm_forward(DType dtype, const void* x, const float* weight, const float* bias, void* y, float* mean,
                        float* rstd, int64_t rows, int hidden, float eps, bool vectorized, cudaStream_t stream) {
  if (rows == 0) return;
  switch (dtype) {
    case DType::kFloat32:
      if (vectorized) forward_typed<float, 4>(x, weight, bias, y, mean, rstd, rows, hidden, eps, stream);
      else forward_typed<float, 1>(x, weight, bias, y, mean, rstd, rows, hidden, eps, stream);
      break;
    case DType::kFloat16:
      if (vectorized) forward_typed<__half, 8>(x, weight, bias, y, mean, rstd, rows, hidden, eps, stream);
      else forward_typed<__half, 1>(x, weight, bias, y, mean, rstd, rows, hidden, eps, stream);
      break;
    case DType::kBFloat16:
      if (vectorized) forward_typed<__nv_bfloat16, 8>(x, weight, bias, y, mean, rstd, rows, hidden, eps, stream);
      else forward_typed<__nv_bfloat16, 1>(x, weight, bias, y, mean, rstd, rows, hidden, eps, stream);
      break;
  }
  check_launch("layer_norm_forward");
}

void layer_norm_backward(DType dtype, const void* grad_y, const void* x, const float* weight, const float* mean,
                         const float* rstd, void* grad_x, float* grad_weight, float* grad_bias, float* dw_part,
                         float* db_part, int64_t rows, int hidden, int num_sms, bool vectorized, cudaStream_t stream) {
  if (rows == 0) {
    cudaMemsetAsync(grad_weight, 0, sizeof(float) * hidden, stream);
    cudaMemsetAsync(grad_bias, 0, sizeof(float) * hidden, stream);
    return;
  }
#define MEGATRON_LN_BWD(T, VEC) \
  backward_typed<T, VEC>(grad_y, x, weight, mean, rstd, grad_x, dw_part, db_part, rows, hidden, num_sms, stream)
  switch (dtype) {
    case DType::kFloat32:
      if (vectorized) MEGATRON_LN_BWD(float, 4); else MEGATRON_LN_BWD(float, 1);
      break;
    case DType::kFloat16:
      if (vectorized) MEGATRON_LN_BWD(__half, 8); else MEGATRON_LN_BWD(__half, 1);
      break;
    case DType::kBFloat16:
      if (vectorized) MEGATRON_LN_BWD(__nv_bfloat16, 8); else MEGATRON_LN_BWD(__nv_bfloat16, 1);
      break;
  }
#undef MEGATRON_LN_BWD
  check_launch("layer_norm_backward");
  const int64_t parts = layer_norm_backward_partial_rows(rows, hidden, num_sms);
  sum_partials_kernel<<<(hidden + 31) / 32, dim3(32, 32), 0, stream>>>(dw_part, db_part, grad_weight, grad_bias, parts,
                                                                       hidden);
  check_launch("layer_norm_backward (sum of partials)");
}

}  // namespace megatron_fused
