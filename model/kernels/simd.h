// The portable SIMD layer every kernel here is written over: one vector type of 16 float lanes
// and the few operations the kernels need (model/kernels/__init__.py builds each ISA variant).
//
// f32x16 is 16 lanes on every ISA, held as the ISA's own registers: one AVX-512 register, two
// AVX2 registers, four NEON or SSE2 registers (each a GCC/Clang vector extension of the native
// width, which the compilers map to registers one to one). Because the width is the same
// everywhere, so is the order of every sum, and every operation here is exact per lane (a fused
// multiply-add rounds once, on every ISA): the variants compute the same bits. That is why this
// layer and not at::vec::Vectorized<float>, whose width follows the ISA (8 lanes on AVX2, 16 on
// AVX-512) and with it the order of a reduction. The kernels are built with -ffp-contract=off,
// so no variant fuses a product that another rounds; a fused multiply-add is asked for by name
// (fmadd), and that is the one operation that needs each ISA's own word. ggml's simd-mappings.h
// maps one source to many ISAs the same way.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace simd {

#define SIMD_INLINE inline __attribute__((always_inline))

// The ISA this file is compiled for, its vector registers and their float lanes.
#if defined(__AVX512F__)
constexpr const char* kIsa = "avx512";
constexpr int kRegisters = 32, kNativeLanes = 16;
#elif defined(__AVX2__)
constexpr const char* kIsa = "avx2";
constexpr int kRegisters = 16, kNativeLanes = 8;
#elif defined(__aarch64__)
constexpr const char* kIsa = "neon";
constexpr int kRegisters = 32, kNativeLanes = 4;
#else
constexpr const char* kIsa = "scalar";
constexpr int kRegisters = 16, kNativeLanes = 4;
#endif

constexpr int kLanes = 16;
constexpr int kParts = kLanes / kNativeLanes;  // native registers per f32x16
// f32x16 values that fit in registers beside a loop's operands (four registers kept for them).
constexpr int kAccumulators = (kRegisters - 4) / kParts;

typedef float native_f32 __attribute__((vector_size(4 * kNativeLanes)));
typedef int32_t native_i32 __attribute__((vector_size(4 * kNativeLanes)));
typedef uint32_t native_u32 __attribute__((vector_size(4 * kNativeLanes)));
typedef uint16_t native_u16 __attribute__((vector_size(2 * kNativeLanes)));

struct f32x16 {
  native_f32 part[kParts];
};
// A lane mask: all ones where a comparison holds, zeros elsewhere; or 16 whole numbers.
struct i32x16 {
  native_i32 part[kParts];
};

// Lane by lane, part by part: the loops every operation below is made of.
template <typename Op>
SIMD_INLINE f32x16 each(Op op) {
  f32x16 out;
  for (int i = 0; i < kParts; ++i) out.part[i] = op(i);
  return out;
}
template <typename Op>
SIMD_INLINE i32x16 each_int(Op op) {
  i32x16 out;
  for (int i = 0; i < kParts; ++i) out.part[i] = op(i);
  return out;
}

SIMD_INLINE f32x16 zero() {
  return each([](int) { return native_f32{}; });
}
SIMD_INLINE f32x16 broadcast(float x) {
  return each([x](int) { return x - native_f32{}; });  // x − 0 is x, −0 included (x + 0 is not)
}

SIMD_INLINE f32x16 operator+(f32x16 a, f32x16 b) { return each([&](int i) { return a.part[i] + b.part[i]; }); }
SIMD_INLINE f32x16 operator-(f32x16 a, f32x16 b) { return each([&](int i) { return a.part[i] - b.part[i]; }); }
SIMD_INLINE f32x16 operator*(f32x16 a, f32x16 b) { return each([&](int i) { return a.part[i] * b.part[i]; }); }
SIMD_INLINE f32x16 operator/(f32x16 a, f32x16 b) { return each([&](int i) { return a.part[i] / b.part[i]; }); }
SIMD_INLINE f32x16 operator-(f32x16 a) { return each([&](int i) { return -a.part[i]; }); }
SIMD_INLINE f32x16 operator+(f32x16 a, float b) { return a + broadcast(b); }
SIMD_INLINE f32x16 operator-(f32x16 a, float b) { return a - broadcast(b); }
SIMD_INLINE f32x16 operator*(f32x16 a, float b) { return a * broadcast(b); }
SIMD_INLINE f32x16 operator+(float a, f32x16 b) { return broadcast(a) + b; }
SIMD_INLINE f32x16 operator/(float a, f32x16 b) { return broadcast(a) / b; }
SIMD_INLINE f32x16 operator-(float a, f32x16 b) { return broadcast(a) - b; }
SIMD_INLINE f32x16 operator*(float a, f32x16 b) { return broadcast(a) * b; }
SIMD_INLINE f32x16& operator+=(f32x16& a, f32x16 b) { return a = a + b; }

