// y = x W^T in fp32 on an x86-64 CPU with AVX2 and FMA (AVX-512 where the build has it), for any number
// of rows of x (see linear.py).
//
// Each output y[r, j] is one sum in one order, whatever rows or columns are computed beside it: LANES
// lanes (8 with AVX2, 16 with AVX-512: one build per machine, so one order per machine) accumulate
// x[r, k] * W[j, k] over k in steps of LANES (fused multiply-adds), the lanes are added in a fixed tree,
// then the last k % LANES products in order. Every tiling below keeps that order, so a row's result is the
// same bits alone, in a verify window or in a prefill chunk of hundreds of rows, which keeps speculative
// greedy decoding token-identical to plain decoding whatever the step's shape.
//
// Two tilings, chosen by the row count only (never changing a sum):
// - up to FEW_ROWS rows (decode steps, verify windows): the weights stream from memory in blocks of
//   FEW_COLS weight rows, each block read from memory once (prefetched PREFETCH_BLOCKS blocks ahead, so
//   the memory stays busy while the rows are multiplied) and then from L1 against every row of x,
//   FEW_TILE_ROWS at a time. A pass over SmolLM2's weights on a 2-core Xeon with AVX-512 (session 58):
//   21 / 23 / 21 / 25 / 30 ms at 1 / 2 / 4 / 8 / 12 rows, against 31 / 34 / 32 / 40 / 47 for one weight
//   row at a time against 8 rows of x (the tiling before) and MKL's 23 / 26 / 38 / 50 / 61;
// - more rows (prefill, big batches): compute decides, so tiles of MANY_TILE_ROWS rows x MANY_COLS weight
//   rows over blocks of BLOCK_COLS weight rows that stay in cache while every row of x passes them (the
//   Xeon at 64 / 256 rows with AVX-512's 4 x 6 tiles: 97 / 320 ms, MKL's 97 / 277; the 2-core AMD EPYC
//   with AVX2's 4 x 3: 119 / 462 ms, oneDNN's 128 / 455; sessions 56, 58).
// Light headers, not <torch/extension.h>: a file including that took ~55 s to compile on a 2-core host,
// with these ~19 s (the whole build 99 s -> 32 s, session 65).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <immintrin.h>

#include "lanes.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using dspark_cpu::lane_sum;

#ifdef __AVX512F__
using vec = __m512;
constexpr int64_t LANES = 16;
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
// The upper eight lanes onto the lower, then the eight-lane tree.
inline float vsum(vec v) { return lane_sum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1))); }
// 32 vector registers: tiles of up to 24 accumulators.
constexpr int FEW_TILE_ROWS = 4, FEW_COLS = 4, MANY_COLS = 6;
constexpr int64_t BLOCK_COLS = 96;
constexpr int64_t PREFETCH_BLOCKS = 1;
#else
using vec = __m256;
constexpr int64_t LANES = 8;
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec v) { return lane_sum(v); }
// 16 vector registers: 12 accumulators, the weight vectors and one of x.
constexpr int FEW_TILE_ROWS = 4, FEW_COLS = 3, MANY_COLS = 3;
constexpr int64_t BLOCK_COLS = 48;
constexpr int64_t PREFETCH_BLOCKS = 2;
#endif
constexpr int MANY_TILE_ROWS = 4;
constexpr int64_t FEW_ROWS = 32;

