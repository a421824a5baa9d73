// y = x W^T (+ bias) for bf16 x [M, K] on x86 CPUs with AVX2 (and FMA), W an int4 weight with a
// scale and a zero per output row and group of G inputs: W[n, k] = (q[n, k] - 8) s[n, g] + z[n, g]
// (models/quant.py's int4 scheme). bf16 out.
//
// Why: torch's _weight_int4pack_mm_for_cpu is bound by unpacking. It streamed a Qwen 0.5B
// drafter's packed weights at 20-28 GB/s on a 2-core AVX-512 EPYC (one row of x) where csd_engine's
// bf16 kernel streams the target's at ~50, and on a 2-core AVX2 EPYC its int4 0.5B forward cost
// more than the int8 one on csd_engine's int8 kernel (62 / 45 ms) for half the bytes.
//  * AVX-512 BF16: a nibble becomes a bf16 (q - 8) by one table lookup (vpermw), and vdpbf16ps
//    multiplies 32 of them by 32 bf16 activations exactly (an 8-bit by a 4-bit significand) into
//    16 fp32 sums; the group's sum is scaled once. Per matrix there: 24-38 GB/s for one row
//    (1.06-1.37x torch's op), 1.3-1.65x torch's op for 5 rows; from 7 rows x takes two tiles,
//    each unpacking W again, and torch's op is up to 15% faster (8 rows) or level (12-16).
//  * AVX2 (and AVX-512 without BF16): 8 bytes are zero-extended to 8 int32 lanes, whose low and
//    high nibbles (a mask, a shift) convert to fp32 q, multiplied with fp32 x by FMAs; the group's
//    sum of x q is scaled once, and the -8 s share joins the zeros' (below): two fewer
//    instructions per 16 inputs than subtracting 8 from every q.
// Either way the zeros' share is (z - offset s) for the group times its sum of x, added after
// (offset 0 for the bf16 tiles, 8 for the AVX2 ones).
//
// Packed layout (models/quant.py, pack_int4_for_kernel): [N, K / 2] bytes; byte 32 c + j of a row
// holds input 64 c + j in its low nibble and 64 c + 32 + j in its high nibble. Scales and zeros:
// [N, K / G, 2] bf16.
//
// Every output y[m, n] is the same sequence of operations whatever M is and whichever tile
// computes it (the tiles cover every row: N % 8 == 0), so a row's result does not depend on how
// many other rows share the call.

// x86 only: elsewhere the op is not registered and int4 weights keep torch's op
// (ops.int4_kernel_runs). The AVX-512 BF16 tiles need a compiler with their intrinsics (GCC 10,
// clang 9); without one the AVX2 tiles run on those CPUs too.
#if defined(__x86_64__) || defined(_M_X64)
#if defined(__clang__) ? __clang_major__ >= 9 : defined(__GNUC__) && __GNUC__ >= 10
#define CSD_INT4_BF16_TILES 1
#endif

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

// A tile: R rows of W (w: packed, K / 2 bytes apart; sz: their [groups, 2] scales and zeros, 2
// groups apart) against M rows of x (X: bf16 bits or fp32, x_stride apart): out[m * out_stride + r]
// = sum over groups of s * (x . (q - offset)), without the zeros' share.
template <typename X>
using TileFn = void (*)(const X*, int64_t, const uint8_t*, int64_t, const uint16_t*, int64_t, float*, int64_t);

__attribute__((target("avx2,fma"))) inline float reduce8(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}

// 8 packed bytes -> fp32 q of their low nibbles (lo) and high nibbles (hi); `ahead` bytes further
// on (the next tile's row) is prefetched when asked.
__attribute__((target("avx2,fma"))) inline void unpack(const uint8_t* bytes, int64_t ahead, bool prefetch, __m256& lo,
                                                       __m256& hi) {
  if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(bytes + ahead), _MM_HINT_T0);
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}

