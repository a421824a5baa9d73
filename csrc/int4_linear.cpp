// y = x W^T (+ bias) for bf16 x [M, K] on CPUs with AVX-512 BF16, W an int4 weight with a scale
// and a zero per output row and group of G inputs: W[n, k] = (q[n, k] - 8) s[n, g] + z[n, g]
// (models/quant.py's int4 scheme). bf16 out.
//
// Why: torch's _weight_int4pack_mm_for_cpu streams a Qwen 0.5B drafter's packed weights at 20-28
// GB/s on a 2-core AVX-512 EPYC (one row of x), where csd_engine's bf16 kernel streams the
// target's at ~50: it is bound by unpacking. Here a nibble becomes a bf16 (q - 8) by one table
// lookup (vpermw), and vdpbf16ps multiplies 32 of them by 32 bf16 activations exactly (an 8-bit
// by a 4-bit significand) into 16 fp32 sums; the group's sum is scaled once, and the zeros' share
// is z[n, g] times the group's sum of x, added after. There, per matrix: 24-38 GB/s for one row
// (1.06-1.37x torch's op), 1.3-1.65x torch's op for 5 rows; from 7 rows x takes two tiles, each
// unpacking W again, and torch's op is up to 15% faster (8 rows) or level (12-16).
//
// Packed layout (models/quant.py, pack_int4_for_kernel): [N, K / 2] bytes; byte 32 c + j of a row
// holds input 64 c + j in its low nibble and 64 c + 32 + j in its high nibble. Scales and zeros:
// [N, K / G, 2] bf16.
//
// Every output y[m, n] is the same sequence of operations whatever M is and whichever tile
// computes it (the tiles cover every row: N % 8 == 0), so a row's result does not depend on how
// many other rows share the call.

// x86 only, and a compiler with the AVX-512 BF16 intrinsics (GCC 10, clang 9): elsewhere the op
// is not registered and int4 weights keep torch's op (ops.int4_kernel_runs).
#if (defined(__x86_64__) || defined(_M_X64)) && \
    (defined(__clang__) ? __clang_major__ >= 9 : defined(__GNUC__) && __GNUC__ >= 10)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_isa.h"

#include <cstring>
#include <optional>
#include <vector>

#pragma GCC diagnostic ignored "-Wuninitialized"  // GCC bug 105593, see bf16_linear.cpp
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

