#pragma once
// A small persistent thread pool. Each parallel_for call splits [0, n) into tasks that are
// independent by construction, so results never depend on the thread count or on scheduling.

#include <cstdint>
#include <functional>

namespace attnlab {

// Number of threads kernels use (the calling thread included). Default: the cores available,
// or ATTNLAB_NUM_THREADS when set.
int get_num_threads();
void set_num_threads(int n);

// Calls fn(i) for every i in [0, n), on up to get_num_threads() threads. The caller participates.
// Safe to call concurrently from several threads; not meant to be nested.
void parallel_for(std::int64_t n, const std::function<void(std::int64_t)>& fn);

}  // namespace attnlab
