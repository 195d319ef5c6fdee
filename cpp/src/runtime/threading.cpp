#include "attnlab/threading.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#endif

namespace attnlab {
namespace detail {

struct Job {
    const std::function<void(std::int64_t)>* fn;
    std::int64_t n;
    std::atomic<std::int64_t> next{0};
    std::atomic<std::int64_t> done{0};
    std::atomic<bool> cancelled{false};  // tasks not yet started are skipped
    std::exception_ptr error;
    std::mutex error_mutex;
    std::mutex done_mutex;
    std::condition_variable done_cv;
};

// How long a thread polls before it sleeps, waiting for work (a worker) or for the last task
// of its job (the caller). The parallel regions of one call (three projections, the attention,
// the output projection) follow each other within microseconds, and the next call from Python
// comes soon after; sleeping in between makes both slower than polling (docs/performance.md,
// kSpin). Short, so that an idle pool does not keep cores busy (other runtimes' threads that
// spin for milliseconds slow whatever runs next).
constexpr auto kSpin = std::chrono::microseconds(100);

// Polls `ready` until it holds or kSpin has passed; whether it held.
template <typename F>
static bool spin_until(F ready) {
    const auto deadline = std::chrono::steady_clock::now() + kSpin;
    for (int i = 0;; ++i) {
        if (ready()) return true;
        if ((i & 63) == 63 && std::chrono::steady_clock::now() > deadline) return ready();
        std::this_thread::yield();
    }
}

// The innermost InterruptPoll of this thread (null: not interruptible), and the job whose task
// this thread is running (for interruption_point).
static thread_local InterruptPoll* tl_poll = nullptr;
static thread_local Job* tl_job = nullptr;

static void count_done(Job& job, std::int64_t count) {
    if (job.done.fetch_add(count) + count == job.n) {
        std::lock_guard<std::mutex> lock(job.done_mutex);
        job.done_cv.notify_all();
    }
}

// Stops handing out the tasks of `job` not yet started and counts them as done.
static void cancel(Job& job) {
    job.cancelled.store(true);
    const std::int64_t first = job.next.exchange(job.n);  // tasks from here on are nobody's
    if (first < job.n) count_done(job, job.n - first);
}

// Runs tasks of `job` until none is left. `poll`: the calling thread's, null on workers; asked
// before each task (it polls only when due).
static void work_on(Job& job, InterruptPoll* poll) {
    for (;;) {
        if (poll && poll->stop_requested()) cancel(job);
        const std::int64_t i = job.next.fetch_add(1);
        if (i >= job.n) return;
        Job* const outer = tl_job;
        tl_job = &job;
        try {
            (*job.fn)(i);
        } catch (...) {
            {
                std::lock_guard<std::mutex> lock(job.error_mutex);
                if (!job.error) job.error = std::current_exception();
            }
            cancel(job);  // the call fails anyway: the other tasks need not run
        }
        tl_job = outer;
        count_done(job, 1);
    }
}

class ThreadPool {
  public:
    // Starts up to `workers` threads. When the system refuses one (std::system_error under a
    // process or memory limit), the pool keeps those already running: destroying a joinable
    // std::thread would call std::terminate.
    explicit ThreadPool(int workers) {
        threads_.reserve(static_cast<std::size_t>(workers));
        for (int i = 0; i < workers; ++i) {
            try {
                threads_.emplace_back([this] { loop(); });
            } catch (...) {
                break;
            }
        }
    }
    ~ThreadPool() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stop_ = true;
        }
        cv_.notify_all();
        for (auto& t : threads_) t.join();
    }
    int workers() const { return static_cast<int>(threads_.size()); }
    void submit(const std::shared_ptr<Job>& job) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            queue_.push_back(job);
            queued_.fetch_add(1, std::memory_order_release);
        }
        cv_.notify_all();
    }

  private:
    void loop() {
        for (;;) {
            std::shared_ptr<Job> job;
            // poll before sleeping (kSpin): a job submitted meanwhile starts without a wake-up
            spin_until([this] { return queued_.load(std::memory_order_acquire) > 0; });
            {
                std::unique_lock<std::mutex> lock(mutex_);
                cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
                if (stop_) return;
                job = queue_.front();
                if (job->next.load() >= job->n) {
                    queue_.pop_front();  // exhausted: its owner waits for stragglers itself
                    queued_.fetch_sub(1, std::memory_order_release);
                    continue;
                }
            }
            work_on(*job, nullptr);
        }
    }

    std::vector<std::thread> threads_;
    std::deque<std::shared_ptr<Job>> queue_;
    std::mutex mutex_;
    std::condition_variable cv_;
    std::atomic<std::int64_t> queued_{0};  // queue_.size(), readable without the lock
    bool stop_ = false;
};

