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

// exp(x) in each lane, for x ≤ 0 (a weight, (logit − largest) / T): 0 below −104, where float32
// ends (and for −inf, a forbidden token). exp(x) = 2^n · exp(r) with n = round(x / ln 2) and
// |r| ≤ ln 2 / 2, exp(r) by its Taylor polynomial to r⁶ (its remainder below 2e-7 of the
// value), 2^n applied by scalef, which underflows as float32 does. With glibc's vector expf,
// which -ffast-math called here before, a 32 × 2048 draw took 55 µs; it takes 29 now.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2 in two parts:
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);       // r exact to float32
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __mmask16 in_range = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-104.0f), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(in_range, _mm512_scalef_ps(p, n));
}

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
// -1 for such a row (the max pass tests each block's class on the way, so the check costs no
// pass of its own).
int64_t draw_row(const float* logits, int64_t V, float temperature, float uniform,
                 float* weights, float* block_sums, bool raw) {
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  auto tail = [&](int64_t b) {  // the block's lanes inside the vocabulary
    const int64_t lanes = std::min(kBlock, V - b * kBlock);
    return static_cast<__mmask16>((1u << lanes) - 1u);
  };
  const __m512 nothing = _mm512_set1_ps(-INFINITY);
  constexpr int kNotFinite = 0x01 | 0x08 | 0x10 | 0x80;  // fpclass: NaNs, +inf, −inf
  __m512 largest_lanes = nothing;
  __mmask16 not_finite = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 z = _mm512_mask_loadu_ps(nothing, tail(b), logits + b * kBlock);
    if (raw) not_finite |= _mm512_mask_fpclass_ps_mask(tail(b), z, kNotFinite);
    largest_lanes = _mm512_max_ps(largest_lanes, z);
  }
  if (not_finite) return -1;
  const __m512 largest = _mm512_set1_ps(_mm512_reduce_max_ps(largest_lanes));
  const __m512 inverse_temperature = _mm512_set1_ps(1.0f / temperature);
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 z = _mm512_mask_loadu_ps(nothing, tail(b), logits + b * kBlock);
    const __m512 scaled = _mm512_mul_ps(_mm512_sub_ps(z, largest), inverse_temperature);
    const __m512 w = exp_nonpositive(scaled);
    _mm512_mask_storeu_ps(weights + b * kBlock, tail(b), w);
    block_sums[b] = _mm512_reduce_add_ps(w);
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

// logits [B, V] float32 (contiguous); temperature, uniforms [B] float32 → [B] int64; `raw`: as
// draw_row's.
torch::Tensor draw_rows(const torch::Tensor& logits, const torch::Tensor& temperature,
                        const torch::Tensor& uniforms, bool raw) {
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
                                          weights.data(), block_sums.data(), raw);
  return out;
}

torch::Tensor tempered(const torch::Tensor& logits, const torch::Tensor& temperature,
                       const torch::Tensor& uniforms) {
  return draw_rows(logits, temperature, uniforms, false);
}

// The same draw of raw logits → (tokens, how many rows failed: -1 for a NaN or infinite logit,
// V for a uniform outside [0, 1)), so that a step whose rows are all fine needs no other check.
std::tuple<torch::Tensor, int64_t> tempered_raw(const torch::Tensor& logits,
                                                const torch::Tensor& temperature,
                                                const torch::Tensor& uniforms) {
  auto out = draw_rows(logits, temperature, uniforms, true);
  const int64_t V = logits.size(1);
  int64_t failed = 0;
  for (int64_t r = 0; r < out.size(0); ++r) {
    const int64_t token = out.data_ptr<int64_t>()[r];
    failed += token < 0 || token >= V;
  }
  return {out, failed};
}

#else  // no AVX-512: draw.py never calls in (vectorised() is false)

constexpr bool kVectorised = false;

torch::Tensor tempered(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "the draw kernel needs AVX-512");
}

std::tuple<torch::Tensor, int64_t> tempered_raw(const torch::Tensor&, const torch::Tensor&,
                                                const torch::Tensor&) {
  TORCH_CHECK(false, "the draw kernel needs AVX-512");
}

#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tempered", &tempered, "each row's inverse-CDF draw from softmax(logits / temperature)");
  m.def("tempered_raw", &tempered_raw,
        "the same draw of the model's logits, with how many rows failed (-1: a non-finite "
        "logit; V: a uniform outside [0, 1))");
  m.def("vectorised", [] { return kVectorised; }, "whether this build has the AVX-512 kernel");
}
