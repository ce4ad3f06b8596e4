// CPU LoRA kernel (AVX2, FMA, F16C): one adapted linear's shrink and expand for a batch whose tokens use
// different adapters, in one call. Activations and outputs are float32; adapter weights float32, float16 or
// bfloat16 (--lora-dtype), widened to float32 as they are read.
//
// In torch a linear costs per adapter in the step an index, a matmul, and per part a matmul and an index_add;
// at one token, or a few tokens per adapter, those dispatches are the whole cost. Here the tokens are grouped by
// adapter into blocks of up to kBlock (a Plan, once per step), and each block reads its adapter's A rows (stored
// [rank, in]) and B rows (stored [rank, out]) once for all its tokens. Blocks split across torch's threads; one
// token splits itself (OneToken), and can run inside the base matmul's own parallel region (LoraApi, SideWork in
// cpu_common/kernel_api.h). A linear's slot tensors are checked once (Weights), so a call checks only its input
// and output.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "cpu_common/extension.h"
#include "cpu_common/kernel_api.h"
#include "cpu_common/prefetch.h"

namespace {

constexpr int kBlock = 4;

template <typename W>
struct Widen;

template <>
struct Widen<float> {
  static __m256 eight(const float* p) { return _mm256_loadu_ps(p); }
  static float one(const float* p) { return *p; }
};

template <>
struct Widen<at::Half> {
  static __m256 eight(const at::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static float one(const at::Half* p) { return static_cast<float>(*p); }
};

template <>
struct Widen<at::BFloat16> {
  static __m256 eight(const at::BFloat16* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static float one(const at::BFloat16* p) { return static_cast<float>(*p); }
};

// A loop hook that does nothing: shrink and expand without a Trickle.
struct NoTrickle {
  void step() {}
};

float horizontal_sum(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}

// h[t * h_stride + j] = a[j] . x[t] for j < rows and the block's N tokens: each row of A is read once for all of them. One token
// keeps four partial sums, so its chain of multiply-adds does not wait on itself.
template <typename W, int N, typename Hook = NoTrickle>
void shrink(const W* a, int64_t rows, int64_t in, const float* const* x, float* h, int64_t h_stride,
            Hook&& hook = {}) {
  constexpr int kSums = N == 1 ? 4 : 1;
  for (int64_t j = 0; j < rows; ++j) {
    hook.step();
    const W* row = a + j * in;
    __m256 acc[N][kSums];
    for (int t = 0; t < N; ++t)
      for (int u = 0; u < kSums; ++u) acc[t][u] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 * kSums <= in; i += 8 * kSums) {
      for (int u = 0; u < kSums; ++u) {
        const __m256 w = Widen<W>::eight(row + i + 8 * u);
        for (int t = 0; t < N; ++t) acc[t][u] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x[t] + i + 8 * u), acc[t][u]);
      }
    }
    for (; i + 8 <= in; i += 8) {
      const __m256 w = Widen<W>::eight(row + i);
      for (int t = 0; t < N; ++t) acc[t][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x[t] + i), acc[t][0]);
    }
    for (int t = 0; t < N; ++t) {
      __m256 total = acc[t][0];
      for (int u = 1; u < kSums; ++u) total = _mm256_add_ps(total, acc[t][u]);
      float sum = horizontal_sum(total);
      for (int64_t k = i; k < in; ++k) sum += Widen<W>::one(row + k) * x[t][k];
      h[t * h_stride + j] = sum;
    }
  }
}

