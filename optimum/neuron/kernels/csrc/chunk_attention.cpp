// optimum_neuron::chunk_attention: the attention of a prefill chunk (or of each row's tokens of a verification call)
// over its sequence's KV window, read from the block-paged cache where it lies, and over the chunk's own keys, fp32
// on the CPU.
//
// Inputs. q [B, Hq, C, D]; k, v [B, Hk, C, D]: the chunk's own keys and values (not yet in the cache); k_cache and
// v_cache [blocks, Hk, block_size, D], contiguous; block_table [B, nb] int64 (absent: no earlier cache is read, the
// context-encoding graph); mask [B, 1, C, L] bool, L = nb * block_size + C, keys ordered [window | chunk]: the caller's
// mask rule (causality, actual tokens, sliding window). One rule the kernel relies on: query t never attends a chunk
// key after its own (causality), so a tile of queries ending at t1 reads keys [0, W + t1) only. Output [B, Hq, C, D].
//
// Schedule. One task per (row, query head, tile of up to 64 query tokens), split over threads. A task
//   1. packs its queries, times the scale, as 16-query panels [D, 16] (`panel_tiles.h`);
//   2. computes the scores S^T [keys, queries] with the panel GEMM: the rows are the keys, each window block that a
//      query of the tile attends read in place from the cache, then the chunk's own (a block no query of the tile
//      attends is not read: the masked bucket past a prompt's first chunk, the blocks a sliding window left behind);
//   3. takes each query's softmax over the keys it attends (two passes over S^T: the maximum, then exp(s - max) and the
//      total; keys the mask leaves out weigh exactly 0), writing the weights as panels [keys, 16];
//   4. computes O^T [D, queries] = V^T [D, keys] times the weights with the same GEMM (V^T: the row's window and chunk
//      values of its KV head, transposed once per call and shared by the head's tasks), from the first attended block
//      on, and divides by the totals.
// Both products run at the panel GEMM's rate, where torch's CPU flash attention runs its blocks through a generic
// sgemm and a float mask; the queries of a tile share every key and value they read.
//
// Order of the sums. A query's scores, maximum, total and output sums each run over keys (or head dimensions) in one
// fixed order, and keys past the tile's causal end or left out by the mask add exact zeros: a query's result depends
// on its own mask row only, not on the tile, the chunk size or the other queries (DESIGN.md invariant 4). The blocks
// skipped before a tile's first attended one would add exact zeros too (a weight of +0 times a finite value leaves a
// sum as it is, and the sums start at +0), so skipping them changes no bit. A query whose mask attends no key gets
// zeros.
//
// Instruction sets: the panel GEMM's paths (AVX-512, AVX2 + FMA, portable); the softmax likewise (16 or 8 columns per
// vector, the same values lane for lane; a key no column of the vector attends is skipped: exact zeros), portable C++
// otherwise (`isa.h`).
#include <ATen/ATen.h>
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

// What every task of one call reads.
struct Call {
  const float* q;      // [B, Hq, C, D]
  const float* k;      // [B, Hk, C, D]
  const float* kc;     // k_cache [blocks, Hk, bs, D]
  const int64_t* table;  // [B, nb] or null
  const uint8_t* mt;   // the mask transposed, [B, L, Cp]: mt[b, j, t] = mask[b, 0, t, j], zero for t >= C
  const uint8_t* live;  // [B, tiles, nb]: whether a query of the tile attends a key of window block i (`live_blocks`)
  const float* vt;     // V^T [B, Hk, D, L]
  float* out;          // [B, Hq, C, D]
  int64_t Hq, Hk, C, Cp, D, nb, bs, L;
  float scale;
};

