// Instruction-set dispatch: which kernel table this CPU runs. Compiled once, with the baseline
// flags only (it runs before any choice is made).
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "attnlab/kernels.hpp"

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)
#define ATTNLAB_X86 1
#if defined(_MSC_VER) && !defined(__clang__)
#include <immintrin.h>
#include <intrin.h>
#else
#include <cpuid.h>
#endif
#endif

namespace attnlab {

// One table per variant built (CMake defines ATTNLAB_HAVE_ISA_<name> for each).
#if defined(ATTNLAB_HAVE_ISA_generic)
namespace isa_generic {
extern const KernelTable kernel_table;
}
#endif
#if defined(ATTNLAB_HAVE_ISA_avx2)
namespace isa_avx2 {
extern const KernelTable kernel_table;
}
#endif
#if defined(ATTNLAB_HAVE_ISA_avx512)
namespace isa_avx512 {
extern const KernelTable kernel_table;
}
#endif
#if defined(ATTNLAB_HAVE_ISA_native)
namespace isa_native {
extern const KernelTable kernel_table;
}
#endif

namespace detail {
namespace {

// Best first.
const KernelTable* const built_tables[] = {
#if defined(ATTNLAB_HAVE_ISA_native)
    &isa_native::kernel_table,
#endif
#if defined(ATTNLAB_HAVE_ISA_avx512)
    &isa_avx512::kernel_table,
#endif
#if defined(ATTNLAB_HAVE_ISA_avx2)
    &isa_avx2::kernel_table,
#endif
#if defined(ATTNLAB_HAVE_ISA_generic)
    &isa_generic::kernel_table,
#endif
};

const char* const known_isas = "generic, avx2, avx512, native";

struct Features {
    std::vector<std::pair<std::string, bool>> flags;
    bool has(const char* name) const {
        for (const auto& f : flags)
            if (f.first == name) return f.second;
        return false;
    }
};

#if defined(ATTNLAB_X86)
struct Regs {
    unsigned a = 0, b = 0, c = 0, d = 0;
};

Regs cpuid(unsigned leaf, unsigned sub) {
    Regs r;
#if defined(_MSC_VER) && !defined(__clang__)
    int v[4];
    __cpuidex(v, static_cast<int>(leaf), static_cast<int>(sub));
    r = {static_cast<unsigned>(v[0]), static_cast<unsigned>(v[1]), static_cast<unsigned>(v[2]),
         static_cast<unsigned>(v[3])};
#else
    __cpuid_count(leaf, sub, r.a, r.b, r.c, r.d);
#endif
    return r;
}

// XCR0: which register states the operating system saves on a context switch. Only called
// when cpuid reports OSXSAVE (otherwise XGETBV itself is an illegal instruction).
std::uint64_t xgetbv0() {
#if defined(_MSC_VER) && !defined(__clang__)
    return _xgetbv(0);
#else
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (static_cast<std::uint64_t>(hi) << 32) | lo;
#endif
}
#endif

Features detect() {
    Features f;
#if defined(ATTNLAB_X86)
    const unsigned max_leaf = cpuid(0, 0).a;
    const unsigned max_ext = cpuid(0x80000000u, 0).a;
    const Regs l1 = max_leaf >= 1 ? cpuid(1, 0) : Regs{};
    const Regs l7 = max_leaf >= 7 ? cpuid(7, 0) : Regs{};
    const Regs e1 = max_ext >= 0x80000001u ? cpuid(0x80000001u, 0) : Regs{};
    auto bit = [](unsigned reg, int b) { return ((reg >> b) & 1u) != 0; };
    const bool osxsave = bit(l1.c, 27);
    const std::uint64_t xcr0 = osxsave ? xgetbv0() : 0;
    // XMM and YMM state (bits 1, 2); opmask, ZMM_Hi256 and Hi16_ZMM state (bits 5-7).
    const bool os_avx = (xcr0 & 0x6) == 0x6;
    const bool os_avx512 = os_avx && (xcr0 & 0xE0) == 0xE0;
    f.flags = {
        {"sse2", bit(l1.d, 26)},     {"sse3", bit(l1.c, 0)},      {"ssse3", bit(l1.c, 9)},
        {"sse4_1", bit(l1.c, 19)},   {"sse4_2", bit(l1.c, 20)},   {"popcnt", bit(l1.c, 23)},
        {"cx16", bit(l1.c, 13)},     {"lahf_lm", bit(e1.c, 0)},   {"avx", bit(l1.c, 28)},
        {"avx2", bit(l7.b, 5)},      {"fma", bit(l1.c, 12)},      {"f16c", bit(l1.c, 29)},
        {"movbe", bit(l1.c, 22)},    {"bmi1", bit(l7.b, 3)},      {"bmi2", bit(l7.b, 8)},
        {"lzcnt", bit(e1.c, 5)},     {"avx512f", bit(l7.b, 16)},  {"avx512dq", bit(l7.b, 17)},
        {"avx512cd", bit(l7.b, 28)}, {"avx512bw", bit(l7.b, 30)}, {"avx512vl", bit(l7.b, 31)},
        {"os_avx", os_avx},          {"os_avx512", os_avx512},
    };
#elif defined(__aarch64__) || defined(_M_ARM64)
    f.flags = {{"neon", true}};  // Advanced SIMD is part of the aarch64 baseline
#endif
    return f;
}

const Features& features() {
    static const Features f = detect();
    return f;
}

// The x86-64 micro-architecture levels the variants are compiled for (-march=x86-64-v3/v4).
bool supports(const Features& f, const std::string& isa) {
    static const char* const v2[] = {"sse3",   "ssse3", "sse4_1", "sse4_2",
                                     "popcnt", "cx16",  "lahf_lm"};
    static const char* const v3[] = {"avx",  "avx2", "fma",   "f16c",  "movbe",
                                     "bmi1", "bmi2", "lzcnt", "os_avx"};
    static const char* const v4[] = {"avx512f",  "avx512dq", "avx512cd",
                                     "avx512bw", "avx512vl", "os_avx512"};
    auto all = [&f](const auto& names) {
        for (const char* n : names)
            if (!f.has(n)) return false;
        return true;
    };
    if (isa == "generic" || isa == "native") return true;  // native: runs where it was built
    if (isa == "avx2") return all(v2) && all(v3);
    if (isa == "avx512") return all(v2) && all(v3) && all(v4);
    return false;
}

const KernelTable* chosen = nullptr;

}  // namespace
}  // namespace detail

std::vector<std::pair<std::string, bool>> cpu_features() { return detail::features().flags; }

std::vector<std::string> built_isas() {
    std::vector<std::string> out;
    for (const KernelTable* t : detail::built_tables) out.emplace_back(t->isa);
    return out;
}

bool isa_supported(const std::string& isa) { return detail::supports(detail::features(), isa); }

CpuIdentity cpu_identity() {
    CpuIdentity id;
#if defined(ATTNLAB_X86)
    const detail::Regs v = detail::cpuid(0, 0);
    const unsigned words[3] = {v.b, v.d, v.c};
    for (unsigned w : words)
        for (int i = 0; i < 4; ++i) id.vendor += static_cast<char>((w >> (8 * i)) & 0xFFu);
    if (v.a >= 1) {
        const unsigned a = detail::cpuid(1, 0).a;
        const unsigned base_family = (a >> 8) & 0xFu, base_model = (a >> 4) & 0xFu;
        // the extended fields count only where the base family says so (Intel SDM, AMD APM)
        id.family = base_family == 0xFu ? base_family + ((a >> 20) & 0xFFu) : base_family;
        id.model = base_family == 0xFu || base_family == 0x6u
                       ? base_model + (((a >> 16) & 0xFu) << 4)
                       : base_model;
    }
#endif
    return id;
}

std::size_t l2_cache_bytes() {
#if defined(ATTNLAB_X86)
    static const std::size_t bytes = [] {
        if (detail::cpuid(0x80000000u, 0).a < 0x80000006u) return std::size_t(0);
        return static_cast<std::size_t>(detail::cpuid(0x80000006u, 0).c >> 16) * 1024;  // KiB
    }();
    return bytes;
#else
    return 0;
#endif
}

const KernelTable& select_kernels(const char* forced) {
    using detail::built_tables;
    const std::string want = forced ? forced : "";
    std::string name;
    for (char c : want)
        if (c != ' ' && c != '\t' && c != '\n')
            name += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (!name.empty()) {
        const std::string known = detail::known_isas;
        if (name != "generic" && name != "avx2" && name != "avx512" && name != "native")
            throw std::runtime_error("ATTNLAB_ISA='" + want + "': expected one of " + known);
        if (!isa_supported(name))
            throw std::runtime_error("ATTNLAB_ISA='" + name +
                                     "': this CPU (or its operating system) does not support it");
        for (const KernelTable* t : built_tables)
            if (name == t->isa) return *(detail::chosen = t);
        std::string built;
        for (const auto& b : built_isas()) built += (built.empty() ? "" : ", ") + b;
        throw std::runtime_error("ATTNLAB_ISA='" + name +
                                 "': that variant was not built (built: " + built + ")");
    }
    for (const KernelTable* t : built_tables)  // best first; native only when asked at build
        if (isa_supported(t->isa)) return *(detail::chosen = t);
    throw std::runtime_error("attnlab: no kernel variant built that this CPU supports");
}

const KernelTable& kernels() {
    if (!detail::chosen) throw std::logic_error("attnlab: kernels used before select_kernels");
    return *detail::chosen;
}

}  // namespace attnlab
