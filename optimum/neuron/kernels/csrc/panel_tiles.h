// The register tiles of the toolkit's panel GEMM, shared by packed_linear.cpp (the linear layers) and
// chunk_attention.cpp (the two products of a prefill chunk's attention): y [M, 16 P] = x [M, K] times P panels of
// [K, 16] (`Tile`, `tile_for`), on the AVX-512, AVX2 + FMA and portable paths; `panel_group`, one group of panels over
// every K block and row block (what packed_linear's threads each run); `gemm_serial`, the whole product on one
// thread. Every output element of fp32 and int8 panels is one fp32 accumulator taking x[m, k] * w[k, n] for
// k = 0, 1, ... in order, whatever the blocking (packed_linear.cpp states the rule); int4 panels sum each run of a
// scale group, then scale it ("int4 tiles" below).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "isa.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define OPTIMUM_NEURON_X86 1
#endif

namespace optimum_neuron {
namespace {
constexpr int64_t kPanel = 16;     // output columns per panel (two 8-float vectors)
constexpr int64_t kBlockK = 64;    // K steps per block (`block_k`: a few row blocks)
constexpr int64_t kDeepBlockK = 576;  // K steps per block of a product with many row blocks (`block_k`)
constexpr int64_t kShortBlockK = 32;  // K steps per block of streamed fp32 weights at 2-4 row blocks, Intel (`block_k`)
constexpr int64_t kMaxRows = 8;    // rows per tile, at most (`max_rows`)
constexpr int64_t kMaxPanels = 4;  // panels per tile
constexpr int64_t kLine = 64;      // bytes per cache line (one prefetch)

// What a panel holds: fp32 weights, or int8 / int4 weights with fp32 scales (packed_qlinear).
enum class Kind { kF32, kI8, kI4 };

// Bytes of one panel row (16 columns at one k) per kind: 16 floats, 16 int8, 16 nibbles.
template <Kind W>
constexpr int64_t row_bytes() {
  return W == Kind::kF32 ? 64 : W == Kind::kI8 ? 16 : 8;
}

// The k steps of a K block at which a tile prefetches: `first`, then every `steps` (`fetch_share`).
struct FetchShare {
  int64_t first, steps;
};

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
  int64_t ahead;        // prefetch this many bytes ahead of the panel rows read (0: none; `prefetch_ahead`)
  FetchShare fetch;     // the k steps that prefetch (`fetch_share`)
  bool once;            // the panels are read once: prefetched non-temporally (`prefetch_line`)
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

// A tile's prefetch steps in order: `due(k)` is true at each of them, never when the tile has no prefetch distance.
struct FetchCursor {
  int64_t next, steps;
  explicit FetchCursor(const Tile& t) : next(t.ahead != 0 ? t.fetch.first : -1), steps(t.fetch.steps) {}
  bool due(int64_t k) {
    if (k != next) return false;
    next += steps;
    return true;
  }
};

// Where step k of a panel starts: its row, or for int4 the 16 bytes of the pair of steps (k & ~1, k | 1) that holds it
// (byte j: column j at the even step in its low nibble, at the odd step in its high one).
template <Kind W>
inline const char* row_at(const char* panel, int64_t k) {
  return W == Kind::kI4 ? panel + (k >> 1) * 16 : panel + k * row_bytes<W>();
}

#ifdef OPTIMUM_NEURON_X86
// Prefetch the cache line at `at` into L1: non-temporally where the tile reads its panels once (`streams_once`), so
// a decode step's stream of weights does not push out of the caches what the step reads again (its KV cache, the
// activations).
inline void prefetch_line(const char* at, bool once) {
  if (once) {
    _mm_prefetch(at, _MM_HINT_NTA);
  } else {
    _mm_prefetch(at, _MM_HINT_T0);
  }
}
#endif

// The portable loader: column j of a panel row (fp32, or int8 dequantized in fp32 as one multiply: one rounding).
template <Kind W>
inline float load_scalar(const char* at, int64_t j, const float* s) {
  static_assert(W != Kind::kI4, "int4 panels have their own tiles");
  if (W == Kind::kF32) return reinterpret_cast<const float*>(at)[j];
  return static_cast<float>(reinterpret_cast<const int8_t*>(at)[j]) * s[j];
}

// The int4 value of column j at step k, from the 16 bytes of its pair of steps (`row_at`): a signed 4-bit nibble.
inline float int4_scalar(const char* pair, int64_t k, int64_t j) {
  const uint8_t byte = reinterpret_cast<const uint8_t*>(pair)[j];
  const int nibble = (k & 1) ? (byte >> 4) : (byte & 0x0F);
  return static_cast<float>((nibble ^ 8) - 8);
}

#ifdef OPTIMUM_NEURON_X86
// The AVX2 loader: a panel row (fp32, or int8 dequantized as one multiply) as two 8-float vectors.
template <Kind W>
__attribute__((target("avx2,fma"))) inline void load_avx2(const char* at, const float* s, __m256* lo, __m256* hi) {
  static_assert(W != Kind::kI4, "int4 panels have their own tiles");
  if (W == Kind::kF32) {
    *lo = _mm256_loadu_ps(reinterpret_cast<const float*>(at));
    *hi = _mm256_loadu_ps(reinterpret_cast<const float*>(at) + 8);
    return;
  }
  const __m256i a = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at)));
  const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at + 8)));
  *lo = _mm256_mul_ps(_mm256_cvtepi32_ps(a), _mm256_loadu_ps(s));
  *hi = _mm256_mul_ps(_mm256_cvtepi32_ps(b), _mm256_loadu_ps(s + 8));
}

