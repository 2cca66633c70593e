// A whole decode step — one new token per row, from its id to its logits — in one call
// (model/kernels/decode_step.py says when it runs and why).
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
// a fixed order.
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <sched.h>

#include "linear_core.h"

#if defined(LINEAR_CORE_VECTORISED)

namespace {

enum Norm : int64_t { kLayerNorm = 0, kRMSNorm = 1 };
enum Mlp : int64_t { kGelu = 0, kGeluTanh = 1, kRelu2 = 2, kSwiGLU = 3 };
constexpr int kTensorsPerBlock = 12;  // see decode_step.py's step_tensors()
// Fewer activations than this stay on one thread: a parallel region costs a few microseconds.
constexpr int64_t kSerialActivations = 16384;
// From this many rows, on several threads, each thread takes its share of the rows through all
// the blocks (decode_step).
constexpr int64_t kSplitRows = 8;
// From this many rows a step shared with the helper goes in two groups (through_blocks_shared).
constexpr int64_t kTwoGroups = 16;

const float* data_or_null(const torch::Tensor& t) {
  return t.numel() ? t.data_ptr<float>() : nullptr;
}

void normalise(const float* x, float* y, int64_t d, const float* weight, const float* bias,
               int64_t norm, float eps) {
  float mean = 0.0f;
  if (norm == kLayerNorm) {
    for (int64_t i = 0; i < d; ++i) mean += x[i];
    mean /= static_cast<float>(d);
  }
  float square = 0.0f;
  for (int64_t i = 0; i < d; ++i) square += (x[i] - mean) * (x[i] - mean);
  const float scale = 1.0f / std::sqrt(square / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) {
    y[i] = (x[i] - mean) * scale * weight[i] + (bias ? bias[i] : 0.0f);
  }
}

// head_attention for any head dimension, one float at a time.
void scalar_head_attention(const float* q, const float* keys, int64_t key_stride,
                           const float* values, int64_t value_stride, int64_t n, int64_t hd,
                           float scale, const float* bias, int64_t bias_stride,
                           const float* /*next_keys*/, float* scores, float* out) {
  float largest = -INFINITY;
  for (int64_t t = 0; t < n; ++t) {
    float dot = 0.0f;
    for (int64_t i = 0; i < hd; ++i) dot += q[i] * keys[t * key_stride + i];
    scores[t] = dot * scale + (bias ? bias[t * bias_stride] : 0.0f);
    largest = std::max(largest, scores[t]);
  }
  float total = 0.0f;
  for (int64_t t = 0; t < n; ++t) {
    scores[t] = std::exp(scores[t] - largest);
    total += scores[t];
  }
  std::fill_n(out, hd, 0.0f);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < hd; ++i) out[i] += scores[t] * values[t * value_stride + i];
  for (int64_t i = 0; i < hd; ++i) out[i] /= total;
}

// A cache line on its way into L2 while other work runs.
void prefetch(const float* line) {
  _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T1);
}

// One head's attention of query q [hd] over n keys and values (rows `*_stride` floats apart)
// with the score bias (null: none), into out [hd]; scores: room for n floats. The head dimension
// is V registers (hd = 16·V): the query and the output stay in registers across all the keys.
//
// At batch 32 and more the cache comes from memory, and one stream at a time left most of the
// bandwidth unused: the key pass asks for the values it will need next, and the value pass for
// the next head's keys (next_keys; null: none to fetch), each key's lines at its turn. The
// blocks then took 0.70-0.78× the time at batch 64 (shipped, one thread) and 0.91× at batch 32
// (4L-256d, two threads); docs/performance.md, sixth round.
template <int V>
void head_attention(const float* q, const float* keys, int64_t key_stride, const float* values,
                    int64_t value_stride, int64_t n, int64_t /*hd*/, float scale,
                    const float* bias, int64_t bias_stride, const float* next_keys,
                    float* scores, float* out) {
  __m512 query[V], acc[V];
  for (int v = 0; v < V; ++v) query[v] = _mm512_loadu_ps(q + 16 * v);
  float largest = -INFINITY;
  for (int64_t t = 0; t < n; ++t) {
    const float* k = keys + t * key_stride;
    for (int v = 0; v < V; ++v) prefetch(values + t * value_stride + 16 * v);
    __m512 sum = _mm512_mul_ps(query[0], _mm512_loadu_ps(k));
    for (int v = 1; v < V; ++v) sum = _mm512_fmadd_ps(query[v], _mm512_loadu_ps(k + 16 * v), sum);
    float score = _mm512_reduce_add_ps(sum) * scale;
    if (bias) score += bias[t * bias_stride];
    scores[t] = score;
    largest = std::max(largest, score);
  }
  float total = 0.0f;
  for (int64_t t = 0; t < n; ++t) {
    scores[t] = std::exp(scores[t] - largest);
    total += scores[t];
  }
  for (int v = 0; v < V; ++v) acc[v] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const __m512 weight = _mm512_set1_ps(scores[t]);
    const float* value = values + t * value_stride;
    if (next_keys)
      for (int v = 0; v < V; ++v) prefetch(next_keys + t * key_stride + 16 * v);
    for (int v = 0; v < V; ++v)
      acc[v] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(value + 16 * v), acc[v]);
  }
  const __m512 inverse = _mm512_set1_ps(1.0f / total);
  for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + 16 * v, _mm512_mul_ps(acc[v], inverse));
}

