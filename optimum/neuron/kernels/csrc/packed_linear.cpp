// optimum_neuron::packed_linear: y = x @ W^T (+ bias) for fp32 on the CPU, W packed into 16-column panels.
//
// Layout. W [N, K] is stored as P [ceil(N / 16), K, 16]: P[p, k, j] = W[16 p + j, k] (zero past N). One panel is
// 16 output columns over the whole K, so a tile of rows streams one contiguous stretch of memory per panel.
//
// Order of the sums. Every output element is one fp32 accumulator, starting at zero, that takes x[m, k] * W[n, k]
// for k = 0, 1, ..., K - 1 in that order (fused multiply-add on the vector path), then the bias. Row blocking, panel
// grouping, K blocking (partial sums are stored and reloaded exactly) and threading never change that sequence, so
// a row's result depends only on the row: two equal rows of one call give bitwise equal outputs (the padded columns
// of a prefill chunk, DESIGN.md invariant 4), whatever M is and wherever the rows sit.
//
// Instruction sets. AVX-512 (one 16-float register per panel row, 32 registers) where the CPU has it, else AVX2 + FMA
// (two 8-float registers per panel row, 16 registers), else portable C++. The two vector paths run the same fused
// multiply-adds in the same order, so they give bitwise equal results; OPTIMUM_NEURON_PACKED_ISA=avx2 or portable
// (read once) picks a lesser path, for comparison and tests.
//
// Weight-only int8 / int4 (optimum_neuron::packed_qlinear). The same panels hold int8 weights ([panels, K, 16] int8)
// or int4 pairs ([panels, K, 8] uint8, read as [panels, K / 2, 16]: byte j of pair i holds column j at k = 2i in its
// low nibble and at k = 2i + 1 in its high one, each a signed 4-bit value; K and the group size even), with fp32
// scales [groups, panels * 16]: k takes the scales of group k / (K / groups). int8 runs packed_linear's tiles with a
// loader that turns a panel row into fp32, float(q) * scale (one multiply, one rounding), then packed_linear's fused
// multiply-adds in its order: packed_qlinear(x, q8, s) is bitwise packed_linear(x, pack(q8 * s)) on every path. int4
// has its own tiles (panel_tiles.h, "int4 tiles"): the sum of x * q over each run of a scale group inside a K block,
// then times the scale into the output, no multiply per weight. Either way a row's result depends on that row only,
// and the AVX2 and AVX-512 paths are bitwise equal.
//
// Schedule. Threads split the panels (groups of up to 4 panels, as many as the registers allow for the row block);
// each thread walks K in blocks (`block_k`: 64 steps for up to 2 row blocks, 576 from 3 on) and, within a block,
// every row block (up to 8 rows on AVX-512, 6 on AVX2: `max_rows`) over the group (`panel_group`), so the panel's
// block stays in the caches while every row uses it, and the memory stream of the weights never pauses for a second
// row block. The first row block prefetches the panels ahead (once
// per cache line of each panel's stream: every k step for fp32, every 4th for int8, every 8th for int4): the next K
// block for fp32 and int8, 1 KiB ahead for int4; near a panel's end, as far into the next group's panels, which
// follow in memory (a thread runs consecutive groups: `prefetch_ahead`).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "panel_tiles.h"

namespace optimum_neuron {
namespace {

void check_x_and_bias(const char* op, const at::Tensor& x, int64_t k, const c10::optional<at::Tensor>& bias,
                      int64_t n, int64_t panels) {
  TORCH_CHECK(x.device().is_cpu(), op, " runs on the CPU; got x on ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, " computes in float32; got x ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, op, ": x has ", x.dim() >= 1 ? x.size(-1) : 0,
              " features, the weight ", k);
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, op, ": ", n, " output features do not fit ", panels,
              " panels");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == n &&
                    bias->scalar_type() == at::kFloat,
                op, ": the bias must be float32 [", n, "] on the CPU; got ", bias->scalar_type(), " ",
                bias->sizes());
  }
}

