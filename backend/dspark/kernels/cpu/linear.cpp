// y = x W^T in fp32 on an x86-64 CPU with AVX2 and FMA, for any number of rows of x (see linear.py).
//
// Each output y[r, j] is one sum in one order, whatever rows or columns are computed beside it: eight
// lanes accumulate x[r, k] * W[j, k] over k in steps of 8 (fused multiply-adds), the lanes are added in a
// fixed tree, then the last k % 8 products in order. Every tiling below keeps that order, so a row's
// result is the same bits alone, in a verify window or in a prefill chunk of hundreds of rows, which keeps
// speculative greedy decoding token-identical to plain decoding whatever the step's shape.
//
// Two tilings, chosen by the row count only (never changing a sum):
// - up to FEW_ROWS rows (a decode step, a verify window): the weights stream from memory, each weight row
//   read once and multiplied against the rows of x eight (then four, then the rest) at a time (8 rows: a
//   pass over SmolLM2's weights 27.9 ms against 32.0 four at a time; session 55);
// - more rows (prefill, big batches): compute decides, so tiles of 4 rows x 3 weight rows (12
//   accumulators: 7 loads per 12 multiply-adds) over blocks of BLOCK_COLS weight rows that stay in cache
//   while every row of x passes them (a pass over SmolLM2 at 64 / 256 rows: 119 / 462 ms, oneDNN's 128 /
//   455, the unblocked tiling's 212 / 1114; session 56).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "lanes.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t FEW_ROWS = 12;
constexpr int64_t BLOCK_COLS = 48;

using dspark_cpu::lane_sum;

// RM rows of x (row stride k) against RN weight rows (row stride k): y[r * ldy + c] for r < RM, c < RN.
template <int RM, int RN>
inline void tile(const float* x, const float* w, int64_t k, float* y, int64_t ldy) {
  __m256 acc[RM][RN];
  for (int r = 0; r < RM; ++r)
    for (int c = 0; c < RN; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    __m256 wv[RN];
    for (int c = 0; c < RN; ++c) wv[c] = _mm256_loadu_ps(w + c * k + i);
    for (int r = 0; r < RM; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * k + i);
      for (int c = 0; c < RN; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RM; ++r)
    for (int c = 0; c < RN; ++c) {
      float s = lane_sum(acc[r][c]);
      for (int64_t t = i; t < k; ++t) s = std::fma(x[r * k + t], w[c * k + t], s);
      y[r * ldy + c] = s;
    }
}

// RM rows of x against weight rows [0, cols): RN at a time, then one at a time.
template <int RM, int RN>
inline void rows_by_cols(const float* x, const float* w, int64_t k, float* y, int64_t ldy, int64_t cols) {
  int64_t c = 0;
  for (; c + RN <= cols; c += RN) tile<RM, RN>(x, w + c * k, k, y + c, ldy);
  for (; c < cols; ++c) tile<RM, 1>(x, w + c * k, k, y + c, ldy);
}

// Every row of x against weight rows [0, cols) (a block that stays in cache): RM rows at a time, then the
// rest.
template <int RM, int RN>
inline void all_rows(const float* x, int64_t rows, const float* w, int64_t k, float* y, int64_t ldy,
                     int64_t cols) {
  int64_t r = 0;
  for (; r + RM <= rows; r += RM) rows_by_cols<RM, RN>(x + r * k, w, k, y + r * ldy, ldy, cols);
  switch (rows - r) {
    case 3: rows_by_cols<3, RN>(x + r * k, w, k, y + r * ldy, ldy, cols); break;
    case 2: rows_by_cols<2, RN>(x + r * k, w, k, y + r * ldy, ldy, cols); break;
    case 1: rows_by_cols<1, RN>(x + r * k, w, k, y + r * ldy, ldy, cols); break;
    default: break;
  }
}

// Few rows: each weight row read once, against every row of x (eight, then four, then the rest at a time).
inline void few_rows(const float* x, int64_t rows, const float* w, int64_t k, float* y, int64_t ldy,
                     int64_t cols) {
  for (int64_t c = 0; c < cols; ++c) {
    const float* w_row = w + c * k;
    int64_t r = 0;
    for (; r + 8 <= rows; r += 8) tile<8, 1>(x + r * k, w_row, k, y + r * ldy + c, ldy);
    for (; r + 4 <= rows; r += 4) tile<4, 1>(x + r * k, w_row, k, y + r * ldy + c, ldy);
    switch (rows - r) {
      case 3: tile<3, 1>(x + r * k, w_row, k, y + r * ldy + c, ldy); break;
      case 2: tile<2, 1>(x + r * k, w_row, k, y + r * ldy + c, ldy); break;
      case 1: tile<1, 1>(x + r * k, w_row, k, y + r * ldy + c, ldy); break;
      default: break;
    }
  }
}

// Rows of x against weight rows [0, cols) into y (row stride ldy), by the row count's tiling.
inline void products(const float* x, int64_t rows, const float* w, int64_t k, float* y, int64_t ldy,
                     int64_t cols) {
  if (rows <= FEW_ROWS) {
    few_rows(x, rows, w, k, y, ldy, cols);
    return;
  }
  for (int64_t jb = 0; jb < cols; jb += BLOCK_COLS) {
    all_rows<4, 3>(x, rows, w + jb * k, k, y + jb, ldy, std::min(BLOCK_COLS, cols - jb));
  }
}

// e^v for eight lanes: v = n ln2 + r, |r| <= ln2 / 2, e^r by Cephes' degree-6 polynomial (relative error
// ~1e-7), times 2^n through the exponent bits; v clamped to fp32's range.
inline __m256 exp8(__m256 v) {
  v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), v);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

