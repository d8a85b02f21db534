// The native decode kernels, one source for every instruction set: each `isa_*.cpp` includes this inside
// its own namespace and target region with one of PIVOTRL_AVX512 / PIVOTRL_AVX2 defined (neither: the
// scalar build), and fills a `KernelTable`. Include only from those files (no include guard on purpose).
//
// Fused decode attention for the continuous-batching engine (one new token per sequence).
// Why a kernel: at decode time each sequence attends with one query per head to its own cached prefix, so
// in torch ops this is RoPE (3 ops) + a KV store + two grouped matmuls of 3-row matrices (GQA groups)
// + softmax per layer; on CPU those small batched matmuls run far below the machine's speed and bf16 ones
// copy their strided operands first. Here one pass per (sequence, kv head) does it all: RoPE on q and k,
// store the new k and v in the cache, scores, softmax, weighted sum of v, accumulating in fp32.
// Keys are stored in blocks of kBlock positions, each block transposed ([D, kBlock]; see model.KVSlots): the
// scores of 16 positions are 16 lanes of one AVX-512 vector (two AVX2 ones), and a sequence's keys are one
// contiguous run. The torch path in model.py (`Attention.decode`) computes the same thing.
//
// The matmul for decode-sized batches (y[M, N] = x[M, K] @ W[N, K]^T + bias, fp32 accumulation). Why our
// own: at decode time M is the number of running sequences (~32) and a small model's step is ~33 such
// calls. oneDNN's prepacked `_linear_pointwise` spends ~12 us per call before any arithmetic (primitive
// lookup), and a step's weights do not stay in cache from one step to the next, so each call waits on
// memory. Here the call is a plain loop: the weight is packed once into 16-column panels (for bf16 in pairs
// along K, the operand layout of AVX512-BF16's VDPBF16PS), a block of the output lives in registers for the
// whole K loop (AVX-512: 8 rows x 48 columns in 24 registers; AVX2: 6 rows x 16 columns in 12), and while
// one group of panels is multiplied the next group's panels are requested, one cache line per K step.

using pivotrl::AttentionArgs;
using pivotrl::bf16;
using pivotrl::from_float;
using pivotrl::kBlock;
using pivotrl::kLanes;
using pivotrl::to_float;

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
#if defined(PIVOTRL_AVX512) || defined(PIVOTRL_AVX2)
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

// ------------------------------------------------------------------------------------------------------
// Vector helpers
// ------------------------------------------------------------------------------------------------------

#if defined(PIVOTRL_AVX512)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  // bf16 is the high half of an fp32: widen to 32 bits and shift.
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(bf16* p, __m512 v) {
  // Round to nearest even, as c10::BFloat16's conversion does (inputs here are finite).
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
// x rounded to T and back to fp32 (what storing then loading a T would give).
inline __m512 round_to(float*, __m512 v) { return v; }
inline __m512 round_to(bf16*, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline __m512 masked_load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 masked_load16(const bf16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

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

#if defined(PIVOTRL_AVX2)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256i rne_bits(__m256 v) {  // v rounded to nearest even bf16, in the high half of each lane
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16* p, __m256 v) {
  const __m256i hi = _mm256_srli_epi32(rne_bits(v), 16);  // each lane <= 0xFFFF: packus is exact
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi, hi), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline __m256 round_to(float*, __m256 v) { return v; }
inline __m256 round_to(bf16*, __m256 v) {
  return _mm256_castsi256_ps(_mm256_and_si256(rne_bits(v), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
// Lanes 0..left-1 set (all for left >= 8), as maskload/maskstore read them.
inline __m256i lane_mask(int64_t left) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int n = left <= 0 ? 0 : left >= 8 ? 8 : static_cast<int>(left);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx);
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// e^x as the AVX-512 `exp_ps` computes it (same clamp, reduction and polynomial); 2^k built in the exponent.
inline __m256 exp_ps(__m256 v) {
  v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.428606765330187e-06f),
                                    _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145751953125f), v));
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));  // k in [-126, 127]: 2^k is a normal float
}
#endif

