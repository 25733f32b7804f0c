// Host-side launcher declarations of the fused kernels; the .cu files take raw pointers so they compile without torch headers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace megatron_fused {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Largest row length the kernels keep in registers (16 elements x 1024 threads).
constexpr int kMaxRowLength = 16384;

// probs = softmax_j(scale * x + slopes[h] * j) over unmasked j; x, probs (B, nh, sq, sk) contiguous.
// causal: j is masked when j > i + (sk - sq). mask (optional, uint8/bool, (Bm, 1, sq, sk) contiguous,
// Bm in {1, B}): j is masked where mask != 0. Rows with every j masked are written as zeros.
// vectorized: caller checked sk % 8 == 0 and 16-byte aligned x/probs and 8-byte aligned mask.
void alibi_softmax_forward(DType dtype, const void* x, const float* slopes, const uint8_t* mask,
                           int64_t mask_batch_stride, void* probs, int64_t batch, int nh, int sq, int sk,
                           float scale, bool causal, bool vectorized, cudaStream_t stream);

// grad_x = scale * probs * (grad_probs - sum_j grad_probs * probs); all (B, nh, sq, sk) contiguous.
// causal lets the kernel skip the columns the forward masked (their probs are zero).
void alibi_softmax_backward(DType dtype, const void* grad_probs, const void* probs, void* grad_x,
                            int64_t batch, int nh, int sq, int sk, float scale, bool causal, bool vectorized,
                            cudaStream_t stream);

// y = (x - mean) * rstd * weight + bias over rows of x (rows, hidden); weight, bias, mean, rstd fp32.
void layer_norm_forward(DType dtype, const void* x, const float* weight, const float* bias, void* y,
                        float* mean, float* rstd, int64_t rows, int hidden, float eps, bool vectorized,
                        cudaStream_t stream);

// Number of partial rows the backward needs in its (partial_rows, hidden) fp32 workspaces.
int64_t layer_norm_backward_partial_rows(int64_t rows, int hidden, int num_sms);

// grad_x (rows, hidden) in dtype; grad_weight, grad_bias (hidden,) fp32. dw_part, db_part are fp32
// workspaces of layer_norm_backward_partial_rows(...) x hidden elements.
void layer_norm_backward(DType dtype, const void* grad_y, const void* x, const float* weight,
                         const float* mean, const float* rstd, void* grad_x, float* grad_weight,
                         float* grad_bias, float* dw_part, float* db_part, int64_t rows, int hidden,
                         int num_sms, bool vectorized, cudaStream_t stream);

// The vocabulary slice a rank's logits hold: columns [vocab_start, vocab_start + vocab) of total_vocab.
struct VocabSlice {
  int64_t vocab;
  int64_t vocab_start;
  int64_t total_vocab;
  int64_t ignore_index;
};

// Per row of logits (rows, slice.vocab) contiguous in dtype, with int64 global targets (rows,): lse = logsumexp
// of the row (fp32), predicted = the target's logit if the slice holds it, else 0 (fp32); 0 for a target equal
// to ignore_index, NaN for any other target outside [0, total_vocab).
// vectorized: caller checked vocab % 8 == 0 and 16-byte aligned logits.
void cross_entropy_forward(DType dtype, const void* logits, const int64_t* target, float* lse, float* predicted,
                           int64_t rows, const VocabSlice& slice, bool vectorized, cudaStream_t stream);

// grad_logits = grad_loss[r] * (exp(logits - lse[r]) - onehot(t - vocab_start)) with lse the logsumexp over the
// whole vocabulary; zero for ignored rows. grad_logits may be logits itself (in place). Same vectorized contract,
// for both buffers.
void cross_entropy_backward(DType dtype, const float* grad_loss, const void* logits, const int64_t* target,
                            const float* lse, void* grad_logits, int64_t rows, const VocabSlice& slice,
                            bool vectorized, cudaStream_t stream);

}  // namespace megatron_fused
