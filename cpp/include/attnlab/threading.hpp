#pragma once
// A small persistent thread pool. Each parallel_for call splits [0, n) into tasks that are
// independent by construction, so results never depend on the thread count or on scheduling.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace attnlab {

// Upper bound of set_num_threads and ATTNLAB_NUM_THREADS.
constexpr int kMaxThreads = 1024;

// Number of threads kernels use (the calling thread included). Default: ATTNLAB_NUM_THREADS
// when set (1..kMaxThreads), else the CPUs in this process's affinity mask, further limited by
// a cgroup CPU quota when one is set.
int get_num_threads();
// Clamped to [1, kMaxThreads]. If the operating system refuses to start some of the threads,
// the pool runs with those it got (get_num_threads() then reports them) instead of failing.
void set_num_threads(int n);
// Where get_num_threads() came from: "ATTNLAB_NUM_THREADS", "sched_getaffinity",
// "cgroup cpu quota", "hardware_concurrency", "set_num_threads", with a note when it was
// reduced because threads could not be started.
std::string num_threads_source();

// Calls fn(i) for every i in [0, n), on up to get_num_threads() threads. The caller participates.
// Safe to call concurrently from several threads; not meant to be nested. A child process
// created by fork() gets a fresh pool on first use (the parent's worker threads do not exist
// there) and exits normally.
void parallel_for(std::int64_t n, const std::function<void(std::int64_t)>& fn);

// Copies bytes[i] bytes from src[i] to dst[i] for i < count (non-overlapping blocks) on the
// pool, in chunks: attnlab.vjp's copies of its arguments, which one thread alone copied while
// the others waited.
void parallel_copy(const void* const* src, void* const* dst, const std::size_t* bytes,
                   std::size_t count);

namespace detail {
// CPU limit of a cgroup (v2 cpu.max, or v1 cpu.cfs_quota_us / cpu.cfs_period_us), rounded up,
// over this process's cgroup and its ancestors; 0 when none is set. Paths are read under
// `sysroot` (empty for the real system; tests pass a fake tree).
int cgroup_cpu_limit(const std::string& sysroot);
}  // namespace detail

}  // namespace attnlab
