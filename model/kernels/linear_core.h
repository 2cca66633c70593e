// y = x · Wᵀ + b for the few rows a decode step multiplies (model/kernels/linear.py says when it
// runs and why), written once over simd.h for every ISA.
//
// The kernel reads a packed copy of the weight W [N, K] (model.kernels.linear.packed makes it):
// [ceil(N / 64), K, 64], block b holding outputs 64b..64b+63 for every input k, the last block
// zero-padded. For each input k, a block's slice of row k is loaded once and multiplied into
// several rows of x at a time, the accumulators in registers. So a block's weights are one
// contiguous run of memory, read front to back: the CPU's prefetchers follow it and each 4 KB
// page is entered once. (Read in place from Wᵀ, the same slices lie N floats apart, every one
// on its own page for the logits.) MKL's general GEMM copies and packs panels on every call,
// which at these sizes costs more than the arithmetic.
//
// Every output is the same chain of fused multiply-adds, over k in order from 0, then the bias:
// a row's result does not depend on how many rows are multiplied with it, where it sits, or how
// many rows and outputs a tile takes (each ISA takes as many as its registers hold), so a request
// decodes to the same bits alone and in any batch, and on every ISA. Inputs are blocked by 128
// so that a block's weights stay in L1 while every row group passes over them; the partial sums
// wait in y, which changes no bits.
//
// A weight is float32, or bfloat16 (its bits as uint16_t) when every value of the float32 weight
// is a bfloat16 value (the shipped checkpoints are stored so): each is widened to its float32 in
// registers, exactly, so the products are the same bits from half the bytes read.
//
// On a CPU with AMX (Sapphire Rapids and later), the AVX-512 variant multiplies a bfloat16
// weight on the tile unit instead (`tiles` below): the same float32 products, summed in another
// order, so other bits than the vector path's, but the same bits for a row alone and in any
// batch. It pays under load and costs a little at one row (docs/performance.md).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

#include "simd.h"

// AMX's bfloat16 tile multiply (Sapphire Rapids and later), built into the AVX-512 variant and
// used only where the CPU has it (model.kernels.linear.tiles_ready).
#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define LINEAR_CORE_TILES 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <vector>
#endif

