// What every variant's library says of itself (model/kernels/__init__.py loads one per ISA, its
// ops under torch.ops.ordinal_<isa>).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <string>

#include "simd.h"

namespace {

// The ISA this library was compiled for.
std::string isa() { return simd::kIsa; }

// How many threads this library's parallel loops use in the calling thread: each library built
// on ATen copies torch's process-wide thread count on its first loop in a thread, so this may
// differ from torch.get_num_threads() there (server/engine/core.py's pin_threads).
int64_t parallel_threads() {
  std::atomic<int64_t> chunks{0};
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) { chunks.fetch_add(1); });
  return chunks.load();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ORDINAL_OPS, m) {
  m.def("isa() -> str", &isa);
  m.def("parallel_threads() -> int", &parallel_threads);
}
