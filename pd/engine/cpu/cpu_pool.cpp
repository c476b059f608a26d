// Chunked parallel loops that never wait for a thread to start (the decode step's many small GEMMs).
//
// A decode step at small batch splits each of its ~120 projections over the threads. Through an
// OpenMP region each one ends in a join that waits for every thread of the team: on a CPU shared
// with other processes a thread that is not running costs a scheduler time slice at each join
// (milliseconds, 120 times a step). Here the caller publishes a job of `num_chunks` chunks, wakes
// the helper threads and takes chunks itself from a shared counter; a helper takes chunks only
// while some are left, and the caller waits only for the chunks a helper has taken and not yet
// finished. A helper that is descheduled (or still asleep) leaves its share to the others: the
// loop runs at the speed of the threads that do run. Helpers spin briefly between jobs (the next
// projection follows in microseconds; a yield every 64 pauses leaves the core to other processes
// that wait for it), then sleep on a condition variable.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#include <ATen/Parallel.h>
#include <unistd.h>

static inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

class ChunkPool {
 public:
  // Runs fn(chunk) for chunk in [0, num_chunks) on the caller and up to num_threads - 1 helpers.
  void run(int64_t num_chunks, int64_t num_threads, const std::function<void(int64_t)>& fn) {
    std::unique_lock<std::mutex> busy(job_mu_, std::try_to_lock);  // one job at a time
    if (num_chunks <= 1 || num_threads <= 1 || !busy.owns_lock()) {
      for (int64_t c = 0; c < num_chunks; ++c) fn(c);
      return;
    }
    ensure_helpers(num_threads - 1);
    const uint64_t gen = (state_.load(std::memory_order_relaxed) >> 32) + 1;
    // The job goes in the slot of its generation's parity: a helper still holding the previous
    // generation reads that one's slot, never this job's chunk count or function (it would claim
    // and run a chunk twice: a projection that accumulates into its output would add it twice).
    Job& job = jobs_[gen & 1];
    job.fn.store(&fn, std::memory_order_relaxed);
    job.num_chunks.store(num_chunks, std::memory_order_relaxed);
    wanted_.store(num_threads - 1, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    state_.store(gen << 32, std::memory_order_release);  // publish: generation gen, next chunk 0
    if (sleepers_.load(std::memory_order_acquire) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mu_);
      wake_.notify_all();
    }
    drain(gen);
    // A helper still on a chunk may have lost its core: yield now and then, so that it gets it back.
    for (int64_t i = 1; done_.load(std::memory_order_acquire) < num_chunks; ++i) {
      if (i % 64 == 0) std::this_thread::yield(); else spin_pause();
    }
  }

  ~ChunkPool() {
    stop_.store(true);
    {
      std::lock_guard<std::mutex> lock(sleep_mu_);
      wake_.notify_all();
    }
    for (auto& t : helpers_) t.join();
  }

 private:
  // Takes and runs chunks of generation `gen` while any are left, counting each one done. The chunk
  // count and function are read from `gen`'s slot: while the state still names `gen`, no later job
  // can have written that slot (a job starts only when every chunk of the one before is done).
  void drain(uint64_t gen) {
    const Job& job = jobs_[gen & 1];
    uint64_t s = state_.load(std::memory_order_acquire);
    const int64_t num_chunks = job.num_chunks.load(std::memory_order_relaxed);
    while ((s >> 32) == gen && static_cast<int64_t>(s & 0xffffffffu) < num_chunks) {
      if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) {
        (*job.fn.load(std::memory_order_relaxed))(static_cast<int64_t>(s & 0xffffffffu));
        done_.fetch_add(1, std::memory_order_acq_rel);
        s = state_.load(std::memory_order_acquire);
      }
    }
  }

  void ensure_helpers(int64_t count) {
    while (static_cast<int64_t>(helpers_.size()) < count) {
      const int64_t index = static_cast<int64_t>(helpers_.size());
      helpers_.emplace_back([this, index] { helper_loop(index); });
    }
  }

  void helper_loop(int64_t index) {
    uint64_t seen = 0;
    while (!stop_.load(std::memory_order_relaxed)) {
      uint64_t s = state_.load(std::memory_order_acquire);
      if ((s >> 32) == seen) {
        const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinUs);
        for (int64_t i = 1; (s >> 32) == seen; ++i) {
          if (i % 64 == 0) std::this_thread::yield(); else spin_pause();  // leave the core to others that wait
          s = state_.load(std::memory_order_acquire);
          if (i % 256 == 0 && std::chrono::steady_clock::now() >= spin_until) break;
        }
        if ((s >> 32) == seen) {
          std::unique_lock<std::mutex> lock(sleep_mu_);
          sleepers_.fetch_add(1, std::memory_order_acq_rel);
          wake_.wait_for(lock, std::chrono::milliseconds(100), [&] {
            return stop_.load() || (state_.load(std::memory_order_acquire) >> 32) != seen;
          });
          sleepers_.fetch_sub(1, std::memory_order_acq_rel);
          continue;
        }
      }
      seen = s >> 32;
      if (index >= wanted_.load(std::memory_order_relaxed)) continue;
      drain(seen);
    }
  }

  static constexpr int kSpinUs = 2000;
  std::mutex job_mu_, sleep_mu_;
  std::condition_variable wake_;
  std::vector<std::thread> helpers_;
  std::atomic<uint64_t> state_{0};  // generation << 32 | next chunk
  struct Job {
    std::atomic<const std::function<void(int64_t)>*> fn{nullptr};
    std::atomic<int64_t> num_chunks{0};
  };
  Job jobs_[2];  // by generation parity (see run)
  std::atomic<int64_t> wanted_{0}, done_{0}, sleepers_{0};
  std::atomic<bool> stop_{false};
};

// fn(chunk) for chunk in [0, num_chunks), over at::get_num_threads() threads (the caller's included).
static void chunked_for(int64_t num_chunks, const std::function<void(int64_t)>& fn) {
  // Never destroyed (helpers may outlive static teardown); a forked child, whose helpers did not
  // survive the fork, makes its own.
  static std::mutex create_mu;
  static ChunkPool* pool = nullptr;
  static pid_t owner = 0;
  ChunkPool* current;
  {
    std::lock_guard<std::mutex> lock(create_mu);
    if (pool == nullptr || owner != getpid()) {
      pool = new ChunkPool();
      owner = getpid();
    }
    current = pool;
  }
  current->run(num_chunks, at::get_num_threads(), fn);
}
