// Each row's argmax — torch.argmax(x, dim=-1) — for a decode step's greedy draw
// (model/kernels/argmax.py says why), written over simd.h.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "simd.h"

namespace {

using simd::f32x16;

// The first index of the largest of x[0..n) — torch's answer: a NaN counts as the largest, so
// the first NaN if there is one; ties go to the lowest index.
int64_t first_largest(const float* x, int64_t n) {
  f32x16 best = simd::broadcast(-__builtin_inff());
  bool nan = false;
  int64_t i = 0;
  for (; i + simd::kLanes <= n; i += simd::kLanes) {
    const f32x16 v = simd::load(x + i);
    nan |= simd::any(simd::is_nan(v));
    best = simd::max(best, v);
  }
  float largest = simd::reduce_max(best);
  for (int64_t j = i; j < n; ++j) {
    nan |= x[j] != x[j];
    largest = x[j] > largest ? x[j] : largest;
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (x[j] != x[j]) return j;
  }
  for (i = 0; i + simd::kLanes <= n; i += simd::kLanes) {
    const int lane = simd::first(simd::load(x + i) == largest);
    if (lane >= 0) return i + lane;
  }
  for (; i < n; ++i)
    if (x[i] == largest) return i;
  return 0;  // not reached: the largest is one of the values
}

// x [rows, n] float32, contiguous → [rows] int64.
at::Tensor argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [rows, n] matrix with n > 0");
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const float* data = x.data_ptr<float>();
  int64_t* index = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < x.size(0); ++r) index[r] = first_largest(data + r * x.size(1), x.size(1));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ORDINAL_OPS, m) {
  m.def("argmax(Tensor x) -> Tensor", &argmax);
}