// ------------------------------------------------------------------------------------------------------
// Attention
// ------------------------------------------------------------------------------------------------------

// Softmax of n floats in place.
inline void softmax_inplace(float* x, int64_t n) {
#if defined(PIVOTRL_AVX512)
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
#elif defined(PIVOTRL_AVX2)
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  __m256 top = ninf;
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i m = lane_mask(n - i);
    top = _mm256_max_ps(top, _mm256_blendv_ps(ninf, _mm256_maskload_ps(x + i, m), _mm256_castsi256_ps(m)));
  }
  const __m256 mx = _mm256_set1_ps(hmax(top));
  __m256 total = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i m = lane_mask(n - i);
    const __m256 e = _mm256_and_ps(exp_ps(_mm256_sub_ps(_mm256_maskload_ps(x + i, m), mx)), _mm256_castsi256_ps(m));
    total = _mm256_add_ps(total, e);
    _mm256_maskstore_ps(x + i, m, e);
  }
  const __m256 inv = _mm256_set1_ps(1.f / hsum(total));
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i m = lane_mask(n - i);
    _mm256_maskstore_ps(x + i, m, _mm256_mul_ps(_mm256_maskload_ps(x + i, m), inv));
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

#if defined(PIVOTRL_AVX512)
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
#elif defined(PIVOTRL_AVX2)
// Scores of GN queries against the 16 keys of the block from s0 (a multiple of 16), as two 8-lane halves.
// The block's 16 positions are always inside the cache (L is a multiple of kBlock): the lanes past n are
// computed from stale keys and never stored.
template <typename T, int GN>
void scores_block(const float* q, const T* kb, int64_t n, int64_t D, int64_t s0, float* out, Ahead& ahead) {
  const T* block = kb + (s0 / kBlock) * D * kBlock;
  __m256 a0[GN], a1[GN];
  for (int j = 0; j < GN; ++j) a0[j] = a1[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 k0 = load8(block + d * kBlock), k1 = load8(block + d * kBlock + 8);
    if ((d & 1) || sizeof(T) == 4) ahead.step();  // one line per 2 rows of bf16 keys, per row of fp32
    for (int j = 0; j < GN; ++j) {
      const __m256 w = _mm256_set1_ps(q[j * D + d]);
      a0[j] = _mm256_fmadd_ps(w, k0, a0[j]);
      a1[j] = _mm256_fmadd_ps(w, k1, a1[j]);
    }
  }
  const __m256i m0 = lane_mask(n - s0), m1 = lane_mask(n - s0 - 8);
  for (int j = 0; j < GN; ++j) {
    _mm256_maskstore_ps(out + j * n + s0, m0, a0[j]);
    _mm256_maskstore_ps(out + j * n + s0 + 8, m1, a1[j]);
  }
}
#endif

