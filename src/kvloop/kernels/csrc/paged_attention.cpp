// Paged attention over a block-table KV cache, read in place (no gather copy).
//
// One entry point covers decode rows and prefill chunks: sequence n owns query rows
// [query_start[n], query_start[n+1]) of q, the last L = query_start[n+1] - query_start[n]
// positions of its context_lens[n] tokens, whose K/V are already in the cache. Row i of
// the L (position ctx - L + i) sees keys 0..ctx-L+i: decode is L == 1, a prefill chunk
// over a cached prefix is L > 1 (causal inside the chunk). With a sliding `window` > 0,
// position p sees only keys p - window + 1 .. p (HF's sliding-window mask): the walk over
// the keys starts at the item's first visible one, so blocks before it (dropped from a
// sliding KV cache group, whatever their table entries say) are never read. A plan may
// soft-cap the scaled scores (Gemma 2: cap * tanh(score / cap)) before the softmax.
//
// Work item = (sequence, kv head, tile of query rows). All query heads of the GQA group
// (and, for prefill, several rows) are handled together, so each K/V row is pulled from
// memory once per item and then reused from L1 for every query vector. Keys are walked
// in tiles of kTile with an online softmax (running max + sum, fp32), flash-decoding style.
//
// The cache holds fp32, bf16, fp16 or int8 rows (kv_dtype.h); every kernel below is a
// template over the element type T. Rows are converted to fp32 in registers as they are
// read (bf16: a 16-bit shift, fp16: F16C, int8: sign extension), so the arithmetic is fp32
// throughout. An int8 row's scale is applied once per row, not per element: a score is
// s_k * (q . codes), and the softmax weight of a V row is multiplied by s_v before the PV
// accumulation. The fp32 instantiation is the kernel as it was before the other dtypes.
//
// Compiled with AVX2/FMA intrinsics when __AVX2__ is defined; otherwise plain loops.

#include "kvloop.h"

// Narrow ATen headers instead of <torch/extension.h>: the first build compiles ~3x faster.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "kv_dtype.h"
#include "simd.h"

namespace kvloop {
namespace {

// Keys per online-softmax step. The scores of a tile sit in a small stack buffer, and
// 32 K rows + 32 V rows of D=64 (16 KiB) stay in L1 while every query vector uses them.
constexpr int64_t kTile = 32;
// Query vectors (rows x group heads) per work item: enough to amortise the K/V reads
// of a prefill tile, small enough for the accumulators ([kMaxQ, D]) to stay in L1.
constexpr int64_t kMaxQ = 16;
// Query vectors per register block in the inner loops (accumulators live in registers).
constexpr int kQBlock = 4;
// Work per thread (Item::cost units, ~6-9 ns each when K/V come from DRAM) below which
// another thread is not worth waking: ~30 us. A tiny call (B=1, short context) then
// pays no fork/join, which costs far more than the work when the other core is busy.
constexpr int64_t kMinCostPerThread = 4096;

// K/V rows of the next tile are software-prefetched into L2 (locality 2 = prefetcht1)
// while the current tile is computed, one key's rows per step of the score loop. Blocks
// are scattered, so the hardware prefetcher loses the stream at every block boundary.
// Measured at B=32, 1 thread, DRAM-resident cache (median ms): no prefetch 3.6; the whole
// next tile at the start of a tile, into L1 3.6, into L2 2.3-2.6; spread over the score
// loop, into L1 3.1, into L2 1.6-1.9 (hot-cache compute alone: 0.55).
constexpr int kPrefetchLocality = 2;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#ifdef __AVX2__

// exp(x) for x <= 0 (a score minus its running max), Cephes-style: 2^n * poly(r),
// ~2 ulp. Inputs below -87 (including -inf for masked keys) return exactly 0; NaN stays
// NaN, so a NaN in the model's K shows in the output as it would with SDPA.
inline __m256 exp_nonpos(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  const __m256 nan = _mm256_and_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q), x);
  x = _mm256_max_ps(x, lo);  // also maps -inf to a finite value before the arithmetic
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i n = _mm256_cvtps_epi32(fx);
  const __m256 pow2n =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
  return _mm256_or_ps(_mm256_and_ps(_mm256_mul_ps(y, pow2n), keep), nan);
}

