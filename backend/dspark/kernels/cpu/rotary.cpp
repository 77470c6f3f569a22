// Rotary embedding and the paged KV store of a CPU step's tokens in one call, fp32 (see linear.py).
//
// What `reference.rotary_store_kv` does without q/k norms, with the step's multipliers made once on the
// host (`reference.host_rotation`): q and k rotated (rotate-half, the Hugging Face Llama convention), the
// rotated k and v written at their cache slots (negative slots skipped), the rotated q returned. Torch
// runs that as ~12 small ops a layer (a decode step of SmolLM2 on a 2-core Xeon: ~5 ms of a 36 ms step,
// session 58); here it is one. Each value is rounded as the reference rounds it, x * cos and x' * sin
// each to fp32, then their sum (the extension is built with -ffp-contract=off, so no multiply-add is
// fused), so the results are the reference's bits.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

namespace {

// out = x * cos + rotate_half(x) * sin for one head of d values; cos = [c, c], sin = [-s, s].
inline void rotate(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < half; ++j) out[j] = x[j] * cos[j] + x[j + half] * sin[j];
  for (int64_t j = half; j < d; ++j) out[j] = x[j] * cos[j] + x[j - half] * sin[j];
}

void check_heads(const at::Tensor& t, const char* name, int64_t tokens, int64_t d) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == tokens && t.size(2) == d, "rotary_store_rows: ", name,
              " [tokens, heads, head_dim]");
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.stride(2) == 1, "rotary_store_rows: ", name,
              " float32 with contiguous head values");
}

}  // namespace

at::Tensor rotary_store_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                             at::Tensor& v_cache, const at::Tensor& slots) {
  const int64_t tokens = q.size(0), num_q = q.size(1), d = q.size(2), num_kv = k.size(1);
  check_heads(q, "q", tokens, d);
  check_heads(k, "k", tokens, d);
  check_heads(v, "v", tokens, d);
  TORCH_CHECK(d % 2 == 0 && v.size(1) == num_kv, "rotary_store_rows: an even head_dim, as many v heads as k");
  for (const auto* table : {&cos, &sin})
    TORCH_CHECK(table->scalar_type() == at::kFloat && table->is_contiguous() && table->numel() == tokens * d,
                "rotary_store_rows: cos and sin float32 [tokens, (1,) head_dim], contiguous");
  for (const auto* cache : {&k_cache, &v_cache})
    TORCH_CHECK(cache->scalar_type() == at::kFloat && cache->is_contiguous() && cache->size(-1) == d &&
                    cache->size(-2) == num_kv,
                "rotary_store_rows: caches float32 [..., kv_heads, head_dim], contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == tokens,
              "rotary_store_rows: slots int64 [tokens]");
  const int64_t num_slots = k_cache.numel() / (num_kv * d);
  TORCH_CHECK(v_cache.numel() == k_cache.numel(), "rotary_store_rows: caches of one size");
  auto out = at::empty({tokens, num_q, d}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t* slot_of = slots.data_ptr<int64_t>();
  float *op = out.data_ptr<float>(), *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot_of[t] < num_slots, "rotary_store_rows: slot ", slot_of[t], " past the cache's ", num_slots);
  // A decode step's few tokens run on this thread (a pool's hand-off costs more than the work).
  at::parallel_for(0, tokens, 32, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float *c = cp + t * d, *s = sp + t * d;
      for (int64_t h = 0; h < num_q; ++h) rotate(qp + t * q.stride(0) + h * q.stride(1), c, s, d, op + (t * num_q + h) * d);
      const int64_t slot = slot_of[t];
      if (slot < 0) continue;
      for (int64_t h = 0; h < num_kv; ++h) {
        rotate(kp + t * k.stride(0) + h * k.stride(1), c, s, d, kc + (slot * num_kv + h) * d);
        const float* vh = vp + t * v.stride(0) + h * v.stride(1);
        std::copy(vh, vh + d, vc + (slot * num_kv + h) * d);
      }
    }
  });
  return out;
}
