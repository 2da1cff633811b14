// optimum_neuron::paged_attention: the attention of one new token per row over its sequence's KV window, read from
// the block-paged cache where it lies (no gathered copy of the window), fp32 on the CPU.
//
// Inputs. q [B, Hq, 1, D] (any strides: a contiguous view is read); k_cache and v_cache [blocks, Hk, block_size, D],
// contiguous: a KV head's positions of one block are one run of block_size x D floats; table [B, nb] int64: the blocks
// of each row's window, in position order;
// mask [B, W] bool, W = nb * block_size: True where the row attends the key at that window position (the caller's
// mask rule: causality, sliding window); scale. Output [B, Hq, 1, D].
//
// Query head h attends with KV head h / (Hq / Hk) (grouped-query attention). One task per (row, KV head): it lists
// where the attended keys of that head lie, computes the scores of its group of query heads against each key as the key is
// read (one pass over K), takes their softmax (the maximum subtracted; keys the mask leaves out are never scored, so
// nothing masked reaches exp), then sums the values weighted by it (one pass over V) and divides by the total.
// Tasks are split over threads. A row whose mask attends no key gets zeros.
//
// int8 caches (optimum_neuron::paged_attention_int8, --kv_cache_dtype int8): k_cache and v_cache hold int8 values and
// k_scale, v_scale [blocks, Hk, block_size] float32 one scale per key; each key (value) is dequantized once as it is
// read, float(q) * scale (one multiply per value, into a scratch row that stays in L1, shared by the group's query
// heads), then goes through exactly the float kernel's code, so the result is bitwise the float kernel's on the
// dequantized cache, on each instruction-set path.
//
// The vector paths read eight keys at a time: eight independent dot products per query head, finished together by one
// transposing sum (`sums8x8`); the value pass adds eight weighted values to each piece of an output row between one
// load and one store, in two independent chains (even and odd keys: one chain waited 4 cycles per key). Both passes
// run 16 floats per register on AVX-512 (head dimension a multiple of 16), 8 on AVX2. A task's keys lie in runs of
// block_size rows scattered over the cache, where the hardware prefetcher restarts at every run: each pass asks for
// its rows (K in the score pass, V in the value pass) of the keys 32 ahead (`prefetch_rows`). When the prefetch came
// in (the score pass then asking for the V rows too), SmolLM2's decode attention at batch 8 (30 layers' caches, cold)
// went from 6.4-6.8 to 4.1-4.8 ms per step at 300 positions and from 19.5-20.4 to 14.2-16.1 ms at 1,000 (a two-thread
// read of the same blocks alone: 2.8-3.4 and 10.7-10.9 ms); each pass its own rows then took 0.74-0.89x of that. Later
// on the same kind of VM (benchmark/README.md, 2026-12-03 evening), no software prefetch at all, distances of 16-96
// keys and the L2 hint each measured within the noise of this schedule, which takes ~1.6x a bare read of the same
// rows: what is left of that gap is not the prefetching.
//
// Instruction sets. AVX-512, or AVX2 + FMA, where the CPU has it (vector dot products, value sums and exp), else
// portable C++; OPTIMUM_NEURON_PACKED_ISA=avx2|portable picks a lower path (`isa.h`, shared with packed_linear).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "isa.h"
#include "vec_exp.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define OPTIMUM_NEURON_X86 1
#endif