// Softmax weights of one tile: for each of the `width` (a multiple of 16) query columns of s [keys, kTile] (row stride
// kTile), the weights over keys [0, keys) where the mask row mt (stride Cp) attends, written as panels w [width / 16,
// keys, 16]; totals in `total` [width].
void softmax_portable(const float* s, const uint8_t* mt, int64_t Cp, int64_t keys, int64_t width, float* w,
                      float* total) {
  for (int64_t c = 0; c < width; ++c) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < keys; ++j)
      if (mt[j * Cp + c]) top = std::max(top, s[j * kTile + c]);
    float sum = 0.0f;
    float* panel = w + (c / kPanel) * keys * kPanel + c % kPanel;
    for (int64_t j = 0; j < keys; ++j) {
      const float e = mt[j * Cp + c] ? std::exp(s[j * kTile + c] - top) : 0.0f;
      sum += e;
      panel[j * kPanel] = e;
    }
    total[c] = sum;
  }
}

#ifdef OPTIMUM_NEURON_X86
// The same in 8-column vectors: a key's mask bytes become a lane mask; masked lanes take -inf in the maximum and
// weigh exactly 0 (the exp's result cleared by the lane mask).
__attribute__((target("avx2,fma"))) void softmax_avx2(const float* s, const uint8_t* mt, int64_t Cp, int64_t keys,
                                                      int64_t width, float* w, float* total) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t c = 0; c < width; c += 8) {
    __m256 top = ninf;
    for (int64_t j = 0; j < keys; ++j) {
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mt + j * Cp + c)));
      const __m256 on = _mm256_castsi256_ps(_mm256_cmpgt_epi32(bytes, _mm256_setzero_si256()));
      top = _mm256_max_ps(top, _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + j * kTile + c), on));
    }
    // a column that attends nothing: top stays -inf; subtract 0 instead (its weights are cleared anyway)
    const __m256 base = _mm256_blendv_ps(top, _mm256_setzero_ps(), _mm256_cmp_ps(top, ninf, _CMP_EQ_OQ));
    __m256 sum = _mm256_setzero_ps();
    float* panel = w + (c / kPanel) * keys * kPanel + c % kPanel;
    for (int64_t j = 0; j < keys; ++j) {
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mt + j * Cp + c)));
      const __m256 on = _mm256_castsi256_ps(_mm256_cmpgt_epi32(bytes, _mm256_setzero_si256()));
      if (_mm256_movemask_ps(on) == 0) {  // a key no column attends (past the causal end, masked blocks): exact zeros
        _mm256_storeu_ps(panel + j * kPanel, _mm256_setzero_ps());
        continue;
      }
      const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j * kTile + c), base)), on);
      sum = _mm256_add_ps(sum, e);
      _mm256_storeu_ps(panel + j * kPanel, e);
    }
    _mm256_storeu_ps(total + c, sum);
  }
}

// Key j's mask bytes for columns [c, c + 16) as a lane mask.
__attribute__((target("avx512f"))) inline __mmask16 lanes16(const uint8_t* mt, int64_t Cp, int64_t j, int64_t c) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mt + j * Cp + c)));
  return _mm512_cmpgt_epi32_mask(bytes, _mm512_setzero_si512());
}

// The AVX-512 twin: 16 columns per vector, a key's mask bytes as a 16-bit lane mask (the same values lane for lane).
__attribute__((target("avx512f"))) void softmax_avx512(const float* s, const uint8_t* mt, int64_t Cp, int64_t keys,
                                                       int64_t width, float* w, float* total) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), zero = _mm512_setzero_ps();
  for (int64_t c = 0; c < width; c += kPanel) {
    __m512 top = ninf;
    for (int64_t j = 0; j < keys; ++j) {
      top = _mm512_mask_max_ps(top, lanes16(mt, Cp, j, c), top, _mm512_loadu_ps(s + j * kTile + c));
    }
    const __m512 base = _mm512_mask_mov_ps(top, _mm512_cmp_ps_mask(top, ninf, _CMP_EQ_OQ), zero);
    __m512 sum = zero;
    float* panel = w + (c / kPanel) * keys * kPanel;
    for (int64_t j = 0; j < keys; ++j) {
      const __mmask16 on = lanes16(mt, Cp, j, c);
      const __m512 e =
          on == 0 ? zero : _mm512_maskz_mov_ps(on, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j * kTile + c), base)));
      sum = _mm512_add_ps(sum, e);
      _mm512_storeu_ps(panel + j * kPanel, e);
    }
    _mm512_storeu_ps(total + c, sum);
  }
}
#endif

