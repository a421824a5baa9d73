// y = x W^T (+ bias) for bf16 x [M, K] on the CPU, W [N, K] in bf16 or in int8 with one scale
// per output row (y = scale * (x q^T)): fp32 accumulation, bf16 out.
//
// Why: on CPUs without native bf16 arithmetic (AVX2, no avx512_bf16/AMX) torch's bf16 matmul
// costs M times a one-row matmul (measured on a 2-core AVX2 EPYC: 1.5 ms for one row of a
// 8960x1536 weight, 7 ms for 5 rows, 23 ms for 17), so a target verifying a 5-token draft paid
// 4x a decoding step and speculation could never win there; torch's int8 weight-only op
// (_weight_int8pack_mm) there was no faster than this kernel's bf16 and also grows with M.
// Both ops stream W once per call and widen each 8-lane chunk of it to fp32 in registers,
// reusing it for up to 6 rows of x; int8 streams half the bytes of bf16.
//
// Every output y[m, n] is the same sequence of fp32 operations whatever M is (see rows_scalar), so a row's result does not depend on how
// many other rows share the call: decoding one token and verifying a draft round alike.
//
// With AMX (cpu_isa() == kAmx) a bf16 weight whose K is a multiple of 32 takes AMX's bf16 tiles
// instead (matmul_amx): its FMA tiles become compute-bound from about 5 rows of x (a 2-core
// Sapphire Rapids Xeon: a 16-row call of an 8960 x 1536 weight 2.3x a 1-row one), AMX's stream
// the weight at any row count up to 16 in a one-row call's time. Their sums are AMX's own
// (another order than the FMA tiles'), again the same for an output whatever M is.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_isa.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which its -O3 flags as
// uninitialized (GCC bug 105593): not a fault in this file
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define CSD_X86 1
#endif

namespace csd_engine {
namespace {

constexpr int64_t kRowsPerTile = 6;  // rows of x sharing one widened chunk of W
constexpr int64_t kLanes = 8;
constexpr int64_t kGroupRows = 24;   // W rows per parallel work item: a multiple of 4, 3 and 2

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline float to_float(uint16_t v) { return bf16_to_float(v); }
inline float to_float(int8_t v) { return static_cast<float>(v); }

// Per (m, n), every path of one instruction set computes: lane l of L (8 with AVX2, 16 with
// AVX-512) accumulates w[k] x[m, k] for k = L j + l over whole L-lane chunks (fused multiply-add,
// in k order); with 16 lanes, lane l + 8 is added to lane l; the 8 lanes are summed as
// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), then the k tail is added with FMAs.
template <int L, typename W>
void rows_scalar(const float* x, const W* w, int64_t K, int64_t m_count, int64_t x_stride, float* out,
                 int64_t out_stride) {
  for (int64_t m = 0; m < m_count; ++m) {
    float lane[L] = {};
    int64_t k = 0;
    for (; k + L <= K; k += L)
      for (int l = 0; l < L; ++l) lane[l] = std::fma(to_float(w[k + l]), x[m * x_stride + k + l], lane[l]);
    if (L == 16)
      for (int l = 0; l < 8; ++l) lane[l] += lane[l + 8];
    float sum = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
    for (; k < K; ++k) sum = std::fma(to_float(w[k]), x[m * x_stride + k], sum);
    out[m * out_stride] = sum;
  }
}

#ifdef CSD_X86
__attribute__((target("avx2,fma"))) inline __m256 widen(const uint16_t* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

__attribute__((target("avx2,fma"))) inline __m256 widen(const int8_t* p) {
  __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
}

__attribute__((target("avx2,fma"))) inline float reduce(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l + (l + 4)
  __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));  // (0+4)+(2+6), (1+5)+(3+7)
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}

// R rows of W (from w, `K` apart) against M rows of x, R * M <= 12 accumulators (with R
// widened chunks of W and one of x: at most 16 registers): out[m * out_stride + r].
template <typename W, int R, int M>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* x, const W* w, int64_t K, int64_t x_stride,
                                                   float* out, int64_t out_stride) {
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    __m256 wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      // the next tile's rows, one cache line ahead per row: short rows (int8: K bytes) end before
      // the hardware prefetcher has ramped up
      if ((k * sizeof(W)) % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (R + r) * K + k), _MM_HINT_T0);
      wv[r] = widen(w + r * K + k);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      __m256 xv = _mm256_loadu_ps(x + m * x_stride + k);
      asm("" : "+x"(xv));  // one load per chunk of x: folded into each FMA it would be loaded R times
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      float sum = reduce(acc[r][m]);
      for (int64_t t = k; t < K; ++t) sum = std::fma(to_float(w[r * K + t]), x[m * x_stride + t], sum);
      out[m * out_stride + r] = sum;
    }
}