// AVX2, offset 0 (the -8 s share goes with the zeros'): R M accumulators, each group's scaled sum
// added to `total` in memory (once per group). Each chunk of x is loaded once for the R rows: all
// of x's chunks held while W's rows are unpacked one by one where they fit (R M + 2 M + 4 <= 16
// registers), else W's R rows unpacked first. Either way each output takes the same FMAs in the
// same order.
template <int R, int M>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* x, int64_t x_stride, const uint8_t* w, int64_t K,
                                                   const uint16_t* sz, int64_t group, float* out,
                                                   int64_t out_stride) {
  constexpr bool kHoldX = R * M + 2 * M + 4 <= 16;
  const int64_t groups = K / group, chunks = group / kChunk;
  alignas(32) float total[R][M][8] = {};
  for (int64_t g = 0; g < groups; ++g) {
    __m256 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k = (g * chunks + c) * kChunk;
      // bytes 8 t + j of the chunk: inputs k + 8 t + j (low nibbles) and k + 32 + 8 t + j (high)
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        if constexpr (kHoldX) {  // x's chunks first, then row after row of W
          __m256 x_lo[M], x_hi[M];
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m) {
            x_lo[m] = _mm256_loadu_ps(x + m * x_stride + k + 8 * t);
            x_hi[m] = _mm256_loadu_ps(x + m * x_stride + k + 32 + 8 * t);
            asm("" : "+x"(x_lo[m]), "+x"(x_hi[m]));  // loaded here, not by each FMA
          }
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            __m256 lo, hi;
            unpack(w + r * (K / 2) + k / 2 + 8 * t, R * (K / 2), t == 0 && c % 2 == 0, lo, hi);
#pragma GCC unroll 8
            for (int m = 0; m < M; ++m)
              acc[r][m] = _mm256_fmadd_ps(hi, x_hi[m], _mm256_fmadd_ps(lo, x_lo[m], acc[r][m]));
          }
        } else {  // W's R rows first, then x's chunks one row of x after another
          __m256 lo[R], hi[R];
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
            unpack(w + r * (K / 2) + k / 2 + 8 * t, R * (K / 2), t == 0 && c % 2 == 0, lo[r], hi[r]);
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m) {
            __m256 x_lo = _mm256_loadu_ps(x + m * x_stride + k + 8 * t);
            __m256 x_hi = _mm256_loadu_ps(x + m * x_stride + k + 32 + 8 * t);
            asm("" : "+x"(x_lo), "+x"(x_hi));
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r)
              acc[r][m] = _mm256_fmadd_ps(hi[r], x_hi, _mm256_fmadd_ps(lo[r], x_lo, acc[r][m]));
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_set1_ps(bf16_bits_to_float(sz[r * 2 * groups + 2 * g]));
      for (int m = 0; m < M; ++m)
        _mm256_store_ps(total[r][m], _mm256_fmadd_ps(acc[r][m], s, _mm256_load_ps(total[r][m])));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) out[m * out_stride + r] = reduce8(_mm256_load_ps(total[r][m]));
}

// W rows per tile by rows of x (each divides kBlockRows): 8 for one row of x, fewer as the
// accumulators for more rows of x fill the registers.
constexpr int kTileRowsAvx2[kMaxXRows + 1] = {0, 8, 4, 2, 2, 2, 2};
constexpr TileFn<float> kTilesAvx2[kMaxXRows + 1] = {nullptr,         tile_avx2<8, 1>, tile_avx2<4, 2>,
                                                     tile_avx2<2, 3>, tile_avx2<2, 4>, tile_avx2<2, 5>,
                                                     tile_avx2<2, 6>};

#ifdef CSD_INT4_BF16_TILES
#define CSD_AVX512_BF16 "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma"