#endif  // __AVX2__

// Walks a sequence's keys slot by slot through its block table: no division per key.
template <typename index_t>
struct SlotCursor {
  const index_t* table;
  int64_t block_size;
  int64_t blk = 0, off = 0;

  SlotCursor(const index_t* t, int64_t bs, int64_t key = 0)
      : table(t), block_size(bs), blk(key / bs), off(key % bs) {}

  int64_t next() {
    const int64_t slot = static_cast<int64_t>(table[blk]) * block_size + off;
    if (++off == block_size) {
      off = 0;
      ++blk;
    }
    return slot;
  }
};

// Prefetch-only helpers must be inlined early: GCC's pure-const analysis sees a function
// whose only effect is __builtin_prefetch as side-effect free and deletes every call to
// it (which silently removed all prefetches from an earlier version of this file).
#define KVLOOP_ALWAYS_INLINE inline __attribute__((always_inline))

// Every cache line the `bytes` bytes of a row touch (one more when it is not aligned).
KVLOOP_ALWAYS_INLINE void prefetch_row(const void* row, int64_t bytes) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(row);
  const uintptr_t end = begin + bytes;
  for (uintptr_t a = begin & ~uintptr_t{63}; a < end; a += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(a), 0, kPrefetchLocality);
}

// The K and V row pointers of one tile of keys (int8: and their scales').
template <typename T>
struct TileRows {
  const T* k[kTile];
  const T* v[kTile];
  const f16_t* ks[kTile];  // int8 only
  const f16_t* vs[kTile];
  int64_t n = 0;

  template <typename index_t>
  void load(SlotCursor<index_t>& cur, int64_t count, const T* kbase, const T* vbase,
            const f16_t* ksbase, const f16_t* vsbase, int64_t D) {
    n = count;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t slot = cur.next();
      k[j] = kbase + slot * D;
      v[j] = vbase + slot * D;
      if constexpr (kQuantized<T>) {
        ks[j] = ksbase + slot;
        vs[j] = vsbase + slot;
      }
    }
  }

  KVLOOP_ALWAYS_INLINE void prefetch(int64_t from, int64_t to, int64_t D) const {
    for (int64_t j = from; j < std::min(to, n); ++j) {
      prefetch_row(k[j], D * static_cast<int64_t>(sizeof(T)));
      prefetch_row(v[j], D * static_cast<int64_t>(sizeof(T)));
      if constexpr (kQuantized<T>) {  // a block's scales share a line: cheap repeats
        __builtin_prefetch(ks[j], 0, kPrefetchLocality);
        __builtin_prefetch(vs[j], 0, kPrefetchLocality);
      }
    }
  }
};

// s[i * kTile + j] = dot(q[i], k_j) for NQ query vectors (rows of q, stride D), j < n
// (int8: times the row's scale). Also prefetches row j of `ahead` (the next tile) at key
// j, if given: spread over the loop, the prefetches never pile up in the miss queues.
template <int NQ, typename T>
inline void dot_block(const float* q, const TileRows<T>& rows, int64_t n, int64_t D,
                      float* s, const TileRows<T>* ahead) {
  for (int64_t j = 0; j < n; ++j) {
    if (ahead != nullptr) ahead->prefetch(j, j + 1, D);
    const T* k = rows.k[j];
    float tot[NQ];
    int64_t d = 0;
#ifdef __AVX2__
    // Two accumulators per query vector: independent FMA chains hide the FMA latency.
    __m256 a0[NQ], a1[NQ];
    for (int i = 0; i < NQ; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
    for (; d + 16 <= D; d += 16) {
      const __m256 k0 = load8(k + d), k1 = load8(k + d + 8);
      for (int i = 0; i < NQ; ++i) {
        a0[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * D + d), k0, a0[i]);
        a1[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * D + d + 8), k1, a1[i]);
      }
    }
    for (; d + 8 <= D; d += 8) {
      const __m256 k0 = load8(k + d);
      for (int i = 0; i < NQ; ++i)
        a0[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * D + d), k0, a0[i]);
    }
    for (int i = 0; i < NQ; ++i) tot[i] = hsum(_mm256_add_ps(a0[i], a1[i]));