// Scores of the G queries (fp32, [G, D]) against keys 0..n) stored in transposed blocks (key_index).
template <typename T>
void scores_of(const float* q, const T* kb, int64_t n, int64_t G, int64_t D, float* out /* [G, n] */, Ahead& ahead) {
#if defined(PIVOTRL_AVX512) || defined(PIVOTRL_AVX2)
#if defined(PIVOTRL_AVX512)
  constexpr int64_t span = 32;
#else
  constexpr int64_t span = 16;
#endif
  for (int64_t g0 = 0; g0 < G; g0 += 4) {  // up to 4 queries per pass (nothing past n is stored)
    const int64_t gn = G - g0 < 4 ? G - g0 : 4;
    for (int64_t s0 = 0; s0 < n; s0 += span) {
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

#if defined(PIVOTRL_AVX512)
// acc[GN, cols c0..c0+C*16) = p[GN, n] @ v[n, D] over those columns: GN * C accumulators in registers (both
// are constants), each 16-column piece of a row of v loaded once for all GN queries.
template <typename T, int C, int GN>
void weighted_sum_block(const float* p, const T* v, int64_t n, int64_t D, int64_t c0, float* acc, Ahead& ahead) {
  __m512 a[GN][C];
  for (int j = 0; j < GN; ++j)
    for (int c = 0; c < C; ++c) a[j][c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < n; ++s) {
    __m512 row[C];
    for (int c = 0; c < C; ++c) row[c] = load16(v + s * D + c0 + c * 16);
    ahead.step();
    ahead.step();
    for (int j = 0; j < GN; ++j) {
      const __m512 w = _mm512_set1_ps(p[j * n + s]);
      for (int c = 0; c < C; ++c) a[j][c] = _mm512_fmadd_ps(w, row[c], a[j][c]);
    }
  }
  for (int j = 0; j < GN; ++j)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + j * D + c0 + c * 16, a[j][c]);
}

template <typename T, int C>
void weighted_sum_cols(const float* p, const T* v, int64_t n, int64_t G, int64_t D, int64_t c0, float* acc,
                       Ahead& ahead) {
  constexpr int most = C <= 4 ? 4 : 2;  // keep GN * C accumulators + C rows within the 32 registers
  for (int64_t g0 = 0; g0 < G; g0 += most) {
    const int64_t gn = G - g0 < most ? G - g0 : most;
    const float* pg = p + g0 * n;
    float* ag = acc + g0 * D;
    if (gn == 4) weighted_sum_block<T, C, (most >= 4 ? 4 : 1)>(pg, v, n, D, c0, ag, ahead);
    else if (gn == 3) weighted_sum_block<T, C, (most >= 3 ? 3 : 1)>(pg, v, n, D, c0, ag, ahead);
    else if (gn == 2) weighted_sum_block<T, C, 2>(pg, v, n, D, c0, ag, ahead);
    else weighted_sum_block<T, C, 1>(pg, v, n, D, c0, ag, ahead);
  }
}
#elif defined(PIVOTRL_AVX2)
// acc[GN, cols c0..c0+C*8) = p[GN, n] @ v[n, D] over those columns: GN * C accumulators, each 8-column
// piece of a row of v loaded once for all GN queries (GN * C <= 12 keeps it within the 16 registers).
template <typename T, int C, int GN>
void weighted_sum_block(const float* p, const T* v, int64_t n, int64_t D, int64_t c0, float* acc, Ahead& ahead) {
  __m256 a[GN][C];
  for (int j = 0; j < GN; ++j)
    for (int c = 0; c < C; ++c) a[j][c] = _mm256_setzero_ps();
  for (int64_t s = 0; s < n; ++s) {
    ahead.step();
    __m256 w[GN];
    for (int j = 0; j < GN; ++j) w[j] = _mm256_set1_ps(p[j * n + s]);
    for (int c = 0; c < C; ++c) {
      const __m256 row = load8(v + s * D + c0 + c * 8);
      for (int j = 0; j < GN; ++j) a[j][c] = _mm256_fmadd_ps(w[j], row, a[j][c]);
    }
  }
  for (int j = 0; j < GN; ++j)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + j * D + c0 + c * 8, a[j][c]);
}

template <typename T, int C>
void weighted_sum_cols(const float* p, const T* v, int64_t n, int64_t G, int64_t D, int64_t c0, float* acc,
                       Ahead& ahead) {
  constexpr int most = C <= 2 ? 4 : 3;
  for (int64_t g0 = 0; g0 < G; g0 += most) {
    const int64_t gn = G - g0 < most ? G - g0 : most;
    const float* pg = p + g0 * n;
    float* ag = acc + g0 * D;
    if (gn == 4) weighted_sum_block<T, C, (most >= 4 ? 4 : 1)>(pg, v, n, D, c0, ag, ahead);
    else if (gn == 3) weighted_sum_block<T, C, 3>(pg, v, n, D, c0, ag, ahead);
    else if (gn == 2) weighted_sum_block<T, C, 2>(pg, v, n, D, c0, ag, ahead);
    else weighted_sum_block<T, C, 1>(pg, v, n, D, c0, ag, ahead);
  }
}
#endif

// acc[G, D] = p[G, n] @ v[n, D]
template <typename T>
void weighted_sum(const float* p, const T* v, int64_t n, int64_t G, int64_t D, float* acc, Ahead& ahead) {
#if defined(PIVOTRL_AVX512)
  if (D % 16 == 0) {  // column groups of up to 128 (8 vectors), then what is left in one group
    int64_t c0 = 0;
    for (; c0 + 128 <= D; c0 += 128) weighted_sum_cols<T, 8>(p, v, n, G, D, c0, acc, ahead);
    switch ((D - c0) / 16) {
      case 1: return weighted_sum_cols<T, 1>(p, v, n, G, D, c0, acc, ahead);
      case 2: return weighted_sum_cols<T, 2>(p, v, n, G, D, c0, acc, ahead);
      case 3: return weighted_sum_cols<T, 3>(p, v, n, G, D, c0, acc, ahead);
      case 4: return weighted_sum_cols<T, 4>(p, v, n, G, D, c0, acc, ahead);
      case 5: return weighted_sum_cols<T, 5>(p, v, n, G, D, c0, acc, ahead);
      case 6: return weighted_sum_cols<T, 6>(p, v, n, G, D, c0, acc, ahead);
      case 7: return weighted_sum_cols<T, 7>(p, v, n, G, D, c0, acc, ahead);
      default: return;  // D was a multiple of 128
    }
  }
#elif defined(PIVOTRL_AVX2)
  if (D % 32 == 0) {  // column groups of 32 (4 vectors), up to 3 queries each
    for (int64_t c0 = 0; c0 < D; c0 += 32) weighted_sum_cols<T, 4>(p, v, n, G, D, c0, acc, ahead);
    return;
  }
  if (D == 16) return weighted_sum_cols<T, 2>(p, v, n, G, D, 0, acc, ahead);
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
#if defined(PIVOTRL_AVX512)
  {  // any half: the last 16 lanes masked (a head of 16, half 8, is one masked pass)
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t d = 0; d < half; d += 16) {
      const __mmask16 m = tail_mask(half - d);
      const __m512 lo = masked_load16(x + d, m), hi = masked_load16(x + d + half, m);
      const __m512 c_lo = _mm512_maskz_loadu_ps(m, cos + d), s_lo = _mm512_maskz_loadu_ps(m, sin + d);
      const __m512 c_hi = _mm512_maskz_loadu_ps(m, cos + d + half), s_hi = _mm512_maskz_loadu_ps(m, sin + d + half);
      _mm512_mask_storeu_ps(out + d, m, _mm512_mul_ps(_mm512_sub_ps(_mm512_mul_ps(lo, c_lo), _mm512_mul_ps(hi, s_lo)), sc));
      _mm512_mask_storeu_ps(out + d + half, m,
                            _mm512_mul_ps(_mm512_add_ps(_mm512_mul_ps(hi, c_hi), _mm512_mul_ps(lo, s_hi)), sc));
    }
    return;
  }
#elif defined(PIVOTRL_AVX2)
  if (half % 8 == 0) {
    const __m256 sc = _mm256_set1_ps(scale);
    for (int64_t d = 0; d < half; d += 8) {
      const __m256 lo = load8(x + d), hi = load8(x + d + half);
      _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_sub_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(cos + d)),
                                                            _mm256_mul_ps(hi, _mm256_loadu_ps(sin + d))), sc));
      _mm256_storeu_ps(out + d + half,
                       _mm256_mul_ps(_mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(cos + d + half)),
                                                   _mm256_mul_ps(lo, _mm256_loadu_ps(sin + d + half))), sc));
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
void attention_range(const AttentionArgs<T>& a, int64_t begin, int64_t end) {
  const int64_t H = a.H, KV = a.KV, D = a.D;
  const int64_t G = H / KV, row = (H + 2 * KV) * D;
  const int64_t head_stride = a.L * D, slot_stride = KV * head_stride, kv_stride = a.slots * slot_stride;
  std::vector<float> q(G * D), acc(G * D), tmp(D), scores;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / KV, h = task % KV, pos = a.lens[b], n = pos + 1;
    const T* x = a.qkv + b * row;
    const float* c = a.cos + b * D;
    const float* s = a.sin + b * D;
    T* k = a.kv + b * slot_stride + h * head_stride;
    T* v = k + kv_stride;
    Ahead ahead = task + 1 < end ? ahead_of<T>(a.kv, a.lens, task + 1, KV, D, slot_stride, head_stride, kv_stride)
                                 : Ahead{};
    rope(x + (H + h) * D, c, s, D, 1.f, tmp.data());
    for (int64_t d = 0; d < D; ++d) k[key_index(d, pos, D)] = from_float<T>(tmp[d]);
    std::memcpy(v + pos * D, x + (H + KV + h) * D, D * sizeof(T));
    for (int64_t g = 0; g < G; ++g) rope(x + (h * G + g) * D, c, s, D, a.scale, q.data() + g * D);
    scores.resize(G * n);
    scores_of(q.data(), k, n, G, D, scores.data(), ahead);
    for (int64_t g = 0; g < G; ++g) softmax_inplace(scores.data() + g * n, n);
    weighted_sum(scores.data(), v, n, G, D, acc.data(), ahead);
    T* out = a.y + b * H * D + h * G * D;
    int64_t i = 0;
#if defined(PIVOTRL_AVX512)
    for (; i + 16 <= G * D; i += 16) store16(out + i, _mm512_loadu_ps(acc.data() + i));
#elif defined(PIVOTRL_AVX2)
    for (; i + 8 <= G * D; i += 8) store8(out + i, _mm256_loadu_ps(acc.data() + i));
#endif
    for (; i < G * D; ++i) out[i] = from_float<T>(acc[i]);
  }
}