using HeadAttention = void (*)(const float*, const float*, int64_t, const float*, int64_t, int64_t,
                               int64_t, float, const float*, int64_t, const float*, float*, float*);

HeadAttention head_attention_for(int64_t hd) {
  switch (hd) {
    case 16: return head_attention<1>;
    case 32: return head_attention<2>;
    case 64: return head_attention<4>;
    case 128: return head_attention<8>;
    default: return scalar_head_attention;
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

// The MLP's activation over n floats in place, one plain loop per form so that the compiler
// vectorises each (with -ffast-math, glibc's vector tanhf/erff/expf).
void activate(float* h, int64_t n, int64_t mlp) {
  switch (mlp) {
    case kGelu:
      for (int64_t i = 0; i < n; ++i) h[i] = 0.5f * h[i] * (1.0f + std::erf(h[i] * 0.70710678f));
      break;
    case kGeluTanh:
      for (int64_t i = 0; i < n; ++i) {
        const float u = h[i];
        h[i] = 0.5f * u * (1.0f + std::tanh(0.79788456f * (u + 0.044715f * u * u * u)));
      }
      break;
    default:  // kRelu2
      for (int64_t i = 0; i < n; ++i) h[i] = h[i] > 0.0f ? h[i] * h[i] : 0.0f;
  }
}

struct Shapes {
  int64_t rows, d, heads, kv_heads, head_dim;
};

// The schemes whose bias comes from each layer's own tensors (model/positional/fox.py, cope.py).
enum Scheme : int64_t { kPlain = 0, kForgetting = 1, kContextual = 2 };

struct LayerSignal {
  int64_t scheme;
  torch::Tensor gate_weight, gate_bias;  // FoX: [layers, H, d], [layers, H]
  torch::Tensor states;                  // FoX: the cache's log gates [layers, rows, H, length]
  torch::Tensor table;                   // CoPE: position embeddings [layers, n, hd]
};

float plain_dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  float sum = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

float log_sigmoid(float x) { return std::min(x, 0.0f) - std::log1p(std::exp(-std::fabs(x))); }

// FoX: each head's log forget gate of this row's new token, kept in the cache beside its key.
void store_log_gates(const LayerSignal& signal, int64_t layer, int64_t row, int64_t position,
                     const float* hidden, int64_t heads, int64_t d) {
  const auto& w = signal.gate_weight;
  const auto& st = signal.states;
  for (int64_t h = 0; h < heads; ++h) {
    const float* weight = w.data_ptr<float>() + layer * w.stride(0) + h * w.stride(1);
    const float gate = plain_dot(weight, hidden, d) +
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
  for (int64_t k = 0; k < rows; ++k) at_rows[k] = plain_dot(q, embeddings + k * table.stride(1), hd);
  double running = 0.0;
  for (int64_t t = n - 1; t >= 0; --t) {
    const float gate = 1.0f / (1.0f + std::exp(-plain_dot(q, keys + t * key_stride, hd) * scale));
    running += gate;
    const float p = std::min(static_cast<float>(running), static_cast<float>(rows - 1));
    const float below = std::floor(p), weight = p - below;
    const int64_t low = static_cast<int64_t>(below), high = static_cast<int64_t>(std::ceil(p));
    bias[t] = at_rows[high] * weight + at_rows[low] * (1.0f - weight);
  }
}

// One row's new key and value in one block: its queries and keys in `qkv` [(H + 2·Hkv)·hd]
// rotated in place, then its key and value written into the cache's slot `position` (keys and
// values: this block's [layers, rows, Hkv, length, hd], hd contiguous).
void store_row(const Shapes& s, float* qkv, const torch::Tensor& keys,
               const torch::Tensor& values, int64_t layer, int64_t row, int64_t position,
               const float* cos, const float* sin, int64_t rot) {
  const int64_t hd = s.head_dim;
  const float* new_keys = qkv + s.heads * hd;
  const float* new_values = qkv + (s.heads + s.kv_heads) * hd;
  if (rot) {
    for (int64_t h = 0; h < s.heads + s.kv_heads; ++h) rotate(qkv + h * hd, cos, sin, rot);
  }
  const auto ks = keys.strides(), vs = values.strides();
  float* key_base = keys.data_ptr<float>() + layer * ks[0] + row * ks[1];
  float* value_base = values.data_ptr<float>() + layer * vs[0] + row * vs[1];
  for (int64_t g = 0; g < s.kv_heads; ++g) {
    std::copy_n(new_keys + g * hd, hd, key_base + g * ks[2] + position * ks[3]);
    std::copy_n(new_values + g * hd, hd, value_base + g * vs[2] + position * vs[3]);
  }
}

// The floats attend_head's own_bias needs for `longest` keys: fox's bias, or cope's and its
// q·e products, one per table row.
int64_t own_bias_room(const LayerSignal& signal, int64_t longest) {
  return longest + (signal.scheme == kContextual ? signal.table.size(1) : 0);
}

// Head h's attention for one row in one block, after store_row: its query in `qkv`, over
// cache row `slot_row`'s slots 0..position, into out [hd]; `row` is its place in the batch (its
// row of `bias`). scores: room for position + 1 floats; own_bias: room for fox's or cope's bias.
// next_slot_row: the cache row whose first head attends right after this row's last (its keys
// are fetched meanwhile; −1: none).
void attend_head(const Shapes& s, const float* qkv, const torch::Tensor& keys,
                 const torch::Tensor& values, int64_t layer, int64_t row, int64_t slot_row,
                 int64_t position, int64_t h, const torch::Tensor& bias, const LayerSignal& signal,
                 float* scores, float* own_bias, float* out, int64_t next_slot_row) {
  const int64_t hd = s.head_dim, group = s.heads / s.kv_heads, g = h / group;
  const auto ks = keys.strides(), vs = values.strides();
  const float* layer_keys = keys.data_ptr<float>() + layer * ks[0];
  const float* key_base = layer_keys + slot_row * ks[1];
  const float* head_keys = key_base + g * ks[2];
  const float* head_values =
      values.data_ptr<float>() + layer * vs[0] + slot_row * vs[1] + g * vs[2];
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float* head_bias =
      bias.numel() ? bias.data_ptr<float>() + row * bias.stride(0) + h * bias.stride(1) : nullptr;
  int64_t bias_stride = head_bias ? bias.stride(2) : 0;
  const float* q = qkv + h * hd;
  const int64_t n = position + 1;
  if (signal.scheme != kPlain) {
    layer_bias(signal, layer, slot_row, h, q, head_keys, ks[3], n, hd, scale, own_bias);
    head_bias = own_bias;
    bias_stride = 1;
  }
  const int64_t next_group = (h + 1) / group;  // the next head's keys, if they are others
  const float* next_keys =
      h + 1 < s.heads && next_group != g ? key_base + next_group * ks[2] : nullptr;
  if (h + 1 == s.heads && next_slot_row >= 0) next_keys = layer_keys + next_slot_row * ks[1];
  head_attention_for(hd)(q, head_keys, ks[3], head_values, vs[3], n, hd, scale, head_bias,
                         bias_stride, next_keys, scores, out);
}

// A large step's attention shared with a helper thread.
//
// One engine thread decodes; on a two-core machine the other core runs the HTTP side and the
// clients, and has time to spare. torch's threads split work statically and wait for the
// slowest, so a thread that has lost its core to another process holds up the whole step (the
// server got nothing from `--threads 2`: docs/performance.md, seventh round). The helper is one
// thread that takes rows of each block's attention from the same counter as the decode thread,
// which never waits for it: a row the helper has taken and not finished when the decode thread
// runs out of rows, the decode thread computes itself. The same code on the same inputs gives
// the same bits on either thread, so no number depends on who computed it.
//
// Only the attention: at 32 rows it streams each row's whole cache from L3 (21 MB a step at the
// bench's lengths), and one core draws ~26 GB/s from there, two ~50. The projections multiply on
// the tile unit, which the two cores of this project's host do not run any faster together
// (torch's bfloat16 GEMM: 1.2 TFLOP/s on one thread and on two); shared in a trial, they gained
// nothing. So from 16 rows the batch goes in two groups, staggered through the blocks, and the
// helper attends one group while this thread projects the other (decode_step's
// through_blocks_shared). Shipped rope, 32 rows, one torch thread: the step's C++ took
// 1.37-1.47 ms alone, 1.03-1.06 sharing one group's attention, 0.95-0.98 two groups', and
// 0.875-0.891 staggered (docs/performance.md, eleventh round).
//
// A piece of work owns (or holds a reference to) everything the helper reads, so a helper still
// busy with a piece of finished work reads live memory; its result is dropped.
class SharedWork {
 public:
  enum State : int { kOpen = 0, kHelperDone = 1, kTaken = 2 };
  // How the two threads meet: freely (serving), or, for the tests, in an order that takes one
  // path for sure — the helper takes the first piece and finishes it while the decode thread
  // waits, or takes it and stalls 5 ms while the decode thread computes it itself.
  enum Order : int { kFree = 0, kHelperFinishes = 1, kHelperStalls = 2 };
  struct Outcome {
    int64_t helped = 0;  // pieces the helper's results supplied
    int64_t taken = 0;   // pieces the helper took and the decode thread computed
  };

  virtual ~SharedWork() = default;
  int64_t pieces() const { return pieces_; }
  bool exhausted() const { return next_.load(std::memory_order_relaxed) >= pieces_; }

  // Ready for `pieces` pieces (work objects are reused, step after step).
  void reset(int64_t pieces) {
    pieces_ = pieces;
    next_.store(0, std::memory_order_relaxed);
    if (static_cast<int64_t>(states_.size()) < pieces) states_ = std::vector<Slot>(pieces);
    for (int64_t i = 0; i < pieces; ++i) states_[i].state.store(kOpen, std::memory_order_relaxed);
  }

  // The helper's turn: pieces into its own buffer until none is left.
  void help(Order order) {
    prepare_helper();
    for (int64_t i; (i = next_.fetch_add(1)) < pieces_;) {
      if (order == kHelperStalls) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      try {
        compute(i, true);
      } catch (...) {  // the piece stays open: the decode thread computes it, and raises there
        return;
      }
      int open = kOpen;
      states_[i].state.compare_exchange_strong(open, kHelperDone, std::memory_order_release,
                                               std::memory_order_relaxed);
    }
  }

  // The decode thread's turn: pieces into place until none is left; then each piece the helper
  // took, its result copied into place if it is done, else computed here.
  Outcome run(Order order) {
    if (order != kFree) wait_for([this] { return next_.load() > 0; });  // the helper's first
    mine_.assign(pieces_, 0);
    for (int64_t i; (i = next_.fetch_add(1)) < pieces_;) {
      compute(i, false);
      mine_[i] = 1;
    }
    Outcome outcome;
    for (int64_t i = 0; i < pieces_; ++i) {
      if (mine_[i]) continue;
      if (order == kHelperFinishes) wait_for([&] { return states_[i].state.load() != kOpen; });
      int open = kOpen;
      if (states_[i].state.compare_exchange_strong(open, kTaken, std::memory_order_acquire)) {
        compute(i, false);  // the helper has not finished it, and will not be asked for it
        ++outcome.taken;
      } else {
        publish(i);  // kHelperDone: its buffer holds the piece
        ++outcome.helped;
      }
    }
    return outcome;
  }

 protected:
  // Piece i into its place (by_helper false) or into the helper's own buffer.
  virtual void compute(int64_t i, bool by_helper) = 0;
  // The helper's result for piece i copied into place.
  virtual void publish(int64_t i) = 0;
  // Called on the helper before its first piece of this work.
  virtual void prepare_helper() {}

  // The tests' orders: spin until `done` (at most a second: a helper that never comes must not
  // hang them; they then fail on the outcome).
  template <typename Done>
  static void wait_for(Done done) {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (!done() && std::chrono::steady_clock::now() < give_up) _mm_pause();
  }

 private:
  struct alignas(64) Slot {  // one cache line each: the two threads write neighbours
    std::atomic<int> state{kOpen};
  };
  int64_t pieces_ = 0;
  std::atomic<int64_t> next_{0};
  std::vector<Slot> states_;
  std::vector<char> mine_;
};

// One block's attention for every row: a piece is a row's heads.
class SharedAttention : public SharedWork {
 public:
  void prepare(const Shapes& s, int64_t layer, int64_t first, int64_t rows, int64_t longest,
               const float* qkv, int64_t qkv_width, const int64_t* positions,
               const int64_t* slot_rows,
               const torch::Tensor& keys, const torch::Tensor& values, const torch::Tensor& bias,
               const LayerSignal& signal, float* out) {
    s_ = s;
    layer_ = layer;
    first_ = first;
    longest_ = longest;
    const int64_t width = s.heads * s.head_dim;
    queries_.resize(rows * width);  // a copy: the decode thread rewrites qkv next block
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(qkv + r * qkv_width, width, queries_.data() + r * width);
    positions_.assign(positions, positions + rows);
    slot_rows_.assign(slot_rows, slot_rows + rows);
    keys_ = keys;
    values_ = values;
    bias_ = bias;
    signal_ = signal;
    out_ = out;
    helper_out_.resize(rows * width);
    scores_.resize(longest);
    own_bias_.resize(own_bias_room(signal, longest));
    reset(rows);
  }

 protected:
  void prepare_helper() override {
    helper_scores_.resize(longest_);
    helper_own_bias_.resize(own_bias_room(signal_, longest_));
  }

  void compute(int64_t r, bool by_helper) override {
    const int64_t width = s_.heads * s_.head_dim;
    float* out = (by_helper ? helper_out_.data() : out_) + r * width;
    auto& scores = by_helper ? helper_scores_ : scores_;
    auto& own_bias = by_helper ? helper_own_bias_ : own_bias_;
    const int64_t next_slot_row = r + 1 < pieces() ? slot_rows_[r + 1] : -1;
    for (int64_t h = 0; h < s_.heads; ++h)
      attend_head(s_, queries_.data() + r * width, keys_, values_, layer_, first_ + r,
                  slot_rows_[r], positions_[r], h, bias_, signal_, scores.data(),
                  own_bias.data(), out + h * s_.head_dim, next_slot_row);
  }

  void publish(int64_t r) override {
    const int64_t width = s_.heads * s_.head_dim;
    std::copy_n(helper_out_.data() + r * width, width, out_ + r * width);
  }

 public:
  // The step's tensors let go (the work is idle: no thread reads them).
  void release() {
    keys_ = values_ = bias_ = torch::Tensor();
    signal_ = LayerSignal{};
    out_ = nullptr;
  }

 private:
  Shapes s_{};
  int64_t layer_ = 0, first_ = 0, longest_ = 0;
  std::vector<float> queries_;  // [rows, H·hd]: attend_head reads head h's at h·hd
  std::vector<int64_t> positions_, slot_rows_;
  torch::Tensor keys_, values_, bias_;
  LayerSignal signal_;
  float* out_ = nullptr;  // [rows, H·hd], the decode thread's
  std::vector<float> helper_out_, scores_, own_bias_, helper_scores_, helper_own_bias_;
};

// The work objects of every step, each reused once no thread holds it but the pool. Idle work
// lets go of the tensors it read (release_idle): the cache above all, which the engine shrinks
// or drops when idle (a 64-row cache is ~130 MB), and a work kept whole would keep it alive.
// Only a thread holding the GIL may let go of them (a tensor made in Python drops its Python
// object with it): the decode thread releases as each step starts and as a shared step ends,
// skipping a work the helper has not yet put down, and never the helper (it deadlocked).
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

// The helper thread: it sleeps until a step with shared work begins, then waits awake (a wake-up
// takes ~60 µs on this project's host, a block's attention at 32 rows ~200) for each piece of
// work the step posts, until the step ends.
class Helper {
 public:
  static Helper& instance() {
    static Helper* helper = new Helper();  // never destroyed: its thread sleeps until the
    return *helper;                        // process ends
  }

  void begin_step() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      awake_.store(true, std::memory_order_relaxed);
    }
    wake_.notify_one();
  }

  void end_step() {
    std::lock_guard<std::mutex> lock(mutex_);
    awake_.store(false, std::memory_order_relaxed);
    posted_work_.clear();  // anything a step that raised did not take back
  }

  // `work` may run on the helper from now until take_back; works are helped in posting order.
  void post(const std::shared_ptr<SharedWork>& work, SharedWork::Order order) {
    std::lock_guard<std::mutex> lock(mutex_);
    posted_work_.push_back(work);
    order_ = order;
    posted_.fetch_add(1, std::memory_order_release);
  }

  // `work` run to its end on the calling thread (with the helper until it runs out of pieces),
  // then out of the helper's reach.
  SharedWork::Outcome take_back(const std::shared_ptr<SharedWork>& work,
                                SharedWork::Order order) {
    const SharedWork::Outcome outcome = work->run(order);
    std::lock_guard<std::mutex> lock(mutex_);
    posted_work_.erase(std::remove(posted_work_.begin(), posted_work_.end(), work),
                       posted_work_.end());
    return outcome;
  }

 private:
  Helper() { std::thread([this] { serve(); }).detach(); }

  // The first posted work with pieces left (null: none), and the order the threads meet in.
  std::pair<std::shared_ptr<SharedWork>, SharedWork::Order> next_work() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& work : posted_work_)
      if (!work->exhausted()) return {work, order_};
    return {nullptr, order_};
  }

  void serve() {
    int64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [this] { return awake_.load(std::memory_order_relaxed); });
      }
      for (int spins = 0;; ++spins) {
        if (posted_.load(std::memory_order_acquire) != seen) {
          seen = posted_.load(std::memory_order_relaxed);
          // Every posted work with pieces left, in order (a reference holds each one's memory
          // while it runs here).
          for (auto [work, order] = next_work(); work; std::tie(work, order) = next_work())
            work->help(order);
          spins = 0;
          continue;
        }
        if (!awake_.load(std::memory_order_relaxed)) break;
        // Now and then the core to any other thread that wants it (never holding the lock:
        // the decode thread would wait for it).
        if (spins % 64 == 63) sched_yield();
        _mm_pause();
      }
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::shared_ptr<SharedWork>> posted_work_;  // posted, not yet taken back
  SharedWork::Order order_ = SharedWork::kFree;
  std::atomic<int64_t> posted_{0};
  std::atomic<bool> awake_{false};
};

