// optimum_neuron::chunk_attention: the attention of a prefill chunk (or of each row's tokens of a verification call)
// over its sequence's KV window, read from the block-paged cache where it lies, and over the chunk's own keys, fp32
// on the CPU.
//
// Inputs. q [B, Hq, C, D]; k, v [B, Hk, C, D]: the chunk's own keys and values (not yet in the cache), each read where
// it lies (any strides with contiguous rows of D: a view of the projections' output is not copied first); k_cache and
// v_cache [blocks, Hk, block_size, D], contiguous; block_table [B, nb] int64 (absent: no earlier cache is read, the
// context-encoding graph); mask [B, 1, C, L] bool, L = nb * block_size + C, keys ordered [window | chunk]: the caller's
// mask rule (causality, actual tokens, sliding window). One rule the kernel relies on: query t never attends a chunk
// key after its own (causality), so a tile of queries ending at t1 reads keys [0, W + t1) only. Output [B, Hq, C, D].
//
// Per call. The mask is read once as bits: for each tile of 64 queries and each key, one 64-bit word whose bit c says
// whether query c of the tile attends the key (`mask_bits`: each 64 x 64 square of the mask taken row by row as bits,
// then transposed); from them, which window blocks each tile attends (`live_blocks`).
//
// Schedule. One task per (row, query head, tile of up to 64 query tokens), split over threads. A task
//   1. packs its queries, times the scale, as 16-query panels [D, 16] (`panel_tiles.h`);
//   2. computes the scores S^T [keys, queries] with the panel GEMM: the rows are the keys, each window block that a
//      query of the tile attends read in place from the cache, then the chunk's own (a block no query of the tile
//      attends is not read: the masked bucket past a prompt's first chunk, the blocks a sliding window left behind;
//      the tile's own keys go 16 at a time to the panels of the queries at or after them, the only ones causality
//      lets attend them);
//   3. takes each query's softmax over the keys it attends (two passes over S^T: the maximum, every column of a key at
//      once, then exp(s - max) and the total; keys the mask leaves out weigh exactly 0; a key's mask bits are the
//      lanes' mask), writing the weights as panels [keys, 16];
//   4. computes the output rows [queries, D] = the weights times the values, with the queries as rows and the values
//      read in place, row by row, from the first attended block on (`values_product`), and divides by the totals.
//      On AVX2 (and the portable path) panel by panel, each panel's keys stopping at its causal end, in blocks of 256
//      keys that every row block of the panel runs before the next (`values_panel`): the sums are carried in the
//      output rows, so a block's values stay in the caches for the panel's row blocks.
// The scores run at the panel GEMM's rate, where torch's CPU flash attention runs its blocks through a generic sgemm
// and a float mask; the queries of a tile share every key and value they read. The values' product once ran on the
// same GEMM over V^T [D, keys], transposed once per call: its tiles then streamed four panels of weights and six rows
// of V^T at once. Reading the values in place, each key's row of D values serves a block of queries whose weights
// lie in one cache line, and no transposition runs: SmolLM2's chunk attention of a 1,024-token prompt's four chunks
// (9 / 3 heads, the two builds alternating in one process, bitwise equal; the Xeon VM) took 0.93x the time on two
// threads and 0.94x on one with the transposition still done, before it was removed.
//
// Order of the sums. A query's scores, maximum, total and output sums each run over keys (or head dimensions) in one
// fixed order, and keys past the tile's causal end or left out by the mask add exact zeros: a query's result depends
// on its own mask row only, not on the tile, the chunk size or the other queries (DESIGN.md invariant 4). The blocks
// skipped before a tile's first attended one would add exact zeros too (a weight of +0 times a finite value leaves a
// sum as it is, and the sums start at +0), so skipping them changes no bit. A query whose mask attends no key gets
// zeros.
//
// Instruction sets: the panel GEMM's paths (AVX-512, AVX2 + FMA, portable); the softmax likewise (16 or 8 columns per
// vector, the same values lane for lane; a key no column of the vector attends is skipped: exact zeros); the mask's
// rows read as bits 32 bytes at a time (AVX2); the queries' packing by 16-lane gathers (AVX-512); the values' product
// in tiles of up to 6 rows x 4 panels (AVX-512) or 6 rows x 1 panel (AVX2), the columns past the last 16 by std::fma
// (the same values on both); portable C++ otherwise (`isa.h`).
//
// The AVX2 path on a 2-core AMD Zen 3 VM (family 25 model 1), SmolLM2's chunk attention of a 1,024-token prompt's
// four chunks (9 / 3 heads), each change alternating with the build before it in one process, bitwise equal: row
// blocks of 6 queries instead of 4 (12 accumulators, where 8 left no slack over the fused multiply-add's latency)
// 0.969x the time; the softmax's keys that every query of the tile attends taken without the lane mask 0.989x; key
// blocks of 256 in the values' product 0.975x (128: 0.976-0.98x, 64: 0.988x, 32: 1.03x); the keys past each
// panel's causal end skipped 0.989x; together 0.886x on two threads, 0.903x on one. Not kept: the tasks split by
// their cost rather than their count (0.997x), the exp pass key by key over every column at once (1.010x). The
// AVX-512 path keeps its one pass over the keys, and stops each panel at its causal end too: on a 2-core AMD Zen 4
// VM (family 25 model 17) the same four chunks' attention over 30 layers took 0.990x the time (quartiles
// 0.978-0.998; 221 -> 217 ms), a whole 1,024-token prefill 0.998x, alternating in one process, bitwise equal.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "panel_tiles.h"
#include "vec_exp.h"

