// Which x86 instruction set csd_engine's CPU kernels use: the best this CPU runs, or a lower one
// named by CSD_CPU_ISA ("baseline", "avx2", "avx512", "avx512_bf16": AVX-512 with its bf16 dot
// products), so that one machine can test every compiled variant. Decided at the first call,
// shared by every kernel file.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

namespace csd_engine {

enum class Isa { kBaseline, kAvx2, kAvx512, kAvx512Bf16 };

inline Isa cpu_isa() {
  static const Isa chosen = [] {
    Isa best = Isa::kBaseline;
#if defined(__x86_64__) || defined(_M_X64)
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Isa::kAvx2;
    if (best == Isa::kAvx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      best = Isa::kAvx512;
    if (best == Isa::kAvx512 && __builtin_cpu_supports("avx512bf16")) best = Isa::kAvx512Bf16;
#endif
    const char* forced = std::getenv("CSD_CPU_ISA");
    if (forced == nullptr || *forced == '\0') return best;
    const std::string name(forced);
    const Isa wanted = name == "baseline" ? Isa::kBaseline : name == "avx2" ? Isa::kAvx2
                       : name == "avx512" ? Isa::kAvx512 : Isa::kAvx512Bf16;
    TORCH_CHECK_VALUE((name == "baseline" || name == "avx2" || name == "avx512" || name == "avx512_bf16") &&
                          wanted <= best,
                      "CSD_CPU_ISA must name an instruction set this CPU runs (baseline",
                      best >= Isa::kAvx2 ? ", avx2" : "", best >= Isa::kAvx512 ? ", avx512" : "",
                      best == Isa::kAvx512Bf16 ? ", avx512_bf16" : "", "), got '", name, "'");
    return wanted;
  }();
  return chosen;
}

}  // namespace csd_engine
