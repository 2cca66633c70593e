// FoX's decay bias D_ij = Σ_{t > j} log f_t over the keys t that query i may see, in one pass
// (model/kernels/fox.py says when it runs; model/positional/fox.py holds the reference).
//
// torch takes seven ops per layer for it (where, flip, cumsum, flip, a slice, a pad), each a
// dispatch and a fresh tensor for one query's row of keys. Here each query's row is one loop from
// the last key back, summing in double as torch's CPU cumsum does, so the bits are the
// reference's. As there, D_ij is also written where query i may not see key j (the running sum
// at that point); the model's mask puts −∞ there.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace {

// log_gates [G, Tk] float32 (one row per batch row and head); allowed [Gm, Tq, Tk] bool, G / Gm
// consecutive groups sharing one → D [G, Tq, Tk] float32.
at::Tensor forgetting_bias(const at::Tensor& log_gates_in, const at::Tensor& allowed_in) {
  const auto log_gates = log_gates_in.contiguous(), allowed = allowed_in.contiguous();
  TORCH_CHECK(log_gates.dim() == 2 && log_gates.scalar_type() == at::kFloat,
              "log_gates must be float32 [groups, keys]");
  TORCH_CHECK(allowed.dim() == 3 && allowed.scalar_type() == at::kBool &&
                  allowed.size(2) == log_gates.size(1) && log_gates.size(0) % allowed.size(0) == 0,
              "allowed must be bool [mask groups, queries, keys]");
  const int64_t groups = log_gates.size(0), Tq = allowed.size(1), Tk = allowed.size(2);
  const int64_t groups_per_mask = groups / allowed.size(0);
  auto bias = at::empty({groups, Tq, Tk}, log_gates.options());
  const float* gates = log_gates.data_ptr<float>();
  const bool* mask = allowed.data_ptr<bool>();
  float* out = bias.data_ptr<float>();
  at::parallel_for(0, groups * Tq, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t group = row / Tq, query = row % Tq;
      const float* gate = gates + group * Tk;
      const bool* sees = mask + ((group / groups_per_mask) * Tq + query) * Tk;
      float* d = out + row * Tk;
      double after = 0.0;  // Σ log f over the visible keys after j
      for (int64_t j = Tk - 1; j >= 0; --j) {
        d[j] = static_cast<float>(after);
        if (sees[j]) after += gate[j];
      }
    }
  });
  return bias;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ORDINAL_OPS, m) {
  m.def("forgetting_bias(Tensor log_gates, Tensor allowed) -> Tensor", &forgetting_bias);
}