namespace optimum_neuron {
namespace {

constexpr int64_t kTile = 4 * kPanel;  // query tokens per task: the widest register tile of the GEMM
constexpr int64_t kValueKeys = 256;    // keys per block of the values' product on AVX2 and portable (`values_panel`)

// What every task of one call reads.
struct Call {
  const float* q;      // [B, Hq, C, D], strides qs (batch, head, token; a row's D values contiguous)
  const float* k;      // [B, Hk, C, D], strides ks
  const float* kc;     // k_cache [blocks, Hk, bs, D]
  const int64_t* table;  // [B, nb] or null
  const uint64_t* bits;  // the mask by tile, [B, tiles, L]: bit c of bits[b, tile, j] = mask[b, 0, 64 tile + c, j]
  const uint8_t* live;  // [B, tiles, nb]: whether a query of the tile attends a key of window block i (`live_blocks`)
  const int64_t* first;  // [B, tiles]: the first window block a query of the tile attends (nb: none)
  const float* vc;     // v_cache [blocks, Hk, bs, D]
  const float* v;      // [B, Hk, C, D], strides vs
  float* out;          // [B, Hq, C, D]
  int64_t Hq, Hk, C, D, nb, bs, L;
  float scale;
  int64_t qs[3], ks[3], vs[3];
};

// Softmax weights of one tile: for each of the `width` (a multiple of 16) query columns of s [keys, kTile] (row stride
// kTile), the weights over keys [0, keys) where the tile's mask bits attend (bit c of bits[j]: column c attends key
// j), written as panels w [width / 16, keys, 16]; totals in `total` [width].
void softmax_portable(const float* s, const uint64_t* bits, int64_t keys, int64_t width, float* w, float* total) {
  for (int64_t c = 0; c < width; ++c) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < keys; ++j)
      if ((bits[j] >> c) & 1) top = std::max(top, s[j * kTile + c]);
    float sum = 0.0f;
    float* panel = w + (c / kPanel) * keys * kPanel + c % kPanel;
    for (int64_t j = 0; j < keys; ++j) {
      const float e = (bits[j] >> c) & 1 ? std::exp(s[j * kTile + c] - top) : 0.0f;
      sum += e;
      panel[j * kPanel] = e;
    }
    total[c] = sum;
  }
}

#ifdef OPTIMUM_NEURON_X86
// Key j's mask bits for columns [c, c + 8) as 8 lanes of all ones or zeros.
__attribute__((target("avx2,fma"))) inline __m256 lanes8(uint64_t bits, int64_t c) {
  const __m256i one_each = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i word = _mm256_set1_epi32(static_cast<int>((bits >> c) & 0xFF));
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(word, one_each), one_each));
}

// The same in 8-column vectors: a key's mask bits become a lane mask; masked lanes take -inf in the maximum and
// weigh exactly 0 (the exp's result cleared by the lane mask). The maxima of all kTile columns run side by side over
// the keys, one chain per vector (a column past `width` has no mask bits: its chain stays -inf, unused), rather than
// one vector's chain over every key after another's: a single chain of maxima waits on each one's latency. The
// maximum is exact whatever the order, so the values are the same. A key every column attends (all 64 bits: the
// window's keys and the earlier chunk keys of a full tile) skips the lane mask, which would keep every lane.
__attribute__((target("avx2,fma"))) void softmax_avx2(const float* s, const uint64_t* bits, int64_t keys,
                                                      int64_t width, float* w, float* total) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 tops[kTile / 8];
  for (__m256& top : tops) top = ninf;
  for (int64_t j = 0; j < keys; ++j) {
    if (bits[j] == ~uint64_t{0}) {  // every column attends the key: no lane mask
#pragma GCC unroll 8
      for (int64_t g = 0; g < kTile / 8; ++g) tops[g] = _mm256_max_ps(tops[g], _mm256_loadu_ps(s + j * kTile + 8 * g));
      continue;
    }
#pragma GCC unroll 8
    for (int64_t g = 0; g < kTile / 8; ++g)
      tops[g] = _mm256_max_ps(tops[g],
                              _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + j * kTile + 8 * g), lanes8(bits[j], 8 * g)));
  }
  for (int64_t c = 0; c < width; c += 8) {
    const __m256 top = tops[c / 8];
    // a column that attends nothing: top stays -inf; subtract 0 instead (its weights are cleared anyway)
    const __m256 base = _mm256_blendv_ps(top, _mm256_setzero_ps(), _mm256_cmp_ps(top, ninf, _CMP_EQ_OQ));
    __m256 sum = _mm256_setzero_ps();
    float* panel = w + (c / kPanel) * keys * kPanel + c % kPanel;
    for (int64_t j = 0; j < keys; ++j) {
      if (((bits[j] >> c) & 0xFF) == 0) {  // a key no column attends (past the causal end, masked blocks): exact zeros
        _mm256_storeu_ps(panel + j * kPanel, _mm256_setzero_ps());
        continue;
      }
      const __m256 x = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j * kTile + c), base));
      const __m256 e = ((bits[j] >> c) & 0xFF) == 0xFF ? x : _mm256_and_ps(x, lanes8(bits[j], c));
      sum = _mm256_add_ps(sum, e);
      _mm256_storeu_ps(panel + j * kPanel, e);
    }
    _mm256_storeu_ps(total + c, sum);
  }
}

