// The FMA peak kernel (see attnlab/peak.hpp), compiled once per instruction set like every
// kernel source, so each variant measures its own widest vector: 16 floats with AVX-512, 8 with
// AVX2 + FMA, 4 with the x86-64 baseline (SSE2 has no FMA: a multiply and an add, still two
// flops) and NEON.
#include "attnlab/peak.hpp"

#include <algorithm>
#include <chrono>
#include <vector>
#if defined(__unix__) || defined(__APPLE__)
#include <time.h>
#endif

#include "attnlab/threading.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp

namespace {

using Packet = Eigen::internal::packet_traits<float>::type;
constexpr Index kLanes = Eigen::internal::packet_traits<float>::size;
// Independent chains: an FMA has a latency of 4-5 cycles and 2 issue ports on current x86
// cores, so 8-10 chains are in flight at once; 12 leave slack and still fit in 16 registers
// with the two operands (AVX2 and SSE2 have 16 vector registers, AVX-512 32).
constexpr int kFmaChains = 12;
// Multiply-adds per chain between two looks at the clock: fine-grained enough for the deadline,
// long enough that reading the clock costs nothing.
constexpr Index kStepsPerCheck = 20000;

// acc = acc * a + b on every chain, `steps` times. Not inlined: one loop the disassembly shows
// (objdump -d | grep vfmadd). The operands are read from volatiles by the caller and the
// results are used, so the compiler can neither fold the chains nor drop them (and without
// -ffast-math it may not reassociate them).
template <int Chains>
EIGEN_DONT_INLINE void fma_chains(Packet* acc, Packet a, Packet b, Index steps) {
    Packet r[Chains];
    for (int c = 0; c < Chains; ++c) r[c] = acc[c];
    for (Index s = 0; s < steps; ++s) {
        for (int c = 0; c < Chains; ++c) r[c] = Eigen::internal::pmadd(r[c], a, b);
    }
    for (int c = 0; c < Chains; ++c) acc[c] = r[c];
}

// CPU seconds the calling thread has run, or -1 where there is no per-thread clock. On a shared
// machine a thread is descheduled for part of its wall time; flops per CPU second are what its
// core can do, whatever else runs.
double thread_cpu_seconds() {
#if defined(CLOCK_THREAD_CPUTIME_ID)
    timespec ts{};
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0)
        return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
#endif
    return -1.0;
}

}  // namespace

double fma_peak(double seconds, double* per_task, double* per_task_cpu, Index tasks) {
    using Clock = std::chrono::steady_clock;
    tasks = std::max<Index>(tasks, 1);
    // One deadline for all tasks: a task a busy thread starts late still stops with the others,
    // so the flops all count over the same wall time.
    const auto start = Clock::now();
    const auto deadline = start + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(std::max(seconds, 0.0)));
    std::vector<double> flops(static_cast<std::size_t>(tasks), 0.0);
    std::vector<float> sink(static_cast<std::size_t>(tasks), 0.0f);
    parallel_for(tasks, [&](std::int64_t t) {
        // a < 1 and b > 0: each chain converges to b / (1 - a) = 1000, never overflowing or
        // reaching subnormals (which would slow some cores down).
        volatile float va = 0.999999f, vb = 0.001f;
        const float fa = va, fb = vb;
        const Packet a = Eigen::internal::pset1<Packet>(fa);
        const Packet b = Eigen::internal::pset1<Packet>(fb);
        Packet acc[kFmaChains];
        for (int c = 0; c < kFmaChains; ++c) {
            acc[c] = Eigen::internal::pset1<Packet>(static_cast<float>(c + t));
        }
        const auto t0 = Clock::now();
        const double cpu0 = thread_cpu_seconds();
        auto now = t0;
        Index steps = 0;
        do {  // at least one block, so every task reports a rate
            fma_chains<kFmaChains>(acc, a, b, kStepsPerCheck);
            steps += kStepsPerCheck;
            now = Clock::now();
        } while (now < deadline);
        const double secs = std::chrono::duration<double>(now - t0).count();
        const double cpu = cpu0 >= 0 ? thread_cpu_seconds() - cpu0 : -1.0;
        const double f =
            2.0 * static_cast<double>(kLanes) * kFmaChains * static_cast<double>(steps);
        flops[static_cast<std::size_t>(t)] = f;
        per_task[t] = secs > 0 ? f / secs * 1e-9 : 0.0;
        per_task_cpu[t] = cpu > 0 ? f / cpu * 1e-9 : 0.0;
        Packet total = acc[0];
        for (int c = 1; c < kFmaChains; ++c) total = Eigen::internal::padd(total, acc[c]);
        sink[static_cast<std::size_t>(t)] = Eigen::internal::predux(total);
    });
    const double wall = std::chrono::duration<double>(Clock::now() - start).count();
    double all = 0.0;
    for (double f : flops) all += f;
    // The chains' results are used (a NaN would mean broken arithmetic): the loops stay live.
    float check = 0.0f;
    for (float s : sink) check += s;
    if (!(check == check)) return 0.0;
    return wall > 0 ? all / wall * 1e-9 : 0.0;
}

}  // namespace attnlab::ATTNLAB_ISA_NS
