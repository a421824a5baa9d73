// The native runner's per-layer work between its matmuls, on the CPU, one op each:
//   add_rmsnorm(h, weight, eps, delta?) -> (out, h + delta)      kernels/rmsnorm.py's semantics
//                                     (without delta the second output is empty: the sum is h)
//   rope_and_cache(qkv, positions, inv_freq, scaling, k_cache!, v_cache!, lengths, Hq, Hkv, D) -> q
//                                                                 kernels/rope.py's semantics
//   decode_attention(q, k_cache, v_cache, lengths, tree_mask?) -> out
//                                     n new tokens per row after lengths[b] cached ones: token t
//                                     sees those and new tokens 0..t, or those its tree_mask row
//                                     marks (a row of length -1, padding, gets zeros)
//   silu_mul(gate_up) -> silu(gate) * up
//
// Why: decoding on a CPU is a few large matmuls per layer and some 50 small PyTorch ops around
// them (norm, rotation, cache write, attention, activation: each converting, allocating and
// dispatching). On a 2-core EPYC those cost a Qwen 0.5B int4 drafter 4 of its 13 ms per token;
// these four ops do the same arithmetic with the roundings of the PyTorch path (bench/forward_cost.py).
// Each row, and each token of a row, is computed alone, so results do not depend on the batch
// or the step width: a token's logits are the same whether it is decoded alone or verified
// among a draft's (greedy speculative decoding then emits plain decoding's tokens exactly).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_isa.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

// vec16 (decode_cpu_kernels.inc) is passed in registers only inside one instruction set's
// inline functions: the ABI note about AVX-512 vectors does not concern a public interface.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace csd_engine {
namespace {

// GCC >= 12 and clang have __builtin_shufflevector; older GCC has __builtin_shuffle.
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define CSD_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#endif
#endif
#ifndef CSD_SHUFFLE
#define CSD_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, vec_mask{__VA_ARGS__})
#endif

#define CSD_VEC_LANES 4
namespace baseline {
#include "decode_cpu_kernels.inc"
}  // namespace baseline
#undef CSD_VEC_LANES

#if defined(__x86_64__) || defined(_M_X64)
#define CSD_X86 1
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define CSD_VEC_LANES 8
namespace avx2 {
#include "decode_cpu_kernels.inc"
}  // namespace avx2
#undef CSD_VEC_LANES
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#define CSD_VEC_LANES 16
namespace avx512 {
#include "decode_cpu_kernels.inc"
}  // namespace avx512
#undef CSD_VEC_LANES
#pragma GCC pop_options
#endif

// Calls the same-named kernel of the instruction set this CPU runs best.
#ifdef CSD_X86
#define CSD_ISA_CALL(fn, ...)                          \
  do {                                                 \
    switch (cpu_isa()) {                                   \
      case Isa::kAmx:                                  \
      case Isa::kAvx512Bf16:                           \
      case Isa::kAvx512: avx512::fn(__VA_ARGS__); break; \
      case Isa::kAvx2: avx2::fn(__VA_ARGS__); break;     \
      default: baseline::fn(__VA_ARGS__);              \
    }                                                  \
  } while (0)
#else
#define CSD_ISA_CALL(fn, ...) baseline::fn(__VA_ARGS__)
#endif

// Work per parallel task: below this many elements a row runs on the calling thread.
constexpr int64_t kGrainElements = 1 << 15;

void check_float(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf,
                   op, ": ", name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> add_rmsnorm_cpu(const at::Tensor& h, const at::Tensor& weight, double eps,
                                                   const std::optional<at::Tensor>& delta) {
  check_float("add_rmsnorm", "h", h);
  const int64_t hidden = h.dim() ? h.size(-1) : 0;
  TORCH_CHECK_VALUE(h.dim() >= 1, "add_rmsnorm: h must have a hidden dimension");
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == hidden && weight.scalar_type() == h.scalar_type(),
                    "add_rmsnorm: weight must be [", hidden, "] in h's dtype (", h.scalar_type(), "), got ",
                    weight.sizes(), " ", weight.scalar_type());
  if (delta.has_value()) {
    TORCH_CHECK_VALUE(delta->sizes() == h.sizes() && delta->scalar_type() == h.scalar_type(),
                      "add_rmsnorm: delta must match h: ", h.sizes(), " ", h.scalar_type(), ", got ", delta->sizes(),
                      " ", delta->scalar_type());
  }
  const at::Tensor hc = h.contiguous(), wc = weight.contiguous();
  const at::Tensor dc = delta.has_value() ? delta->contiguous() : at::Tensor();
  at::Tensor out = at::empty(h.sizes(), h.options());
  at::Tensor sum = at::empty(delta.has_value() ? h.sizes() : at::IntArrayRef({0}), h.options());
  const int64_t rows = hidden ? hc.numel() / hidden : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "add_rmsnorm", [&] {
    const scalar_t* hp = hc.const_data_ptr<scalar_t>();
    const scalar_t* dp = delta.has_value() ? dc.const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* wp = wc.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    scalar_t* sp = delta.has_value() ? sum.mutable_data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(hidden, 1)),
                     [&](int64_t lo, int64_t hi) {
      std::vector<float> row(hidden);
      CSD_ISA_CALL(add_rmsnorm_rows, hp + lo * hidden, dp ? dp + lo * hidden : nullptr, wp, op + lo * hidden,
                   sp ? sp + lo * hidden : nullptr, hi - lo, hidden, static_cast<float>(eps), row.data());
    });
  });
  return {out, sum};
}