// ------------------------------------------------------------------------------------------------------
// Add + RMSNorm, SwiGLU
// ------------------------------------------------------------------------------------------------------

template <typename T>
void add_rms_norm_impl(T* x, const T* delta, const T* w, T* out, int64_t rows, int64_t dim, float eps) {
#if defined(PIVOTRL_AVX512)
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
#elif defined(PIVOTRL_AVX2)
  if (dim % 8 == 0) {
    for (int64_t r = 0; r < rows; ++r) {
      T* xr = x + r * dim;
      __m256 ss0 = _mm256_setzero_ps(), ss1 = _mm256_setzero_ps();  // two chains: FMA latency
      for (int64_t i = 0; i < dim; i += 8) {
        __m256 v = load8(xr + i);
        if (delta != nullptr) {
          v = round_to(static_cast<T*>(nullptr), _mm256_add_ps(v, load8(delta + r * dim + i)));
          store8(xr + i, v);
        }
        if ((i / 8) & 1) ss1 = _mm256_fmadd_ps(v, v, ss1);
        else ss0 = _mm256_fmadd_ps(v, v, ss0);
      }
      const float total = hsum(_mm256_add_ps(ss0, ss1));
      const __m256 scale = _mm256_set1_ps(1.f / std::sqrt(total / static_cast<float>(dim) + eps));
      for (int64_t i = 0; i < dim; i += 8) {
        const __m256 h = round_to(static_cast<T*>(nullptr), _mm256_mul_ps(load8(xr + i), scale));
        store8(out + r * dim + i, _mm256_mul_ps(load8(w + i), h));
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
      if (delta != nullptr) xr[i] = from_float<T>(to_float(xr[i]) + to_float(delta[r * dim + i]));
      h[i] = to_float(xr[i]);
      ss += h[i] * h[i];
    }
    const float scale = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
    for (int64_t i = 0; i < dim; ++i)  // as HF: normalise in fp32, cast, then times the weight in x's dtype
      out[r * dim + i] = from_float<T>(to_float(w[i]) * to_float(from_float<T>(h[i] * scale)));
  }
}

template <typename T>
void silu_mul_impl(const T* gate_up, T* out, int64_t rows, int64_t inner) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * inner;
    const T* u = g + inner;
    int64_t i = 0;
#if defined(PIVOTRL_AVX512)
    for (; i + 16 <= inner; i += 16) {
      const __m512 a = load16(g + i);
      const __m512 one = _mm512_set1_ps(1.f);
      const __m512 act = round_to(static_cast<T*>(nullptr),
                                  _mm512_div_ps(a, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), a)))));
      store16(out + r * inner + i, _mm512_mul_ps(act, load16(u + i)));
    }
