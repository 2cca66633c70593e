// A whole decode step — one new token per row, from its id to its logits — in one call
// (model/kernels/decode_step.py says when it runs and why), written over simd.h.
//
// The torch forward (model/transformer.py) is the definition; this is the same arithmetic
// without the ~40 tensor operations a block costs there, each a few microseconds of dispatch
// for a few hundred floats of work. The token's embedding plus the scheme's position vector;
// then per block: norm, fused QKV projection, rotation of queries and keys, the new key and
// value written into the cache at the row's position, attention over the row's slots
// 0..position (plus the scheme's score bias), output projection, residual, norm, MLP, residual;
// then the final norm and the logits. The bias is the scheme's (alibi, t5, fire: computed once
// per pass, FIRE's by fire_bias below) or, for fox and cope, computed here per layer and head
// from the same tensors as their torch code. The projections are linear_core.h's, so a row's
// numbers are the same alone and in any batch: everything else here is computed row by row, in
// a fixed order, and so the same on every ISA too.
//
// Reading order: the inputs (StepInputs, BlockWeights), the pieces of a block (normalise,
// attention, rotation, the MLP), a block's three stages for a group of rows (before_attention,
// attend, after_attention), the step (run_step), and last the op that builds StepInputs from
// its tensors (decode_step).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <mutex>
#include <vector>

#include "linear_core.h"
#include "shared_work.h"
#include "simd.h"

namespace {

using simd::f32x16;
using shared_work::Helper;
using shared_work::SharedWork;

enum Norm : int64_t { kLayerNorm = 0, kRMSNorm = 1 };
enum Mlp : int64_t { kGelu = 0, kGeluTanh = 1, kRelu2 = 2, kSwiGLU = 3 };
// The schemes whose bias comes from each layer's own tensors (model/positional/fox.py, cope.py).
enum Scheme : int64_t { kPlain = 0, kForgetting = 1, kContextual = 2 };
constexpr int64_t kTensorsPerBlock = 12;  // decode_step.py's step_tensors()
// Fewer activations than this stay on one thread: a parallel region costs a few microseconds.
constexpr int64_t kSerialActivations = 16384;
// From this many rows, on several threads, each thread takes its share of the rows through all
// the blocks (run_step).
constexpr int64_t kSplitRows = 8;
// From this many rows a step shared with the helper goes in two groups (through_blocks_shared).
constexpr int64_t kTwoGroups = 16;

const float* data_or_null(const at::Tensor& t) { return t.numel() ? t.data_ptr<float>() : nullptr; }

// The model's shape and forms, as decode_step.py's architecture list gives them.
struct Architecture {
  int64_t vocab, heads, kv_heads, head_dim, d, norm, mlp, scheme;
  float eps;
  int64_t qkv_width() const { return (heads + 2 * kv_heads) * head_dim; }
};

// One block's weights: a norm's weight and bias (the bias null where the model has none), a
// projection's packed weight (linear_core.h) and bias.
struct Projection {
  at::Tensor packed;
  const float* bias;
};
struct NormWeights {
  const float* weight;
  const float* bias;
};
struct BlockWeights {
  NormWeights attention_norm;
  Projection qkv, proj;
  NormWeights mlp_norm;
  Projection up, down;
};

// What fox's and cope's biases read (model/positional/fox.py, cope.py); empty otherwise.
struct LayerSignal {
  int64_t scheme = kPlain;
  at::Tensor gate_weight, gate_bias;  // FoX: [layers, H, d], [layers, H]
  at::Tensor states;                  // FoX: the cache's log gates [layers, rows, H, length]
  at::Tensor table;                   // CoPE: position embeddings [layers, n, hd]
};

// What a head's attention reads: the cache, the scheme's score bias, fox's or cope's tensors.
// A piece of work shared with the helper keeps a copy (the tensors' references keep them alive).
struct AttentionInputs {
  Architecture arch;
  at::Tensor keys, values;  // the cache's [layers, cache rows, Hkv, length, hd], hd contiguous
  at::Tensor bias;          // the scheme's score bias [rows, H, length], or empty
  LayerSignal signal;
};

// Everything a step reads, checked (decode_step builds it).
struct StepInputs {
  AttentionInputs attention;
  int64_t rows = 0, longest = 0;  // pass rows; the most slots a row attends
  std::vector<int64_t> position;  // each row's position: where its key goes, the last it sees
  const int64_t* slot_row = nullptr;  // each row's cache row
  bool prompt_rows = false;  // some cache row takes several pass rows (a prompt's tokens)
  const float* cos = nullptr;  // [rows, rot] each, or null: no rotation
  const float* sin = nullptr;
  int64_t rot = 0, rotation_stride = 0;
  std::vector<BlockWeights> blocks;
  NormWeights final_norm;
  Projection logits;
  const Architecture& arch() const { return attention.arch; }
};

void normalise(const float* x, float* y, const Architecture& a, NormWeights w) {
  const int64_t d = a.d;
  float mean = 0.0f;
  if (a.norm == kLayerNorm) {
    for (int64_t i = 0; i < d; ++i) mean += x[i];
    mean /= static_cast<float>(d);
  }
  float square = 0.0f;
  for (int64_t i = 0; i < d; ++i) square = simd::fmadd(x[i] - mean, x[i] - mean, square);
  const float scale = 1.0f / std::sqrt(square / static_cast<float>(d) + a.eps);
  for (int64_t i = 0; i < d; ++i) y[i] = (x[i] - mean) * scale * w.weight[i] + (w.bias ? w.bias[i] : 0.0f);
}

// softmax's numerators e^(score − largest) in place over n scores → their sum.
float exponentiate(float* scores, int64_t n, float largest) {
  f32x16 total = simd::zero();
  int64_t t = 0;
  for (; t + simd::kLanes <= n; t += simd::kLanes) {
    const f32x16 w = simd::exp(simd::load(scores + t) - largest);
    simd::store(scores + t, w);
    total += w;
  }
  if (t < n) {  // the lanes past n are −inf: e^−inf = 0
    const f32x16 w = simd::exp(simd::load_first(scores + t, n - t, -__builtin_inff()) - largest);
    simd::store_first(scores + t, w, n - t);
    total += w;
  }
  return simd::reduce_add(total);
}

// One head's attention of query q [hd] over n keys and values (rows `*_stride` floats apart)
// with the score bias (null: none), into out [hd]; scores: room for n floats. The head dimension
// is V vectors (hd = 16·V): the query and the output stay in registers across all the keys.
// next_keys: the lines the next head reads (fetched during the value pass; null: none). At
// batch 32 and more the cache comes from memory, and fetching ahead keeps more of it in flight.
struct HeadAttention {
  const float *keys, *values, *bias, *next_keys;
  int64_t key_stride, value_stride, bias_stride, n, hd;
  float scale;
};

template <int V>
void attend_vectors(const HeadAttention& h, const float* q, float* scores, float* out) {
  f32x16 query[V], acc[V];  // every loop over them unrolled: they stay in registers
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) query[v] = simd::load(q + simd::kLanes * v);
  float largest = -__builtin_inff();
  for (int64_t t = 0; t < h.n; ++t) {
    const float* k = h.keys + t * h.key_stride;
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) simd::prefetch_l2(h.values + t * h.value_stride + simd::kLanes * v);
    f32x16 sum = query[0] * simd::load(k);
#pragma GCC unroll 8
    for (int v = 1; v < V; ++v) sum = simd::fmadd(query[v], simd::load(k + simd::kLanes * v), sum);
    float score = simd::reduce_add(sum) * h.scale;
    if (h.bias) score += h.bias[t * h.bias_stride];
    scores[t] = score;
    largest = std::max(largest, score);
  }
  const float total = exponentiate(scores, h.n, largest);
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) acc[v] = simd::zero();
  for (int64_t t = 0; t < h.n; ++t) {
    const f32x16 weight = simd::broadcast(scores[t]);
    const float* value = h.values + t * h.value_stride;
    if (h.next_keys)
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) simd::prefetch_l2(h.next_keys + t * h.key_stride + simd::kLanes * v);
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[v] = simd::fmadd(weight, simd::load(value + simd::kLanes * v), acc[v]);
  }
  const float inverse = 1.0f / total;
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) simd::store(out + simd::kLanes * v, acc[v] * inverse);
}

