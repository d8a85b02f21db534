// AVX512-BF16's bf16 matmul (`kernels_impl.h`'s `linear_impl<bf16>` on VDPBF16PS), in its own target
// region: `bindings.cpp` adds it to the AVX-512 path only on a CPU that has AVX512-BF16.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PIVOTRL_AVX512 1
#define PIVOTRL_AVX512BF16 1
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")
#endif

namespace pivotrl {
namespace isa_avx512bf16 {
#include "kernels_impl.h"
}  // namespace isa_avx512bf16
}  // namespace pivotrl

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace pivotrl {
LinearBf16 avx512bf16_linear() { return &isa_avx512bf16::linear_impl<bf16>; }
}  // namespace pivotrl
#else
namespace pivotrl {
LinearBf16 avx512bf16_linear() { return nullptr; }
}  // namespace pivotrl
#endif
