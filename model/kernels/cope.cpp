// CoPE's bias and its gradient, each in one pass over every query's keys (model/kernels/cope.py
// says why and what; model/positional/cope.py holds the reference in torch).
//
// For query i and key j: gate g_ij = mask_ij · σ(score_ij · scale), position p_ij = Σ_{t ≥ j} g_it,
// and bias_ij = rows_i[⌈p⌉] · w + rows_i[⌊p⌋] · (1 − w), p clamped to n − 1, w = p − ⌊p⌋, where
// rows_i[k] = q_i · e_k, the query's product with the table's row k (computed by the caller).
// torch computes this in a dozen passes over [B, H, Tq, Tk] tensors (the reversed cumulative sum
// and the gathers cannot be fused); here each block of 16 score rows (16 queries of a head, or
// in a decode step the one query of 16 heads and batch rows) is copied into a [Tk, 16] buffer
// that stays in L1, scanned over its keys with the 16 side by side (the inner loops vectorise),
// and written back once. Keys that no query of a block may see (under a
// causal mask, half of them) have position 0 and bias rows_i[0]: they are filled, not scanned.
// (Inside AT_DISPATCH's macro argument a #pragma cannot stand, hence _Pragma there.)
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kLanes = simd::kLanes;  // queries scanned side by side

// Where position p reads the table: rows ⌊p⌋ and ⌈p⌉, and the weight of the row above.
struct Lookup {
  int32_t below, above;
  float weight;
};

inline Lookup lookup(float position, float last_row) {
  const float p = std::min(position, last_row);
  const int32_t below = static_cast<int32_t>(p);  // p ≥ 0: truncation is the floor
  const float weight = p - static_cast<float>(below);
  return {below, below + (weight > 0.f), weight};
}

// In place: each score becomes its gate, σ(score · scale) where the mask is 1 and 0 elsewhere
// (size: a multiple of 16, a block's keys times its lanes).
void gates_from_scores(float* scores, const float* mask, int64_t size, float scale) {
  for (int64_t i = 0; i < size; i += simd::kLanes) {
    const simd::f32x16 gate = simd::sigmoid(simd::load(scores + i) * scale);
    simd::store(scores + i, simd::load(mask + i) * gate);
  }
}

// Keys [0, seen) of `live` rows (each `stride` long) into a [seen, kLanes] block.
template <typename In>
void to_block(const In* source, int64_t live, int64_t stride, int64_t seen, float* block) {
  for (int64_t lane = 0; lane < live; ++lane)
    for (int64_t j = 0; j < seen; ++j)
      block[j * kLanes + lane] = static_cast<float>(source[lane * stride + j]);
}

template <typename Out>
void from_block(const float* block, int64_t live, int64_t stride, int64_t seen, Out* target) {
  for (int64_t lane = 0; lane < live; ++lane)
    for (int64_t j = 0; j < seen; ++j)
      target[lane * stride + j] = static_cast<Out>(block[j * kLanes + lane]);
}

// scores [G, Tq, Tk], mask [Gm, Tq, Tk] (G / Gm consecutive groups share one), rows [G, Tq, n]
struct Problem {
  int64_t groups, groups_per_mask, Tq, Tk, n;
  // Blocks run over the score rows of every group in turn ([G·Tq] rows), so that a decode step's
  // single query per head and batch row fills the lanes too.
  int64_t blocks() const { return (groups * Tq + kLanes - 1) / kLanes; }
  int64_t mask_row(int64_t row) const { return (row / Tq / groups_per_mask) * Tq + row % Tq; }
};

Problem problem_of(const at::Tensor& scores, const at::Tensor& mask, const at::Tensor& rows) {
  TORCH_CHECK(scores.dim() == 3 && mask.dim() == 3 && rows.dim() == 3, "3-d tensors expected");
  TORCH_CHECK(mask.scalar_type() == at::kBool, "the mask must be bool");
  TORCH_CHECK(rows.scalar_type() == scores.scalar_type(), "scores and rows must share a dtype");
  const int64_t groups = scores.size(0);
  TORCH_CHECK(groups % mask.size(0) == 0, "mask groups must divide score groups");
  TORCH_CHECK(rows.size(0) == groups && rows.size(1) == scores.size(1), "rows: one per query");
  return {groups, groups / mask.size(0), scores.size(1), scores.size(2), rows.size(2)};
}

