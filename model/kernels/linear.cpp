// y = x · Wᵀ + b for the few rows a decode step multiplies: linear_core.h holds the kernel and
// says how it works; this file is its Python entry point (model/kernels/linear.py).
#include <torch/extension.h>

#include "linear_core.h"

#if defined(LINEAR_CORE_VECTORISED)

constexpr bool kVectorised = true;

// x [M, K] float32; packed: a weight [out, K] packed as linear_core.h says (float32 or
// bfloat16); bias [out] float32 or None.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed,
                     const c10::optional<torch::Tensor>& bias, int64_t out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [rows, in] matrix");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == out &&
                        bias->scalar_type() == at::kFloat),
              "the bias must be a contiguous float32 [out] vector");
  auto y = torch::empty({x.size(0), out}, x.options());
  linear_core::project(x.data_ptr<float>(), packed, bias ? bias->data_ptr<float>() : nullptr,
                       y.data_ptr<float>(), x.size(0), x.size(1), out);
  return y;
}

bool tiles() {
#if defined(LINEAR_CORE_TILES)
  return linear_core::tiles::permitted();
#else
  return false;
#endif
}

#else  // no AVX-512: linear.py never calls in (vectorised() is false), F.linear runs instead

constexpr bool kVectorised = false;

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed,
                     const c10::optional<torch::Tensor>& bias, int64_t out) {
  TORCH_CHECK(false, "the linear kernel needs AVX-512");
}

bool tiles() { return false; }

#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "x [M, K] · weight [out, K]ᵀ + bias (weight packed), for a few rows");
  m.def("vectorised", [] { return kVectorised; }, "whether this build has the AVX-512 kernel");
  m.def("tiles", &tiles, "whether this build has the AMX path and this process may use it");
}