namespace linear_core {

using simd::f32x16;

constexpr int64_t kColumns = 64;  // outputs per packed block: 4 vectors of 16 floats
constexpr int64_t kVectors = kColumns / simd::kLanes;
constexpr int64_t kInputBlock = 128;  // inputs per pass: 32 KB of float32 weights, L1-sized
constexpr int64_t kLine = 64;         // bytes in a cache line

// A tile of R rows by C vectors of outputs, as many as the ISA's registers hold beside a row of
// the tile's weights and a broadcast input: the most rows sharing each load of the weights
// (each bfloat16 weight is widened once per tile), up to 6, with all four vectors of a block
// where that still leaves 6 rows (AVX-512), else one vector at a time. One row alone takes the
// whole block: its four chains of multiply-adds run side by side.
constexpr int accumulator_rows(int vectors) {
  return (simd::kRegisters - vectors * simd::kParts - 1) / (vectors * simd::kParts);
}
constexpr int kTileVectors = accumulator_rows(4) >= 6 ? 4 : accumulator_rows(2) >= 6 ? 2 : 1;
constexpr int kRowGroup = std::min(6, std::max(1, accumulator_rows(kTileVectors)));
constexpr int64_t kTilesPerGroup = kVectors / kTileVectors;  // tiles of a row group, one block

template <typename W>
struct Operands {
  const float* x;   // [M, K]
  const W* packed;  // [ceil(N / 64), K, 64]: float, or bfloat16 bits
  const float* bias;  // [N] or null
  float* y;           // [M, N]
  int64_t M, K, N;
  // Row k of the block that starts at output `column` (a multiple of 64): its 64 weights.
  const W* row(int64_t column, int64_t k) const { return packed + column * K + k * kColumns; }
};

// Cache lines a tile fetches into L2 as it goes, spread evenly over its inputs: `count` lines
// from `first` (none: count 0).
struct Lines {
  const char* first = nullptr;
  int64_t count = 0;
};

// Rows [row, row + R) and the C·16 outputs from `column` + 16·`vector` (inside the block that
// starts at `column`), over inputs [k0, k1); fetching `fetch` meanwhile.
template <int R, int C, typename W>
inline void full_tile(const Operands<W>& o, int64_t row, int64_t column, int64_t vector,
                      int64_t k0, int64_t k1, Lines fetch) {
  // Every loop over the tile unrolled, so that its accumulators stay in registers.
  f32x16 acc[R][C];
  float* y = o.y + row * o.N + column + simd::kLanes * vector;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < C; ++v)
      acc[r][v] = k0 == 0 ? simd::zero() : simd::load(y + r * o.N + simd::kLanes * v);
  const int64_t per_input = (fetch.count + (k1 - k0) - 1) / (k1 - k0);
  const char *line = fetch.first, *stop = fetch.first + kLine * fetch.count;
  const float* x = o.x + row * o.K;
  for (int64_t k = k0; k < k1; ++k) {
    const W* w = o.row(column, k) + simd::kLanes * vector;
    f32x16 weights[C];
#pragma GCC unroll 8
    for (int v = 0; v < C; ++v) weights[v] = simd::load(w + simd::kLanes * v);
    if (line < stop) {
      for (int64_t j = 0; j < per_input; ++j) simd::prefetch_l2(line + kLine * j);
      line += kLine * per_input;
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const f32x16 input = simd::broadcast(x[r * o.K + k]);
#pragma GCC unroll 8
      for (int v = 0; v < C; ++v) acc[r][v] = simd::fmadd(input, weights[v], acc[r][v]);
    }
  }
  const bool last = k1 == o.K;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < C; ++v) {
      f32x16 out = acc[r][v];
      if (last && o.bias) out += simd::load(o.bias + column + simd::kLanes * (vector + v));
      simd::store(y + r * o.N + simd::kLanes * v, out);
    }
}

// The last outputs when N is not a multiple of 64: 16 at a time, one row at a time, the same
// chain of multiply-adds per output as full_tile's.
template <typename W>
inline void ragged_block(const Operands<W>& o, int64_t row, int64_t column) {
  const float* x = o.x + row * o.K;
  float* y = o.y + row * o.N;
  for (int64_t c = column; c < o.N; c += simd::kLanes) {
    const int64_t lanes = std::min<int64_t>(simd::kLanes, o.N - c);
    f32x16 acc = simd::zero();
    for (int64_t k = 0; k < o.K; ++k)  // the padded block's lanes past N are zeros
      acc = simd::fmadd(simd::broadcast(x[k]), simd::load(o.row(column, k) + c - column), acc);
    if (o.bias) acc += simd::load_first(o.bias + c, lanes);
    simd::store_first(y + c, acc, lanes);
  }
}

// Tile `pass` of `passes` over a block's inputs fetches its share of `next`, the weights the
// block reads after them (column_block).
inline Lines share(Lines next, int64_t pass, int64_t passes) {
  const int64_t begin = next.count * pass / passes, end = next.count * (pass + 1) / passes;
  return {next.first + kLine * begin, end - begin};
}

// Rows [row, row + R) of one block's outputs over inputs [k0, k1), one tile of vectors at a time,
// each fetching its share of `next` (the block's tiles counted row group by row group).
template <int R, typename W>
inline void tile_rows(const Operands<W>& o, int64_t row, int64_t column, int64_t k0, int64_t k1,
                      Lines next, int64_t passes) {
  for (int64_t tile = 0; tile < kTilesPerGroup; ++tile) {
    const int64_t pass = row / kRowGroup * kTilesPerGroup + tile;
    full_tile<R, kTileVectors>(o, row, column, tile * kTileVectors, k0, k1,
                               share(next, pass, passes));
  }
}

