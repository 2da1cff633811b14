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
// or int4 pairs ([panels, K, 8] uint8: byte j holds column 2j in its low nibble, 2j + 1 in its high one, each a
// signed 4-bit value), with fp32 scales [groups, panels * 16]: k takes the scales of group k / (K / groups). The
// tiles are the same templates over the weight kind: a loader per kind and path turns a panel row into fp32,
// float(q) * scale (one multiply, one rounding), and the fused multiply-adds that follow are packed_linear's, in its
// order. So packed_qlinear(x, q, s) is bitwise packed_linear(x, pack(q * s)) on every path, a row's result still
// depends on that row only, and the AVX2 and AVX-512 paths stay bitwise equal.
//
// Schedule. Threads split the panels (groups of up to 4 panels, as many as the registers allow for the row block);
// each thread walks K in blocks of 64 and, within a block, every row block (up to 6 rows) over the group, so the
// panel's block stays in L1 while every row uses it, and the memory stream of the weights never pauses for a second
// row block. The first row block prefetches the next K block of the panels (once per cache line of each panel's
// stream: every k step for fp32, every 4th for int8, every 8th for int4).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "isa.h"

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
constexpr int64_t kLine = 64;      // bytes per cache line (one prefetch)

// What a panel holds: fp32 weights, or int8 / int4 weights with fp32 scales (packed_qlinear).
enum class Kind { kF32, kI8, kI4 };

// Bytes of one panel row (16 columns at one k) per kind: 16 floats, 16 int8, 16 nibbles.
template <Kind W>
constexpr int64_t row_bytes() {
  return W == Kind::kF32 ? 64 : W == Kind::kI8 ? 16 : 8;
}

// One tile's work: `rows` rows of x times `panels` panels over one K block.
struct Tile {
  const float* x;       // the first row, at the block's first k
  int64_t ldx;          // x's row stride
  const char* w;        // the first panel, at the block's first k
  int64_t ldw;          // panel stride in bytes (K * row_bytes)
  int64_t steps;        // k steps in this block
  const float* in;      // partial sums to continue (null: start from zero), row stride ldin
  int64_t ldin;
  float* out;           // where the sums go (the partial-sum buffer, or y on the last block), row stride ldout
  int64_t ldout;
  const float* bias;    // added on the last block (null: none)
  bool prefetch;        // prefetch the next block of the panels
  // Quantized kinds only: scales[g, c] of the first panel's first column (row stride lds), the block's first k
  // (absolute) and the group size: k takes the scales of group k / group.
  const float* scales;
  int64_t lds;
  int64_t k0;
  int64_t group;
};

// The k steps [k, end) of a block that share one scale group, and that group's scale row (fp32: the whole block).
template <Kind W>
inline int64_t group_end(const Tile& t, int64_t k, const float** srow) {
  if (W == Kind::kF32) {
    *srow = nullptr;
    return t.steps;
  }
  const int64_t g = (t.k0 + k) / t.group;
  *srow = t.scales + g * t.lds;
  return std::min(t.steps, (g + 1) * t.group - t.k0);
}

// Prefetch the next block at this k? Once per cache line of a panel's stream (a row is 64, 16 or 8 bytes).
template <Kind W>
inline bool prefetch_step(int64_t k) {
  constexpr int64_t every = kLine / row_bytes<W>();
  return (k & (every - 1)) == 0;
}

// The portable loader: column j of a panel row, dequantized in fp32 as one multiply (one rounding).
template <Kind W>
inline float load_scalar(const char* at, int64_t j, const float* s) {
  if (W == Kind::kF32) return reinterpret_cast<const float*>(at)[j];
  if (W == Kind::kI8) return static_cast<float>(reinterpret_cast<const int8_t*>(at)[j]) * s[j];
  const uint8_t byte = reinterpret_cast<const uint8_t*>(at)[j >> 1];
  const int nibble = (j & 1) ? (byte >> 4) : (byte & 0x0F);
  return static_cast<float>((nibble ^ 8) - 8) * s[j];
}

