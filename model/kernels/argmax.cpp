// Each row's argmax — torch.argmax(x, dim=-1) — for a decode step's greedy draw
// (model/kernels/argmax.py says why).
#include <torch/extension.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)

#include <immintrin.h>

namespace {

// NaN tests on the bits, not on floats: -ffast-math lets the compiler assume there are none.
constexpr int32_t kAbsMask = 0x7fffffff, kInfinityBits = 0x7f800000;

bool is_nan(float value) {
  int32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return (bits & kAbsMask) > kInfinityBits;
}

// The first index of the largest of x[0..n) — torch's answer: a NaN counts as the largest, so
// the first NaN if there is one; ties go to the lowest index.
int64_t first_largest(const float* x, int64_t n) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  const __m512i abs_mask = _mm512_set1_epi32(kAbsMask), infinity = _mm512_set1_epi32(kInfinityBits);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512i magnitude = _mm512_and_si512(_mm512_castps_si512(v), abs_mask);
    nan |= _mm512_cmpgt_epi32_mask(magnitude, infinity);
    best = _mm512_max_ps(best, v);
  }
  float largest = _mm512_reduce_max_ps(best);
  for (int64_t j = i; j < n; ++j) {
    nan |= is_nan(x[j]);
    largest = x[j] > largest ? x[j] : largest;
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (is_nan(x[j])) return j;
  }
  const __m512 target = _mm512_set1_ps(largest);
  for (i = 0; i + 16 <= n; i += 16) {
    const __mmask16 equal = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
    if (equal) return i + __builtin_ctz(equal);
  }
  for (; i < n; ++i)
    if (x[i] == largest) return i;
  return 0;  // not reached: the largest is one of the values
}

}  // namespace

constexpr bool kVectorised = true;

// x [rows, n] float32, contiguous → [rows] int64.
torch::Tensor argmax(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [rows, n] matrix with n > 0");
  auto out = torch::empty({x.size(0)}, x.options().dtype(at::kLong));
  const float* data = x.data_ptr<float>();
  int64_t* index = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < x.size(0); ++r) index[r] = first_largest(data + r * x.size(1), x.size(1));
  return out;
}

#else  // no AVX-512: argmax.py never calls in (vectorised() is false)

constexpr bool kVectorised = false;

torch::Tensor argmax(const torch::Tensor&) {
  TORCH_CHECK(false, "the argmax kernel needs AVX-512");
}

#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax", &argmax, "each row's argmax, as torch.argmax(x, dim=-1)");
  m.def("vectorised", [] { return kVectorised; }, "whether this build has the AVX-512 kernel");
}