// One block of outputs (64 from `column`) for every row. While a pass over a block's inputs reads
// its weights from L1, the weights the block reads next (its next inputs, or the next block's
// first) are fetched into L2, a share per tile, so that they are there when the next pass starts.
// The CPU's own prefetchers start only on a miss, and follow a tile of a part of the block (as
// AVX2's registers allow) too slowly.
template <typename W>
inline void column_block(const Operands<W>& o, int64_t column) {
  if (o.N - column < kColumns) {
    for (int64_t row = 0; row < o.M; ++row) ragged_block(o, row, column);
    return;
  }
  const auto inputs_from = [&](int64_t at, int64_t k) -> Lines {
    const int64_t bytes = (std::min(o.K, k + kInputBlock) - k) * kColumns * int64_t(sizeof(W));
    return {reinterpret_cast<const char*>(o.row(at, k)), bytes / kLine};
  };
  const int64_t passes = (o.M + kRowGroup - 1) / kRowGroup * kTilesPerGroup;
  for (int64_t k0 = 0; k0 < o.K; k0 += kInputBlock) {
    const int64_t k1 = std::min(o.K, k0 + kInputBlock);
    Lines next;
    if (k1 < o.K)
      next = inputs_from(column, k1);
    else if (column + kColumns < o.N)
      next = inputs_from(column + kColumns, 0);
    if (o.M == 1) {  // one row: the whole block's four chains side by side
      full_tile<1, kVectors>(o, 0, column, 0, k0, k1, next);
      continue;
    }
    for (int64_t row = 0; row < o.M; row += kRowGroup) {
      switch (std::min<int64_t>(kRowGroup, o.M - row)) {
        case 6: if constexpr (kRowGroup >= 6) tile_rows<6>(o, row, column, k0, k1, next, passes); break;
        case 5: if constexpr (kRowGroup >= 5) tile_rows<5>(o, row, column, k0, k1, next, passes); break;
        case 4: if constexpr (kRowGroup >= 4) tile_rows<4>(o, row, column, k0, k1, next, passes); break;
        case 3: if constexpr (kRowGroup >= 3) tile_rows<3>(o, row, column, k0, k1, next, passes); break;
        case 2: if constexpr (kRowGroup >= 2) tile_rows<2>(o, row, column, k0, k1, next, passes); break;
        default: tile_rows<1>(o, row, column, k0, k1, next, passes);
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

#if defined(LINEAR_CORE_TILES)
// With AMX: y = x · Wᵀ + b for a bfloat16 W on the tile unit, exactly as float32 would multiply
// it. Each float32 input is split into three bfloat16 values whose sum it is exactly, x = hi +
// mid + lo (each part the top 8 significant bits of what the previous left), so every product
// with a bfloat16 weight is exact in float32, and the tile unit's float32 sums are the only
// rounding, as in a float32 product. A row's three parts are rows 3i, 3i + 1, 3i + 2 of a tile
// (5 rows of x a tile, its 16th row zero); y = hi·W + (mid·W + lo·W) + b. A row's result
// depends on its own inputs alone, so it is the same bits alone and in any batch.
//
// The weight is packed in the tile unit's pair layout, [ceil(N / 16), K / 32, 16, 32]: for 16
// outputs and 32 inputs, row r holds, for each output c, its weights for inputs 2r and 2r + 1
// (model.kernels.linear.packed makes it; K a multiple of 32, outputs zero-padded).
namespace tiles {

constexpr int64_t kOutputs = 16;  // a tile's columns: outputs
constexpr int64_t kInputs = 32;   // inputs a tile multiply takes (16 pairs)
constexpr int64_t kRowsPerTile = 5;  // rows of x a tile holds, three parts each

// Linux hands a process the tile state only when it asks (arch_prctl): once, the answer kept.
inline bool permitted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                      18 /* XFEATURE_XTILEDATA */) == 0;
  return granted;
}

// The tile configuration every thread loads before it multiplies: 8 tiles of 16 rows × 64 bytes
// (an accumulator: 16 × 16 float32; x's parts: 16 rows × 32 bfloat16; W: 16 pairs × 16 outputs).
struct alignas(64) Configuration {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// The compiler may not regroup a sum across this point (-ffast-math lets it reassociate, and it
// did so for some rows and not others: a row's bits then depended on its place in the batch).
inline void settle(__m512& value) { asm volatile("" : "+v"(value)); }

// x [M, K] float32 → its parts [ceil(M / 5) · 16, K] as bfloat16 bits, tile rows as above, in
// this thread's buffer (kept across calls: every projection of every step splits its input).
inline const uint16_t* split(const float* x, int64_t M, int64_t K) {
  const int64_t tiles = (M + kRowsPerTile - 1) / kRowsPerTile;
  thread_local std::vector<uint16_t> parts;
  parts.assign(tiles * 16 * K, 0);  // the padding rows are zero
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t m = 0; m < M; ++m) {
    uint16_t* hi = parts.data() + ((m / kRowsPerTile) * 16 + (m % kRowsPerTile) * 3) * K;
    uint16_t *mid = hi + K, *lo = mid + K;
    for (int64_t k = 0; k < K; k += 16) {  // K is a multiple of 32
      const __m512i value = _mm512_castps_si512(_mm512_loadu_ps(x + m * K + k));
      const __m512i high = _mm512_and_si512(value, top);
      const __m512i rest = _mm512_castps_si512(
          _mm512_sub_ps(_mm512_castsi512_ps(value), _mm512_castsi512_ps(high)));
      const __m512i middle = _mm512_and_si512(rest, top);
      const __m512i low = _mm512_castps_si512(
          _mm512_sub_ps(_mm512_castsi512_ps(rest), _mm512_castsi512_ps(middle)));
      // The exact values' top halves: their bfloat16 bits.
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + k),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(high, 16)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(mid + k),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(middle, 16)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + k),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(low, 16)));
    }
  }
  return parts.data();
}

