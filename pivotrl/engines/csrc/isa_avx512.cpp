// The AVX-512 build of the kernels (`kernels_impl.h` with PIVOTRL_AVX512; F + BW + VL + DQ): 16-lane
// vectors with masked tails. Compiled for that target whatever the compiler's default, so one build
// carries it; `bindings.cpp` runs it only on a CPU that has all four. The bf16 matmul (VDPBF16PS) is
// `isa_avx512bf16.cpp`'s: a CPU can have AVX-512 without AVX512-BF16.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PIVOTRL_AVX512 1
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#endif

namespace pivotrl {
namespace isa_avx512 {
#include "kernels_impl.h"
}  // namespace isa_avx512
}  // namespace pivotrl

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace pivotrl {
const KernelTable& avx512_kernels() {
  using namespace isa_avx512;
  static const KernelTable table{
      "avx512", &attention_range<float>, &attention_range<bf16>, &add_rms_norm_impl<float>, &add_rms_norm_impl<bf16>,
      &silu_mul_impl<float>, &silu_mul_impl<bf16>, &linear_impl<float>, nullptr,
  };
  return table;
}
}  // namespace pivotrl
#else
namespace pivotrl {
const KernelTable& avx512_kernels() {
  static const KernelTable none{};
  return none;
}
}  // namespace pivotrl
#endif
