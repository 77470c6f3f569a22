// Eight-lane helpers shared by the CPU extension's sources (linear.cpp, norm.cpp).
#pragma once

#include <immintrin.h>

namespace dspark_cpu {

// The sum of eight lanes in one fixed tree: (0+4, 1+5, 2+6, 3+7), then halves, then the last pair.
inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace dspark_cpu