// shrink for one token, four rows of A at a time: each load of x serves four rows (one load per FMA, not two),
// and two sums per row keep eight independent chains of multiply-adds. The rows past a multiple of four go to
// shrink<W, 1>.
template <typename W>
void shrink_one(const W* a, int64_t rows, int64_t in, const float* x, float* h) {
  constexpr int kRows = 4;
  int64_t j = 0;
  for (; j + kRows <= rows; j += kRows) {
    __m256 acc[kRows][2];
    for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= in; i += 16) {
      const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
      for (int r = 0; r < kRows; ++r) {
        const W* row = a + (j + r) * in + i;
        acc[r][0] = _mm256_fmadd_ps(Widen<W>::eight(row), x0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(Widen<W>::eight(row + 8), x1, acc[r][1]);
      }
    }
    for (; i + 8 <= in; i += 8) {
      const __m256 x0 = _mm256_loadu_ps(x + i);
      for (int r = 0; r < kRows; ++r) acc[r][0] = _mm256_fmadd_ps(Widen<W>::eight(a + (j + r) * in + i), x0, acc[r][0]);
    }
    for (int r = 0; r < kRows; ++r) {
      float sum = horizontal_sum(_mm256_add_ps(acc[r][0], acc[r][1]));
      for (int64_t k = i; k < in; ++k) sum += Widen<W>::one(a + (j + r) * in + k) * x[k];
      h[j + r] = sum;
    }
  }
  const float* xs[1] = {x};
  if (j < rows) shrink<W, 1>(a + j * in, rows - j, in, xs, h + j, 0);
}

// y[t][0:n] += sum over k < rank of h[t * h_stride + k] * b[k * ldb : k * ldb + n] for the block's N tokens: b
// holds rank rows of ldb, and each is read once for all of them. Each output is summed over the rank in
// registers first and added to y once, as torch adds the product h @ b.
template <typename W, int N, typename Hook = NoTrickle>
void expand(const float* h, int64_t h_stride, int64_t rank, const W* b, int64_t ldb, float* const* y, int64_t n,
            Hook&& hook = {}) {
  constexpr int kVectors = N == 1 ? 8 : N == 2 ? 4 : 2;  // at most 8 accumulators: 8 chains of multiply-adds
  int64_t o = 0;
  for (; o + 8 * kVectors <= n; o += 8 * kVectors) {
    hook.step();
    __m256 acc[N][kVectors];
    for (int t = 0; t < N; ++t)
      for (int v = 0; v < kVectors; ++v) acc[t][v] = _mm256_setzero_ps();
    for (int64_t k = 0; k < rank; ++k) {
      const W* row = b + k * ldb + o;
      for (int v = 0; v < kVectors; ++v) {
        const __m256 w = Widen<W>::eight(row + 8 * v);
        for (int t = 0; t < N; ++t) acc[t][v] = _mm256_fmadd_ps(_mm256_set1_ps(h[t * h_stride + k]), w, acc[t][v]);
      }
    }
    for (int t = 0; t < N; ++t)
      for (int v = 0; v < kVectors; ++v) {
        float* out = y[t] + o + 8 * v;
        _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), acc[t][v]));
      }
  }
  for (; o + 8 <= n; o += 8) {
    __m256 acc[N];
    for (int t = 0; t < N; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t k = 0; k < rank; ++k) {
      const __m256 w = Widen<W>::eight(b + k * ldb + o);
      for (int t = 0; t < N; ++t) acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(h[t * h_stride + k]), w, acc[t]);
    }
    for (int t = 0; t < N; ++t) _mm256_storeu_ps(y[t] + o, _mm256_add_ps(_mm256_loadu_ps(y[t] + o), acc[t]));
  }
  for (; o < n; ++o) {
    for (int t = 0; t < N; ++t) {
      float acc = 0.0f;
      // fma, as the vector lanes: a column's sum does not depend on where a call's columns start.
      for (int64_t k = 0; k < rank; ++k) acc = std::fma(h[t * h_stride + k], Widen<W>::one(b + k * ldb + o), acc);
      y[t][o] += acc;
    }
  }
}

// A step's tokens grouped by adapter slot, once per step for all its adapted linears: blocks of up to kBlock
// tokens of one slot, slot by slot, in token order within each. Tokens without an adapter (slot -1) are in none.
class Plan {
 public:
  struct Block {
    int64_t slot;
    int count;
    int64_t tokens[kBlock];
  };