// The helper awake for this object's lifetime, when `wanted` (a step that throws ends too).
class Awake {
 public:
  explicit Awake(bool wanted) : wanted_(wanted) {
    if (wanted_) Helper::instance().begin_step();
  }
  ~Awake() {
    if (wanted_) Helper::instance().end_step();
  }
  Awake(const Awake&) = delete;
  Awake& operator=(const Awake&) = delete;

 private:
  bool wanted_;
};

std::atomic<bool> g_sharing{false};  // whether large steps share their attention
std::atomic<int> g_order{SharedWork::kFree};
std::atomic<int64_t> g_helped{0}, g_taken{0};  // SharedWork::Outcome's, summed over the process

}  // namespace

constexpr bool kVectorised = true;

// tokens [rows, 1] int64: each row's new token; embedding [vocab', d] float32 (any strides);
// position_vectors [rows, d] (empty: none), added to the embeddings. blocks: kTensorsPerBlock
// tensors per block (an absent bias is an empty tensor); head: the final norm's weight and bias
// and the logits projection's packed weight and bias, 4 tensors; vocab: its outputs.
// keys/values: the cache's [layers, cache rows, Hkv, length, hd]; slot_rows [rows]
// int64, the cache row of each row's token, and positions [rows, 1] int64, where it goes and the
// last slot it sees. Several rows may write one cache row (the tokens of a prompt, prefilled
// here with the decoding rows): they must be consecutive rows, in position order, and each
// attends the slots the ones before it wrote in the same block. cos/sin [rows, rot] (empty: no
// rotation); bias [rows, H, length] (empty: none); states: FoX's [layers, cache rows, H,
// length]. logit_rows [k] int64: the rows whose logits are wanted (none: every row; a prompt
// needs only its last token's). → logits [k, vocab].
torch::Tensor decode_step(const torch::Tensor& tokens, const torch::Tensor& embedding,
                          const torch::Tensor& position_vectors,
                          const std::vector<torch::Tensor>& blocks,
                          const std::vector<torch::Tensor>& head, int64_t vocab,
                          const torch::Tensor& keys, const torch::Tensor& values,
                          const torch::Tensor& slot_rows, const torch::Tensor& positions,
                          const torch::Tensor& cos, const torch::Tensor& sin,
                          const torch::Tensor& bias, int64_t heads, int64_t kv_heads,
                          int64_t norm, double eps, int64_t mlp, int64_t scheme,
                          const torch::Tensor& gate_weight, const torch::Tensor& gate_bias,
                          const torch::Tensor& states, const torch::Tensor& table,
                          const c10::optional<torch::Tensor>& logit_rows) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(1) == 1 && tokens.scalar_type() == at::kLong,
              "tokens must be an int64 [rows, 1] matrix");
  TORCH_CHECK(positions.dim() == 2 && positions.size(0) == tokens.size(0) &&
                  positions.size(1) == 1 && positions.scalar_type() == at::kLong,
              "positions must be an int64 [rows, 1] matrix");
  TORCH_CHECK(embedding.dim() == 2 && embedding.scalar_type() == at::kFloat,
              "the embedding must be a float32 [vocab, d] matrix");
  TORCH_CHECK(head.size() == 4,
              "head: the final norm's weight and bias, the logits' weight and bias");
  TORCH_CHECK(blocks.size() % kTensorsPerBlock == 0, "blocks: 12 tensors per block");
  TORCH_CHECK(keys.dim() == 5 && keys.stride(4) == 1 && values.stride(4) == 1,
              "the cache's keys and values must be [layers, rows, Hkv, length, hd], hd contiguous");
  TORCH_CHECK(slot_rows.dim() == 1 && slot_rows.size(0) == tokens.size(0) &&
                  slot_rows.scalar_type() == at::kLong && slot_rows.is_contiguous(),
              "slot_rows must be a contiguous int64 [rows] vector");
  const int64_t n_blocks = static_cast<int64_t>(blocks.size()) / kTensorsPerBlock;
  const int64_t rows = tokens.size(0), d = embedding.size(1), hd = keys.size(4);
  TORCH_CHECK(!position_vectors.numel() ||
                  (position_vectors.sizes() == at::IntArrayRef{rows, d} &&
                   position_vectors.is_contiguous() &&
                   position_vectors.scalar_type() == at::kFloat),
              "position_vectors must be a contiguous float32 [rows, d] matrix");
  const Shapes s{rows, d, heads, kv_heads, hd};
  work_pool().release_idle();  // what the last shared step's helper still held as it ended
  const int64_t qkv_width = (heads + 2 * kv_heads) * hd;
  const int64_t rot = cos.numel() ? cos.size(1) : 0;
  const auto row_positions = positions.accessor<int64_t, 2>();
  std::vector<int64_t> position(rows);
  for (int64_t r = 0; r < rows; ++r) position[r] = row_positions[r][0];
  int64_t longest = 0;
  for (int64_t r = 0; r < rows; ++r) longest = std::max(longest, position[r] + 1);
  TORCH_CHECK(longest <= keys.size(3), "a position is past the cache's allocated slots");
  const int64_t* slot_row = slot_rows.data_ptr<int64_t>();
  // Whether some cache row takes several tokens (then no thread may take a row through the
  // blocks alone: its later tokens attend what the earlier ones stored in each block).
  bool prompt_rows = false;
  std::vector<char> seen(keys.size(1), 0);
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(slot_row[r] >= 0 && slot_row[r] < keys.size(1), "slot row ", slot_row[r],
                " is outside the cache's ", keys.size(1), " rows");
    const bool continues = r > 0 && slot_row[r - 1] == slot_row[r];
    TORCH_CHECK(continues ? position[r - 1] < position[r] : !seen[slot_row[r]],
                "the rows of one cache row must be consecutive, in position order");
    seen[slot_row[r]] = 1;
    prompt_rows = prompt_rows || continues;
  }
  if (logit_rows) {
    TORCH_CHECK(logit_rows->dim() == 1 && logit_rows->scalar_type() == at::kLong &&
                    logit_rows->is_contiguous(),
                "logit_rows must be a contiguous int64 vector");
    const int64_t* pick = logit_rows->data_ptr<int64_t>();
    for (int64_t i = 0; i < logit_rows->size(0); ++i)
      TORCH_CHECK(pick[i] >= 0 && pick[i] < rows, "logit row ", pick[i], " is not a row");
  }

  const LayerSignal signal{scheme, gate_weight, gate_bias, states, table};
  TORCH_CHECK(scheme != kForgetting || (states.dim() == 4 && states.size(1) == keys.size(1) &&
                                         states.size(3) >= longest),
              "FoX needs the cache's key states");
  // The residual stream [rows, d], updated in place: each row's embedding plus its position's
  // vector, as the torch forward adds them.
  auto x = torch::empty({rows, d}, embedding.options());
  const auto token = tokens.accessor<int64_t, 2>();
  const float* table_of_embeddings = embedding.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK_INDEX(token[r][0] >= 0 && token[r][0] < embedding.size(0), "token ", token[r][0],
                      " is outside the embedding's ", embedding.size(0), " rows");
    const float* from = table_of_embeddings + token[r][0] * embedding.stride(0);
    float* to = x.data_ptr<float>() + r * d;
    for (int64_t i = 0; i < d; ++i) to[i] = from[i * embedding.stride(1)];
    if (position_vectors.numel()) {
      const float* vector = position_vectors.data_ptr<float>() + r * d;
      for (int64_t i = 0; i < d; ++i) to[i] += vector[i];
    }
  }
  // A large step on one torch thread shares its attention with the helper (SharedWork).
  const bool shared = g_sharing.load(std::memory_order_relaxed) && rows >= kSplitRows &&
                      at::get_num_threads() == 1;
  const auto order = static_cast<SharedWork::Order>(g_order.load(std::memory_order_relaxed));
  SharedWork::Outcome outcome;
  const Awake awake(shared);  // from here: it takes ~60 µs to wake, the first attention is later
  // A group of rows [first, first + n) and its buffers (the cache, positions and tables are
  // indexed by the row's place in the batch).
  struct Rows {
    int64_t first, n;
    float* stream;  // its rows of x
    std::vector<float> normed, qkv, attended, projected, hidden;
    std::shared_ptr<SharedAttention> work;  // its attention, while shared
  };
  const auto rows_of = [&](int64_t first, int64_t last) {
    const int64_t n = last - first;
    return Rows{first, n, x.data_ptr<float>() + first * d, std::vector<float>(n * d),
                std::vector<float>(n * qkv_width), std::vector<float>(n * heads * hd),
                std::vector<float>(n * d), {}, nullptr};
  };
  // Block b up to its attention: norm, QKV projection, rotation, the new keys and values stored.
  const auto before_attention = [&](Rows& g, int64_t b) {
    const torch::Tensor* t = blocks.data() + b * kTensorsPerBlock;
    for (int64_t r = 0; r < g.n; ++r)
      normalise(g.stream + r * d, g.normed.data() + r * d, d, t[0].data_ptr<float>(),
                data_or_null(t[1]), norm, static_cast<float>(eps));
    linear_core::project(g.normed.data(), t[2], data_or_null(t[3]), g.qkv.data(), g.n, d,
                         qkv_width);
    if (scheme == kForgetting)
      for (int64_t r = 0; r < g.n; ++r)
        store_log_gates(signal, b, slot_row[g.first + r], position[g.first + r],
                        g.normed.data() + r * d, heads, d);
    for (int64_t r = 0; r < g.n; ++r) {
      const int64_t row = g.first + r;
      const float* row_cos = rot ? cos.data_ptr<float>() + row * cos.stride(0) : nullptr;
      const float* row_sin = rot ? sin.data_ptr<float>() + row * sin.stride(0) : nullptr;
      store_row(s, g.qkv.data() + r * qkv_width, keys, values, b, slot_row[row], position[row],
                row_cos, row_sin, rot);
    }
  };
  // Block b's attention on torch's threads: every (row, head) pair on its own (a batch of one
  // row still has its heads to split across threads, and its attention reads that row's cache).
  const auto attend = [&](Rows& g, int64_t b) {
    at::parallel_for(0, g.n * heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(longest), own_bias(own_bias_room(signal, longest));
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = i / heads, h = i % heads, row = g.first + r;
        const int64_t next_slot_row = h + 1 == heads && i + 1 < end ? slot_row[row + 1] : -1;
        attend_head(s, g.qkv.data() + r * qkv_width, keys, values, b, row, slot_row[row],
                    position[row], h, bias, signal, scores.data(), own_bias.data(),
                    g.attended.data() + r * heads * hd + h * hd, next_slot_row);
      }
    });
  };
  // Block b after its attention: output projection, residual, norm, MLP, residual.
  const auto after_attention = [&](Rows& g, int64_t b) {
    const torch::Tensor* t = blocks.data() + b * kTensorsPerBlock;
    // The up projection's outputs, from the down projection's inputs (packing pads outputs).
    const int64_t inner = linear_core::inputs_of(t[10]);
    const int64_t expanded = mlp == kSwiGLU ? 2 * inner : inner;
    g.hidden.resize(g.n * expanded);
    linear_core::project(g.attended.data(), t[4], data_or_null(t[5]), g.projected.data(), g.n,
                         heads * hd, d);
    for (int64_t i = 0; i < g.n * d; ++i) g.stream[i] += g.projected[i];
    for (int64_t r = 0; r < g.n; ++r)
      normalise(g.stream + r * d, g.normed.data() + r * d, d, t[6].data_ptr<float>(),
                data_or_null(t[7]), norm, static_cast<float>(eps));
    linear_core::project(g.normed.data(), t[8], data_or_null(t[9]), g.hidden.data(), g.n, d,
                         expanded);
    float* hidden = g.hidden.data();
    if (mlp == kSwiGLU) {
      for (int64_t r = 0; r < g.n; ++r) {  // gate, then value (FeedForward's chunk(2))
        float* h = hidden + r * expanded;
        for (int64_t i = 0; i < inner; ++i) h[i] = h[i] / (1.0f + std::exp(-h[i])) * h[inner + i];
        if (r) std::copy_n(h, inner, hidden + r * inner);  // rows packed to [n, inner]
      }
    } else {  // row by row: a row's floats take the same vector lanes alone and in a batch
      const int64_t grain = std::max<int64_t>(1, kSerialActivations / expanded);
      at::parallel_for(0, g.n, grain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) activate(hidden + r * expanded, expanded, mlp);
      });
    }
    linear_core::project(hidden, t[10], data_or_null(t[11]), g.projected.data(), g.n, inner, d);
    for (int64_t i = 0; i < g.n * d; ++i) g.stream[i] += g.projected[i];
  };
  // Rows [first, last) through every block.
  const auto through_blocks = [&](int64_t first, int64_t last) {
    Rows g = rows_of(first, last);
    for (int64_t b = 0; b < n_blocks; ++b) {
      before_attention(g, b);
      attend(g, b);
      after_attention(g, b);
    }
  };
  // Shared with the helper: from 16 rows, two groups, so that the helper attends one group's
  // rows while this thread projects the other's (the tile unit's products are this thread's
  // alone: they do not go faster on two cores). The groups go through the blocks staggered:
  // each takes its attention back (SharedWork::run: what is left of it, on both threads),
  // finishes the block and posts the next block's attention, while the helper attends the
  // other group's.
  const auto through_blocks_shared = [&]() {
    std::vector<Rows> groups;
    if (rows >= kTwoGroups) {
      groups.push_back(rows_of(0, rows / 2));
      groups.push_back(rows_of(rows / 2, rows));
    } else {
      groups.push_back(rows_of(0, rows));
    }
    // Group g up to block b's attention, which it posts to the helper.
    const auto post = [&](Rows& g, int64_t b) {
      before_attention(g, b);
      g.work = work_pool().idle();
      g.work->prepare(s, b, g.first, g.n, longest, g.qkv.data(), qkv_width,
                      position.data() + g.first, slot_row + g.first, keys, values, bias, signal,
                      g.attended.data());
      Helper::instance().post(g.work, order);
    };
    for (Rows& g : groups) post(g, 0);
    // Each group takes its attention back, finishes the block and posts the next block's: the
    // helper attends the other group meanwhile.
    for (int64_t b = 0; b < n_blocks; ++b) {
      for (Rows& g : groups) {
        const SharedWork::Outcome done = Helper::instance().take_back(g.work, order);
        g.work.reset();
        outcome.helped += done.helped;
        outcome.taken += done.taken;
        after_attention(g, b);
        if (b + 1 < n_blocks) post(g, b + 1);
      }
    }
  };
  // A large batch on several threads: each thread takes its rows through every block, one
  // parallel region a step instead of one per product and attention (each a wait for the
  // slowest thread, which on a busy machine may be waiting for a core). Inside, the loops above
  // run serially. A row's numbers are the same either way: everything is computed row by row.
  if (shared) {
    through_blocks_shared();
    work_pool().release_idle();
  } else if (rows >= kSplitRows && at::get_num_threads() > 1 && !prompt_rows)
    at::parallel_for(0, rows, kSplitRows / 2, through_blocks);
  else
    through_blocks(0, rows);
  // The final norm, then the logits of the rows asked for: one projection over them (its outputs
  // split across threads), so that each thread reads only its share of the largest weight.
  const int64_t wanted = logit_rows ? logit_rows->size(0) : rows;
  const int64_t* pick = logit_rows ? logit_rows->data_ptr<int64_t>() : nullptr;
  std::vector<float> normed(wanted * d);
  for (int64_t i = 0; i < wanted; ++i)
    normalise(x.data_ptr<float>() + (pick ? pick[i] : i) * d, normed.data() + i * d, d,
              head[0].data_ptr<float>(), data_or_null(head[1]), norm, static_cast<float>(eps));
  auto logits = torch::empty({wanted, vocab}, x.options());
  if (wanted)
    linear_core::project(normed.data(), head[2], data_or_null(head[3]),
                         logits.data_ptr<float>(), wanted, d, vocab);
  g_helped.fetch_add(outcome.helped, std::memory_order_relaxed);
  g_taken.fetch_add(outcome.taken, std::memory_order_relaxed);
  return logits;
}

