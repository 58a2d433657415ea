// Paged attention on CPU, reading the KV cache in place (no gathered copy of the blocks).
//
// One call covers a whole engine step: every sequence's chunk of new query tokens (a decode is a
// chunk of one), causal over the chunk and over every token already in the cache.
//
//   q            [T, heads, D]              the step's queries, sequences back to back
//   key_cache    [num_blocks, block_size, kv_heads, D]   (value_cache the same)
//   block_tables int32 [S, max_blocks]      row s: sequence s's blocks in order
//   seq_lens     int32 [S]                  tokens in the cache for s, this step's included
//   query_start  int32 [S + 1]              s's queries are q[query_start[s] : query_start[s + 1]]
//   out          [T, heads, D]
//
// Query i of sequence s (n = its chunk length) sits at position seq_lens[s] - n + i and sees keys
// 0 .. that position. Work items are (sequence, kv head, tile of up to QUERY_TILE queries), run with
// at::parallel_for; an item holds the tile's queries for all `group` query heads of its kv head as
// rows, so each key and value row read from the cache serves group x tile query rows while it is
// in L1. Softmax is online per cache block (running max m, running sum l, rescaled accumulator),
// in fp32 whatever the cache dtype. On AVX-512 (head dims 32-128, multiples of 32 or 96) the block step is
// attention_avx512.h's; elsewhere, for work items of many rows (prefill tiles) and head dims in eights,
// attention_avx2.h's; else the loops over D are plain loops that -O3 -march=native vectorises (the dot
// products through `omp simd reduction`).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_amx.h"  // the many-rows step on AMX tiles, where QUANTKIT_ATTENTION_AMX
#include "attention_avx512.h"  // fold_block's vector path, where QUANTKIT_AVX512
#if defined(__AVX2__) && defined(__FMA__)
#include "attention_avx2.h"  // fold_block's AVX2 path for many rows, where the AVX-512 one is not built
#endif

namespace {

constexpr int64_t QUERY_TILE = 16;
constexpr int64_t PREFIX_TILE = 64;  // queries per work item of the shared prefix pass

struct WorkItem {
  int64_t seq, kv_head, q_begin, q_end;  // queries [q_begin, q_end) of the flat batch
};

template <typename T>
inline float dot(const T* a, const float* b, int64_t d) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += static_cast<float>(a[i]) * b[i];
  return acc;
}

// The query rows of one work item in fp32: q pre-scaled, and the online softmax's running max m,
// running sum l and unnormalised accumulator acc. A bf16 query is also kept as it came (qb, unscaled):
// the AVX-512 BF16 step multiplies bf16 pairs.
struct Rows {
  int64_t n, d;
  float scale = 1.f;
  std::vector<float> q, acc, m, l;
  std::vector<c10::BFloat16> qb;
  Rows(int64_t n, int64_t d)
      : n(n), d(d), q(n * d), acc(n * d, 0.f), m(n, -std::numeric_limits<float>::infinity()), l(n, 0.f) {}

  template <typename T>
  void set_query(int64_t r, const T* src, float sc) {
    scale = sc;
    for (int64_t i = 0; i < d; ++i) q[r * d + i] = static_cast<float>(src[i]) * sc;
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (qb.empty()) qb.resize(n * d);
      std::copy(src, src + d, qb.begin() + r * d);
    }
  }

  // the unscaled bf16 rows where the cache is bf16, else null
  template <typename T>
  const T* query_as_cached() const {
    if constexpr (std::is_same_v<T, c10::BFloat16>) return qb.empty() ? nullptr : qb.data();
    return nullptr;
  }
};

// Whether fold_block runs its AVX-512 path (built, an fp32, bf16 or fp16 cache, head dim d taken); the AVX2 step
// stands aside where it does.
template <typename T>
inline bool avx512_folds(int64_t d) {
#if defined(QUANTKIT_AVX512)
  if constexpr (!std::is_same_v<T, double>) return avx512::supports(d);
#endif
  return false;
}