at::Tensor rope_and_cache_cpu(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& inv_freq,
                              double scaling, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& lengths,
                              int64_t q_heads, int64_t kv_heads, int64_t head_dim) {
  check_float("rope_and_cache", "qkv", qkv);
  TORCH_CHECK_VALUE(qkv.dim() == 3 && qkv.size(2) == (q_heads + 2 * kv_heads) * head_dim,
                    "rope_and_cache: qkv must be [B, n, (q_heads + 2 * kv_heads) * head_dim = ",
                    (q_heads + 2 * kv_heads) * head_dim, "], got ", qkv.sizes());
  TORCH_CHECK_VALUE(head_dim >= 2 && head_dim % 2 == 0, "rope_and_cache: head_dim must be even, got ", head_dim);
  const int64_t b = qkv.size(0), n = qkv.size(1);
  TORCH_CHECK_VALUE(positions.sizes() == at::IntArrayRef({b, n}) && positions.scalar_type() == at::kLong,
                    "rope_and_cache: positions must be int64 [", b, ", ", n, "], got ", positions.scalar_type(), " ",
                    positions.sizes());
  TORCH_CHECK_VALUE(lengths.sizes() == at::IntArrayRef({b}) && lengths.scalar_type() == at::kLong,
                    "rope_and_cache: lengths must be int64 [", b, "], got ", lengths.scalar_type(), " ", lengths.sizes());
  TORCH_CHECK_VALUE(inv_freq.sizes() == at::IntArrayRef({head_dim / 2}) && inv_freq.scalar_type() == at::kFloat,
                    "rope_and_cache: inv_freq must be float32 [", head_dim / 2, "], got ", inv_freq.scalar_type(), " ",
                    inv_freq.sizes());
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.size(0) == b && k_cache.size(1) == kv_heads &&
                        k_cache.size(3) == head_dim && k_cache.sizes() == v_cache.sizes() &&
                        k_cache.strides() == v_cache.strides() && k_cache.stride(3) == 1 &&
                        k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type(),
                    "rope_and_cache: k_cache and v_cache must both be [", b, ", ", kv_heads, ", S, ", head_dim,
                    "] in qkv's dtype (", qkv.scalar_type(), "), contiguous along head_dim with equal strides, got ",
                    k_cache.scalar_type(), " ", k_cache.sizes(), " strides ", k_cache.strides(), " and ",
                    v_cache.scalar_type(), " ", v_cache.sizes(), " strides ", v_cache.strides());
  const int64_t capacity = k_cache.size(2);
  const at::Tensor x = qkv.contiguous(), pos = positions.contiguous(), freq = inv_freq.contiguous();
  const at::Tensor lens = lengths.contiguous();
  const int64_t* pp = pos.const_data_ptr<int64_t>();
  const int64_t* lp = lens.const_data_ptr<int64_t>();
  for (int64_t row = 0; row < b; ++row) {
    // a negative slot wraps to the end of the row, as in kernels/rope.py (padded graph rows)
    // (compared without adding n to the length: a huge length must not wrap into range)
    TORCH_CHECK_VALUE(lp[row] >= -capacity && lp[row] <= capacity - n, "rope_and_cache: row ", row,
                      " writes slots ", lp[row], "..", lp[row] + n - 1, " of a cache of ", capacity);
  }
  at::Tensor q = at::empty({b, n, q_heads, head_dim}, qkv.options());
  const int64_t width = x.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_and_cache", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* qp = q.mutable_data_ptr<scalar_t>();
    scalar_t* kp = k_cache.mutable_data_ptr<scalar_t>();
    scalar_t* vp = v_cache.mutable_data_ptr<scalar_t>();
    const float* fp = freq.const_data_ptr<float>();
    at::parallel_for(0, b * n, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(width, 1)),
                     [&](int64_t lo, int64_t hi) {
      std::vector<float> cos_sin(head_dim);
      for (int64_t token = lo; token < hi; ++token) {
        const int64_t row = token / n;
        const int64_t slot = lp[row] + token % n < 0 ? lp[row] + token % n + capacity : lp[row] + token % n;
        const int64_t offset = row * k_cache.stride(0) + slot * k_cache.stride(2);
        CSD_ISA_CALL(rope_token, xp + token * width, pp[token], fp, static_cast<float>(scaling),
                     qp + token * q_heads * head_dim, kp + offset, vp + offset, k_cache.stride(1), q_heads, kv_heads,
                     head_dim, cos_sin.data());
      }
    });
  });
  return q;
}