// The same for a head dimension that is not 16, 32, 64 or 128: one float at a time.
void attend_floats(const HeadAttention& h, const float* q, float* scores, float* out) {
  float largest = -__builtin_inff();
  for (int64_t t = 0; t < h.n; ++t) {
    scores[t] = simd::dot(q, h.keys + t * h.key_stride, h.hd) * h.scale +
                (h.bias ? h.bias[t * h.bias_stride] : 0.0f);
    largest = std::max(largest, scores[t]);
  }
  const float total = exponentiate(scores, h.n, largest);
  std::fill_n(out, h.hd, 0.0f);
  for (int64_t t = 0; t < h.n; ++t)
    for (int64_t i = 0; i < h.hd; ++i) out[i] = simd::fmadd(scores[t], h.values[t * h.value_stride + i], out[i]);
  for (int64_t i = 0; i < h.hd; ++i) out[i] *= 1.0f / total;
}

void attend_one_head(const HeadAttention& h, const float* q, float* scores, float* out) {
  switch (h.hd) {
    case 16: return attend_vectors<1>(h, q, scores, out);
    case 32: return attend_vectors<2>(h, q, scores, out);
    case 64: return attend_vectors<4>(h, q, scores, out);
    case 128: return attend_vectors<8>(h, q, scores, out);
    default: return attend_floats(h, q, scores, out);
  }
}

// NeoX half-split rotation of the first `rot` dims (model/positional/rotation.py).
void rotate(float* x, const float* cos, const float* sin, int64_t rot) {
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float first = x[i], second = x[i + half];
    x[i] = first * cos[i] - second * sin[i];
    x[i + half] = second * cos[i + half] + first * sin[i + half];
  }
}

// The MLP's activation over n floats in place, 16 at a time (simd.h's erf and tanh: the same
// bits on every ISA).
void activate(float* h, int64_t n, int64_t mlp) {
  for (int64_t i = 0; i < n; i += simd::kLanes) {
    const int64_t lanes = std::min<int64_t>(simd::kLanes, n - i);
    const f32x16 u = simd::load_first(h + i, lanes);
    f32x16 out;
    switch (mlp) {
      case kGelu: out = 0.5f * u * (1.0f + simd::erf(u * 0.70710678f)); break;
      case kGeluTanh:
        out = 0.5f * u * (1.0f + simd::tanh(0.79788456f * (u + 0.044715f * u * u * u)));
        break;
      default: out = simd::select(u > 0.0f, u * u, simd::zero());  // kRelu2
    }
    simd::store_first(h + i, out, lanes);
  }
}