  explicit Plan(const at::Tensor& token_slots) {
    TORCH_CHECK_VALUE(token_slots.dim() == 1 && token_slots.is_contiguous() &&
                          token_slots.scalar_type() == at::kLong && token_slots.device().is_cpu(),
                      "token_slots must be a contiguous int64 CPU vector, got ", token_slots.sizes(), " ",
                      token_slots.scalar_type());
    num_tokens_ = token_slots.size(0);
    const int64_t* slot_of = token_slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < num_tokens_; ++t) {
      TORCH_CHECK_VALUE(slot_of[t] >= -1, "token ", t, " uses slot ", slot_of[t]);
      max_slot_ = std::max(max_slot_, slot_of[t]);
    }
    std::vector<std::vector<int64_t>> tokens_of(max_slot_ + 1);
    for (int64_t t = 0; t < num_tokens_; ++t)
      if (slot_of[t] >= 0) tokens_of[slot_of[t]].push_back(t);
    for (int64_t s = 0; s <= max_slot_; ++s) {
      for (size_t start = 0; start < tokens_of[s].size(); start += kBlock) {
        Block block{s, static_cast<int>(std::min<size_t>(kBlock, tokens_of[s].size() - start)), {}};
        for (int i = 0; i < block.count; ++i) block.tokens[i] = tokens_of[s][start + i];
        blocks_.push_back(block);
      }
    }
  }

  int64_t num_tokens() const { return num_tokens_; }
  int64_t max_slot() const { return max_slot_; }
  const std::vector<Block>& blocks() const { return blocks_; }

 private:
  int64_t num_tokens_ = 0;
  int64_t max_slot_ = -1;
  std::vector<Block> blocks_;
};

// One block's rows of x and y, for one call.
struct Rows {
  int64_t slot;
  int count;
  const float* x[kBlock];
  float* y[kBlock];
};

bool is_float_cpu(const at::Tensor& t) { return t.scalar_type() == at::kFloat && t.device().is_cpu(); }

// One adapted linear's slots: lora_a [slots, parts * rank, in] and lora_b[p] [slots, rank, out_p], checked once
// when the linear's slots are made. The tensors are held, and only ever written in place (an adapter loaded into
// a slot), so what was checked stays true.
class Weights {
 public:
  Weights(at::Tensor lora_a, std::vector<at::Tensor> lora_b, std::vector<int64_t> offsets)
      : lora_a_(std::move(lora_a)), lora_b_(std::move(lora_b)), offsets_(std::move(offsets)) {
    dtype_ = lora_a_.scalar_type();
    TORCH_CHECK_VALUE(lora_a_.dim() == 3 && is_weight_cpu(lora_a_, dtype_),
                      "lora_a must be a contiguous float32, float16 or bfloat16 CPU [slots, parts * rank, in] "
                      "tensor, got ",
                      lora_a_.sizes(), " ", dtype_);
    slots_ = lora_a_.size(0);
    part_rows_ = lora_a_.size(1);
    in_ = lora_a_.size(2);
    const int64_t parts = static_cast<int64_t>(lora_b_.size());
    TORCH_CHECK_VALUE(parts > 0 && part_rows_ % parts == 0 && static_cast<int64_t>(offsets_.size()) == parts,
                      "lora_a's ", part_rows_, " rows, ", parts, " lora_b and ", offsets_.size(),
                      " offsets do not match");
    rank_ = part_rows_ / parts;
    for (int64_t p = 0; p < parts; ++p) {
      const at::Tensor& b = lora_b_[p];
      TORCH_CHECK_VALUE(b.dim() == 3 && is_weight_cpu(b, dtype_) && b.size(0) == slots_ && b.size(1) == rank_,
                        "lora_b[", p, "] must be a contiguous ", dtype_, " CPU [", slots_, ", ", rank_,
                        ", out] tensor like lora_a, got ", b.sizes(), " ", b.scalar_type());
      TORCH_CHECK_VALUE(offsets_[p] >= 0, "part ", p, " starts at column ", offsets_[p]);
      widths_.push_back(b.size(2));
      columns_ = std::max(columns_, offsets_[p] + b.size(2));
    }
  }

