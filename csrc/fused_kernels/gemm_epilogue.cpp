// The MLP's dgrad GEMM with GeLU's gradient in its cuBLASLt epilogue (DGELU), row-major views, column-major call:
//
//   gemm_dgelu(dy (M,N), w (N,F), pre (M,F)) -> d_pre = (dy w) * gelu_tanh'(pre)   (M,F)
//
// Row-major (R, C) is column-major (C, R) with the same pointer, so the call computes d_pre^T = w^T dy^T as
// D (F x M) = A (F x N) B (N x M) with A = w and B = dy, reading pre^T (F x M) as the epilogue's aux input. On
// Hopper cuBLASLt runs DGELU inside the GEMM kernel; its DGELU_BGRAD (the bias gradient too) and GELU_AUX_BIAS
// (forward) were measured slower than the unfused ops in the training step (benchmarks/results/), so they are not
// here. Where cuBLASLt offers no algorithm the ATen ops run instead, counted by gemm_epilogue_fallbacks() so the
// GPU tests can assert that the epilogue itself ran.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <torch/extension.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

namespace megatron_fused {
namespace {

constexpr int64_t kWorkspaceBytes = 32 << 20;  // Hopper's recommended cuBLASLt workspace
std::atomic<int64_t> fallbacks{0};

#define LT_CHECK(expr)                                                                                      \
  do {                                                                                                      \
    const cublasStatus_t status_ = (expr);                                                                  \
    TORCH_CHECK(status_ == CUBLAS_STATUS_SUCCESS, "cuBLASLt call ", #expr, " failed with status ",         \
                static_cast<int>(status_));                                                                 \
  } while (0)

cudaDataType_t lt_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return CUDA_R_32F;
    case at::kHalf: return CUDA_R_16F;
    case at::kBFloat16: return CUDA_R_16BF;
    default: TORCH_CHECK(false, "gemm epilogue: unsupported dtype ", type);
  }
  return CUDA_R_32F;  // unreachable
}

int64_t alignment(const void* ptr) {  // the largest power of two <= 256 dividing the address
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  int64_t align = 256;
  while (align > 1 && address % align != 0) align /= 2;
  return align;
}

struct MatmulDesc {
  cublasLtMatmulDesc_t desc = nullptr;
  MatmulDesc() { LT_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F)); }
  ~MatmulDesc() { cublasLtMatmulDescDestroy(desc); }
  template <typename T>
  void set(cublasLtMatmulDescAttributes_t attribute, const T& value) {
    LT_CHECK(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)));
  }
};

struct Layout {
  cublasLtMatrixLayout_t layout = nullptr;
  Layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
    LT_CHECK(cublasLtMatrixLayoutCreate(&layout, type, rows, cols, ld));
  }
  ~Layout() { cublasLtMatrixLayoutDestroy(layout); }
};

struct Preference {
  cublasLtMatmulPreference_t pref = nullptr;
  Preference() { LT_CHECK(cublasLtMatmulPreferenceCreate(&pref)); }
  ~Preference() { cublasLtMatmulPreferenceDestroy(pref); }
  template <typename T>
  void set(cublasLtMatmulPreferenceAttributes_t attribute, const T& value) {
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attribute, &value, sizeof(value)));
  }
};

// One column-major GEMM: D (m x n, ld ldd) = epilogue(op(A) op(B)).
struct Gemm {
  bool trans_a, trans_b;
  int64_t m, n, k, lda, ldb, ldd;
  cublasLtEpilogue_t epilogue;
  at::ScalarType dtype;
  const void* a;
  const void* b;
  void* d;
  const void* aux;  // the epilogue's input (the pre-activation), ld m
};

using AlgoKey = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int64_t, int64_t,
                           int64_t, int>;

std::mutex algo_mutex;
std::map<AlgoKey, std::optional<cublasLtMatmulAlgo_t>> algo_cache;  // nullopt: cuBLASLt has none for this key