// Folds one cache block (keys kb, values vb; rows of token_stride elements) into every row's online
// softmax. Row r sees the block's first visible[r] keys (all of them when visible is null); s is
// scratch of block_size floats.
template <typename T>
void fold_block(Rows& rows, const T* kb, const T* vb, int64_t token_stride, int64_t block_size,
                const int64_t* visible, float* s) {
  const int64_t d = rows.d;
#if defined(QUANTKIT_AVX512)
  if constexpr (!std::is_same_v<T, double>)
    if (avx512_folds<T>(d))
      return avx512::fold_rows(rows.n, d, rows.q.data(), rows.query_as_cached<T>(), rows.scale, rows.acc.data(),
                               rows.m.data(), rows.l.data(), kb, vb, token_stride, block_size, visible);
#endif
  for (int64_t r = 0; r < rows.n; ++r) {
    const int64_t valid = visible ? std::min(block_size, visible[r]) : block_size;
    if (valid <= 0) continue;
    const float* qr = rows.q.data() + r * d;
    float block_max = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < valid; ++t) {
      s[t] = dot(kb + t * token_stride, qr, d);
      block_max = std::max(block_max, s[t]);
    }
    const float m_new = std::max(rows.m[r], block_max);
    const float alpha = std::exp(rows.m[r] - m_new);  // 0 on the first block (m = -inf)
    float* ar = rows.acc.data() + r * d;
    float sum = 0.f;
    for (int64_t t = 0; t < valid; ++t) {
      s[t] = std::exp(s[t] - m_new);
      sum += s[t];
    }
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) ar[i] *= alpha;
    for (int64_t t = 0; t < valid; ++t) {
      const T* vr = vb + t * token_stride;
      const float p = s[t];
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) ar[i] += p * static_cast<float>(vr[i]);
    }
    rows.l[r] = rows.l[r] * alpha + sum;
    rows.m[r] = m_new;
  }
}

// Asks for a block's key and value rows of one kv head (block_size rows of d elements, token_stride apart)
// to be brought into the cache while the block before it is folded in. A decode's blocks lie wherever the
// pool put them, so the hardware prefetcher cannot guess the next one: without this, the decode step waited
// on memory (8 layers x 8 sequences x 192 keys: 2.4-3.0 ms from memory against 0.7-1.0 ms with the same
// blocks in the cache, docs/BENCHMARKS.md).
// How many blocks ahead of the one being folded are prefetched (0: none). A setting, so that the attention
// benchmark can time both in one process (set_prefetch_blocks).
inline int64_t& prefetch_blocks() {
  static int64_t blocks = 1;
  return blocks;
}

template <typename T>
inline void prefetch_block(const T* kb, const T* vb, int64_t token_stride, int64_t block_size, int64_t d) {
  constexpr int64_t LINE = 64 / static_cast<int64_t>(sizeof(T));  // elements per cache line
  for (int64_t t = 0; t < block_size; ++t)
    for (int64_t i = 0; i < d; i += LINE) {
      __builtin_prefetch(kb + t * token_stride + i, 0, 2);
      __builtin_prefetch(vb + t * token_stride + i, 0, 2);
    }
}

// The online-softmax state of every (query, query head) after the shared prefix blocks, fp32:
// acc [T, heads, D], m and l [T, heads]. Written by the cascade's first pass (shared_prefix_state_ below,
// GEMMs), read by paged_attention.
struct PrefixState {
  float *acc, *m, *l;
};

// Row r of a work item over queries [q_begin, q_end) of kv head h: query q_begin + r / group,
// query head h * group + r % group.
inline int64_t row_index(int64_t q_begin, int64_t r, int64_t group, int64_t kv_head, int64_t heads) {
  return (q_begin + r / group) * heads + kv_head * group + r % group;
}