SIMD_INLINE i32x16 operator<(f32x16 a, f32x16 b) { return each_int([&](int i) { return a.part[i] < b.part[i]; }); }
SIMD_INLINE i32x16 operator>(f32x16 a, f32x16 b) { return each_int([&](int i) { return a.part[i] > b.part[i]; }); }
SIMD_INLINE i32x16 operator==(f32x16 a, f32x16 b) { return each_int([&](int i) { return a.part[i] == b.part[i]; }); }
SIMD_INLINE i32x16 operator!=(f32x16 a, f32x16 b) { return each_int([&](int i) { return a.part[i] != b.part[i]; }); }
SIMD_INLINE i32x16 operator<(f32x16 a, float b) { return a < broadcast(b); }
SIMD_INLINE i32x16 operator>(f32x16 a, float b) { return a > broadcast(b); }
SIMD_INLINE i32x16 operator==(f32x16 a, float b) { return a == broadcast(b); }
SIMD_INLINE i32x16 operator|(i32x16 a, i32x16 b) { return each_int([&](int i) { return a.part[i] | b.part[i]; }); }

// Where `mask` is set, a's lane; elsewhere b's.
SIMD_INLINE f32x16 select(i32x16 mask, f32x16 a, f32x16 b) {
  return each([&](int i) { return mask.part[i] ? a.part[i] : b.part[i]; });
}

// 0, 1, …, 15: a lane's index, for masks of the first n lanes (lane_index() < n).
SIMD_INLINE i32x16 lane_index() {
  i32x16 out;
  for (int i = 0; i < kParts; ++i)
    for (int j = 0; j < kNativeLanes; ++j) out.part[i][j] = i * kNativeLanes + j;
  return out;
}
SIMD_INLINE i32x16 operator<(i32x16 a, int32_t b) { return each_int([&](int i) { return a.part[i] < b; }); }

SIMD_INLINE f32x16 load(const float* p) {
  return each([p](int i) {
    native_f32 v;
    std::memcpy(&v, p + i * kNativeLanes, sizeof v);
    return v;
  });
}

// 16 bfloat16 values (their bits) widened to float32 exactly: the bits moved to the top half.
// Named per ISA, as each has one or two instructions for it that compilers do not all find.
SIMD_INLINE f32x16 load(const uint16_t* p) {
  return each([p](int i) -> native_f32 {
    const uint16_t* part = p + i * kNativeLanes;
#if defined(__AVX512F__)
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(part));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#elif defined(__AVX2__)
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(part));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
#elif defined(__SSE2__)
    const __m128i bits = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(part));
    return _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), bits));  // zeros below
#elif defined(__aarch64__)
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(part), 16));
#else
    native_u16 bits;
    std::memcpy(&bits, part, sizeof bits);
    return reinterpret_cast<native_f32>(__builtin_convertvector(bits, native_u32) << 16);
#endif
  });
}

SIMD_INLINE void store(float* p, f32x16 v) {
  for (int i = 0; i < kParts; ++i) std::memcpy(p + i * kNativeLanes, &v.part[i], sizeof v.part[i]);
}

// The first n lanes (n ≤ 16) from p, the others `fill`.
template <typename T>
SIMD_INLINE f32x16 load_first(const T* p, int64_t n, float fill = 0.0f) {
  if (n >= kLanes) return load(p);  // a whole vector: no lane-by-lane copy
  T part[kLanes];
  for (int i = 0; i < kLanes; ++i) part[i] = i < n ? p[i] : T{};
  return select(lane_index() < static_cast<int32_t>(n), load(part), broadcast(fill));
}

SIMD_INLINE void store_first(float* p, f32x16 v, int64_t n) {
  if (n >= kLanes) return store(p, v);
  float lanes[kLanes];
  store(lanes, v);
  for (int64_t i = 0; i < n; ++i) p[i] = lanes[i];
}