// Runs g; false (nothing written) where cuBLASLt has no algorithm for it. The algorithm cuBLASLt's heuristic picks
// first is cached per shape, epilogue, dtype and operand alignment.
bool run(const Gemm& g) {
  const cudaDataType_t type = lt_dtype(g.dtype);
  MatmulDesc desc;
  const cublasOperation_t op_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  desc.set(CUBLASLT_MATMUL_DESC_TRANSA, op_a);
  desc.set(CUBLASLT_MATMUL_DESC_TRANSB, op_b);
  desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, g.epilogue);
  desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
  desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.m);
  const Layout layout_a(type, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda);
  const Layout layout_b(type, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb);
  const Layout layout_d(type, g.m, g.n, g.ldd);
  const cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();

  const int64_t align_a = alignment(g.a), align_b = alignment(g.b), align_d = alignment(g.d);
  const AlgoKey key{g.trans_a, g.trans_b, g.m, g.n, g.k, g.lda, g.ldb, g.ldd, static_cast<int>(g.epilogue),
                    static_cast<int>(g.dtype), align_a, align_b, align_d,
                    static_cast<int>(c10::cuda::current_device())};
  std::optional<cublasLtMatmulAlgo_t> algo;
  {
    const std::lock_guard<std::mutex> lock(algo_mutex);
    const auto found = algo_cache.find(key);
    if (found != algo_cache.end()) {
      algo = found->second;
    } else {
      Preference pref;
      pref.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(kWorkspaceBytes));
      pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, static_cast<uint32_t>(align_a));
      pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, static_cast<uint32_t>(align_b));
      pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, static_cast<uint32_t>(align_d));
      pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, static_cast<uint32_t>(align_d));
      cublasLtMatmulHeuristicResult_t result{};
      int returned = 0;
      const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
          handle, desc.desc, layout_a.layout, layout_b.layout, layout_d.layout, layout_d.layout, pref.pref, 1,
          &result, &returned);
      if (status == CUBLAS_STATUS_SUCCESS && returned > 0) algo = result.algo;
      algo_cache.emplace(key, algo);
    }
  }
  if (!algo.has_value()) return false;
  const float alpha = 1.0f, beta = 0.0f;
  auto workspace = at::empty({kWorkspaceBytes}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA));
  LT_CHECK(cublasLtMatmul(handle, desc.desc, &alpha, g.a, layout_a.layout, g.b, layout_b.layout, &beta, g.d,
                          layout_d.layout, g.d, layout_d.layout, &*algo, workspace.data_ptr(), kWorkspaceBytes,
                          at::cuda::getCurrentCUDAStream()));
  return true;
}

void check_matrix(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), "gemm epilogue: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), "gemm epilogue: ", name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == dtype, "gemm epilogue: ", name, " must be ", dtype, ", got ", t.scalar_type());
}

// dy (M, N), weight (N, F), pre (M, F) -> (dy weight) * gelu_tanh'(pre) (M, F).
at::Tensor gemm_dgelu_op(const at::Tensor& dy, const at::Tensor& weight, const at::Tensor& pre) {
  const auto dtype = dy.scalar_type();
  check_matrix(dy, "dy", dtype);
  check_matrix(weight, "weight", dtype);
  check_matrix(pre, "pre", dtype);
  TORCH_CHECK(dy.dim() == 2 && weight.dim() == 2 && pre.dim() == 2 && dy.size(1) == weight.size(0) &&
                  pre.size(0) == dy.size(0) && pre.size(1) == weight.size(1),
              "gemm_dgelu: dy (M, N), weight (N, F), pre (M, F) expected, got ", dy.sizes(), ", ", weight.sizes(),
              ", ", pre.sizes());
  const int64_t rows = dy.size(0), out = dy.size(1), inner = weight.size(1);
  const c10::cuda::CUDAGuard guard(dy.device());
  auto d_pre = at::empty({rows, inner}, dy.options());
  const Gemm g{false, false, inner, rows, out, inner, out, inner, CUBLASLT_EPILOGUE_DGELU, dtype, weight.data_ptr(),
               dy.data_ptr(), d_pre.data_ptr(), pre.data_ptr()};
  if (run(g)) return d_pre;
  ++fallbacks;
  return at::gelu_backward(dy.mm(weight), pre, "tanh");
}

}  // namespace

void bind_gemm_epilogue(pybind11::module_& m) {
  m.def("gemm_dgelu", &gemm_dgelu_op, "(dy w) * gelu_tanh'(pre) through a cuBLASLt DGELU epilogue", py::arg("dy"),
        py::arg("weight"), py::arg("pre"));
  m.def("gemm_epilogue_fallbacks", [] { return fallbacks.load(); },
        "calls that found no cuBLASLt algorithm for their epilogue and ran the ATen ops instead");
}

}  // namespace megatron_fused