// FIRE's score bias for one token per row (model/positional/fire.py): for the query at position
// p and each key t ≤ p, f(ψ(p − t) / ψ(max(L, p))) with ψ(x) = log(|c|·x + 1) and f a one-input
// ReLU MLP with an output per head. in_weight/in_bias [hidden], out_weight [H, hidden],
// out_bias [H] (contiguous); keys past p get 0 (they are masked). → [rows, H, key_length].
torch::Tensor fire_bias(const torch::Tensor& positions, int64_t key_length,
                        const torch::Tensor& in_weight, const torch::Tensor& in_bias,
                        const torch::Tensor& out_weight, const torch::Tensor& out_bias, double c,
                        double threshold, bool log_transform, bool normalise) {
  const int64_t rows = positions.size(0), hidden = in_weight.numel(), heads = out_bias.numel();
  const auto position = positions.accessor<int64_t, 1>();
  auto bias = torch::zeros({rows, heads, key_length});
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
        out[h * key_length + t] = plain_dot(w2 + h * hidden, units.data(), hidden) + b2[h];
    }
  }
  return bias;
}

#else  // no AVX-512: decode_step.py never calls in (vectorised() is false)

constexpr bool kVectorised = false;

torch::Tensor decode_step(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                          const std::vector<torch::Tensor>&, const std::vector<torch::Tensor>&,
                          int64_t, const torch::Tensor&, const torch::Tensor&,
                          const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                          const torch::Tensor&, const torch::Tensor&, int64_t, int64_t, int64_t,
                          double, int64_t, int64_t, const torch::Tensor&, const torch::Tensor&,
                          const torch::Tensor&, const torch::Tensor&,
                          const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "the decode-step kernel needs AVX-512");
}