// The AVX-512 twin: 16 columns per vector, a key's mask bits as its 16-bit lane mask (the same values lane for lane),
// the four vectors' maxima side by side as on AVX2. That took the chunk attention of a 1,024-token prompt's chunks
// (SmolLM2's 9 heads, on one thread, the two builds alternating in one process; the Xeon VM) 0.97x the time of one
// chain per vector.
__attribute__((target("avx512f"))) void softmax_avx512(const float* s, const uint64_t* bits, int64_t keys,
                                                       int64_t width, float* w, float* total) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), zero = _mm512_setzero_ps();
  __m512 tops[kTile / kPanel];
  for (__m512& top : tops) top = ninf;
  for (int64_t j = 0; j < keys; ++j) {
#pragma GCC unroll 4
    for (int64_t g = 0; g < kTile / kPanel; ++g)
      tops[g] = _mm512_mask_max_ps(tops[g], static_cast<__mmask16>(bits[j] >> (kPanel * g)), tops[g],
                                   _mm512_loadu_ps(s + j * kTile + kPanel * g));
  }
  for (int64_t c = 0; c < width; c += kPanel) {
    const __m512 top = tops[c / kPanel];
    const __m512 base = _mm512_mask_mov_ps(top, _mm512_cmp_ps_mask(top, ninf, _CMP_EQ_OQ), zero);
    __m512 sum = zero;
    float* panel = w + (c / kPanel) * keys * kPanel;
    for (int64_t j = 0; j < keys; ++j) {
      const __mmask16 on = static_cast<__mmask16>(bits[j] >> c);
      const __m512 e =
          on == 0 ? zero : _mm512_maskz_mov_ps(on, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j * kTile + c), base)));
      sum = _mm512_add_ps(sum, e);
      _mm512_storeu_ps(panel + j * kPanel, e);
    }
    _mm512_storeu_ps(total + c, sum);
  }
}
#endif

void softmax_tile(const float* s, const uint64_t* bits, int64_t keys, int64_t width, float* w, float* total) {
#ifdef OPTIMUM_NEURON_X86
  if (isa() == Isa::kAvx512) return softmax_avx512(s, bits, keys, width, w, total);
  if (isa() != Isa::kPortable) return softmax_avx2(s, bits, keys, width, w, total);
#endif
  softmax_portable(s, bits, keys, width, w, total);
}

// A run of consecutive keys' values, read in place: n rows of D values, `ld` floats apart (`values_product`).
struct Segment {
  const float* v;
  int64_t n;
  int64_t ld;
};

// Scratch of one thread, sized for the call's largest tile.
struct Scratch {
  std::vector<float> q, s, w, partial;
  std::vector<Segment> segments, pieces;
  std::vector<int64_t> starts;
  float total[kTile];
  explicit Scratch(const Call& c)
      : q(c.D * kTile), s(c.L * kTile), w(c.L * kTile), partial(std::max({c.bs, c.C, c.D}) * kTile) {
    segments.reserve(c.nb + 1);
  }
};

// A 64 x 64 bit matrix transposed in place: bit c of a[r] becomes bit r of a[c] (six rounds, each swapping the
// off-diagonal quarters of every block of 2j x 2j bits).
inline void transpose64(uint64_t* a) {
  uint64_t m = 0x00000000FFFFFFFFULL;
  for (int j = 32; j != 0; j >>= 1, m ^= m << j) {
    for (int k = 0; k < 64; k = ((k | j) + 1) & ~j) {
      const uint64_t t = ((a[k] >> j) ^ a[k | j]) & m;
      a[k] ^= t << j;
      a[k | j] ^= t;
    }
  }
}

// Bit j of the 64 mask bytes row[0, n) (n <= 64): whether the byte is non-zero; bits from n on are zero.
uint64_t row_bits_portable(const uint8_t* row, int64_t n) {
  uint64_t word = 0;
  for (int64_t j = 0; j < n; ++j) word |= static_cast<uint64_t>(row[j] != 0) << j;
  return word;
}

#ifdef OPTIMUM_NEURON_X86
__attribute__((target("avx2"))) uint64_t row_bits_avx2(const uint8_t* row, int64_t n) {
  if (n < 64) return row_bits_portable(row, n);
  const __m256i zero = _mm256_setzero_si256();
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32));
  const uint32_t zero_lo = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(lo, zero)));
  const uint32_t zero_hi = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(hi, zero)));
  return ~(static_cast<uint64_t>(zero_hi) << 32 | zero_lo);
}
#endif

uint64_t row_bits(const uint8_t* row, int64_t n) {
#ifdef OPTIMUM_NEURON_X86
  if (isa() != Isa::kPortable) return row_bits_avx2(row, n);
#endif
  return row_bits_portable(row, n);
}