template <typename W>
using TileFn = void (*)(const float*, const W*, int64_t, int64_t, float*, int64_t);
// Tiles by rows of x, each within 16 registers (4 x 3 spilled): 4 rows of W for 1 or 2 rows of x
// (more independent FMA chains when decoding one token), 3 for 3 or 4 (with x and W in L1 the
// fastest on Zen 3, 70-79 GFLOP/s a core against a 100 GFLOP/s FMA peak), 2 for 5 or 6. A
// group's last rows that fill no tile take rows_scalar.
constexpr int kTileRowsOfW[kRowsPerTile + 1] = {0, 4, 4, 3, 3, 2, 2};
template <typename W>
constexpr TileFn<W> kTiles[kRowsPerTile + 1] = {nullptr,           tile_avx2<W, 4, 1>, tile_avx2<W, 4, 2>,
                                                tile_avx2<W, 3, 3>, tile_avx2<W, 3, 4>, tile_avx2<W, 2, 5>,
                                                tile_avx2<W, 2, 6>};

#define CSD_AVX512 "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"

__attribute__((target(CSD_AVX512))) inline __m512 widen16(const uint16_t* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

__attribute__((target(CSD_AVX512))) inline __m512 widen16(const int8_t* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
}

// Lane l + 8 added to lane l, then reduce()'s order of the 8 (rows_scalar<16>).
__attribute__((target(CSD_AVX512))) inline float reduce16(__m512 v) {
  const __m256 lo = _mm512_castps512_ps256(v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return reduce(_mm256_add_ps(lo, hi));
}

// tile_avx2 with 16 lanes: 32 registers hold up to 24 accumulators.
template <typename W, int R, int M>
__attribute__((target(CSD_AVX512))) void tile_avx512(const float* x, const W* w, int64_t K, int64_t x_stride,
                                                     float* out, int64_t out_stride) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      if ((k * sizeof(W)) % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (R + r) * K + k), _MM_HINT_T0);
      wv[r] = widen16(w + r * K + k);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      __m512 xv = _mm512_loadu_ps(x + m * x_stride + k);
      asm("" : "+v"(xv));  // one load per chunk of x (see tile_avx2)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      float sum = reduce16(acc[r][m]);
      for (int64_t t = k; t < K; ++t) sum = std::fma(to_float(w[r * K + t]), x[m * x_stride + t], sum);
      out[m * out_stride + r] = sum;
    }
}

// 8 rows of W for 1 or 2 rows of x, 6 for 3 or 4, 4 for 5 or 6 (all divide kGroupRows).
constexpr int kTileRowsOfW512[kRowsPerTile + 1] = {0, 8, 8, 6, 6, 4, 4};
template <typename W>
constexpr TileFn<W> kTiles512[kRowsPerTile + 1] = {nullptr,             tile_avx512<W, 8, 1>, tile_avx512<W, 8, 2>,
                                                   tile_avx512<W, 6, 3>, tile_avx512<W, 6, 4>, tile_avx512<W, 4, 5>,
                                                   tile_avx512<W, 4, 6>};
#endif