// The AVX-512 loader: a panel row (fp32, or int8 dequantized as one multiply) as one 16-float vector.
template <Kind W>
__attribute__((target("avx512f"))) inline __m512 load_avx512(const char* at, const float* s) {
  static_assert(W != Kind::kI4, "int4 panels have their own tiles");
  if (W == Kind::kF32) return _mm512_loadu_ps(reinterpret_cast<const float*>(at));
  const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
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
  const int64_t ahead = t.ahead;
  FetchCursor cursor(t);
  for (int64_t k = 0; k < steps;) {
    const float* s;
    const int64_t end = group_end<W>(t, k, &s);
    for (; k < end; ++k) {
      __m256 v[A];
      const bool fetch = cursor.due(k);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const char* at = row_at<W>(w + p * ldw, k);
        if (fetch) prefetch_line(at + ahead, t.once);
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

// One step's fused multiply-adds of an AVX-512 tile: acc[r, p] += x[r * ldx] * v[p], row by row.
template <int R, int P>
__attribute__((target("avx512f"))) inline void step_avx512(__m512* acc, const float* x, int64_t ldx, const __m512* v) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512 b = _mm512_set1_ps(x[r * ldx]);
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) acc[r * P + p] = _mm512_fmadd_ps(b, v[p], acc[r * P + p]);
  }
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
  const int64_t ahead = t.ahead;
  FetchCursor cursor(t);
  for (int64_t k = 0; k < steps;) {
    const float* s;
    const int64_t end = group_end<W>(t, k, &s);
    for (; k < end; ++k) {
      __m512 v[P];
      const bool fetch = cursor.due(k);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const char* at = row_at<W>(w + p * ldw, k);
        if (fetch) prefetch_line(at + ahead, t.once);
        v[p] = load_avx512<W>(at, s + kPanel * p);
      }
      step_avx512<R, P>(acc, x + k, ldx, v);
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
          v[p * kPanel + j] =
              load_scalar<W>(row_at<W>(t.w + p * t.ldw, k), j, W == Kind::kF32 ? nullptr : s + p * kPanel);
      for (int r = 0; r < R; ++r) {
        const float b = t.x[r * t.ldx + k];
        for (int c = 0; c < C; ++c) acc[r][c] += b * v[c];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) t.out[r * t.ldout + c] = t.bias == nullptr ? acc[r][c] : acc[r][c] + t.bias[c];
}

// int4 tiles. Their sums take the scales once per run instead of once per weight: for each run of k steps that share
// a scale group inside a K block (`group_end`), g = the sum over the run, in order, of x[m, k] * q[k, n] with q the
// nibble's integer (exact as a float; fused multiply-adds from zero on the vector paths), then
// out[m, n] = fma(g, scale[n], out[m, n]), out being zero before the first run and the partial sums after it (the
// portable path: g * scale + out, two roundings); the bias last. No multiply per weight, so a decode step's int4
// products are bound by the stream of bytes rather than by the vector units; the order depends only on the group
// size and the K block, never on the rows, the blocking or the threads, so a row's result still depends on that row
// only, and the AVX2 and AVX-512 paths are bitwise equal. The stream is prefetched kPrefetchI4 bytes ahead (a panel
// of int4 advances 8 bytes a step: one block ahead was too short to hide the memory's latency), into the next
// group's panels near a panel's end (`prefetch_ahead`).
constexpr int64_t kPrefetchI4 = 1024;

// The start of a run's sums: zero before the tile's first run when the tile starts the product (t.in null), else the
// partial sums so far (t.in before the tile's first run, t.out after it), row stride *ld.
inline const float* run_base(const Tile& t, bool first, int64_t* ld) {
  *ld = first ? t.ldin : t.ldout;
  return first ? t.in : t.out;
}

// The portable int4 tile (no fused multiply-add: the machine's own rounding, the same order).
template <int R, int P>
void tile_int4_portable(const Tile& t) {
  constexpr int C = P * kPanel;
  for (int64_t k = 0, run = 0; k < t.steps; ++run) {
    const float* s;
    const int64_t end = group_end<Kind::kI4>(t, k, &s);
    float g[R][C] = {};
    for (; k < end; ++k) {
      float v[C];
      for (int p = 0; p < P; ++p)
        for (int j = 0; j < kPanel; ++j)
          v[p * kPanel + j] = int4_scalar(row_at<Kind::kI4>(t.w + p * t.ldw, k), k, j);
      for (int r = 0; r < R; ++r) {
        const float b = t.x[r * t.ldx + k];
        for (int c = 0; c < C; ++c) g[r][c] += b * v[c];
      }
    }
    int64_t ld;
    const float* base = run_base(t, run == 0, &ld);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        t.out[r * t.ldout + c] = g[r][c] * s[c] + (base == nullptr ? 0.0f : base[r * ld + c]);
  }
  if (t.bias != nullptr)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) t.out[r * t.ldout + c] += t.bias[c];
}