namespace optimum_neuron {
namespace {

constexpr int KEYS = 8;  // keys (values) the AVX2 path reads per step: one 8-float vector of scores (`sums8x8`)

// One task's view of the call: the group of query heads of one row that share a KV head. T: the caches' element type
// (float, or int8_t with one float scale per cache row).
template <typename T>
struct Task {
  const float* q;        // [group, D]: the group's query heads
  const T* k;            // k_cache: the key of an attended position is cache row rows[i], at k + rows[i] * D
  const T* v;            // v_cache, likewise
  const float* k_scale;  // int8 only: one scale per cache row, [blocks, Hk, block_size]
  const float* v_scale;  // int8 only: likewise for the values
  const int64_t* rows;   // the attended keys' cache rows ((block * Hk + head) * block_size + j), count of them
  int64_t count;
  int64_t group;
  int64_t dim;
  float scale;
  float* scores;  // [group, count] scratch
  float* out;     // [group, D]
  float* buf;     // [KEYS, D] scratch: int8 rows dequantized
};

// Cache row ``index`` as floats: in place for a float cache; for an int8 one, float(q) * scale into ``buf``.
inline const float* row_floats(const float* cache, const float*, int64_t index, int64_t dim, float*) {
  return cache + index * dim;
}
inline const float* row_floats(const int8_t* cache, const float* scales, int64_t index, int64_t dim, float* buf) {
  const int8_t* values = cache + index * dim;
  const float scale = scales[index];
  for (int64_t d = 0; d < dim; ++d) buf[d] = static_cast<float>(values[d]) * scale;
  return buf;
}

template <typename T>
void task_portable(const Task<T>& t) {
  for (int64_t i = 0; i < t.count; ++i) {
    const float* key = row_floats(t.k, t.k_scale, t.rows[i], t.dim, t.buf);
    for (int64_t g = 0; g < t.group; ++g) {
      const float* query = t.q + g * t.dim;
      float dot = 0.f;
      for (int64_t d = 0; d < t.dim; ++d) dot += query[d] * key[d];
      t.scores[g * t.count + i] = dot * t.scale;
    }
  }
  for (int64_t g = 0; g < t.group; ++g) {
    float* row = t.scores + g * t.count;
    const float top = *std::max_element(row, row + t.count);
    float total = 0.f;
    for (int64_t i = 0; i < t.count; ++i) total += (row[i] = std::exp(row[i] - top));
    float* out = t.out + g * t.dim;
    std::fill(out, out + t.dim, 0.f);
    for (int64_t i = 0; i < t.count; ++i) {
      const float* value = row_floats(t.v, t.v_scale, t.rows[i], t.dim, t.buf);
      const float weight = row[i] / total;
      for (int64_t d = 0; d < t.dim; ++d) out[d] += weight * value[d];
    }
  }
}

#ifdef OPTIMUM_NEURON_X86
__attribute__((target("avx2,fma"))) inline float sum8(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}

__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int64_t dim) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  float dot = sum8(acc);
  for (; d < dim; ++d) dot += a[d] * b[d];
  return dot;
}

// The rows rows[0..n) of a cache as floats, their pointers in ``out``: in place for a float cache; for an int8 one
// dequantized into ``buf`` ([n, dim]), float(q) * scale, the portable path's value (one exact conversion, one rounding).
__attribute__((target("avx2,fma"))) inline void rows_avx2(const float* cache, const float*, const int64_t* rows,
                                                          int64_t n, int64_t dim, float*, const float** out) {
  for (int64_t j = 0; j < n; ++j) out[j] = cache + rows[j] * dim;
}
__attribute__((target("avx2,fma"))) inline void rows_avx2(const int8_t* cache, const float* scales,
                                                          const int64_t* rows, int64_t n, int64_t dim, float* buf,
                                                          const float** out) {
  for (int64_t j = 0; j < n; ++j) {
    const int8_t* values = cache + rows[j] * dim;
    const float scale = scales[rows[j]];
    float* row = buf + j * dim;
    int64_t d = 0;
    for (; d + 8 <= dim; d += 8) {
      const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(values + d)));
      _mm256_storeu_ps(row + d, _mm256_mul_ps(_mm256_cvtepi32_ps(wide), _mm256_set1_ps(scale)));
    }
    for (; d < dim; ++d) row[d] = static_cast<float>(values[d]) * scale;
    out[j] = row;
  }
}