#ifdef CSD_AMX
constexpr int64_t kAmxK = 32;        // bf16 of k per tile row (64 bytes)
constexpr int64_t kAmxRows = 16;     // rows of W per tile, and at most as many rows of x
constexpr int64_t kAmxChunk = 64;     // k-tiles of one W tile before the next's (4 KB of each of its rows)
constexpr int64_t kAmxTilesOfW = 4;  // W tiles per work item: accumulators 0-3, W in tiles 5 and 6, x in 7

// Palette 1: W's tiles 16 rows of 64 bytes (32 bf16 of k); x's 16 k-pairs x `cols` rows of x, and
// the accumulators 16 W rows x `cols` fp32, where cols = min(M, 16): a one-row call loads 64
// bytes of x per k-tile, not 1 KB. An output's sum does not depend on cols.
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit AmxConfig(int64_t cols) {
    for (int t = 0; t < 8; ++t) {
      rows[t] = kAmxRows;
      colsb[t] = t == 5 || t == 6 ? 64 : static_cast<uint16_t>(4 * cols);
    }
  }
};

// x [M, K] bf16 re-laid as AMX's B operand (pairs of k together): per tile of `cols` rows of x
// and k-tile j, 16 k-pairs x cols rows x 2 at ((tile * K / 32) + j) * 32 cols elements; rows
// past M are 0.
std::vector<uint16_t> amx_pack_x(const uint16_t* x, int64_t M, int64_t K, int64_t cols) {
  const int64_t k_tiles = K / kAmxK, m_tiles = (M + cols - 1) / cols;
  std::vector<uint16_t> packed(m_tiles * k_tiles * kAmxK * cols, 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k)
      packed[((m / cols) * k_tiles + k / kAmxK) * kAmxK * cols + ((k % kAmxK) / 2) * 2 * cols + (m % cols) * 2 +
             k % 2] = x[m * K + k];
  return packed;
}

// T (1 or kAmxTilesOfW) tiles of 16 W rows from w against every tile of x's rows: the weight
// rows are AMX's A operand as they lie (16 rows of 32 bf16, K apart), x the packed B, so each
// accumulator holds y^T for 16 weight rows x cols rows of x; k-tiles are summed in order.
template <int T>
__attribute__((target("amx-tile,amx-bf16"))) void amx_tiles(const uint16_t* w, const uint16_t* xb, int64_t M,
                                                              int64_t K, int64_t cols, float* out, int64_t N) {
  const int64_t k_tiles = K / kAmxK, x_tile = kAmxK * cols, stride = 4 * cols;
  alignas(64) float acc[kAmxRows * kAmxRows];
  for (int64_t m0 = 0; m0 < M; m0 += cols) {
    const uint16_t* xm = xb + (m0 / cols) * k_tiles * x_tile;
    _tile_zero(0);
    if constexpr (T > 1) { _tile_zero(1); _tile_zero(2); _tile_zero(3); }
    for (int64_t j0 = 0; j0 < k_tiles; j0 += kAmxChunk) {
      const int64_t j1 = std::min(j0 + kAmxChunk, k_tiles);
      // accumulator ACC += W tile `row` (loaded into tile A) x x over k-tiles j0..j1; the tiles'
      // numbers are written into the instructions, so they are literals, not variables
#define CSD_AMX_SWEEP(ACC, A, row)                                      \
  for (int64_t j = j0; j < j1; ++j) {                                   \
    _tile_loadd(7, xm + j * x_tile, stride);                            \
    _tile_loadd(A, w + (row) * kAmxRows * K + j * kAmxK, K * 2);        \
    _tile_dpbf16ps(ACC, A, 7);                                          \
  }
      CSD_AMX_SWEEP(0, 5, 0)
      if constexpr (T > 1) {
        CSD_AMX_SWEEP(1, 6, 1)
        CSD_AMX_SWEEP(2, 5, 2)
        CSD_AMX_SWEEP(3, 6, 3)
      }
#undef CSD_AMX_SWEEP
    }
    const int64_t rows = std::min(cols, M - m0);
    for (int t = 0; t < T; ++t) {
      switch (t) {  // a tile's number must be a constant
        case 0: _tile_stored(0, acc, stride); break;
        case 1: _tile_stored(1, acc, stride); break;
        case 2: _tile_stored(2, acc, stride); break;
        default: _tile_stored(3, acc, stride); break;
      }
      for (int64_t n = 0; n < kAmxRows; ++n)
        for (int64_t m = 0; m < rows; ++m) out[(m0 + m) * N + t * kAmxRows + n] = acc[n * cols + m];
    }
  }
}