// SwiGLU: out[i] = silu(gate[i]) · value[i] over n floats (out may be gate).
void swiglu(const float* gate, const float* value, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += simd::kLanes) {
    const int64_t lanes = std::min<int64_t>(simd::kLanes, n - i);
    const f32x16 g = simd::load_first(gate + i, lanes), v = simd::load_first(value + i, lanes);
    simd::store_first(out + i, g / (1.0f + simd::exp(-g)) * v, lanes);
  }
}

float log_sigmoid(float x) { return std::min(x, 0.0f) - std::log1p(std::exp(-std::fabs(x))); }

// FoX: each head's log forget gate of this row's new token, kept in the cache beside its key.
void store_log_gates(const LayerSignal& signal, int64_t layer, int64_t row, int64_t position,
                     const float* hidden, int64_t heads, int64_t d) {
  const auto& w = signal.gate_weight;
  const auto& st = signal.states;
  for (int64_t h = 0; h < heads; ++h) {
    const float* weight = w.data_ptr<float>() + layer * w.stride(0) + h * w.stride(1);
    const float gate = simd::dot(weight, hidden, d) +
                       signal.gate_bias.data_ptr<float>()[layer * signal.gate_bias.stride(0) + h];
    st.data_ptr<float>()[layer * st.stride(0) + row * st.stride(1) + h * st.stride(2) +
                         position * st.stride(3)] = log_sigmoid(gate);
  }
}

// The data-dependent bias of one head's n keys (the query at slot n − 1) into `bias`, which has
// room after them for CoPE's q·e products, one per table row.
// FoX: D_j = Σ_{l=j+1..n−1} log f_l. CoPE: p_j = Σ_{t=j..n−1} σ(q·k_t/√hd), then q·e[p_j]
// read between rows ⌊p_j⌋ and ⌈p_j⌉. Both running sums in double, as torch's CPU cumsum.
void layer_bias(const LayerSignal& signal, int64_t layer, int64_t row, int64_t head,
                const float* q, const float* keys, int64_t key_stride, int64_t n, int64_t hd,
                float scale, float* bias) {
  if (signal.scheme == kForgetting) {
    const auto& st = signal.states;
    const float* gates = st.data_ptr<float>() + layer * st.stride(0) + row * st.stride(1) +
                         head * st.stride(2);
    double running = 0.0;
    for (int64_t t = n - 1; t >= 0; --t) {
      bias[t] = static_cast<float>(running);
      running += gates[t * st.stride(3)];
    }
    return;
  }
  const auto& table = signal.table;  // kContextual
  const int64_t rows = table.size(1);
  float* at_rows = bias + n;
  const float* embeddings = table.data_ptr<float>() + layer * table.stride(0);
  for (int64_t k = 0; k < rows; ++k) at_rows[k] = simd::dot(q, embeddings + k * table.stride(1), hd);
  double running = 0.0;
  for (int64_t t = n - 1; t >= 0; --t) {
    const float gate = 1.0f / (1.0f + std::exp(-simd::dot(q, keys + t * key_stride, hd) * scale));
    running += gate;
    const float p = std::min(static_cast<float>(running), static_cast<float>(rows - 1));
    const float below = std::floor(p), weight = p - below;
    const int64_t low = static_cast<int64_t>(below), high = static_cast<int64_t>(std::ceil(p));
    bias[t] = at_rows[high] * weight + at_rows[low] * (1.0f - weight);
  }
}

// The floats attend_head's own_bias needs for `longest` keys: fox's bias, or cope's and its
// q·e products, one per table row.
int64_t own_bias_room(const LayerSignal& signal, int64_t longest) {
  return longest + (signal.scheme == kContextual ? signal.table.size(1) : 0);
}

// Head h's attention for one row in block `layer`, after store_row: its query in `qkv`, over
// cache row `slot_row`'s slots 0..position, into out [hd]; `row` is its place in the batch (its
// row of the score bias). scores: room for position + 1 floats; own_bias: own_bias_room floats.
// next_slot_row: the cache row whose first head attends right after this row's last (its keys
// are fetched meanwhile; −1: none).
struct HeadTask {
  int64_t layer, row, slot_row, position, head, next_slot_row;
};

void attend_head(const AttentionInputs& in, const float* qkv, const HeadTask& task, float* scores,
                 float* own_bias, float* out) {
  const Architecture& a = in.arch;
  const int64_t hd = a.head_dim, group = a.heads / a.kv_heads, g = task.head / group;
  const auto ks = in.keys.strides(), vs = in.values.strides();
  const float* layer_keys = in.keys.data_ptr<float>() + task.layer * ks[0];
  const float* key_base = layer_keys + task.slot_row * ks[1];
  HeadAttention h{};
  h.keys = key_base + g * ks[2];
  h.values = in.values.data_ptr<float>() + task.layer * vs[0] + task.slot_row * vs[1] + g * vs[2];
  h.key_stride = ks[3];
  h.value_stride = vs[3];
  h.n = task.position + 1;
  h.hd = hd;
  h.scale = 1.0f / std::sqrt(static_cast<float>(hd));
  if (in.bias.numel()) {
    h.bias = in.bias.data_ptr<float>() + task.row * in.bias.stride(0) + task.head * in.bias.stride(1);
    h.bias_stride = in.bias.stride(2);
  }
  const float* q = qkv + task.head * hd;
  if (in.signal.scheme != kPlain) {
    layer_bias(in.signal, task.layer, task.slot_row, task.head, q, h.keys, ks[3], h.n, hd, h.scale,
               own_bias);
    h.bias = own_bias;
    h.bias_stride = 1;
  }
  const int64_t next_group = (task.head + 1) / group;  // the next head's keys, if they are others
  if (task.head + 1 < a.heads && next_group != g) h.next_keys = key_base + next_group * ks[2];
  if (task.head + 1 == a.heads && task.next_slot_row >= 0)
    h.next_keys = layer_keys + task.next_slot_row * ks[1];
  attend_one_head(h, q, scores, out);
}