#ifdef OPTIMUM_NEURON_X86
// int4 on the AVX2 path: the 16 bytes of a pair of steps, sign-extended one byte per lane, hold the odd step's
// value as the byte's top nibble (an arithmetic right shift by 4 gives it with its sign) and the even step's as its
// low nibble (left by 28, then arithmetic right by 28): the same integers as the portable (n ^ 8) - 8.
__attribute__((target("avx2,fma"))) inline __m256 nibble_avx2(const char* bytes, bool odd) {
  const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  return _mm256_cvtepi32_ps(odd ? _mm256_srai_epi32(b, 4) : _mm256_srai_epi32(_mm256_slli_epi32(b, 28), 28));
}

template <int R, int P>
__attribute__((target("avx2,fma"))) void tile_int4_fma(const Tile& t) {
  constexpr int A = 2 * P;
  const int64_t ahead = t.ahead;
  FetchCursor cursor(t);
  for (int64_t k = 0, run = 0; k < t.steps; ++run) {
    const float* s;
    const int64_t end = group_end<Kind::kI4>(t, k, &s);
    __m256 g[R * A];
#pragma GCC unroll 32
    for (int i = 0; i < R * A; ++i) g[i] = _mm256_setzero_ps();
    for (; k < end; ++k) {
      __m256 v[A];
      const bool fetch = cursor.due(k);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const char* at = row_at<Kind::kI4>(t.w + p * t.ldw, k);
        if (fetch) prefetch_line(at + ahead, t.once);
        v[2 * p] = nibble_avx2(at, k & 1);
        v[2 * p + 1] = nibble_avx2(at + 8, k & 1);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 b = _mm256_broadcast_ss(t.x + r * t.ldx + k);
#pragma GCC unroll 8
        for (int j = 0; j < A; ++j) g[r * A + j] = _mm256_fmadd_ps(b, v[j], g[r * A + j]);
      }
    }
    int64_t ld;
    const float* base = run_base(t, run == 0, &ld);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < A; ++j) {
        const __m256 prior = base == nullptr ? _mm256_setzero_ps() : _mm256_loadu_ps(base + r * ld + 8 * j);
        const __m256 scale = _mm256_loadu_ps(s + 8 * j);
        _mm256_storeu_ps(t.out + r * t.ldout + 8 * j, _mm256_fmadd_ps(g[r * A + j], scale, prior));
      }
  }
  if (t.bias != nullptr)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < A; ++j) {
        float* out = t.out + r * t.ldout + 8 * j;
        _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), _mm256_loadu_ps(t.bias + 8 * j)));
      }
}

