// Fused decode attention for the continuous-batching engine (one new token per sequence).
//
// Why a kernel: at decode time each sequence attends with one query per head to its own cached prefix, so
// in torch ops this is RoPE (3 ops) + a KV store + two grouped matmuls of 3-row matrices (GQA groups)
// + softmax per layer; on CPU those small batched matmuls run far below the machine's speed and bf16 ones
// copy their strided operands first. Here one pass per (sequence, kv head) does it all: RoPE on q and k,
// store the new k and v in the cache, scores, softmax, weighted sum of v, accumulating in fp32.
// Keys are stored in blocks of kBlock positions, each block transposed ([D, kBlock]; see model.KVSlots): the
// scores of 16 positions are 16 lanes of one vector, and a sequence's keys are one contiguous run. The torch
// path in model.py (`Attention.decode`) computes the same thing and is used wherever this does not build.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__SSE__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 16;  // positions per key block (model.KEY_BLOCK)

// Element (d, s) of one head's blocked keys.
inline int64_t key_index(int64_t d, int64_t s, int64_t D) { return (s / kBlock) * D * kBlock + d * kBlock + s % kBlock; }

// The next task's keys and values, requested one cache line at a time from inside this task's loops: a
// burst of requests at the task's start fills the miss queue and stalls the core, while spread out they
// arrive as the arithmetic runs.
struct Ahead {
  const char* k = nullptr;
  const char* k_end = nullptr;
  const char* v = nullptr;
  const char* v_end = nullptr;
  inline void step() {
#if defined(__AVX512F__) || defined(__SSE__)
    if (k < k_end) {
      _mm_prefetch(k, _MM_HINT_T1);
      k += 64;
    } else if (v < v_end) {
      _mm_prefetch(v, _MM_HINT_T1);
      v += 64;
    }
#endif
  }
};

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  // bf16 is the high half of an fp32: widen to 32 bits and shift.
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  // Round to nearest even, as c10::BFloat16's conversion does (inputs here are finite).
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
// x rounded to T and back to fp32 (what storing then loading a T would give).
inline __m512 round_to(float*, __m512 v) { return v; }
inline __m512 round_to(c10::BFloat16*, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline __m512 masked_load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 masked_load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

#if defined(__AVX512F__)
inline __mmask16 tail_mask(int64_t left) {
  return left <= 0 ? 0 : left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// e^x for x in [-87, 88] (clamped): e^x = 2^k * e^r with |r| <= ln2/2, e^r by its degree-7 Taylor
// polynomial (relative error < 1e-8 on that range; ln 2 split in two so k * ln2 stays exact).
inline __m512 exp_ps(__m512 v) {
  v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187e-06f),
                                    _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), v));
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, k);
}
#endif

// Softmax of n floats in place.
inline void softmax_inplace(float* x, int64_t n) {
#if defined(__AVX512F__)
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 16)
    top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(n - i), x + i));
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), mx));
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, e));
    _mm512_mask_storeu_ps(x + i, m, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), inv));
  }
#else
  float top = x[0];
  for (int64_t i = 1; i < n; ++i) top = x[i] > top ? x[i] : top;
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - top);
    total += x[i];
  }
  const float inv = 1.f / total;
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
#endif
}

#if defined(__AVX512F__)
// Scores of GN (compile-time) queries against the 32 keys of the two blocks from s0 (a multiple of 32):
// each key load serves every query and the 2 * GN accumulators are independent (FMA latency hidden).
template <typename T, int GN>
void scores_block(const float* q, const T* kb, int64_t n, int64_t D, int64_t s0, float* out, Ahead& ahead) {
  const __mmask16 m0 = tail_mask(n - s0), m1 = tail_mask(n - s0 - 16);
  const T* block0 = kb + (s0 / kBlock) * D * kBlock;
  const T* block1 = block0 + D * kBlock;  // read only under a non-empty mask m1
  __m512 a0[GN], a1[GN];
  for (int j = 0; j < GN; ++j) a0[j] = a1[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 k0 = masked_load16(block0 + d * kBlock, m0);
    const __m512 k1 = m1 ? masked_load16(block1 + d * kBlock, m1) : _mm512_setzero_ps();
    // One line per iteration covers bf16 keys and values with the weighted sum's; fp32 has twice the lines.
    for (size_t r = 0; r < sizeof(T) / 2; ++r) ahead.step();
    for (int j = 0; j < GN; ++j) {
      const __m512 w = _mm512_set1_ps(q[j * D + d]);
      a0[j] = _mm512_fmadd_ps(w, k0, a0[j]);
      a1[j] = _mm512_fmadd_ps(w, k1, a1[j]);
    }
  }
  for (int j = 0; j < GN; ++j) {
    _mm512_mask_storeu_ps(out + j * n + s0, m0, a0[j]);
    _mm512_mask_storeu_ps(out + j * n + s0 + 16, m1, a1[j]);
  }
}
#endif

