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
// SwiGLU (optimum_neuron::packed_linear_swiglu). A gated MLP's silu(x @ G^T) * (x @ U^T): packed_linear's products of
// the gate and the up on the same panels, into a thread's own buffers, then the activation (`packed_linear_swiglu`).
//
// Schedule. Threads split the panels (groups of up to 4 panels, as many as the registers allow for the row block that
// sizes them: `group_rows`; on AMD CPUs, one panel per group for fp32 with a single row block, a decode step, whose
// threads then each read one contiguous stream, prefetched non-temporally: `streams_once`; packed_linear_cat: the
// groups of every weight of the call, in one parallel region); each thread walks K in blocks (`block_k`: 64 steps for
// up to 2 row blocks, 576 from 3 on; on Intel with AVX-512, 32 at 2-4 row blocks and 64 at 5-6) and, within a block,
// every row block (up to 8 rows on AVX-512, 6 on AVX2: `max_rows`, split as `row_blocks` says) over the group
// (`panel_group`), so the panel's block stays in the caches while every row uses it, and the memory stream of the
// weights never pauses for a second row block. The row blocks prefetch the panels ahead (once per cache line of each
// panel's stream: every k step for fp32, every 4th for int8, every 8th for int4; line i by row block i mod count,
// `fetch_share`): the next K block for fp32 and int8, 1 KiB ahead for int4; near a panel's end, as far into the next
// group's panels, which follow in memory (a thread runs consecutive groups: `prefetch_ahead`).
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "panel_tiles.h"
#include "vec_exp.h"

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

// One packed weight of kind W among a call's products: `w` its first panel, `bias` padded to its panels (undefined:
// none), `scales` the contiguous [K / group, panels * 16] of the quantized kinds (undefined for fp32), `n` its output
// features.
struct Part {
  const char* w;
  int64_t panels;
  at::Tensor bias;
  at::Tensor scales;
  int64_t n;
};

// `count` panels of part `part` from panel `first`: one thread's unit of work.
struct Group {
  size_t part;
  int64_t first, count;
};

// The groups of panels the threads share: every part cut into groups of `per_tile` panels (its last one shorter).
std::vector<Group> groups_of(const std::vector<Part>& parts, int64_t per_tile) {
  std::vector<Group> groups;
  for (size_t i = 0; i < parts.size(); ++i)
    for (int64_t first = 0; first < parts[i].panels; first += per_tile)
      groups.push_back({i, first, std::min(per_tile, parts[i].panels - first)});
  return groups;
}

// y [M, sum n] = x [M, K] times every part's packed weight (+ its bias), the parts' outputs side by side in their
// order. One parallel region runs the panel groups of every part, so a layer's projections that read the same x (q, k
// and v; gate and up) cost one fork and one barrier, not one each, and the threads balance over all their panels.
// Each output element is summed exactly as with its part alone (the order of the sums is per element): bitwise the
// separate products.
template <Kind W>
at::Tensor gemm(const at::Tensor& x, const std::vector<Part>& parts, int64_t group) {
  const int64_t K = x.size(-1), ldw = K * row_bytes<W>();
  const at::Tensor xs = x.reshape({-1, K}).contiguous();
  const int64_t M = xs.size(0);
  int64_t width = 0, n = 0, panels = 0;
  for (const Part& part : parts) width += part.panels * kPanel, n += part.n, panels += part.panels;
  at::Tensor y = at::empty({M, width}, x.options());
  if (M > 0 && K > 0) {
    const float* xp = xs.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const RowBlocks blocks = row_blocks(M);
    const int64_t per_tile = panels_per_group<W>(blocks, panels, at::get_num_threads());
    std::vector<Product> products;
    int64_t col = 0;
    for (const Part& part : parts) {
      const float* bp = part.bias.defined() ? part.bias.data_ptr<float>() : nullptr;
      const float* sp = part.scales.defined() ? part.scales.data_ptr<float>() : nullptr;
      products.push_back({xp, K, K, part.w, ldw, yp + col, width, bp, sp, part.panels * kPanel, group, true});
      col += part.panels * kPanel;
    }
    const std::vector<Group> groups = groups_of(parts, per_tile);
    at::parallel_for(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t begin, int64_t end) {
      const int64_t ld = per_tile * kPanel;
      std::vector<float> partial(K > block_k<W>(blocks, true) ? M * ld : 0);
      for (int64_t g = begin; g < end; ++g)
        panel_group<W>(products[groups[g].part], blocks, groups[g].first, groups[g].count, partial.data(), ld);
    });
  } else if (M > 0) {
    y.zero_();
    int64_t col = 0;
    for (const Part& part : parts) {
      if (part.bias.defined()) y.narrow(1, col, part.panels * kPanel).add_(part.bias);
      col += part.panels * kPanel;
    }
  }
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  if (width == n) return y.view(sizes);
  std::vector<at::Tensor> columns;
  int64_t col = 0;
  for (const Part& part : parts) {
    columns.push_back(y.narrow(1, col, part.n));
    col += part.panels * kPanel;
  }
  return at::cat(columns, 1).view(sizes);
}

