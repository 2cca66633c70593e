// A temperature-only draw — softmax(logits / T), then the first token whose cumulative mass
// reaches u × the total — in one pass per row, for a sampled decode step (model/kernels/draw.py
// says why), written over simd.h.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <tuple>
#include <vector>

#include "simd.h"

namespace {

using simd::f32x16;
constexpr int64_t kBlock = simd::kLanes;  // tokens summed together

// One row: logits [V], its temperature and uniform; weights: room for V floats, block_sums for
// ceil(V / 16). → the token, or V when u × total is past the row's whole mass (a uniform
// outside [0, 1)).
//
// The weights exp((z − max) / T) need not be normalised: the target is u × their total, which
// is what the cumulative sum reaches at the end. The total is the sum of the 16-token blocks'
// sums, in order, and the walk adds the same block sums, so a target at most the total is
// always found; inside the block that crosses it, tokens are added one by one. Two passes over
// the logits, 16 tokens at a time: their largest, then each block's weights and sum.
//
// `raw`: the row's logits straight from the model, where any NaN or infinity is a failure:
// -1 for such a row (the max pass tests each block on the way, so the check costs no pass of
// its own).
int64_t draw_row(const float* logits, int64_t V, float temperature, float uniform,
                 float* weights, float* block_sums, bool raw) {
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  const auto block = [&](int64_t b) {  // lanes past the vocabulary are −inf: weight 0
    const int64_t lanes = std::min(kBlock, V - b * kBlock);
    if (lanes == kBlock) return simd::load(logits + b * kBlock);
    return simd::load_first(logits + b * kBlock, lanes, -__builtin_inff());
  };
  f32x16 largest_lanes = simd::broadcast(-__builtin_inff());
  bool not_finite = false;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lanes = std::min(kBlock, V - b * kBlock);
    if (lanes == kBlock) {
      const f32x16 z = simd::load(logits + b * kBlock);
      if (raw) not_finite |= simd::any(simd::not_finite(z));
      largest_lanes = simd::max(largest_lanes, z);
    } else {
      const f32x16 z = simd::load_first(logits + b * kBlock, lanes);  // zeros past V: finite
      if (raw) not_finite |= simd::any(simd::not_finite(z));
      const simd::i32x16 inside = simd::lane_index() < static_cast<int32_t>(lanes);
      largest_lanes = simd::max(largest_lanes, simd::select(inside, z, largest_lanes));
    }
  }
  if (not_finite) return -1;
  const float largest = simd::reduce_max(largest_lanes);
  const float inverse_temperature = 1.0f / temperature;
  for (int64_t b = 0; b < blocks; ++b) {
    const f32x16 w = simd::exp((block(b) - largest) * inverse_temperature);
    simd::store_first(weights + b * kBlock, w, std::min(kBlock, V - b * kBlock));
    block_sums[b] = simd::reduce_add(w);
  }
  float total = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) total += block_sums[b];
  // Above 0 and above what the blocks before reached, so the token that reaches it added mass:
  // one without has the cumulative sum of the one before.
  const float target = std::max(uniform * total, FLT_MIN);
  float reached = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    if (reached + block_sums[b] < target) {
      reached += block_sums[b];
      continue;
    }
    const int64_t first = b * kBlock, last = std::min(V, first + kBlock);
    int64_t with_mass = first;
    for (int64_t i = first; i < last; ++i) {
      if (weights[i] > 0.0f) with_mass = i;
      reached += weights[i];
      if (reached >= target) return i;
    }
    return with_mass;  // added one by one the block fell short by a rounding: its last with mass
  }
  return V;
}

// logits [B, V] float32 (contiguous); temperature, uniforms [B] float32 → [B] int64; `raw`: as
// draw_row's.
at::Tensor draw_rows(const at::Tensor& logits, const at::Tensor& temperature,
                     const at::Tensor& uniforms, bool raw) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.scalar_type() == at::kFloat &&
                  logits.is_contiguous(),
              "logits must be a contiguous float32 [rows, V] matrix with V > 0");
  const int64_t rows = logits.size(0), V = logits.size(1);
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.numel() == rows &&
                  uniforms.scalar_type() == at::kFloat && uniforms.numel() == rows,
              "temperature and uniforms must be float32 [rows] vectors");
  const auto t = temperature.contiguous(), u = uniforms.contiguous();
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  std::vector<float> weights(V), block_sums((V + kBlock - 1) / kBlock);
  for (int64_t r = 0; r < rows; ++r)
    out.data_ptr<int64_t>()[r] = draw_row(logits.data_ptr<float>() + r * V, V,
                                          t.data_ptr<float>()[r], u.data_ptr<float>()[r],
                                          weights.data(), block_sums.data(), raw);
  return out;
}

at::Tensor tempered(const at::Tensor& logits, const at::Tensor& temperature,
                    const at::Tensor& uniforms) {
  return draw_rows(logits, temperature, uniforms, false);
}

// The same draw of raw logits → (tokens, how many rows failed: -1 for a NaN or infinite logit,
// V for a uniform outside [0, 1)), so that a step whose rows are all fine needs no other check.
std::tuple<at::Tensor, int64_t> tempered_raw(const at::Tensor& logits,
                                             const at::Tensor& temperature,
                                             const at::Tensor& uniforms) {
  auto out = draw_rows(logits, temperature, uniforms, true);
  const int64_t V = logits.size(1);
  int64_t failed = 0;
  for (int64_t r = 0; r < out.size(0); ++r) {
    const int64_t token = out.data_ptr<int64_t>()[r];
    failed += token < 0 || token >= V;
  }
  return {out, failed};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ORDINAL_OPS, m) {
  m.def("tempered(Tensor logits, Tensor temperature, Tensor uniforms) -> Tensor", &tempered);
  m.def("tempered_raw(Tensor logits, Tensor temperature, Tensor uniforms) -> (Tensor, int)",
        &tempered_raw);
}
