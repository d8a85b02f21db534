// Fused decode attention for the continuous-batching engine (one new token per sequence).
//
// Why a kernel: at decode time each sequence attends with one query per head to its own cached prefix, so
// in torch ops this is RoPE (3 ops) + a KV store + two grouped matmuls of 3-row matrices (GQA groups)
// + softmax per layer; on CPU those small batched matmuls run far below the machine's speed and bf16 ones
// copy their strided operands first. Here one pass per (sequence, kv head) does it all: RoPE on q and k,
// store the new k and v in the cache, scores, softmax, weighted sum of v, accumulating in fp32. The torch
// path in model.py (`Attention.decode`) computes the same thing and is used wherever this does not build.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  // bf16 is the high half of an fp32: widen to 32 bits and shift.
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 masked_load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 masked_load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

// exp of each of n floats in place. AVX-512: exp(x) = 2^k * e^r, |r| <= ln2/2, e^r by its degree-7 Taylor
// polynomial (relative error < 3e-7 on that range, below fp32's 6e-8 ulp times a few).
inline void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  // ln 2 split in two (Cody-Waite) so that k * ln2 stays exact enough for large |k|.
  const __m512 ln2_hi = _mm512_set1_ps(0.693145751953125f), ln2_lo = _mm512_set1_ps(1.428606765330187e-06f);
  const __m512 lo = _mm512_set1_ps(-87.0f), hi = _mm512_set1_ps(88.0f);
  for (; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(k, ln2_lo, _mm512_fnmadd_ps(k, ln2_hi, v));
    __m512 p = _mm512_set1_ps(1.f / 5040.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    _mm512_mask_storeu_ps(x + i, m, _mm512_scalef_ps(p, k));
  }
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

// Scores of the G queries (fp32, [G, D]) against keys 0..n) stored TRANSPOSED: kt[d * L + s].
template <typename T>
void scores_of(const float* q, const T* kt, int64_t L, int64_t n, int64_t G, int64_t D, float* out /* [G, n] */) {
#if defined(__AVX512F__)
  // 64 keys per pass in four independent accumulators (FMA latency is hidden), masked at the tail (masked-off
  // lanes are neither read nor written).
  auto mask = [n](int64_t s) -> __mmask16 {
    return s >= n ? 0 : n - s >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - s)) - 1);
  };
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    float* og = out + g * n;
    for (int64_t s0 = 0; s0 < n; s0 += 64) {
      const __mmask16 m0 = mask(s0), m1 = mask(s0 + 16), m2 = mask(s0 + 32), m3 = mask(s0 + 48);
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        const __m512 w = _mm512_set1_ps(qg[d]);
        const T* row = kt + d * L + s0;
        a0 = _mm512_fmadd_ps(w, masked_load16(row, m0), a0);
        a1 = _mm512_fmadd_ps(w, masked_load16(row + 16, m1), a1);
        a2 = _mm512_fmadd_ps(w, masked_load16(row + 32, m2), a2);
        a3 = _mm512_fmadd_ps(w, masked_load16(row + 48, m3), a3);
      }
      _mm512_mask_storeu_ps(og + s0, m0, a0);
      _mm512_mask_storeu_ps(og + s0 + 16, m1, a1);
      _mm512_mask_storeu_ps(og + s0 + 32, m2, a2);
      _mm512_mask_storeu_ps(og + s0 + 48, m3, a3);
    }
  }
  return;
#endif
  for (int64_t s = 0; s < n; ++s)
    for (int64_t g = 0; g < G; ++g) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += q[g * D + d] * to_float(kt[d * L + s]);
      out[g * n + s] = acc;
    }
}

#if defined(__AVX512F__)
// acc[G, C*16] = p[G, n] @ v[n, C*16], C accumulators per query (held in registers: C is a constant).
template <typename T, int C>
void weighted_sum_vec(const float* p, const T* v, int64_t n, int64_t G, float* acc) {
  constexpr int64_t D = C * 16;
  for (int64_t g = 0; g < G; ++g) {
    __m512 a[C];
    for (int c = 0; c < C; ++c) a[c] = _mm512_setzero_ps();
    const float* pg = p + g * n;
    for (int64_t s = 0; s < n; ++s) {
      const __m512 w = _mm512_set1_ps(pg[s]);
      for (int c = 0; c < C; ++c) a[c] = _mm512_fmadd_ps(w, load16(v + s * D + c * 16), a[c]);
    }
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * D + c * 16, a[c]);
  }
}
#endif

// acc[G, D] = p[G, n] @ v[n, D]
template <typename T>
void weighted_sum(const float* p, const T* v, int64_t n, int64_t G, int64_t D, float* acc) {
#if defined(__AVX512F__)
  if (D == 64) return weighted_sum_vec<T, 4>(p, v, n, G, acc);
  if (D == 128) return weighted_sum_vec<T, 8>(p, v, n, G, acc);
  if (D == 32) return weighted_sum_vec<T, 2>(p, v, n, G, acc);
#endif
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) {
      float a = 0.f;
      for (int64_t s = 0; s < n; ++s) a += p[g * n + s] * to_float(v[s * D + d]);
      acc[g * D + d] = a;
    }
}