// The mask [B, C, L] bytes by tile of 64 queries: bits[(b * tiles + tile) * L + j], bit c = whether query 64 tile + c
// attends key j (zero for queries past C). Each 64 x 64 square of the mask is read row by row as bits, then
// transposed, in place of a byte transpose of the whole mask per call.
std::vector<uint64_t> mask_bits(const uint8_t* mask, int64_t B, int64_t C, int64_t L) {
  const int64_t tiles = (C + kTile - 1) / kTile, squares = (L + 63) / 64;
  std::vector<uint64_t> bits(B * tiles * L);
  at::parallel_for(0, B * tiles * squares, 1, [&](int64_t begin, int64_t end) {
    uint64_t a[64];
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / (tiles * squares), tile = unit / squares % tiles, j0 = unit % squares * 64;
      const int64_t n = std::min<int64_t>(64, L - j0);
      for (int64_t c = 0; c < 64; ++c) {
        const int64_t t = tile * kTile + c;
        a[c] = t < C ? row_bits(mask + (b * C + t) * L + j0, n) : 0;
      }
      transpose64(a);
      std::memcpy(bits.data() + (b * tiles + tile) * L + j0, a, n * sizeof(uint64_t));
    }
  });
  return bits;
}

// For each row and tile of queries, which window blocks a query of the tile attends: live[(b * tiles + tile) * nb + i].
std::vector<uint8_t> live_blocks(const uint64_t* bits, int64_t B, int64_t tiles, int64_t L, int64_t nb, int64_t bs) {
  std::vector<uint8_t> live(B * tiles * nb, 0);
  for (int64_t bt = 0; bt < B * tiles; ++bt)
    for (int64_t i = 0; i < nb; ++i) {
      uint64_t any = 0;
      for (int64_t j = i * bs; j < (i + 1) * bs; ++j) any |= bits[bt * L + j];
      live[bt * nb + i] = any != 0;
    }
  return live;
}

// For each of the `count` (row, tile) pairs, the first window block `live` marks (nb: none).
std::vector<int64_t> first_blocks(const std::vector<uint8_t>& live, int64_t count, int64_t nb) {
  std::vector<int64_t> first(count);
  for (int64_t bt = 0; bt < count; ++bt) {
    const uint8_t* row = live.data() + bt * nb;
    first[bt] = std::find(row, row + nb, 1) - row;
  }
  return first;
}

// The tile's `cols` queries q [cols, D] (row stride ldq) times the scale as panels [D, 16] (zero past `cols`).
void pack_queries_portable(const float* q, int64_t ldq, int64_t cols, int64_t panels, int64_t D, float scale,
                           float* dst) {
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t d = 0; d < D; ++d)
      for (int64_t j = 0; j < kPanel; ++j) {
        const int64_t col = p * kPanel + j;
        dst[(p * D + d) * kPanel + j] = col < cols ? q[col * ldq + d] * scale : 0.0f;
      }
}

#ifdef OPTIMUM_NEURON_X86
// A 16 x 16 block of floats transposed in registers: r[i] holds row i on entry and column i on return. Three rounds
// of in-lane unpacks and 128-bit lane shuffles, each pairing the vectors of one distance.
__attribute__((target("avx512f"))) inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  // in each 128-bit lane L of r[4 i + m]: column 4 L + m of rows 4 i .. 4 i + 3
  for (int i = 0; i < 16; i += 4) {
    for (int m = 0; m < 2; ++m) {
      const __m512d a = _mm512_castps_pd(t[i + m]), b = _mm512_castps_pd(t[i + m + 2]);
      r[i + 2 * m] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      r[i + 2 * m + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  }
  for (int m = 0; m < 4; ++m) {
    t[m] = _mm512_shuffle_f32x4(r[m], r[4 + m], 0x88);
    t[4 + m] = _mm512_shuffle_f32x4(r[m], r[4 + m], 0xDD);
    t[8 + m] = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0x88);
    t[12 + m] = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0xDD);
  }
  for (int m = 0; m < 4; ++m) {
    r[m] = _mm512_shuffle_f32x4(t[m], t[8 + m], 0x88);
    r[8 + m] = _mm512_shuffle_f32x4(t[m], t[8 + m], 0xDD);
    r[4 + m] = _mm512_shuffle_f32x4(t[4 + m], t[12 + m], 0x88);
    r[12 + m] = _mm512_shuffle_f32x4(t[4 + m], t[12 + m], 0xDD);
  }
}

// The same as pack_queries_portable, 16 x 16 blocks at a time: the panel's rows loaded (zeros past `cols`),
// transposed in registers, times the scale (the same products, so the same values). It replaced 16-lane gathers,
// which took ~10 % of the chunk attention's time on a 2-core Zen 4 VM.
__attribute__((target("avx512f"))) void pack_queries_avx512(const float* q, int64_t ldq, int64_t cols, int64_t panels,
                                                            int64_t D, float scale, float* dst) {
  const __m512 times = _mm512_set1_ps(scale);
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t left = std::min(kPanel, cols - p * kPanel);
    const __mmask16 in = left >= kPanel ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    for (int64_t d0 = 0; d0 < D; d0 += kPanel) {
      const int64_t n = std::min(kPanel, D - d0);
      const __mmask16 part = n >= kPanel ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
      __m512 r[16];
      for (int64_t j = 0; j < kPanel; ++j)
        r[j] = j < left ? _mm512_maskz_loadu_ps(part, q + (p * kPanel + j) * ldq + d0) : _mm512_setzero_ps();
      transpose16(r);
      for (int64_t i = 0; i < n; ++i)
        _mm512_storeu_ps(dst + (p * D + d0 + i) * kPanel, _mm512_maskz_mul_ps(in, r[i], times));
    }
  }
}