void softmax_tile(const float* s, const uint8_t* mt, int64_t Cp, int64_t keys, int64_t width, float* w,
                  float* total) {
#ifdef OPTIMUM_NEURON_X86
  if (isa() == Isa::kAvx512) return softmax_avx512(s, mt, Cp, keys, width, w, total);
  if (isa() != Isa::kPortable) return softmax_avx2(s, mt, Cp, keys, width, w, total);
#endif
  softmax_portable(s, mt, Cp, keys, width, w, total);
}

// Scratch of one thread, sized for the call's largest tile.
struct Scratch {
  std::vector<float> q, s, w, o, partial;
  float total[kTile];
  explicit Scratch(const Call& c)
      : q(c.D * kTile), s(c.L * kTile), w(c.L * kTile), o(c.D * kTile),
        partial(std::max({c.bs, c.C, c.D}) * kTile) {}
};

// For each row and tile of queries, which window blocks a query of the tile attends: live[(b * tiles + tile) * nb + i].
std::vector<uint8_t> live_blocks(const uint8_t* mt, int64_t B, int64_t L, int64_t Cp, int64_t nb, int64_t bs) {
  const int64_t tiles = Cp / kTile;
  std::vector<uint8_t> live(B * tiles * nb, 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < nb * bs; ++j) {
      const uint8_t* row = mt + (b * L + j) * Cp;
      for (int64_t tile = 0; tile < tiles; ++tile) {
        uint64_t any = 0, word;
        for (int64_t w = 0; w < kTile; w += 8) {
          std::memcpy(&word, row + tile * kTile + w, 8);
          any |= word;
        }
        if (any != 0) live[(b * tiles + tile) * nb + j / bs] = 1;
      }
    }
  return live;
}