// RM rows of x (row stride k) against RN weight rows (row stride k): y[r * ldy + c] for r < RM, c < RN.
// PREFETCH: also ask for the same columns of the weight rows PREFETCH_BLOCKS blocks of RN ahead (the
// first pass over a block; reading past the weights' end is harmless, a prefetch never faults).
template <int RM, int RN, bool PREFETCH = false>
inline void tile(const float* x, const float* w, int64_t k, float* y, int64_t ldy) {
  vec acc[RM][RN];
  for (int r = 0; r < RM; ++r)
    for (int c = 0; c < RN; ++c) acc[r][c] = vzero();
  int64_t i = 0;
  for (; i + LANES <= k; i += LANES) {
    vec wv[RN];
    for (int c = 0; c < RN; ++c) wv[c] = vload(w + c * k + i);
    if (PREFETCH)
      for (int c = 0; c < RN; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(w + (c + PREFETCH_BLOCKS * RN) * k + i), _MM_HINT_T0);
    for (int r = 0; r < RM; ++r) {
      const vec xv = vload(x + r * k + i);
      for (int c = 0; c < RN; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RM; ++r)
    for (int c = 0; c < RN; ++c) {
      float s = vsum(acc[r][c]);
      for (int64_t t = i; t < k; ++t) s = std::fma(x[r * k + t], w[c * k + t], s);
      y[r * ldy + c] = s;
    }
}

// Rows of x against RN weight rows, RM rows at a time, then the rest (three, two or one); the first tile
// with PREFETCH.
template <int RM, int RN, bool PREFETCH>
inline void rows_against(const float* x, int64_t rows, const float* w, int64_t k, float* y, int64_t ldy) {
  static_assert(RM == 4, "the remainders below are those of four rows");
  int64_t r = 0;
  if (rows >= RM) {
    tile<RM, RN, PREFETCH>(x, w, k, y, ldy);
    r = RM;
  }
  for (; r + RM <= rows; r += RM) tile<RM, RN>(x + r * k, w, k, y + r * ldy, ldy);
  switch (rows - r) {
    case 3: tile<3, RN, PREFETCH>(x + r * k, w, k, y + r * ldy, ldy); break;
    case 2: tile<2, RN, PREFETCH>(x + r * k, w, k, y + r * ldy, ldy); break;
    case 1: tile<1, RN, PREFETCH>(x + r * k, w, k, y + r * ldy, ldy); break;
    default: break;
  }
}

// Few rows: blocks of FEW_COLS weight rows, each against every row of x, then the last weight rows one
// at a time.
inline void few_rows(const float* x, int64_t rows, const float* w, int64_t k, float* y, int64_t ldy,
                     int64_t cols) {
  int64_t c = 0;
  for (; c + FEW_COLS <= cols; c += FEW_COLS)
    rows_against<FEW_TILE_ROWS, FEW_COLS, true>(x, rows, w + c * k, k, y + c, ldy);
  for (; c < cols; ++c) rows_against<FEW_TILE_ROWS, 1, false>(x, rows, w + c * k, k, y + c, ldy);
}

// Many rows: blocks of BLOCK_COLS weight rows (kept in cache), every row of x against each block in
// tiles of MANY_TILE_ROWS x MANY_COLS, then the block's last weight rows one at a time.
inline void many_rows(const float* x, int64_t rows, const float* w, int64_t k, float* y, int64_t ldy,
                      int64_t cols) {
  for (int64_t jb = 0; jb < cols; jb += BLOCK_COLS) {
    const int64_t block = std::min(BLOCK_COLS, cols - jb);
    const float* wb = w + jb * k;
    for (int64_t r = 0; r < rows; r += MANY_TILE_ROWS) {
      const int64_t tile_rows = std::min<int64_t>(MANY_TILE_ROWS, rows - r);
      int64_t c = 0;
      for (; c + MANY_COLS <= block; c += MANY_COLS)
        rows_against<MANY_TILE_ROWS, MANY_COLS, false>(x + r * k, tile_rows, wb + c * k, k, y + r * ldy + jb + c, ldy);
      for (; c < block; ++c)
        rows_against<MANY_TILE_ROWS, 1, false>(x + r * k, tile_rows, wb + c * k, k, y + r * ldy + jb + c, ldy);
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
  many_rows(x, rows, w, k, y, ldy, cols);
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

void check_operands(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), name, ": x [rows, k], w [n, k]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, name, ": float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), name, ": contiguous operands only");
}

}  // namespace

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w) {
  check_operands(x, w, "linear_rows");
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0);
  auto y = at::empty({rows, n}, x.options());
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
at::Tensor silu_mul_rows(const at::Tensor& x, const at::Tensor& w) {
  check_operands(x, w, "silu_mul_rows");
  TORCH_CHECK(w.size(0) % 2 == 0, "silu_mul_rows: w holds gate rows then as many up rows");
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0) / 2;
  auto y = at::empty({rows, n}, x.options());
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

std::vector<at::Tensor> rms_norm_rows(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                      const at::Tensor& weight, double eps);
at::Tensor rotary_store_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                             at::Tensor& v_cache, const at::Tensor& slots);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_rows", &linear_rows, "x [rows, k] @ w [n, k]^T in fp32, each output summed in one order");
  m.def("silu_mul_rows", &silu_mul_rows, "silu(x Wg^T) * (x Wu^T) for w = [Wg; Wu], the products as linear_rows");
  m.def("rms_norm_rows", &rms_norm_rows, "RMSNorm of each row (after adding the residual, if given), fp32");
  m.def("rotary_store_rows", &rotary_store_rows, "rotary on q and k, k and v stored at their slots; rotated q");
}