at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& lengths, const std::optional<at::Tensor>& tree_mask) {
  check_float("decode_attention", "q", q);
  TORCH_CHECK_VALUE(q.dim() == 4 && q.size(1) >= 1, "decode_attention: q must be [B, n, q_heads, head_dim], got ",
                    q.sizes());
  const int64_t b = q.size(0), n = q.size(1), q_heads = q.size(2), head_dim = q.size(3);
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.size(0) == b && k_cache.size(3) == head_dim &&
                        k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                        k_cache.stride(3) == 1 && k_cache.scalar_type() == q.scalar_type() &&
                        v_cache.scalar_type() == q.scalar_type(),
                    "decode_attention: k_cache and v_cache must both be [", b, ", kv_heads, S, ", head_dim,
                    "] in q's dtype (", q.scalar_type(), "), contiguous along head_dim with equal strides, got ",
                    k_cache.scalar_type(), " ", k_cache.sizes(), " strides ", k_cache.strides(), " and ",
                    v_cache.scalar_type(), " ", v_cache.sizes(), " strides ", v_cache.strides());
  const int64_t kv_heads = k_cache.size(1), capacity = k_cache.size(2);
  TORCH_CHECK_VALUE(kv_heads > 0 && q_heads % kv_heads == 0,
                    "decode_attention: q_heads (", q_heads, ") must be a multiple of kv_heads (", kv_heads, ")");
  TORCH_CHECK_VALUE(lengths.sizes() == at::IntArrayRef({b}) && lengths.scalar_type() == at::kLong,
                    "decode_attention: lengths must be int64 [", b, "], got ", lengths.scalar_type(), " ",
                    lengths.sizes());
  if (tree_mask.has_value()) {
    TORCH_CHECK_VALUE(tree_mask->sizes() == at::IntArrayRef({b, n, n}) && tree_mask->scalar_type() == at::kBool,
                      "decode_attention: tree_mask must be bool [", b, ", ", n, ", ", n, "], got ",
                      tree_mask->scalar_type(), " ", tree_mask->sizes());
  }
  const at::Tensor lens = lengths.contiguous();
  const int64_t* lp = lens.const_data_ptr<int64_t>();
  for (int64_t row = 0; row < b; ++row) {
    TORCH_CHECK_VALUE(lp[row] <= capacity - n, "decode_attention: row ", row, "'s new tokens sit in slots ", lp[row],
                      "..", lp[row] + n - 1, ", past a cache of ", capacity, " slots");
  }
  // per row and token, the new tokens it sees in slot order (a chain: 0..t; a tree: its mask row)
  std::vector<int64_t> seen(b * n * n), seen_count(b * n);
  const at::Tensor mask = tree_mask.has_value() ? tree_mask->contiguous() : at::Tensor();
  const bool* mp = tree_mask.has_value() ? mask.const_data_ptr<bool>() : nullptr;
  for (int64_t row = 0; row < b; ++row) {
    for (int64_t t = 0; t < n; ++t) {
      int64_t count = 0;
      for (int64_t u = 0; u < n; ++u) {
        if (mp ? mp[(row * n + t) * n + u] : u <= t) seen[(row * n + t) * n + count++] = u;
      }
      seen_count[row * n + t] = count;
    }
  }
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  const int64_t group = q_heads / kv_heads, token_stride = q_heads * head_dim;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    const scalar_t* qp = qc.const_data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.const_data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, b * kv_heads, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> scratch;
      for (int64_t task = lo; task < hi; ++task) {
        const int64_t row = task / kv_heads, head = task % kv_heads, prefix = lp[row];
        const int64_t q_offset = row * n * token_stride + head * group * head_dim;
        if (prefix < 0) {  // a padded row of the graph runner (length -1) sees nothing: zeros
          for (int64_t t = 0; t < n; ++t)
            std::fill(op + q_offset + t * token_stride, op + q_offset + t * token_stride + group * head_dim,
                      scalar_t(0));
          continue;
        }
        scratch.resize(baseline::attend_scratch(prefix, n, group, head_dim));
        const int64_t offset = row * k_cache.stride(0) + head * k_cache.stride(1);
        CSD_ISA_CALL(attend_tokens, qp + q_offset, token_stride, kp + offset, vp + offset, k_cache.stride(2), prefix,
                     n, seen.data() + row * n * n, seen_count.data() + row * n, group, head_dim, op + q_offset,
                     token_stride, scratch.data());
      }
    });
  });
  return out;
}