#elif defined(PIVOTRL_AVX2)
    for (; i + 8 <= inner; i += 8) {
      const __m256 a = load8(g + i);
      const __m256 one = _mm256_set1_ps(1.f);
      const __m256 act = round_to(static_cast<T*>(nullptr),
                                  _mm256_div_ps(a, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), a)))));
      store8(out + r * inner + i, _mm256_mul_ps(act, load8(u + i)));
    }
#endif
    for (; i < inner; ++i) {
      const float a = to_float(g[i]);
      const T act = from_float<T>(a / (1.f + std::exp(-a)));  // silu, rounded to T as torch's silu is
      out[r * inner + i] = from_float<T>(to_float(act) * to_float(u[i]));
    }
  }
}

// ------------------------------------------------------------------------------------------------------
// Matmul (packed weights: pack_linear in bindings.cpp)
// ------------------------------------------------------------------------------------------------------

// Element types: float (one k per step) and bf16 (a pair of k per step). Either way one step of a panel
// is 64 bytes: 16 columns x (1 fp32 | 2 bf16).
template <typename T>
constexpr int64_t k_per_step() { return sizeof(T) == 4 ? 1 : 2; }

#if defined(PIVOTRL_AVX512)
constexpr int kRows = 8;    // output rows per register block
constexpr int kPanels = 3;  // panels per register block: 8 x 3 = 24 accumulators