// Folds blocks b0..b1-1 into the rows on AMX tiles (attention_amx.h) where the step takes them (a bf16 cache, enough
// rows, the head dim and block size); returns whether it did. base(b): block b's offset in both caches; last: the
// last key each row sees (null: every key).
template <typename T, typename Base>
bool folded_on_amx(Rows& rows, const T* kc, const T* vc, int64_t token_stride, int64_t block_size, int64_t b0,
                   int64_t b1, Base base, const int64_t* last) {
#if defined(QUANTKIT_ATTENTION_AMX)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (rows.n >= amxattn::from_rows() && amxattn::supports(rows.d, block_size)) {
      amxattn::fold_blocks_any(rows.d, rows.n, rows.qb.data(), rows.scale, rows.acc.data(), rows.m.data(),
                               rows.l.data(), kc, vc, token_stride, b0, b1, base, last);
      return true;
    }
  }
#endif
  return false;
}

// Folds blocks b0..b1-1 into the rows by the AVX2 step (attention_avx2.h) where it takes them (AVX2 built, no AVX-512
// step for this head dim, enough rows); returns whether it did. Arguments as folded_on_amx's.
template <typename T, typename Base>
bool folded_on_avx2(Rows& rows, const T* kc, const T* vc, int64_t token_stride, int64_t block_size, int64_t b0,
                    int64_t b1, Base base, const int64_t* last) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (!std::is_same_v<T, double>) {
    if (!avx512_folds<T>(rows.d) && avx2att::supports(rows.n, rows.d)) {
      avx2att::fold_blocks(rows.n, rows.d, rows.q.data(), rows.acc.data(), rows.m.data(), rows.l.data(), kc, vc,
                           token_stride, block_size, b0, b1, base, last);
      return true;
    }
  }
#endif
  return false;
}

// The work item's outputs: each row's accumulator over its softmax sum, in the output's dtype.
template <typename T>
void finish_item(const WorkItem& w, const Rows& rows, T* out, int64_t group, int64_t heads) {
  const int64_t d = rows.d;
  for (int64_t r = 0; r < rows.n; ++r) {
    T* dst = out + row_index(w.q_begin, r, group, w.kv_head, heads) * d;
    const float inv = 1.f / rows.l[r];
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(rows.acc[r * d + i] * inv);
  }
}

template <typename T>
void attend_item(const WorkItem& w, const T* q, const T* kc, const T* vc, const int32_t* table, int64_t seq_len,
                 int64_t chunk_begin, int64_t chunk_len, T* out, int64_t heads, int64_t kv_heads, int64_t d,
                 int64_t block_size, float scale, int64_t skip_blocks, const PrefixState* prefix) {
  const int64_t group = heads / kv_heads;
  Rows rows((w.q_end - w.q_begin) * group, d);
  for (int64_t r = 0; r < rows.n; ++r) {
    const int64_t idx = row_index(w.q_begin, r, group, w.kv_head, heads);
    rows.set_query(r, q + idx * d, scale);
    if (skip_blocks > 0) {  // continue the softmax from the shared prefix pass
      std::copy(prefix->acc + idx * d, prefix->acc + (idx + 1) * d, rows.acc.begin() + r * d);
      rows.m[r] = prefix->m[idx];
      rows.l[r] = prefix->l[idx];
    }
  }
  const int64_t first_pos = seq_len - chunk_len;  // position of the chunk's first query
  const int64_t last_key = first_pos + (w.q_end - 1 - chunk_begin);  // the tile's last query sees up to here
  const int64_t token_stride = kv_heads * d;
  const auto base_of = [&](int64_t b) { return static_cast<int64_t>(table[b]) * block_size * token_stride + w.kv_head * d; };
  std::vector<int64_t> last(rows.n);  // causal: the row's query at position last[r] sees keys 0 .. last[r]
  for (int64_t r = 0; r < rows.n; ++r) last[r] = first_pos + (w.q_begin + r / group - chunk_begin);
  if (folded_on_amx(rows, kc, vc, token_stride, block_size, skip_blocks, last_key / block_size + 1, base_of,
                    last.data()) ||
      folded_on_avx2(rows, kc, vc, token_stride, block_size, skip_blocks, last_key / block_size + 1, base_of,
                     last.data()))
    return finish_item(w, rows, out, group, heads);
  std::vector<float> s(block_size);
  std::vector<int64_t> visible(rows.n);
  const int64_t ahead = prefetch_blocks();
  for (int64_t b = skip_blocks; b * block_size <= last_key; ++b) {
    const int64_t base = base_of(b);
    for (int64_t f = b == skip_blocks ? b + 1 : b + ahead; f <= b + ahead && f * block_size <= last_key; ++f)
      prefetch_block(kc + base_of(f), vc + base_of(f), token_stride, block_size, d);
    for (int64_t r = 0; r < rows.n; ++r) visible[r] = last[r] - b * block_size + 1;  // the block's keys it sees
    fold_block(rows, kc + base, vc + base, token_stride, block_size, visible.data(), s.data());
  }
  finish_item(w, rows, out, group, heads);
}