__attribute__((target("amx-tile,amx-bf16"))) void amx_load_config(const AmxConfig& config) {
  _tile_loadconfig(&config);
}

__attribute__((target("amx-tile"))) void amx_release() { _tile_release(); }

// [M, N] fp32 = x W^T for bf16 x and W with K % 32 == 0: AMX tiles for W's rows in whole tiles of
// 16, in parallel by groups of kAmxTilesOfW, the last N % 16 rows by rows_scalar.
at::Tensor matmul_amx(const at::Tensor& x, const uint16_t* wp, int64_t N, int64_t K) {
  const int64_t M = x.numel() / K;
  const int64_t cols = std::clamp<int64_t>(M, 1, kAmxRows);
  const AmxConfig config(cols);
  const at::Tensor xc = x.reshape({M, K}).contiguous();
  const std::vector<uint16_t> xb =
      amx_pack_x(reinterpret_cast<const uint16_t*>(xc.const_data_ptr<at::BFloat16>()), M, K, cols);
  at::Tensor acc = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* op = acc.mutable_data_ptr<float>();
  const int64_t tiles = N / kAmxRows, items = (tiles + kAmxTilesOfW - 1) / kAmxTilesOfW;
  at::parallel_for(0, items, 1, [&](int64_t lo, int64_t hi) {
    amx_load_config(config);  // the tile state is per thread
    for (int64_t item = lo; item < hi; ++item) {
      int64_t tile = item * kAmxTilesOfW;
      if (tile + kAmxTilesOfW <= tiles) {
        amx_tiles<kAmxTilesOfW>(wp + tile * kAmxRows * K, xb.data(), M, K, cols, op + tile * kAmxRows, N);
      } else {
        for (; tile < tiles; ++tile) amx_tiles<1>(wp + tile * kAmxRows * K, xb.data(), M, K, cols, op + tile * kAmxRows, N);
      }
    }
    amx_release();
  });
  if (tiles * kAmxRows < N) {
    const at::Tensor xf = xc.to(at::kFloat);
    for (int64_t n = tiles * kAmxRows; n < N; ++n)
      rows_scalar<16>(xf.const_data_ptr<float>(), wp + n * K, K, M, K, op + n, N);
  }
  return acc;
}
#endif

// [M, N] fp32 = x W^T for x [M, K] (any float dtype) and W [N, K] of element type W.
template <typename W>
at::Tensor matmul_f32(const at::Tensor& x, const W* wp, int64_t N, int64_t K) {
  const int64_t M = K ? x.numel() / K : 0;
  const at::Tensor xf = x.reshape({M, K}).to(at::kFloat).contiguous();  // small: M x K
  at::Tensor acc = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.const_data_ptr<float>();
  float* op = acc.mutable_data_ptr<float>();
  // x's rows in near-equal tiles of at most kRowsPerTile (7 = 4 + 3, not 6 + 1: a 1-row tile
  // does a sixth of the work per W chunk it widens).
  const int64_t tiles = (M + kRowsPerTile - 1) / kRowsPerTile;
  // Parallel over groups of kGroupRows W rows (a multiple of every tile's W rows); each task
  // sweeps every tile of x rows over its groups.
  const int64_t groups = (N + kGroupRows - 1) / kGroupRows;
  const Isa isa = cpu_isa();
  at::parallel_for(0, groups, 2, [&](int64_t lo, int64_t hi) {
    for (int64_t group = lo; group < hi; ++group) {
      const int64_t n0 = kGroupRows * group, n1 = std::min(n0 + kGroupRows, N);
      for (int64_t tile = 0, m0 = 0; tile < tiles; ++tile) {
        const int64_t rows = M / tiles + (tile < M % tiles);
        const float* xs = xp + m0 * K;
        float* out = op + m0 * N;
        m0 += rows;
        int64_t n = n0;
#ifdef CSD_X86
        if (isa >= Isa::kAvx512) {  // with or without AVX-512 BF16: fp32 FMAs ran as fast as vdpbf16ps on Zen 4
          for (const int64_t r = kTileRowsOfW512[rows]; n + r <= n1; n += r)
            kTiles512<W>[rows](xs, wp + n * K, K, K, out + n, N);
          for (; n < n1; ++n) rows_scalar<16>(xs, wp + n * K, K, rows, K, out + n, N);
        } else if (isa == Isa::kAvx2) {
          for (const int64_t r = kTileRowsOfW[rows]; n + r <= n1; n += r) kTiles<W>[rows](xs, wp + n * K, K, K, out + n, N);
        }
#endif
        for (; n < n1; ++n) rows_scalar<kLanes>(xs, wp + n * K, K, rows, K, out + n, N);
      }
    }
  });
  return acc;
}