at::Tensor silu_mul_cpu(const at::Tensor& gate_up) {
  check_float("silu_mul", "gate_up", gate_up);
  TORCH_CHECK_VALUE(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
                    "silu_mul: gate_up's last dimension must be even ([gate | up]), got ", gate_up.sizes());
  const at::Tensor x = gate_up.contiguous();
  const int64_t inner = x.size(-1) / 2;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = inner;
  at::Tensor out = at::empty(shape, x.options());
  const int64_t rows = inner ? out.numel() / inner : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_mul", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(inner, 1)),
                     [&](int64_t lo, int64_t hi) {
      CSD_ISA_CALL(silu_mul_rows, xp + lo * 2 * inner, op + lo * inner, hi - lo, inner);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(csd_engine, m) {
  m.def("add_rmsnorm(Tensor h, Tensor weight, float eps, Tensor? delta=None) -> (Tensor, Tensor)");
  m.def("rope_and_cache(Tensor qkv, Tensor positions, Tensor inv_freq, float scaling, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor lengths, int q_heads, int kv_heads, int head_dim) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor lengths, Tensor? tree_mask=None) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(csd_engine, CPU, m) {
  m.impl("add_rmsnorm", &add_rmsnorm_cpu);
  m.impl("rope_and_cache", &rope_and_cache_cpu);
  m.impl("decode_attention", &decode_attention_cpu);
  m.impl("silu_mul", &silu_mul_cpu);
}

}  // namespace csd_engine