// a · b + c, rounded once.
SIMD_INLINE f32x16 fmadd(f32x16 a, f32x16 b, f32x16 c) {
  return each([&](int i) -> native_f32 {
#if defined(__AVX512F__)
    return _mm512_fmadd_ps(a.part[i], b.part[i], c.part[i]);
#elif defined(__FMA__)
    return _mm256_fmadd_ps(a.part[i], b.part[i], c.part[i]);
#elif defined(__aarch64__)
    return vfmaq_f32(c.part[i], a.part[i], b.part[i]);
#else  // no fused multiply-add instruction to name: libm's fmaf, exact on any CPU
    native_f32 out;
    for (int j = 0; j < kNativeLanes; ++j) out[j] = __builtin_fmaf(a.part[i][j], b.part[i][j], c.part[i][j]);
    return out;
#endif
  });
}

// The same for one float (one instruction with FMA, else libm's exact fmaf).
SIMD_INLINE float fmadd(float a, float b, float c) { return __builtin_fmaf(a, b, c); }

// Lane by lane; where either is a NaN, b (as x86's maxps and minps).
SIMD_INLINE f32x16 max(f32x16 a, f32x16 b) { return select(a > b, a, b); }
SIMD_INLINE f32x16 min(f32x16 a, f32x16 b) { return select(a < b, a, b); }

// The sum of the lanes in one fixed order on every ISA: lanes i and i + 8, then i and i + 4,
// then i and i + 2, and the last two.
SIMD_INLINE float reduce_add(f32x16 v) {
  typedef float f32x8 __attribute__((vector_size(32)));
  typedef float f32x4 __attribute__((vector_size(16)));
  typedef float f32x2 __attribute__((vector_size(8)));
  f32x8 half;
#if defined(__AVX512F__)
  half = __builtin_shufflevector(v.part[0], v.part[0], 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v.part[0], v.part[0], 8, 9, 10, 11, 12, 13, 14, 15);
#elif defined(__AVX2__)
  half = v.part[0] + v.part[1];
#else
  const f32x4 low = v.part[0] + v.part[2], high = v.part[1] + v.part[3];
  half = __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7);
#endif
  const f32x4 quarter = __builtin_shufflevector(half, half, 0, 1, 2, 3) +
                        __builtin_shufflevector(half, half, 4, 5, 6, 7);
  const f32x2 pair = __builtin_shufflevector(quarter, quarter, 0, 1) +
                     __builtin_shufflevector(quarter, quarter, 2, 3);
  return pair[0] + pair[1];
}

SIMD_INLINE float reduce_max(f32x16 v) {
  float lanes[kLanes];
  store(lanes, v);
  float largest = lanes[0];
  for (int i = 1; i < kLanes; ++i) largest = lanes[i] > largest ? lanes[i] : largest;
  return largest;
}

// Whether any lane of a mask is set.
SIMD_INLINE bool any(i32x16 mask) {
  native_i32 all = mask.part[0];
  for (int i = 1; i < kParts; ++i) all |= mask.part[i];
  uint64_t words[kNativeLanes / 2];
  std::memcpy(words, &all, sizeof words);
  uint64_t folded = 0;
  for (int i = 0; i < kNativeLanes / 2; ++i) folded |= words[i];
  return folded != 0;
}

// The first lane set in a mask, or -1.
SIMD_INLINE int first(i32x16 mask) {
  int32_t lanes[kLanes];
  std::memcpy(lanes, &mask, sizeof lanes);
  for (int i = 0; i < kLanes; ++i)
    if (lanes[i]) return i;
  return -1;
}

SIMD_INLINE i32x16 bits(f32x16 v) {
  return each_int([&](int i) { return reinterpret_cast<native_i32>(v.part[i]); });
}

// Lanes holding a NaN or an infinity (tested on the bits).
SIMD_INLINE i32x16 not_finite(f32x16 v) {
  const i32x16 b = bits(v);
  return each_int([&](int i) { return (b.part[i] & 0x7f800000) == 0x7f800000; });
}

// Lanes holding a NaN.
SIMD_INLINE i32x16 is_nan(f32x16 v) {
  const i32x16 b = bits(v);
  return each_int([&](int i) { return (b.part[i] & 0x7fffffff) > 0x7f800000; });
}

// 2^n for whole n in [-126, 127], built from its bits.
SIMD_INLINE f32x16 power_of_two(i32x16 n) {
  return each([&](int i) { return reinterpret_cast<native_f32>((n.part[i] + 127) << 23); });
}