// y [M, n] = x [M, K] @ W^T + bias for a packed weight of kind W: `wp` the first panel, `ldw` the panel stride in
// bytes; for the quantized kinds `sp` the scales [K / group, panels * 16].
template <Kind W>
at::Tensor gemm(const at::Tensor& x, const char* wp, int64_t panels, const float* sp, int64_t group,
                const c10::optional<at::Tensor>& bias, int64_t n) {
  const int64_t K = x.size(-1), width = panels * kPanel, ldw = K * row_bytes<W>();
  const at::Tensor xs = x.reshape({-1, K}).contiguous();
  const int64_t M = xs.size(0);
  at::Tensor y = at::empty({M, width}, x.options());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = width == n ? bias->contiguous() : at::constant_pad_nd(*bias, {0, width - n});
  if (M > 0 && K > 0) {
    const float* xp = xs.data_ptr<float>();
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    const RowBlocks blocks = row_blocks(M);
    const int64_t per_tile = panels_per_tile(blocks.rows(0), panels, at::get_num_threads());
    const int64_t tiles = (panels + per_tile - 1) / per_tile;
    const Product p{xp, K, K, wp, ldw, yp, width, bp, sp, width, group, true};
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      const int64_t ld = per_tile * kPanel;
      std::vector<float> partial(K > block_k<W>(blocks) ? M * ld : 0);
      for (int64_t g = begin; g < end; ++g)
        panel_group<W>(p, blocks, g * per_tile, std::min(per_tile, panels - g * per_tile), partial.data(), ld);
    });
  } else if (M > 0) {
    y.zero_();
    if (b.defined()) y.add_(b);
  }
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  return (width == n ? y : y.narrow(1, 0, n).contiguous()).view(sizes);
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                         int64_t n) {
  TORCH_CHECK(w.device().is_cpu(), "packed_linear runs on the CPU; got the weight on ", w.device());
  TORCH_CHECK(w.scalar_type() == at::kFloat, "packed_linear computes in float32; got weight ", w.scalar_type());
  TORCH_CHECK(w.dim() == 3 && w.size(2) == kPanel && w.is_contiguous(),
              "packed_linear needs a contiguous weight [panels, K, 16]; got ", w.sizes());
  check_x_and_bias("packed_linear", x, w.size(1), bias, n, w.size(0));
  return gemm<Kind::kF32>(x, reinterpret_cast<const char*>(w.data_ptr<float>()), w.size(0), nullptr, 0, bias, n);
}

// packed_qlinear: the weight-only int8 / int4 twin. Each panel row is dequantized at load, w = float(q) * scale in
// fp32 (one rounding), then the same fused multiply-adds in the same order as packed_linear: the result is bitwise
// packed_linear's on the packed dequantized weight.
at::Tensor packed_qlinear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(w.device().is_cpu() && scales.device().is_cpu(), "packed_qlinear runs on the CPU; got the weight on ",
              w.device(), " and the scales on ", scales.device());
  const bool int8 = w.scalar_type() == at::kChar, int4 = w.scalar_type() == at::kByte;
  TORCH_CHECK(int8 || int4,
              "packed_qlinear needs an int8 weight [panels, K, 16] or a uint8 weight of int4 pairs [panels, K, 8]; "
              "got dtype ", w.scalar_type());
  const int64_t row = int8 ? kPanel : kPanel / 2;
  TORCH_CHECK(w.dim() == 3 && w.size(2) == row && w.is_contiguous(), "packed_qlinear needs a contiguous ",
              int8 ? "int8 weight [panels, K, 16]" : "uint8 (int4 pairs) weight [panels, K, 8]", "; got ",
              w.sizes());
  const int64_t panels = w.size(0), K = w.size(1);
  check_x_and_bias("packed_qlinear", x, K, bias, n, panels);
  TORCH_CHECK(scales.scalar_type() == at::kFloat, "packed_qlinear: the scales must be float32; got ",
              scales.scalar_type());
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) >= 1 && scales.size(1) == panels * kPanel,
              "packed_qlinear: the scales must be [groups, ", panels * kPanel, "] (groups >= 1); got ",
              scales.sizes());
  const int64_t groups = scales.size(0);
  TORCH_CHECK(K % groups == 0, "packed_qlinear: ", groups, " groups do not divide K = ", K);
  const at::Tensor s = scales.contiguous();
  const int64_t group = K / groups;
  TORCH_CHECK(int8 || group % 2 == 0, "packed_qlinear: int4 pairs two steps of K in a byte, so the group size must be ",
              "even; got ", group, " (K = ", K, ", ", groups, " groups)");
  const char* wp = reinterpret_cast<const char*>(w.data_ptr());
  return int8 ? gemm<Kind::kI8>(x, wp, panels, s.data_ptr<float>(), group, bias, n)
              : gemm<Kind::kI4>(x, wp, panels, s.data_ptr<float>(), group, bias, n);
}

}  // namespace
}  // namespace optimum_neuron

TORCH_LIBRARY_IMPL(optimum_neuron, CPU, m) {
  m.impl("packed_linear", &optimum_neuron::packed_linear);
  m.impl("packed_qlinear", &optimum_neuron::packed_qlinear);
}
