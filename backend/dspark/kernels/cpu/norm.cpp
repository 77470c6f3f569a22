// RMSNorm of rows in fp32 on an x86-64 CPU with AVX2 and FMA, with the residual add fused (see linear.py).
//
// One call where torch's CPU rms_norm runs five ops and the add a sixth (a decode row of SmolLM2: 22.6 us
// for torch's add and norm against 2.4 here, session 56; a step has 61). Each row is normed alone, its sum of squares in eight lanes
// over the row then a fixed tree then the tail in order: the same bits whatever rows are beside it.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <immintrin.h>

#include "lanes.h"

#include <cmath>
#include <vector>

namespace {

using dspark_cpu::lane_sum;

// out = s * rsqrt(mean(s^2) + eps) * w for one row s of h values.
inline void norm_row(const float* s, const float* w, int64_t h, float eps, float* out) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= h; i += 8) {
    const __m256 v = _mm256_loadu_ps(s + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float squares = lane_sum(acc);
  for (int64_t t = i; t < h; ++t) squares = std::fma(s[t], s[t], squares);
  const float scale = 1.0f / std::sqrt(squares / static_cast<float>(h) + eps);
  const __m256 sv = _mm256_set1_ps(scale);
  for (i = 0; i + 8 <= h; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(s + i), sv), _mm256_loadu_ps(w + i)));
  }
  for (; i < h; ++i) out[i] = (s[i] * scale) * w[i];
}

}  // namespace

std::vector<at::Tensor> rms_norm_rows(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                      const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "rms_norm_rows: x [rows, h], weight [h]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm_rows: float32 only");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm_rows: contiguous operands only");
  const int64_t rows = x.size(0), h = x.size(1);
  auto out = at::empty_like(x);
  at::Tensor summed;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* rp = nullptr;
  float* sp = nullptr;
  if (residual.has_value()) {
    const at::Tensor& res = residual.value();
    TORCH_CHECK(res.sizes() == x.sizes() && res.scalar_type() == at::kFloat && res.is_contiguous(),
                "rms_norm_rows: residual like x, contiguous");
    summed = at::empty_like(x);
    rp = res.data_ptr<float>();
    sp = summed.data_ptr<float>();
  }
  const float e = static_cast<float>(eps);
  // Rows apart on torch's threads once there are enough to pay for waking them (a decode step's few
  // rows run on the caller's thread).
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * h;
      if (residual.has_value()) {
        float* s = sp + r * h;
        const float* q = rp + r * h;
        int64_t i = 0;
        for (; i + 8 <= h; i += 8) _mm256_storeu_ps(s + i, _mm256_add_ps(_mm256_loadu_ps(row + i), _mm256_loadu_ps(q + i)));
        for (; i < h; ++i) s[i] = row[i] + q[i];
        row = s;
      }
      norm_row(row, wp, h, e, op + r * h);
    }
  });
  if (residual.has_value()) return {out, summed};
  return {out};
}