  // For each token t of the plan whose slot s is not -1: h = lora_a[s] @ x[t] ([parts * rank]), and for each
  // part p, y[t, offsets[p] : offsets[p] + out_p] += h[p * rank : (p + 1) * rank] @ lora_b[p][s].
  void add(const Plan& plan, const at::Tensor& x, at::Tensor& y) const {
    check_plan(plan);
    TORCH_CHECK_VALUE(x.dim() == 2 && is_float_cpu(x) && x.stride(1) == 1 && x.size(1) == in_,
                      "x must be a float32 CPU [tokens, ", in_, "] matrix with contiguous rows, got ", x.sizes(),
                      " ", x.scalar_type(), " strides ", x.strides());
    const int64_t tokens = x.size(0);
    TORCH_CHECK_VALUE(tokens == plan.num_tokens(), "x has ", tokens, " rows, the plan ", plan.num_tokens(),
                      " tokens");
    TORCH_CHECK_VALUE(y.dim() == 2 && is_float_cpu(y) && y.stride(1) == 1 && y.size(0) == tokens,
                      "y must be a float32 CPU [", tokens, ", out] matrix with contiguous rows, got ", y.sizes());
    TORCH_CHECK_VALUE(columns_ <= y.size(1), "the parts reach column ", columns_, ", past y's ", y.size(1),
                      " columns");
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    std::vector<Rows> rows;
    rows.reserve(plan.blocks().size());
    for (const Plan::Block& block : plan.blocks()) {
      Rows r{block.slot, block.count, {}, {}};
      for (int i = 0; i < block.count; ++i) {
        r.x[i] = xp + block.tokens[i] * x.stride(0);
        r.y[i] = yp + block.tokens[i] * y.stride(0);
      }
      rows.push_back(r);
    }
    switch (dtype_) {
      case at::kFloat: run<float>(rows); break;
      case at::kHalf: run<at::Half>(rows); break;
      default: run<at::BFloat16>(rows); break;
    }
  }

  // add() for a plan of one token with an adapter, run as `shares` shares one after another on this thread, as a
  // matmul's side work runs when its region gets fewer threads than shares: each share finds the later ones not
  // yet published. For tests: the result must be add()'s on `shares` threads, bit for bit.
  void add_in_shares(const Plan& plan, const at::Tensor& x, at::Tensor& y, int64_t shares) const {
    const int64_t bytes = side_bytes(plan, shares);
    TORCH_CHECK_VALUE(bytes > 0, "add_in_shares takes a plan of one token with an adapter, and shares > 1");
    TORCH_CHECK_VALUE(x.dim() == 2 && is_float_cpu(x) && x.is_contiguous() && x.size(0) == 1 && x.size(1) == in_ &&
                          y.dim() == 2 && is_float_cpu(y) && y.is_contiguous() && y.size(0) == 1 &&
                          y.size(1) >= columns_,
                      "add_in_shares takes a contiguous float32 [1, ", in_, "] x and [1, >= ", columns_, "] y");
    std::vector<char> scratch(bytes, 0);
    for (int64_t s = 0; s < shares; ++s)
      add_share(plan, x.data_ptr<float>(), scratch.data(), s, shares, y.data_ptr<float>(), columns_ * s / shares,
                columns_ * (s + 1) / shares);
  }

  // The one-token product in shares (kernel_api.h, LoraApi): the bytes of the shares' scratch, 0 for a plan that
  // is not one token with an adapter.
  int64_t side_bytes(const Plan& plan, int64_t shares) const {
    check_plan(plan);
    const bool one = plan.num_tokens() == 1 && plan.blocks().size() == 1;
    return one && shares > 1 && rank_ > 1 ? OneToken::bytes(part_rows_, shares) : 0;
  }

  // Share `share` of `shares` of the token's product, added to columns begin..end of its output row y.
  void add_share(const Plan& plan, const float* x, void* scratch, int64_t share, int64_t shares, float* y,
                 int64_t begin, int64_t end) const {
    const OneToken one{plan.blocks()[0].slot, x, y, scratch, shares};
    switch (dtype_) {
      case at::kFloat: add_share<float>(one, share, begin, end); break;
      case at::kHalf: add_share<at::Half>(one, share, begin, end); break;
      default: add_share<at::BFloat16>(one, share, begin, end); break;
    }
  }