// A part's bias padded to its panels (undefined: none).
at::Tensor padded_bias(const c10::optional<at::Tensor>& bias, int64_t panels, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return {};
  return panels * kPanel == n ? bias->contiguous() : at::constant_pad_nd(*bias, {0, panels * kPanel - n});
}

void check_f32_weight(const char* op, const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu(), op, " runs on the CPU; got a weight on ", w.device());
  TORCH_CHECK(w.scalar_type() == at::kFloat, op, " computes in float32; got a weight of ", w.scalar_type());
  TORCH_CHECK(w.dim() == 3 && w.size(2) == kPanel && w.is_contiguous(), op,
              " needs contiguous weights [panels, K, 16]; got ", w.sizes());
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                         int64_t n) {
  check_f32_weight("packed_linear", w);
  check_x_and_bias("packed_linear", x, w.size(1), bias, n, w.size(0));
  const Part part{reinterpret_cast<const char*>(w.data_ptr<float>()), w.size(0), padded_bias(bias, w.size(0), n), {},
                  n};
  return gemm<Kind::kF32>(x, {part}, 0);
}

// packed_linear_cat: packed_linear of several weights (no bias) on the same x, their outputs concatenated, in one
// parallel region.
at::Tensor packed_linear_cat(const at::Tensor& x, at::TensorList weights, at::IntArrayRef out_features) {
  TORCH_CHECK(!weights.empty() && weights.size() == out_features.size(),
              "packed_linear_cat needs one output size per weight (at least one); got ", weights.size(),
              " weights and ", out_features.size(), " sizes");
  std::vector<Part> parts;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    check_f32_weight("packed_linear_cat", w);
    check_x_and_bias("packed_linear_cat", x, w.size(1), c10::nullopt, out_features[i], w.size(0));
    parts.push_back({reinterpret_cast<const char*>(w.data_ptr<float>()), w.size(0), {}, {}, out_features[i]});
  }
  return gemm<Kind::kF32>(x, parts, 0);
}

// SwiGLU's product, silu(g) * u = g / (1 + exp(-g)) * u, over `n` columns (a multiple of 16: whole panels) of one
// row. The vector paths take vec_exp.h's exp, the same values lane for lane on AVX2 and AVX-512; the portable path
// std::exp.
void silu_mul_portable(const float* g, const float* u, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

#ifdef OPTIMUM_NEURON_X86
__attribute__((target("avx2,fma"))) void silu_mul_avx2(const float* g, const float* u, float* y, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 a = _mm256_loadu_ps(g + i);
    const __m256 silu = _mm256_div_ps(a, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, a))));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
  }
}

__attribute__((target("avx512f"))) void silu_mul_avx512(const float* g, const float* u, float* y, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kPanel) {
    const __m512 a = _mm512_loadu_ps(g + i);
    const __m512 silu = _mm512_div_ps(a, _mm512_add_ps(one, exp16(_mm512_sub_ps(zero, a))));
    _mm512_storeu_ps(y + i, _mm512_mul_ps(silu, _mm512_loadu_ps(u + i)));
  }
}
#endif

void silu_mul(const float* g, const float* u, float* y, int64_t n) {
#ifdef OPTIMUM_NEURON_X86
  if (isa() == Isa::kAvx512) return silu_mul_avx512(g, u, y, n);
  if (isa() == Isa::kAvx2) return silu_mul_avx2(g, u, y, n);
#endif
  silu_mul_portable(g, u, y, n);
}

