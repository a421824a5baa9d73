// Which x86 instruction set csd_engine's CPU kernels use: the best this CPU runs, or a lower one
// named by CSD_CPU_ISA ("baseline", "avx2", "avx512", "avx512_bf16": AVX-512 with its bf16 dot
// products, "amx": with AMX's bf16 tiles too), so that one machine can test every compiled
// variant. Decided at the first call, shared by every kernel file. AMX counts only where Linux
// grants this process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM), which it asks for here.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

#if defined(__linux__) && (defined(__x86_64__) || defined(_M_X64))
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace csd_engine {

enum class Isa { kBaseline, kAvx2, kAvx512, kAvx512Bf16, kAmx };

// Whether this compiler has the AMX intrinsics (GCC 11, clang 12).
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define CSD_AMX 1
#endif

// AMX's bf16 tiles, usable by this process: the CPU has them and Linux lets it use their state.
inline bool amx_usable() {
#ifdef CSD_AMX
  if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

inline Isa cpu_isa() {
  static const Isa chosen = [] {
    Isa best = Isa::kBaseline;
#if defined(__x86_64__) || defined(_M_X64)
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Isa::kAvx2;
    if (best == Isa::kAvx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      best = Isa::kAvx512;
    if (best == Isa::kAvx512 && __builtin_cpu_supports("avx512bf16")) best = Isa::kAvx512Bf16;
    if (best == Isa::kAvx512Bf16 && amx_usable()) best = Isa::kAmx;
#endif
    const char* forced = std::getenv("CSD_CPU_ISA");
    if (forced == nullptr || *forced == '\0') return best;
    const std::string name(forced);
    const Isa wanted = name == "baseline" ? Isa::kBaseline : name == "avx2" ? Isa::kAvx2
                       : name == "avx512" ? Isa::kAvx512 : name == "avx512_bf16" ? Isa::kAvx512Bf16 : Isa::kAmx;
    TORCH_CHECK_VALUE((name == "baseline" || name == "avx2" || name == "avx512" || name == "avx512_bf16" ||
                       name == "amx") && wanted <= best,
                      "CSD_CPU_ISA must name an instruction set this CPU runs (baseline",
                      best >= Isa::kAvx2 ? ", avx2" : "", best >= Isa::kAvx512 ? ", avx512" : "",
                      best >= Isa::kAvx512Bf16 ? ", avx512_bf16" : "", best == Isa::kAmx ? ", amx" : "", "), got '",
                      name, "'");
    return wanted;
  }();
  return chosen;
}

}  // namespace csd_engine