void check_inputs(const torch::Tensor& q, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                  const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                  const torch::Tensor& query_start) {
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4, "q must be [T, heads, D] and the caches 4-d");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key and value caches differ in shape");
  TORCH_CHECK(key_cache.size(3) == q.size(2), "head_dim of q and the cache differ");
  TORCH_CHECK(q.size(1) % key_cache.size(2) == 0, "query heads are not a multiple of kv heads");
  TORCH_CHECK(q.scalar_type() == key_cache.scalar_type() && q.scalar_type() == value_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "q and the caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
                  query_start.scalar_type() == torch::kInt32,
              "block_tables, seq_lens and query_start must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous(), "block_tables must be a contiguous [S, W]");
  const int64_t n_seqs = seq_lens.size(0);
  TORCH_CHECK(block_tables.size(0) == n_seqs && query_start.size(0) == n_seqs + 1,
              "block_tables, seq_lens and query_start must describe the same sequences");
}

// The cascade's first pass for one work item (kv head h, the `rows` query rows of tokens tok[0 ..]) by the
// AVX-512 block step: the prefix blocks are read in place and each stays in L1 while all the item's rows
// fold it in, so there is no gathered fp32 copy of the prefix and no GEMM set-up. Returns false where the
// block step does not apply (no AVX-512, fp64, a head dim it does not take): the caller's GEMMs run.
template <typename T>
bool prefix_item_folded(const T* q, const T* kc, const T* vc, const int32_t* tok, const int32_t* blk, int64_t n_blocks,
                        int64_t rows_n, int64_t h, int64_t heads, int64_t group, int64_t d, int64_t block_size,
                        int64_t token_stride, float scale, float* acc, float* m, float* l) {
#if defined(QUANTKIT_AVX512)
  if constexpr (!std::is_same_v<T, double>) {
    if (!avx512::supports(d)) return false;
    Rows rows(rows_n, d);
    for (int64_t r = 0; r < rows_n; ++r) {  // row r: query tok[r / group], head h * group + r % group
      const T* src = q + (static_cast<int64_t>(tok[r / group]) * heads + h * group + r % group) * d;
      rows.set_query(r, src, scale);
    }
    const auto base_of = [&](int64_t b) { return static_cast<int64_t>(blk[b]) * block_size * token_stride + h * d; };
    const bool amx = folded_on_amx(rows, kc, vc, token_stride, block_size, 0, n_blocks, base_of, nullptr);
    for (int64_t b = 0; !amx && b < n_blocks; ++b) {
      const int64_t base = base_of(b);
      for (int64_t f = b == 0 ? 1 : b + prefetch_blocks(); f <= b + prefetch_blocks() && f < n_blocks; ++f)
        prefetch_block(kc + base_of(f), vc + base_of(f), token_stride, block_size, d);
      avx512::fold_rows(rows.n, d, rows.q.data(), rows.query_as_cached<T>(), rows.scale, rows.acc.data(),
                        rows.m.data(), rows.l.data(), kc + base, vc + base, token_stride, block_size, nullptr);
    }
    for (int64_t r = 0; r < rows_n; ++r) {
      const int64_t idx = static_cast<int64_t>(tok[r / group]) * heads + h * group + r % group;
      std::copy(rows.acc.begin() + r * d, rows.acc.begin() + (r + 1) * d, acc + idx * d);
      m[idx] = rows.m[r];
      l[idx] = rows.l[r];
    }
    return true;
  }
#endif
  return false;
}

}  // namespace

