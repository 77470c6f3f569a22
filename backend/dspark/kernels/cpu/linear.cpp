// y = x W^T for a few rows of x in fp32 on an x86-64 CPU with AVX2 and FMA (see linear.py).
//
// Each output y[r, j] is one sum in one order, whatever rows or columns are computed beside it: eight
// lanes accumulate x[r, k] * W[j, k] over k in steps of 8 (fused multiply-adds), the lanes are added in a
// fixed tree, then the last k % 8 products in order. So a row's result is the same bits alone or in a
// verify window, which keeps speculative greedy decoding token-identical to plain decoding.
//
// A decode step's projections stream their weights: each weight row is read once from memory and
// multiplied against the rows of x, eight (then four, then the rest) at a time, one accumulator register
// each (8 rows: a pass over SmolLM2's weights 27.9 ms against 32.0 four at a time; session 55).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>

namespace {

inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// G rows of x (row stride k) against one weight row w: y[r * ldy] for r < G.
template <int G>
inline void rows_dot(const float* x, const float* w, int64_t k, float* y, int64_t ldy) {
  __m256 acc[G];
  for (int r = 0; r < G; ++r) acc[r] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    const __m256 wv = _mm256_loadu_ps(w + i);
    for (int r = 0; r < G; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + i), wv, acc[r]);
  }
  for (int r = 0; r < G; ++r) {
    float s = lane_sum(acc[r]);
    for (int64_t t = i; t < k; ++t) s = std::fma(x[r * k + t], w[t], s);
    y[r * ldy] = s;
  }
}

}  // namespace

torch::Tensor linear_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_rows: x [rows, k], w [n, k]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "linear_rows: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "linear_rows: contiguous operands only");
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0);
  auto y = torch::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Torch's own thread pool splits the weight rows (the same threads as every other op of the step).
  at::parallel_for(0, n, 64, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const float* w_row = wp + j * k;
      int64_t r = 0;
      for (; r + 8 <= rows; r += 8) rows_dot<8>(xp + r * k, w_row, k, yp + r * n + j, n);
      for (; r + 4 <= rows; r += 4) rows_dot<4>(xp + r * k, w_row, k, yp + r * n + j, n);
      switch (rows - r) {
        case 3: rows_dot<3>(xp + r * k, w_row, k, yp + r * n + j, n); break;
        case 2: rows_dot<2>(xp + r * k, w_row, k, yp + r * n + j, n); break;
        case 1: rows_dot<1>(xp + r * k, w_row, k, yp + r * n + j, n); break;
        default: break;
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_rows", &linear_rows, "x [rows, k] @ w [n, k]^T in fp32, each output summed in one order");
}
