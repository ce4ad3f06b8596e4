// Vectorised math shared by the CPU kernels (AVX2 + FMA).
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace tokenmill {

// e^x for 8 floats (Cephes' polynomial, relative error ~2e-7); inputs below -88 give ~0, above 88 infinity.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.37626f)), _mm256_set1_ps(-88.37626f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}

// tanh(x) for 8 floats, as 1 - 2 / (e^2x + 1): absolute error ~2e-7 (relative, near 0, more); saturates to +-1.
inline __m256 tanh8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 e = exp8(_mm256_add_ps(x, x));
  return _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, one)));
}

// out[i] = silu(gate[i]) * up[i] for i < n, silu as torch computes it: x / (1 + e^-x).
inline void silu_and_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

// out[i] = gelu_tanh(gate[i]) * up[i] for i < n: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).
inline void gelu_tanh_and_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  constexpr float kAlpha = 0.7978845608028654f, kBeta = 0.044715f;
  const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(kAlpha),
                                       _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(kBeta), g), _mm256_mul_ps(g, g), g));
    const __m256 gelu = _mm256_mul_ps(_mm256_mul_ps(half, g), _mm256_add_ps(one, tanh8(inner)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) {
    const float x = gate[i];
    out[i] = 0.5f * x * (1.0f + std::tanh(kAlpha * (x + kBeta * x * x * x))) * up[i];
  }
}

}  // namespace tokenmill