// The AVX-512 int4 tile. One 16-byte load sign-extended serves a pair of steps; a nibble's integer comes from a
// 16-float table (a permute reads only the index's low 4 bits: the byte for the even step, the byte shifted right by 4
// for the odd one): the same floats as the AVX2 path's conversion, in one instruction.
template <int R, int P>
__attribute__((target("avx512f"))) void tile_int4_avx512(const Tile& t) {
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  const int64_t ahead = t.ahead;
  FetchCursor cursor(t);
  for (int64_t k = 0, run = 0; k < t.steps; ++run) {
    const float* s;
    const int64_t end = group_end<Kind::kI4>(t, k, &s);
    __m512 g[R * P];
#pragma GCC unroll 32
    for (int i = 0; i < R * P; ++i) g[i] = _mm512_setzero_ps();
    for (; k < end; k += 2) {  // k is even: blocks, groups and K are
      __m512i bytes[P];
      __m512 v[P];
      const bool fetch = cursor.due(k);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const char* at = row_at<Kind::kI4>(t.w + p * t.ldw, k);
        if (fetch) prefetch_line(at + ahead, t.once);
        bytes[p] = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
        v[p] = _mm512_permutexvar_ps(bytes[p], values);
      }
      step_avx512<R, P>(g, t.x + k, t.ldx, v);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) v[p] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes[p], 4), values);
      step_avx512<R, P>(g, t.x + k + 1, t.ldx, v);
    }
    int64_t ld;
    const float* base = run_base(t, run == 0, &ld);
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      const __m512 scale = _mm512_loadu_ps(s + kPanel * p);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 prior = base == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(base + r * ld + kPanel * p);
        _mm512_storeu_ps(t.out + r * t.ldout + kPanel * p, _mm512_fmadd_ps(g[r * P + p], scale, prior));
      }
    }
  }
  if (t.bias != nullptr)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        float* out = t.out + r * t.ldout + kPanel * p;
        _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), _mm512_loadu_ps(t.bias + kPanel * p)));
      }
}
#endif

using TileFn = void (*)(const Tile&);

// Vector registers a tile may hold as accumulators (the rest: the panels' weights and the broadcast): 24 of AVX-512's
// 32, one per row of one panel; 12 of AVX2's 16, two per row of one panel. The portable path sizes its tiles as AVX2's.
constexpr int64_t kAccumulators512 = 24, kPanelRegisters512 = 1;
constexpr int64_t kAccumulators256 = 12, kPanelRegisters256 = 2;
int64_t accumulators() { return isa() == Isa::kAvx512 ? kAccumulators512 : kAccumulators256; }
int64_t registers_per_panel() { return isa() == Isa::kAvx512 ? kPanelRegisters512 : kPanelRegisters256; }

// Whether a tile of R rows x P panels fits a path's accumulators. Only those are compiled: `max_rows` and
// `panels_per_tile` never ask for another. The 60 AVX2 and 60 portable tiles that would not fit (and 6 AVX-512 ones)
// took 40 % of packed_linear.cpp's compile for nothing: 53 s of g++ with them on a 2-core Zen 3 VM, 31.5 s without.
template <int R, int P>
constexpr bool fits_avx512() {
  return kPanelRegisters512 * R * P <= kAccumulators512;
}
template <int R, int P>
constexpr bool fits_avx2() {
  return kPanelRegisters256 * R * P <= kAccumulators256;
}

// Each path's tile of R rows x P panels of kind W (null where it does not fit): int4 panels have their own.
template <Kind W, int R, int P>
constexpr TileFn portable_tile() {
  if constexpr (!fits_avx2<R, P>()) return nullptr;
  else if constexpr (W == Kind::kI4) return tile_int4_portable<R, P>;
  else return tile_portable<W, R, P>;
}

#ifdef OPTIMUM_NEURON_X86
template <Kind W, int R, int P>
constexpr TileFn fma_tile() {
  if constexpr (!fits_avx2<R, P>()) return nullptr;
  else if constexpr (W == Kind::kI4) return tile_int4_fma<R, P>;
  else return tile_fma<W, R, P>;
}

template <Kind W, int R, int P>
constexpr TileFn avx512_tile() {
  if constexpr (!fits_avx512<R, P>()) return nullptr;
  else if constexpr (W == Kind::kI4) return tile_int4_avx512<R, P>;
  else return tile_avx512<W, R, P>;
}
#endif