// One block's attention for every row of a group, shared with the helper: a piece is a row's
// heads (shared_work.h says how the two threads split the pieces).
class SharedAttention : public SharedWork {
 public:
  void prepare(const StepInputs& in, int64_t layer, int64_t first, int64_t rows, const float* qkv,
               float* out) {
    in_ = in.attention;
    layer_ = layer;
    first_ = first;
    longest_ = in.longest;
    const Architecture& a = in.arch();
    const int64_t width = a.heads * a.head_dim;
    queries_.resize(rows * width);  // a copy: the decode thread rewrites qkv next block
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(qkv + r * a.qkv_width(), width, queries_.data() + r * width);
    positions_.assign(in.position.begin() + first, in.position.begin() + first + rows);
    slot_rows_.assign(in.slot_row + first, in.slot_row + first + rows);
    out_ = out;
    helper_out_.resize(rows * width);
    scores_.resize(longest_);
    own_bias_.resize(own_bias_room(in_.signal, longest_));
    reset(rows);
  }

  // The step's tensors let go (the work is idle: no thread reads them).
  void release() {
    in_ = AttentionInputs{};
    out_ = nullptr;
  }

 protected:
  void prepare_helper() override {
    helper_scores_.resize(longest_);
    helper_own_bias_.resize(own_bias_room(in_.signal, longest_));
  }

  void compute(int64_t r, bool by_helper) override {
    const Architecture& a = in_.arch;
    const int64_t width = a.heads * a.head_dim;
    float* out = (by_helper ? helper_out_.data() : out_) + r * width;
    auto& scores = by_helper ? helper_scores_ : scores_;
    auto& own_bias = by_helper ? helper_own_bias_ : own_bias_;
    const int64_t next_slot_row = r + 1 < pieces() ? slot_rows_[r + 1] : -1;
    for (int64_t h = 0; h < a.heads; ++h) {
      const HeadTask task{layer_, first_ + r, slot_rows_[r], positions_[r], h, next_slot_row};
      attend_head(in_, queries_.data() + r * width, task, scores.data(), own_bias.data(),
                  out + h * a.head_dim);
    }
  }

  void publish(int64_t r) override {
    const int64_t width = in_.arch.heads * in_.arch.head_dim;
    std::copy_n(helper_out_.data() + r * width, width, out_ + r * width);
  }

 private:
  AttentionInputs in_;
  int64_t layer_ = 0, first_ = 0, longest_ = 0;
  std::vector<float> queries_;  // [rows, H·hd]: attend_head reads head h's at h·hd
  std::vector<int64_t> positions_, slot_rows_;
  float* out_ = nullptr;  // [rows, H·hd], the decode thread's
  std::vector<float> helper_out_, scores_, own_bias_, helper_scores_, helper_own_bias_;
};

// The work objects of every step, each reused once no thread holds it but the pool. Idle work
// lets go of the tensors it read (release_idle): the cache above all, which the engine shrinks
// or drops when idle, and a work kept whole would keep it alive. Only a thread holding the GIL
// may let go of them (a tensor made in Python drops its Python object with it): the decode
// thread releases as each step starts and as a shared step ends, skipping a work the helper has
// not yet put down, and never the helper (it deadlocked).
class WorkPool {
 public:
  std::shared_ptr<SharedAttention> idle() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& work : works_)
      if (work.use_count() == 1) return work;
    works_.push_back(std::make_shared<SharedAttention>());
    return works_.back();
  }

  void release_idle() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& work : works_)
      if (work.use_count() == 1) work->release();
  }

 private:
  std::mutex mutex_;  // use counts change only under it, but for a holder letting go
  std::vector<std::shared_ptr<SharedAttention>> works_;
};

WorkPool& work_pool() {
  static WorkPool* pool = new WorkPool();  // never destroyed, as the helper
  return *pool;
}

std::atomic<bool> g_sharing{false};  // whether large steps share their attention
std::atomic<int> g_order{SharedWork::kFree};
std::atomic<int64_t> g_helped{0}, g_taken{0};  // SharedWork::Outcome's, summed over the process

// A group of pass rows [first, first + n) on its way through the blocks, with its buffers.
struct RowGroup {
  int64_t first, n;
  float* stream;  // its rows of the residual stream [n, d], updated in place
  std::vector<float> normed, qkv, attended, projected, hidden;
  std::shared_ptr<SharedAttention> work;  // its attention, while shared with the helper

  RowGroup(const StepInputs& in, float* residual, int64_t first_row, int64_t last_row)
      : first(first_row), n(last_row - first_row), stream(residual + first_row * in.arch().d) {
    const Architecture& a = in.arch();
    normed.resize(n * a.d);
    qkv.resize(n * a.qkv_width());
    attended.resize(n * a.heads * a.head_dim);
    projected.resize(n * a.d);
  }
};

