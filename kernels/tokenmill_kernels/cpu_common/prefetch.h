// Memory asked for into L2 a few cache lines at a time as a loop runs (a matmul's row groups, a LoRA block's rows),
// so that the requests overlap the loop's own work. Asked for all at once, they fill the core's line-fill buffers
// and the core waits on them instead of computing.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace tokenmill {

class Trickle {
 public:
  static constexpr int kMaxRuns = 8;

  // `count` runs of `bytes` bytes, `stride` bytes apart, from `begin` (asked for from the line it starts in). Past
  // kMaxRuns, a run is not asked for: these are hints.
  void add(const void* begin, int64_t bytes, int64_t stride = 0, int64_t count = 1) {
    if (count_ == kMaxRuns || bytes <= 0 || count <= 0) return;
    const int64_t skew = reinterpret_cast<uintptr_t>(begin) % 64;
    runs_[count_++] = {static_cast<const char*>(begin) - skew, bytes + skew, stride, count};
    lines_ += count * ((bytes + skew + 63) / 64);
  }
  // Spread what was added over `steps` calls of step() (all of it at the first, for steps <= 0).
  void spread(int64_t steps) { per_step_ = steps > 0 ? (lines_ + steps - 1) / steps : lines_; }
  void step() {
    for (int64_t k = 0; k < per_step_ && run_ < count_; ++k) next();
  }
  // Whatever step() has not asked for yet.
  void rest() {
    while (run_ < count_) next();
  }

 private:
  void next() {
    const Run& r = runs_[run_];
    _mm_prefetch(r.begin + repeat_ * r.stride + offset_, _MM_HINT_T1);
    offset_ += 64;
    if (offset_ < r.bytes) return;
    offset_ = 0;
    if (++repeat_ < r.count) return;
    repeat_ = 0;
    ++run_;
  }

  struct Run {
    const char* begin;
    int64_t bytes, stride, count;
  };
  Run runs_[kMaxRuns];
  int count_ = 0, run_ = 0;
  int64_t lines_ = 0, per_step_ = 0, repeat_ = 0, offset_ = 0;
};

}  // namespace tokenmill
