// Matmul for decode-sized batches: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32 accumulation, x and W both
// fp32 or both bf16.
//
// Why our own: at decode time M is the number of running sequences (~32) and a small model's step is ~33
// such calls. oneDNN's prepacked `_linear_pointwise` spends ~12 us per call before any arithmetic (primitive
// lookup), and a step's weights (25 MB bf16, 50 MB fp32) do not stay in cache from one step to the next,
// so each call waits on memory. Here the call is a plain loop: the weight is packed once into 16-column
// panels (for bf16 in pairs along K, the operand layout of AVX512-BF16's VDPBF16PS), an 8-row x 48-column
// block of the output lives in 24 registers for the whole K loop, and while one group of panels is
// multiplied the next group's panels are requested, one cache line per K step. Built where the compiler
// targets AVX-512 (bf16: AVX512-BF16); elsewhere `has_linear(dtype)` is false and the engine keeps oneDNN.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;  // output columns per panel (one fp32 vector)
constexpr int kRows = 8;        // output rows per register block
constexpr int kPanels = 3;      // panels per register block: 8 x 3 = 24 accumulators

#if defined(__AVX512F__)
// Element types: float (one k per step) and uint16_t holding bf16 (a pair of k per step). Either way one
// step of a panel is 64 bytes: 16 columns x (1 fp32 | 2 bf16).
template <typename T>
constexpr int64_t k_per_step() { return std::is_same_v<T, float> ? 1 : 2; }

template <typename T>
inline __m512 fma_step(__m512 acc, const T* x, __m512i w);

template <>
inline __m512 fma_step<float>(__m512 acc, const float* x, __m512i w) {
  return _mm512_fmadd_ps(_mm512_set1_ps(*x), _mm512_castsi512_ps(w), acc);
}

#if defined(__AVX512BF16__)
template <>
inline __m512 fma_step<uint16_t>(__m512 acc, const uint16_t* x, __m512i w) {
  int32_t bits;
  std::memcpy(&bits, x, sizeof(bits));  // the (k, k+1) pair of this row as one 32-bit lane
  const __m512i pair = _mm512_set1_epi32(bits);
  return _mm512_dpbf16_ps(acc, (__m512bh)pair, (__m512bh)w);
}
#endif

inline void store_row(float* y, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(y, mask, v); }
#if defined(__AVX512BF16__)
inline void store_row(uint16_t* y, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(v));  // round to nearest even
}
#endif

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
    const __mmask16 mask = left >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 b = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias + col);
    for (int m = 0; m < MR; ++m) store_row(y + m * ldy + col, _mm512_add_ps(acc[m][p], b), mask);
  }
}

template <typename T, int NR>
void rows_block(int mr, const T* x, int64_t ldx, const T* wp, int64_t steps, const float* bias, T* y, int64_t ldy,
                int64_t n_valid, const char* next, int64_t next_bytes) {
  switch (mr) {
    case 8: return block<T, 8, NR>(x, ldx, wp, steps, bias, y, ldy, n_valid, next, next_bytes);
    case 7: return block<T, 7, NR>(x, ldx, wp, steps, bias, y, ldy, n_valid, next, next_bytes);
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
      if (nr == 3) rows_block<T, 3>(mr, xr, K, w, steps, b, yr, N, n_valid, pre, next_bytes);
      else if (nr == 2) rows_block<T, 2>(mr, xr, K, w, steps, b, yr, N, n_valid, pre, next_bytes);
      else rows_block<T, 1>(mr, xr, K, w, steps, b, yr, N, n_valid, pre, next_bytes);
    }
  }
}
#endif

}  // namespace

bool has_linear(c10::ScalarType dtype) {
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return true;
#endif
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return true;
#endif
  return false;
}

// w [N, K] -> panels: fp32 [ceil(N / 16), K, 16]; bf16 (K even) [ceil(N / 16), K / 2, 16, 2], for each pair of
// k the 16 columns' (k, k+1) weights side by side, the second operand of VDPBF16PS. Padded columns are zero.
torch::Tensor pack_linear(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && has_linear(w.scalar_type()), "pack_linear: w must be [N, K] of a supported dtype");
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK(!bf16 || w.size(1) % 2 == 0, "pack_linear: bf16 needs K even");
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kLanes - 1) / kLanes;
  auto padded = torch::zeros({panels * kLanes, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  if (bf16) return padded.view({panels, kLanes, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  return padded.view({panels, kLanes, K}).permute({0, 2, 1}).contiguous();
}

// x [..., K] @ packed (from pack_linear, same dtype) -> [..., N], plus bias [N] (added in fp32) if given.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(has_linear(dtype) && packed.scalar_type() == dtype && packed.is_contiguous(),
              "linear: x and the packed weight must share a supported dtype");
  const int64_t K = x.size(-1), per = dtype == at::kBFloat16 ? 2 : 1;
  TORCH_CHECK(x.dim() >= 1 && K > 0, "linear: x must be [..., K] with K > 0");
  TORCH_CHECK(packed.size(1) * per == K && packed.size(2) == kLanes && packed.size(0) * kLanes >= N,
              "linear: the packed weight does not fit x [..., K] and N");
  const int64_t M = x.numel() / K;
  auto xc = x.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  auto y = torch::empty(shape, x.options());
  torch::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "linear: bias must have N elements");
    b = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
#if defined(__AVX512F__)
  if (dtype == at::kFloat) {
    linear_impl<float>(xc.data_ptr<float>(), M, K, packed.data_ptr<float>(), packed.size(0), bp, y.data_ptr<float>(), N);
  }
#endif
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) {
    auto as16 = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<c10::BFloat16>()); };
    linear_impl<uint16_t>(as16(xc), M, K, as16(packed), packed.size(0), bp, as16(y), N);
  }
#endif
  return y;
}