template <typename T>
inline __m512 fma_step(__m512 acc, const T* x, __m512i w);

template <>
inline __m512 fma_step<float>(__m512 acc, const float* x, __m512i w) {
  return _mm512_fmadd_ps(_mm512_set1_ps(*x), _mm512_castsi512_ps(w), acc);
}

#if defined(PIVOTRL_AVX512BF16)
template <>
inline __m512 fma_step<bf16>(__m512 acc, const bf16* x, __m512i w) {
  int32_t bits;
  std::memcpy(&bits, x, sizeof(bits));  // the (k, k+1) pair of this row as one 32-bit lane
  const __m512i pair = _mm512_set1_epi32(bits);
  return _mm512_dpbf16_ps(acc, (__m512bh)pair, (__m512bh)w);
}
inline void store_row(bf16* y, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(v));  // round to nearest even
}
#endif
inline void store_row(float* y, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(y, mask, v); }

// Output rows m0..m0+MR, panels p0..p0+NR over all of K. `wp`: the packed weight from this group's first
// panel; `steps`: K / k_per_step; `next` (or nullptr): the next group's first panel, `next_bytes` of it
// requested while this block runs.
template <typename T, int MR, int NR>
void block(const T* x, int64_t ldx, const T* wp, int64_t steps, const float* bias, T* y, int64_t ldy,
           int64_t n_valid, const char* next, int64_t next_bytes) {
  constexpr int64_t per = k_per_step<T>();
  const int64_t panel_stride = steps * per * kLanes;
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NR; ++p) acc[m][p] = _mm512_setzero_ps();
  int64_t fetched = 0;
  for (int64_t s = 0; s < steps; ++s) {
    __m512i w[NR];
    for (int p = 0; p < NR; ++p) w[p] = _mm512_loadu_si512(wp + p * panel_stride + s * per * kLanes);
    for (int m = 0; m < MR; ++m)
      for (int p = 0; p < NR; ++p) acc[m][p] = fma_step<T>(acc[m][p], x + m * ldx + s * per, w[p]);
    for (int p = 0; p < NR && fetched < next_bytes; ++p, fetched += 64)
      _mm_prefetch(next + fetched, _MM_HINT_T1);
  }
  for (int p = 0; p < NR; ++p) {
    const int64_t col = p * kLanes, left = n_valid - col;
    if (left <= 0) break;
    const __mmask16 mask = tail_mask(left);
    const __m512 b = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias + col);
    for (int m = 0; m < MR; ++m) store_row(y + m * ldy + col, _mm512_add_ps(acc[m][p], b), mask);
  }
}
#elif defined(PIVOTRL_AVX2)
constexpr int kRows = 6;    // output rows per register block
constexpr int kPanels = 1;  // one 16-column panel (two vectors): 6 x 2 = 12 accumulators