  // What add_share reads for a share: the token's input x (written on another thread), its rows of A of each part,
  // and each part's columns begin..end of B.
  int share_reads(const Plan& plan, const float* x, int64_t share, int64_t shares, int64_t begin, int64_t end,
                  tokenmill::SideWork::Range* ranges) const {
    return reads(plan.blocks()[0].slot, x, share, shares, begin, end, ranges);
  }

 private:
  int reads(int64_t slot, const float* x, int64_t share, int64_t shares, int64_t begin, int64_t end,
            tokenmill::SideWork::Range* ranges) const {
    const int64_t size = lora_a_.element_size();
    const auto [first, count] = rows_of(share, shares);
    ranges[0] = {reinterpret_cast<const char*>(x), in_ * static_cast<int64_t>(sizeof(float)), 0, 1};
    int n = 1;
    for (size_t p = 0; p < widths_.size() && n + 2 <= tokenmill::SideWork::kMaxReads; ++p) {
      const char* a = static_cast<const char*>(lora_a_.const_data_ptr());
      ranges[n++] = {a + ((slot * part_rows_ + p * rank_ + first) * in_) * size, count * in_ * size, 0, 1};
      const auto [lo, hi] = columns_of(p, begin, end);
      const char* b = static_cast<const char*>(lora_b_[p].const_data_ptr());
      if (lo < hi) {  // rank_ runs of the part's columns, a row of B apart
        ranges[n++] = {b + (slot * rank_ * widths_[p] + lo) * size, (hi - lo) * size, widths_[p] * size, rank_};
      }
    }
    return n;
  }

  void check_plan(const Plan& plan) const {
    TORCH_CHECK_VALUE(plan.max_slot() < slots_, "a token uses slot ", plan.max_slot(), " of ", slots_);
  }

  // One token's product split in shares: share s shrinks rows_of(s) of every part and publishes them in the
  // scratch (a flag per share, a cache line each, then h [parts * rank]); then it expands the whole rank into its
  // columns. A share whose rows are not published yet is not waited for: its rows are computed again, by the
  // same code, so the result does not depend on which thread ran first.
  struct OneToken {
    static constexpr int64_t kFlagBytes = 64;
    int64_t slot;
    const float* x;
    float* y;
    void* scratch;
    int64_t shares;

    static int64_t bytes(int64_t part_rows, int64_t shares) {
      return shares * kFlagBytes + part_rows * static_cast<int64_t>(sizeof(float));
    }
    int32_t* flag(int64_t share) const {
      return reinterpret_cast<int32_t*>(static_cast<char*>(scratch) + share * kFlagBytes);
    }
    float* h() const { return reinterpret_cast<float*>(static_cast<char*>(scratch) + shares * kFlagBytes); }
  };

  // A share's rows of the rank: (first, count).
  std::pair<int64_t, int64_t> rows_of(int64_t share, int64_t shares) const {
    const int64_t first = rank_ * share / shares;
    return {first, rank_ * (share + 1) / shares - first};
  }

  // Part p's columns within the merged output's begin..end, in that part's own columns: (lo, hi).
  std::pair<int64_t, int64_t> columns_of(size_t p, int64_t begin, int64_t end) const {
    return {std::clamp(begin - offsets_[p], int64_t{0}, widths_[p]),
            std::clamp(end - offsets_[p], int64_t{0}, widths_[p])};
  }

  static bool is_weight_cpu(const at::Tensor& t, at::ScalarType dtype) {
    return t.scalar_type() == dtype && t.device().is_cpu() && t.is_contiguous() &&
           (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16);
  }

  template <typename W>
  const W* slot_a(int64_t slot) const {
    return lora_a_.const_data_ptr<W>() + slot * part_rows_ * in_;
  }

  template <typename W>
  const W* slot_b(size_t part, int64_t slot) const {
    return lora_b_[part].const_data_ptr<W>() + slot * rank_ * widths_[part];
  }