#else
    for (int i = 0; i < NQ; ++i) tot[i] = 0.f;
#endif
    for (; d < D; ++d)
      for (int i = 0; i < NQ; ++i) tot[i] += q[i * D + d] * to_f32(k[d]);
    if constexpr (kQuantized<T>) {
      const float ks = static_cast<float>(*rows.ks[j]);
      for (int i = 0; i < NQ; ++i) s[i * kTile + j] = tot[i] * ks;
    } else {
      for (int i = 0; i < NQ; ++i) s[i * kTile + j] = tot[i];
    }
  }
}

// acc[i] += sum_j p[i * kTile + j] * v_j for NQ accumulators (rows of acc, stride D), j < n
// (int8: p already carries each V row's scale, v_j are its codes).
template <int NQ, typename T>
inline void pv_block(const float* p, const T* const* vrows, int64_t n, int64_t D,
                     float* acc) {
  int64_t d = 0;
#ifdef __AVX2__
  // D outer, keys inner: the NQ x 16 accumulator slice stays in registers across the
  // tile while the V rows (hot in L1 after the first slice) stream past.
  for (; d + 16 <= D; d += 16) {
    __m256 o0[NQ], o1[NQ];
    for (int i = 0; i < NQ; ++i) {
      o0[i] = _mm256_loadu_ps(acc + i * D + d);
      o1[i] = _mm256_loadu_ps(acc + i * D + d + 8);
    }
    for (int64_t j = 0; j < n; ++j) {
      const __m256 v0 = load8(vrows[j] + d), v1 = load8(vrows[j] + d + 8);
      for (int i = 0; i < NQ; ++i) {
        const __m256 w = _mm256_broadcast_ss(p + i * kTile + j);
        o0[i] = _mm256_fmadd_ps(w, v0, o0[i]);
        o1[i] = _mm256_fmadd_ps(w, v1, o1[i]);
      }
    }
    for (int i = 0; i < NQ; ++i) {
      _mm256_storeu_ps(acc + i * D + d, o0[i]);
      _mm256_storeu_ps(acc + i * D + d + 8, o1[i]);
    }
  }
  for (; d + 8 <= D; d += 8) {
    __m256 o0[NQ];
    for (int i = 0; i < NQ; ++i) o0[i] = _mm256_loadu_ps(acc + i * D + d);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 v0 = load8(vrows[j] + d);
      for (int i = 0; i < NQ; ++i)
        o0[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + i * kTile + j), v0, o0[i]);
    }
    for (int i = 0; i < NQ; ++i) _mm256_storeu_ps(acc + i * D + d, o0[i]);
  }
#endif
  for (; d < D; ++d)
    for (int64_t j = 0; j < n; ++j)
      for (int i = 0; i < NQ; ++i) acc[i * D + d] += p[i * kTile + j] * to_f32(vrows[j][d]);
}

