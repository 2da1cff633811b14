// optimum_neuron::packed_rows: rows W[ids] of a weight kept only in the packed layout (packed_linear.cpp), an
// embedding lookup in a tied embedding / LM head table: out[t, k] = P[ids[t] / 16, k, ids[t] % 16].
//
// Why an operator. As a tensor index in the graph (P[ids // 16, :, ids % 16]), inductor inlined the gather into each
// kernel that read the looked-up rows (the first layer's norm, its residual adds: five kernels of a prefill chunk's
// graph), and each of them gathered the rows again: a row's K values lie one per cache line of its panel (K lines,
// 64 bytes each, for 4 K bytes of values), so a 256-token chunk read ~9 MB of cold lines per kernel. An operator's
// output is computed once and read as an ordinary tensor by its consumers.
//
// Each thread takes a range of ids; for each id, the K values at a stride of one panel row, prefetched a few lines
// ahead. The values are copied as they are (any element size: fp32 panels, int8 panels): the same bytes as the index.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "panel_tiles.h"

namespace optimum_neuron {
namespace {

constexpr int64_t kAhead = 8;  // panel rows a gather prefetches ahead of the one it copies

// K values of type T at a stride of 16 elements from `src` into `dst`.
template <typename T>
void gather_row(const T* src, int64_t K, T* dst) {
  for (int64_t k = 0; k < K; ++k) {
#ifdef OPTIMUM_NEURON_X86
    if (k + kAhead < K) prefetch_line(reinterpret_cast<const char*>(src + (k + kAhead) * kPanel), false);
#endif
    dst[k] = src[k * kPanel];
  }
}

template <typename T>
void gather_rows(const at::Tensor& table, const int64_t* ids, int64_t n, at::Tensor& out) {
  const int64_t K = table.size(1);
  const T* base = static_cast<const T*>(table.data_ptr());
  T* dst = static_cast<T*>(out.data_ptr());
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      gather_row(base + (ids[t] / kPanel) * K * kPanel + ids[t] % kPanel, K, dst + t * K);
  });
}

at::Tensor packed_rows(const at::Tensor& table, const at::Tensor& ids) {
  TORCH_CHECK(table.device().is_cpu() && ids.device().is_cpu(), "packed_rows runs on the CPU; got the table on ",
              table.device(), " and the ids on ", ids.device());
  TORCH_CHECK(table.dim() == 3 && table.size(2) == kPanel && table.is_contiguous(),
              "packed_rows needs a contiguous packed table [panels, K, 16]; got ", table.sizes());
  TORCH_CHECK(ids.scalar_type() == at::kLong, "packed_rows: the ids must be int64; got ", ids.scalar_type());
  const at::Tensor flat = ids.contiguous();
  const int64_t n = flat.numel(), rows = table.size(0) * kPanel;
  const int64_t* idp = flat.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(idp[t] >= 0 && idp[t] < rows, "packed_rows: id ", idp[t], " is outside the table's ", rows,
                " rows");
  at::Tensor out = at::empty({n, table.size(1)}, table.options());
  switch (table.element_size()) {
    case 4: gather_rows<int32_t>(table, idp, n, out); break;
    case 2: gather_rows<int16_t>(table, idp, n, out); break;
    case 1: gather_rows<int8_t>(table, idp, n, out); break;
    default: TORCH_CHECK(false, "packed_rows: elements of ", table.element_size(), " bytes are not supported");
  }
  std::vector<int64_t> sizes = ids.sizes().vec();
  sizes.push_back(table.size(1));
  return out.view(sizes);
}

}  // namespace
}  // namespace optimum_neuron

TORCH_LIBRARY_IMPL(optimum_neuron, CPU, m) { m.impl("packed_rows", &optimum_neuron::packed_rows); }