template <Kind W, int P>
TileFn tile_for_rows(int64_t rows) {
  static const TileFn portable[kMaxRows] = {portable_tile<W, 1, P>(), portable_tile<W, 2, P>(),
                                            portable_tile<W, 3, P>(), portable_tile<W, 4, P>(),
                                            portable_tile<W, 5, P>(), portable_tile<W, 6, P>(),
                                            portable_tile<W, 7, P>(), portable_tile<W, 8, P>()};
#ifdef OPTIMUM_NEURON_X86
  static const TileFn fma[kMaxRows] = {fma_tile<W, 1, P>(), fma_tile<W, 2, P>(), fma_tile<W, 3, P>(),
                                       fma_tile<W, 4, P>(), fma_tile<W, 5, P>(), fma_tile<W, 6, P>(),
                                       fma_tile<W, 7, P>(), fma_tile<W, 8, P>()};
  static const TileFn avx512[kMaxRows] = {avx512_tile<W, 1, P>(), avx512_tile<W, 2, P>(), avx512_tile<W, 3, P>(),
                                          avx512_tile<W, 4, P>(), avx512_tile<W, 5, P>(), avx512_tile<W, 6, P>(),
                                          avx512_tile<W, 7, P>(), avx512_tile<W, 8, P>()};
  if (isa() == Isa::kAvx512) return avx512[rows - 1];
  if (isa() == Isa::kAvx2) return fma[rows - 1];
#endif
  return portable[rows - 1];
}

template <Kind W>
TileFn tile_for_panels(int64_t rows, int64_t panels) {
  switch (panels) {
    case 1: return tile_for_rows<W, 1>(rows);
    case 2: return tile_for_rows<W, 2>(rows);
    case 3: return tile_for_rows<W, 3>(rows);
    default: return tile_for_rows<W, 4>(rows);
  }
}

// The tile of `rows` rows x `panels` panels on this CPU's path; one that does not fit its accumulators (`fits_avx2`,
// `fits_avx512`) is a bug of the caller's blocking, raised rather than called.
template <Kind W>
TileFn tile_for(int64_t rows, int64_t panels) {
  const TileFn tile = tile_for_panels<W>(rows, panels);
  TORCH_CHECK(tile != nullptr, "optimum_neuron: no ", rows, " x ", panels, " tile on this CPU's path (",
              accumulators(), " accumulators)");
  return tile;
}

// Rows per tile, at most: AVX-512 holds 8 rows x 3 panels of accumulators (24 of its 32 registers), so a batch-8
// decode step streams each weight panel once for all its rows; AVX2's 12 accumulators take 6 rows x 1 panel.
int64_t max_rows() { return isa() == Isa::kAvx512 ? 8 : 6; }

// Rows split into blocks of at most `max_rows`. AVX-512: as even as possible (14 rows: 7 + 7), each block taking a
// group's panels in one tile. AVX2 and portable: full blocks of `max_rows` first, then the rest in one narrower block
// (8 rows: 6 + 2), which takes as many panels per tile as its accumulators allow (`group_rows`: 2 rows x 3 panels),
// while each full block runs the group one panel per tile (`panel_group`). Measured on the 2-core Zen 3 VM (AVX2, 30
// layers of SmolLM2's four projections from the last-level cache, the two splits interleaved in one process): 8
// rows 0.90-0.95x the even split's time (4 + 4: 8 accumulators, one fused multiply-add each per step, no slack over
// the FMA's latency), 10 rows 0.79-0.90x, 26-40 rows 0.81-0.96x, 256 rows and weights streamed from memory at 8 rows
// ~1.0x; AVX-512 was not measured with it and keeps the even split.
struct RowBlocks {
  int64_t count, base, extra;  // `extra` blocks of base + 1 rows, then blocks of base rows
  int64_t tail;                // non-zero: the last block has this many rows instead
  int64_t rows(int64_t b) const { return tail != 0 && b == count - 1 ? tail : base + (b < extra ? 1 : 0); }
};

// `m` rows in as few blocks of at most `most` rows as can hold them, as even as possible (14 rows, 8 at most: 7 + 7).
RowBlocks even_row_blocks(int64_t m, int64_t most) {
  const int64_t count = (m + most - 1) / most;
  return {count, m / count, m % count, 0};
}

RowBlocks row_blocks(int64_t m) {
  if (isa() == Isa::kAvx512) return even_row_blocks(m, max_rows());
  const int64_t count = (m + max_rows() - 1) / max_rows();
  return {count, max_rows(), 0, m - (count - 1) * max_rows()};
}