// AVX-512 BF16, offset 8: 2 R M accumulators, at most 24 of the 32 registers.
template <int R, int M>
__attribute__((target(CSD_AVX512_BF16))) void tile_bf16(const uint16_t* x, int64_t x_stride, const uint8_t* w,
                                                       int64_t K, const uint16_t* sz, int64_t group, float* out,
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

// 8 W rows for one row of x (decoding), fewer as the accumulators fill the 32 registers.
constexpr int kTileRowsBf16[kMaxXRows + 1] = {0, 8, 4, 4, 2, 2, 2};
constexpr TileFn<uint16_t> kTilesBf16[kMaxXRows + 1] = {nullptr,         tile_bf16<8, 1>, tile_bf16<4, 2>,
                                                        tile_bf16<4, 3>, tile_bf16<2, 4>, tile_bf16<2, 5>,
                                                        tile_bf16<2, 6>};
#endif

// Whether this CPU (and CSD_CPU_ISA) lets int4_linear run: the one place the rule lives
// (ops.int4_kernel_runs asks it).
bool int4_linear_runs() { return cpu_isa() >= Isa::kAvx2; }

bool bf16_tiles_run() {
#ifdef CSD_INT4_BF16_TILES
  return cpu_isa() >= Isa::kAvx512Bf16;
#else
  return false;
#endif
}

// [M, N] fp32 = x W^T without bias: tiles of x's rows (near-equal, at most kMaxXRows) swept over
// blocks of kBlockRows W rows in parallel, then each output's zeros' share
// sum_g (z - offset s) xsum_g, xsum_g the group's sequential fp32 sum of x.
template <typename X>
void matmul(const X* xp, const uint16_t* x_bits, int64_t M, const uint8_t* wp, const uint16_t* szp, int64_t N,
            int64_t K, int64_t group, const int* tile_rows, const TileFn<X>* tiles_by_rows, int offset, float* op) {
  const int64_t groups = K / group;
  std::vector<float> xsum(M * groups, 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) s += bf16_bits_to_float(x_bits[m * K + k]);
      xsum[m * groups + g] = s;
    }
  const int64_t tiles = (M + kMaxXRows - 1) / kMaxXRows;
  at::parallel_for(0, N / kBlockRows, 4, [&](int64_t lo, int64_t hi) {
    std::vector<float> coef(groups * kBlockRows);  // z - offset s of the block's rows, [groups, 8]
    for (int64_t block = lo; block < hi; ++block) {
      const int64_t n0 = block * kBlockRows;
      for (int64_t tile_index = 0, m0 = 0; tile_index < tiles; ++tile_index) {
        const int64_t rows = M / tiles + (tile_index < M % tiles);
        for (int64_t n = n0; n < n0 + kBlockRows; n += tile_rows[rows])
          tiles_by_rows[rows](xp + m0 * K, K, wp + n * (K / 2), K, szp + n * 2 * groups, group, op + m0 * N + n, N);
        m0 += rows;
      }
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t j = 0; j < kBlockRows; ++j) {
          const float s = bf16_bits_to_float(szp[((n0 + j) * groups + g) * 2]);
          const float z = bf16_bits_to_float(szp[((n0 + j) * groups + g) * 2 + 1]);
          coef[g * kBlockRows + j] = offset ? z - offset * s : z;
        }
      for (int64_t m = 0; m < M; ++m) {  // y += coef x sum, group after group (a multiply and an add)
        float* y = op + m * N + n0;
        for (int64_t g = 0; g < groups; ++g)
          for (int64_t j = 0; j < kBlockRows; ++j) y[j] = y[j] + coef[g * kBlockRows + j] * xsum[m * groups + g];
      }
    }
  });
}

at::Tensor int4_linear_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                           int64_t group, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(int4_linear_runs(), "int4_linear: needs an x86 CPU with AVX2 and FMA (and CSD_CPU_ISA unset or not "
              "baseline)");
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
  const int64_t M = x.numel() / K;
  const at::Tensor xc = x.reshape({M, K}).contiguous();
  const at::Tensor w = packed.contiguous(), sz = scales_zeros.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.const_data_ptr<at::BFloat16>());
  const uint8_t* wp = w.const_data_ptr<uint8_t>();
  const uint16_t* szp = reinterpret_cast<const uint16_t*>(sz.const_data_ptr<at::BFloat16>());
  at::Tensor acc = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* op = acc.mutable_data_ptr<float>();
#ifdef CSD_INT4_BF16_TILES
  if (bf16_tiles_run()) {
    matmul<uint16_t>(xp, xp, M, wp, szp, N, K, group, kTileRowsBf16, kTilesBf16, 0, op);
  } else
#endif
  {
    const at::Tensor xf = xc.to(at::kFloat);  // small: M x K
    matmul<float>(xf.const_data_ptr<float>(), xp, M, wp, szp, N, K, group, kTileRowsAvx2, kTilesAvx2, 8, op);
  }
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