inline void store_row(float* y, __m256 v0, __m256 v1, int64_t left) {
  if (left >= 16) {
    _mm256_storeu_ps(y, v0);
    _mm256_storeu_ps(y + 8, v1);
  } else {
    _mm256_maskstore_ps(y, lane_mask(left), v0);
    _mm256_maskstore_ps(y + 8, lane_mask(left - 8), v1);
  }
}

// One K step of the AVX2 block: the panel's 16 columns at k = s against MR rows' x[m, s].
template <int MR>
inline void panel_step(const float* x, int64_t ldx, const float* w, __m256 (&a0)[MR], __m256 (&a1)[MR]) {
  const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    const __m256 xm = _mm256_broadcast_ss(x + m * ldx);
    a0[m] = _mm256_fmadd_ps(xm, w0, a0[m]);
    a1[m] = _mm256_fmadd_ps(xm, w1, a1[m]);
  }
}

// Output rows m0..m0+MR of one panel over all of K (fp32); `next`: as the AVX-512 block's. The K steps
// that also request the next panels run in their own loop: with the request behind a branch in one loop,
// GCC kept a copy of all 12 accumulators on the stack and stored them every step (0.6x oneDNN's speed).
template <typename T, int MR, int NR>
void block(const float* x, int64_t ldx, const float* wp, int64_t steps, const float* bias, float* y, int64_t ldy,
           int64_t n_valid, const char* next, int64_t next_bytes) {
  static_assert(NR == 1, "one panel per AVX2 block");
  __m256 a0[MR], a1[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) a0[m] = a1[m] = _mm256_setzero_ps();
  // One line requested per step; none by the row blocks after the first (they get no `next`).
  const int64_t ahead = next == nullptr ? 0 : std::min<int64_t>(steps, (next_bytes + 63) / 64);
  int64_t s = 0;
  for (; s < ahead; ++s) {
    panel_step<MR>(x + s, ldx, wp + s * kLanes, a0, a1);
    _mm_prefetch(next + s * 64, _MM_HINT_T1);
  }
  for (; s < steps; ++s) panel_step<MR>(x + s, ldx, wp + s * kLanes, a0, a1);
  if (n_valid <= 0) return;
  const __m256i mb0 = lane_mask(n_valid), mb1 = lane_mask(n_valid - 8);
  const __m256 b0 = bias == nullptr ? _mm256_setzero_ps() : _mm256_maskload_ps(bias, mb0);
  const __m256 b1 = bias == nullptr ? _mm256_setzero_ps() : _mm256_maskload_ps(bias + 8, mb1);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) store_row(y + m * ldy, _mm256_add_ps(a0[m], b0), _mm256_add_ps(a1[m], b1), n_valid);
}
#endif

