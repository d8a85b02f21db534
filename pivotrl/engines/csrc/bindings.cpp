// The torch side of the native kernels: argument checks, the run-time choice of instruction set, and the
// Python bindings. The arithmetic is in `kernels_impl.h`, built once per instruction set (`isa_*.cpp`).
//
// Why chosen at run time: the build is compiled for the baseline CPU (no -march=native), each kernel file
// for its own target, so one build (and one cache directory) runs on any x86-64 CPU and carries every
// path; the best the CPU's flags allow (cpuid, `__builtin_cpu_supports`) is taken unless `set_isa` (from
// PIVOTRL_KERNEL_ISA, see kernels.py) forces another.
// Only the headers used, not <torch/extension.h> (the whole C++ frontend): this file is most of the
// build, which a fresh checkout compiles before its first decode step (docs/decisions.md).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with the Tensor caster
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <string>
#include <vector>

#include "kernels.h"

namespace {

using pivotrl::bf16;
using pivotrl::KernelTable;

// The instruction sets this CPU runs, best first ("avx512", "avx2", "scalar").
std::vector<std::string> supported() {
  std::vector<std::string> out;
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    out.push_back("avx512");
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) out.push_back("avx2");
#endif
  out.push_back("scalar");
  return out;
}

bool cpu_has_avx512bf16() {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

struct Active {
  std::string name;
  KernelTable table;
  bool linear_fp32 = false;  // whether the native fp32 matmul beats oneDNN on this path (has_linear)
  bool linear_bf16 = false;
};

Active make(const std::string& name) {
  Active a;
  a.name = name;
  if (name == "avx512") {
    a.table = pivotrl::avx512_kernels();
    a.linear_fp32 = true;
    if (cpu_has_avx512bf16()) a.table.linear_bf16 = pivotrl::avx512bf16_linear();
    a.linear_bf16 = a.table.linear_bf16 != nullptr;
  } else if (name == "avx2") {
    a.table = pivotrl::avx2_kernels();
    a.linear_fp32 = true;  // 1.1-2.2x oneDNN's AVX2 matmul at M <= 32, level from 48 to 1024 (docs/engine.md)
  } else {
    a.table = pivotrl::scalar_kernels();  // its matmul only keeps packed weights computing (not preferred)
  }
  if (a.table.linear_bf16 == nullptr) a.table.linear_bf16 = pivotrl::scalar_kernels().linear_bf16;
  if (a.table.linear_f32 == nullptr) a.table.linear_f32 = pivotrl::scalar_kernels().linear_f32;
  return a;
}

Active& active() {
  static Active a = make(supported().front());
  return a;
}

void set_isa(const std::string& name) {
  const auto ok = supported();
  const std::string pick = name == "auto" ? ok.front() : name;
  std::string names;
  for (const auto& n : ok) names += (names.empty() ? "" : ", ") + n;
  TORCH_CHECK(std::find(ok.begin(), ok.end(), pick) != ok.end(), "PIVOTRL_KERNEL_ISA=", name,
              ": this CPU runs only ", names, " (or auto)");
  active() = make(pick);
}

std::string isa() { return active().name; }

bf16* as_bf16(const at::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr<c10::BFloat16>()); }

}  // namespace

bool has_linear(c10::ScalarType dtype) {
  if (dtype == at::kFloat) return active().linear_fp32;
  if (dtype == at::kBFloat16) return active().linear_bf16;
  return false;
}

// w [N, K] -> panels: fp32 [ceil(N / 16), K, 16]; bf16 (K even) [ceil(N / 16), K / 2, 16, 2], for each pair of
// k the 16 columns' (k, k+1) weights side by side, the second operand of VDPBF16PS. Padded columns are zero.
// One layout for every instruction set, so a packed weight computes on whichever path is active.
at::Tensor pack_linear(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "pack_linear: w must be [N, K] fp32 or bf16");
  const bool is_bf16 = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK(!is_bf16 || w.size(1) % 2 == 0, "pack_linear: bf16 needs K even");
  const int64_t N = w.size(0), K = w.size(1), panels = (N + pivotrl::kLanes - 1) / pivotrl::kLanes;
  auto padded = at::zeros({panels * pivotrl::kLanes, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  if (is_bf16) return padded.view({panels, pivotrl::kLanes, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  return padded.view({panels, pivotrl::kLanes, K}).permute({0, 2, 1}).contiguous();
}

// x [..., K] @ packed (from pack_linear, same dtype) -> [..., N], plus bias [N] (added in fp32) if given.
at::Tensor linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t N) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && packed.scalar_type() == dtype &&
                  packed.is_contiguous(),
              "linear: x and the packed weight must share a dtype (fp32 or bf16)");
  const int64_t K = x.size(-1), per = dtype == at::kBFloat16 ? 2 : 1;
  TORCH_CHECK(x.dim() >= 1 && K > 0, "linear: x must be [..., K] with K > 0");
  TORCH_CHECK(packed.size(1) * per == K && packed.size(2) == pivotrl::kLanes &&
                  packed.size(0) * pivotrl::kLanes >= N,
              "linear: the packed weight does not fit x [..., K] and N");
  const int64_t M = x.numel() / K;
  auto xc = x.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  auto y = at::empty(shape, x.options());
  at::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "linear: bias must have N elements");
    b = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  const KernelTable& k = active().table;
  if (dtype == at::kFloat) {
    k.linear_f32(xc.data_ptr<float>(), M, K, packed.data_ptr<float>(), packed.size(0), bp, y.data_ptr<float>(), N);
  } else {
    k.linear_bf16(as_bf16(xc), M, K, as_bf16(packed), packed.size(0), bp, as_bf16(y), N);
  }
  return y;
}