// --- default thread count

static bool read_file(const std::string& path, std::string& out) {
    std::ifstream f(path);
    if (!f) return false;
    std::ostringstream s;
    s << f.rdbuf();
    out = s.str();
    return true;
}

static std::vector<std::string> split(const std::string& s, char sep) {
    std::vector<std::string> parts;
    std::string item;
    std::istringstream in(s);
    while (std::getline(in, item, sep)) parts.push_back(item);
    return parts;
}

static int ceil_ratio(long long quota, long long period) {
    if (quota <= 0 || period <= 0) return 0;
    const long long n = (quota + period - 1) / period;
    return static_cast<int>(std::min<long long>(std::max<long long>(n, 1), kMaxThreads));
}

// Limit set in one cgroup directory, 0 for none.
static int cgroup_dir_limit(const std::string& dir, bool v2) {
    std::string text;
    if (v2) {
        if (!read_file(dir + "/cpu.max", text)) return 0;
        std::istringstream in(text);
        std::string quota;
        long long period = 0;
        in >> quota >> period;
        if (quota == "max" || quota.empty()) return 0;
        return ceil_ratio(std::atoll(quota.c_str()), period);
    }
    std::string period;
    if (!read_file(dir + "/cpu.cfs_quota_us", text) ||
        !read_file(dir + "/cpu.cfs_period_us", period))
        return 0;
    return ceil_ratio(std::atoll(text.c_str()), std::atoll(period.c_str()));
}

int cgroup_cpu_limit(const std::string& sysroot) {
    std::string self, mountinfo;
    if (!read_file(sysroot + "/proc/self/cgroup", self) ||
        !read_file(sysroot + "/proc/self/mountinfo", mountinfo))
        return 0;
    int best = 0;
    for (const std::string& line : split(mountinfo, '\n')) {
        // id parent major:minor root mount-point options [optional...] - fstype source super
        std::istringstream in(line);
        std::vector<std::string> f;
        for (std::string w; in >> w;) f.push_back(w);
        auto dash = std::find(f.begin(), f.end(), "-");
        if (f.size() < 5 || dash == f.end() || dash + 3 > f.end()) continue;
        const std::string& fstype = *(dash + 1);
        const bool v2 = fstype == "cgroup2";
        if (!v2 && !(fstype == "cgroup" && [&] {
                for (const auto& o : split(*(dash + 3), ','))
                    if (o == "cpu") return true;
                return false;
            }()))
            continue;
        // this process's path in that hierarchy
        std::string path;
        bool found = false;
        for (const std::string& c : split(self, '\n')) {
            const auto a = c.find(':'), b = a == std::string::npos ? a : c.find(':', a + 1);
            if (b == std::string::npos) continue;
            const std::string controllers = c.substr(a + 1, b - a - 1);
            bool match = v2 ? controllers.empty() : false;
            if (!v2)
                for (const auto& o : split(controllers, ','))
                    if (o == "cpu") match = true;
            if (match) {
                path = c.substr(b + 1);
                found = true;
                break;
            }
        }
        if (!found) continue;
        const std::string& root = f[3];
        const std::string mount = sysroot + f[4];
        if (root != "/" && path.compare(0, root.size(), root) == 0) path = path.substr(root.size());
        if (root != "/" && path == root) path.clear();
        // the cgroup and each ancestor up to the mount point: the tightest quota wins
        for (;;) {
            const int lim = cgroup_dir_limit(mount + (path == "/" ? "" : path), v2);
            if (lim > 0 && (best == 0 || lim < best)) best = lim;
            if (path.empty() || path == "/") break;
            path = path.substr(0, path.find_last_of('/'));
        }
    }
    return best;
}