// max(s[0..n)), n >= 1. (A plain std::max loop kept the running max on the stack.)
inline float max_of(const float* s, int64_t n) {
  int64_t j = 0;
  float m = kNegInf;
#ifdef __AVX2__
  if (n >= 8) {
    __m256 mv = _mm256_loadu_ps(s);
    for (j = 8; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    m = _mm_cvtss_f32(h);
  }
#endif
  for (; j < n; ++j) m = s[j] > m ? s[j] : m;
  return m;
}

// In place s[j] = exp(s[j] - m) for j < n; returns the sum.
inline float exp_shift_sum(float* s, int64_t n, float m) {
  int64_t j = 0;
  float sum = 0.f;
#ifdef __AVX2__
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(acc);
#endif
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  return sum;
}

// Dispatch a register-blocked kernel over m query vectors in blocks of up to kQBlock.
// n_of(b, e) is how many keys of the tile query vectors [b, e) need (the max over them).
template <typename F, typename N>
inline void for_qblocks(int64_t m, const N& n_of, const F& f) {
  for (int64_t b = 0; b < m; b += kQBlock) {
    const int64_t e = std::min(m, b + kQBlock);
    const int64_t n = n_of(b, e);
    if (n <= 0) continue;
    f(b, e - b, n);
  }
}

using Item = AttentionItem;

struct Problem {
  const float* q;       // [T, H, D]
  const void* cache;    // [2, Hkv, slots, D] of the element type the kernels run for
  const f16_t* scales;  // [2, Hkv, slots], int8 only
  float* out;           // [T, H, D]
  const int64_t* qstart;  // [N + 1]
  const int64_t* ctx;     // [N]
  int64_t H, Hkv, G, D, slots, block_size, max_blocks;
  float scale;
  int64_t window;  // > 0: sliding window (keys a query sees, its own included); 0: none
  int64_t key_block;  // int8: keys are stored rotated over blocks of this (kv_dtype.h)
  float softcap;      // > 0: scores = softcap * tanh(scores / softcap) (Gemma 2); 0: none
};

// The first key position `pos` sees.
inline int64_t first_visible(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

// The first key an item reads: the one its first query row sees first.
inline int64_t item_first_key(const Problem& P, const Item& it) {
  const int64_t L = P.qstart[it.seq + 1] - P.qstart[it.seq];
  return first_visible(P.ctx[it.seq] - L + it.row0, P.window);
}

// Keys the item reads: its last query row sees the most.
inline int64_t item_keys(const Problem& P, const Item& it) {
  const int64_t L = P.qstart[it.seq + 1] - P.qstart[it.seq];
  return P.ctx[it.seq] - L + it.row0 + it.nrows;
}

// Where a kv head's K (kv = 0) or V (kv = 1) rows, and their scales, begin.
template <typename T>
inline const T* head_rows(const Problem& P, int64_t kv, int64_t head) {
  return static_cast<const T*>(P.cache) + (kv * P.Hkv + head) * P.slots * P.D;
}
inline const f16_t* head_scales(const Problem& P, int64_t kv, int64_t head) {
  return P.scales == nullptr ? nullptr : P.scales + (kv * P.Hkv + head) * P.slots;
}

// The row pointers of an item's first tile.
template <typename index_t, typename T>
void first_tile(const Problem& P, const index_t* tables, const Item& it, TileRows<T>& t) {
  const int64_t kbeg = item_first_key(P, it);
  SlotCursor<index_t> cur(tables + it.seq * P.max_blocks, P.block_size, kbeg);
  t.load(cur, std::min(kTile, item_keys(P, it) - kbeg), head_rows<T>(P, 0, it.kv_head),
         head_rows<T>(P, 1, it.kv_head), head_scales(P, 0, it.kv_head),
         head_scales(P, 1, it.kv_head), P.D);
}

// One work item. `next` (if any) is the item this thread runs afterwards: its first tile
// is prefetched during this item's last one.
template <typename index_t, typename T>
void run_item(const Problem& P, const index_t* tables, const Item& it, const Item* next,
              float* qs, float* acc, float* s, TileRows<T>* tiles /*[2]*/) {
  const int64_t D = P.D, G = P.G, ng = it.ng, bs = P.block_size;
  const int64_t L = P.qstart[it.seq + 1] - P.qstart[it.seq];
  const int64_t ctx = P.ctx[it.seq];
  const int64_t M = it.nrows * ng;  // query vectors: m = r * ng + g
  const index_t* table = tables + it.seq * P.max_blocks;
  const T* kbase = head_rows<T>(P, 0, it.kv_head);
  const T* vbase = head_rows<T>(P, 1, it.kv_head);
  const f16_t* ksbase = head_scales(P, 0, it.kv_head);
  const f16_t* vsbase = head_scales(P, 1, it.kv_head);

  // Visible keys per query vector: [lo, vis); both non-decreasing in m (rows ascend,
  // heads share a row).
  int64_t vis[kMaxQ], lo[kMaxQ];
  float run_max[kMaxQ], run_sum[kMaxQ];
  for (int64_t r = 0; r < it.nrows; ++r) {
    const int64_t t = P.qstart[it.seq] + it.row0 + r;
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t m = r * ng + g;
      vis[m] = ctx - L + it.row0 + r + 1;
      lo[m] = first_visible(vis[m] - 1, P.window);
      run_max[m] = kNegInf;
      run_sum[m] = 0.f;
      // Fold the softmax scale into q once instead of into every score.
      const float* src = P.q + (t * P.H + it.kv_head * G + it.g0 + g) * D;
      float* qm = qs + m * D;
      if (kQuantized<T> && P.key_block > 1) {
        // Into the keys' rotated basis: q' = H q / b, so q' . (H k) = q . k (1 / b is a
        // power of two: exact).
        std::copy(src, src + D, qm);
        fwht(qm, D, P.key_block);
        const float sc = P.scale / static_cast<float>(P.key_block);
        for (int64_t d = 0; d < D; ++d) qm[d] *= sc;
      } else {
        for (int64_t d = 0; d < D; ++d) qm[d] = src[d] * P.scale;
      }
    }
  }
  std::fill(acc, acc + M * D, 0.f);
  const int64_t kend = vis[M - 1];  // == item_keys(P, it)
  // Keys of a tile that query vectors [b, e) need: the last of them sees the most.
  const auto n_of = [&vis](int64_t j0, int64_t n) {
    return [&vis, j0, n](int64_t /*b*/, int64_t e) { return std::min(n, vis[e - 1] - j0); };
  };

  const int64_t kbeg = lo[0];  // == item_first_key(P, it)
  // Double-buffered tiles: the next one is loaded (and prefetched) during this one.
  SlotCursor<index_t> cursor(table, bs, kbeg);
  tiles[0].load(cursor, std::min(kTile, kend - kbeg), kbase, vbase, ksbase, vsbase, D);
  int cur = 0;
  for (int64_t j0 = kbeg; j0 < kend; j0 += kTile) {
    const int64_t n = std::min(kTile, kend - j0);
    const TileRows<T>& now = tiles[cur];
    TileRows<T>& ahead = tiles[1 - cur];
    if (j0 + kTile < kend)
      ahead.load(cursor, std::min(kTile, kend - j0 - kTile), kbase, vbase, ksbase, vsbase, D);
    else if (next != nullptr)
      first_tile(P, tables, *next, ahead);
    else
      ahead.n = 0;
    cur = 1 - cur;
    const T* const* vr = now.v;
    int64_t prefetched = 0;  // rows of `ahead` the first score block prefetched

    for_qblocks(M, n_of(j0, n), [&](int64_t b, int64_t nq, int64_t nk) {
      const float* qb = qs + b * D;
      float* sb = s + b * kTile;
      const TileRows<T>* pf = b == 0 ? &ahead : nullptr;
      if (b == 0) prefetched = nk;
      switch (nq) {
        case 1: dot_block<1>(qb, now, nk, D, sb, pf); break;
        case 2: dot_block<2>(qb, now, nk, D, sb, pf); break;
        case 3: dot_block<3>(qb, now, nk, D, sb, pf); break;
        default: dot_block<4>(qb, now, nk, D, sb, pf); break;
      }
    });
    ahead.prefetch(prefetched, kTile, D);  // rows the score loop had no key for

    for (int64_t m = 0; m < M; ++m) {
      float* sm = s + m * kTile;
      const int64_t nv = std::clamp<int64_t>(vis[m] - j0, 0, n);
      // Keys before this vector's window start (a later row of the block may see them)
      // or past its causal limit get weight 0 (the PV block may still walk them for
      // another row of the same block).
      const int64_t a = std::clamp<int64_t>(lo[m] - j0, 0, nv);
      std::fill(sm, sm + a, 0.f);
      std::fill(sm + nv, sm + n, 0.f);
      if (nv == a) continue;
      if (P.softcap > 0.f)  // on the scaled scores, before the softmax (HF's order)
        for (int64_t j = a; j < nv; ++j) sm[j] = P.softcap * std::tanh(sm[j] / P.softcap);
      const float new_max = std::max(run_max[m], max_of(sm + a, nv - a));
      const float sum = exp_shift_sum(sm + a, nv - a, new_max);
      if (new_max != run_max[m]) {
        const float alpha = std::exp(run_max[m] - new_max);  // 0 on the first tile
        run_sum[m] *= alpha;
        float* am = acc + m * D;
        for (int64_t d = 0; d < D; ++d) am[d] *= alpha;
        run_max[m] = new_max;
      }
      run_sum[m] += sum;
    }
    if constexpr (kQuantized<T>) {
      // The V rows' scales go into the weights (after the sums above, which must not see
      // them): M * n multiplies instead of M * n * D.
      float vsc[kTile];
      for (int64_t j = 0; j < n; ++j) vsc[j] = static_cast<float>(*now.vs[j]);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < n; ++j) s[m * kTile + j] *= vsc[j];
    }

    for_qblocks(M, n_of(j0, n), [&](int64_t b, int64_t nq, int64_t nk) {
      const float* pb = s + b * kTile;
      float* ab = acc + b * D;
      switch (nq) {
        case 1: pv_block<1>(pb, vr, nk, D, ab); break;
        case 2: pv_block<2>(pb, vr, nk, D, ab); break;
        case 3: pv_block<3>(pb, vr, nk, D, ab); break;
        default: pv_block<4>(pb, vr, nk, D, ab); break;
      }
    });
  }

  for (int64_t r = 0; r < it.nrows; ++r) {
    const int64_t t = P.qstart[it.seq] + it.row0 + r;
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t m = r * ng + g;
      const float inv = 1.f / run_sum[m];
      float* dst = P.out + (t * P.H + it.kv_head * G + it.g0 + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = acc[m * D + d] * inv;
    }
  }
}