// From how many rows of a work item the AMX step runs (attention_amx.h); returns the old value, -1 where that step is
// not compiled in.
int64_t set_amx_attention_from_rows(int64_t rows) {
#if defined(QUANTKIT_ATTENTION_AMX)
  TORCH_CHECK(rows >= 1, "rows must be at least 1");
  return std::exchange(amxattn::from_rows(), rows);
#else
  return -1;
#endif
}

int64_t set_prefetch_blocks(int64_t blocks) {
  TORCH_CHECK(blocks >= 0, "blocks must be at least 0");
  return std::exchange(prefetch_blocks(), blocks);
}

// The AVX-512 step's switch between its per-row and widened-block paths (attention_avx512.h); -1 where
// that step is not compiled in.
int64_t set_widen_from_rows(int64_t rows) {
#if defined(QUANTKIT_AVX512)
  TORCH_CHECK(rows >= 1, "rows must be at least 1");
  return std::exchange(avx512::widen_from_rows(), rows);
#else
  return -1;
#endif
}

// The AVX-512 per-row step's folding of two rows that see the same keys in one pass (attention_avx512.h):
// on or off; returns the old setting (1 or 0), -1 where that step is not compiled in.
int64_t set_pair_rows(bool on) {
#if defined(QUANTKIT_AVX512)
  return std::exchange(avx512::pair_rows(), on) ? 1 : 0;
#else
  return -1;
#endif
}

