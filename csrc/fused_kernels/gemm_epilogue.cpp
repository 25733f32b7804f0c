// The MLP's GEMMs with cuBLASLt epilogues: tanh GeLU and its bias in the h -> 4h GEMM (the pre-activation kept as
// the epilogue's auxiliary output), and GeLU's gradient with the bias gradient in the 4h -> h dgrad GEMM.
//
// Row-major (tokens, n) tensors are column-major (n, tokens) matrices to cuBLAS, so every call below computes
// D (m x tokens, column-major, ld m) = op(A) B with the weight as A and the activations as B; the epilogue's bias
// and bias gradient are per row of D, i.e. per output feature.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace megatron_fused {
namespace {

constexpr int64_t kWorkspaceBytes = 32 << 20;  // cuBLAS's own choice for sm_90

void check_lt(cublasStatus_t status, const char* what) {
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "cuBLASLt ", what, " failed: ", cublasLtGetStatusString(status));
}

cudaDataType_t cuda_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return CUDA_R_32F;
    case at::kHalf: return CUDA_R_16F;
    case at::kBFloat16: return CUDA_R_16BF;
    default: TORCH_CHECK(false, "GEMM epilogues: unsupported dtype ", t.scalar_type());
  }
  return CUDA_R_32F;  // unreachable
}

void check_matrix(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous 2-D CUDA tensor, got ",
              t.sizes());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must be ", like.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
}

// RAII holders of the cuBLASLt descriptors of one call.
struct Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  ~Descriptors() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// D (m x n, ld m) = epilogue(op(A) B): A stored (a_rows x a_cols, ld a_rows), transposed when trans_a; B stored
// (k x n, ld k). bias: the bias (forward) or the bias gradient (output); aux: the pre-activation (ld m).
void matmul(const at::Tensor& a, bool trans_a, int64_t a_rows, int64_t a_cols, const at::Tensor& b, at::Tensor& d,
            int64_t m, int64_t n, int64_t k, cublasLtEpilogue_t epilogue, void* bias, void* aux) {
  const cudaDataType_t type = cuda_type(d);
  Descriptors desc;
  check_lt(cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul descriptor");
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = CUBLAS_OP_N;
  check_lt(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)), "TRANSA");
  check_lt(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)), "TRANSB");
  check_lt(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)),
           "EPILOGUE");
  check_lt(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)),
           "BIAS_POINTER");
  check_lt(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)),
           "EPILOGUE_AUX_POINTER");
  const int64_t aux_ld = m;
  check_lt(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)),
           "EPILOGUE_AUX_LD");
  check_lt(cublasLtMatrixLayoutCreate(&desc.a, type, a_rows, a_cols, a_rows), "layout A");
  check_lt(cublasLtMatrixLayoutCreate(&desc.b, type, k, n, k), "layout B");
  check_lt(cublasLtMatrixLayoutCreate(&desc.d, type, m, n, m), "layout D");
  check_lt(cublasLtMatmulPreferenceCreate(&desc.preference), "preference");
  const uint64_t workspace_bytes = kWorkspaceBytes;
  check_lt(cublasLtMatmulPreferenceSetAttribute(desc.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &workspace_bytes, sizeof(workspace_bytes)),
           "workspace preference");
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  check_lt(cublasLtMatmulAlgoGetHeuristic(handle, desc.op, desc.a, desc.b, desc.d, desc.d, desc.preference, 1,
                                          &heuristic, &found),
           "heuristic");
  TORCH_CHECK(found > 0, "cuBLASLt has no algorithm for this GEMM epilogue (m ", m, ", n ", n, ", k ", k, ")");
  auto workspace = at::empty({static_cast<int64_t>(heuristic.workspaceSize)}, d.options().dtype(at::kByte));
  const float alpha = 1.0f, beta = 0.0f;
  check_lt(cublasLtMatmul(handle, desc.op, &alpha, a.data_ptr(), desc.a, b.data_ptr(), desc.b, &beta, d.data_ptr(),
                          desc.d, d.data_ptr(), desc.d, &heuristic.algo, workspace.data_ptr(), heuristic.workspaceSize,
                          at::cuda::getCurrentCUDAStream()),
           "matmul");
}

}  // namespace

// x (tokens, k), weight (m, k), bias (m,) -> [gelu_tanh(x weight^T + bias), x weight^T + bias], both (tokens, m).
std::vector<at::Tensor> gemm_bias_gelu_op(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  check_matrix(x, "x", x);
  check_matrix(weight, "weight", x);
  TORCH_CHECK(bias.is_cuda() && bias.dim() == 1 && bias.is_contiguous() && bias.scalar_type() == x.scalar_type(),
              "bias must be a contiguous 1-D CUDA tensor of the input's dtype");
  const int64_t tokens = x.size(0), k = x.size(1), m = weight.size(0);
  TORCH_CHECK(weight.size(1) == k && bias.size(0) == m, "shapes x ", x.sizes(), " weight ", weight.sizes(), " bias ",
              bias.sizes(), " do not chain");
  TORCH_CHECK(m % 8 == 0, "output features ", m, " must be a multiple of 8 (the auxiliary output's alignment)");
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({tokens, m}, x.options());
  auto pre = at::empty({tokens, m}, x.options());
  matmul(weight, /*trans_a=*/true, k, m, x, out, m, tokens, k, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, bias.data_ptr(),
         pre.data_ptr());
  return {out, pre};
}

// grad (tokens, k), weight (k, m), pre (tokens, m) -> [gelu_tanh'(pre) * (grad weight), its column sums (m,)].
std::vector<at::Tensor> gemm_dgelu_bgrad_op(const at::Tensor& grad, const at::Tensor& weight, const at::Tensor& pre) {
  check_matrix(grad, "grad", grad);
  check_matrix(weight, "weight", grad);
  check_matrix(pre, "pre-activation", grad);
  const int64_t tokens = grad.size(0), k = grad.size(1), m = weight.size(1);
  TORCH_CHECK(weight.size(0) == k && pre.size(0) == tokens && pre.size(1) == m, "shapes grad ", grad.sizes(),
              " weight ", weight.sizes(), " pre-activation ", pre.sizes(), " do not chain");
  TORCH_CHECK(m % 8 == 0, "features ", m, " must be a multiple of 8 (the auxiliary input's alignment)");
  const c10::cuda::CUDAGuard guard(grad.device());
  auto grad_pre = at::empty({tokens, m}, grad.options());
  auto grad_bias = at::empty({m}, grad.options());
  matmul(weight, /*trans_a=*/false, m, k, grad, grad_pre, m, tokens, k, CUBLASLT_EPILOGUE_DGELU_BGRAD,
         grad_bias.data_ptr(), pre.data_ptr());
  return {grad_pre, grad_bias};
}

}  // namespace megatron_fused
