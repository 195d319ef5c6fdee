#pragma once
// A small persistent thread pool. Each parallel_for call splits [0, n) into tasks that are
// independent by construction, so results never depend on the thread count or on scheduling.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
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
// there) and exits normally. When the calling thread's InterruptPoll asks to stop (checked
// between tasks and while waiting for the last ones), the tasks not yet started are skipped, the
// running ones finish (or stop at an interruption_point) and Interrupted is thrown.
void parallel_for(std::int64_t n, const std::function<void(std::int64_t)>& fn);

// Thrown out of a kernel call whose InterruptPoll asked to stop. The outputs are then partly
// written and must not be used; every buffer of the call is freed by the unwinding.
class Interrupted : public std::exception {
  public:
    const char* what() const noexcept override;
};

// While alive, lets the calling thread's kernel calls be interrupted: parallel_for and
// interruption_point call poll(context) on this thread, at most once per kInterruptPollInterval
// and never within the first interval (shorter calls never poll), and throw Interrupted once it
// returned true. poll == nullptr: no effect. This is how the Python bindings check for signals
// (the core itself never touches Python); a poll that runs on the calling thread only needs no
// locking of its own. Scopes nest (the innermost one polls).
class InterruptPoll {
  public:
    using Fn = bool (*)(void* context);
    InterruptPoll(Fn poll, void* context);
    ~InterruptPoll();
    InterruptPoll(const InterruptPoll&) = delete;
    InterruptPoll& operator=(const InterruptPoll&) = delete;
    // Polls when due; whether a stop was asked (then it stays asked).
    bool stop_requested();
    bool stopped() const { return stopped_; }

  private:
    Fn poll_;
    void* context_;
    std::chrono::steady_clock::time_point next_{};
    bool stopped_ = false;
    InterruptPoll* outer_ = nullptr;  // the enclosing scope of this thread, restored at exit
    void* outer_job_ = nullptr;       // the parallel_for job this thread was running a task of
};
constexpr auto kInterruptPollInterval = std::chrono::milliseconds(50);

// For a long stretch of work inside one parallel_for task (the tasks of a few kernels scale
// with n^2): throws Interrupted when the call is being interrupted (on a worker: another thread
// asked to stop; on the calling thread: it also polls, as parallel_for does). Costs a
// thread-local read and an atomic load on workers, a clock read on the calling thread.
void interruption_point();

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