// Rows of the R row tiles from `tile` by the C column tiles from output `column` (R, C ≤ 2),
// into y: every input chunk multiplied into accumulator tiles 0..R·C-1, then each row's three
// sums added. Registers: accumulators 0-3 (r·C + c), x's parts 4-5, weights 6-7.
template <int R, int C>
inline void multiply(const uint16_t* parts, const uint16_t* packed, const float* bias, float* y,
                     int64_t M, int64_t K, int64_t N, int64_t tile, int64_t column) {
  static_assert(R >= 1 && R <= 2 && C >= 1 && C <= 2);
  const int64_t chunks = K / kInputs, stride = K * 2;  // bytes between a part's rows
  const uint16_t* rows = parts + tile * 16 * K;
  const uint16_t* weights = packed + (column / kOutputs) * chunks * 16 * kInputs;
  _tile_zero(0);
  if constexpr (R * C > 1) _tile_zero(1);
  if constexpr (R * C > 2) _tile_zero(2);
  if constexpr (R * C > 3) _tile_zero(3);
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const int64_t k = chunk * kInputs;
    _tile_loadd(4, rows + k, stride);
    if constexpr (R > 1) _tile_loadd(5, rows + 16 * K + k, stride);
    _tile_loadd(6, weights + chunk * 16 * kInputs, 64);
    if constexpr (C > 1) _tile_loadd(7, weights + (chunks + chunk) * 16 * kInputs, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (C > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (R > 1 && C > 1) {
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    } else if constexpr (R > 1) {
      _tile_dpbf16ps(1, 5, 6);
    }
  }
  alignas(64) float sums[4][16][kOutputs];  // accumulator r·C + c
  _tile_stored(0, sums[0], 64);
  if constexpr (R * C > 1) _tile_stored(1, sums[1], 64);
  if constexpr (R * C > 2) _tile_stored(2, sums[2], 64);
  if constexpr (R * C > 3) _tile_stored(3, sums[3], 64);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const float(*sum)[kOutputs] = sums[r * C + c];
      const int64_t first = column + c * kOutputs;
      const auto lanes = static_cast<unsigned>(std::min<int64_t>(kOutputs, N - first));
      const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1u);
      const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + first) : _mm512_setzero_ps();
      for (int64_t i = 0; i < kRowsPerTile; ++i) {
        const int64_t m = (tile + r) * kRowsPerTile + i;
        if (m >= M) break;
        __m512 out =
            _mm512_add_ps(_mm512_load_ps(sum[3 * i + 1]), _mm512_load_ps(sum[3 * i + 2]));
        settle(out);
        out = _mm512_add_ps(_mm512_load_ps(sum[3 * i]), out);
        settle(out);
        if (bias) out = _mm512_add_ps(out, b);
        _mm512_mask_storeu_ps(y + m * N + first, mask, out);
      }
    }
}