struct ThreadDefault {
    int n;
    std::string source;
};

static ThreadDefault default_threads() {
    std::string note;
    if (const char* env = std::getenv("ATTNLAB_NUM_THREADS")) {
        char* end = nullptr;
        const long v = std::strtol(env, &end, 10);
        if (end != env && *end == '\0' && v >= 1 && v <= kMaxThreads)
            return {static_cast<int>(v), "ATTNLAB_NUM_THREADS"};
        note = std::string(" (ATTNLAB_NUM_THREADS='") + env + "' ignored: expected 1.." +
               std::to_string(kMaxThreads) + ")";
    }
    ThreadDefault d{0, "sched_getaffinity"};
#if defined(__linux__)
    // CPU_COUNT over a set large enough for any machine (the fixed cpu_set_t has 1024 bits)
    for (int cpus = 1024; cpus <= (1 << 16) && d.n == 0; cpus *= 2) {
        cpu_set_t* set = CPU_ALLOC(cpus);
        if (!set) break;
        const std::size_t size = CPU_ALLOC_SIZE(cpus);
        CPU_ZERO_S(size, set);
        if (sched_getaffinity(0, size, set) == 0) d.n = CPU_COUNT_S(size, set);
        CPU_FREE(set);
    }
#endif
    if (d.n <= 0) {
        const unsigned hc = std::thread::hardware_concurrency();
        d = {hc == 0 ? 1 : static_cast<int>(hc), "hardware_concurrency"};
    }
    const int quota = cgroup_cpu_limit("");
    if (quota > 0 && quota < d.n) d = {quota, "cgroup cpu quota"};
    d.n = std::min(d.n, kMaxThreads);
    d.source += note;
    return d;
}

static std::mutex g_pool_mutex;
static int g_num_threads = 0;  // 0: not read yet
static std::string g_source;
static std::shared_ptr<ThreadPool> g_pool;

static void ensure_default_locked() {
    if (g_num_threads > 0) return;
    ThreadDefault d = default_threads();
    g_num_threads = d.n;
    g_source = d.source;
}

// The pool for the current thread count, started on first use. Returns null when the calls
// should run serially (one thread, or no worker could be started).
static std::shared_ptr<ThreadPool> pool_for_locked() {
    if (g_num_threads <= 1) return nullptr;
    if (!g_pool) {
        g_pool = std::make_shared<ThreadPool>(g_num_threads - 1);
        const int started = g_pool->workers() + 1;
        if (started < g_num_threads) {
            g_source += " (reduced from " + std::to_string(g_num_threads) +
                        ": the system refused to start more threads)";
            g_num_threads = started;
        }
        if (g_pool->workers() == 0) g_pool.reset();
    }
    return g_pool;
}

#if defined(__unix__) || defined(__APPLE__)
// fork() copies only the calling thread: in the child the pool's workers do not exist, and
// joining them (when the pool is replaced or at exit) would wait forever. The child therefore
// drops the inherited pool without destroying it (a small, deliberate leak) and starts a new one
// on first use. The lock is held across fork so that the child never inherits it locked.
static void atfork_prepare() { g_pool_mutex.lock(); }
static void atfork_parent() { g_pool_mutex.unlock(); }
static void atfork_child() {
    new std::shared_ptr<ThreadPool>(std::move(g_pool));  // leaked on purpose, see above
    g_pool_mutex.unlock();
}
[[maybe_unused]] static const int g_atfork_registered =
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
#endif

}  // namespace detail

int get_num_threads() {
    std::lock_guard<std::mutex> lock(detail::g_pool_mutex);
    detail::ensure_default_locked();
    return detail::g_num_threads;
}

std::string num_threads_source() {
    std::lock_guard<std::mutex> lock(detail::g_pool_mutex);
    detail::ensure_default_locked();
    return detail::g_source;
}