// Cascade attention, first pass: the queries `tokens` (int32 [Q], rows of q) of every sequence that
// starts with the cache blocks `blocks` (int32 [P], each fully visible to all those queries) attend
// to those blocks; the online-softmax state goes to acc [T, heads, D] (sum of exp(s - m) * v), m (max
// scaled score) and l (sum of exp(s - m)) [T, heads], fp32, at the queries' rows, for paged_attention
// to continue from. Work items are (kv head, tile of PREFIX_TILE queries), in one parallel region.
// On AVX-512 an item folds the prefix blocks in place into all its rows, block by block
// (prefix_item_folded). Elsewhere it gathers its head's prefix keys and values once ([L, D] fp32,
// L = P * block_size) and runs two GEMMs, [tile x group, D] x [D, L] and [tile x group, L] x [L, D]
// (at::mm, single-threaded inside the region). Either way the prefix is read once per tile of sequences.
void shared_prefix_state_(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                          torch::Tensor blocks, torch::Tensor tokens, double scale, torch::Tensor acc,
                          torch::Tensor m, torch::Tensor l) {
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "q must be [T, heads, D] and the caches [num_blocks, block_size, kv_heads, D]");
  TORCH_CHECK(q.scalar_type() == key_cache.scalar_type() && q.scalar_type() == value_cache.scalar_type() &&
                  q.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "q and the caches must be contiguous and share a dtype");
  TORCH_CHECK(blocks.scalar_type() == torch::kInt32 && tokens.scalar_type() == torch::kInt32 &&
                  blocks.is_contiguous() && tokens.is_contiguous(),
              "blocks and tokens must be contiguous int32");
  TORCH_CHECK(acc.scalar_type() == torch::kFloat32 && m.scalar_type() == torch::kFloat32 &&
                  l.scalar_type() == torch::kFloat32 && acc.is_contiguous() && m.is_contiguous() &&
                  l.is_contiguous() && acc.sizes() == q.sizes() && m.numel() == q.size(0) * q.size(1) &&
                  l.numel() == m.numel(),
              "the state must be contiguous fp32: acc like q, m and l [T, heads]");
  const int64_t heads = q.size(1), d = q.size(2), block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == d && heads % kv_heads == 0, "q and the cache disagree on heads or head_dim");
  const int64_t group = heads / kv_heads, n_tokens = tokens.size(0), n_blocks = blocks.size(0);
  const int64_t keys = n_blocks * block_size, token_stride = kv_heads * d;
  const int32_t* tok = tokens.data_ptr<int32_t>();
  const int32_t* blk = blocks.data_ptr<int32_t>();
  for (int64_t i = 0; i < n_tokens; ++i) TORCH_CHECK(tok[i] >= 0 && tok[i] < q.size(0), "token row out of range");
  for (int64_t b = 0; b < n_blocks; ++b)
    TORCH_CHECK(blk[b] >= 0 && blk[b] < key_cache.size(0), "block id out of range");
  if (n_tokens == 0 || n_blocks == 0) return;
  const int64_t tiles = (n_tokens + PREFIX_TILE - 1) / PREFIX_TILE;
  float* accp = acc.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  float* lp = l.data_ptr<float>();
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "shared_prefix_state", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = key_cache.data_ptr<scalar_t>();
    const scalar_t* vp = value_cache.data_ptr<scalar_t>();
    at::parallel_for(0, kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t h = item / tiles, t0 = (item % tiles) * PREFIX_TILE;
        const int64_t n = std::min(PREFIX_TILE, n_tokens - t0), rows = n * group;
        if (prefix_item_folded(qp, kp, vp, tok + t0, blk, n_blocks, rows, h, heads, group, d, block_size, token_stride,
                               static_cast<float>(scale), accp, mp, lp))
          continue;
        auto k = torch::empty({keys, d}, f32), v = torch::empty({keys, d}, f32), qh = torch::empty({rows, d}, f32);
        float *kf = k.data_ptr<float>(), *vf = v.data_ptr<float>(), *qf = qh.data_ptr<float>();
        for (int64_t b = 0; b < n_blocks; ++b)  // head h of the prefix tokens, in order
          for (int64_t t = 0; t < block_size; ++t) {
            const int64_t src = (static_cast<int64_t>(blk[b]) * block_size + t) * token_stride + h * d;
            const int64_t dst = (b * block_size + t) * d;
            for (int64_t i = 0; i < d; ++i) {
              kf[dst + i] = static_cast<float>(kp[src + i]);
              vf[dst + i] = static_cast<float>(vp[src + i]);
            }
          }
        for (int64_t r = 0; r < rows; ++r) {  // row r: query tok[t0 + r / group], head h * group + r % group
          const scalar_t* src = qp + (static_cast<int64_t>(tok[t0 + r / group]) * heads + h * group + r % group) * d;
          for (int64_t i = 0; i < d; ++i) qf[r * d + i] = static_cast<float>(src[i]) * static_cast<float>(scale);
        }
        auto s = at::mm(qh, k.t());  // [rows, keys]
        auto mx = std::get<0>(s.max(1, /*keepdim=*/true));
        s.sub_(mx).exp_();
        auto out = at::mm(s, v);  // [rows, D]
        auto sum = s.sum(1);
        const float *op = out.data_ptr<float>(), *mxp = mx.data_ptr<float>(), *sp = sum.data_ptr<float>();
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t idx = static_cast<int64_t>(tok[t0 + r / group]) * heads + h * group + r % group;
          std::copy(op + r * d, op + (r + 1) * d, accp + idx * d);
          mp[idx] = mxp[r];
          lp[idx] = sp[r];
        }
      }
    });
  });
}