// The most panels one tile of `rows` rows holds in the accumulators.
int64_t panels_fit(int64_t rows) {
  return std::max<int64_t>(1, std::min<int64_t>(kMaxPanels, accumulators() / (registers_per_panel() * rows)));
}

// The rows that size a group of panels (`panels_per_tile`): the widest block's on AVX-512, the narrowest block's
// (the last) on the other paths (`row_blocks`).
int64_t group_rows(const RowBlocks& blocks) {
  return isa() == Isa::kAvx512 ? blocks.rows(0) : blocks.rows(blocks.count - 1);
}

// Panels per group: the most the accumulators allow for a tile of `rows` rows (`group_rows`), lowered when that
// balances the threads better (12 panels on 2 threads: 3 groups of 4 would leave one thread with twice the work).
int64_t panels_per_tile(int64_t rows, int64_t panels, int64_t threads) {
  const int64_t most = panels_fit(rows);
  int64_t best = 1, best_cost = INT64_MAX;
  for (int64_t p = most; p >= 1; --p) {
    const int64_t groups = (panels + p - 1) / p;
    const int64_t cost = ((groups + threads - 1) / threads) * p;
    if (cost < best_cost) best = p, best_cost = cost;
  }
  return best;
}

// Whether a product of kind W with these row blocks reads each panel once: fp32 with one row block (up to `max_rows`
// rows: a decode step), where the product waits on the stream of its weights. Each thread then takes one panel per
// group (`panels_per_group`), so its consecutive panels are one contiguous stream of memory rather than up to
// kMaxPanels streams a panel apart, and prefetches them non-temporally (`prefetch_line`); at 1 row its tile is one
// chain of fused multiply-adds, 64 bytes per latency (~50 GB/s a core at 3 GHz, more than a core streams). SmolLM2's 30
// layers of products and its LM head at 1 row, weights streamed (2 threads, the variants alternating in one process,
// 2-core Zen 5 VM, AVX-512): 0.90-0.91x the time of groups of 3-4 panels prefetched into L1 (one panel alone
// 0.94-0.95x); 2, 4 and 8 rows 0.94, 0.89 and 0.91x (the hint alone: 1.0x at 2 and 4 rows, 0.96-0.97x at 8); the AVX2
// path 0.92x at 1 row, 0.96x at 6; the engine's decode step 0.86-0.91x at batch 1, 0.96-1.00x at batch 8. int8 panels
// keep their groups and hint (one panel: 1.24-1.40x; the hint: 1.03-1.04x: they wait on dequantizing, which one
// accumulator chain per row serialises); so do 2 and more row blocks (one panel at 16 and 24 rows: 1.17-1.26x, every
// row block reading the panel's K block again). Only on CPUs where that measured faster (`stream_once_pays`: AMD's
// with AVX-512; on an Intel Xeon the groups of panels prefetched into L1 read at the memory's rate and the stream did
// not, and on a Zen 3 the batch-1 decode step took 1.09x the groups' time with it).
template <Kind W>
inline bool streams_once(const RowBlocks& blocks) {
  return W == Kind::kF32 && blocks.count == 1 && stream_once_pays();
}

// Panels per group of a product of kind W on `threads` threads: one where it `streams_once`, else `panels_per_tile`.
template <Kind W>
inline int64_t panels_per_group(const RowBlocks& blocks, int64_t panels, int64_t threads) {
  return streams_once<W>(blocks) ? 1 : panels_per_tile(group_rows(blocks), panels, threads);
}

// One product y = x [M, K] times panels of kind W: the operands and strides every group of panels shares.
struct Product {
  const float* x;       // row stride ldx
  int64_t ldx;
  int64_t K;
  const char* w;        // the first panel
  int64_t ldw;          // panel stride in bytes
  float* y;             // row stride ldy, 16 columns per panel
  int64_t ldy;
  const float* bias;    // one per column, padded to the panels (null: none)
  const float* scales;  // quantized kinds: [groups, lds], the group size `group`
  int64_t lds;
  int64_t group;
  bool prefetch;        // the row blocks prefetch the panels ahead (`prefetch_ahead`, `fetch_share`)
  int64_t next = 0;     // fp32 and int8: bytes from a group's first panel to what its thread reads after it (0: the
                        // panels that follow the group's in memory)
};