template <typename index_t, typename T>
void run_items(const Problem& P, const index_t* tables, const std::vector<Item>& items,
               const std::vector<int64_t>& prefix, int64_t parts) {
  const int64_t nitems = static_cast<int64_t>(items.size());
  const int64_t total = prefix[nitems];
  at::parallel_for(0, parts, 1, [&](int64_t pbegin, int64_t pend) {
    // Per-thread scratch, kept between calls (a decode step runs this once per layer).
    thread_local std::vector<float> qs, acc, s;
    const int64_t kq = kMaxQ * P.D;
    if (static_cast<int64_t>(qs.size()) < kq) {
      qs.resize(kq);
      acc.resize(kq);
    }
    s.resize(kMaxQ * kTile);
    TileRows<T> tiles[2];
    for (int64_t part = pbegin; part < pend; ++part) {
      // Items whose cost prefix starts in this part's share of the total.
      const auto lo = std::lower_bound(prefix.begin(), prefix.end() - 1, total * part / parts);
      const auto hi = std::lower_bound(prefix.begin(), prefix.end() - 1,
                                       total * (part + 1) / parts);
      const int64_t ib = lo - prefix.begin();
      const int64_t ie = part + 1 == parts ? nitems : hi - prefix.begin();
      for (int64_t i = ib; i < ie; ++i)
        run_item<index_t, T>(P, tables, items[i], i + 1 < ie ? &items[i + 1] : nullptr,
                             qs.data(), acc.data(), s.data(), tiles);
    }
  });
}

}  // namespace

