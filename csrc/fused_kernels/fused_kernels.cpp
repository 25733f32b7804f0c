// PyTorch bindings of the fused kernels: tensor checks, output allocation, stream, then the raw-pointer launchers.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <optional>
#include <tuple>

#include "fused_kernels.h"

namespace megatron_fused {

void bind_gemm_epilogue(pybind11::module_& m);  // gemm_epilogue.cpp

namespace {

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "fused kernels: unsupported dtype ", t.scalar_type());
  }
  return DType::kFloat32;  // unreachable
}

bool aligned(const at::Tensor& t, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0;
}

void check_cuda_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// x (B, nh, sq, sk) fp16/bf16; slopes (nh,) fp32; mask (Bm, 1, sq, sk) bool with Bm in {1, B} or none (causal).
at::Tensor alibi_softmax_forward_op(const at::Tensor& x, const at::Tensor& slopes, double scale,
                                    const std::optional<at::Tensor>& mask, bool causal) {
  check_cuda_contiguous(x, "scores");
  check_cuda_contiguous(slopes, "slopes");
  TORCH_CHECK(x.dim() == 4, "scores must be (B, nh, sq, sk), got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, "scores must be fp16 or bf16");
  TORCH_CHECK(slopes.scalar_type() == at::kFloat && slopes.numel() == x.size(1), "slopes must be fp32 (nh,)");
  const int64_t batch = x.size(0), nh = x.size(1), sq = x.size(2), sk = x.size(3);
  TORCH_CHECK(sk <= kMaxRowLength, "sk ", sk, " > ", kMaxRowLength);
  const uint8_t* mask_ptr = nullptr;
  int64_t mask_batch_stride = 0;
  bool vectorized = sk % 8 == 0 && aligned(x, 16);
  if (mask.has_value()) {
    TORCH_CHECK(!causal, "causal and mask are exclusive");
    const at::Tensor& m = *mask;
    check_cuda_contiguous(m, "mask");
    TORCH_CHECK(m.scalar_type() == at::kBool, "mask must be bool");
    TORCH_CHECK(m.dim() == 4 && (m.size(0) == 1 || m.size(0) == batch) && m.size(1) == 1 && m.size(2) == sq &&
                    m.size(3) == sk,
                "mask must be (B or 1, 1, sq, sk), got ", m.sizes());
    mask_ptr = reinterpret_cast<const uint8_t*>(m.data_ptr());
    mask_batch_stride = m.size(0) == 1 ? 0 : sq * sk;
    vectorized = vectorized && aligned(m, 8);
  }
  auto probs = at::empty_like(x);
  vectorized = vectorized && aligned(probs, 16);
  const c10::cuda::CUDAGuard guard(x.device());
  alibi_softmax_forward(dtype_of(x), x.data_ptr(), slopes.data_ptr<float>(), mask_ptr, mask_batch_stride,
                        probs.data_ptr(), batch, static_cast<int>(nh), static_cast<int>(sq), static_cast<int>(sk),
                        static_cast<float>(scale), causal, vectorized, at::cuda::getCurrentCUDAStream());
  return probs;
}

// grad_probs, probs (B, nh, sq, sk) -> grad_scores.
at::Tensor alibi_softmax_backward_op(const at::Tensor& grad_probs, const at::Tensor& probs, double scale, bool causal) {
  check_cuda_contiguous(grad_probs, "grad_probs");
  check_cuda_contiguous(probs, "probs");
  TORCH_CHECK(probs.dim() == 4 && grad_probs.sizes() == probs.sizes(), "grad_probs and probs must match");
  TORCH_CHECK(grad_probs.scalar_type() == probs.scalar_type(), "grad_probs and probs must share a dtype");
  TORCH_CHECK(probs.scalar_type() == at::kHalf || probs.scalar_type() == at::kBFloat16, "probs must be fp16 or bf16");
  const int64_t batch = probs.size(0), nh = probs.size(1), sq = probs.size(2), sk = probs.size(3);
  TORCH_CHECK(sk <= kMaxRowLength, "sk ", sk, " > ", kMaxRowLength);
  auto grad_x = at::empty_like(probs);
  const bool vectorized = sk % 8 == 0 && aligned(probs, 16) && aligned(grad_probs, 16) && aligned(grad_x, 16);
  const c10::cuda::CUDAGuard guard(probs.device());
  alibi_softmax_backward(dtype_of(probs), grad_probs.data_ptr(), probs.data_ptr(), grad_x.data_ptr(), batch,
                         static_cast<int>(nh), static_cast<int>(sq), static_cast<int>(sk), static_cast<float>(scale),
                         causal, vectorized, at::cuda::getCurrentCUDAStream());
  return grad_x;
}

void check_layer_norm_params(const at::Tensor& x, const at::Tensor& weight, const char* name) {
  check_cuda_contiguous(weight, name);
  TORCH_CHECK(weight.scalar_type() == at::kFloat, name, " must be fp32");
  TORCH_CHECK(weight.numel() == x.size(1), name, " must have hidden = ", x.size(1), " elements");
}

// x (rows, hidden) -> y (rows, hidden) in x.dtype, mean (rows,), rstd (rows,) fp32.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward_op(const at::Tensor& x, const at::Tensor& weight,
                                                                     const at::Tensor& bias, double eps) {
  check_cuda_contiguous(x, "input");
  TORCH_CHECK(x.dim() == 2, "input must be (rows, hidden)");
  check_layer_norm_params(x, weight, "weight");
  check_layer_norm_params(x, bias, "bias");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(hidden > 0 && hidden <= kMaxRowLength, "hidden ", hidden, " not in [1, ", kMaxRowLength, "]");
  auto y = at::empty_like(x);
  auto mean = at::empty({rows}, x.options().dtype(at::kFloat));
  auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  const int64_t vec_elems = 16 / x.element_size();
  const bool vectorized = hidden % vec_elems == 0 && aligned(x, 16) && aligned(y, 16) && aligned(weight, 16) &&
                          aligned(bias, 16);
  const c10::cuda::CUDAGuard guard(x.device());
  layer_norm_forward(dtype_of(x), x.data_ptr(), weight.data_ptr<float>(), bias.data_ptr<float>(), y.data_ptr(),
                     mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, static_cast<int>(hidden),
                     static_cast<float>(eps), vectorized, at::cuda::getCurrentCUDAStream());
  return {y, mean, rstd};
}