// Scores of the G queries (fp32, [G, D]) against keys 0..n) stored in transposed blocks (key_index).
template <typename T>
void scores_of(const float* q, const T* kb, int64_t n, int64_t G, int64_t D, float* out /* [G, n] */, Ahead& ahead) {
#if defined(__AVX512F__)
  for (int64_t g0 = 0; g0 < G; g0 += 4) {  // up to 4 queries per pass (masked tails: nothing past n is read)
    const int64_t gn = G - g0 < 4 ? G - g0 : 4;
    for (int64_t s0 = 0; s0 < n; s0 += 32) {
      const float* qg = q + g0 * D;
      float* og = out + g0 * n;
      if (gn == 4) scores_block<T, 4>(qg, kb, n, D, s0, og, ahead);
      else if (gn == 3) scores_block<T, 3>(qg, kb, n, D, s0, og, ahead);
      else if (gn == 2) scores_block<T, 2>(qg, kb, n, D, s0, og, ahead);
      else scores_block<T, 1>(qg, kb, n, D, s0, og, ahead);
    }
  }
  return;
#endif
  for (int64_t s = 0; s < n; ++s)
    for (int64_t g = 0; g < G; ++g) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += q[g * D + d] * to_float(kb[key_index(d, s, D)]);
      out[g * n + s] = acc;
    }
}

#if defined(__AVX512F__)
// acc[GN, C*16] = p[GN, n] @ v[n, C*16]: GN * C accumulators in registers (both are constants), each row of
// v loaded once for all GN queries.
template <typename T, int C, int GN>
void weighted_sum_block(const float* p, const T* v, int64_t n, float* acc, Ahead& ahead) {
  constexpr int64_t D = C * 16;
  __m512 a[GN][C];
  for (int j = 0; j < GN; ++j)
    for (int c = 0; c < C; ++c) a[j][c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < n; ++s) {
    __m512 row[C];
    for (int c = 0; c < C; ++c) row[c] = load16(v + s * D + c * 16);
    ahead.step();
    ahead.step();
    for (int j = 0; j < GN; ++j) {
      const __m512 w = _mm512_set1_ps(p[j * n + s]);
      for (int c = 0; c < C; ++c) a[j][c] = _mm512_fmadd_ps(w, row[c], a[j][c]);
    }
  }
  for (int j = 0; j < GN; ++j)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + j * D + c * 16, a[j][c]);
}

template <typename T, int C>
void weighted_sum_vec(const float* p, const T* v, int64_t n, int64_t G, float* acc, Ahead& ahead) {
  constexpr int64_t D = C * 16;
  constexpr int most = C <= 4 ? 4 : 2;  // keep GN * C accumulators + C rows within the 32 registers
  for (int64_t g0 = 0; g0 < G; g0 += most) {
    const int64_t gn = G - g0 < most ? G - g0 : most;
    if (gn == 4) weighted_sum_block<T, C, 4>(p + g0 * n, v, n, acc + g0 * D, ahead);
    else if (gn == 3) weighted_sum_block<T, C, 3>(p + g0 * n, v, n, acc + g0 * D, ahead);
    else if (gn == 2) weighted_sum_block<T, C, 2>(p + g0 * n, v, n, acc + g0 * D, ahead);
    else weighted_sum_block<T, C, 1>(p + g0 * n, v, n, acc + g0 * D, ahead);
  }
}
#endif