void set_num_threads(int n) {
    n = std::clamp(n, 1, kMaxThreads);
    std::shared_ptr<detail::ThreadPool> old;
    {
        std::lock_guard<std::mutex> lock(detail::g_pool_mutex);
        detail::ensure_default_locked();
        detail::g_source = "set_num_threads";
        if (n == detail::g_num_threads) return;
        detail::g_num_threads = n;
        old.swap(detail::g_pool);  // calls in flight keep their own reference
    }
}

const char* Interrupted::what() const noexcept { return "attnlab: the call was interrupted"; }

InterruptPoll::InterruptPoll(Fn poll, void* context) : poll_(poll), context_(context) {
    if (!poll_) return;
    next_ = std::chrono::steady_clock::now() + kInterruptPollInterval;
    outer_ = detail::tl_poll;
    outer_job_ = detail::tl_job;
    detail::tl_poll = this;
    detail::tl_job = nullptr;  // a call made from inside a task (a signal handler) is its own
}

InterruptPoll::~InterruptPoll() {
    if (!poll_) return;
    detail::tl_poll = outer_;
    detail::tl_job = static_cast<detail::Job*>(outer_job_);
}

bool InterruptPoll::stop_requested() {
    if (stopped_) return true;
    if (!poll_ || std::chrono::steady_clock::now() < next_) return false;
    stopped_ = poll_(context_);
    next_ = std::chrono::steady_clock::now() + kInterruptPollInterval;  // the poll's own time aside
    return stopped_;
}

void interruption_point() {
    detail::Job* const job = detail::tl_job;
    if (job && job->cancelled.load(std::memory_order_relaxed)) throw Interrupted();
    InterruptPoll* const poll = detail::tl_poll;
    if (poll && poll->stop_requested()) {
        if (job) detail::cancel(*job);
        throw Interrupted();
    }
}

void parallel_for(std::int64_t n, const std::function<void(std::int64_t)>& fn) {
    if (n <= 0) return;
    InterruptPoll* const poll = detail::tl_poll;
    std::shared_ptr<detail::ThreadPool> pool;
    if (n > 1) {
        std::lock_guard<std::mutex> lock(detail::g_pool_mutex);
        detail::ensure_default_locked();
        pool = detail::pool_for_locked();
    }
    if (!pool) {
        for (std::int64_t i = 0; i < n; ++i) {
            if (poll && poll->stop_requested()) throw Interrupted();
            fn(i);
        }
        return;
    }
    auto job = std::make_shared<detail::Job>();
    job->fn = &fn;
    job->n = n;
    pool->submit(job);
    detail::work_on(*job, poll);
    const auto finished = [&] { return job->done.load() >= job->n; };
    if (!detail::spin_until(finished)) {
        std::unique_lock<std::mutex> lock(job->done_mutex);
        if (!poll) {
            job->done_cv.wait(lock, finished);
        } else {
            // the last tasks may be long: keep polling, without the lock (the poll may block)
            while (!job->done_cv.wait_for(lock, kInterruptPollInterval, finished)) {
                lock.unlock();
                if (!job->cancelled.load() && poll->stop_requested()) detail::cancel(*job);
                lock.lock();
            }
        }
    }
    if (poll && poll->stopped()) throw Interrupted();  // the interrupt over the tasks' errors
    if (job->error) std::rethrow_exception(job->error);
}

void parallel_copy(const void* const* src, void* const* dst, const std::size_t* bytes,
                   std::size_t count) {
    constexpr std::size_t kChunk = std::size_t(256) << 10;  // large enough to stream
    std::vector<std::size_t> first(count + 1, 0);           // first chunk of each block
    for (std::size_t i = 0; i < count; ++i)
        first[i + 1] = first[i] + (bytes[i] + kChunk - 1) / kChunk;
    parallel_for(static_cast<std::int64_t>(first[count]), [&](std::int64_t t) {
        const auto c = static_cast<std::size_t>(t);
        const std::size_t i = static_cast<std::size_t>(
                                  std::upper_bound(first.begin(), first.end(), c) - first.begin()) -
                              1;
        const std::size_t off = (c - first[i]) * kChunk;
        std::memcpy(static_cast<char*>(dst[i]) + off, static_cast<const char*>(src[i]) + off,
                    std::min(kChunk, bytes[i] - off));
    });
}

}  // namespace attnlab