// silu(g) * u = g / (1 + e^-g) * u for eight lanes.
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

// y[c] = silu(g[c]) * u[c] for c < cols; the last cols % 8 through the same eight-lane code (padded), so
// every column gets the same bits wherever a chunk of columns begins.
inline void silu_mul_row(const float* g, const float* u, float* y, int64_t cols) {
  int64_t c = 0;
  for (; c + 8 <= cols; c += 8) _mm256_storeu_ps(y + c, silu_mul8(_mm256_loadu_ps(g + c), _mm256_loadu_ps(u + c)));
  if (c < cols) {
    alignas(32) float gt[8] = {0}, ut[8] = {0}, yt[8];
    std::copy(g + c, g + cols, gt);
    std::copy(u + c, u + cols, ut);
    _mm256_store_ps(yt, silu_mul8(_mm256_load_ps(gt), _mm256_load_ps(ut)));
    std::copy(yt, yt + (cols - c), y + c);
  }
}

void check_operands(const torch::Tensor& x, const torch::Tensor& w, const char* name) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), name, ": x [rows, k], w [n, k]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, name, ": float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), name, ": contiguous operands only");
}

}  // namespace

torch::Tensor linear_rows(const torch::Tensor& x, const torch::Tensor& w) {
  check_operands(x, w, "linear_rows");
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0);
  auto y = torch::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Torch's own thread pool splits the weight rows (the same threads as every other op of the step).
  at::parallel_for(0, n, 64, [&](int64_t j0, int64_t j1) { products(xp, rows, wp + j0 * k, k, yp + j0, n, j1 - j0); });
  return y;
}

// SwiGLU's gate/up projection with its activation in the epilogue: w [2n, k] holds the gate rows then the
// up rows; y [rows, n] = silu(x Wg^T) * (x Wu^T), both products summed exactly as linear_rows sums them.
torch::Tensor silu_mul_rows(const torch::Tensor& x, const torch::Tensor& w) {
  check_operands(x, w, "silu_mul_rows");
  TORCH_CHECK(w.size(0) % 2 == 0, "silu_mul_rows: w holds gate rows then as many up rows");
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0) / 2;
  auto y = torch::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t j0, int64_t j1) {
    const int64_t cols = j1 - j0;
    std::vector<float> gate(rows * cols), up(rows * cols);
    products(xp, rows, wp + j0 * k, k, gate.data(), cols, cols);
    products(xp, rows, wp + (n + j0) * k, k, up.data(), cols, cols);
    for (int64_t r = 0; r < rows; ++r) silu_mul_row(gate.data() + r * cols, up.data() + r * cols, yp + r * n + j0, cols);
  });
  return y;
}

std::vector<torch::Tensor> rms_norm_rows(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
                                         const torch::Tensor& weight, double eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_rows", &linear_rows, "x [rows, k] @ w [n, k]^T in fp32, each output summed in one order");
  m.def("silu_mul_rows", &silu_mul_rows, "silu(x Wg^T) * (x Wu^T) for w = [Wg; Wu], the products as linear_rows");
  m.def("rms_norm_rows", &rms_norm_rows, "RMSNorm of each row (after adding the residual, if given), fp32");
}
