// y = x · Wᵀ + b for the few rows a decode step multiplies (model/kernels/linear.py says when it
// runs and why).
//
// The kernel reads a packed copy of the weight W [N, K] (model.kernels.linear.packed makes it):
// [ceil(N / 64), K, 64], block b holding outputs 64b..64b+63 for every input k, the last block
// zero-padded. A block of 64 outputs is 4 AVX-512 registers: for each input k the block's slice
// of row k is loaded once and multiplied into up to 4 rows of x at a time (16 accumulators in
// registers). So a block's weights are one contiguous run of memory, read front to back: the
// CPU's prefetchers follow it and each 4 KB page is entered once. Read in place from Wᵀ, the same
// slices lay N floats apart, every one on its own page for the logits — 1.2x slower at batch 1
// (docs/performance.md). MKL's general GEMM copies and packs panels on every call, which at
// these sizes costs more than the arithmetic.
//
// Every output is the same chain of fused multiply-adds, over k in order from 0, then the bias:
// a row's result does not depend on how many rows are multiplied with it or where it sits, so a
// request decodes to the same bits alone and in any batch. Inputs are blocked by 128 so that a
// block's weights stay in L1 while every row group passes over them; the partial sums wait in
// y, which changes no bits.
//
// A weight is float32, or bfloat16 (its bits as uint16_t) when every value of the float32 weight
// is a bfloat16 value (the shipped checkpoints are stored so): each is widened to its float32 in
// registers, exactly (a shift), so the products are the same bits from half the bytes read.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

// AVX-512 with its 16-bit loads (BW: every AVX-512 CPU since Skylake-SP); the files that include
// this build their vectorised code under LINEAR_CORE_VECTORISED.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LINEAR_CORE_VECTORISED 1
#include <immintrin.h>

namespace linear_core {

// 16 weights from w as float32 (the last lanes past `mask` zero).
inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 load16(const uint16_t* w) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(__mmask16 mask, const float* w) { return _mm512_maskz_loadu_ps(mask, w); }
inline __m512 load16(__mmask16 mask, const uint16_t* w) {
  const __m256i bits = _mm256_maskz_loadu_epi16(mask, w);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

constexpr int64_t kColumns = 64;    // outputs per block: 4 registers of 16 floats
constexpr int64_t kVectors = kColumns / 16;
constexpr int64_t kRowGroup = 4;    // rows multiplied together: 16 accumulators
constexpr int64_t kInputBlock = 128;  // inputs per pass: 32 KB of weights, L1-sized
constexpr int64_t kAhead = 8;  // weight rows fetched ahead (cold weights: 1.34 → 1.13 ms a step)

template <typename W>
struct Operands {
  const float* x;       // [M, K]
  const W* packed;      // [ceil(N / 64), K, 64]: float, or bfloat16 bits
  const float* bias;    // [N] or null
  float* y;             // [M, N]
  int64_t M, K, N;
  // Row k of the block that starts at output `column` (a multiple of 64): its 64 weights.
  const W* row(int64_t column, int64_t k) const { return packed + column * K + k * kColumns; }
};

// Rows [row, row + R) and the 64 outputs from `column`, over inputs [k0, k1).
template <int R, typename W>
inline void full_block(const Operands<W>& o, int64_t row, int64_t column, int64_t k0, int64_t k1) {
  __m512 acc[R][kVectors];
  float* y = o.y + row * o.N + column;
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v)
      acc[r][v] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * o.N + 16 * v);
  const float* x = o.x + row * o.K;
  for (int64_t k = k0; k < k1; ++k) {
    const W* w = o.row(column, k);
    __m512 weights[kVectors];
    for (int v = 0; v < kVectors; ++v) weights[v] = load16(w + 16 * v);
    if (k + kAhead < o.K)  // more rows in flight when the weights come from memory
      for (int v = 0; v < kVectors; ++v)
        _mm_prefetch(reinterpret_cast<const char*>(w + kAhead * kColumns + 16 * v), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      const __m512 input = _mm512_set1_ps(x[r * o.K + k]);
      for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_fmadd_ps(input, weights[v], acc[r][v]);
    }
  }
  const bool last = k1 == o.K;
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) {
      __m512 out = acc[r][v];
      if (last && o.bias) out = _mm512_add_ps(out, _mm512_loadu_ps(o.bias + column + 16 * v));
      _mm512_storeu_ps(y + r * o.N + 16 * v, out);
    }
}

// The last outputs when N is not a multiple of 64: 16 at a time under a mask, one row at a time,
// the same chain of multiply-adds per output as full_block's.
template <typename W>
inline void ragged_block(const Operands<W>& o, int64_t row, int64_t column) {
  const float* x = o.x + row * o.K;
  float* y = o.y + row * o.N;
  for (int64_t c = column; c < o.N; c += 16) {
    const auto lanes = static_cast<unsigned>(std::min<int64_t>(16, o.N - c));
    const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1u);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < o.K; ++k)
      acc = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), load16(mask, o.row(column, k) + c - column), acc);
    if (o.bias) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, o.bias + c));
    _mm512_mask_storeu_ps(y + c, mask, acc);
  }
}

template <typename W>
inline void column_block(const Operands<W>& o, int64_t column) {
  if (o.N - column < kColumns) {
    for (int64_t row = 0; row < o.M; ++row) ragged_block(o, row, column);
    return;
  }
  for (int64_t k0 = 0; k0 < o.K; k0 += kInputBlock) {
    const int64_t k1 = std::min(o.K, k0 + kInputBlock);
    for (int64_t row = 0; row < o.M; row += kRowGroup) {
      switch (std::min(kRowGroup, o.M - row)) {
        case 4: full_block<4>(o, row, column, k0, k1); break;
        case 3: full_block<3>(o, row, column, k0, k1); break;
        case 2: full_block<2>(o, row, column, k0, k1); break;
        default: full_block<1>(o, row, column, k0, k1);
      }
    }
  }
}

// y [M, N] = x [M, K] · Wᵀ + bias [N] (bias may be null), W packed as Operands says; blocks of
// outputs in parallel.
template <typename W>
inline void project(const float* x, const W* packed, const float* bias, float* y, int64_t M,
                    int64_t K, int64_t N) {
  const Operands<W> o{x, packed, bias, y, M, K, N};
  const int64_t blocks = (N + kColumns - 1) / kColumns;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) column_block(o, block * kColumns);
  });
}

// The same for a packed weight tensor [ceil(N / 64), K, 64], float32 or bfloat16: the one place
// that reads a weight's layout and dtype.
inline void project(const float* x, const at::Tensor& packed, const float* bias, float* y,
                    int64_t M, int64_t K, int64_t N) {
  const bool narrow = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) == (N + kColumns - 1) / kColumns &&
                  packed.size(1) == K && packed.size(2) == kColumns && packed.is_contiguous(),
              "a projection's weight must be packed as [ceil(out / 64), in, 64]");
  TORCH_CHECK(narrow || packed.scalar_type() == at::kFloat,
              "a projection's packed weight must be float32 or bfloat16");
  if (narrow)
    project(x, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), bias, y, M, K,
            N);
  else
    project(x, packed.data_ptr<float>(), bias, y, M, K, N);
}

}  // namespace linear_core

#endif
