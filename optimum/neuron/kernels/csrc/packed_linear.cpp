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
// Schedule. Threads split the panels (groups of up to 4 panels, as many as the registers allow for the row block);
// each thread walks K in blocks of 64 and, within a block, every row block (up to 6 rows) over the group, so the
// panel's block stays in L1 while every row uses it, and the memory stream of the weights never pauses for a second
// row block. The first row block prefetches the next K block of the panels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define OPTIMUM_NEURON_X86 1
#endif

namespace optimum_neuron {
namespace {

constexpr int64_t kPanel = 16;     // output columns per panel (two 8-float vectors)
constexpr int64_t kBlockK = 64;    // K steps per block
constexpr int64_t kMaxRows = 6;    // rows per tile
constexpr int64_t kMaxPanels = 4;  // panels per tile

enum class Isa { kPortable, kAvx2, kAvx512 };

// One tile's work: `rows` rows of x times `panels` panels over one K block.
struct Tile {
  const float* x;     // the first row, at the block's first k
  int64_t ldx;        // x's row stride
  const float* w;     // the first panel, at the block's first k
  int64_t ldw;        // panel stride (K * 16)
  int64_t steps;      // k steps in this block
  const float* in;    // partial sums to continue (null: start from zero), row stride ldin
  int64_t ldin;
  float* out;         // where the sums go (the partial-sum buffer, or y on the last block), row stride ldout
  int64_t ldout;
  const float* bias;  // added on the last block (null: none)
  bool prefetch;      // prefetch the next block of the panels
};

#ifdef OPTIMUM_NEURON_X86
template <int R, int P>
__attribute__((target("avx,fma"))) void tile_fma(const Tile& t) {
  constexpr int A = 2 * P;
  __m256 acc[R * A];
  if (t.in == nullptr) {
#pragma GCC unroll 32
    for (int i = 0; i < R * A; ++i) acc[i] = _mm256_setzero_ps();
  } else {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < A; ++j) acc[r * A + j] = _mm256_loadu_ps(t.in + r * t.ldin + 8 * j);
  }
  const float* x = t.x;
  const float* w = t.w;
  const int64_t steps = t.steps, ldx = t.ldx, ldw = t.ldw;
  const bool prefetch = t.prefetch;
  for (int64_t k = 0; k < steps; ++k) {
    __m256 v[A];
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      const float* at = w + p * ldw + k * kPanel;
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(at + kBlockK * kPanel), _MM_HINT_T0);
      v[2 * p] = _mm256_loadu_ps(at);
      v[2 * p + 1] = _mm256_loadu_ps(at + 8);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < A; ++j) acc[r * A + j] = _mm256_fmadd_ps(b, v[j], acc[r * A + j]);
    }
  }
  if (t.bias != nullptr) {
#pragma GCC unroll 8
    for (int j = 0; j < A; ++j) {
      const __m256 b = _mm256_loadu_ps(t.bias + 8 * j);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r * A + j] = _mm256_add_ps(acc[r * A + j], b);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < A; ++j) _mm256_storeu_ps(t.out + r * t.ldout + 8 * j, acc[r * A + j]);
}

// The same tile with one 16-float register per panel row (the same fused multiply-adds, in the same order).
template <int R, int P>
__attribute__((target("avx512f"))) void tile_avx512(const Tile& t) {
  __m512 acc[R * P];
  if (t.in == nullptr) {
#pragma GCC unroll 32
    for (int i = 0; i < R * P; ++i) acc[i] = _mm512_setzero_ps();
  } else {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) acc[r * P + p] = _mm512_loadu_ps(t.in + r * t.ldin + kPanel * p);
  }
  const float* x = t.x;
  const float* w = t.w;
  const int64_t steps = t.steps, ldx = t.ldx, ldw = t.ldw;
  const bool prefetch = t.prefetch;
  for (int64_t k = 0; k < steps; ++k) {
    __m512 v[P];
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      const float* at = w + p * ldw + k * kPanel;
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(at + kBlockK * kPanel), _MM_HINT_T0);
      v[p] = _mm512_loadu_ps(at);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) acc[r * P + p] = _mm512_fmadd_ps(b, v[p], acc[r * P + p]);
    }
  }
  if (t.bias != nullptr) {
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      const __m512 b = _mm512_loadu_ps(t.bias + kPanel * p);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r * P + p] = _mm512_add_ps(acc[r * P + p], b);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(t.out + r * t.ldout + kPanel * p, acc[r * P + p]);
}
#endif