// acc[G, D] = p[G, n] @ v[n, D]
template <typename T>
void weighted_sum(const float* p, const T* v, int64_t n, int64_t G, int64_t D, float* acc, Ahead& ahead) {
#if defined(__AVX512F__)
  if (D == 64) return weighted_sum_vec<T, 4>(p, v, n, G, acc, ahead);
  if (D == 128) return weighted_sum_vec<T, 8>(p, v, n, G, acc, ahead);
  if (D == 32) return weighted_sum_vec<T, 2>(p, v, n, G, acc, ahead);
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
#if defined(__AVX512F__)
  if (half % 16 == 0) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t d = 0; d < half; d += 16) {
      const __m512 lo = load16(x + d), hi = load16(x + d + half);
      _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_sub_ps(_mm512_mul_ps(lo, _mm512_loadu_ps(cos + d)),
                                                            _mm512_mul_ps(hi, _mm512_loadu_ps(sin + d))), sc));
      _mm512_storeu_ps(out + d + half,
                       _mm512_mul_ps(_mm512_add_ps(_mm512_mul_ps(hi, _mm512_loadu_ps(cos + d + half)),
                                                   _mm512_mul_ps(lo, _mm512_loadu_ps(sin + d + half))), sc));
    }
    return;
  }
#endif
  for (int64_t d = 0; d < half; ++d)
    out[d] = (to_float(x[d]) * cos[d] - to_float(x[d + half]) * sin[d]) * scale;
  for (int64_t d = half; d < D; ++d)
    out[d] = (to_float(x[d]) * cos[d] + to_float(x[d - half]) * sin[d]) * scale;
}

template <typename T>
inline Ahead ahead_of(const T* kv, const int64_t* lens, int64_t task, int64_t KV, int64_t D, int64_t slot_stride,
                      int64_t head_stride, int64_t kv_stride) {
  const int64_t b = task / KV, h = task % KV, n = lens[b] + 1;
  Ahead a;
  a.k = reinterpret_cast<const char*>(kv + b * slot_stride + h * head_stride);
  a.v = reinterpret_cast<const char*>(kv + b * slot_stride + h * head_stride + kv_stride);
  a.k_end = a.k + ((n + kBlock - 1) / kBlock) * kBlock * D * static_cast<int64_t>(sizeof(T));
  a.v_end = a.v + n * D * static_cast<int64_t>(sizeof(T));
  return a;
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
      Ahead ahead = task + 1 < end ? ahead_of<T>(kv, lens, task + 1, KV, D, slot_stride, head_stride, kv_stride)
                                   : Ahead{};
      rope(x + (H + h) * D, c, s, D, 1.f, tmp.data());
      for (int64_t d = 0; d < D; ++d) k[key_index(d, pos, D)] = static_cast<T>(tmp[d]);
      std::memcpy(v + pos * D, x + (H + KV + h) * D, D * sizeof(T));
      for (int64_t g = 0; g < G; ++g) rope(x + (h * G + g) * D, c, s, D, scale, q.data() + g * D);
      scores.resize(G * n);
      scores_of(q.data(), k, n, G, D, scores.data(), ahead);
      for (int64_t g = 0; g < G; ++g) softmax_inplace(scores.data() + g * n, n);
      weighted_sum(scores.data(), v, n, G, D, acc.data(), ahead);
      T* out = y + b * H * D + h * G * D;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= G * D; i += 16) store16(out + i, _mm512_loadu_ps(acc.data() + i));
#endif
      for (; i < G * D; ++i) out[i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

// qkv: [B, (H + 2 KV) * D] (q heads, then k heads, then v heads), cos/sin: [B, D] fp32 rotary rows at
// each sequence's position, kv: one layer of the cache [2, slots, KV, L, D] (keys then values; each key
// head block holds its keys in blocks of kBlock positions, each block transposed as [D, kBlock], see
// model.KVSlots; L is a multiple of kBlock), lens: [B]
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
  TORCH_CHECK(L % kBlock == 0, "the cache length must be a multiple of ", kBlock);
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

namespace {
template <typename T>
void add_rms_norm_impl(T* x, const T* delta, const T* w, T* out, int64_t rows, int64_t dim, float eps) {
#if defined(__AVX512F__)
  if (dim % 16 == 0) {
    for (int64_t r = 0; r < rows; ++r) {
      T* xr = x + r * dim;
      __m512 ss = _mm512_setzero_ps();
      for (int64_t i = 0; i < dim; i += 16) {
        __m512 v = load16(xr + i);
        if (delta != nullptr) {
          v = round_to(static_cast<T*>(nullptr), _mm512_add_ps(v, load16(delta + r * dim + i)));
          store16(xr + i, v);
        }
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      const __m512 scale = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(dim) + eps));
      for (int64_t i = 0; i < dim; i += 16) {
        const __m512 h = round_to(static_cast<T*>(nullptr), _mm512_mul_ps(load16(xr + i), scale));
        store16(out + r * dim + i, _mm512_mul_ps(load16(w + i), h));
      }
    }
    return;
  }
#endif
  std::vector<float> h(dim);
  for (int64_t r = 0; r < rows; ++r) {
    T* xr = x + r * dim;
    float ss = 0.f;
    for (int64_t i = 0; i < dim; ++i) {
      if (delta != nullptr) xr[i] = static_cast<T>(to_float(xr[i]) + to_float(delta[r * dim + i]));
      h[i] = to_float(xr[i]);
      ss += h[i] * h[i];
    }
    const float scale = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
    for (int64_t i = 0; i < dim; ++i)  // as HF: normalise in fp32, cast, then times the weight in x's dtype
      out[r * dim + i] = static_cast<T>(to_float(w[i]) * to_float(static_cast<T>(h[i] * scale)));
  }
}

template <typename T>
void silu_mul_impl(const T* gate_up, T* out, int64_t rows, int64_t inner) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * inner;
    const T* u = g + inner;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= inner; i += 16) {
      const __m512 a = load16(g + i);
      const __m512 one = _mm512_set1_ps(1.f);
      const __m512 act = round_to(static_cast<T*>(nullptr), _mm512_div_ps(a, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), a)))));
      store16(out + r * inner + i, _mm512_mul_ps(act, load16(u + i)));
    }