// [sum of a[0]'s lanes, ..., sum of a[7]'s]: eight dot products finished at once.
__attribute__((target("avx2,fma"))) inline __m256 sums8x8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// Asks for the rows of `cache` (the task's K in the score pass, its V in the value pass) of keys [from, from + n)
// (those that exist) ahead of their use, into L1: a task's keys lie in runs of block_size rows scattered over the
// cache. Each pass prefetches its own rows. When the score pass also asked for the V rows (into L2, for the value
// pass), SmolLM2's decode attention, 30 layers' caches cold, in one process on a 2-core Zen 5 VM, took 1.12-1.36x the
// time: batch 8 at 84 / 300 / 1,000 positions 3.12 / 8.33 / 26.7 ms against 2.60 / 6.51 / 19.7 ms, batch 1 at 300 /
// 1,000 1.35 / 3.50 against 1.17 / 3.12 ms (not measured further: the score pass then had twice the lines in flight);
// the batch-8 artifact's decode step at 300-420 positions 0.91-0.99x.
template <typename T>
__attribute__((target("avx2,fma"))) inline void prefetch_rows(const Task<T>& t, const T* cache, int64_t from,
                                                              int64_t n) {
  const int64_t end = std::min(t.count, from + n), bytes = t.dim * static_cast<int64_t>(sizeof(T));
  for (int64_t j = from; j < end; ++j) {
    const char* row = reinterpret_cast<const char*>(cache + t.rows[j] * t.dim);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
  }
}

constexpr int64_t AHEAD = 32;  // keys between a row's prefetch and its use

// The scores of keys [from, count), one key at a time (what the KEYS-wide passes leave, or every key when the head
// dimension is not a multiple of 8).
template <typename T>
__attribute__((target("avx2,fma"))) void scores_one_by_one(const Task<T>& t, int64_t from) {
  const float* key[1];
  for (int64_t i = from; i < t.count; ++i) {
    rows_avx2(t.k, t.k_scale, t.rows + i, 1, t.dim, t.buf, key);
    for (int64_t g = 0; g < t.group; ++g) {
      t.scores[g * t.count + i] = dot_avx2(t.q + g * t.dim, key[0], t.dim) * t.scale;
    }
  }
}

// Scores of the group's query heads against every attended key: KEYS keys at a time (eight independent dot products
// per query head, finished together), the rest one by one.
template <typename T>
__attribute__((target("avx2,fma"))) void scores_avx2(const Task<T>& t) {
  const float* keys[KEYS];
  int64_t i = 0;
  if (t.dim % 8 == 0) {
    const __m256 scale = _mm256_set1_ps(t.scale);
    prefetch_rows(t, t.k, 0, AHEAD);
    for (; i + KEYS <= t.count; i += KEYS) {
      prefetch_rows(t, t.k, i + AHEAD, KEYS);
      rows_avx2(t.k, t.k_scale, t.rows + i, KEYS, t.dim, t.buf, keys);
      for (int64_t g = 0; g < t.group; ++g) {
        const float* query = t.q + g * t.dim;
        __m256 acc[KEYS];
        for (int j = 0; j < KEYS; ++j) acc[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < t.dim; d += 8) {
          const __m256 qv = _mm256_loadu_ps(query + d);
          for (int j = 0; j < KEYS; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[j] + d), acc[j]);
        }
        _mm256_storeu_ps(t.scores + g * t.count + i, _mm256_mul_ps(sums8x8(acc), scale));
      }
    }
  }
  scores_one_by_one(t, i);
}

// out[0, 8 P) += sum over j < n of weights[j] * values[j][at, at + 8 P): the even and odd keys in two sets of P
// accumulators, 2 P independent chains of fused multiply-adds (one piece at a time waited on its chain: 4 cycles a
// key).
template <int P>
__attribute__((target("avx2,fma"))) inline void weighted_sum8(float* out, const float* const* values,
                                                             const float* weights, int64_t n, int64_t at) {
  __m256 even[P], odd[P];
  for (int p = 0; p < P; ++p) even[p] = _mm256_loadu_ps(out + 8 * p), odd[p] = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    const __m256 a = _mm256_set1_ps(weights[j]), b = _mm256_set1_ps(weights[j + 1]);
    for (int p = 0; p < P; ++p) {
      even[p] = _mm256_fmadd_ps(a, _mm256_loadu_ps(values[j] + at + 8 * p), even[p]);
      odd[p] = _mm256_fmadd_ps(b, _mm256_loadu_ps(values[j + 1] + at + 8 * p), odd[p]);
    }
  }
  if (j < n) {
    const __m256 a = _mm256_set1_ps(weights[j]);
    for (int p = 0; p < P; ++p) even[p] = _mm256_fmadd_ps(a, _mm256_loadu_ps(values[j] + at + 8 * p), even[p]);
  }
  for (int p = 0; p < P; ++p) _mm256_storeu_ps(out + 8 * p, _mm256_add_ps(even[p], odd[p]));
}