// A block's rows [live, n] as float32.
template <typename In>
void load_rows(const In* rows, int64_t live, int64_t n, float* block) {
  std::transform(rows, rows + live * n, block, [](In v) { return static_cast<float>(v); });
}

// One block of up to 16 score rows: where they start, how many it holds, each one's mask row,
// and `seen`: keys from there on are hidden from all of them.
struct Block {
  int64_t first_row, live, seen;
  const bool* mask[kLanes];
};

Block block_of(const Problem& p, int64_t task, const bool* mask_data) {
  Block b{task * kLanes, std::min(kLanes, p.groups * p.Tq - task * kLanes), 0, {}};
  for (int64_t lane = 0; lane < b.live; ++lane) {
    b.mask[lane] = mask_data + p.mask_row(b.first_row + lane) * p.Tk;
    for (int64_t j = p.Tk - 1; j >= b.seen; --j)
      if (b.mask[lane][j]) {
        b.seen = j + 1;
        break;
      }
  }
  return b;
}

// The block's mask rows, keys [0, seen), into a [seen, kLanes] block of 0 and 1.
void mask_to_block(const Block& b, float* block) {
  for (int64_t lane = 0; lane < b.live; ++lane)
    for (int64_t j = 0; j < b.seen; ++j) block[j * kLanes + lane] = b.mask[lane][j] ? 1.f : 0.f;
}

// Every block's bias: `load(block, gates, table)` puts the block's scores into `gates`
// ([seen, kLanes]) and its rows q·e_k into `table` ([kLanes, n]); the rest is the same for the
// forward of given scores and for the decode step's, which computes them here.
template <typename Out, typename Load>
void bias_of_blocks(const Problem& p, const bool* mask_data, float score_scale, Out* bias_data,
                    Load load) {
  const float last_row = static_cast<float>(p.n - 1);
  const int32_t width = static_cast<int32_t>(p.n);
  at::parallel_for(0, p.blocks(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> gates(p.Tk * kLanes, 0.f), allowed(p.Tk * kLanes, 0.f);
    std::vector<float> out(p.Tk * kLanes), table(kLanes * p.n, 0.f);
    for (int64_t task = begin; task < end; ++task) {
      const Block b = block_of(p, task, mask_data);
      load(b, gates.data(), table.data());
      mask_to_block(b, allowed.data());
      gates_from_scores(gates.data(), allowed.data(), b.seen * kLanes, score_scale);
      const float* __restrict rows_of = table.data();
      float position[kLanes] = {};
      for (int64_t j = b.seen - 1; j >= 0; --j) {  // from the last key back: p_ij = Σ_{t ≥ j} g_it
        const float* __restrict gate = gates.data() + j * kLanes;
        float* __restrict bias_j = out.data() + j * kLanes;
#pragma omp simd
        for (int32_t lane = 0; lane < kLanes; ++lane) {
          position[lane] += gate[lane];
          const Lookup at = lookup(position[lane], last_row);
          const float* row = rows_of + lane * width;
          bias_j[lane] = row[at.above] * at.weight + row[at.below] * (1.f - at.weight);
        }
      }
      Out* target = bias_data + b.first_row * p.Tk;
      from_block(out.data(), b.live, p.Tk, b.seen, target);
      for (int64_t lane = 0; lane < b.live; ++lane)  // position 0 past every visible key
        std::fill(target + lane * p.Tk + b.seen, target + (lane + 1) * p.Tk,
                  static_cast<Out>(table[lane * p.n]));
    }
  });
}

