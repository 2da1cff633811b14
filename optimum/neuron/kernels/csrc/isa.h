// The instruction set every kernel of the toolkit's CPU library runs (every source of kernels/library.py): the
// best path this CPU has, lowered by OPTIMUM_NEURON_PACKED_ISA (avx2, portable: for comparison and tests). Read once
// per process, shared by every kernel.
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

}  // namespace optimum_neuron