namespace csd_engine {
namespace {

constexpr int64_t kChunk = 64;      // inputs per 32 packed bytes
constexpr int64_t kMaxXRows = 6;    // rows of x per tile
constexpr int64_t kBlockRows = 8;   // W rows per parallel work item: a multiple of every tile's

inline float bf16_bits_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

#define CSD_AVX512_BF16 "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma"

// R rows of W (w: packed, K / 2 bytes apart; sz: their [groups, 2] scales and zeros, 2 groups
// apart) against M rows of x (bf16 bits): out[m * out_stride + r] = sum over groups of
// s * (x . (q - 8)), without the zeros' share. 2 R M accumulators, at most 24.
template <int R, int M>
__attribute__((target(CSD_AVX512_BF16))) void tile(const uint16_t* x, int64_t x_stride, const uint8_t* w, int64_t K,
                                                  const uint16_t* sz, int64_t group, float* out,
                                                  int64_t out_stride) {
  // bf16 bits of (i % 16) - 8: vpermw reads an index's low 5 bits, so a byte's low nibble is
  // looked up without masking off its high one
  alignas(64) static const uint16_t kValues[32] = {
      0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000,
      0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040,
      0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};
  const __m512i table = _mm512_load_si512(kValues);
  const int64_t groups = K / group, chunks = group / kChunk;
  __m512 total[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) total[r][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k = (g * chunks + c) * kChunk;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const uint8_t* bytes = w + r * (K / 2) + k / 2;
        if (c % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(bytes + R * (K / 2)), _MM_HINT_T0);
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)));
        const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(v, table);
        const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          const uint16_t* xs = x + m * x_stride + k;
          acc[r][m] = _mm512_dpbf16_ps(acc[r][m], lo, (__m512bh)_mm512_loadu_si512(xs));
          acc[r][m] = _mm512_dpbf16_ps(acc[r][m], hi, (__m512bh)_mm512_loadu_si512(xs + 32));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(bf16_bits_to_float(sz[r * 2 * groups + 2 * g]));
      for (int m = 0; m < M; ++m) total[r][m] = _mm512_fmadd_ps(acc[r][m], s, total[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) out[m * out_stride + r] = _mm512_reduce_add_ps(total[r][m]);
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint8_t*, int64_t, const uint16_t*, int64_t, float*, int64_t);
// W rows per tile by rows of x (each divides kBlockRows): 8 for one row of x (decoding), fewer
// as the accumulators for more rows of x fill the 32 registers.
constexpr int kTileRows[kMaxXRows + 1] = {0, 8, 4, 4, 2, 2, 2};
constexpr TileFn kTiles[kMaxXRows + 1] = {nullptr,    tile<8, 1>, tile<4, 2>, tile<4, 3>,
                                          tile<2, 4>, tile<2, 5>, tile<2, 6>};

// Whether this CPU (and CSD_CPU_ISA) lets int4_linear run: the one place the rule lives
// (ops.int4_kernel_runs asks it).
bool int4_linear_runs() { return cpu_isa() == Isa::kAvx512Bf16; }

at::Tensor int4_linear_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                           int64_t group, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(int4_linear_runs(), "int4_linear: needs a CPU with AVX-512 BF16 (and CSD_CPU_ISA unset or avx512_bf16)");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kBFloat16, "int4_linear: x must be bfloat16, got ", x.scalar_type());
  TORCH_CHECK_TYPE(packed.scalar_type() == at::kByte, "int4_linear: packed must be uint8, got ",
                   packed.scalar_type());
  TORCH_CHECK_VALUE(packed.dim() == 2, "int4_linear: packed must be 2-D [N, K / 2], got ", packed.dim(),
                    " dimensions");
  const int64_t N = packed.size(0), K = 2 * packed.size(1);
  TORCH_CHECK_VALUE(K > 0 && group > 0 && group % kChunk == 0 && K % group == 0, "int4_linear: group must be a multiple of ",
                    kChunk, " that divides K = ", K, ", got ", group);
  TORCH_CHECK_VALUE(N % kBlockRows == 0, "int4_linear: the output size N must be a multiple of ", kBlockRows,
                    ", got ", N);
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == K, "int4_linear: x's last dimension (", x.dim() ? x.size(-1) : 0,
                    ") must equal K = 2 x packed's columns (", K, ")");
  TORCH_CHECK_TYPE(scales_zeros.scalar_type() == at::kBFloat16, "int4_linear: scales_zeros must be bfloat16, got ",
                   scales_zeros.scalar_type());
  TORCH_CHECK_VALUE(scales_zeros.sizes() == at::IntArrayRef({N, K / group, 2}),
                    "int4_linear: scales_zeros must be [N, K / group, 2] = [", N, ", ", K / group, ", 2], got ",
                    scales_zeros.sizes());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N, "int4_linear: bias must be [N] = [", N, "]");
  }
  const int64_t M = x.numel() / K, groups = K / group;
  const at::Tensor xc = x.reshape({M, K}).contiguous();
  const at::Tensor w = packed.contiguous(), sz = scales_zeros.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.const_data_ptr<at::BFloat16>());
  const uint8_t* wp = w.const_data_ptr<uint8_t>();
  const uint16_t* szp = reinterpret_cast<const uint16_t*>(sz.const_data_ptr<at::BFloat16>());
  // The zeros' share needs each group's sum of x: sequential fp32 sums, per row of x.
  std::vector<float> xsum(M * groups, 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) s += bf16_bits_to_float(xp[m * K + k]);
      xsum[m * groups + g] = s;
    }
  at::Tensor acc = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* op = acc.mutable_data_ptr<float>();
  const int64_t tiles = (M + kMaxXRows - 1) / kMaxXRows;
  at::parallel_for(0, N / kBlockRows, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t block = lo; block < hi; ++block) {
      const int64_t n0 = block * kBlockRows;
      for (int64_t tile_index = 0, m0 = 0; tile_index < tiles; ++tile_index) {
        const int64_t rows = M / tiles + (tile_index < M % tiles);
        for (int64_t n = n0; n < n0 + kBlockRows; n += kTileRows[rows])
          kTiles[rows](xp + m0 * K, K, wp + n * (K / 2), K, szp + n * 2 * groups, group, op + m0 * N + n, N);
        for (int64_t m = m0; m < m0 + rows; ++m)
          for (int64_t n = n0; n < n0 + kBlockRows; ++n) {
            float y = op[m * N + n];
            for (int64_t g = 0; g < groups; ++g)
              y += bf16_bits_to_float(szp[(n * groups + g) * 2 + 1]) * xsum[m * groups + g];
            op[m * N + n] = y;
          }
        m0 += rows;
      }
    }
  });
  if (bias.has_value()) acc.add_(bias->to(at::kFloat));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return acc.to(at::kBFloat16).reshape(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(csd_engine, m) {
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales_zeros, int group, Tensor? bias=None) -> Tensor");
  m.def("int4_linear_runs() -> bool", &int4_linear_runs);
}

TORCH_LIBRARY_IMPL(csd_engine, CPU, m) { m.impl("int4_linear", &int4_linear_cpu); }

}  // namespace csd_engine

#endif