at::Tensor cope_forward(const at::Tensor& scores_in, const at::Tensor& mask_in,
                        const at::Tensor& rows_in, double scale) {
  const auto scores = scores_in.contiguous(), mask = mask_in.contiguous(), rows = rows_in.contiguous();
  const Problem p = problem_of(scores, mask, rows);
  auto bias = at::empty_like(scores);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, scores.scalar_type(), "cope_forward", [&] {
    const scalar_t* score_data = scores.data_ptr<scalar_t>();
    const scalar_t* row_data = rows.data_ptr<scalar_t>();
    bias_of_blocks(p, mask.data_ptr<bool>(), static_cast<float>(scale),
                   bias.data_ptr<scalar_t>(), [&](const Block& b, float* gates, float* table) {
                     to_block(score_data + b.first_row * p.Tk, b.live, p.Tk, b.seen, gates);
                     load_rows(row_data + b.first_row * p.n, b.live, p.n, table);
                   });
  });
  return bias;
}

// A pass without gradients in float32 (decoding): the bias straight from queries [B, H, Tq, hd],
// the keys they may see [B, H, Tk, hd] (views into the KV cache: any strides but the last),
// the layer's table [n, hd] and the mask [B|1, 1, Tq, Tk]. The scores and rows the forward
// is given are dot products here, for the block's rows only: no [B, H, Tq, Tk] score tensor
// and no two matrix products' dispatch for a single query.
at::Tensor cope_decode(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& table_in,
                       const at::Tensor& mask_in, double scale) {
  TORCH_CHECK(queries.dim() == 4 && keys.dim() == 4 && queries.scalar_type() == at::kFloat &&
                  keys.scalar_type() == at::kFloat && table_in.scalar_type() == at::kFloat,
              "float32 queries [B, H, Tq, hd], keys [B, H, Tk, hd] and table [n, hd] expected");
  TORCH_CHECK(queries.stride(3) == 1 && keys.stride(3) == 1, "head dimensions must be contiguous");
  const auto table = table_in.contiguous(), mask = mask_in.contiguous();
  const int64_t batch = queries.size(0), heads = queries.size(1), Tq = queries.size(2);
  const int64_t head_dim = queries.size(3), Tk = keys.size(2), n = table.size(0);
  TORCH_CHECK(mask.dim() == 4 && mask.scalar_type() == at::kBool && mask.size(2) == Tq &&
                  mask.size(3) == Tk && (batch * heads) % mask.size(0) == 0,
              "the mask must be bool [B|1, 1, Tq, Tk]");
  const Problem p{batch * heads, batch * heads / mask.size(0), Tq, Tk, n};
  auto bias = at::empty({batch, heads, Tq, Tk}, queries.options());
  const float* q_data = queries.data_ptr<float>();
  const float* k_data = keys.data_ptr<float>();
  const float* e_data = table.data_ptr<float>();
  bias_of_blocks(p, mask.data_ptr<bool>(), static_cast<float>(scale), bias.data_ptr<float>(),
                 [&](const Block& b, float* gates, float* rows) {
                   for (int64_t lane = 0; lane < b.live; ++lane) {
                     const int64_t row = b.first_row + lane, group = row / Tq;
                     const int64_t r = group / heads, h = group % heads;
                     const float* q = q_data + r * queries.stride(0) + h * queries.stride(1) +
                                      (row % Tq) * queries.stride(2);
                     const float* k = k_data + r * keys.stride(0) + h * keys.stride(1);
                     for (int64_t j = 0; j < b.seen; ++j)
                       gates[j * kLanes + lane] = simd::dot(q, k + j * keys.stride(2), head_dim);
                     for (int64_t e = 0; e < n; ++e)
                       rows[lane * n + e] = simd::dot(q, e_data + e * head_dim, head_dim);
                   }
                 });
  return bias;
}