  template <typename W>
  void run(const std::vector<Rows>& rows) const {
    if (rows.size() == 1 && rows[0].count == 1 && at::get_num_threads() > 1 && rank_ > 1) {
      split_one_token<W>(rows[0]);
      return;
    }
    at::parallel_for(0, static_cast<int64_t>(rows.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> h(kBlock * part_rows_);
      if (begin < end) block_rows<W>(rows[begin]).rest();
      for (int64_t i = begin; i < end; ++i) {
        tokenmill::Trickle next = i + 1 < end ? block_rows<W>(rows[i + 1]) : tokenmill::Trickle{};
        switch (rows[i].count) {
          case 1: run_block<W, 1>(rows[i], h.data(), next); break;
          case 2: run_block<W, 2>(rows[i], h.data(), next); break;
          case 3: run_block<W, 3>(rows[i], h.data(), next); break;
          default: run_block<W, kBlock>(rows[i], h.data(), next); break;
        }
        next.rest();
      }
    });
  }

  // A block's A and B rows, to ask for into L2 while the block before it runs: one adapter's rows are a few runs
  // of tens of KB that the hardware prefetcher would find a miss at a time. Spread over the running block's loop
  // iterations (one per row of A, one per chunk of each part's columns), so that its loads and the requests
  // overlap (asked for all at once, the requests held the core up: docs/benchmarks.md).
  template <typename W>
  tokenmill::Trickle block_rows(const Rows& block) const {
    tokenmill::Trickle ahead;
    ahead.add(slot_a<W>(block.slot), part_rows_ * in_ * static_cast<int64_t>(sizeof(W)));
    for (size_t p = 0; p < widths_.size(); ++p)
      ahead.add(slot_b<W>(p, block.slot), rank_ * widths_[p] * static_cast<int64_t>(sizeof(W)));
    ahead.spread(part_rows_ + columns_ / 16);
    return ahead;
  }

  template <typename W, int N>
  void run_block(const Rows& block, float* h, tokenmill::Trickle& ahead) const {
    if constexpr (N == 1) {
      shrink_one<W>(slot_a<W>(block.slot), part_rows_, in_, block.x[0], h);
    } else {
      shrink<W, N>(slot_a<W>(block.slot), part_rows_, in_, block.x, h, part_rows_, ahead);
    }
    for (size_t p = 0; p < widths_.size(); ++p) {
      float* y[N];
      for (int t = 0; t < N; ++t) y[t] = block.y[t] + offsets_[p];
      expand<W, N>(h + p * rank_, part_rows_, rank_, slot_b<W>(p, block.slot), widths_[p], y, widths_[p], ahead);
    }
  }