void check_args(const char* op, const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_TYPE(x.scalar_type() == at::kBFloat16, op, ": x must be bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(weight.dim() == 2, op, ": weight must be 2-D [N, K], got ", weight.dim(), " dimensions");
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == weight.size(1), op, ": x's last dimension (",
                    x.dim() ? x.size(-1) : 0, ") must equal weight's K (", weight.size(1), ")");
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0), op, ": bias must be [N] = [",
                      weight.size(0), "]");
  }
}

at::Tensor finish(at::Tensor acc, const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  if (bias.has_value()) acc.add_(bias->to(at::kFloat));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = acc.size(1);
  return acc.to(at::kBFloat16).reshape(shape);
}

at::Tensor bf16_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_args("bf16_linear", x, weight, bias);
  TORCH_CHECK_TYPE(weight.scalar_type() == at::kBFloat16, "bf16_linear: weight must be bfloat16, got ",
                   weight.scalar_type());
  const at::Tensor w = weight.contiguous();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.const_data_ptr<at::BFloat16>());
#ifdef CSD_AMX
  if (cpu_isa() == Isa::kAmx && w.size(1) % kAmxK == 0 && w.size(1) > 0)
    return finish(matmul_amx(x, wp, w.size(0), w.size(1)), x, bias);
#endif
  return finish(matmul_f32(x, wp, w.size(0), w.size(1)), x, bias);
}

// y = (x q^T) * scale (+ bias): the per-row scale applied to the fp32 sum, as torch's _weight_int8pack_mm.
at::Tensor int8_linear_cpu(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                           const std::optional<at::Tensor>& bias) {
  check_args("int8_linear", x, q, bias);
  TORCH_CHECK_TYPE(q.scalar_type() == at::kChar, "int8_linear: weight must be int8, got ", q.scalar_type());
  TORCH_CHECK_VALUE(scale.dim() == 1 && scale.size(0) == q.size(0), "int8_linear: scale must be [N] = [",
                    q.size(0), "], got ", scale.sizes());
  const at::Tensor w = q.contiguous();
  at::Tensor acc = matmul_f32(x, w.const_data_ptr<int8_t>(), w.size(0), w.size(1));
  acc.mul_(scale.to(at::kFloat));
  return finish(std::move(acc), x, bias);
}

// The instruction set the CPU kernels run (cpu_isa.h), by its CSD_CPU_ISA name.
std::string cpu_isa_name() {
  switch (cpu_isa()) {
    case Isa::kAmx: return "amx";
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "baseline";
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(csd_engine, m) {
  m.def("cpu_isa() -> str", &cpu_isa_name);
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(csd_engine, CPU, m) {
  m.impl("bf16_linear", &bf16_linear_cpu);
  m.impl("int8_linear", &int8_linear_cpu);
}

}  // namespace csd_engine