// out[g] += the group's softmax numerators times the values, KEYS values at a time: each piece of an output row is
// loaded once, takes the KEYS products, and is stored once.
template <typename T>
__attribute__((target("avx2,fma"))) void values_avx2(const Task<T>& t) {
  const float* values[KEYS];
  prefetch_rows(t, t.v, 0, AHEAD);
  for (int64_t i = 0; i < t.count; i += KEYS) {
    const int64_t n = std::min<int64_t>(KEYS, t.count - i);
    prefetch_rows(t, t.v, i + AHEAD, KEYS);
    rows_avx2(t.v, t.v_scale, t.rows + i, n, t.dim, t.buf, values);
    for (int64_t g = 0; g < t.group; ++g) {
      const float* weights = t.scores + g * t.count + i;
      float* out = t.out + g * t.dim;
      int64_t d = 0;
      for (; d + 32 <= t.dim; d += 32) weighted_sum8<4>(out + d, values, weights, n, d);
      for (; d + 8 <= t.dim; d += 8) weighted_sum8<1>(out + d, values, weights, n, d);
      for (; d < t.dim; ++d) {
        for (int64_t j = 0; j < n; ++j) out[d] += weights[j] * values[j][d];
      }
    }
  }
}

// Each query head's scores turned into softmax numerators in place (the head's maximum subtracted), their totals in
// ``totals``; the output rows zeroed for the value pass.
template <typename T>
__attribute__((target("avx2,fma"))) void softmax_avx2(const Task<T>& t, float* totals) {
  for (int64_t g = 0; g < t.group; ++g) {
    float* row = t.scores + g * t.count;
    __m256 high = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t i = 0;
    for (; i + 8 <= t.count; i += 8) high = _mm256_max_ps(high, _mm256_loadu_ps(row + i));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, high);
    float top = *std::max_element(lanes, lanes + 8);
    for (; i < t.count; ++i) top = std::max(top, row[i]);
    const __m256 shift = _mm256_set1_ps(top);
    __m256 total = _mm256_setzero_ps();
    for (i = 0; i + 8 <= t.count; i += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), shift));
      _mm256_storeu_ps(row + i, e);
      total = _mm256_add_ps(total, e);
    }
    float rest = 0.f;
    for (; i < t.count; ++i) rest += (row[i] = std::exp(row[i] - top));
    totals[g] = sum8(total) + rest;
    std::fill(t.out + g * t.dim, t.out + (g + 1) * t.dim, 0.f);
  }
}

template <typename T>
void normalize(const Task<T>& t, const float* totals) {
  for (int64_t g = 0; g < t.group; ++g) {
    const float inverse = 1.f / totals[g];
    for (int64_t d = 0; d < t.dim; ++d) t.out[g * t.dim + d] *= inverse;
  }
}

template <typename T>
__attribute__((target("avx2,fma"))) void task_avx2(const Task<T>& t) {
  std::vector<float> totals(t.group);
  scores_avx2(t);
  softmax_avx2(t, totals.data());
  values_avx2(t);
  normalize(t, totals.data());
}