// See the top of this file for the shapes. Returns out [T, heads, D] in q's dtype.
// skip_blocks int32 [S] or empty: sequence s starts at block skip_blocks[s], continuing from the
// state (acc, m, l) that the shared prefix pass left for its queries when skip_blocks[s] > 0.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start,
                              double scale, torch::Tensor skip_blocks, torch::Tensor acc, torch::Tensor m,
                              torch::Tensor l) {
  check_inputs(q, key_cache, value_cache, block_tables, seq_lens, query_start);
  const bool cascade = skip_blocks.numel() > 0;
  TORCH_CHECK(!cascade || (skip_blocks.scalar_type() == torch::kInt32 && skip_blocks.numel() == seq_lens.size(0) &&
                           acc.scalar_type() == torch::kFloat32 && acc.sizes() == q.sizes() && acc.is_contiguous() &&
                           m.is_contiguous() && l.is_contiguous() && m.numel() == q.size(0) * q.size(1) &&
                           l.numel() == m.numel()),
              "skip_blocks must be int32 [S] with the fp32 state of the shared prefix pass");
  const int32_t* skips = cascade ? skip_blocks.data_ptr<int32_t>() : nullptr;
  const PrefixState state = cascade ? PrefixState{acc.data_ptr<float>(), m.data_ptr<float>(), l.data_ptr<float>()}
                                    : PrefixState{nullptr, nullptr, nullptr};
  const int64_t heads = q.size(1), d = q.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  const int64_t width = block_tables.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start.data_ptr<int32_t>();
  std::vector<WorkItem> items;
  for (int64_t s = 0; s < seq_lens.size(0); ++s) {
    const int64_t n = starts[s + 1] - starts[s];
    TORCH_CHECK(n >= 0 && n <= lens[s], "sequence ", s, " has more queries than tokens");
    TORCH_CHECK((lens[s] + block_size - 1) / block_size <= width, "sequence ", s, " needs more blocks than its table");
    TORCH_CHECK(!cascade || (skips[s] >= 0 && (n == 0 || skips[s] * block_size <= lens[s] - n + 1)),
                "sequence ", s, ": its shared prefix blocks are not all visible to its first query");
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t b = starts[s]; b < starts[s + 1]; b += QUERY_TILE)
        items.push_back({s, h, b, std::min<int64_t>(b + QUERY_TILE, starts[s + 1])});
  }
  TORCH_CHECK(query_start.size(0) == 1 || starts[seq_lens.size(0)] <= q.size(0), "query_start runs past q");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_cpu", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = key_cache.data_ptr<scalar_t>();
    const scalar_t* vp = value_cache.data_ptr<scalar_t>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const WorkItem& w = items[i];
        attend_item<scalar_t>(w, qp, kp, vp, tables + w.seq * width, lens[w.seq], starts[w.seq],
                              starts[w.seq + 1] - starts[w.seq], op, heads, kv_heads, d, block_size,
                              static_cast<float>(scale), cascade ? skips[w.seq] : 0, &state);
      }
    });
  });
  return out;
}

// fused_ops_cpu.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate, torch::Tensor up);
void rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);
torch::Tensor rope_and_cache(torch::Tensor qkv, torch::Tensor positions, torch::Tensor table, torch::Tensor key_cache,
                             torch::Tensor value_cache, torch::Tensor slots, int64_t hq, int64_t hk);
torch::Tensor argmax_rows(torch::Tensor x);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  auto dev = m.def_submodule("dev", "development-only tuning switches, for benchmarks and tests; production code "
                             "never calls them");
  m.def("paged_attention", &paged_attention,
        "causal attention of each sequence's new queries over its paged KV cache, read in place");
  m.def("shared_prefix_state_", &shared_prefix_state_,
        "cascade first pass: the queries of the sequences sharing prefix blocks over those blocks, state out");
  dev.def("set_widen_from_rows", &set_widen_from_rows,
        "rows of a work item from which a block is widened once for all of them (AVX-512); returns the old value");
  dev.def("set_pair_rows", &set_pair_rows,
        "whether the per-row step folds two rows with the same keys together (AVX-512); returns the old setting");
  dev.def("set_amx_attention_from_rows", &set_amx_attention_from_rows,
        "rows of a work item from which a bf16 cache is attended on AMX tiles; returns the old value (-1: not built)");
  amx::bind_switches(m, dev);
  dev.def("set_prefetch_blocks", &set_prefetch_blocks,
        "how many cache blocks ahead of the one being folded are prefetched (0: none); returns the old value");
  m.def("rms_norm", &rms_norm, "RMSNorm, fp32");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = RMSNorm(residual), in place, fp32");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up, fp32");
  m.def("rotary_", &rotary_, "rotate-half RoPE on q and k in place, fp32");
  m.def("rope_and_cache", &rope_and_cache,
        "q, k, v of the fused projection: q rotated out, k rotated and v copied into the caches' slots");
  m.def("argmax_rows", &argmax_rows, "the first maximum's index of each row of a fp32 [rows, n], as torch.argmax");
}