AttentionPlan::AttentionPlan(int64_t T, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t slots, const at::Tensor& block_tables,
                             const std::optional<at::Tensor>& query_start,
                             const at::Tensor& context_lens, int64_t block_size, double scale,
                             int64_t window, double softcap)
    : H_(num_heads), Hkv_(num_kv_heads), D_(head_dim), slots_(slots),
      block_size_(block_size), scale_(static_cast<float>(scale)), window_(window),
      softcap_(static_cast<float>(softcap)) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no sliding window)");
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0: none)");
  TORCH_CHECK(block_tables.dim() == 2 && (block_tables.scalar_type() == at::kLong ||
                                          block_tables.scalar_type() == at::kInt),
              "block_tables must be an int32/int64 [N, max_blocks] tensor");
  TORCH_CHECK(block_size > 0, "block_size must be positive");
  TORCH_CHECK(Hkv_ > 0 && H_ % Hkv_ == 0, "query heads must be a multiple of kv heads");
  const int64_t G = H_ / Hkv_;
  const int64_t N = block_tables.size(0), max_blocks = block_tables.size(1);
  // No query_start: one query row per sequence (decode).
  qstart_t_ = query_start.has_value() ? query_start->to(at::kLong).contiguous()
                                      : at::arange(N + 1, at::kLong);
  ctx_t_ = context_lens.to(at::kLong).contiguous();
  TORCH_CHECK(qstart_t_.dim() == 1 && qstart_t_.numel() == N + 1, "query_start must be [N + 1]");
  TORCH_CHECK(ctx_t_.dim() == 1 && ctx_t_.numel() == N, "context_lens must be [N]");
  tables_t_ = block_tables.contiguous();
  const int64_t* qstart = qstart_t_.data_ptr<int64_t>();
  const int64_t* ctx = ctx_t_.data_ptr<int64_t>();
  TORCH_CHECK(qstart[0] == 0 && qstart[N] == T, "query_start must run from 0 to T");

  // Pack query rows x group heads into items of up to kMaxQ vectors: whole groups (and,
  // for prefill, several rows) when they fit, slices of a group when G > kMaxQ.
  const int64_t head_tile = std::min(G, kMaxQ);
  const int64_t rows_per_item = kMaxQ / head_tile;
  items_.reserve(N * Hkv_);
  const int64_t blocks_avail = slots / block_size;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t L = qstart[n + 1] - qstart[n];
    TORCH_CHECK(L >= 0, "query_start must be non-decreasing");
    TORCH_CHECK(ctx[n] >= L, "sequence ", n, ": context_len ", ctx[n], " < its ", L,
                " query rows");
    TORCH_CHECK(ctx[n] <= max_blocks * block_size, "sequence ", n, ": context_len ", ctx[n],
                " exceeds its block table");
    // Validate every block the kernel will read, so a bad table is an error, not a segfault.
    const int64_t used = (ctx[n] + block_size - 1) / block_size;
    const int64_t first = first_visible(ctx[n] - L, window) / block_size;
    AT_DISPATCH_INDEX_TYPES(tables_t_.scalar_type(), "paged_attention_check", [&] {
      const index_t* row = tables_t_.data_ptr<index_t>() + n * max_blocks;
      for (int64_t b = first; b < used; ++b)
        TORCH_CHECK(row[b] >= 0 && row[b] < blocks_avail, "sequence ", n, ": block id ",
                    static_cast<int64_t>(row[b]), " out of range [0, ", blocks_avail, ")");
    });
    for (int64_t r0 = 0; r0 < L; r0 += rows_per_item) {
      const int64_t nr = std::min(rows_per_item, L - r0);
      // The tile's last row sees the most keys; with a window, from its first row's first.
      const int64_t keys = ctx[n] - L + r0 + nr - first_visible(ctx[n] - L + r0, window);
      for (int64_t h = 0; h < Hkv_; ++h)
        for (int64_t g0 = 0; g0 < G; g0 += head_tile) {
          const int64_t ng = std::min(head_tile, G - g0);
          items_.push_back({n, h, r0, nr, g0, ng, (keys + 8) * (nr * ng + 2)});
        }
    }
  }
  // Static split into one contiguous range per thread with equal total cost: sequence
  // lengths differ, and at::parallel_for alone would split by item count.
  const int64_t nitems = static_cast<int64_t>(items_.size());
  prefix_.assign(nitems + 1, 0);
  for (int64_t i = 0; i < nitems; ++i) prefix_[i + 1] = prefix_[i] + items_[i].cost;
  // Small calls stay on the calling thread: waking the pool costs more than it saves.
  parts_ = std::clamp<int64_t>(std::min<int64_t>(prefix_[nitems] / kMinCostPerThread, nitems),
                               1, at::get_num_threads());
}