// The AVX-512 path (head dimension a multiple of 16): the same passes, 16 floats per register.
__attribute__((target("avx512f,avx2,fma"))) inline __m256 fold16(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

template <typename T>
__attribute__((target("avx512f,avx2,fma"))) void scores_avx512(const Task<T>& t) {
  const float* keys[KEYS];
  const __m256 scale = _mm256_set1_ps(t.scale);
  prefetch_rows(t, t.k, 0, AHEAD);
  int64_t i = 0;
  for (; i + KEYS <= t.count; i += KEYS) {
    prefetch_rows(t, t.k, i + AHEAD, KEYS);
    rows_avx2(t.k, t.k_scale, t.rows + i, KEYS, t.dim, t.buf, keys);
    for (int64_t g = 0; g < t.group; ++g) {
      const float* query = t.q + g * t.dim;
      __m512 acc[KEYS];
      for (int j = 0; j < KEYS; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t d = 0; d < t.dim; d += 16) {
        const __m512 qv = _mm512_loadu_ps(query + d);
        for (int j = 0; j < KEYS; ++j) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys[j] + d), acc[j]);
      }
      __m256 folded[KEYS];
      for (int j = 0; j < KEYS; ++j) folded[j] = fold16(acc[j]);
      _mm256_storeu_ps(t.scores + g * t.count + i, _mm256_mul_ps(sums8x8(folded), scale));
    }
  }
  scores_one_by_one(t, i);
}

// The AVX-512 twin of `weighted_sum8`: out[0, 16 P) += sum over j < n of weights[j] * values[j][at, at + 16 P).
template <int P>
__attribute__((target("avx512f,avx2,fma"))) inline void weighted_sum16(float* out, const float* const* values,
                                                                       const float* weights, int64_t n, int64_t at) {
  __m512 even[P], odd[P];
  for (int p = 0; p < P; ++p) even[p] = _mm512_loadu_ps(out + 16 * p), odd[p] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    const __m512 a = _mm512_set1_ps(weights[j]), b = _mm512_set1_ps(weights[j + 1]);
    for (int p = 0; p < P; ++p) {
      even[p] = _mm512_fmadd_ps(a, _mm512_loadu_ps(values[j] + at + 16 * p), even[p]);
      odd[p] = _mm512_fmadd_ps(b, _mm512_loadu_ps(values[j + 1] + at + 16 * p), odd[p]);
    }
  }
  if (j < n) {
    const __m512 a = _mm512_set1_ps(weights[j]);
    for (int p = 0; p < P; ++p) even[p] = _mm512_fmadd_ps(a, _mm512_loadu_ps(values[j] + at + 16 * p), even[p]);
  }
  for (int p = 0; p < P; ++p) _mm512_storeu_ps(out + 16 * p, _mm512_add_ps(even[p], odd[p]));
}

template <typename T>
__attribute__((target("avx512f,avx2,fma"))) void values_avx512(const Task<T>& t) {
  const float* values[KEYS];
  prefetch_rows(t, t.v, 0, AHEAD);
  for (int64_t i = 0; i < t.count; i += KEYS) {
    const int64_t n = std::min<int64_t>(KEYS, t.count - i);
    prefetch_rows(t, t.v, i + AHEAD, KEYS);
    rows_avx2(t.v, t.v_scale, t.rows + i, n, t.dim, t.buf, values);
    for (int64_t g = 0; g < t.group; ++g) {
      const float* weights = t.scores + g * t.count + i;
      float* out = t.out + g * t.dim;
      int64_t d = 0;
      for (; d + 64 <= t.dim; d += 64) weighted_sum16<4>(out + d, values, weights, n, d);
      for (; d < t.dim; d += 16) weighted_sum16<1>(out + d, values, weights, n, d);
    }
  }
}

template <typename T>
__attribute__((target("avx512f,avx2,fma"))) void task_avx512(const Task<T>& t) {
  std::vector<float> totals(t.group);
  scores_avx512(t);
  softmax_avx2(t, totals.data());
  values_avx512(t);
  normalize(t, totals.data());
}
#endif

template <typename T>
void run_task(const Task<T>& t) {
  if (t.count == 0) {
    std::fill(t.out, t.out + t.group * t.dim, 0.f);
    return;
  }
#ifdef OPTIMUM_NEURON_X86
  if (isa() == Isa::kAvx512 && t.dim % 16 == 0) return task_avx512(t);
  if (isa() != Isa::kPortable) return task_avx2(t);  // an AVX-512 CPU has AVX2 + FMA
#endif
  task_portable(t);
}