// The gradients of cope_forward's bias with respect to the scores and the rows.
std::vector<at::Tensor> cope_backward(const at::Tensor& grad_in, const at::Tensor& scores_in,
                                      const at::Tensor& mask_in, const at::Tensor& rows_in,
                                      double scale) {
  const auto scores = scores_in.contiguous(), mask = mask_in.contiguous(), rows = rows_in.contiguous();
  const auto grad = grad_in.to(scores.scalar_type()).contiguous();
  const Problem p = problem_of(scores, mask, rows);
  auto d_scores = at::empty_like(scores);
  auto d_rows = at::empty_like(rows);
  const float last_row = static_cast<float>(p.n - 1), score_scale = static_cast<float>(scale);
  const int32_t width = static_cast<int32_t>(p.n);
  const bool* mask_data = mask.data_ptr<bool>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, scores.scalar_type(), "cope_backward", [&] {
    const scalar_t* grad_data = grad.data_ptr<scalar_t>();
    const scalar_t* score_data = scores.data_ptr<scalar_t>();
    const scalar_t* row_data = rows.data_ptr<scalar_t>();
    scalar_t* d_score_data = d_scores.data_ptr<scalar_t>();
    scalar_t* d_row_data = d_rows.data_ptr<scalar_t>();
    at::parallel_for(0, p.blocks(), 1, [&](int64_t begin, int64_t end) {
      const int64_t size = p.Tk * kLanes;
      std::vector<float> gates(size, 0.f), allowed(size, 0.f), grads(size, 0.f);
      std::vector<float> positions(size), out(size), table(kLanes * p.n, 0.f), d_table(kLanes * p.n);
      for (int64_t task = begin; task < end; ++task) {
        const Block b = block_of(p, task, mask_data);
        const scalar_t* grad_rows = grad_data + b.first_row * p.Tk;
        to_block(score_data + b.first_row * p.Tk, b.live, p.Tk, b.seen, gates.data());
        mask_to_block(b, allowed.data());
        to_block(grad_rows, b.live, p.Tk, b.seen, grads.data());
        load_rows(row_data + b.first_row * p.n, b.live, p.n, table.data());
        std::fill(d_table.begin(), d_table.end(), 0.f);
        gates_from_scores(gates.data(), allowed.data(), b.seen * kLanes, score_scale);
        float running[kLanes] = {};
        for (int64_t j = b.seen - 1; j >= 0; --j) {  // the positions, counted as the forward did
          _Pragma("omp simd")
          for (int32_t lane = 0; lane < kLanes; ++lane) {
            running[lane] += gates[j * kLanes + lane];
            positions[j * kLanes + lane] = running[lane];
          }
        }
        // d gate_t = Σ_{j ≤ t} d position_j, so the keys run forward; d score = d gate · g(1 − g)
        const float* __restrict rows_of = table.data();
        float* __restrict d_rows_of = d_table.data();
        float d_gate[kLanes] = {};
        for (int64_t j = 0; j < b.seen; ++j) {
          _Pragma("omp simd")  // each lane scatters into its own row: no two lanes collide
          for (int32_t lane = 0; lane < kLanes; ++lane) {
            const int64_t at = j * kLanes + lane;
            const Lookup l = lookup(positions[at], last_row);
            const float g = grads[at];
            const float* row = rows_of + lane * width;
            float* d_row = d_rows_of + lane * width;
            d_row[l.below] += g * (1.f - l.weight);
            d_row[l.above] += g * l.weight;
            d_gate[lane] += g * (row[l.above] - row[l.below]);
            out[at] = d_gate[lane] * gates[at] * (1.f - gates[at]) * score_scale;  // masked: 0
          }
        }
        scalar_t* target = d_score_data + b.first_row * p.Tk;
        from_block(out.data(), b.live, p.Tk, b.seen, target);
        for (int64_t lane = 0; lane < b.live; ++lane) {  // hidden keys: gate 0, position 0
          std::fill(target + lane * p.Tk + b.seen, target + (lane + 1) * p.Tk, scalar_t(0));
          for (int64_t j = b.seen; j < p.Tk; ++j)
            d_rows_of[lane * width] += static_cast<float>(grad_rows[lane * p.Tk + j]);
        }
        std::transform(d_table.begin(), d_table.begin() + b.live * p.n, d_row_data + b.first_row * p.n,
                       [](float v) { return static_cast<scalar_t>(v); });
      }
    });
  });
  return {d_scores, d_rows};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ORDINAL_OPS, m) {
  m.def("cope_forward(Tensor scores, Tensor mask, Tensor rows, float scale) -> Tensor",
        &cope_forward);
  m.def("cope_decode(Tensor queries, Tensor keys, Tensor table, Tensor mask, float scale) -> Tensor",
        &cope_decode);
  m.def("cope_backward(Tensor grad, Tensor scores, Tensor mask, Tensor rows, float scale) -> Tensor[]",
        &cope_backward);
}