void AttentionPlan::run(const float* q, const KVView& kv, float* out) const {
  if (items_.empty()) return;
  TORCH_CHECK(kv.Hkv == Hkv_ && kv.slots == slots_ && kv.D == D_,
              "the KV cache's shape is not the one the attention plan was built for");
  const Problem P{q, kv.data, kv.scales, out, qstart_t_.data_ptr<int64_t>(),
                  ctx_t_.data_ptr<int64_t>(), H_, Hkv_, H_ / Hkv_, D_, slots_, block_size_,
                  tables_t_.size(1), scale_, window_, kv.key_block, softcap_};
  AT_DISPATCH_INDEX_TYPES(tables_t_.scalar_type(), "paged_attention", [&] {
    dispatch_kv(kv.dtype, [&](auto elem) {
      run_items<index_t, decltype(elem)>(P, tables_t_.data_ptr<index_t>(), items_, prefix_,
                                         parts_);
    });
  });
}

KVView kv_view(const at::Tensor& cache, const std::optional<at::Tensor>& scales) {
  TORCH_CHECK(cache.dim() == 4 && cache.size(0) == 2 && cache.is_contiguous() &&
                  !cache.is_cuda(),
              "kv_cache must be a contiguous CPU [2, Hkv, slots, D] tensor");
  KVView v;
  switch (cache.scalar_type()) {
    case at::kFloat: v.dtype = KVDtype::F32; break;
    case at::kBFloat16: v.dtype = KVDtype::BF16; break;
    case at::kHalf: v.dtype = KVDtype::F16; break;
    case at::kChar: v.dtype = KVDtype::I8; break;
    default:
      TORCH_CHECK(false, "kv_cache must be float32, bfloat16, float16 or int8, got ",
                  cache.scalar_type());
  }
  v.data = cache.data_ptr();
  v.Hkv = cache.size(1);
  v.slots = cache.size(2);
  v.D = cache.size(3);
  if (v.dtype == KVDtype::I8) {
    TORCH_CHECK(scales.has_value() && scales->scalar_type() == at::kHalf &&
                    scales->dim() == 3 && scales->size(0) == 2 && scales->size(1) == v.Hkv &&
                    scales->size(2) == v.slots && scales->is_contiguous(),
                "an int8 kv_cache needs kv_scales, a contiguous float16 [2, Hkv, slots] "
                "tensor");
    v.scales = reinterpret_cast<f16_t*>(scales->data_ptr());
    v.key_block = key_block(v.D);
  } else {
    TORCH_CHECK(!scales.has_value(), "kv_scales are for an int8 kv_cache only");
  }
  return v;
}

