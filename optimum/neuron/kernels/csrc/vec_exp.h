// exp for eight floats on the AVX2 path and sixteen on the AVX-512 one, shared by the attention kernels
// (paged_attention.cpp, chunk_attention.cpp).
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

namespace optimum_neuron {

// exp(x) = 2^n exp(r), x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (Cephes' expf). Both widths
// take these constants and the same steps, so the same value lane for lane.
namespace expf_constants {
constexpr float kHigh = 88.3762626647949f, kLow = -87.3365447504f;  // x clamped to [kLow, kHigh]
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;  // ln 2 in two parts: r = x - n ln2, exactly
constexpr float kPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};  // highest degree first
}  // namespace expf_constants

__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  using namespace expf_constants;
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(kHigh)), _mm256_set1_ps(kLow));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 y = _mm256_set1_ps(kPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kPoly[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(power));
}

__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
  using namespace expf_constants;
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(kHigh)), _mm512_set1_ps(kLow));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 y = _mm512_set1_ps(kPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kPoly[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i power = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(power));
}

}  // namespace optimum_neuron
#endif