#if defined(PIVOTRL_AVX512) || defined(PIVOTRL_AVX2)
template <typename T, int NR>
void rows_block(int mr, const T* x, int64_t ldx, const T* wp, int64_t steps, const float* bias, T* y, int64_t ldy,
                int64_t n_valid, const char* next, int64_t next_bytes) {
  switch (mr) {
#if defined(PIVOTRL_AVX512)
    case 8: return block<T, 8, NR>(x, ldx, wp, steps, bias, y, ldy, n_valid, next, next_bytes);
    case 7: return block<T, 7, NR>(x, ldx, wp, steps, bias, y, ldy, n_valid, next, next_bytes);
#endif
    case 6: return block<T, 6, NR>(x, ldx, wp, steps, bias, y, ldy, n_valid, next, next_bytes);
    case 5: return block<T, 5, NR>(x, ldx, wp, steps, bias, y, ldy, n_valid, next, next_bytes);
    case 4: return block<T, 4, NR>(x, ldx, wp, steps, bias, y, ldy, n_valid, next, next_bytes);
    case 3: return block<T, 3, NR>(x, ldx, wp, steps, bias, y, ldy, n_valid, next, next_bytes);
    case 2: return block<T, 2, NR>(x, ldx, wp, steps, bias, y, ldy, n_valid, next, next_bytes);
    default: return block<T, 1, NR>(x, ldx, wp, steps, bias, y, ldy, n_valid, next, next_bytes);
  }
}

template <typename T>
void linear_impl(const T* x, int64_t M, int64_t K, const T* wp, int64_t panels, const float* bias, T* y, int64_t N) {
  const int64_t steps = K / k_per_step<T>(), panel_stride = K * kLanes;
  for (int64_t p0 = 0; p0 < panels; p0 += kPanels) {
    const int nr = static_cast<int>(std::min<int64_t>(kPanels, panels - p0));
    const T* w = wp + p0 * panel_stride;
    const int64_t p1 = p0 + nr;
    const char* next = p1 < panels ? reinterpret_cast<const char*>(wp + p1 * panel_stride) : nullptr;
    const int64_t next_bytes = next == nullptr ? 0 : std::min<int64_t>(kPanels, panels - p1) * panel_stride * sizeof(T);
    const float* b = bias == nullptr ? nullptr : bias + p0 * kLanes;
    const int64_t n_valid = N - p0 * kLanes;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kRows, M - m0));
      // The first row block streams this group's panels in; it also asks for the next group's.
      const char* pre = m0 == 0 ? next : nullptr;
      const T* xr = x + m0 * K;
      T* yr = y + m0 * N + p0 * kLanes;
      if (nr == 3) rows_block<T, (kPanels >= 3 ? 3 : 1)>(mr, xr, K, w, steps, b, yr, N, n_valid, pre, next_bytes);
      else if (nr == 2) rows_block<T, (kPanels >= 2 ? 2 : 1)>(mr, xr, K, w, steps, b, yr, N, n_valid, pre, next_bytes);
      else rows_block<T, 1>(mr, xr, K, w, steps, b, yr, N, n_valid, pre, next_bytes);
    }
  }
}
#endif

// The scalar matmul over the same packed layout: the last fallback, so that a weight packed under one
// instruction set still computes under another (an engine forced to another path mid-run).
template <typename T>
void linear_scalar(const T* x, int64_t M, int64_t K, const T* wp, int64_t panels, const float* bias, T* y, int64_t N) {
  constexpr int64_t per = k_per_step<T>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const int64_t p = n / kLanes, lane = n % kLanes;
      const T* panel = wp + p * K * kLanes;
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t s = k / per, j = k % per;  // bf16: [K/2, 16, 2]; fp32: [K, 16]
        acc += to_float(x[m * K + k]) * to_float(panel[(s * kLanes + lane) * per + j]);
      }
      y[m * N + n] = from_float<T>(acc + (bias == nullptr ? 0.f : bias[n]));
    }
  (void)panels;
}