#ifdef OPTIMUM_NEURON_X86
// int4 on the vector paths: a little-endian dword of a panel row holds 8 columns, column c in bits 4c..4c+3. Each
// lane gets the dword of its column, shifts its nibble to the top (left by 28 - 4c) and back with the sign (right
// arithmetic by 28): the same integer as the portable (n ^ 8) - 8, without byte shuffles.
inline int32_t dword_at(const char* at) {
  int32_t v;
  std::memcpy(&v, at, sizeof v);
  return v;
}

// The AVX2 loader: one panel row as two 8-float vectors.
template <Kind W>
__attribute__((target("avx2,fma"))) inline void load_avx2(const char* at, const float* s, __m256* lo, __m256* hi) {
  if (W == Kind::kF32) {
    *lo = _mm256_loadu_ps(reinterpret_cast<const float*>(at));
    *hi = _mm256_loadu_ps(reinterpret_cast<const float*>(at) + 8);
    return;
  }
  __m256i a, b;
  if (W == Kind::kI8) {
    a = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at)));
    b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at + 8)));
  } else {
    const __m256i up = _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0);
    a = _mm256_srai_epi32(_mm256_sllv_epi32(_mm256_set1_epi32(dword_at(at)), up), 28);
    b = _mm256_srai_epi32(_mm256_sllv_epi32(_mm256_set1_epi32(dword_at(at + 4)), up), 28);
  }
  *lo = _mm256_mul_ps(_mm256_cvtepi32_ps(a), _mm256_loadu_ps(s));
  *hi = _mm256_mul_ps(_mm256_cvtepi32_ps(b), _mm256_loadu_ps(s + 8));
}

// The AVX-512 loader: one panel row as one 16-float vector.
template <Kind W>
__attribute__((target("avx512f"))) inline __m512 load_avx512(const char* at, const float* s) {
  if (W == Kind::kF32) return _mm512_loadu_ps(reinterpret_cast<const float*>(at));
  __m512i q;
  if (W == Kind::kI8) {
    q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
  } else {
    const __m512i dwords = _mm512_castsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at)));
    const __m512i which = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i up = _mm512_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0, 28, 24, 20, 16, 12, 8, 4, 0);
    q = _mm512_srai_epi32(_mm512_sllv_epi32(_mm512_permutexvar_epi32(which, dwords), up), 28);
  }
  return _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_loadu_ps(s));
}

