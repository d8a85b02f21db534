// The AVX2 + FMA build of the kernels (`kernels_impl.h` with PIVOTRL_AVX2): 8-lane fp32 vectors, bf16
// widened and rounded (to nearest even) in registers. Compiled for that target whatever the compiler's
// default, so one build carries it; `bindings.cpp` runs it only on a CPU that has both.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PIVOTRL_AVX2 1
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

namespace pivotrl {
namespace isa_avx2 {
#include "kernels_impl.h"
}  // namespace isa_avx2
}  // namespace pivotrl

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace pivotrl {
const KernelTable& avx2_kernels() {
  using namespace isa_avx2;
  // No bf16 matmul here: without a bf16 dot product the widening costs more than oneDNN's (has_linear).
  static const KernelTable table{
      "avx2", &attention_range<float>, &attention_range<bf16>, &add_rms_norm_impl<float>, &add_rms_norm_impl<bf16>,
      &silu_mul_impl<float>, &silu_mul_impl<bf16>, &linear_impl<float>, nullptr,
  };
  return table;
}
}  // namespace pivotrl
#else
namespace pivotrl {
const KernelTable& avx2_kernels() {
  static const KernelTable none{};
  return none;
}
}  // namespace pivotrl
#endif