  // One token (a decode step of one stream) is one block: the threads split it as the side work of a matmul does
  // (add_share), each adding to an equal share of the output's columns.
  template <typename W>
  void split_one_token(const Rows& block) const {
    const int64_t shares = at::get_num_threads();
    std::vector<char> scratch(OneToken::bytes(part_rows_, shares), 0);
    const OneToken one{block.slot, block.x[0], block.y[0], scratch.data(), shares};
    at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s) {
        const int64_t first = columns_ * s / shares, last = columns_ * (s + 1) / shares;
        // What the share reads: short runs the hardware prefetcher would find a miss at a time.
        tokenmill::SideWork::Range ranges[tokenmill::SideWork::kMaxReads];
        const int count = reads(block.slot, block.x[0], s, shares, first, last, ranges);
        tokenmill::Trickle reading;
        for (int i = 0; i < count; ++i)
          reading.add(ranges[i].begin, ranges[i].bytes, ranges[i].stride, ranges[i].count);
        reading.rest();
        add_share<W>(one, s, first, last);
      }
    });
  }

  template <typename W>
  void shrink_rows(const OneToken& one, int64_t share, float* h) const {
    const auto [first, count] = rows_of(share, one.shares);
    for (size_t p = 0; p < widths_.size() && count > 0; ++p)
      shrink_one<W>(slot_a<W>(one.slot) + (p * rank_ + first) * in_, count, in_, one.x, h + p * rank_ + first);
  }

  template <typename W>
  void add_share(const OneToken& one, int64_t share, int64_t begin, int64_t end) const {
    float* h = one.h();
    shrink_rows<W>(one, share, h);
    __atomic_store_n(one.flag(share), 1, __ATOMIC_RELEASE);
    // A flag once read set stays set, so a share seen published below may be read from h.
    const auto published = [&](int64_t s) { return s == share || __atomic_load_n(one.flag(s), __ATOMIC_ACQUIRE); };
    bool all = true;
    for (int64_t s = 0; s < one.shares && all; ++s) all = published(s);
    std::vector<float> own;  // the whole h, when some share's rows are not published yet
    if (!all) {
      own.resize(part_rows_);
      for (int64_t s = 0; s < one.shares; ++s) {
        if (!published(s)) {
          shrink_rows<W>(one, s, own.data());
          continue;
        }
        const auto [first, count] = rows_of(s, one.shares);
        for (size_t p = 0; p < widths_.size(); ++p)
          std::copy_n(h + p * rank_ + first, count, own.data() + p * rank_ + first);
      }
    }
    const float* full = all ? h : own.data();
    for (size_t p = 0; p < widths_.size(); ++p) {
      const auto [lo, hi] = columns_of(p, begin, end);
      float* y[1] = {one.y + offsets_[p] + lo};
      if (lo < hi) expand<W, 1>(full + p * rank_, 0, rank_, slot_b<W>(p, one.slot) + lo, widths_[p], y, hi - lo);
    }
  }

  at::Tensor lora_a_;
  std::vector<at::Tensor> lora_b_;
  std::vector<int64_t> offsets_;
  std::vector<int64_t> widths_;
  at::ScalarType dtype_;
  int64_t slots_ = 0, part_rows_ = 0, in_ = 0, rank_ = 0, columns_ = 0;
};

template <typename T>
const void* unwrap(pybind11::handle object) {
  return pybind11::isinstance<T>(object) ? static_cast<const void*>(object.cast<const T*>()) : nullptr;
}

void add(const void* weights, const void* plan, const at::Tensor& x, at::Tensor& y) {
  static_cast<const Weights*>(weights)->add(*static_cast<const Plan*>(plan), x, y);
}

int64_t side_bytes(const void* weights, const void* plan, int64_t shares) {
  return static_cast<const Weights*>(weights)->side_bytes(*static_cast<const Plan*>(plan), shares);
}

void add_share(const void* weights, const void* plan, const float* x, void* scratch, int64_t share, int64_t shares,
               float* y, int64_t begin, int64_t end) {
  static_cast<const Weights*>(weights)->add_share(*static_cast<const Plan*>(plan), x, scratch, share, shares, y,
                                                   begin, end);
}

int share_reads(const void* weights, const void* plan, const float* x, int64_t share, int64_t shares, int64_t begin,
                int64_t end, tokenmill::SideWork::Range* ranges) {
  return static_cast<const Weights*>(weights)->share_reads(*static_cast<const Plan*>(plan), x, share, shares, begin,
                                                            end, ranges);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Plan>(m, "Plan", "A step's tokens grouped by adapter slot (token_slots: int64, -1 for none)")
      .def(pybind11::init<const at::Tensor&>(), pybind11::arg("token_slots"));
  pybind11::class_<Weights>(m, "Weights", "One adapted linear's slots, checked once")
      .def(pybind11::init<at::Tensor, std::vector<at::Tensor>, std::vector<int64_t>>(), pybind11::arg("lora_a"),
           pybind11::arg("lora_b"), pybind11::arg("offsets"))
      .def("add", &Weights::add, "Each token's adapter product added in place to a float32 linear's output",
           pybind11::arg("plan"), pybind11::arg("x"), pybind11::arg("y"))
      .def("add_in_shares", &Weights::add_in_shares,
           "add() for one token, as `shares` shares run one after another on this thread (for tests)",
           pybind11::arg("plan"), pybind11::arg("x"), pybind11::arg("y"), pybind11::arg("shares"));
  static const tokenmill::LoraApi api{&unwrap<Weights>, &unwrap<Plan>, &add, &side_bytes, &add_share, &share_reads};
  tokenmill::def_api(m, &api);
}