// Block b up to its attention: norm, QKV projection, rotation, the new keys and values stored
// (the cache's slot `position` of each row's cache row; FoX's log gates beside them).
void before_attention(const StepInputs& in, RowGroup& g, int64_t b) {
  const Architecture& a = in.arch();
  const BlockWeights& w = in.blocks[b];
  const int64_t width = a.qkv_width(), hd = a.head_dim;
  for (int64_t r = 0; r < g.n; ++r) normalise(g.stream + r * a.d, g.normed.data() + r * a.d, a, w.attention_norm);
  linear_core::project(g.normed.data(), w.qkv.packed, w.qkv.bias, g.qkv.data(), g.n, a.d, width);
  const LayerSignal& signal = in.attention.signal;
  const auto ks = in.attention.keys.strides(), vs = in.attention.values.strides();
  for (int64_t r = 0; r < g.n; ++r) {
    const int64_t row = g.first + r, slot_row = in.slot_row[row], position = in.position[row];
    if (signal.scheme == kForgetting)
      store_log_gates(signal, b, slot_row, position, g.normed.data() + r * a.d, a.heads, a.d);
    float* qkv = g.qkv.data() + r * width;
    if (in.rot)
      for (int64_t h = 0; h < a.heads + a.kv_heads; ++h)
        rotate(qkv + h * hd, in.cos + row * in.rotation_stride, in.sin + row * in.rotation_stride,
               in.rot);
    float* keys = in.attention.keys.data_ptr<float>() + b * ks[0] + slot_row * ks[1];
    float* values = in.attention.values.data_ptr<float>() + b * vs[0] + slot_row * vs[1];
    for (int64_t kv = 0; kv < a.kv_heads; ++kv) {
      std::copy_n(qkv + (a.heads + kv) * hd, hd, keys + kv * ks[2] + position * ks[3]);
      std::copy_n(qkv + (a.heads + a.kv_heads + kv) * hd, hd, values + kv * vs[2] + position * vs[3]);
    }
  }
}

// Block b's attention on torch's threads: every (row, head) pair on its own (a batch of one row
// still has its heads to split across threads, and its attention reads that row's cache).
void attend(const StepInputs& in, RowGroup& g, int64_t b) {
  const Architecture& a = in.arch();
  at::parallel_for(0, g.n * a.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(in.longest), own_bias(own_bias_room(in.attention.signal, in.longest));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / a.heads, h = i % a.heads, row = g.first + r;
      const int64_t next_slot_row = h + 1 == a.heads && i + 1 < end ? in.slot_row[row + 1] : -1;
      const HeadTask task{b, row, in.slot_row[row], in.position[row], h, next_slot_row};
      attend_head(in.attention, g.qkv.data() + r * a.qkv_width(), task, scores.data(),
                  own_bias.data(), g.attended.data() + (r * a.heads + h) * a.head_dim);
    }
  });
}

// Block b after its attention: output projection, residual, norm, MLP, residual.
void after_attention(const StepInputs& in, RowGroup& g, int64_t b) {
  const Architecture& a = in.arch();
  const BlockWeights& w = in.blocks[b];
  // The up projection's outputs, from the down projection's inputs (packing pads outputs).
  const int64_t inner = linear_core::inputs_of(w.down.packed);
  const int64_t expanded = a.mlp == kSwiGLU ? 2 * inner : inner;
  g.hidden.resize(g.n * expanded);
  linear_core::project(g.attended.data(), w.proj.packed, w.proj.bias, g.projected.data(), g.n,
                       a.heads * a.head_dim, a.d);
  for (int64_t i = 0; i < g.n * a.d; ++i) g.stream[i] += g.projected[i];
  for (int64_t r = 0; r < g.n; ++r) normalise(g.stream + r * a.d, g.normed.data() + r * a.d, a, w.mlp_norm);
  linear_core::project(g.normed.data(), w.up.packed, w.up.bias, g.hidden.data(), g.n, a.d, expanded);
  float* hidden = g.hidden.data();
  if (a.mlp == kSwiGLU) {
    for (int64_t r = 0; r < g.n; ++r) {  // gate, then value (FeedForward's chunk(2)), packed
      const float* h = hidden + r * expanded;  // to [n, inner] in place, row by row
      swiglu(h, h + inner, hidden + r * inner, inner);
    }
  } else {  // row by row: a row's floats take the same vector lanes alone and in a batch
    const int64_t grain = std::max<int64_t>(1, kSerialActivations / expanded);
    at::parallel_for(0, g.n, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) activate(hidden + r * expanded, expanded, a.mlp);
    });
  }
  linear_core::project(hidden, w.down.packed, w.down.bias, g.projected.data(), g.n, inner, a.d);
  for (int64_t i = 0; i < g.n * a.d; ++i) g.stream[i] += g.projected[i];
}

// Rows [first, last) through every block.
void through_blocks(const StepInputs& in, float* residual, int64_t first, int64_t last) {
  RowGroup g(in, residual, first, last);
  for (int64_t b = 0; b < static_cast<int64_t>(in.blocks.size()); ++b) {
    before_attention(in, g, b);
    attend(in, g, b);
    after_attention(in, g, b);
  }
}