// y [M, N] = x [M, K] · Wᵀ + bias (may be null), W packed as above; pairs of column tiles in
// parallel, each over every pair of row tiles: a pair's weights (K · 64 bytes) are read from
// memory once and stay in L1 while the rows pass over them. Every output is the same
// computation whichever tiles it shares a multiply with. (Four column tiles at once for a
// batch of one row timed the same: docs/performance.md, tenth round.)
inline void project(const float* x, const uint16_t* packed, const float* bias, float* y,
                    int64_t M, int64_t K, int64_t N) {
  const uint16_t* p = split(x, M, K);
  const int64_t row_tiles = (M + kRowsPerTile - 1) / kRowsPerTile;
  const int64_t column_tiles = (N + kOutputs - 1) / kOutputs;
  at::parallel_for(0, (column_tiles + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    const Configuration configuration;
    _tile_loadconfig(&configuration);  // per thread, and anything else may have changed it
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t column = pair * 2 * kOutputs;
      const bool two = column + kOutputs < N;
      for (int64_t tile = 0; tile < row_tiles; tile += 2) {
        const bool both = tile + 1 < row_tiles;
        if (both && two) multiply<2, 2>(p, packed, bias, y, M, K, N, tile, column);
        else if (both) multiply<2, 1>(p, packed, bias, y, M, K, N, tile, column);
        else if (two) multiply<1, 2>(p, packed, bias, y, M, K, N, tile, column);
        else multiply<1, 1>(p, packed, bias, y, M, K, N, tile, column);
      }
    }
    _tile_release();
  });
}

}  // namespace tiles
#endif

// The inputs K of a weight packed either way (below).
inline int64_t inputs_of(const at::Tensor& packed) {
  return packed.dim() == 4 ? packed.size(1) * packed.size(3) : packed.size(1);
}

// The same for a packed weight tensor, float32 or bfloat16 [ceil(N / 64), K, 64], or bfloat16
// in the tile layout [ceil(N / 16), K / 32, 16, 32]: the one place that reads a weight's layout
// and dtype.
inline void project(const float* x, const at::Tensor& packed, const float* bias, float* y,
                    int64_t M, int64_t K, int64_t N) {
  const bool narrow = packed.scalar_type() == at::kBFloat16;
  if (packed.dim() == 4) {
#if defined(LINEAR_CORE_TILES)
    TORCH_CHECK(narrow && K % tiles::kInputs == 0 &&
                    packed.size(0) == (N + tiles::kOutputs - 1) / tiles::kOutputs &&
                    packed.size(1) == K / tiles::kInputs && packed.size(2) == 16 &&
                    packed.size(3) == tiles::kInputs && packed.is_contiguous(),
                "a projection's tile-packed weight must be bfloat16 [ceil(out / 16), in / 32, "
                "16, 32]");
    TORCH_CHECK(tiles::permitted(), "this process may not use the CPU's tiles (AMX)");
    tiles::project(x, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), bias, y,
                   M, K, N);
    return;
#else
    TORCH_CHECK(false, "a tile-packed weight needs a build with AMX");
#endif
  }
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