// How far ahead the row blocks of a K block prefetch each panel's stream: fp32 and int8, the next K block of
// the same panels; int4, kPrefetchI4 bytes. Where that would pass the panel's end, the same distance into the panels
// that follow the group's in memory, the group a thread of packed_linear takes next (a thread runs consecutive
// groups): fp32 and int8 prefetch the next group's first K block during their last one (or what `Product::next`
// names: packed_linear_swiglu's thread reads the gate's panels of a span, then the up's same panels); int4 shifts
// its distance by the group's other panels (past the end of panel p lies panel p + 1, which the tile is reading
// already). Without that, each group's first K block was read with no prefetch in flight: SmolLM2's 211 fp32
// products of a decode step streamed from memory took 3-4 % longer (1 and 8 rows), its 210 int4 ones 5-11 %.
template <Kind W>
inline int64_t prefetch_ahead(const Product& p, int64_t count, int64_t k0, int64_t block, bool last) {
  if (W == Kind::kI4) {
    const bool past = (k0 + kBlockK) * row_bytes<W>() + kPrefetchI4 > p.ldw;
    return past ? kPrefetchI4 + (count - 1) * p.ldw : kPrefetchI4;
  }
  return last ? (p.next != 0 ? p.next : count * p.ldw) - k0 * row_bytes<W>() : block * row_bytes<W>();
}

// K steps per block of a product with these row blocks, its panels streamed from memory (``streamed``: prefetched, a
// linear layer's weights) or not (the chunk attention's operands, in the caches). Up to 2 row blocks (a decode step, a
// short chunk), blocks of kBlockK: the weights' stream is what the product waits on, and a short block keeps the panels
// just read in L1 for the second row block and the prefetch one block ahead. From 3 row blocks on (a prefill chunk),
// blocks of kDeepBlockK: the product is bound by its multiply-adds, and every K block costs each tile a load and a
// store of its partial sums; SmolLM2's 210 fp32 products of a 256-row chunk (weights streamed, 2 threads, in one
// process, AMD Zen) took 0.90-0.95x the time of blocks of 64, 24 to 1,024 rows 0.86-0.96x, while 8 and 16 rows took
// 1.02-1.08x. int4 keeps kBlockK: its sums run per scale group inside a K block, so its block is part of its
// arithmetic. On Intel CPUs with AVX-512, streamed fp32 weights at 2 to 6 row blocks (9 to 48 rows: a verification
// call's columns) take shorter blocks: measured on the Xeon VM (family 6 model 207; SmolLM2's 30 layers of products,
// weights streamed, 2 threads, the blockings alternating in one process), against blocks of 64, blocks of 32 took 12-16
// rows 0.92-0.94x, 20-32 rows 0.92-0.98x (and 0.81-0.89x the time of kDeepBlockK there), but 36 rows 1.05x; at 5 row
// blocks (33-40 rows) 64 took 0.95-0.97x kDeepBlockK's time, at 6 (41-48) the same, from 7 on (52-256 rows) kDeepBlockK
// 0.89-0.99x 64's. fp32 and int8 results do not depend on the blocking (the partial sums are stored and reloaded
// exactly).
template <Kind W>
inline int64_t block_k(const RowBlocks& blocks, bool streamed) {
  if (W == Kind::kF32 && streamed && isa() == Isa::kAvx512 && !amd_cpu() && blocks.count >= 2 && blocks.count <= 6)
    return blocks.count <= 4 ? kShortBlockK : kBlockK;
  return W != Kind::kI4 && blocks.count >= 3 ? kDeepBlockK : kBlockK;
}

// Which k steps of a K block row block `blk` of `count` prefetches on: every row block takes its share of the next
// block's cache lines (line i: row block i mod count), so the weights' stream keeps going while the later row blocks
// work on the panels the first one brought in. With one row block, every line (a decode step's products). When only
// the first row block prefetched, the stream paused for the rest of each K block: SmolLM2's 30 layers of products and
// its LM head at 16 to 40 rows (a verification call's columns, a short chunk; weights streamed, 2 threads, the two
// builds alternating in fresh processes on a 2-core Zen 4 VM) took 1.10-1.18x this schedule's time, 56 and 64 rows
// 1.03-1.08x, 8 and 256 rows the same; the batch-8 artifact's packed verification call at 16 to 56 columns
// 1.06-1.20x; int8 weights the same either way (their products are bound by the dequantizing, not the stream).
template <Kind W>
inline FetchShare fetch_share(int64_t blk, int64_t count) {
  constexpr int64_t every = kLine / row_bytes<W>();  // k steps per cache line of a panel's stream
  return {every * blk, every * count};
}