// -> grad_x (rows, hidden) in x.dtype, grad_weight (hidden,) fp32, grad_bias (hidden,) fp32.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_op(const at::Tensor& grad_y, const at::Tensor& x,
                                                                      const at::Tensor& weight, const at::Tensor& mean,
                                                                      const at::Tensor& rstd) {
  check_cuda_contiguous(grad_y, "grad_output");
  check_cuda_contiguous(x, "input");
  TORCH_CHECK(x.dim() == 2 && grad_y.sizes() == x.sizes(), "grad_output and input must be (rows, hidden)");
  TORCH_CHECK(grad_y.scalar_type() == x.scalar_type(), "grad_output and input must share a dtype");
  check_layer_norm_params(x, weight, "weight");
  check_cuda_contiguous(mean, "mean");
  check_cuda_contiguous(rstd, "rstd");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(hidden > 0 && hidden <= kMaxRowLength, "hidden ", hidden, " not in [1, ", kMaxRowLength, "]");
  TORCH_CHECK(mean.numel() == rows && rstd.numel() == rows, "mean and rstd must have rows elements");
  const c10::cuda::CUDAGuard guard(x.device());
  const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  auto grad_x = at::empty_like(x);
  auto grad_w = at::empty({hidden}, weight.options());
  auto grad_b = at::empty({hidden}, weight.options());
  const int64_t parts = layer_norm_backward_partial_rows(rows, static_cast<int>(hidden), num_sms);
  auto dw_part = at::empty({parts, hidden}, weight.options());
  auto db_part = at::empty({parts, hidden}, weight.options());
  const int64_t vec_elems = 16 / x.element_size();
  const bool vectorized = hidden % vec_elems == 0 && aligned(x, 16) && aligned(grad_y, 16) && aligned(grad_x, 16) &&
                          aligned(weight, 16);
  layer_norm_backward(dtype_of(x), grad_y.data_ptr(), x.data_ptr(), weight.data_ptr<float>(), mean.data_ptr<float>(),
                      rstd.data_ptr<float>(), grad_x.data_ptr(), grad_w.data_ptr<float>(), grad_b.data_ptr<float>(),
                      dw_part.data_ptr<float>(), db_part.data_ptr<float>(), rows, static_cast<int>(hidden), num_sms,
                      vectorized, at::cuda::getCurrentCUDAStream());
  return {grad_x, grad_w, grad_b};
}

void check_cross_entropy_inputs(const at::Tensor& logits, const at::Tensor& target) {
  check_cuda_contiguous(logits, "logits");
  check_cuda_contiguous(target, "target");
  TORCH_CHECK(logits.dim() == 2, "logits must be (rows, vocab), got ", logits.sizes());
  TORCH_CHECK(target.scalar_type() == at::kLong && target.dim() == 1 && target.size(0) == logits.size(0),
              "target must be int64 (rows,)");
  TORCH_CHECK(logits.size(1) > 0, "vocab must be > 0");
}