// Every row through every block with the helper: from 16 rows in two groups, so that the helper
// attends one group's rows while this thread projects the other's. The groups go through the
// blocks staggered: each takes its attention back (SharedWork::run: what is left of it, on both
// threads), finishes the block and posts the next block's attention, while the helper attends
// the other group's.
SharedWork::Outcome through_blocks_shared(const StepInputs& in, float* residual) {
  const auto order = static_cast<SharedWork::Order>(g_order.load(std::memory_order_relaxed));
  const shared_work::Awake awake(true);  // from here: waking takes a while, the first post is later
  std::vector<RowGroup> groups;
  if (in.rows >= kTwoGroups) {
    groups.emplace_back(in, residual, 0, in.rows / 2);
    groups.emplace_back(in, residual, in.rows / 2, in.rows);
  } else {
    groups.emplace_back(in, residual, 0, in.rows);
  }
  const auto post = [&](RowGroup& g, int64_t b) {  // up to block b's attention, then posted
    before_attention(in, g, b);
    g.work = work_pool().idle();
    g.work->prepare(in, b, g.first, g.n, g.qkv.data(), g.attended.data());
    Helper::instance().post(g.work, order);
  };
  for (RowGroup& g : groups) post(g, 0);
  SharedWork::Outcome outcome;
  const int64_t n_blocks = static_cast<int64_t>(in.blocks.size());
  for (int64_t b = 0; b < n_blocks; ++b) {
    for (RowGroup& g : groups) {
      const SharedWork::Outcome done = Helper::instance().take_back(g.work, order);
      g.work.reset();
      outcome.helped += done.helped;
      outcome.taken += done.taken;
      after_attention(in, g, b);
      if (b + 1 < n_blocks) post(g, b + 1);
    }
  }
  return outcome;
}

// The final norm, then the logits of the rows `pick` names (null: every row): one projection
// over them (its outputs split across threads), so that each thread reads only its share of the
// largest weight. → [wanted, vocab].
at::Tensor logits_of(const StepInputs& in, const at::Tensor& residual, const int64_t* pick,
                     int64_t wanted) {
  const Architecture& a = in.arch();
  std::vector<float> normed(wanted * a.d);
  for (int64_t i = 0; i < wanted; ++i)
    normalise(residual.data_ptr<float>() + (pick ? pick[i] : i) * a.d, normed.data() + i * a.d, a,
              in.final_norm);
  auto logits = at::empty({wanted, a.vocab}, residual.options());
  if (wanted)
    linear_core::project(normed.data(), in.logits.packed, in.logits.bias, logits.data_ptr<float>(),
                         wanted, a.d, a.vocab);
  return logits;
}

// The step: the residual stream [rows, d] (each row's embedding plus its position vector, as
// the torch forward adds them) through every block, then the logits.
//
// A large step on one torch thread shares its attention with the helper (shared_work.h). A large
// batch on several threads: each thread takes its rows through every block, one parallel region
// a step instead of one per product and attention (each a wait for the slowest thread, which on
// a busy machine may be waiting for a core); inside, the loops run serially. A row's numbers are
// the same either way: everything is computed row by row.
at::Tensor run_step(const StepInputs& in, at::Tensor residual, const int64_t* pick, int64_t wanted) {
  work_pool().release_idle();  // what the last shared step's helper still held as it ended
  float* stream = residual.data_ptr<float>();
  const bool large = in.rows >= kSplitRows;
  SharedWork::Outcome outcome;
  if (large && g_sharing.load(std::memory_order_relaxed) && at::get_num_threads() == 1) {
    outcome = through_blocks_shared(in, stream);
    work_pool().release_idle();
  } else if (large && at::get_num_threads() > 1 && !in.prompt_rows) {
    at::parallel_for(0, in.rows, kSplitRows / 2,
                     [&](int64_t first, int64_t last) { through_blocks(in, stream, first, last); });
  } else {
    through_blocks(in, stream, 0, in.rows);
  }
  g_helped.fetch_add(outcome.helped, std::memory_order_relaxed);
  g_taken.fetch_add(outcome.taken, std::memory_order_relaxed);
  return logits_of(in, residual, pick, wanted);
}

// ---- The op: its tensors checked and read into StepInputs ----

NormWeights norm_of(const at::Tensor& weight, const at::Tensor& bias) {
  return {weight.data_ptr<float>(), data_or_null(bias)};
}

Projection projection_of(const at::Tensor& packed, const at::Tensor& bias) {
  return {packed, data_or_null(bias)};
}

// Each row's position and cache row, checked: a position inside the cache, and the rows of one
// cache row (a prompt's tokens prefilled with the decoding rows) consecutive, in position order
// (each attends the slots the ones before it wrote in the same block).
void read_rows(StepInputs& in, const at::Tensor& tokens, const at::Tensor& slot_rows,
               const at::Tensor& positions) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(1) == 1 && tokens.scalar_type() == at::kLong,
              "tokens must be an int64 [rows, 1] matrix");
  in.rows = tokens.size(0);
  TORCH_CHECK(positions.dim() == 2 && positions.size(0) == in.rows && positions.size(1) == 1 &&
                  positions.scalar_type() == at::kLong,
              "positions must be an int64 [rows, 1] matrix");
  TORCH_CHECK(slot_rows.dim() == 1 && slot_rows.size(0) == in.rows &&
                  slot_rows.scalar_type() == at::kLong && slot_rows.is_contiguous(),
              "slot_rows must be a contiguous int64 [rows] vector");
  const auto& keys = in.attention.keys;
  const auto row_positions = positions.accessor<int64_t, 2>();
  in.position.resize(in.rows);
  for (int64_t r = 0; r < in.rows; ++r) {
    in.position[r] = row_positions[r][0];
    in.longest = std::max(in.longest, in.position[r] + 1);
  }
  TORCH_CHECK(in.longest <= keys.size(3), "a position is past the cache's allocated slots");
  in.slot_row = slot_rows.data_ptr<int64_t>();
  std::vector<char> seen(keys.size(1), 0);
  for (int64_t r = 0; r < in.rows; ++r) {
    const int64_t slot_row = in.slot_row[r];
    TORCH_CHECK(slot_row >= 0 && slot_row < keys.size(1), "slot row ", slot_row,
                " is outside the cache's ", keys.size(1), " rows");
    const bool continues = r > 0 && in.slot_row[r - 1] == slot_row;
    TORCH_CHECK(continues ? in.position[r - 1] < in.position[r] : !seen[slot_row],
                "the rows of one cache row must be consecutive, in position order");
    seen[slot_row] = 1;
    in.prompt_rows = in.prompt_rows || continues;
  }
}