// The `count` panels from panel `first` of product `p`: K in blocks of `block_k`, every row block of `blocks` over
// each K block, in tiles of as many of the panels as the block's rows allow (`panels_fit`); ``partial`` holds M x ld
// floats of partial sums (ld: 16 x the widest group; used when K is longer than one block).
template <Kind W>
inline void panel_group(const Product& p, const RowBlocks& blocks, int64_t first, int64_t count, float* partial,
                        int64_t ld) {
  const int64_t col = first * kPanel, block = block_k<W>(blocks, p.prefetch);
  const bool once = streams_once<W>(blocks);
  for (int64_t k0 = 0; k0 < p.K; k0 += block) {
    const int64_t steps = std::min(block, p.K - k0);
    const bool last = k0 + steps == p.K;
    for (int64_t blk = 0, m = 0; blk < blocks.count; m += blocks.rows(blk), ++blk) {
      float* sums = partial + m * ld;
      const FetchShare fetch = fetch_share<W>(blk, blocks.count);
      const int64_t fit = std::min(count, panels_fit(blocks.rows(blk)));
      for (int64_t q = 0; q < count; q += fit) {
        const int64_t n = std::min(fit, count - q), c = col + q * kPanel;
        const Tile t{p.x + m * p.ldx + k0, p.ldx, row_at<W>(p.w + (first + q) * p.ldw, k0), p.ldw, steps,
                     k0 == 0 ? nullptr : sums + q * kPanel, ld,
                     last ? p.y + m * p.ldy + c : sums + q * kPanel, last ? p.ldy : ld,
                     last && p.bias != nullptr ? p.bias + c : nullptr,
                     p.prefetch ? prefetch_ahead<W>(p, count, k0, block, last) : 0, fetch, once,
                     p.scales == nullptr ? nullptr : p.scales + c, p.lds, k0, p.group};
        tile_for<W>(blocks.rows(blk), n)(t);
      }
    }
  }
}

// Row blocks of a product on one thread (`gemm_serial`) with `panels` panels. On AVX-512 with kMaxPanels panels or
// more, blocks of at most 6 rows (the accumulators over kMaxPanels; as even as possible), so that one tile takes 4
// panels: a step loads 10 vectors (4 panel rows, 6 broadcasts) for 24 fused multiply-adds, and each row of x is read
// once per 64 columns. Blocks of 8 rows (`row_blocks`) take 2 panels per tile there (`panels_per_tile`: 3 would leave
// a group of 1), 10 loads for 16 fused multiply-adds, each row read twice. The chunk attention's products (64-query
// tiles: 4 panels) of a 1,024-token prompt's chunks, SmolLM2's 9 heads, the two blockings alternating in one process
// on the Xeon VM: 0.96-0.99x the time on one thread, 0.93-0.99x on two. Otherwise `row_blocks`.
inline RowBlocks serial_row_blocks(int64_t m, int64_t panels) {
  if (isa() != Isa::kAvx512 || panels < kMaxPanels) return row_blocks(m);
  return even_row_blocks(m, accumulators() / (registers_per_panel() * kMaxPanels));
}

// y [M, 16 panels] (row stride ldy) = x [M, K] (row stride ldx) times fp32 panels w [panels, K, 16] (panel stride
// ldw floats), on the calling thread, in groups of as many panels as the registers allow (`serial_row_blocks`).
// ``partial`` holds M x 16 kMaxPanels floats of partial sums (used when K is longer than one block: `block_k`).
inline void gemm_serial(const float* x, int64_t M, int64_t K, int64_t ldx, const float* w, int64_t panels,
                        int64_t ldw, float* y, int64_t ldy, float* partial) {
  if (M <= 0) return;
  const RowBlocks blocks = serial_row_blocks(M, panels);
  const int64_t per_tile = panels_per_tile(group_rows(blocks), panels, 1);
  const Product p{x, ldx, K, reinterpret_cast<const char*>(w), ldw * static_cast<int64_t>(sizeof(float)),
                  y, ldy, nullptr, nullptr, 0, 0, false};
  for (int64_t first = 0; first < panels; first += per_tile)
    panel_group<Kind::kF32>(p, blocks, first, std::min(per_tile, panels - first), partial, per_tile * kPanel);
}

}  // namespace
}  // namespace optimum_neuron