#endif

// How many threads this library's parallel loops use in the calling thread: each library built
// on ATen copies torch's process-wide thread count on its first loop in a thread, so this may
// differ from torch.get_num_threads() there (server/engine/core.py's pin_threads).
int64_t parallel_threads() {
  std::atomic<int64_t> chunks{0};
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) { chunks.fetch_add(1); });
  return chunks.load();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_step", &decode_step, "a one-token-per-row decode step: token ids to logits");
#if defined(LINEAR_CORE_VECTORISED)
  m.def("fire_bias", &fire_bias, "FIRE's score bias for one token per row");
  m.def(
      "share_large_steps",
      [](bool on, int64_t order) {
        TORCH_CHECK(order >= SharedWork::kFree && order <= SharedWork::kHelperStalls,
                    "order must be 0 (free), 1 (the helper finishes) or 2 (the helper stalls)");
        g_order.store(static_cast<int>(order));
        g_sharing.store(on);
      },
      "whether a step of 8 rows or more on one torch thread shares its attention with a helper "
      "thread, and in which order the threads meet (0: freely; 1, 2: the tests')");
  m.def("shares_large_steps", [] { return g_sharing.load(); },
        "whether large steps share their attention now");
  m.def("shared_rows", [] { return std::vector<int64_t>{g_helped.load(), g_taken.load()}; },
        "rows of shared attention so far: supplied by the helper, taken back from it");
#endif
  m.def("vectorised", [] { return kVectorised; }, "whether this build has the AVX-512 kernel");
  m.def("parallel_threads", &parallel_threads, "threads of this library's loops in this thread");
}