// The residual stream's first value: each row's embedding plus its position vector ([rows, d],
// or empty: none).
at::Tensor embed(const StepInputs& in, const at::Tensor& tokens, const at::Tensor& embedding,
                 const at::Tensor& position_vectors) {
  const int64_t d = in.arch().d;
  TORCH_CHECK(!position_vectors.numel() ||
                  (position_vectors.sizes() == at::IntArrayRef{in.rows, d} &&
                   position_vectors.is_contiguous() && position_vectors.scalar_type() == at::kFloat),
              "position_vectors must be a contiguous float32 [rows, d] matrix");
  auto x = at::empty({in.rows, d}, embedding.options());
  const auto token = tokens.accessor<int64_t, 2>();
  for (int64_t r = 0; r < in.rows; ++r) {
    TORCH_CHECK_INDEX(token[r][0] >= 0 && token[r][0] < embedding.size(0), "token ", token[r][0],
                      " is outside the embedding's ", embedding.size(0), " rows");
    const float* from = embedding.data_ptr<float>() + token[r][0] * embedding.stride(0);
    float* to = x.data_ptr<float>() + r * d;
    for (int64_t i = 0; i < d; ++i) to[i] = from[i * embedding.stride(1)];
    if (position_vectors.numel()) {
      const float* vector = position_vectors.data_ptr<float>() + r * d;
      for (int64_t i = 0; i < d; ++i) to[i] += vector[i];
    }
  }
  return x;
}

// tokens [rows, 1] int64: each row's new token; slot_rows [rows] int64: each row's cache row;
// positions [rows, 1] int64: where its key goes and the last slot it sees.
// cache: the keys and values [layers, cache rows, Hkv, length, hd] and FoX's log gates [layers,
// cache rows, H, length] (else empty). embedding [vocab', d] float32 (any strides).
// signal: the scheme's position vectors [rows, d] (added to the embeddings), cos and sin
// [rows, rot] (rotation) and score bias [rows, H, length], each empty where it has none.
// blocks: 12 tensors per block (decode_step.py's step_tensors; an absent bias is empty); head:
// the final norm's weight and bias, the logits' packed weight and bias. own: FoX's gate weights
// [layers, H, d] and biases [layers, H], CoPE's table [layers, n, hd] (else empty).
// architecture: vocab, heads, kv_heads, norm, mlp, scheme (the enums above); eps: the norms'.
// logit_rows [k] int64: the rows whose logits are wanted (none: every row; a prompt needs only
// its last token's). → logits [k, vocab].
at::Tensor decode_step(const at::Tensor& tokens, const at::Tensor& slot_rows,
                       const at::Tensor& positions, at::TensorList cache,
                       const at::Tensor& embedding, at::TensorList signal, at::TensorList blocks,
                       at::TensorList head, at::TensorList own, at::IntArrayRef architecture,
                       double eps, const c10::optional<at::Tensor>& logit_rows) {
  TORCH_CHECK(cache.size() == 3 && signal.size() == 4 && head.size() == 4 && own.size() == 3 &&
                  architecture.size() == 6,
              "cache: keys, values, states; signal: vectors, cos, sin, bias; head: norm weight "
              "and bias, logits weight and bias; own: gate weight and bias, table; architecture: "
              "vocab, heads, kv_heads, norm, mlp, scheme");
  TORCH_CHECK(embedding.dim() == 2 && embedding.scalar_type() == at::kFloat,
              "the embedding must be a float32 [vocab, d] matrix");
  TORCH_CHECK(blocks.size() % kTensorsPerBlock == 0, "blocks: 12 tensors per block");
  const at::Tensor &keys = cache[0], &values = cache[1];
  TORCH_CHECK(keys.dim() == 5 && keys.stride(4) == 1 && values.stride(4) == 1,
              "the cache's keys and values must be [layers, rows, Hkv, length, hd], hd contiguous");
  StepInputs in;
  in.attention.arch = {architecture[0], architecture[1], architecture[2], keys.size(4),
                       embedding.size(1), architecture[3], architecture[4], architecture[5],
                       static_cast<float>(eps)};
  in.attention.keys = keys;
  in.attention.values = values;
  in.attention.bias = signal[3];
  in.attention.signal = {architecture[5], own[0], own[1], cache[2], own[2]};
  TORCH_CHECK(in.attention.signal.scheme != kForgetting ||
                  (cache[2].dim() == 4 && cache[2].size(1) == keys.size(1)),
              "FoX needs the cache's key states");
  read_rows(in, tokens, slot_rows, positions);
  TORCH_CHECK(in.attention.signal.scheme != kForgetting || cache[2].size(3) >= in.longest,
              "FoX needs the cache's key states");
  if (signal[1].numel()) {
    in.cos = signal[1].data_ptr<float>();
    in.sin = signal[2].data_ptr<float>();
    in.rot = signal[1].size(1);
    in.rotation_stride = signal[1].stride(0);
  }
  for (size_t b = 0; b < blocks.size(); b += kTensorsPerBlock) {
    const at::Tensor* t = blocks.data() + b;
    in.blocks.push_back({norm_of(t[0], t[1]), projection_of(t[2], t[3]), projection_of(t[4], t[5]),
                         norm_of(t[6], t[7]), projection_of(t[8], t[9]), projection_of(t[10], t[11])});
  }
  in.final_norm = norm_of(head[0], head[1]);
  in.logits = projection_of(head[2], head[3]);
  const int64_t* pick = nullptr;
  int64_t wanted = in.rows;
  if (logit_rows) {
    TORCH_CHECK(logit_rows->dim() == 1 && logit_rows->scalar_type() == at::kLong &&
                    logit_rows->is_contiguous(),
                "logit_rows must be a contiguous int64 vector");
    pick = logit_rows->data_ptr<int64_t>();
    wanted = logit_rows->size(0);
    for (int64_t i = 0; i < wanted; ++i)
      TORCH_CHECK(pick[i] >= 0 && pick[i] < in.rows, "logit row ", pick[i], " is not a row");
  }
  return run_step(in, embed(in, tokens, embedding, signal[0]), pick, wanted);
}

