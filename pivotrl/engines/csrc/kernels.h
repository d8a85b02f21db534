// What every instruction-set build of the native kernels shares: the bf16 element type, the arguments of
// one decode-attention call, and the table of entry points each build fills (`isa_*.cpp`).
//
// Why a table per instruction set: one build carries every path (AVX-512, AVX2 + FMA, scalar), each
// compiled for its own target by a `#pragma GCC target` region over the same source (`kernels_impl.h`),
// and the torch glue (`bindings.cpp`) picks one at run time from the CPU's flags (or
// PIVOTRL_KERNEL_ISA), instead of one -march=native build that runs only on CPUs like the builder's.
// The kernel files include no torch header, so the three of them compile in seconds.
#pragma once

#include <cstdint>
#include <cstring>

namespace pivotrl {

// Bit-compatible with c10::BFloat16 (its conversions: round to nearest even; NaN -> 0x7FC0).
struct bf16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline bf16 from_float<bf16>(float x) {
  if (x != x) return bf16{0x7FC0};
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return bf16{static_cast<uint16_t>((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16)};
}

// One decode-attention call (see `decode_attention` in bindings.cpp for the layouts).
template <typename T>
struct AttentionArgs {
  const T* qkv;
  const float* cos;
  const float* sin;
  T* kv;
  const int64_t* lens;
  T* y;
  int64_t B, H, KV, D, slots, L;
  float scale;
};

// The entry points of one instruction-set build. A null `linear_*`: that build has no such matmul.
struct KernelTable {
  const char* name;
  // tasks [begin, end) of B * KV (one per sequence and kv head)
  void (*attention_f32)(const AttentionArgs<float>&, int64_t begin, int64_t end);
  void (*attention_bf16)(const AttentionArgs<bf16>&, int64_t begin, int64_t end);
  void (*add_rms_norm_f32)(float* x, const float* delta, const float* w, float* out, int64_t rows, int64_t dim,
                           float eps);
  void (*add_rms_norm_bf16)(bf16* x, const bf16* delta, const bf16* w, bf16* out, int64_t rows, int64_t dim,
                            float eps);
  void (*silu_mul_f32)(const float* gate_up, float* out, int64_t rows, int64_t inner);
  void (*silu_mul_bf16)(const bf16* gate_up, bf16* out, int64_t rows, int64_t inner);
  // y[M, N] = x[M, K] @ W^T (+ bias), W packed by pack_linear into `panels` panels of 16 columns
  void (*linear_f32)(const float* x, int64_t M, int64_t K, const float* wp, int64_t panels, const float* bias,
                     float* y, int64_t N);
  void (*linear_bf16)(const bf16* x, int64_t M, int64_t K, const bf16* wp, int64_t panels, const float* bias,
                      bf16* y, int64_t N);
};

constexpr int64_t kBlock = 16;  // positions per key block (model.KEY_BLOCK)
constexpr int64_t kLanes = 16;  // output columns per packed weight panel

const KernelTable& scalar_kernels();
const KernelTable& avx2_kernels();
const KernelTable& avx512_kernels();
// AVX512-BF16's bf16 matmul (VDPBF16PS), its own build: a CPU may have AVX-512 without it.
using LinearBf16 = decltype(KernelTable::linear_bf16);
LinearBf16 avx512bf16_linear();

}  // namespace pivotrl