void kv_store(const at::Tensor& kv_cache, const std::optional<at::Tensor>& kv_scales,
              const at::Tensor& slot_mapping, const at::Tensor& k, const at::Tensor& v) {
  const KVView kv = kv_view(kv_cache, kv_scales);
  const auto slots_t = slot_mapping.to(at::kLong).contiguous();
  const int64_t T = slots_t.numel();
  for (const auto* x : {&k, &v})
    TORCH_CHECK(x->scalar_type() == at::kFloat && x->is_contiguous() && x->dim() == 3 &&
                    x->size(0) == T && x->size(1) == kv.Hkv && x->size(2) == kv.D,
                "k and v must be contiguous float32 [T, Hkv, D] tensors, one row per slot");
  const int64_t* slot = slots_t.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < kv.slots, "slot ", slot[t], " out of range");
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  dispatch_kv(kv.dtype, [&](auto elem) {
    using T_ = decltype(elem);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < kv.Hkv; ++h) {
        kv_store_row<T_>(kv, 0, h, slot[t], kp + (t * kv.Hkv + h) * kv.D);
        kv_store_row<T_>(kv, 1, h, slot[t], vp + (t * kv.Hkv + h) * kv.D);
      }
  });
}

// q [T, H, D] fp32; kv_cache [2, Hkv, slots, D] fp32 / bf16 / fp16 / int8 (then with
// kv_scales [2, Hkv, slots] fp16); block_tables [N, max_blocks] int32/int64; query_start
// [N + 1] int64, row offsets into q (None: one row per sequence); context_lens [N] int64,
// tokens in the cache including the query rows; window > 0: each row sees only its last
// `window` positions (0: all); softcap > 0: scores = softcap * tanh(scores / softcap)
// (0: none). Returns [T, H, D] fp32.
at::Tensor paged_attention_varlen(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables,
                                  const std::optional<at::Tensor>& query_start,
                                  const at::Tensor& context_lens, int64_t block_size,
                                  double scale, int64_t window,
                                  const std::optional<at::Tensor>& kv_scales, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "q must be a contiguous float32 [T, H, D] tensor");
  TORCH_CHECK(!q.is_cuda(), "CPU tensors only");
  const KVView kv = kv_view(kv_cache, kv_scales);
  TORCH_CHECK(kv.D == q.size(2), "head_dim of q and kv_cache differ");
  const AttentionPlan plan(q.size(0), q.size(1), kv.Hkv, q.size(2), kv.slots, block_tables,
                           query_start, context_lens, block_size, scale, window, softcap);
  auto out = at::empty_like(q);
  plan.run(q.data_ptr<float>(), kv, out.data_ptr<float>());
  return out;
}

}  // namespace kvloop