template <Kind W, int R, int P>
__attribute__((target("avx2,fma"))) void tile_fma(const Tile& t) {
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
  const char* w = t.w;
  const int64_t steps = t.steps, ldx = t.ldx, ldw = t.ldw;
  const bool prefetch = t.prefetch;
  for (int64_t k = 0; k < steps;) {
    const float* s;
    const int64_t end = group_end<W>(t, k, &s);
    for (; k < end; ++k) {
      __m256 v[A];
      const bool fetch = prefetch && prefetch_step<W>(k);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const char* at = w + p * ldw + k * row_bytes<W>();
        if (fetch) _mm_prefetch(at + kBlockK * row_bytes<W>(), _MM_HINT_T0);
        load_avx2<W>(at, s + kPanel * p, &v[2 * p], &v[2 * p + 1]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 8
        for (int j = 0; j < A; ++j) acc[r * A + j] = _mm256_fmadd_ps(b, v[j], acc[r * A + j]);
      }
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
template <Kind W, int R, int P>
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
  const char* w = t.w;
  const int64_t steps = t.steps, ldx = t.ldx, ldw = t.ldw;
  const bool prefetch = t.prefetch;
  for (int64_t k = 0; k < steps;) {
    const float* s;
    const int64_t end = group_end<W>(t, k, &s);
    for (; k < end; ++k) {
      __m512 v[P];
      const bool fetch = prefetch && prefetch_step<W>(k);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const char* at = w + p * ldw + k * row_bytes<W>();
        if (fetch) _mm_prefetch(at + kBlockK * row_bytes<W>(), _MM_HINT_T0);
        v[p] = load_avx512<W>(at, s + kPanel * p);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 b = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 8
        for (int p = 0; p < P; ++p) acc[r * P + p] = _mm512_fmadd_ps(b, v[p], acc[r * P + p]);
      }
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
template <Kind W, int R, int P>
void tile_portable(const Tile& t) {
  constexpr int C = P * kPanel;
  float acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = t.in == nullptr ? 0.0f : t.in[r * t.ldin + c];
  for (int64_t k = 0; k < t.steps;) {
    const float* s;
    const int64_t end = group_end<W>(t, k, &s);
    for (; k < end; ++k) {
      float v[C];
      for (int p = 0; p < P; ++p)
        for (int j = 0; j < kPanel; ++j)
          v[p * kPanel + j] = load_scalar<W>(t.w + p * t.ldw + k * row_bytes<W>(), j,
                                             W == Kind::kF32 ? nullptr : s + p * kPanel);
      for (int r = 0; r < R; ++r) {
        const float b = t.x[r * t.ldx + k];
        for (int c = 0; c < C; ++c) acc[r][c] += b * v[c];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) t.out[r * t.ldout + c] = t.bias == nullptr ? acc[r][c] : acc[r][c] + t.bias[c];
}

using TileFn = void (*)(const Tile&);

// Vector registers a tile may hold as accumulators (the rest: the panels' weights and the broadcast), and how many
// one row of one panel takes.
int64_t accumulators() { return isa() == Isa::kAvx512 ? 24 : 12; }
int64_t registers_per_panel() { return isa() == Isa::kAvx512 ? 1 : 2; }

template <Kind W, int P>
TileFn tile_for_rows(int64_t rows) {
  static const TileFn portable[kMaxRows] = {tile_portable<W, 1, P>, tile_portable<W, 2, P>, tile_portable<W, 3, P>,
                                            tile_portable<W, 4, P>, tile_portable<W, 5, P>, tile_portable<W, 6, P>};
#ifdef OPTIMUM_NEURON_X86
  static const TileFn fma[kMaxRows] = {tile_fma<W, 1, P>, tile_fma<W, 2, P>, tile_fma<W, 3, P>,
                                       tile_fma<W, 4, P>, tile_fma<W, 5, P>, tile_fma<W, 6, P>};
  static const TileFn avx512[kMaxRows] = {tile_avx512<W, 1, P>, tile_avx512<W, 2, P>, tile_avx512<W, 3, P>,
                                          tile_avx512<W, 4, P>, tile_avx512<W, 5, P>, tile_avx512<W, 6, P>};
  if (isa() == Isa::kAvx512) return avx512[rows - 1];
  if (isa() == Isa::kAvx2) return fma[rows - 1];
#endif
  return portable[rows - 1];
}

template <Kind W>
TileFn tile_for(int64_t rows, int64_t panels) {
  switch (panels) {
    case 1: return tile_for_rows<W, 1>(rows);
    case 2: return tile_for_rows<W, 2>(rows);
    case 3: return tile_for_rows<W, 3>(rows);
    default: return tile_for_rows<W, 4>(rows);
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
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      const int64_t ld = per_tile * kPanel;
      std::vector<float> partial(K > kBlockK ? M * ld : 0);
      for (int64_t g = begin; g < end; ++g) {
        const int64_t first = g * per_tile, count = std::min(per_tile, panels - first), col = first * kPanel;
        for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
          const int64_t steps = std::min(kBlockK, K - k0);
          const bool last = k0 + steps == K;
          for (int64_t blk = 0, m = 0; blk < blocks.count; m += blocks.rows(blk), ++blk) {
            float* sums = partial.data() + m * ld;
            const Tile t{xp + m * K + k0, K, wp + first * ldw + k0 * row_bytes<W>(), ldw, steps,
                         k0 == 0 ? nullptr : sums, ld,
                         last ? yp + m * width + col : sums, last ? width : ld,
                         last && bp != nullptr ? bp + col : nullptr, blk == 0,
                         sp == nullptr ? nullptr : sp + col, width, k0, group};
            tile_for<W>(blocks.rows(blk), count)(t);
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
