// A temperature-only draw — softmax(logits / T), then the first token whose cumulative mass
// reaches u × the total — in one pass per row, for a sampled decode step (model/kernels/draw.py
// says why).
#include <torch/extension.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)

#include <immintrin.h>

namespace {

constexpr int64_t kBlock = 16;  // tokens summed together: one AVX-512 register

// One row: logits [V], its temperature and uniform; weights: room for V floats, block_sums for
// ceil(V / 16). → the token, or V when u × total is past the row's whole mass (a uniform
// outside [0, 1)).
//
// The weights exp(z - max) need not be normalised: the target is u × their total, which is
// what the cumulative sum reaches at the end. The total is the sum of the 16-token blocks'
// sums, in order, and the walk adds the same block sums, so a target at most the total is
// always found; inside the block that crosses it, tokens are added one by one.
int64_t draw_row(const float* logits, int64_t V, float temperature, float uniform,
                 float* weights, float* block_sums) {
  float largest = -INFINITY;
  for (int64_t i = 0; i < V; ++i) {
    weights[i] = logits[i] / temperature;
    largest = std::max(largest, weights[i]);
  }
#pragma omp simd
  for (int64_t i = 0; i < V; ++i) weights[i] = std::exp(weights[i] - largest);
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lanes = std::min(kBlock, V - b * kBlock);
    const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1u);
    block_sums[b] = _mm512_reduce_add_ps(_mm512_maskz_loadu_ps(mask, weights + b * kBlock));
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

}  // namespace

constexpr bool kVectorised = true;

// logits [B, V] float32 (contiguous); temperature, uniforms [B] float32 → [B] int64.
torch::Tensor tempered(const torch::Tensor& logits, const torch::Tensor& temperature,
                       const torch::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.scalar_type() == at::kFloat &&
                  logits.is_contiguous(),
              "logits must be a contiguous float32 [rows, V] matrix with V > 0");
  const int64_t rows = logits.size(0), V = logits.size(1);
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.numel() == rows &&
                  uniforms.scalar_type() == at::kFloat && uniforms.numel() == rows,
              "temperature and uniforms must be float32 [rows] vectors");
  const auto t = temperature.contiguous(), u = uniforms.contiguous();
  auto out = torch::empty({rows}, logits.options().dtype(at::kLong));
  std::vector<float> weights(V), block_sums((V + kBlock - 1) / kBlock);
  for (int64_t r = 0; r < rows; ++r)
    out.data_ptr<int64_t>()[r] = draw_row(logits.data_ptr<float>() + r * V, V,
                                          t.data_ptr<float>()[r], u.data_ptr<float>()[r],
                                          weights.data(), block_sums.data());
  return out;
}

#else  // no AVX-512: draw.py never calls in (vectorised() is false)

constexpr bool kVectorised = false;

torch::Tensor tempered(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "the draw kernel needs AVX-512");
}

#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tempered", &tempered, "each row's inverse-CDF draw from softmax(logits / temperature)");
  m.def("vectorised", [] { return kVectorised; }, "whether this build has the AVX-512 kernel");
}
