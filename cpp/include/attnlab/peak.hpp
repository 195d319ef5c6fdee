#pragma once
// The machine's floating-point peak, measured: independent FMA chains in the widest vector of
// the build, on every pool thread at once. It is the denominator of the benchmark's "share of
// peak" figures, so it is measured by code that does nothing else (a GEMM rate would be a
// lower bound that a better GEMM can exceed).

#include "attnlab/common.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp

// Runs `tasks` parallel_for tasks (one per pool thread when tasks == get_num_threads()), each
// looping over 12 independent float multiply-add chains until `seconds` have passed since the
// call began. Writes each task's GFLOP/s (2 flops per lane per multiply-add) over its own wall
// time to per_task[0, tasks), and over the CPU time its thread ran to per_task_cpu (0 where the
// system has no per-thread CPU clock: the rate of its core even when other processes share it);
// returns the whole machine's GFLOP/s: all tasks' flops over the wall time of the call. Float32
// only (the benchmarks' precision).
double fma_peak(double seconds, double* per_task, double* per_task_cpu, Index tasks);

}  // namespace attnlab::ATTNLAB_ISA_NS