// packed_linear_swiglu: silu(x @ G^T) * (x @ U^T) for two packed fp32 weights of one shape (a gated MLP's gate and
// up). The threads share the groups of panels as in packed_linear. A thread runs the gate's panels of a span of its
// groups, then the up's same panels (`panel_group`: each sum bitwise what packed_linear gives), into buffers of its
// own, then writes silu(g) * u for the span: the [M, 2 n] products stay in the thread's caches instead of going to
// memory and coming back through a pointwise kernel. The span is one group for a call of many rows (the buffers stay
// small), and all the thread's groups for a decode step's products (`streams_once`: the thread then reads two
// contiguous streams, the gate's panels and the up's, rather than switching between them every panel). A row's
// result depends on that row only, as for packed_linear.
at::Tensor packed_linear_swiglu(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up, int64_t n) {
  check_f32_weight("packed_linear_swiglu", gate);
  check_f32_weight("packed_linear_swiglu", up);
  TORCH_CHECK(gate.sizes() == up.sizes(), "packed_linear_swiglu: the gate and up weights must have one shape; got ",
              gate.sizes(), " and ", up.sizes());
  check_x_and_bias("packed_linear_swiglu", x, gate.size(1), c10::nullopt, n, gate.size(0));
  const int64_t K = x.size(-1), panels = gate.size(0), ldw = K * row_bytes<Kind::kF32>();
  const at::Tensor xs = x.reshape({-1, K}).contiguous();
  const int64_t M = xs.size(0), width = panels * kPanel;
  at::Tensor y = at::empty({M, width}, x.options());
  if (M > 0 && K > 0) {
    const float* xp = xs.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const char* weights[2] = {reinterpret_cast<const char*>(gate.data_ptr<float>()),
                              reinterpret_cast<const char*>(up.data_ptr<float>())};
    const RowBlocks blocks = row_blocks(M);
    const int64_t per_tile = panels_per_group<Kind::kF32>(blocks, panels, at::get_num_threads());
    at::parallel_for(0, (panels + per_tile - 1) / per_tile, 1, [&](int64_t begin, int64_t end) {
      const int64_t span = streams_once<Kind::kF32>(blocks) ? end - begin : 1, ld = span * per_tile * kPanel;
      std::vector<float> partial(K > block_k<Kind::kF32>(blocks, true) ? M * per_tile * kPanel : 0), sums(2 * M * ld);
      for (int64_t g0 = begin; g0 < end; g0 += span) {
        const int64_t g1 = std::min(end, g0 + span), c0 = g0 * per_tile, c1 = std::min(panels, g1 * per_tile);
        for (int i = 0; i < 2; ++i) {
          // after the span's gate panels, the thread reads its up panels; after those, the gate's next span
          const char* after = i == 0 ? weights[1] + c0 * ldw : weights[0] + c1 * ldw;
          for (int64_t first = c0; first < c1; first += per_tile) {
            const int64_t count = std::min(per_tile, c1 - first);
            const char* w = weights[i] + first * ldw;
            const Product p{xp, K, K, w, ldw, sums.data() + i * M * ld + (first - c0) * kPanel, ld, nullptr, nullptr,
                            0, 0, true, first + count == c1 ? after - w : 0};
            panel_group<Kind::kF32>(p, blocks, 0, count, partial.data(), per_tile * kPanel);
          }
        }
        for (int64_t m = 0; m < M; ++m)
          silu_mul(sums.data() + m * ld, sums.data() + (M + m) * ld, yp + m * width + c0 * kPanel, (c1 - c0) * kPanel);
      }
    });
  } else if (M > 0) {
    y.zero_();
  }
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  return (width == n ? y : y.narrow(1, 0, n).contiguous()).view(sizes);
}