#endif

void pack_queries(const float* q, int64_t ldq, int64_t cols, int64_t panels, int64_t D, float scale, float* dst) {
#ifdef OPTIMUM_NEURON_X86
  if (isa() == Isa::kAvx512) return pack_queries_avx512(q, ldq, cols, panels, D, scale, dst);
#endif
  pack_queries_portable(q, ldq, cols, panels, D, scale, dst);
}

// 4. The values' product, with the tile's queries as rows: out [cols, D] (row stride D) = the softmax weights times
// the values, each row divided by its query's total (zeros where a query attends no key). The values are read in
// place, row by row: the `segments` in key order (the window's blocks of the KV head from the tile's first attended
// one, then the chunk's own values up to the tile's end). The weights are the softmax's panels (`softmax_tile`):
// query c's weight of key j at w[(c / 16) * keys * 16 + j * 16 + c % 16], so a block of rows inside one panel reads one
// 64-byte line per key for all its broadcasts. Each output element is one accumulator taking weight * value for the
// keys in order (fused multiply-adds on the vector paths, std::fma for the columns past the last 16: the same
// rounding), so the AVX2 and AVX-512 paths give the same values, and a query's result depends on its own weights only.
// Where one block of `rows` queries (inside one panel) writes: its weights' first column, its totals, its output rows.
struct RowBlock {
  const float* w;  // query 0's weight of key 0; key j at w + 16 j, query r at + r
  const float* total;
  float* out;  // row stride D
  int64_t rows;
};

// Divide the columns [d0, D) of a row block's rows by their totals (zeros where a query attends no key).
void divide_columns(const RowBlock& rb, int64_t D, int64_t d0) {
  for (int64_t r = 0; r < rb.rows; ++r) {
    const float t = rb.total[r];
    float* out = rb.out + r * D;
    for (int64_t d = d0; d < D; ++d) out[d] = t > 0.0f ? out[d] / t : 0.0f;
  }
}

// The sums of the columns [d0, D) of a row block over the keys of `n` segments by scalar fused multiply-adds, in key
// order: from zero (`first`) or from what the block's output holds (the sums over the keys before these).
void values_tail(const Segment* seg, int64_t n, int64_t D, int64_t d0, const RowBlock& rb, bool first) {
  for (int64_t r = 0; r < rb.rows; ++r)
    for (int64_t d = d0; d < D; ++d) {
      float acc = first ? 0.0f : rb.out[r * D + d];
      const float* wr = rb.w + r;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < seg[i].n; ++j, wr += kPanel) acc = std::fma(*wr, seg[i].v[j * seg[i].ld + d], acc);
      rb.out[r * D + d] = acc;
    }
}

// The portable path: every column of each row, weight * value added (the machine's own rounding), in key order,
// from zero (`first`) or from the sums so far.
void values_portable(const Segment* seg, int64_t n, int64_t D, const RowBlock& rb, bool first) {
  for (int64_t r = 0; r < rb.rows; ++r) {
    float* out = rb.out + r * D;
    if (first) std::fill(out, out + D, 0.0f);
    const float* wr = rb.w + r;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < seg[i].n; ++j, wr += kPanel)
        for (int64_t d = 0; d < D; ++d) out[d] += *wr * seg[i].v[j * seg[i].ld + d];
  }
}

#ifdef OPTIMUM_NEURON_X86
// R rows x P panels of 16 columns from column d0, AVX-512: R * P accumulators, P value loads and R broadcasts per key.
template <int R, int P>
__attribute__((target("avx512f"))) void values_tile_avx512(const std::vector<Segment>& segments, int64_t D,
                                                             int64_t d0, const RowBlock& rb) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  const float* wr = rb.w;
  for (const Segment& seg : segments) {
    const float* v = seg.v + d0;
    for (int64_t j = 0; j < seg.n; ++j, wr += kPanel, v += seg.ld) {
      __m512 x[P];
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) x[p] = _mm512_loadu_ps(v + kPanel * p);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 b = _mm512_set1_ps(wr[r]);
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(b, x[p], acc[r][p]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const float t = rb.total[r];
    for (int p = 0; p < P; ++p) {
      const __m512 y = t > 0.0f ? _mm512_div_ps(acc[r][p], _mm512_set1_ps(t)) : _mm512_setzero_ps();
      _mm512_storeu_ps(rb.out + r * D + d0 + kPanel * p, y);
    }
  }
}

