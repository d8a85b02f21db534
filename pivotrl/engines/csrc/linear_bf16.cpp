// bf16 matmul for decode-sized batches: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32 accumulation.
//
// Why our own: at decode time M is the number of running sequences (~32) and a small model's step is ~33
// such calls. oneDNN's prepacked `_linear_pointwise` spends ~12 us per call before any arithmetic (primitive
// lookup), and it streams each weight from memory only when it reaches it. Here the call is a plain loop:
// the weight is packed once into 16-column panels of bf16 pairs (the operand layout of AVX512-BF16's
// VDPBF16PS), an 8-row x 48-column block of the output lives in 24 registers for the whole K loop, and
// while one group of panels is multiplied the next group's panels are prefetched. Built only where the
// compiler targets AVX512-BF16; elsewhere `has_linear_bf16()` is false and the engine keeps oneDNN.
#include <torch/extension.h>

#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;  // output columns per panel (one fp32 vector)
constexpr int kRows = 8;        // output rows per register block
constexpr int kPanels = 3;      // panels per register block: 8 x 3 = 24 accumulators

#if defined(__AVX512BF16__)
// Output rows m0..m0+MR, panels p0..p0+NR over all of K. `wp` is the packed weight [panels][K/2][16][2],
// `half_k` = K/2; `next` (or nullptr) the first panel of the next group, prefetched while this one runs.
template <int MR, int NR>
void block(const uint16_t* x, int64_t ldx, const uint16_t* wp, int64_t half_k, const float* bias,
           uint16_t* y, int64_t ldy, int64_t n_valid, const uint16_t* next, int64_t next_panels) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NR; ++p) acc[m][p] = _mm512_setzero_ps();
  const int64_t panel_stride = half_k * 2 * kLanes;
  const int64_t next_bytes = next == nullptr ? 0 : next_panels * panel_stride * 2;
  int64_t fetched = 0;
  for (int64_t kk = 0; kk < half_k; ++kk) {
    __m512bh w[NR];
    for (int p = 0; p < NR; ++p)
      w[p] = (__m512bh)_mm512_loadu_si512(wp + p * panel_stride + kk * 2 * kLanes);
    for (int m = 0; m < MR; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + m * ldx + 2 * kk));
      for (int p = 0; p < NR; ++p) acc[m][p] = _mm512_dpbf16_ps(acc[m][p], a, w[p]);
    }
    // Spread the next group's prefetches over this K loop (about one cache line per panel per step).
    for (int p = 0; p < NR && fetched < next_bytes; ++p, fetched += 64)
      _mm_prefetch(reinterpret_cast<const char*>(next) + fetched, _MM_HINT_T0);
  }
  for (int p = 0; p < NR; ++p) {
    const int64_t col = p * kLanes;
    const int64_t left = n_valid - col;
    if (left <= 0) break;
    const __mmask16 mask = left >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 b = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias + col);
    for (int m = 0; m < MR; ++m) {
      const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][p], b));  // round to nearest even
      _mm256_mask_storeu_epi16(y + m * ldy + col, mask, out);
    }
  }
}

template <int NR>
void rows_block(int mr, const uint16_t* x, int64_t ldx, const uint16_t* wp, int64_t half_k, const float* bias,
                uint16_t* y, int64_t ldy, int64_t n_valid, const uint16_t* next, int64_t next_panels) {
  switch (mr) {
    case 8: return block<8, NR>(x, ldx, wp, half_k, bias, y, ldy, n_valid, next, next_panels);
    case 7: return block<7, NR>(x, ldx, wp, half_k, bias, y, ldy, n_valid, next, next_panels);
    case 6: return block<6, NR>(x, ldx, wp, half_k, bias, y, ldy, n_valid, next, next_panels);
    case 5: return block<5, NR>(x, ldx, wp, half_k, bias, y, ldy, n_valid, next, next_panels);
    case 4: return block<4, NR>(x, ldx, wp, half_k, bias, y, ldy, n_valid, next, next_panels);
    case 3: return block<3, NR>(x, ldx, wp, half_k, bias, y, ldy, n_valid, next, next_panels);
    case 2: return block<2, NR>(x, ldx, wp, half_k, bias, y, ldy, n_valid, next, next_panels);
    default: return block<1, NR>(x, ldx, wp, half_k, bias, y, ldy, n_valid, next, next_panels);
  }
}

void linear_impl(const uint16_t* x, int64_t M, int64_t K, const uint16_t* wp, int64_t panels, const float* bias,
                 uint16_t* y, int64_t N) {
  const int64_t half_k = K / 2, panel_stride = half_k * 2 * kLanes;
  for (int64_t p0 = 0; p0 < panels; p0 += kPanels) {
    const int nr = static_cast<int>(std::min<int64_t>(kPanels, panels - p0));
    const uint16_t* w = wp + p0 * panel_stride;
    const int64_t p1 = p0 + nr;
    const uint16_t* next = p1 < panels ? wp + p1 * panel_stride : nullptr;
    const int64_t next_panels = std::min<int64_t>(kPanels, panels - p1);
    const float* b = bias == nullptr ? nullptr : bias + p0 * kLanes;
    const int64_t n_valid = N - p0 * kLanes;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kRows, M - m0));
      // The first row block streams this group's panels in; it also asks for the next group's.
      const uint16_t* pre = m0 == 0 ? next : nullptr;
      const uint16_t* xr = x + m0 * K;
      uint16_t* yr = y + m0 * N + p0 * kLanes;
      if (nr == 3) rows_block<3>(mr, xr, K, w, half_k, b, yr, N, n_valid, pre, next_panels);
      else if (nr == 2) rows_block<2>(mr, xr, K, w, half_k, b, yr, N, n_valid, pre, next_panels);
      else rows_block<1>(mr, xr, K, w, half_k, b, yr, N, n_valid, pre, next_panels);
    }
  }
}
#endif

}  // namespace

bool has_linear_bf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// w [N, K] bf16 (K even) -> [ceil(N / 16), K / 2, 16, 2]: panel p holds columns 16p..16p+15, and for each
// pair of k its 16 columns' (k, k+1) weights side by side, the second operand of VDPBF16PS. Padded columns
// are zero.
torch::Tensor pack_linear_bf16(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(1) % 2 == 0,
              "pack_linear_bf16: w must be bf16 [N, K] with K even");
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kLanes - 1) / kLanes;
  auto padded = torch::zeros({panels * kLanes, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({panels, kLanes, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [..., K] bf16 @ packed (from pack_linear_bf16) -> [..., N] bf16, plus bias [N] (bf16 or fp32) if given.
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(has_linear_bf16(), "linear_bf16: built without AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
              packed.is_contiguous() && packed.size(1) * 2 == x.size(-1) && packed.size(2) == kLanes &&
              packed.size(0) * kLanes >= N,
              "linear_bf16: x [..., K] bf16 and a packed weight for K");
  const int64_t K = x.size(-1), M = x.numel() / K;
  auto xc = x.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  auto y = torch::empty(shape, x.options());
  torch::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "linear_bf16: bias must have N elements");
    b = bias->to(at::kFloat).contiguous();
  }
#if defined(__AVX512BF16__)
  linear_impl(reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>()), M, K,
              reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()), packed.size(0),
              bias.has_value() ? b.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>()),
              N);
#endif
  return y;
}