// FIRE's score bias for one token per row (model/positional/fire.py): for the query at position
// p and each key t ≤ p, f(ψ(p − t) / ψ(max(L, p))) with ψ(x) = log(|c|·x + 1) and f a one-input
// ReLU MLP with an output per head. in_weight/in_bias [hidden], out_weight [H, hidden],
// out_bias [H] (contiguous); keys past p get 0 (they are masked). → [rows, H, key_length].
at::Tensor fire_bias(const at::Tensor& positions, int64_t key_length, const at::Tensor& in_weight,
                     const at::Tensor& in_bias, const at::Tensor& out_weight,
                     const at::Tensor& out_bias, double c, double threshold, bool log_transform,
                     bool normalise) {
  const int64_t rows = positions.size(0), hidden = in_weight.numel(), heads = out_bias.numel();
  const auto position = positions.accessor<int64_t, 1>();
  auto bias = at::zeros({rows, heads, key_length});
  const float* w1 = in_weight.data_ptr<float>();
  const float* b1 = in_bias.data_ptr<float>();
  const float* w2 = out_weight.data_ptr<float>();
  const float* b2 = out_bias.data_ptr<float>();
  const auto psi = [&](float x) {
    return log_transform ? std::log(static_cast<float>(c) * x + 1.0f) : x;
  };
  std::vector<float> units(hidden);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t p = position[r];
    const float divisor =
        normalise ? psi(std::max(static_cast<float>(p), static_cast<float>(threshold))) + 1e-6f
                  : 1.0f;
    float* out = bias.data_ptr<float>() + r * heads * key_length;
    for (int64_t t = 0; t <= std::min(p, key_length - 1); ++t) {
      const float x = psi(static_cast<float>(p - t)) / divisor;
      for (int64_t j = 0; j < hidden; ++j) units[j] = std::max(0.0f, w1[j] * x + b1[j]);
      for (int64_t h = 0; h < heads; ++h)
        out[h * key_length + t] = simd::dot(w2 + h * hidden, units.data(), hidden) + b2[h];
    }
  }
  return bias;
}

void share_large_steps(bool on, int64_t order) {
  TORCH_CHECK(order >= SharedWork::kFree && order <= SharedWork::kHelperStalls,
              "order must be 0 (free), 1 (the helper finishes) or 2 (the helper stalls)");
  g_order.store(static_cast<int>(order));
  g_sharing.store(on);
}

bool shares_large_steps() { return g_sharing.load(); }

std::vector<int64_t> shared_rows() { return {g_helped.load(), g_taken.load()}; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ORDINAL_OPS, m) {
  m.def(
      "decode_step(Tensor tokens, Tensor slot_rows, Tensor positions, Tensor[] cache, "
      "Tensor embedding, Tensor[] signal, Tensor[] blocks, Tensor[] head, Tensor[] own, "
      "int[] architecture, float eps, Tensor? logit_rows) -> Tensor",
      &decode_step);
  m.def(
      "fire_bias(Tensor positions, int key_length, Tensor in_weight, Tensor in_bias, "
      "Tensor out_weight, Tensor out_bias, float c, float threshold, bool log_transform, "
      "bool normalise) -> Tensor",
      &fire_bias);
  // Whether a step of 8 rows or more on one torch thread shares its attention with the helper
  // thread, and in which order the threads meet (0: freely; 1, 2: the tests').
  m.def("share_large_steps(bool on, int order) -> ()", &share_large_steps);
  m.def("shares_large_steps() -> bool", &shares_large_steps);
  // Rows of shared attention so far: supplied by the helper, taken back from it.
  m.def("shared_rows() -> int[]", &shared_rows);
}