VocabSlice vocab_slice(const at::Tensor& logits, int64_t vocab_start, int64_t total_vocab, int64_t ignore_index) {
  const int64_t vocab = logits.size(1);
  TORCH_CHECK(vocab_start >= 0 && vocab_start + vocab <= total_vocab, "vocab slice [", vocab_start, ", ",
              vocab_start + vocab, ") outside total_vocab ", total_vocab);
  return VocabSlice{vocab, vocab_start, total_vocab, ignore_index};
}

// logits (rows, vocab) fp32/fp16/bf16, target (rows,) int64 -> lse (rows,) fp32, predicted (rows,) fp32.
std::tuple<at::Tensor, at::Tensor> cross_entropy_forward_op(const at::Tensor& logits, const at::Tensor& target,
                                                            int64_t vocab_start, int64_t total_vocab,
                                                            int64_t ignore_index) {
  check_cross_entropy_inputs(logits, target);
  const VocabSlice slice = vocab_slice(logits, vocab_start, total_vocab, ignore_index);
  const int64_t rows = logits.size(0);
  auto lse = at::empty({rows}, logits.options().dtype(at::kFloat));
  auto predicted = at::empty({rows}, logits.options().dtype(at::kFloat));
  const c10::cuda::CUDAGuard guard(logits.device());
  cross_entropy_forward(dtype_of(logits), logits.data_ptr(), target.data_ptr<int64_t>(), lse.data_ptr<float>(),
                        predicted.data_ptr<float>(), rows, slice, slice.vocab % 8 == 0 && aligned(logits, 16),
                        at::cuda::getCurrentCUDAStream());
  return {lse, predicted};
}

// -> grad_logits (rows, vocab) in logits.dtype, written over logits when inplace; lse is the full-vocabulary one.
at::Tensor cross_entropy_backward_op(const at::Tensor& grad_loss, at::Tensor logits, const at::Tensor& target,
                                     const at::Tensor& lse, int64_t vocab_start, int64_t total_vocab,
                                     int64_t ignore_index, bool inplace) {
  check_cross_entropy_inputs(logits, target);
  check_cuda_contiguous(grad_loss, "grad_loss");
  check_cuda_contiguous(lse, "lse");
  const VocabSlice slice = vocab_slice(logits, vocab_start, total_vocab, ignore_index);
  const int64_t rows = logits.size(0);
  TORCH_CHECK(grad_loss.scalar_type() == at::kFloat && grad_loss.numel() == rows, "grad_loss must be fp32 (rows,)");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.numel() == rows, "lse must be fp32 (rows,)");
  auto grad = inplace ? logits : at::empty_like(logits);
  const c10::cuda::CUDAGuard guard(logits.device());
  cross_entropy_backward(dtype_of(logits), grad_loss.data_ptr<float>(), logits.data_ptr(),
                         target.data_ptr<int64_t>(), lse.data_ptr<float>(), grad.data_ptr(), rows, slice,
                         slice.vocab % 8 == 0 && aligned(logits, 16) && aligned(grad, 16),
                         at::cuda::getCurrentCUDAStream());
  return grad;
}

}  // namespace
}  // namespace megatron_fused

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Megatron-BLOOM fused CUDA kernels (ALiBi softmax, mixed-precision LayerNorm, cross entropy, cuBLASLt "
            "GEMM epilogues)";
  m.attr("max_row_length") = megatron_fused::kMaxRowLength;
  m.def("alibi_softmax_forward", &megatron_fused::alibi_softmax_forward_op, "ALiBi softmax forward",
        py::arg("scores"), py::arg("slopes"), py::arg("scale"), py::arg("mask") = py::none(), py::arg("causal") = true);
  m.def("alibi_softmax_backward", &megatron_fused::alibi_softmax_backward_op, "ALiBi softmax backward",
        py::arg("grad_probs"), py::arg("probs"), py::arg("scale"), py::arg("causal"));
  m.def("layer_norm_forward", &megatron_fused::layer_norm_forward_op, "mixed LayerNorm forward", py::arg("input"),
        py::arg("weight"), py::arg("bias"), py::arg("eps"));
  m.def("layer_norm_backward", &megatron_fused::layer_norm_backward_op, "mixed LayerNorm backward",
        py::arg("grad_output"), py::arg("input"), py::arg("weight"), py::arg("mean"), py::arg("rstd"));
  m.def("cross_entropy_forward", &megatron_fused::cross_entropy_forward_op, "cross entropy forward",
        py::arg("logits"), py::arg("target"), py::arg("vocab_start"), py::arg("total_vocab"), py::arg("ignore_index"));
  m.def("cross_entropy_backward", &megatron_fused::cross_entropy_backward_op, "cross entropy backward",
        py::arg("grad_loss"), py::arg("logits"), py::arg("target"), py::arg("lse"), py::arg("vocab_start"),
        py::arg("total_vocab"), py::arg("ignore_index"), py::arg("inplace"));
  megatron_fused::bind_gemm_epilogue(m);
}
