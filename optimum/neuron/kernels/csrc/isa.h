// The instruction set every kernel of the toolkit's CPU library runs (every source of kernels/library.py): the
// best path this CPU has, lowered by OPTIMUM_NEURON_PACKED_ISA (avx2, portable: for comparison and tests). Read once
// per process, shared by every kernel. Beside it, the CPU's vendor, on which two schedule choices depend as well as on
// its instructions (`amd_cpu`).
#pragma once

#include <cstdlib>
#include <cstring>

namespace optimum_neuron {

enum class Isa { kPortable, kAvx2, kAvx512 };

inline Isa isa() {
  static const Isa found = [] {
    const char* asked = std::getenv("OPTIMUM_NEURON_PACKED_ISA");
    const bool portable_only = asked != nullptr && std::strcmp(asked, "portable") == 0;
    const bool no_avx512 = portable_only || (asked != nullptr && std::strcmp(asked, "avx2") == 0);
#if defined(__x86_64__) || defined(_M_X64)
    if (!no_avx512 && __builtin_cpu_supports("avx512f")) return Isa::kAvx512;
    if (!portable_only && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
    (void)no_avx512;
    return Isa::kPortable;
  }();
  return found;
}

// Whether this CPU is AMD's: the schedule choices that depend on the vendor (`stream_once_pays`, panel_tiles.h
// `block_k`) were measured on AMD Zen 3 / Zen 4 / Zen 5 and Intel Xeon VMs, and went different ways.
inline bool amd_cpu() {
#if defined(__x86_64__) || defined(_M_X64)
  static const bool amd = __builtin_cpu_is("amd") != 0;
  return amd;
#else
  return false;
#endif
}

// Whether this CPU reads a decode step's weights faster as one contiguous stream per thread, prefetched
// non-temporally (panel_tiles.h `streams_once`), than as groups of panels prefetched into L1. Measured both ways, the
// layouts' sums being the same: on the 2-core AMD Zen 5 VM the stream took 0.90-0.91x the time of the groups
// (SmolLM2's products at 1 row); on a 2-core Intel Xeon VM (family 6 model 207, AVX-512), fresh processes alternating,
// SmolLM2's 30 layers and LM head (538 MB) took 1.7-2.0x the time at 1 row and 1.35-1.6x at 8 rows (the groups read
// 20-28 GB/s, about what a 2-thread `sum` reads there, the stream 11-16), 90 layers (1.27 GB) 1.3-1.6x and
// 1.5-2.0x. On a 2-core AMD Zen 3 VM (family 25 model 1, AVX2, no AVX-512) the batch-1 engine's decode step, fresh
// processes alternating (10 pairs, 2026-12-07), took 1.09x the groups' time with the stream (median of the pairs'
// ratios; 21.6 against 19.8 ms, medians). So AMD CPUs with AVX-512 (Zen 4 on, the hardware's capability, whatever
// path OPTIMUM_NEURON_PACKED_ISA picks: the Zen 5 VM's AVX2 path gained too) take it and the others do not;
// OPTIMUM_NEURON_STREAM_ONCE=1 or 0 (read once) overrides, to measure a new CPU.
inline bool stream_once_pays() {
  static const bool pays = [] {
    const char* asked = std::getenv("OPTIMUM_NEURON_STREAM_ONCE");
    if (asked != nullptr && (std::strcmp(asked, "0") == 0 || std::strcmp(asked, "1") == 0)) return asked[0] == '1';
#if defined(__x86_64__) || defined(_M_X64)
    return amd_cpu() && __builtin_cpu_supports("avx512f");
#else
    return false;
#endif
  }();
  return pays;
}

}  // namespace optimum_neuron
