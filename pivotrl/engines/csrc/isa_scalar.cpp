// The scalar build of the kernels (`kernels_impl.h` with no vector path): the last fallback, for a CPU
// with neither AVX2 + FMA nor AVX-512, or forced with PIVOTRL_KERNEL_ISA=scalar.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace pivotrl {
namespace isa_scalar {
#include "kernels_impl.h"
}  // namespace isa_scalar

const KernelTable& scalar_kernels() {
  using namespace isa_scalar;
  static const KernelTable table{
      "scalar",           &attention_range<float>, &attention_range<bf16>, &add_rms_norm_impl<float>,
      &add_rms_norm_impl<bf16>, &silu_mul_impl<float>, &silu_mul_impl<bf16>, &linear_scalar<float>,
      &linear_scalar<bf16>,
  };
  return table;
}
}  // namespace pivotrl