void run_task(const Call& c, int64_t task, Scratch& z) {
  const int64_t tiles = (c.C + kTile - 1) / kTile;
  const int64_t b = task / (c.Hq * tiles), h = (task / tiles) % c.Hq, tile = task % tiles, t0 = tile * kTile;
  const int64_t cols = std::min(kTile, c.C - t0), panels = (cols + kPanel - 1) / kPanel, width = panels * kPanel;
  const uint8_t* live = c.live + (b * tiles + tile) * c.nb;
  const int64_t first = std::find(live, live + c.nb, 1) - live;  // the first attended window block (nb: none)
  // keys [k0, W + t0 + cols): the window from its first attended block, then the chunk up to the tile's end
  const int64_t head = h / (c.Hq / c.Hk), W = c.nb * c.bs, k0 = first * c.bs, keys = W + t0 + cols - k0;
  // 1. queries times the scale, as panels [D, 16] (zero past the chunk's end)
  const float* q = c.q + ((b * c.Hq + h) * c.C + t0) * c.D;
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t d = 0; d < c.D; ++d)
      for (int64_t j = 0; j < kPanel; ++j) {
        const int64_t col = p * kPanel + j;
        z.q[(p * c.D + d) * kPanel + j] = col < cols ? q[col * c.D + d] * c.scale : 0.0f;
      }
  // 2. scores S^T [keys, width]: each attended window block in place (the scores of a block no query attends stay
  // unset: the softmax never reads a masked key's score), then the chunk's keys up to the tile's end
  for (int64_t i = first; i < c.nb; ++i) {
    if (!live[i]) continue;
    const float* rows = c.kc + ((c.table[b * c.nb + i] * c.Hk + head) * c.bs) * c.D;
    gemm_serial(rows, c.bs, c.D, c.D, z.q.data(), panels, c.D * kPanel, z.s.data() + (i * c.bs - k0) * kTile, kTile,
                z.partial.data());
  }
  gemm_serial(c.k + ((b * c.Hk + head) * c.C) * c.D, t0 + cols, c.D, c.D, z.q.data(), panels, c.D * kPanel,
              z.s.data() + (W - k0) * kTile, kTile, z.partial.data());
  // 3. softmax weights as panels [keys, 16]
  softmax_tile(z.s.data(), c.mt + (b * c.L + k0) * c.Cp + t0, c.Cp, keys, width, z.w.data(), z.total);
  // 4. O^T [D, width] = V^T [D, keys] times the weights; out = O / total
  gemm_serial(c.vt + (b * c.Hk + head) * c.D * c.L + k0, c.D, keys, c.L, z.w.data(), panels, keys * kPanel,
              z.o.data(), kTile, z.partial.data());
  float* out = c.out + ((b * c.Hq + h) * c.C + t0) * c.D;
  for (int64_t col = 0; col < cols; ++col) {
    const float total = z.total[col];
    for (int64_t d = 0; d < c.D; ++d) out[col * c.D + d] = total > 0.0f ? z.o[d * kTile + col] / total : 0.0f;
  }
}

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
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor table = windowed ? block_table->contiguous() : at::Tensor();
  const int64_t blocks = k_cache.size(0);
  if (windowed && table.numel() > 0) {
    const int64_t low = table.min().item<int64_t>(), high = table.max().item<int64_t>();
    TORCH_CHECK(low >= 0 && high < blocks, "chunk_attention: block_table names blocks [", low, ", ", high,
                "] of a cache of ", blocks);
  }
  const int64_t Cp = (C + kTile - 1) / kTile * kTile;
  // the mask transposed to [B, L, Cp] bytes (queries past C: zero), and V^T [B, Hk, D, L]
  at::Tensor mt = at::zeros({B, L, Cp}, at::kByte);
  mt.narrow(2, 0, C).copy_(mask.select(1, 0).transpose(1, 2));
  at::Tensor vt = at::empty({B, Hk, D, L}, q.options());
  {
    const float* vcache = v_cache.data_ptr<float>();
    const float* vchunk = vc.data_ptr<float>();
    const int64_t* tp = windowed ? table.data_ptr<int64_t>() : nullptr;
    float* vtp = vt.data_ptr<float>();
    at::parallel_for(0, B * Hk, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / Hk, head = bh % Hk;
        float* dst = vtp + bh * D * L;
        for (int64_t i = 0; i < nb; ++i) {
          const float* rows = vcache + ((tp[b * nb + i] * Hk + head) * bs) * D;
          for (int64_t d = 0; d < D; ++d)
            for (int64_t r = 0; r < bs; ++r) dst[d * L + i * bs + r] = rows[r * D + d];
        }
        const float* rows = vchunk + bh * C * D;
        for (int64_t d = 0; d < D; ++d)
          for (int64_t t = 0; t < C; ++t) dst[d * L + nb * bs + t] = rows[t * D + d];
      }
    });
  }
  at::Tensor out = at::empty({B, Hq, C, D}, q.options());
  if (B == 0 || C == 0 || Hq == 0) return out;
  const std::vector<uint8_t> live = live_blocks(mt.data_ptr<uint8_t>(), B, L, Cp, nb, bs);
  const Call call{qc.data_ptr<float>(), kc.data_ptr<float>(), k_cache.data_ptr<float>(),
                  windowed ? table.data_ptr<int64_t>() : nullptr, mt.data_ptr<uint8_t>(), live.data(),
                  vt.data_ptr<float>(), out.data_ptr<float>(), Hq, Hk, C, Cp, D, nb, bs, L, static_cast<float>(scale)};
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