// qkv: [B, (H + 2 KV) * D] (q heads, then k heads, then v heads), cos/sin: [B, D] fp32 rotary rows at
// each sequence's position, kv: one layer of the cache [2, slots, KV, L, D] (keys then values; each key
// head block holds its keys in blocks of kBlock positions, each block transposed as [D, kBlock], see
// model.KVSlots; L is a multiple of kBlock), lens: [B]
// positions (sequence b sits in slot b and attends to positions 0..lens[b]). Stores the new k, v at
// position lens[b] of slot b and returns the attention output [B, H * D].
at::Tensor decode_attention(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor kv, at::Tensor lens,
                            int64_t heads, double scale) {
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
  TORCH_CHECK(L % pivotrl::kBlock == 0, "the cache length must be a multiple of ", pivotrl::kBlock);
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(pos[b] >= 0 && pos[b] < L, "a position is outside the cache");
  auto y = at::empty({B, heads * D}, qkv.options());
  const KernelTable& k = active().table;
  const float sc = static_cast<float>(scale);
  if (qkv.scalar_type() == at::kFloat) {
    const pivotrl::AttentionArgs<float> a{qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                                          kv.data_ptr<float>(),  pos, y.data_ptr<float>(), B, heads, KV, D, slots,
                                          L, sc};
    at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) { k.attention_f32(a, begin, end); });
  } else if (qkv.scalar_type() == at::kBFloat16) {
    const pivotrl::AttentionArgs<bf16> a{as_bf16(qkv), cos.data_ptr<float>(), sin.data_ptr<float>(), as_bf16(kv), pos,
                                         as_bf16(y),   B, heads, KV, D, slots, L, sc};
    at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) { k.attention_bf16(a, begin, end); });
  } else {
    TORCH_CHECK(false, "decode_attention supports float32 and bfloat16");
  }
  return y;
}

// The residual add and RMSNorm between sublayers as one pass: x += delta (in place; delta may be None),
// returns rms_norm(x) * weight. x, delta: contiguous [rows, dim]; weight: [dim]; all one dtype.
at::Tensor add_rms_norm(at::Tensor x, c10::optional<at::Tensor> delta, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(1) &&
              weight.scalar_type() == x.scalar_type(), "add_rms_norm: x [rows, dim] contiguous, weight [dim]");
  if (delta.has_value())
    TORCH_CHECK(delta->is_contiguous() && delta->sizes() == x.sizes() && delta->scalar_type() == x.scalar_type(),
                "add_rms_norm: delta must match x");
  auto out = at::empty_like(x);
  const KernelTable& k = active().table;
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    k.add_rms_norm_f32(x.data_ptr<float>(), delta.has_value() ? delta->data_ptr<float>() : nullptr,
                       weight.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1), e);
  } else if (x.scalar_type() == at::kBFloat16) {
    k.add_rms_norm_bf16(as_bf16(x), delta.has_value() ? as_bf16(*delta) : nullptr, as_bf16(weight), as_bf16(out),
                        x.size(0), x.size(1), e);
  } else {
    TORCH_CHECK(false, "add_rms_norm supports float32 and bfloat16");
  }
  return out;
}

// SwiGLU's silu(gate) * up from the fused gate|up projection [rows, 2 * inner] -> [rows, inner].
at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0, "silu_mul: [rows, 2I]");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  auto out = at::empty({rows, inner}, gate_up.options());
  const KernelTable& k = active().table;
  if (gate_up.scalar_type() == at::kFloat) {
    k.silu_mul_f32(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, inner);
  } else if (gate_up.scalar_type() == at::kBFloat16) {
    k.silu_mul_bf16(as_bf16(gate_up), as_bf16(out), rows, inner);
  } else {
    TORCH_CHECK(false, "silu_mul supports float32 and bfloat16");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported_isas", &supported, "instruction sets this CPU runs, best first");
  m.def("set_isa", &set_isa, "run the kernels on this instruction set ('avx512', 'avx2', 'scalar', 'auto')");
  m.def("isa", &isa, "the instruction set the kernels run on now");
  m.def("has_linear_fp32", [] { return has_linear(at::kFloat); }, "whether the fp32 matmul beats oneDNN here");
  m.def("has_linear_bf16", [] { return has_linear(at::kBFloat16); }, "whether linear takes bf16 (AVX512-BF16)");
  m.def("pack_linear", &pack_linear, "pack an [N, K] weight for linear");
  m.def("linear", &linear, "x @ W^T (+ bias) with fp32 accumulation, W packed by pack_linear");
  m.def("decode_attention", &decode_attention, "fused RoPE + KV store + attention for one decode step");
  m.def("add_rms_norm", &add_rms_norm, "x += delta in place, then RMSNorm(x) * weight");
  m.def("silu_mul", &silu_mul, "silu(gate) * up from [rows, 2 * inner]");
}
