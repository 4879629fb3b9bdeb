// Pin the calling thread's OpenMP team (the threads torch's intra-op parallelism runs on when
// called from this thread) one thread per CPU, as vLLM's CPU worker does. Each Python thread that
// runs torch ops has its own team: call this from the thread that runs the forward.
#include <ATen/Parallel.h>
#include <omp.h>
#include <sched.h>
#include <torch/library.h>

#include <atomic>
#include <vector>

// Returns how many team threads were pinned (== len(cpus) when every call succeeded).
int64_t pin_threads(std::vector<int64_t> cpus) {
  const int n = static_cast<int>(cpus.size());
  TORCH_CHECK(n > 0, "pin_threads: no CPUs given");
  at::set_num_threads(n);
  std::atomic<int64_t> pinned{0};
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[t]), &set);
    if (sched_setaffinity(0, sizeof(set), &set) == 0) pinned.fetch_add(1);
  }
  return pinned.load();
}

// Release every idle OpenMP thread pool of the process (omp_pause_resource_all, soft). Returns 0
// on success.
int64_t release_thread_pools() { return omp_pause_resource_all(omp_pause_soft); }

TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) {
  m.def("pin_threads(int[] cpus) -> int");
  m.def("release_thread_pools() -> int");
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CatchAll, m) {
  m.impl("pin_threads", &pin_threads);
  m.impl("release_thread_pools", &release_thread_pools);
}