// e^x in each lane, within 2e-7 of the value: 0 below -104 (where float32's subnormals end; -inf
// included), +inf above 88.72, NaN for NaN. e^x = 2^n · e^r with n = round(x / ln 2) and
// |r| ≤ ln 2 / 2, e^r by its Taylor polynomial to r⁶ (Horner's rule in fused multiply-adds), and
// 2^n applied in two exact halves so that a subnormal result is rounded once.
SIMD_INLINE f32x16 exp(f32x16 x) {
  const f32x16 clamped = min(max(x, broadcast(-104.0f)), broadcast(88.8f));
  // round(x / ln 2): adding and taking away 1.5 · 2^23 rounds to the nearest whole number.
  const f32x16 shifter = broadcast(12582912.0f);
  const f32x16 n = (clamped * 1.44269504f + shifter) - shifter;
  f32x16 r = fmadd(-n, broadcast(0.693359375f), clamped);  // ln 2 in two parts: r exact
  r = fmadd(-n, broadcast(-2.12194440e-4f), r);
  f32x16 p = broadcast(1.0f / 720);
  p = fmadd(p, r, broadcast(1.0f / 120));
  p = fmadd(p, r, broadcast(1.0f / 24));
  p = fmadd(p, r, broadcast(1.0f / 6));
  p = fmadd(p, r, broadcast(0.5f));
  p = fmadd(p, r, broadcast(1.0f));
  p = fmadd(p, r, broadcast(1.0f));
  const i32x16 whole = each_int([&](int i) { return __builtin_convertvector(n.part[i], native_i32); });
  const i32x16 low = each_int([&](int i) { return whole.part[i] >> 1; });
  const i32x16 high = each_int([&](int i) { return whole.part[i] - low.part[i]; });
  f32x16 out = p * power_of_two(low) * power_of_two(high);  // whole in [-150, 128]
  out = select(x < -104.0f, zero(), out);
  out = select(x > 88.72f, broadcast(__builtin_inff()), out);
  return select(x != x, x, out);
}

SIMD_INLINE f32x16 abs(f32x16 v) {
  return each([&](int i) { return reinterpret_cast<native_f32>(reinterpret_cast<native_i32>(v.part[i]) & 0x7fffffff); });
}

// a's magnitude with b's sign, in each lane.
SIMD_INLINE f32x16 copysign(f32x16 a, f32x16 b) {
  return each([&](int i) {
    const native_i32 sign = reinterpret_cast<native_i32>(b.part[i]) & static_cast<int32_t>(0x80000000u);
    return reinterpret_cast<native_f32>((reinterpret_cast<native_i32>(a.part[i]) & 0x7fffffff) | sign);
  });
}

// tanh(x) = sign(x) · (1 − 2 / (e^{2|x|} + 1)) in each lane, within 1e-7 of the value (2|x| past
// 88.7, e^{2|x|} is +inf and the quotient 0: tanh is 1 to float32 long before).
SIMD_INLINE f32x16 tanh(f32x16 x) {
  const f32x16 e = exp(abs(x) * 2.0f);
  return copysign(1.0f - 2.0f / (e + 1.0f), x);
}

// erf(x) in each lane by Abramowitz and Stegun's 7.1.26: 1 − (a₁t + … + a₅t⁵)·e^{−x²} with
// t = 1 / (1 + p|x|), within 1.5e-7 of the value, the sign of x.
SIMD_INLINE f32x16 erf(f32x16 x) {
  const f32x16 a = abs(x);
  const f32x16 t = 1.0f / fmadd(a, broadcast(0.3275911f), broadcast(1.0f));
  f32x16 poly = broadcast(1.061405429f);
  poly = fmadd(poly, t, broadcast(-1.453152027f));
  poly = fmadd(poly, t, broadcast(1.421413741f));
  poly = fmadd(poly, t, broadcast(-0.284496736f));
  poly = fmadd(poly, t, broadcast(0.254829592f));
  poly = poly * t;
  return copysign(1.0f - poly * exp(-(a * a)), x);
}

// σ(x) = 1 / (1 + e^-x) in each lane.
SIMD_INLINE f32x16 sigmoid(f32x16 x) { return 1.0f / (1.0f + exp(-x)); }

// a · b over n floats: 16 products at a time into one vector of sums, added in reduce_add's
// order, then the last n mod 16 one by one.
SIMD_INLINE float dot(const float* a, const float* b, int64_t n) {
  f32x16 acc = zero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = fmadd(load(a + i), load(b + i), acc);
  float sum = reduce_add(acc);
  for (; i < n; ++i) sum = fmadd(a[i], b[i], sum);
  return sum;
}

// A cache line on its way into the caches: the nearest (the next loads want it) or L2.
SIMD_INLINE void prefetch_near(const void* p) { __builtin_prefetch(p, 0, 3); }
SIMD_INLINE void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

// A spinning thread's pause: the core's other work (or its sibling thread) goes first.
SIMD_INLINE void pause() {
#if defined(__SSE2__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace simd