// The same tile in portable C++ (no fused multiply-add: the machine's own rounding, same order).
template <int R, int P>
void tile_portable(const Tile& t) {
  constexpr int C = P * kPanel;
  float acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = t.in == nullptr ? 0.0f : t.in[r * t.ldin + c];
  for (int64_t k = 0; k < t.steps; ++k)
    for (int r = 0; r < R; ++r) {
      const float b = t.x[r * t.ldx + k];
      for (int p = 0; p < P; ++p)
        for (int j = 0; j < kPanel; ++j) acc[r][p * kPanel + j] += b * t.w[p * t.ldw + k * kPanel + j];
    }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) t.out[r * t.ldout + c] = t.bias == nullptr ? acc[r][c] : acc[r][c] + t.bias[c];
}

using TileFn = void (*)(const Tile&);

// The best path this CPU has, lowered by OPTIMUM_NEURON_PACKED_ISA (avx2, portable); read once.
Isa detect_isa() {
  const char* asked = std::getenv("OPTIMUM_NEURON_PACKED_ISA");
  const bool portable_only = asked != nullptr && std::strcmp(asked, "portable") == 0;
  const bool no_avx512 = portable_only || (asked != nullptr && std::strcmp(asked, "avx2") == 0);
#ifdef OPTIMUM_NEURON_X86
  if (!no_avx512 && __builtin_cpu_supports("avx512f")) return Isa::kAvx512;
  if (!portable_only && __builtin_cpu_supports("avx") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  (void)no_avx512;
  return Isa::kPortable;
}

Isa isa() {
  static const Isa found = detect_isa();
  return found;
}

// Vector registers a tile may hold as accumulators (the rest: the panels' weights and the broadcast), and how many
// one row of one panel takes.
int64_t accumulators() { return isa() == Isa::kAvx512 ? 24 : 12; }
int64_t registers_per_panel() { return isa() == Isa::kAvx512 ? 1 : 2; }

template <int P>
TileFn tile_for_rows(int64_t rows) {
  static const TileFn portable[kMaxRows] = {tile_portable<1, P>, tile_portable<2, P>, tile_portable<3, P>,
                                            tile_portable<4, P>, tile_portable<5, P>, tile_portable<6, P>};
#ifdef OPTIMUM_NEURON_X86
  static const TileFn fma[kMaxRows] = {tile_fma<1, P>, tile_fma<2, P>, tile_fma<3, P>,
                                       tile_fma<4, P>, tile_fma<5, P>, tile_fma<6, P>};
  static const TileFn avx512[kMaxRows] = {tile_avx512<1, P>, tile_avx512<2, P>, tile_avx512<3, P>,
                                          tile_avx512<4, P>, tile_avx512<5, P>, tile_avx512<6, P>};
  if (isa() == Isa::kAvx512) return avx512[rows - 1];
  if (isa() == Isa::kAvx2) return fma[rows - 1];
#endif
  return portable[rows - 1];
}

TileFn tile_for(int64_t rows, int64_t panels) {
  switch (panels) {
    case 1: return tile_for_rows<1>(rows);
    case 2: return tile_for_rows<2>(rows);
    case 3: return tile_for_rows<3>(rows);
    default: return tile_for_rows<4>(rows);
  }
}

// Rows split into blocks of at most kMaxRows, as even as possible (8 rows: 4 + 4).
struct RowBlocks {
  int64_t count, base, extra;  // `extra` blocks of base + 1 rows, then blocks of base rows
  int64_t rows(int64_t b) const { return base + (b < extra ? 1 : 0); }
};

RowBlocks row_blocks(int64_t m) {
  const int64_t count = (m + kMaxRows - 1) / kMaxRows;
  return {count, m / count, m % count};
}

// Panels per tile: the most the accumulators allow for the widest row block, lowered when that balances the
// threads better (12 panels on 2 threads: 3 groups of 4 would leave one thread with twice the work).
int64_t panels_per_tile(int64_t widest, int64_t panels, int64_t threads) {
  const int64_t most =
      std::max<int64_t>(1, std::min<int64_t>(kMaxPanels, accumulators() / (registers_per_panel() * widest)));
  int64_t best = 1, best_cost = INT64_MAX;
  for (int64_t p = most; p >= 1; --p) {
    const int64_t groups = (panels + p - 1) / p;
    const int64_t cost = ((groups + threads - 1) / threads) * p;
    if (cost < best_cost) best = p, best_cost = cost;
  }
  return best;
}

void check_inputs(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "packed_linear runs on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "packed_linear computes in float32; got x ", x.scalar_type(), " and weight ", w.scalar_type());
  TORCH_CHECK(w.dim() == 3 && w.size(2) == kPanel && w.is_contiguous(),
              "packed_linear needs a contiguous weight [panels, K, 16]; got ", w.sizes());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == w.size(1), "packed_linear: x has ", x.size(-1), " features, the weight ",
              w.size(1));
  TORCH_CHECK(n > (w.size(0) - 1) * kPanel && n <= w.size(0) * kPanel, "packed_linear: ", n,
              " output features do not fit ", w.size(0), " panels");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat,
                "packed_linear: the bias must be float32 [", n, "]");
  }
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                         int64_t n) {
  check_inputs(x, w, bias, n);
  const int64_t K = x.size(-1), panels = w.size(0), width = panels * kPanel, ldw = K * kPanel;
  const at::Tensor xs = x.reshape({-1, K}).contiguous();
  const int64_t M = xs.size(0);
  at::Tensor y = at::empty({M, width}, x.options());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = width == n ? bias->contiguous() : at::constant_pad_nd(*bias, {0, width - n});
  if (M > 0 && K > 0) {
    const float* xp = xs.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    const RowBlocks blocks = row_blocks(M);
    const int64_t group = panels_per_tile(blocks.rows(0), panels, at::get_num_threads());
    const int64_t groups = (panels + group - 1) / group;
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      const int64_t ld = group * kPanel;
      std::vector<float> partial(K > kBlockK ? M * ld : 0);
      for (int64_t g = begin; g < end; ++g) {
        const int64_t first = g * group, count = std::min(group, panels - first), col = first * kPanel;
        for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
          const int64_t steps = std::min(kBlockK, K - k0);
          const bool last = k0 + steps == K;
          for (int64_t blk = 0, m = 0; blk < blocks.count; m += blocks.rows(blk), ++blk) {
            float* sums = partial.data() + m * ld;
            const Tile t{xp + m * K + k0, K, wp + first * ldw + k0 * kPanel, ldw, steps,
                         k0 == 0 ? nullptr : sums, ld,
                         last ? yp + m * width + col : sums, last ? width : ld,
                         last && bp != nullptr ? bp + col : nullptr, blk == 0};
            tile_for(blocks.rows(blk), count)(t);
          }
        }
      }
    });
  } else if (M > 0) {
    y.zero_();
    if (b.defined()) y.add_(b);
  }
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  return (width == n ? y : y.narrow(1, 0, n).contiguous()).view(sizes);
}

}  // namespace
}  // namespace optimum_neuron

TORCH_LIBRARY_IMPL(optimum_neuron, CPU, m) { m.impl("packed_linear", &optimum_neuron::packed_linear); }