#endif
    for (; i < inner; ++i) {
      const float a = to_float(g[i]);
      const T act = static_cast<T>(a / (1.f + std::exp(-a)));  // silu, rounded to T as torch's silu is
      out[r * inner + i] = static_cast<T>(to_float(act) * to_float(u[i]));
    }
  }
}
}  // namespace

// The residual add and RMSNorm between sublayers as one pass: x += delta (in place; delta may be None),
// returns rms_norm(x) * weight. x, delta: contiguous [rows, dim]; weight: [dim]; all one dtype.
torch::Tensor add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(1) &&
              weight.scalar_type() == x.scalar_type(), "add_rms_norm: x [rows, dim] contiguous, weight [dim]");
  if (delta.has_value())
    TORCH_CHECK(delta->is_contiguous() && delta->sizes() == x.sizes() && delta->scalar_type() == x.scalar_type(),
                "add_rms_norm: delta must match x");
  auto out = torch::empty_like(x);
  if (x.scalar_type() == at::kFloat) {
    add_rms_norm_impl<float>(x.data_ptr<float>(), delta.has_value() ? delta->data_ptr<float>() : nullptr,
                             weight.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1), eps);
  } else if (x.scalar_type() == at::kBFloat16) {
    using B = c10::BFloat16;
    add_rms_norm_impl<B>(x.data_ptr<B>(), delta.has_value() ? delta->data_ptr<B>() : nullptr, weight.data_ptr<B>(),
                         out.data_ptr<B>(), x.size(0), x.size(1), eps);
  } else {
    TORCH_CHECK(false, "add_rms_norm supports float32 and bfloat16");
  }
  return out;
}

// SwiGLU's silu(gate) * up from the fused gate|up projection [rows, 2 * inner] -> [rows, inner].
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0, "silu_mul: [rows, 2I]");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inner}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_mul_impl<float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, inner);
  } else if (gate_up.scalar_type() == at::kBFloat16) {
    silu_mul_impl<c10::BFloat16>(gate_up.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, inner);
  } else {
    TORCH_CHECK(false, "silu_mul supports float32 and bfloat16");
  }
  return out;
}

// linear.cpp
bool has_linear(c10::ScalarType dtype);
torch::Tensor pack_linear(torch::Tensor w);
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_linear_fp32", [] { return has_linear(at::kFloat); }, "whether linear takes fp32 here (AVX-512)");
  m.def("has_linear_bf16", [] { return has_linear(at::kBFloat16); }, "whether linear takes bf16 (AVX512-BF16)");
  m.def("pack_linear", &pack_linear, "pack an [N, K] weight for linear");
  m.def("linear", &linear, "x @ W^T (+ bias) with fp32 accumulation, W packed by pack_linear");
  m.def("decode_attention", &decode_attention, "fused RoPE + KV store + attention for one decode step");
  m.def("add_rms_norm", &add_rms_norm, "x += delta in place, then RMSNorm(x) * weight");
  m.def("silu_mul", &silu_mul, "silu(gate) * up from [rows, 2 * inner]");
}