// RoPE of one head (HF convention: rotate_half), in fp32: out = x * cos + rotate_half(x) * sin.
template <typename T>
void rope(const T* x, const float* cos, const float* sin, int64_t D, float scale, float* out) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d)
    out[d] = (to_float(x[d]) * cos[d] - to_float(x[d + half]) * sin[d]) * scale;
  for (int64_t d = half; d < D; ++d)
    out[d] = (to_float(x[d]) * cos[d] + to_float(x[d - half]) * sin[d]) * scale;
}

template <typename T>
void decode_attention_impl(const T* qkv, const float* cos, const float* sin, T* kv, const int64_t* lens, T* y,
                           int64_t B, int64_t H, int64_t KV, int64_t D, int64_t slots, int64_t L, float scale) {
  const int64_t G = H / KV, row = (H + 2 * KV) * D;
  const int64_t head_stride = L * D, slot_stride = KV * head_stride, kv_stride = slots * slot_stride;
  at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(G * D), acc(G * D), tmp(D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KV, h = task % KV, pos = lens[b], n = pos + 1;
      const T* x = qkv + b * row;
      const float* c = cos + b * D;
      const float* s = sin + b * D;
      T* k = kv + b * slot_stride + h * head_stride;
      T* v = k + kv_stride;
      rope(x + (H + h) * D, c, s, D, 1.f, tmp.data());
      for (int64_t d = 0; d < D; ++d) {
        k[d * L + pos] = static_cast<T>(tmp[d]);  // keys are stored transposed: [D, L] per head
        v[pos * D + d] = x[(H + KV + h) * D + d];
      }
      for (int64_t g = 0; g < G; ++g) rope(x + (h * G + g) * D, c, s, D, scale, q.data() + g * D);
      scores.resize(G * n);
      scores_of(q.data(), k, L, n, G, D, scores.data());
      for (int64_t g = 0; g < G; ++g) {
        float* sc = scores.data() + g * n;
        float top = sc[0];
        for (int64_t i = 1; i < n; ++i) top = sc[i] > top ? sc[i] : top;
        for (int64_t i = 0; i < n; ++i) sc[i] -= top;
        exp_inplace(sc, n);
        float total = 0.f;
        for (int64_t i = 0; i < n; ++i) total += sc[i];
        const float inv = 1.f / total;
        for (int64_t i = 0; i < n; ++i) sc[i] *= inv;
      }
      weighted_sum(scores.data(), v, n, G, D, acc.data());
      T* out = y + b * H * D + h * G * D;
      for (int64_t i = 0; i < G * D; ++i) out[i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

// qkv: [B, (H + 2 KV) * D] (q heads, then k heads, then v heads), cos/sin: [B, D] fp32 rotary rows at
// each sequence's position, kv: one layer of the cache [2, slots, KV, L, D] (keys then values; each key
// head block holds its [L, D] keys TRANSPOSED, as [D, L], see model.KVSlots), lens: [B]
// positions (sequence b sits in slot b and attends to positions 0..lens[b]). Stores the new k, v at
// position lens[b] of slot b and returns the attention output [B, H * D].
torch::Tensor decode_attention(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor kv,
                               torch::Tensor lens, int64_t heads, double scale) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qkv must be a contiguous [B, (H + 2KV) * D]");
  TORCH_CHECK(kv.dim() == 5 && kv.size(0) == 2 && kv.is_contiguous(), "kv must be a contiguous [2, slots, KV, L, D]");
  TORCH_CHECK(kv.scalar_type() == qkv.scalar_type(), "kv and qkv dtypes differ");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous(), "cos/sin must be contiguous fp32 [B, D]");
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.is_contiguous(), "lens must be contiguous int64");
  const int64_t B = qkv.size(0), KV = kv.size(2), L = kv.size(3), D = kv.size(4), slots = kv.size(1);
  TORCH_CHECK(heads % KV == 0 && qkv.size(1) == (heads + 2 * KV) * D && cos.size(0) == B && cos.size(1) == D &&
              lens.size(0) == B && B <= slots, "shapes do not agree");
  const int64_t* pos = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(pos[b] >= 0 && pos[b] < L, "a position is outside the cache");
  auto y = torch::empty({B, heads * D}, qkv.options());
  if (qkv.scalar_type() == at::kFloat) {
    decode_attention_impl<float>(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                                 kv.data_ptr<float>(), lens.data_ptr<int64_t>(), y.data_ptr<float>(), B, heads, KV,
                                 D, slots, L, static_cast<float>(scale));
  } else if (qkv.scalar_type() == at::kBFloat16) {
    decode_attention_impl<c10::BFloat16>(qkv.data_ptr<c10::BFloat16>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                                         kv.data_ptr<c10::BFloat16>(), lens.data_ptr<int64_t>(),
                                         y.data_ptr<c10::BFloat16>(), B, heads, KV, D, slots, L,
                                         static_cast<float>(scale));
  } else {
    TORCH_CHECK(false, "decode_attention supports float32 and bfloat16");
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "fused RoPE + KV store + attention for one decode step");
}
