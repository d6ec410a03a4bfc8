// claim_parallel_for (claim_pool.h): the calling thread and sleeping workers claim units of a job from one counter.
#include "cpu/claim_pool.h"

#include <ATen/Parallel.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define HEBRUS_HAS_MXCSR 1
#endif

namespace hebrus {
namespace {

thread_local bool in_claimed_unit = false;

struct Job {
  const std::function<void(int64_t, int64_t)>* fn;
  int64_t count, grain, units;
  int helpers;                        // workers that may join (the thread count less the caller)
  std::atomic<int> joined{0};
  std::atomic<int64_t> next{0};       // the next unit to claim
  std::atomic<int64_t> done{0};       // units finished
  std::mutex error_mutex;
  std::exception_ptr error;
#ifdef HEBRUS_HAS_MXCSR
  unsigned int csr = _mm_getcsr();    // the caller's flush-to-zero / denormals-are-zero (torch.set_flush_denormal):
                                      // a worker runs the caller's units under the caller's modes
#endif

  // Runs units until none is left to claim (a late worker claims none: next is past the last unit).
  void work() {
#ifdef HEBRUS_HAS_MXCSR
    const unsigned int own_csr = _mm_getcsr();
    if (own_csr != csr) _mm_setcsr(csr);
#endif
    in_claimed_unit = true;
    for (int64_t u = next.fetch_add(1, std::memory_order_relaxed); u < units;
         u = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t begin = u * grain;
      try {
        (*fn)(begin, std::min(count, begin + grain));
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
      }
      done.fetch_add(1, std::memory_order_release);
    }
    in_claimed_unit = false;
#ifdef HEBRUS_HAS_MXCSR
    if (own_csr != csr) _mm_setcsr(own_csr);
#endif
  }
};

// Workers started on demand and never stopped (detached; the pool is never destroyed, so no thread outlives it). A
// job is published under the mutex with a new generation; each worker takes a reference to it (a worker that wakes
// after the job finished still holds a valid Job, whose counter has nothing left).
class Pool {
 public:
  void run(const std::shared_ptr<Job>& job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (int i = workers_; i < job->helpers; ++i) std::thread([this] { loop(); }).detach();
      workers_ = std::max(workers_, job->helpers);
      job_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    job->work();
    for (int spin = 0; job->done.load(std::memory_order_acquire) < job->units; ++spin) {
      if (spin >= 64) std::this_thread::yield();  // a worker is inside a unit (it may be waiting for a core)
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (job_ == job) job_.reset();
    }
  }

 private:
  // After a job a worker watches for the next one for about kSpin pauses (tens of microseconds) before it sleeps: a
  // decode step's projections come a few tens of microseconds apart, and waking a sleeping thread costs about as
  // much as a short projection's share (measured on the idle VM: 30 us more for a 0.1 ms call at 2 threads).
  static constexpr int kSpin = 2000;

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      for (int i = 0; i < kSpin && generation_.load(std::memory_order_acquire) == seen; ++i) pause();
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return generation_.load(std::memory_order_relaxed) != seen; });
        seen = generation_.load(std::memory_order_relaxed);
        job = job_;
      }
      if (job && job->joined.fetch_add(1, std::memory_order_relaxed) < job->helpers) job->work();
    }
  }

  static void pause() {
#ifdef HEBRUS_HAS_MXCSR
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};  // written under mutex_, read without it while a worker spins
  int workers_ = 0;
  std::shared_ptr<Job> job_;
};

std::atomic<Pool*> current_pool{nullptr};

// A forked child has none of the parent's workers (and maybe a mutex a worker held): it starts a pool of its own.
Pool& pool() {
  static const bool created = [] {
    current_pool.store(new Pool);
    pthread_atfork(nullptr, nullptr, [] { current_pool.store(new Pool); });
    return true;
  }();
  (void)created;
  return *current_pool.load();
}

}  // namespace

void claim_parallel_for(int64_t count, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (count <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t units = (count + grain - 1) / grain;
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), units));
  if (threads <= 1 || in_claimed_unit || at::in_parallel_region()) {
    fn(0, count);
    return;
  }
  auto job = std::make_shared<Job>();
  job->fn = &fn;
  job->count = count;
  job->grain = grain;
  job->units = units;
  job->helpers = threads - 1;
  pool().run(job);
  if (job->error) std::rethrow_exception(job->error);
}

}  // namespace hebrus