// The AVX2 tile: R rows x one panel (two 8-float vectors), the same fused multiply-adds in the same order as the
// AVX-512 one, over the keys of `n` segments, from zero (`first`) or from the sums so far in the block's output.
template <int R>
__attribute__((target("avx2,fma"))) void values_tile_avx2(const Segment* seg, int64_t n, int64_t D, int64_t d0,
                                                          const RowBlock& rb, bool first) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) {
    lo[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(rb.out + r * D + d0);
    hi[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(rb.out + r * D + d0 + 8);
  }
  const float* wr = rb.w;
  for (int64_t i = 0; i < n; ++i) {
    const float* v = seg[i].v + d0;
    for (int64_t j = 0; j < seg[i].n; ++j, wr += kPanel, v += seg[i].ld) {
      const __m256 a = _mm256_loadu_ps(v), b = _mm256_loadu_ps(v + 8);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 x = _mm256_set1_ps(wr[r]);
        lo[r] = _mm256_fmadd_ps(x, a, lo[r]);
        hi[r] = _mm256_fmadd_ps(x, b, hi[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(rb.out + r * D + d0, lo[r]);
    _mm256_storeu_ps(rb.out + r * D + d0 + 8, hi[r]);
  }
}

using ValuesTile = void (*)(const std::vector<Segment>&, int64_t, int64_t, const RowBlock&);

// The AVX-512 tile of `rows` (1-6) rows x `panels` (1-4) panels.
template <int P>
ValuesTile avx512_values_tile(int64_t rows) {
  static const ValuesTile tiles[6] = {values_tile_avx512<1, P>, values_tile_avx512<2, P>, values_tile_avx512<3, P>,
                                      values_tile_avx512<4, P>, values_tile_avx512<5, P>, values_tile_avx512<6, P>};
  return tiles[rows - 1];
}

ValuesTile values_tile_for(int64_t rows, int64_t panels) {
  switch (panels) {
    case 1: return avx512_values_tile<1>(rows);
    case 2: return avx512_values_tile<2>(rows);
    case 3: return avx512_values_tile<3>(rows);
    default: return avx512_values_tile<4>(rows);
  }
}

// A row block on AVX-512: the columns in groups of up to 4 panels (one pass over all the keys each), then the tail.
__attribute__((target("avx512f"))) void values_avx512(const std::vector<Segment>& segments, int64_t D,
                                                      const RowBlock& rb) {
  int64_t d0 = 0;
  while (D - d0 >= kPanel) {
    const int64_t panels = std::min<int64_t>(kMaxPanels, (D - d0) / kPanel);
    values_tile_for(rb.rows, panels)(segments, D, d0, rb);
    d0 += panels * kPanel;
  }
  if (d0 < D) {
    values_tail(segments.data(), static_cast<int64_t>(segments.size()), D, d0, rb, true);
    divide_columns(rb, D, d0);
  }
}

// A row block's sums over the keys of `n` segments on AVX2: one panel per pass over them (up to 6 rows), then the
// tail.
void values_avx2(const Segment* seg, int64_t n, int64_t D, const RowBlock& rb, bool first) {
  using Tile = void (*)(const Segment*, int64_t, int64_t, int64_t, const RowBlock&, bool);
  static const Tile tiles[6] = {values_tile_avx2<1>, values_tile_avx2<2>, values_tile_avx2<3>,
                                values_tile_avx2<4>, values_tile_avx2<5>, values_tile_avx2<6>};
  int64_t d0 = 0;
  for (; d0 + kPanel <= D; d0 += kPanel) tiles[rb.rows - 1](seg, n, D, d0, rb, first);
  if (d0 < D) values_tail(seg, n, D, d0, rb, first);
}
#endif

// The most rows of a row block on this path (they stay inside one panel of 16 queries: `RowBlock`).
int64_t values_rows() {
#ifdef OPTIMUM_NEURON_X86
  if (isa() != Isa::kPortable) return 6;
#endif
  return kPanel;
}

// The keys of `segments` up to `limit` cut into `pieces` of at most kValueKeys keys, grouped into key blocks of at
// most kValueKeys keys: block i is pieces [starts[i], starts[i + 1]) (`starts` closed by the pieces' count).
void key_blocks(const std::vector<Segment>& segments, int64_t D, int64_t limit, std::vector<Segment>& pieces,
                std::vector<int64_t>& starts) {
  pieces.clear();
  starts.clear();
  int64_t taken = 0;
  for (const Segment& seg : segments)
    for (int64_t j = 0; j < seg.n && taken < limit; j += kValueKeys) {
      pieces.push_back({seg.v + j * seg.ld, std::min({kValueKeys, seg.n - j, limit - taken}), seg.ld});
      taken += pieces.back().n;
    }
  int64_t held = kValueKeys;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (held + pieces[i].n > kValueKeys) starts.push_back(static_cast<int64_t>(i)), held = 0;
    held += pieces[i].n;
  }
  starts.push_back(static_cast<int64_t>(pieces.size()));
}

// The keys the panel of queries from c0 (of a tile of `cols` queries over `keys` keys) reads, cut by `key_blocks`
// into z.pieces and z.starts: they stop at the panel's causal end, since its queries weigh every later key exactly 0.
// Returns the panel's width.
int64_t panel_keys(const std::vector<Segment>& segments, int64_t D, int64_t keys, int64_t cols, int64_t c0,
                   Scratch& z) {
  const int64_t width = std::min(kPanel, cols - c0);
  key_blocks(segments, D, keys - cols + c0 + width, z.pieces, z.starts);
  return width;
}

// The AVX2 and portable values' product of one panel of queries from c0: for each key block of its keys
// (`panel_keys`), each row block's sums over its keys, carried in the output rows from one block to the next; then the
// division by the totals.
void values_panel(const std::vector<Segment>& segments, int64_t D, const float* w, int64_t keys, const float* total,
                  int64_t cols, int64_t c0, float* out, Scratch& z) {
  const int64_t width = panel_keys(segments, D, keys, cols, c0, z), most = values_rows();
  int64_t j0 = 0;  // the block's first key
  for (size_t blk = 0; blk + 1 < z.starts.size(); ++blk) {
    const Segment* seg = z.pieces.data() + z.starts[blk];
    const int64_t n = z.starts[blk + 1] - z.starts[blk];
    for (int64_t c = c0; c < c0 + width; c += most) {
      const RowBlock rb{w + (c0 / kPanel) * keys * kPanel + j0 * kPanel + c % kPanel, total + c, out + c * D,
                        std::min(most, c0 + width - c)};
#ifdef OPTIMUM_NEURON_X86
      if (isa() == Isa::kAvx2) {
        values_avx2(seg, n, D, rb, blk == 0);
        continue;
      }
#endif
      values_portable(seg, n, D, rb, blk == 0);
    }
    for (int64_t i = 0; i < n; ++i) j0 += seg[i].n;
  }
  divide_columns({w, total + c0, out + c0 * D, width}, D, 0);
}

// out [cols, D] for the tile's `cols` queries. AVX-512: row blocks of up to 6 queries inside each panel, each over
// the panel's keys up to its causal end in one pass (`values_avx512`). AVX2 and portable: panel by panel, in key
// blocks (`values_panel`).
void values_product(const std::vector<Segment>& segments, int64_t D, const float* w, int64_t keys, const float* total,
                    int64_t cols, float* out, Scratch& z) {
#ifdef OPTIMUM_NEURON_X86
  if (isa() == Isa::kAvx512) {
    for (int64_t c0 = 0; c0 < cols; c0 += kPanel) {
      const int64_t width = panel_keys(segments, D, keys, cols, c0, z);
      for (int64_t c = c0; c < c0 + width; c += values_rows()) {
        const int64_t rows = std::min(values_rows(), c0 + width - c);
        values_avx512(z.pieces, D, {w + (c0 / kPanel) * keys * kPanel + c % kPanel, total + c, out + c * D, rows});
      }
    }
    return;
  }
#endif
  for (int64_t c0 = 0; c0 < cols; c0 += kPanel) values_panel(segments, D, w, keys, total, cols, c0, out, z);
}

void run_task(const Call& c, int64_t task, Scratch& z) {
  const int64_t tiles = (c.C + kTile - 1) / kTile;
  const int64_t b = task / (c.Hq * tiles), h = (task / tiles) % c.Hq, tile = task % tiles, t0 = tile * kTile;
  const int64_t cols = std::min(kTile, c.C - t0), panels = (cols + kPanel - 1) / kPanel, width = panels * kPanel;
  const uint8_t* live = c.live + (b * tiles + tile) * c.nb;
  const int64_t first = c.first[b * tiles + tile];
  // keys [k0, W + t0 + cols): the window from its first attended block, then the chunk up to the tile's end
  const int64_t head = h / (c.Hq / c.Hk), W = c.nb * c.bs, k0 = first * c.bs, keys = W + t0 + cols - k0;
  // 1. queries times the scale, as panels [D, 16] (zero past the chunk's end)
  pack_queries(c.q + b * c.qs[0] + h * c.qs[1] + t0 * c.qs[2], c.qs[2], cols, panels, c.D, c.scale, z.q.data());
  // 2. scores S^T [keys, width]: each attended window block in place (the scores of a block no query attends stay
  // unset: the softmax never reads a masked key's score), then the chunk's keys up to the tile's end
  for (int64_t i = first; i < c.nb; ++i) {
    if (!live[i]) continue;
    const float* rows = c.kc + ((c.table[b * c.nb + i] * c.Hk + head) * c.bs) * c.D;
    gemm_serial(rows, c.bs, c.D, c.D, z.q.data(), panels, c.D * kPanel, z.s.data() + (i * c.bs - k0) * kTile, kTile,
                z.partial.data());
  }
  // the chunk's keys before the tile for every query, then the tile's own keys 16 at a time, each group for the
  // panels whose queries may attend it (causality: panel p's queries attend chunk keys up to t0 + 16 p + 15)
  const float* own = c.k + b * c.ks[0] + head * c.ks[1];
  float* scores = z.s.data() + (W - k0) * kTile;
  gemm_serial(own, t0, c.D, c.ks[2], z.q.data(), panels, c.D * kPanel, scores, kTile, z.partial.data());
  for (int64_t g = 0; g < panels; ++g) {
    const int64_t r0 = t0 + g * kPanel, rows = std::min(kPanel, t0 + cols - r0);
    gemm_serial(own + r0 * c.ks[2], rows, c.D, c.ks[2], z.q.data() + g * c.D * kPanel, panels - g, c.D * kPanel,
                scores + r0 * kTile + g * kPanel, kTile, z.partial.data());
  }
  // 3. softmax weights as panels [keys, 16]
  softmax_tile(z.s.data(), c.bits + (b * tiles + tile) * c.L + k0, keys, width, z.w.data(), z.total);
  // 4. out = the weights times the values, read in place in key order, over each query's total
  z.segments.clear();
  for (int64_t i = first; i < c.nb; ++i)
    z.segments.push_back({c.vc + ((c.table[b * c.nb + i] * c.Hk + head) * c.bs) * c.D, c.bs, c.D});
  z.segments.push_back({c.v + b * c.vs[0] + head * c.vs[1], t0 + cols, c.vs[2]});
  values_product(z.segments, c.D, z.w.data(), keys, z.total, cols, c.out + ((b * c.Hq + h) * c.C + t0) * c.D, z);
}

// `t` itself where its rows (the last dimension) are contiguous, else a contiguous copy.
at::Tensor rows_in_place(const at::Tensor& t) { return t.size(3) <= 1 || t.stride(3) == 1 ? t : t.contiguous(); }

at::Tensor chunk_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const c10::optional<at::Tensor>& block_table,
                           const at::Tensor& mask, double scale) {
  const bool windowed = block_table.has_value() && block_table->defined();
  for (const at::Tensor* t : {&q, &k, &v, &k_cache, &v_cache}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat,
                "chunk_attention computes float32 on the CPU; got ", t->scalar_type(), " on ", t->device());
  }
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(), "chunk_attention: q [B, Hq, C, D] and k, v [B, ",
              "Hk, C, D]; got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const int64_t B = q.size(0), Hq = q.size(1), C = q.size(2), D = q.size(3), Hk = k.size(1);
  TORCH_CHECK(k.size(0) == B && k.size(2) == C && k.size(3) == D && Hk > 0 && Hq % Hk == 0,
              "chunk_attention: k [B, Hk, C, D] with Hk dividing Hq; got q ", q.sizes(), ", k ", k.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.size(1) == Hk &&
                  k_cache.size(3) == D && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "chunk_attention: contiguous caches [blocks, ", Hk, ", block_size, ", D, "]; got ", k_cache.sizes());
  const int64_t nb = windowed ? block_table->size(1) : 0, bs = k_cache.size(2), L = nb * bs + C;
  if (windowed) {
    TORCH_CHECK(block_table->scalar_type() == at::kLong && block_table->dim() == 2 && block_table->size(0) == B,
                "chunk_attention: block_table int64 [B, nb]; got ", block_table->scalar_type(), " ",
                block_table->sizes());
  }
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 4 && mask.size(0) == B && mask.size(1) == 1 &&
                  mask.size(2) == C && mask.size(3) == L,
              "chunk_attention: mask bool [", B, ", 1, ", C, ", ", L, "]; got ", mask.scalar_type(), " ",
              mask.sizes());
  // q, k and v are read where they lie (any strides whose rows of D values are contiguous): a view of the
  // projections' output is not copied first
  const at::Tensor qc = rows_in_place(q), kc = rows_in_place(k), vc = rows_in_place(v);
  const at::Tensor table = windowed ? block_table->contiguous() : at::Tensor();
  const int64_t blocks = k_cache.size(0);
  if (windowed && table.numel() > 0) {
    const int64_t low = table.min().item<int64_t>(), high = table.max().item<int64_t>();
    TORCH_CHECK(low >= 0 && high < blocks, "chunk_attention: block_table names blocks [", low, ", ", high,
                "] of a cache of ", blocks);
  }
  at::Tensor out = at::empty({B, Hq, C, D}, q.options());
  if (B == 0 || C == 0 || Hq == 0) return out;
  const int64_t tiles = (C + kTile - 1) / kTile;
  const at::Tensor mc = mask.contiguous();
  const std::vector<uint64_t> bits = mask_bits(reinterpret_cast<const uint8_t*>(mc.data_ptr<bool>()), B, C, L);
  const std::vector<uint8_t> live = live_blocks(bits.data(), B, tiles, L, nb, bs);
  const std::vector<int64_t> first = first_blocks(live, B * tiles, nb);
  const Call call{qc.data_ptr<float>(), kc.data_ptr<float>(), k_cache.data_ptr<float>(),
                  windowed ? table.data_ptr<int64_t>() : nullptr, bits.data(), live.data(), first.data(),
                  v_cache.data_ptr<float>(), vc.data_ptr<float>(), out.data_ptr<float>(), Hq, Hk, C, D, nb, bs, L,
                  static_cast<float>(scale), {qc.stride(0), qc.stride(1), qc.stride(2)},
                  {kc.stride(0), kc.stride(1), kc.stride(2)}, {vc.stride(0), vc.stride(1), vc.stride(2)}};
  const int64_t tasks = B * Hq * ((C + kTile - 1) / kTile);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(call);
    for (int64_t task = begin; task < end; ++task) run_task(call, task, scratch);
  });
  return out;
}

}  // namespace
}  // namespace optimum_neuron

TORCH_LIBRARY_IMPL(optimum_neuron, CPU, m) { m.impl("chunk_attention", &optimum_neuron::chunk_attention); }
