// y = x · Wᵀ + b for the few rows a decode step multiplies: linear_core.h holds the kernel and
// says how it works; this file registers it as an op (model/kernels/linear.py calls it).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "linear_core.h"

namespace {

// x [M, K] float32; packed: a weight [out, K] packed as linear_core.h says (float32 or
// bfloat16); bias [out] float32 or None → [M, out].
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                  int64_t out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [rows, in] matrix");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == out &&
                        bias->scalar_type() == at::kFloat),
              "the bias must be a contiguous float32 [out] vector");
  auto y = at::empty({x.size(0), out}, x.options());
  linear_core::project(x.data_ptr<float>(), packed, bias ? bias->data_ptr<float>() : nullptr,
                       y.data_ptr<float>(), x.size(0), x.size(1), out);
  return y;
}

// Whether this variant has the AMX path and this process may use the tiles.
bool tiles() {
#if defined(LINEAR_CORE_TILES)
  return linear_core::tiles::permitted();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ORDINAL_OPS, m) {
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int outputs) -> Tensor", &linear);
  m.def("tiles() -> bool", &tiles);
}