// A quantized weight's part, checked: int8 [panels, K, 16] or int4 pairs [panels, K, 8] with float32 scales
// [groups, panels * 16], groups dividing K (an even group size for int4). Its group size goes to `group`.
Part quantized_part(const char* op, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                    const c10::optional<at::Tensor>& bias, int64_t n, int64_t* group) {
  TORCH_CHECK(w.device().is_cpu() && scales.device().is_cpu(), op, " runs on the CPU; got the weight on ", w.device(),
              " and the scales on ", scales.device());
  const bool int8 = w.scalar_type() == at::kChar, int4 = w.scalar_type() == at::kByte;
  TORCH_CHECK(int8 || int4, op,
              " needs an int8 weight [panels, K, 16] or a uint8 weight of int4 pairs [panels, K, 8]; got dtype ",
              w.scalar_type());
  const int64_t row = int8 ? kPanel : kPanel / 2;
  TORCH_CHECK(w.dim() == 3 && w.size(2) == row && w.is_contiguous(), op, " needs a contiguous ",
              int8 ? "int8 weight [panels, K, 16]" : "uint8 (int4 pairs) weight [panels, K, 8]", "; got ", w.sizes());
  const int64_t panels = w.size(0), K = w.size(1);
  check_x_and_bias(op, x, K, bias, n, panels);
  TORCH_CHECK(scales.scalar_type() == at::kFloat, op, ": the scales must be float32; got ", scales.scalar_type());
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) >= 1 && scales.size(1) == panels * kPanel, op,
              ": the scales must be [groups, ", panels * kPanel, "] (groups >= 1); got ", scales.sizes());
  const int64_t groups = scales.size(0);
  TORCH_CHECK(K % groups == 0, op, ": ", groups, " groups do not divide K = ", K);
  *group = K / groups;
  TORCH_CHECK(int8 || *group % 2 == 0, op, ": int4 pairs two steps of K in a byte, so the group size must be ",
              "even; got ", *group, " (K = ", K, ", ", groups, " groups)");
  return {reinterpret_cast<const char*>(w.data_ptr()), panels, padded_bias(bias, panels, n), scales.contiguous(), n};
}

// packed_qlinear: the weight-only int8 / int4 twin. Each panel row is dequantized at load, w = float(q) * scale in
// fp32 (one rounding), then the same fused multiply-adds in the same order as packed_linear: the result is bitwise
// packed_linear's on the packed dequantized weight.
at::Tensor packed_qlinear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& bias, int64_t n) {
  int64_t group = 0;
  const Part part = quantized_part("packed_qlinear", x, w, scales, bias, n, &group);
  return w.scalar_type() == at::kChar ? gemm<Kind::kI8>(x, {part}, group) : gemm<Kind::kI4>(x, {part}, group);
}

// packed_qlinear_cat: packed_qlinear of several weights (no bias) of one kind and one group size on the same x, their
// outputs concatenated, in one parallel region.
at::Tensor packed_qlinear_cat(const at::Tensor& x, at::TensorList weights, at::TensorList scales,
                              at::IntArrayRef out_features) {
  TORCH_CHECK(!weights.empty() && weights.size() == out_features.size() && weights.size() == scales.size(),
              "packed_qlinear_cat needs one scales tensor and one output size per weight (at least one); got ",
              weights.size(), " weights, ", scales.size(), " scales and ", out_features.size(), " sizes");
  std::vector<Part> parts;
  int64_t group = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    int64_t own = 0;
    parts.push_back(quantized_part("packed_qlinear_cat", x, weights[i], scales[i], c10::nullopt, out_features[i], &own));
    TORCH_CHECK(weights[i].scalar_type() == weights[0].scalar_type() && (i == 0 || own == group),
                "packed_qlinear_cat: every weight must have the first one's kind and group size (",
                weights[0].scalar_type(), ", ", i == 0 ? own : group, "); weight ", i, " has ",
                weights[i].scalar_type(), ", ", own);
    group = own;
  }
  return weights[0].scalar_type() == at::kChar ? gemm<Kind::kI8>(x, parts, group) : gemm<Kind::kI4>(x, parts, group);
}

}  // namespace
}  // namespace optimum_neuron

TORCH_LIBRARY_IMPL(optimum_neuron, CPU, m) {
  m.impl("packed_linear", &optimum_neuron::packed_linear);
  m.impl("packed_qlinear", &optimum_neuron::packed_qlinear);
  m.impl("packed_linear_cat", &optimum_neuron::packed_linear_cat);
  m.impl("packed_qlinear_cat", &optimum_neuron::packed_qlinear_cat);
  m.impl("packed_linear_swiglu", &optimum_neuron::packed_linear_swiglu);
}