// Checks shared by both operators; the caches' element type is checked by each.
void check_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& table,
                  const at::Tensor& mask) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "paged_attention: q must be [B, Hq, 1, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "paged_attention: caches must be [blocks, Hk, block_size, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_attention: float32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention: caches must be contiguous");
  TORCH_CHECK(table.scalar_type() == at::kLong && mask.scalar_type() == at::kBool, "paged_attention: int64 table, "
              "bool mask");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(3);
  const int64_t kv_heads = k_cache.size(1), window = table.size(1) * k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && heads % kv_heads == 0, "paged_attention: head layout mismatch");
  TORCH_CHECK(table.size(0) == rows && mask.size(0) == rows && mask.size(1) == window,
              "paged_attention: table [B, nb] and mask [B, nb * block_size] expected");
}

// The attention of every row: one task per (row, KV head), split over threads. kp, vp: the caches' data; ks, vs: an
// int8 cache's scales (nullptr for a float cache).
template <typename T>
at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const T* kp, const T* vp, const float* ks,
                  const float* vs, const at::Tensor& table, const at::Tensor& mask, double scale) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(3);
  const int64_t cache_blocks = k_cache.size(0), kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t blocks = table.size(1), window = blocks * block_size, group = heads / kv_heads;
  const at::Tensor qc = q.contiguous(), tc = table.contiguous(), mc = mask.contiguous();
  at::Tensor out = at::empty({rows, heads, 1, dim}, q.options());
  const float* qp = qc.data_ptr<float>();
  const int64_t* tp = tc.data_ptr<int64_t>();
  const bool* mp = mc.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> keys(window);
    std::vector<float> scores(group * window), buffer(KEYS * dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / kv_heads, head = task % kv_heads;
      int64_t count = 0;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t block = tp[row * blocks + b];
        TORCH_CHECK(block >= 0 && block < cache_blocks, "paged_attention: a block of the table lies outside the cache");
        const int64_t base = (block * kv_heads + head) * block_size;
        for (int64_t j = 0; j < block_size; ++j) {
          if (mp[row * window + b * block_size + j]) keys[count++] = base + j;
        }
      }
      const int64_t first = row * heads + head * group;
      const Task<T> t{qp + first * dim, kp, vp, ks, vs, keys.data(), count, group, dim, static_cast<float>(scale),
                      scores.data(), op + first * dim, buffer.data()};
      run_task(t);
    }
  });
  return out;
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& table, const at::Tensor& mask, double scale) {
  check_inputs(q, k_cache, v_cache, table, mask);
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat,
              "paged_attention: float32 only");
  return attend<float>(q, k_cache, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), nullptr, nullptr, table,
                       mask, scale);
}

at::Tensor paged_attention_int8(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& table,
                                const at::Tensor& mask, double scale) {
  check_inputs(q, k_cache, v_cache, table, mask);
  TORCH_CHECK(k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar,
              "paged_attention_int8: int8 caches expected");
  TORCH_CHECK(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat && k_scale.is_contiguous() &&
                  v_scale.is_contiguous(),
              "paged_attention_int8: contiguous float32 scales expected");
  TORCH_CHECK(k_scale.sizes() == k_cache.sizes().slice(0, 3) && v_scale.sizes() == k_scale.sizes(),
              "paged_attention_int8: scales must be [blocks, Hk, block_size]");
  return attend<int8_t>(q, k_cache, k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(), k_scale.data_ptr<float>(),
                        v_scale.data_ptr<float>(), table, mask, scale);
}

}  // namespace
}  // namespace optimum_neuron

TORCH_LIBRARY_IMPL(optimum_neuron, CPU, m) {
  m.impl("paged_attention", &optimum_neuron::paged_attention);
  m.impl("paged_attention_int8", &optimum_neuron::paged_attention_int8);
}
