#include "attnlab/threading.hpp"

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace attnlab {
namespace detail {

struct Job {
    const std::function<void(std::int64_t)>* fn;
    std::int64_t n;
    std::atomic<std::int64_t> next{0};
    std::atomic<std::int64_t> done{0};
    std::exception_ptr error;
    std::mutex error_mutex;
    std::mutex done_mutex;
    std::condition_variable done_cv;
};

// Runs tasks of `job` until none is left; returns true if it finished the last one.
static void work_on(Job& job) {
    for (;;) {
        std::int64_t i = job.next.fetch_add(1);
        if (i >= job.n) return;
        try {
            (*job.fn)(i);
        } catch (...) {
            std::lock_guard<std::mutex> lock(job.error_mutex);
            if (!job.error) job.error = std::current_exception();
        }
        if (job.done.fetch_add(1) + 1 == job.n) {
            std::lock_guard<std::mutex> lock(job.done_mutex);
            job.done_cv.notify_all();
        }
    }
}

class ThreadPool {
public:
    explicit ThreadPool(int workers) {
        for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { loop(); });
    }
    ~ThreadPool() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stop_ = true;
        }
        cv_.notify_all();
        for (auto& t : threads_) t.join();
    }
    void submit(const std::shared_ptr<Job>& job) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            queue_.push_back(job);
        }
        cv_.notify_all();
    }

private:
    void loop() {
        for (;;) {
            std::shared_ptr<Job> job;
            {
                std::unique_lock<std::mutex> lock(mutex_);
                cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
                if (stop_) return;
                job = queue_.front();
                if (job->next.load() >= job->n) {
                    queue_.pop_front();  // exhausted: its owner waits for stragglers itself
                    continue;
                }
            }
            work_on(*job);
        }
    }

    std::vector<std::thread> threads_;
    std::deque<std::shared_ptr<Job>> queue_;
    std::mutex mutex_;
    std::condition_variable cv_;
    bool stop_ = false;
};

static int default_threads() {
    if (const char* env = std::getenv("ATTNLAB_NUM_THREADS")) {
        char* end = nullptr;
        long v = std::strtol(env, &end, 10);
        if (end != env && v >= 1 && v <= 1024) return static_cast<int>(v);
    }
    unsigned hc = std::thread::hardware_concurrency();
    return hc == 0 ? 1 : static_cast<int>(hc);
}

static std::mutex g_pool_mutex;
static int g_num_threads = default_threads();
static std::shared_ptr<ThreadPool> g_pool;

static std::shared_ptr<ThreadPool> pool_for(int threads) {
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    if (threads <= 1) return nullptr;
    if (!g_pool) g_pool = std::make_shared<ThreadPool>(threads - 1);
    return g_pool;
}

}  // namespace detail

int get_num_threads() {
    std::lock_guard<std::mutex> lock(detail::g_pool_mutex);
    return detail::g_num_threads;
}

void set_num_threads(int n) {
    if (n < 1) n = 1;
    std::shared_ptr<detail::ThreadPool> old;
    {
        std::lock_guard<std::mutex> lock(detail::g_pool_mutex);
        if (n == detail::g_num_threads) return;
        detail::g_num_threads = n;
        old.swap(detail::g_pool);  // calls in flight keep their own reference
    }
}

void parallel_for(std::int64_t n, const std::function<void(std::int64_t)>& fn) {
    if (n <= 0) return;
    const int threads = get_num_threads();
    if (threads <= 1 || n == 1) {
        for (std::int64_t i = 0; i < n; ++i) fn(i);
        return;
    }
    auto pool = detail::pool_for(threads);
    auto job = std::make_shared<detail::Job>();
    job->fn = &fn;
    job->n = n;
    pool->submit(job);
    detail::work_on(*job);
    {
        std::unique_lock<std::mutex> lock(job->done_mutex);
        job->done_cv.wait(lock, [&] { return job->done.load() >= job->n; });
    }
    if (job->error) std::rethrow_exception(job->error);
}

}  // namespace attnlab
