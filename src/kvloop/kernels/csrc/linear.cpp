// Linear layers, built for decode-sized batches (1..64 rows) and usable at any size:
// y = x W^T with W in fp32, int8 (per-channel scale), 4-bit (groups of 32, scale + min) or
// int8 codes with group scales (GGUF's block formats as stored) layout. See kvloop.h.
//
// At decode the whole weight is streamed from memory once per step, so these kernels are
// organised around the weight: each weight row is read once per (up to 64-row) chunk of
// activations and applied to every row of it (C at a time, in registers). Threads split
// the output rows. Quantized weights meet int8 activations (one scale per 32 values) in
// AVX2's u8 x s8 multiply-add (vpmaddubsw), 32 weights per instruction; that and 4-bit
// storage is what lets a step go faster than fp32 bandwidth allows.
//
// Compiled with AVX2/FMA intrinsics when __AVX2__ is defined, and with AVX-512 VNNI's
// u8 x s8 dot product (vpdpbusd: 32 multiply-adds into 8 int32 lanes in one instruction,
// where AVX2 needs four) on CPUs that have it; otherwise plain loops compute the same
// sums (the reference for the vector code is in kvloop.kernels.linear).

#include "kvloop.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include <c10/util/Half.h>

#include "simd.h"

namespace kvloop {
namespace {

constexpr int64_t kGroup = 32;
constexpr float kMinScale = 1e-30f;  // activation blocks with a smaller scale quantize to 0
constexpr int kCols = 4;  // activation rows sharing one pass over a weight row
constexpr int64_t kChunkRows = 64;  // activation rows per pass over the weights
// Batched fp32 activations (M >= kTileMinRows): tiles of kTileRows weight rows x kTileCols
// activation rows.
constexpr int64_t kTileMinRows = 4;
#ifdef __AVX512VL__
constexpr int kTileRows = 4, kTileCols = 5;  // 32 vector registers: 20 accumulators
#else
constexpr int kTileRows = 4, kTileCols = 3;
#endif
constexpr int64_t kQ4Block = 20;  // bytes per group: fp16 scale, fp16 min, 16 bytes of codes
constexpr int64_t kQ4FBlock = 24;  // Q4F: fp32 scale, fp32 min, 16 bytes of codes


#ifdef __AVX2__
// int8 x int8 dot products: vpmaddubsw wants u8 x s8, so w's sign moves onto x (|w| as u8
// <= 128, |x| <= 127: a pair sums to at most 32512, no saturation) - see row_q8.


// 16 bytes of one group -> its 32 codes in element order.
inline __m256i unpack_q4(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(raw, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  return _mm256_set_m128i(hi, lo);
}
#endif

#ifdef __AVX2__
// A pair of groups' 4-bit codes (lo: low nibbles, hi: high) against their activations in
// A.qp's order (xa, xb): lanes 0-3 the first group's int32 sums, 4-7 the second's.
inline __m256i q4_pair_dot(__m256i lo, __m256i hi, __m256i xa, __m256i xb) {
#ifdef KVLOOP_VNNI
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xa), hi, xb);
#else
  // Both halves' u4 x s8 pair sums added as int16 before the one widening madd: each
  // is at most 2 * 15 * 127 = 3810, so the sum (7620) cannot saturate, and a lane
  // still holds one group's products (A.qp's order), so nothing mixes.
  return _mm256_madd_epi16(
      _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xb)),
      _mm256_set1_epi16(1));
#endif
}
#endif

// ---- one weight row n against activation rows m0..m0+C ----
//
// A thread walks its share of the weight rows in order, each row read start to end, so
// the weights stream through memory sequentially: interleaving several rows (the usual
// register tiling of a GEMM) was measured to cut this CPU's bandwidth by half at batch 1
// (33 -> 15 GB/s), the hardware prefetcher losing track of the streams. Reuse comes from
// the activation side instead: C activation rows share every weight load. (Below kCols
// activation rows the 4-bit and head kernels do take a few adjacent rows together, and
// prefetch for themselves: rows_batch1.)

#ifdef __AVX2__
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// 16 fp32 weights (w0: k..k+7, w1: k+8..k+15) into each of C activation rows' two FMA
// chains (two per row: one chain alone is latency-bound at C == 1).
template <int C>
inline void fma16_rows(__m256 (&acc)[C][2], __m256 w0, __m256 w1, const float* X, int64_t K,
                       int64_t m0, int64_t k) {
  for (int c = 0; c < C; ++c) {
    acc[c][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(X + (m0 + c) * K + k), acc[c][0]);
    acc[c][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(X + (m0 + c) * K + k + 8), acc[c][1]);
  }
}
#endif

// fp32 activations against fp32 weights.
template <int C>
void row_dense(const float* W, const float* X, int64_t K, int64_t N, int64_t n, int64_t m0,
               float* Y) {
  const float* w = W + n * K;
  float out[C];
  int64_t k = 0;
#ifdef __AVX2__
  __m256 acc[C][2];
  for (int c = 0; c < C; ++c) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
  for (; k + 16 <= K; k += 16) fma16_rows<C>(acc, load8(w + k), load8(w + k + 8), X, K, m0, k);
  for (int c = 0; c < C; ++c) out[c] = hsum(_mm256_add_ps(acc[c][0], acc[c][1]));
#else
  for (int c = 0; c < C; ++c) out[c] = 0.f;
#endif
  for (; k < K; ++k)
    for (int c = 0; c < C; ++c) out[c] += w[k] * X[(m0 + c) * K + k];
  for (int c = 0; c < C; ++c) Y[(m0 + c) * N + n] = out[c];
}

// block(b, acc) for b in 0..nb: even blocks into acc0, odd ones into acc1 (two FMA chains in
// flight; two named arrays, since acc[b & 1] would index registers at run time and keep
// the accumulators in memory).
template <typename Acc, typename F>
inline void even_odd_blocks(int64_t nb, Acc* acc0, Acc* acc1, F&& block) {
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    block(b, acc0);
    block(b + 1, acc1);
  }
  if (b < nb) block(b, acc0);
}

// pair(b, acc) for the pairs of groups b, b + 1 in 0..nb, alternating acc0 and acc1 as
// even_odd_blocks does; returns the group it stopped at (nb, or nb - 1 for an odd last).
template <typename Acc, typename F>
inline int64_t even_odd_pairs(int64_t nb, Acc* acc0, Acc* acc1, F&& pair) {
  even_odd_blocks(nb / 2, acc0, acc1, [&](int64_t p, Acc* acc) { pair(2 * p, acc); });
  return nb / 2 * 2;
}

template <int C>
void row_q8(const int8_t* W, const float* scales, const QuantizedActs& A, int64_t N,
            int64_t n, int64_t m0, float* Y) {
  const int64_t K = A.K, nb = K / kGroup;
  const int8_t* w = W + n * K;
  float out[C];
#if defined(KVLOOP_VNNI)
  // vpdpbusd multiplies u8 by s8: flip the weights' sign bit (w + 128 as u8) and take the
  // excess back at the end: sum_b d_b (w + 128) . q_b = w . x + 128 sum_b d_b sum(q_b),
  // and sum_b d_b sum(q_b) is the row's A.ssum. Two accumulators per row (even and odd
  // blocks) keep enough FMA chains in flight.
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const int8_t* xq = A.q.data() + m0 * K;
  const float* xd = A.d.data() + m0 * nb;
  __m256 acc0[C], acc1[C];
  for (int c = 0; c < C; ++c) acc0[c] = acc1[c] = _mm256_setzero_ps();
  auto block = [&](int64_t b, __m256* acc) {
    const __m256i wv = _mm256_xor_si256(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kGroup)), flip);
    for (int c = 0; c < C; ++c) {
      const __m256i xv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c * K + b * kGroup));
      const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv, xv);
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(xd[c * nb + b]), acc[c]);
    }
  };
  even_odd_blocks(nb, acc0, acc1, block);
  for (int c = 0; c < C; ++c)
    out[c] = hsum(_mm256_add_ps(acc0[c], acc1[c])) - 128.f * A.ssum[m0 + c];
#elif defined(__AVX2__)
  // Two accumulators per row (even and odd blocks): at one activation row a single FMA
  // chain left the step waiting on its latency.
  __m256 acc0[C], acc1[C];
  for (int c = 0; c < C; ++c) acc0[c] = acc1[c] = _mm256_setzero_ps();
  auto block = [&](int64_t b, __m256* acc) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kGroup));
    for (int c = 0; c < C; ++c) {
      const __m256i dot = dot_s8s8(wv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                           A.q.data() + (m0 + c) * K + b * kGroup)));
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                               _mm256_set1_ps(A.d[(m0 + c) * nb + b]), acc[c]);
    }
  };
  even_odd_blocks(nb, acc0, acc1, block);
  for (int c = 0; c < C; ++c) out[c] = hsum(_mm256_add_ps(acc0[c], acc1[c]));
#else
  for (int c = 0; c < C; ++c) {
    float s = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      int32_t dot = 0;
      for (int64_t i = 0; i < kGroup; ++i)
        dot += int32_t(w[b * kGroup + i]) * int32_t(A.q[(m0 + c) * K + b * kGroup + i]);
      s += float(dot) * A.d[(m0 + c) * nb + b];
    }
    out[c] = s;
  }
#endif
  for (int c = 0; c < C; ++c) Y[(m0 + c) * N + n] = out[c] * scales[n];
}

#if defined(__AVX2__) && defined(__F16C__)
template <bool F32S>
inline __m256 scales8(const uint8_t* table, int64_t i) {  // 8 scales from group i on
  if constexpr (F32S) return _mm256_loadu_ps(reinterpret_cast<const float*>(table) + i);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table + 2 * i)));
}
#endif

// Q4 (F32S false) and Q4F (true).
template <int C, bool F32S>
void row_q4(const uint8_t* W, const QuantizedActs& A, int64_t N, int64_t n, int64_t m0,
            float* Y) {
  const int64_t K = A.K, nb = K / kGroup;
  constexpr int64_t kS = F32S ? 4 : 2;  // bytes per scale
  const uint8_t* w = W + n * nb * (2 * kS + kGroup / 2);  // [nb scales][nb mins][nb x 16 codes]
  const uint8_t* mins = w + nb * kS;
  const uint8_t* codes = w + nb * 2 * kS;
  // Per-group factors of this row, hoisted out of the inner loop: scale * activation
  // scale for each activation row, and the whole zero-point term sum(min * d * sum(q)).
  float sx[C][kMaxGroups], out[C];
  for (int c = 0; c < C; ++c) out[c] = 0.f;
  int64_t b0 = 0;
#if defined(__AVX2__) && defined(__F16C__)
  {
    __m256 zp[C];
    for (int c = 0; c < C; ++c) zp[c] = _mm256_setzero_ps();
    for (; b0 + 8 <= nb; b0 += 8) {
      const __m256 sw = scales8<F32S>(w, b0);
      const __m256 mw = scales8<F32S>(mins, b0);
      for (int c = 0; c < C; ++c) {
        const int64_t o = (m0 + c) * nb + b0;
        _mm256_storeu_ps(&sx[c][b0], _mm256_mul_ps(sw, _mm256_loadu_ps(A.d.data() + o)));
        zp[c] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(A.s.data() + o), zp[c]);
      }
    }
    for (int c = 0; c < C; ++c) out[c] = hsum(zp[c]);
  }
#endif
  for (int64_t b = b0; b < nb; ++b) {
    const float sw = scale_at<F32S>(w, b), mw = scale_at<F32S>(mins, b);
    for (int c = 0; c < C; ++c) {
      sx[c][b] = sw * A.d[(m0 + c) * nb + b];
      out[c] += mw * A.s[(m0 + c) * nb + b];
    }
  }
#ifdef __AVX2__
  // Groups in pairs: one 32-byte load holds both groups' codes, and the activations come
  // in the matching order (A.qp, see pair_acts), so the low nibbles of both groups meet
  // one 32-byte activation load and the high nibbles the next: one unpack, one convert
  // and one FMA per 64 weights (lanes 0-3: the first group, 4-7: the second). Two
  // accumulators per row keep enough FMA chains in flight.
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m256 acc0[C], acc1[C];
  for (int c = 0; c < C; ++c) acc0[c] = acc1[c] = _mm256_setzero_ps();
  auto pair = [&](int64_t b, __m256* acc) {
    const __m256i raw =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + b * (kGroup / 2)));
    const __m256i lo = _mm256_and_si256(raw, mask);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
    for (int c = 0; c < C; ++c) {
      const int8_t* xp = A.qp.data() + (m0 + c) * K + b * kGroup;
      const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp));
      const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + kGroup));
      const __m256i dot = q4_pair_dot(lo, hi, xa, xb);
      const __m256 sc = pair_factors(&sx[c][b]);
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sc, acc[c]);
    }
  };
  int64_t b = even_odd_pairs(nb, acc0, acc1, pair);
  if (b < nb) {  // an odd last group: stored in element order in A.qp
    const __m256i q = unpack_q4(codes + b * (kGroup / 2));
    for (int c = 0; c < C; ++c) {
      const __m256i xv = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(A.qp.data() + (m0 + c) * K + b * kGroup));
      acc1[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(q, xv)),
                                _mm256_broadcast_ss(&sx[c][b]), acc1[c]);
    }
  }
  for (int c = 0; c < C; ++c) out[c] += hsum(_mm256_add_ps(acc0[c], acc1[c]));
#else
  for (int c = 0; c < C; ++c)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* g = codes + b * (kGroup / 2);
      const int8_t* x = A.q.data() + (m0 + c) * K + b * kGroup;
      int32_t dot = 0;
      for (int64_t j = 0; j < kGroup / 2; ++j)
        dot += int32_t(g[j] & 0x0F) * x[j] + int32_t(g[j] >> 4) * x[j + kGroup / 2];
      out[c] += float(dot) * sx[c][b];
    }
#endif
  for (int c = 0; c < C; ++c) Y[(m0 + c) * N + n] = out[c];
}

// ---- batch 1: R weight rows against one activation row ----
//
// At one activation row and a short K (576: 18 groups, 9 pairs) a row's fixed work (its
// factors, the zero-point term, two horizontal sums) and the latency of its two short
// FMA chains cost as much as its multiply-adds. R adjacent rows share the activation
// loads, keep 2R chains in flight and reduce their sums together (hsum_rows). Each row's
// arithmetic is the one-row kernel's, operation for operation: the results are
// bit-identical. (Measured on Zen 3, one thread, K = 576: R = 4 ran 1.4x the one-row
// kernels' speed with the weights in cache; R = 2 1.2x, R = 8 1.25x.)
constexpr int kRows = 4;  // weight rows per call at batch 1

#if defined(__AVX2__) && defined(__F16C__)
#define KVLOOP_MULTI_ROW 1
#ifndef __AVX512BW__
// 8-bit codes (Q8, Q8B) in fours too, with int8 activations (rows_q8, rows_q8b) and with
// int16 ones (the head: rows_q8_wide, rows_q8b_wide). AVX2 builds only: AVX-512's row_wide
// takes 32 weights an instruction, a different summation, and the int8 ones were measured
// on AVX2 only; the AVX-512 builds keep the one-row kernels at batch 1.
#define KVLOOP_MULTI_ROW_8BIT 1
#endif
// row_q4<1, F32S> for rows n..n+R against activation row m.
template <int R, bool F32S>
void rows_q4(const uint8_t* W, const QuantizedActs& A, int64_t N, int64_t n, int64_t m,
             float* Y) {
  const int64_t K = A.K, nb = K / kGroup;
  constexpr int64_t kS = F32S ? 4 : 2;
  const int64_t row_bytes = nb * (2 * kS + kGroup / 2);
  const uint8_t* w[R];
  for (int r = 0; r < R; ++r) w[r] = W + (n + r) * row_bytes;
  RowPrefetch pf(w[0], R * row_bytes, (nb + 1) / 2);
  const float* xd = A.d.data() + m * nb;
  const float* xs = A.s.data() + m * nb;
  float sx[R][kMaxGroups], out[R];
  {
    __m256 zp[R];
    for (int r = 0; r < R; ++r) zp[r] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
      const __m256 d = _mm256_loadu_ps(xd + b), s = _mm256_loadu_ps(xs + b);
      for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(&sx[r][b], _mm256_mul_ps(scales8<F32S>(w[r], b), d));
        zp[r] = _mm256_fmadd_ps(scales8<F32S>(w[r] + nb * kS, b), s, zp[r]);
      }
    }
    hsum_rows<R>(zp, out);
    for (; b < nb; ++b)
      for (int r = 0; r < R; ++r) {
        sx[r][b] = scale_at<F32S>(w[r], b) * xd[b];
        // fused, as the one-row kernel's compiled form of this line
        out[r] = std::fma(scale_at<F32S>(w[r] + nb * kS, b), xs[b], out[r]);
      }
  }
  const uint8_t* codes[R];
  for (int r = 0; r < R; ++r) codes[r] = w[r] + nb * 2 * kS;
  const int8_t* xp = A.qp.data() + m * K;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  auto pair = [&](int64_t b, __m256* acc) {
    const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + b * kGroup));
    const __m256i xb =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + b * kGroup + kGroup));
    pf.next();
    for (int r = 0; r < R; ++r) {
      const __m256i raw =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes[r] + b * (kGroup / 2)));
      const __m256i lo = _mm256_and_si256(raw, mask);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_pair_dot(lo, hi, xa, xb)),
                               pair_factors(&sx[r][b]), acc[r]);
    }
  };
  int64_t b = even_odd_pairs(nb, acc0, acc1, pair);
  if (b < nb) {  // an odd last group, in element order
    pf.next();
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + b * kGroup));
    for (int r = 0; r < R; ++r)
      acc1[r] = _mm256_fmadd_ps(
          _mm256_cvtepi32_ps(dot_u8s8(unpack_q4(codes[r] + b * (kGroup / 2)), xv)),
          _mm256_broadcast_ss(&sx[r][b]), acc1[r]);
  }
  store_row_sums<R>(acc0, acc1, out, Y + m * N + n);
}
#endif

// Q8B: int8 codes with a scale per group of G (16 or 32) and, with MIN, a min per 32;
// scales fp32 (F32S) or fp16. The integer dot product of a 32-byte block leaves the sums
// of its first 16 bytes in lanes 0-3 and of its last 16 in lanes 4-7, so a group of 16
// costs nothing more than one of 32: the two halves are scaled by one vector holding
// each half's factor.

// A Q8B weight row's factors against activation row m: sx[g] = the scale of group g x
// the activation scale of its block (g over the row's K / G groups), and the return
// value, the sum of the mins x the activations' block sums (0 without MIN). The one-row
// and the multi-row kernels both take them from here, so a row's arithmetic is the same
// in both (a sequence's logits must not depend on its batch).
template <bool F32S, int G, bool MIN>
inline float q8b_factors(const uint8_t* table, const QuantizedActs& A, int64_t m, float* sx) {
  const int64_t nb = A.K / kGroup, ng = A.K / G;
  constexpr int64_t kS = F32S ? 4 : 2;
  const float* xd = A.d.data() + m * nb;
  int64_t g = 0;
  float extra = 0.f;
#if defined(__AVX2__) && defined(__F16C__)
  if constexpr (G == kGroup) {
    for (; g + 8 <= ng; g += 8)
      _mm256_storeu_ps(sx + g, _mm256_mul_ps(scales8<F32S>(table, g), _mm256_loadu_ps(xd + g)));
  } else {  // groups of 16: each block's activation scale serves two of them
    const __m256i dup = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    for (; g + 8 <= ng; g += 8) {
      const __m256 d = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(xd + g / 2)),
                                                dup);
      _mm256_storeu_ps(sx + g, _mm256_mul_ps(scales8<F32S>(table, g), d));
    }
  }
  if constexpr (MIN) {
    const uint8_t* mins = table + ng * kS;
    const float* xs = A.s.data() + m * nb;
    __m256 zp = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8)
      zp = _mm256_fmadd_ps(scales8<F32S>(mins, b), _mm256_loadu_ps(xs + b), zp);
    extra = hsum(zp);
    for (; b < nb; ++b) extra = std::fma(scale_at<F32S>(mins, b), xs[b], extra);
  }
#else
  if constexpr (MIN)
    for (int64_t b = 0; b < nb; ++b)
      extra = std::fma(scale_at<F32S>(table + ng * kS, b), A.s[m * nb + b], extra);
#endif
  for (; g < ng; ++g) sx[g] = scale_at<F32S>(table, g) * xd[g * G / kGroup];
  return extra;
}

#ifdef __AVX2__
// The factor vector of block b's dot product (lanes 0-3: its first 16 weights, 4-7: the
// rest) from q8b_factors' sx: one broadcast for groups of 32, a pair for groups of 16.
template <int G>
inline __m256 q8b_block_factors(const float* sx, int64_t b) {
  if constexpr (G == kGroup) return _mm256_broadcast_ss(sx + b);
  return pair_factors(sx + 2 * b);
}
#endif

template <int C, bool F32S, int G, bool MIN>
void row_q8b(const int8_t* W, const uint8_t* S, const QuantizedActs& A, int64_t N, int64_t n,
             int64_t m0, float* Y) {
  const int64_t K = A.K, nb = K / kGroup, ng = K / G;
  constexpr int64_t kS = F32S ? 4 : 2;
  const int8_t* w = W + n * K;
  const uint8_t* table = S + n * ng * kS * (MIN ? 2 : 1);  // the row's scales (then mins)
  float sx[C][2 * kMaxGroups], out[C];
  for (int c = 0; c < C; ++c) out[c] = q8b_factors<F32S, G, MIN>(table, A, m0 + c, sx[c]);
#ifdef __AVX2__
  __m256 acc0[C], acc1[C];
  for (int c = 0; c < C; ++c) acc0[c] = acc1[c] = _mm256_setzero_ps();
  auto block = [&](int64_t b, __m256* acc) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kGroup));
    for (int c = 0; c < C; ++c) {
      const __m256i dot = dot_s8s8(
          wv, _mm256_loadu_si256(
                  reinterpret_cast<const __m256i*>(A.q.data() + (m0 + c) * K + b * kGroup)));
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), q8b_block_factors<G>(sx[c], b), acc[c]);
    }
  };
  even_odd_blocks(nb, acc0, acc1, block);
  for (int c = 0; c < C; ++c) out[c] += hsum(_mm256_add_ps(acc0[c], acc1[c]));
#else
  for (int c = 0; c < C; ++c)
    for (int64_t h = 0; h < 2 * nb; ++h) {
      const int8_t* x = A.q.data() + (m0 + c) * K + h * 16;
      int32_t dot = 0;
      for (int64_t j = 0; j < 16; ++j) dot += int32_t(w[h * 16 + j]) * int32_t(x[j]);
      out[c] += float(dot) * sx[c][h * 16 / G];
    }
#endif
  for (int c = 0; c < C; ++c) Y[(m0 + c) * N + n] = out[c];
}

#ifdef KVLOOP_MULTI_ROW_8BIT
// row_q8b<1, ...> for weight rows n..n+R against activation row m: the rows are adjacent
// in W, one stream, prefetched ahead (RowPrefetch), and each activation load serves R rows.
// One row at a time pays its factors, its horizontal sums and its two FMA chains' latency
// per 64 blocks (K = 2048). Measured on Zen 3, Q8_0 8192x2048 from memory, two threads:
// 15-16 GB/s one row at a time, 23 GB/s four (7.5 -> 5.1 cycles a block from L3, one
// thread); a Llama-3.2-1B-shaped Q8_0 model decodes 15.0 -> 18.8 tok/s.
template <int R, bool F32S, int G, bool MIN>
void rows_q8b(const int8_t* W, const uint8_t* S, const QuantizedActs& A, int64_t N, int64_t n,
              int64_t m, float* Y) {
  const int64_t K = A.K, nb = K / kGroup, ng = K / G;
  constexpr int64_t kS = F32S ? 4 : 2;
  const int8_t* w = W + n * K;  // rows n..n+R, contiguous
  RowPrefetch pf(w, R * K, nb);
  float sx[R][2 * kMaxGroups], out[R];
  for (int r = 0; r < R; ++r)
    out[r] = q8b_factors<F32S, G, MIN>(S + (n + r) * ng * kS * (MIN ? 2 : 1), A, m, sx[r]);
  const int8_t* xq = A.q.data() + m * K;
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  auto block = [&](int64_t b, __m256* acc) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kGroup));
    pf.next();
    for (int r = 0; r < R; ++r) {
      const __m256i wv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * K + b * kGroup));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_s8s8(wv, xv)),
                               q8b_block_factors<G>(sx[r], b), acc[r]);
    }
  };
  even_odd_blocks(nb, acc0, acc1, block);
  store_row_sums<R>(acc0, acc1, out, Y + m * N + n);
}

// row_q8<1> for weight rows n..n+R against activation row m, as rows_q8b: the block's
// activation scale is the one factor, shared by the R rows; the row scales come last.
template <int R>
void rows_q8(const int8_t* W, const float* scales, const QuantizedActs& A, int64_t N,
             int64_t n, int64_t m, float* Y) {
  const int64_t K = A.K, nb = K / kGroup;
  const int8_t* w = W + n * K;  // rows n..n+R, contiguous
  RowPrefetch pf(w, R * K, nb);
  const int8_t* xq = A.q.data() + m * K;
  const float* xd = A.d.data() + m * nb;
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  auto block = [&](int64_t b, __m256* acc) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kGroup));
    const __m256 d = _mm256_set1_ps(xd[b]);
    pf.next();
    for (int r = 0; r < R; ++r) {
      const __m256i wv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * K + b * kGroup));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_s8s8(wv, xv)), d, acc[r]);
    }
  };
  even_odd_blocks(nb, acc0, acc1, block);
  float out[R];
  const float zero[R] = {};
  store_row_sums<R>(acc0, acc1, zero, out);
  for (int r = 0; r < R; ++r) Y[m * N + n + r] = out[r] * scales[n + r];
}
#endif

// ---- int8 weights against int16 activations (wide_acts: the output head) ----
//
// The head's logits are what sampling compares, and int8 activations moved them enough to
// change greedy tokens (benchmarks/quant_quality.py). fp32 activations against the codes
// widened to fp32 cost ~5 vector ops per 16 weights and left a 1B model's head
// compute-bound at ~15 GB/s, half of its decode step. int16 activations instead, one scale
// per row (2^-15 of the row's largest: finer than the bf16 of the batched path for any
// value within 2^7 of it), let one multiply-add (vpmaddwd) take 32 codes x activations
// (AVX-512) or 16 (AVX2) into exact int32 pair sums, and leave one fp32 multiply-add per
// block: its sums times the weights' group scales. (A scale per block of 32 cost a
// multiply more per block and was ~1.3x slower.)

// A weight row's factor for each half block of 16 weights (half h: weights 16h..16h+15):
// Q8B's group scales in fp32 (groups of 16 or 32), or 1 (Q8, whose row scale comes last).
template <int G>
struct GroupScales {
  static constexpr bool kWholeBlock = G == 32;  // a block's two halves share one factor
  const float* sc;
  float half(int64_t h) const { return sc[G == 16 ? h : h / 2]; }
#ifdef __AVX512F__
  __m512 block(int64_t b) const {  // lanes 0-7: half 2b's factor, lanes 8-15: half 2b + 1's
    if constexpr (G == 32) {
      return _mm512_set1_ps(sc[b]);
    } else {
      const __m128 two =  // the scales of groups 2b, 2b + 1
          _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 2 * b)));
      return _mm512_permutexvar_ps(
          _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
          _mm512_castps128_ps512(two));
    }
  }
#endif
};
struct UnitScales {
  static constexpr bool kWholeBlock = true;
  float half(int64_t) const { return 1.f; }
#ifdef __AVX512F__
  __m512 block(int64_t) const { return _mm512_set1_ps(1.f); }
#endif
};

// out[c] = d of row m0 + c x the sum over blocks of the block's factors x (codes . its
// int16 activations).
template <int C, typename Scales>
void row_wide(const int8_t* w, const Scales& sc, const QuantizedActs& A, int64_t m0,
              float (&out)[C]) {
  const int64_t K = A.K, nb = K / kGroup;
  const int16_t* xq = A.q16.data() + m0 * K;
#if defined(__AVX512BW__)
  __m512 acc0[C], acc1[C];
  for (int c = 0; c < C; ++c) acc0[c] = acc1[c] = _mm512_setzero_ps();
  auto block = [&](int64_t b, __m512* acc) {
    const __m512i wv = _mm512_cvtepi8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kGroup)));
    const __m512 f = sc.block(b);
    for (int c = 0; c < C; ++c) {
      const __m512i p = _mm512_madd_epi16(wv, _mm512_loadu_si512(xq + c * K + b * kGroup));
      acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), f, acc[c]);
    }
  };
  even_odd_blocks(nb, acc0, acc1, block);
  for (int c = 0; c < C; ++c) out[c] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[c], acc1[c]));
#elif defined(__AVX2__)
  __m256 acc0[C], acc1[C];
  for (int c = 0; c < C; ++c) acc0[c] = acc1[c] = _mm256_setzero_ps();
  auto block = [&](int64_t b, __m256* acc) {
    const __m256i w0 = _mm256_cvtepi8_epi16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * kGroup)));
    const __m256i w1 = _mm256_cvtepi8_epi16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * kGroup + 16)));
    const __m256 f0 = _mm256_set1_ps(sc.half(2 * b));
    for (int c = 0; c < C; ++c) {
      const auto* x = reinterpret_cast<const __m256i*>(xq + c * K + b * kGroup);
      const __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256(x));
      const __m256i p1 = _mm256_madd_epi16(w1, _mm256_loadu_si256(x + 1));
      if constexpr (Scales::kWholeBlock) {
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)), f0, acc[c]);
      } else {  // the halves' factors differ: two multiply-adds, one chain
        const __m256 f1 = _mm256_set1_ps(sc.half(2 * b + 1));
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), f0, acc[c]);
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), f1, acc[c]);
      }
    }
  };
  even_odd_blocks(nb, acc0, acc1, block);
  for (int c = 0; c < C; ++c) out[c] = hsum(_mm256_add_ps(acc0[c], acc1[c]));
#else
  for (int c = 0; c < C; ++c) {
    out[c] = 0.f;
    for (int64_t h = 0; h < 2 * nb; ++h) {
      int32_t dot = 0;
      for (int64_t j = 0; j < 16; ++j)
        dot += int32_t(w[h * 16 + j]) * int32_t(xq[c * K + h * 16 + j]);
      out[c] += float(dot) * sc.half(h);
    }
  }
#endif
  for (int c = 0; c < C; ++c) out[c] *= A.d16[m0 + c];
}

template <int C>
void row_q8_wide(const int8_t* W, const float* scales, const QuantizedActs& A, int64_t N,
                 int64_t n, int64_t m0, float* Y) {
  float out[C];
  row_wide<C>(W + n * A.K, UnitScales{}, A, m0, out);
  for (int c = 0; c < C; ++c) Y[(m0 + c) * N + n] = out[c] * scales[n];
}

// fp32 copies of a row's fp16 scales (n of them from `table`); fp32 tables as they are.
template <bool F32S>
const float* row_scales(const uint8_t* table, int64_t n, float* buf) {
  if constexpr (F32S) {
    return reinterpret_cast<const float*>(table);
  } else {
    f16_scales(table, n, buf);
    return buf;
  }
}

// sum over the nb groups of mins[b] x s[b]: a Q8B head row's min terms against one
// activation row's per-group sums (s16 = d sum(q)).
inline float min_term(const float* mins, const float* s, int64_t nb) {
  float extra = 0.f;
  int64_t b = 0;
#ifdef __AVX2__
  __m256 acc = _mm256_setzero_ps();
  for (; b + 8 <= nb; b += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(mins + b), _mm256_loadu_ps(s + b), acc);
  extra = hsum(acc);
#endif
  for (; b < nb; ++b) extra += mins[b] * s[b];
  return extra;
}

template <int C, bool F32S, int G, bool MIN>
void row_q8b_wide(const int8_t* W, const uint8_t* S, const QuantizedActs& A, int64_t N,
                  int64_t n, int64_t m0, float* Y) {
  const int64_t K = A.K, ng = K / G, nb = K / kGroup;
  constexpr int64_t kS = F32S ? 4 : 2;
  const uint8_t* table = S + n * ng * kS * (MIN ? 2 : 1);  // the row's scales (then mins)
  float buf[2 * kMaxGroups];
  float out[C];
  row_wide<C>(W + n * K, GroupScales<G>{row_scales<F32S>(table, ng, buf)}, A, m0, out);
  if constexpr (MIN) {  // + each group's min x the sum of its activations, s16 = d sum(q)
    const float* mins = row_scales<F32S>(table + ng * kS, nb, buf);
    for (int c = 0; c < C; ++c) out[c] += min_term(mins, A.s16.data() + (m0 + c) * nb, nb);
  }
  for (int c = 0; c < C; ++c) Y[(m0 + c) * N + n] = out[c];
}

#ifdef KVLOOP_MULTI_ROW_8BIT

// row_wide<1> for R weight rows (w[r], factors sc[r]) against activation row m.
template <int R, typename Scales>
void rows_wide(const int8_t* const (&w)[R], const Scales (&sc)[R], const QuantizedActs& A,
               int64_t m, float (&out)[R]) {
  const int64_t K = A.K, nb = K / kGroup;
  const int16_t* xq = A.q16.data() + m * K;
  RowPrefetch pf(w[0], R * K, nb);
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  auto block = [&](int64_t b, __m256* acc) {
    const auto* x = reinterpret_cast<const __m256i*>(xq + b * kGroup);
    const __m256i x0 = _mm256_loadu_si256(x), x1 = _mm256_loadu_si256(x + 1);
    pf.next();
    for (int r = 0; r < R; ++r) {
      const __m256i p0 = _mm256_madd_epi16(
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[r] + b * kGroup))),
          x0);
      const __m256i p1 = _mm256_madd_epi16(
          _mm256_cvtepi8_epi16(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[r] + b * kGroup + 16))),
          x1);
      const __m256 f0 = _mm256_set1_ps(sc[r].half(2 * b));
      if constexpr (Scales::kWholeBlock) {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)), f0, acc[r]);
      } else {
        const __m256 f1 = _mm256_set1_ps(sc[r].half(2 * b + 1));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), f0, acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), f1, acc[r]);
      }
    }
  };
  even_odd_blocks(nb, acc0, acc1, block);
  __m256 tot[R];
  for (int r = 0; r < R; ++r) tot[r] = _mm256_add_ps(acc0[r], acc1[r]);
  hsum_rows<R>(tot, out);
  for (int r = 0; r < R; ++r) out[r] *= A.d16[m];
}

// row_q8_wide<1> for rows n..n+R.
template <int R>
void rows_q8_wide(const int8_t* W, const float* scales, const QuantizedActs& A, int64_t N,
                  int64_t n, int64_t m, float* Y) {
  const int8_t* w[R];
  UnitScales sc[R];
  for (int r = 0; r < R; ++r) w[r] = W + (n + r) * A.K;
  float out[R];
  rows_wide<R>(w, sc, A, m, out);
  for (int r = 0; r < R; ++r) Y[m * N + n + r] = out[r] * scales[n + r];
}

// row_q8b_wide<1, ...> for rows n..n+R.
template <int R, bool F32S, int G, bool MIN>
void rows_q8b_wide(const int8_t* W, const uint8_t* S, const QuantizedActs& A, int64_t N,
                   int64_t n, int64_t m, float* Y) {
  const int64_t K = A.K, ng = K / G, nb = K / kGroup;
  constexpr int64_t kS = F32S ? 4 : 2;
  float buf[R][2 * kMaxGroups];
  const uint8_t* table[R];
  const int8_t* w[R];
  GroupScales<G> sc[R];
  for (int r = 0; r < R; ++r) {
    table[r] = S + (n + r) * ng * kS * (MIN ? 2 : 1);
    w[r] = W + (n + r) * K;
    sc[r].sc = row_scales<F32S>(table[r], ng, buf[r]);
  }
  float out[R];
  rows_wide<R>(w, sc, A, m, out);
  if constexpr (MIN)
    for (int r = 0; r < R; ++r)
      out[r] += min_term(row_scales<F32S>(table[r] + ng * kS, nb, buf[r]),
                         A.s16.data() + m * nb, nb);
  for (int r = 0; r < R; ++r) Y[m * N + n + r] = out[r];
}
#endif

// f(F32S, G, MIN) for a Q8B layer's variant, each as a std::integral_constant: fp32 or
// fp16 scales, groups of 16 or 32, with or without mins (only with groups of 32).
template <typename F>
void with_q8b_variant(const QLinear& L, F&& f) {
  using Yes = std::true_type;
  using No = std::false_type;
  using G16 = std::integral_constant<int, 16>;
  using G32 = std::integral_constant<int, 32>;
  if (L.has_min) {
    if (L.f32_scales) f(Yes{}, G32{}, Yes{});
    else f(No{}, G32{}, Yes{});
  } else if (L.group == 16) {
    if (L.f32_scales) f(Yes{}, G16{}, No{});
    else f(No{}, G16{}, No{});
  } else {
    if (L.f32_scales) f(Yes{}, G32{}, No{});
    else f(No{}, G32{}, No{});
  }
}

#ifdef KVLOOP_MULTI_ROW
// Weight rows n..n+R against activation rows m0..m1 (fewer than kCols: each one alone),
// for the layouts with a multi-row kernel (multi_row).
template <int R>
void rows_batch1(const QLinear& L, const QuantizedActs& A, int64_t m0, int64_t m1, int64_t n,
                 float* y) {
  const int64_t N = L.out_features;
  if (is_stored(L.kind) && L.wide_acts) {  // every activation row in the one pass
    static_assert(R == kStoredRowsAtOnce, "the stored kernels take kStoredRowsAtOnce rows");
    stored_rows_wide_at_once(L, A, m0, m1, n, y);
    return;
  }
  for (int64_t m = m0; m < m1; ++m) {
    switch (L.kind) {
      case WeightKind::Q4:
        rows_q4<R, false>(L.wbytes, A, N, n, m, y);
        break;
      case WeightKind::Q4F:
        rows_q4<R, true>(L.wbytes, A, N, n, m, y);
        break;
#ifdef KVLOOP_MULTI_ROW_8BIT
      case WeightKind::Q8: {
        const int8_t* W = L.w<int8_t>();
        const float* scales = L.s<float>();
        if (L.wide_acts) {
          rows_q8_wide<R>(W, scales, A, N, n, m, y);
        } else {
          rows_q8<R>(W, scales, A, N, n, m, y);
        }
        break;
      }
      case WeightKind::Q8B: {
        const int8_t* W = L.w<int8_t>();
        const auto* S = L.sbytes;
        with_q8b_variant(L, [&](auto f32s, auto g, auto mn) {
          constexpr bool kF32S = decltype(f32s)::value, kMin = decltype(mn)::value;
          constexpr int kG = decltype(g)::value;
          if (L.wide_acts) {
            rows_q8b_wide<R, kF32S, kG, kMin>(W, S, A, N, n, m, y);
          } else {
            rows_q8b<R, kF32S, kG, kMin>(W, S, A, N, n, m, y);
          }
        });
        break;
      }
#endif
      default:
        static_assert(R == kStoredRowsAtOnce, "the stored kernels take kStoredRowsAtOnce rows");
        if (is_stored(L.kind)) stored_rows_at_once(L, A, m, n, y);
        break;
    }
  }
}
#endif

// Whether rows_batch1 takes L's rows.
bool multi_row(const QLinear& L) {
#ifdef KVLOOP_MULTI_ROW
  switch (L.kind) {
    case WeightKind::Q4:
    case WeightKind::Q4F:
    // GGUF blocks as stored (stored_rows_at_once).
    case WeightKind::Q4_K:
    case WeightKind::Q5_K:
    case WeightKind::Q5_0:
    case WeightKind::Q5_1:
      return true;
    // Q6_K's 4-row kernel measured 0-5% slower than one row at a time while its factors
    // were float permutes held in registers; with its scales applied in integers, 1.1x
    // from memory (stored_blocks.cpp). Builds with the float factors keep one row.
    // With int16 activations (a head), four rows too: measured in rows_q6k_wide.
    case WeightKind::Q6_K:
      return kQ6KIntScales || L.wide_acts;
#ifdef KVLOOP_MULTI_ROW_8BIT
    case WeightKind::Q8:
    case WeightKind::Q8B:
      return true;
#endif
    default:
      return false;
  }
#else
  (void)L;
  return false;
#endif
}

template <int C, bool F32S, int G, bool MIN>
void row_q8b_all(const QLinear& L, const float* x, const QuantizedActs* A, int64_t m0,
                 int64_t m1, int64_t n, float* y) {
  const int64_t N = L.out_features;
  const int8_t* W = L.w<int8_t>();
  const auto* S = L.sbytes;
  int64_t m = m0;
  if (L.wide_acts) {
    for (; m + C <= m1; m += C) row_q8b_wide<C, F32S, G, MIN>(W, S, *A, N, n, m, y);
    for (; m < m1; ++m) row_q8b_wide<1, F32S, G, MIN>(W, S, *A, N, n, m, y);
  } else {
    for (; m + C <= m1; m += C) row_q8b<C, F32S, G, MIN>(W, S, *A, N, n, m, y);
    for (; m < m1; ++m) row_q8b<1, F32S, G, MIN>(W, S, *A, N, n, m, y);
  }
}

template <int C>
void row_q8b_any(const QLinear& L, const float* x, const QuantizedActs* A, int64_t m0,
                 int64_t m1, int64_t n, float* y) {
  with_q8b_variant(L, [&](auto f32s, auto g, auto mn) {
    row_q8b_all<C, decltype(f32s)::value, decltype(g)::value, decltype(mn)::value>(L, x, A, m0,
                                                                                 m1, n, y);
  });
}

// ---- batched, fp32: a tile of R weight rows x C activation rows ----
//
// With many activation rows the step is compute-bound and the weights come from cache
// after the first pass, so the usual register tiling pays: each activation load is shared
// by R weight rows and each weight load by C activation rows. (For the int8-activation kernels the same tiling measured slower than the
// row-at-a-time loop: their cost is the per-pair multiply-add chain, not loads.)

template <int R, int C>
void tile_dense(const float* W, const float* X, int64_t K, int64_t N, int64_t n0, int64_t m0,
                float* Y) {
  float out[R][C];
  int64_t k = 0;
#ifdef __AVX2__
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    __m256 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = _mm256_loadu_ps(X + (m0 + c) * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = load8(W + (n0 + r) * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv, xv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r][c] = hsum(acc[r][c]);
#else
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r][c] = 0.f;
#endif
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        out[r][c] += W[(n0 + r) * K + k] * X[(m0 + c) * K + k];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) Y[(m0 + c) * N + n0 + r] = out[r][c];
}

// fp32 weight rows n0..n0+R against activation rows m0..m1, C at a time (then one by one).
template <int R, int C>
void tile_all_dense(const QLinear& L, const float* x, int64_t m0, int64_t m1, int64_t n0,
                    float* y) {
  const int64_t N = L.out_features, K = L.in_features;
  const float* W = L.w<float>();
  int64_t m = m0;
  for (; m + C <= m1; m += C) tile_dense<R, C>(W, x, K, N, n0, m, y);
  for (; m < m1; ++m) tile_dense<R, 1>(W, x, K, N, n0, m, y);
}

// Weight row n against activation rows m0..m1: C at a time, then one by one.
template <int C>
void row_all(const QLinear& L, const float* x, const QuantizedActs* A, int64_t m0, int64_t m1,
             int64_t n, float* y) {
  const int64_t N = L.out_features, K = L.in_features;
  int64_t m = m0;
  switch (L.kind) {
    case WeightKind::F32: {
      const float* W = L.w<float>();
      for (; m + C <= m1; m += C) row_dense<C>(W, x, K, N, n, m, y);
      for (; m < m1; ++m) row_dense<1>(W, x, K, N, n, m, y);
      break;
    }
    case WeightKind::Q8: {
      const int8_t* W = L.w<int8_t>();
      const float* s = L.s<float>();
      if (L.wide_acts) {
        for (; m + C <= m1; m += C) row_q8_wide<C>(W, s, *A, N, n, m, y);
        for (; m < m1; ++m) row_q8_wide<1>(W, s, *A, N, n, m, y);
      } else {
        for (; m + C <= m1; m += C) row_q8<C>(W, s, *A, N, n, m, y);
        for (; m < m1; ++m) row_q8<1>(W, s, *A, N, n, m, y);
      }
      break;
    }
    case WeightKind::Q4: {
      const uint8_t* W = L.wbytes;
      for (; m + C <= m1; m += C) row_q4<C, false>(W, *A, N, n, m, y);
      for (; m < m1; ++m) row_q4<1, false>(W, *A, N, n, m, y);
      break;
    }
    case WeightKind::Q4F: {
      const uint8_t* W = L.wbytes;
      for (; m + C <= m1; m += C) row_q4<C, true>(W, *A, N, n, m, y);
      for (; m < m1; ++m) row_q4<1, true>(W, *A, N, n, m, y);
      break;
    }
    case WeightKind::Q8B:
      row_q8b_any<C>(L, x, A, m0, m1, n, y);
      break;
    default:  // GGUF blocks as stored (stored_blocks.cpp)
      if (L.wide_acts) {
        stored_rows_wide(L, *A, m0, m1, n, y);
      } else {
        stored_rows(L, *A, m0, m1, n, y);
      }
      break;
  }
}

void check_2d(const at::Tensor& t, at::ScalarType dtype, int64_t rows, int64_t cols,
              const char* what) {
  TORCH_CHECK(t.scalar_type() == dtype && t.dim() == 2 && t.size(0) == rows &&
                  t.size(1) == cols && t.is_contiguous(),
              what, " must be a contiguous ", c10::toString(dtype), " [", rows, ", ", cols,
              "] tensor, got ", c10::toString(t.scalar_type()), " ", t.sizes());
}

}  // namespace

QLinear::QLinear(int64_t kind_, at::Tensor weight_, int64_t in_features_,
                 std::optional<at::Tensor> scales_, std::optional<at::Tensor> bias_,
                 bool wide_acts_)
    : kind(static_cast<WeightKind>(kind_)), wide_acts(wide_acts_),
      weight(std::move(weight_)),
      bias(std::move(bias_)) {
  TORCH_CHECK(kind_ >= 0 && kind_ < kNumWeightKinds,
              "weight kind must be 0 (fp32), 1 (int8), 2 (int4), 3 (int4, fp32 scales), "
              "4 (int8 codes, group scales) or 5-9 (GGUF Q4_K, Q5_K, Q6_K, Q5_0, Q5_1 blocks)");
  TORCH_CHECK(!wide_acts_ || kind == WeightKind::Q8 || kind == WeightKind::Q8B ||
                  (is_stored(kind) && stored_takes_wide_acts(kind)),
              "int16 activations are an option of int8 weights and Q6_K blocks");
  TORCH_CHECK(weight.dim() == 2, "weight must be 2-D");
  out_features = weight.size(0);
  const bool packed = kind == WeightKind::Q4 || kind == WeightKind::Q4F || is_stored(kind);
  in_features = packed ? in_features_ : weight.size(1);
  const int64_t N = out_features, K = in_features;
  switch (kind) {
    case WeightKind::F32:
      TORCH_CHECK(in_features_ == K, "in_features != the weight's columns");
      check_2d(weight, at::kFloat, N, K, "fp32 weight");
      break;
    case WeightKind::Q8:
      TORCH_CHECK(in_features_ == K, "in_features != the weight's columns");
      check_2d(weight, at::kChar, N, K, "int8 weight");
      TORCH_CHECK(K % kGroup == 0, "int8 weights need in_features divisible by 32");
      TORCH_CHECK(scales_.has_value(), "int8 weights need scales");
      scales = scales_->contiguous();
      TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == N,
                  "int8 scales must be float32 [N]");
      break;
    case WeightKind::Q4:
      TORCH_CHECK(in_features_ % kGroup == 0, "int4 weights need in_features divisible by 32");
      TORCH_CHECK(in_features_ / kGroup <= kMaxGroups, "int4 in_features too large");
      check_2d(weight, at::kByte, N, K / kGroup * kQ4Block, "int4 weight");
      break;
    case WeightKind::Q4F:
      TORCH_CHECK(in_features_ % kGroup == 0, "int4 weights need in_features divisible by 32");
      TORCH_CHECK(in_features_ / kGroup <= kMaxGroups, "int4 in_features too large");
      check_2d(weight, at::kByte, N, K / kGroup * kQ4FBlock, "int4 (fp32 scales) weight");
      break;
    case WeightKind::Q8B: {
      TORCH_CHECK(in_features_ == K, "in_features != the weight's columns");
      check_2d(weight, at::kChar, N, K, "int8 weight");
      TORCH_CHECK(K % kGroup == 0 && K / kGroup <= kMaxGroups,
                  "int8 group weights need in_features divisible by 32 (at most 65536)");
      TORCH_CHECK(scales_.has_value(), "int8 group weights need scales");
      scales = scales_->contiguous();
      const auto st = scales.scalar_type();
      TORCH_CHECK(st == at::kFloat || st == at::kHalf, "group scales must be fp32 or fp16");
      f32_scales = st == at::kFloat;
      has_min = scales.dim() == 3;
      if (has_min) {
        TORCH_CHECK(scales.size(0) == N && scales.size(1) == 2 && scales.size(2) == K / kGroup,
                    "group scales with mins must be [N, 2, K / 32]");
        group = kGroup;
      } else {
        TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N &&
                        (scales.size(1) == K / 16 || scales.size(1) == K / kGroup),
                    "group scales must be [N, K / 16] or [N, K / 32]");
        group = K / scales.size(1);
      }
      break;
    }
    default: {  // GGUF blocks as stored
      const int64_t row_bytes = stored_row_bytes(kind, K);
      TORCH_CHECK(K > 0 && row_bytes > 0,
                  "in_features must be a whole number of the format's blocks");
      check_2d(weight, at::kByte, N, row_bytes, "stored block weight");
      break;
    }
  }
  if (bias.has_value()) {
    *bias = bias->contiguous();
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N,
                "bias must be float32 [N]");
  }
  wbytes = static_cast<const uint8_t*>(weight.data_ptr());
  if (scales.defined()) sbytes = static_cast<const uint8_t*>(scales.data_ptr());
}

std::shared_ptr<QLinear> QLinear::stack(const std::vector<std::shared_ptr<QLinear>>& parts) {
  TORCH_CHECK(!parts.empty(), "a stack needs at least one part");
  auto s = std::make_shared<QLinear>();
  s->kind = WeightKind::Stack;
  s->in_features = parts[0]->in_features;
  for (const auto& p : parts) {
    TORCH_CHECK(p != nullptr && p->parts.empty() && !p->wide_acts,
                "stacked parts must be plain layers");
    TORCH_CHECK(p->in_features == s->in_features, "stacked parts must share in_features");
    s->out_features += p->out_features;
  }
  s->parts = parts;
  return s;
}

int64_t QLinear::weight_bytes() const {  // what a decode step (< batched_min_rows) reads
  if (!parts.empty()) {
    int64_t n = 0;
    for (const auto& p : parts) n += p->weight_bytes();
    return n;
  }
  int64_t n = weight.numel() * weight.element_size();
  if (scales.defined()) n += scales.numel() * scales.element_size();
  if (bias.has_value()) n += bias->numel() * 4;
  return n;
}

void QLinear::run(const float* x, const QuantizedActs* acts, int64_t M, float* y) const {
  TORCH_CHECK(parts.empty(), "a stack runs through apply");
  const int64_t N = out_features;
  TORCH_CHECK(!quantized() || (acts != nullptr && acts->M == M && acts->K == in_features),
              "quantized weights need activations quantized for them");
  TORCH_CHECK(!quantized() || !paired() ||
                  static_cast<int64_t>(acts->qp.size()) == M * in_features,
              "4-bit weights need the activations in pair order (pair_acts)");
  TORCH_CHECK(!wide_acts || static_cast<int64_t>(acts->q16.size()) == M * in_features,
              "the head's kernel needs int16 activations (quantize_acts16)");
#ifdef __AVX2__  // the scalar kernel reads q16 as it is
  TORCH_CHECK(!wide_acts || !is_stored(kind) ||
                  static_cast<int64_t>(acts->q16x.size()) == M * in_features,
              "a Q6_K head's kernel needs its activations in lane order (lane_order_acts16)");
#endif
  // Activation rows in chunks that stay in L2 while the weights stream past them once
  // per chunk (prefill-sized M); within a chunk each thread takes one contiguous share of
  // the output rows (sequential weight reads).
  for (int64_t m0 = 0; m0 < M; m0 += kChunkRows) {
    const int64_t m1 = std::min(M, m0 + kChunkRows);
    const bool tiled = kind == WeightKind::F32 && m1 - m0 >= kTileMinRows;
    // Fewer activation rows than kCols (batch 1): kRows weight rows at a time.
    const bool multi = m1 - m0 < kCols && multi_row(*this);
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      int64_t n = n0;
      if (tiled) {
        for (; n + kTileRows <= n1; n += kTileRows)
          tile_all_dense<kTileRows, kTileCols>(*this, x, m0, m1, n, y);
      }
#ifdef KVLOOP_MULTI_ROW
      if (multi) {
        for (; n + kRows <= n1; n += kRows) rows_batch1<kRows>(*this, *acts, m0, m1, n, y);
      }
#else
      (void)multi;
#endif
      for (; n < n1; ++n) row_all<kCols>(*this, x, acts, m0, m1, n, y);
    });
  }
  add_bias(y, M);
}

void QLinear::add_bias(float* y, int64_t M) const {
  if (!bias.has_value()) return;
  const float* b = bias->data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < out_features; ++n) y[m * out_features + n] += b[n];
}

at::Tensor QLinear::forward(const at::Tensor& x_) const {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && x_.dim() == 2 && x_.size(1) == in_features,
              "x must be float32 [M, ", in_features, "]");
  const auto x = x_.contiguous();
  const int64_t M = x.size(0);
  auto y = at::empty({M, out_features}, x.options());
  if (M == 0) return y;
  QuantizedActs acts;
  apply(x.data_ptr<float>(), M, acts, y.data_ptr<float>());
  return y;
}

void QLinear::set_batched_decode(int64_t min_rows, bool bf16) {
  TORCH_CHECK(min_rows >= 1, "min_rows must be >= 1");
  for (const auto& p : parts) p->set_batched_decode(min_rows, bf16);
  batched_decode = true;
  batched_bf16 = bf16;
  batched_min_rows = min_rows;
}

namespace {
// fp32 -> bf16, round to nearest even (c10::BFloat16's rounding, without its NaN branch:
// decoded weights are finite), in a form the compiler vectorizes.
inline uint16_t to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline void store(float* out, float v) { *out = v; }
inline void store(at::BFloat16* out, float v) {
  const uint16_t b = to_bf16_bits(v);
  std::memcpy(out, &b, 2);
}

// One weight row, K values: w = scale * code (+ min), in fp32 as the kernels compute it
// (the product is exact in every layout: kvloop.quant.layout), then stored as T.
template <typename T>
void decode_row(const QLinear& L, int64_t n, T* out) {
  const int64_t K = L.in_features;
  for (const auto& p : L.parts) {  // a stack: the part holding row n
    if (n < p->out_features) return decode_row(*p, n, out);
    n -= p->out_features;
  }
  if (is_stored(L.kind)) {
    if constexpr (std::is_same_v<T, float>) {
      stored_decode_row(L, n, out);
    } else {  // fp32 first (exact), then rounded as every layout's bf16 rows are
      thread_local std::vector<float> row;
      row.resize(K);
      float* r = row.data();
      stored_decode_row(L, n, r);
      for (int64_t k = 0; k < K; ++k) store(out + k, r[k]);
    }
    return;
  }
  switch (L.kind) {
    case WeightKind::F32: {
      const float* w = L.w<float>() + n * K;
      for (int64_t k = 0; k < K; ++k) store(out + k, w[k]);
      break;
    }
    case WeightKind::Q8: {
      const int8_t* q = L.w<int8_t>() + n * K;
      const float s = L.s<float>()[n];
      for (int64_t k = 0; k < K; ++k) store(out + k, s * static_cast<float>(q[k]));
      break;
    }
    case WeightKind::Q4:
    case WeightKind::Q4F: {
      const bool f32s = L.kind == WeightKind::Q4F;
      const int64_t nb = K / kGroup, width = f32s ? 4 : 2;
      const uint8_t* row = L.wbytes + n * nb * (f32s ? kQ4FBlock : kQ4Block);
      const uint8_t* codes = row + 2 * width * nb;
      for (int64_t g = 0; g < nb; ++g) {
        const float sc = f32s ? scale_at<true>(row, g) : scale_at<false>(row, g);
        const float mn = f32s ? scale_at<true>(row + 4 * nb, g) : scale_at<false>(row + 2 * nb, g);
        const uint8_t* b = codes + g * (kGroup / 2);
        T* o = out + g * kGroup;
        for (int j = 0; j < kGroup / 2; ++j) {
          store(o + j, sc * static_cast<float>(b[j] & 0x0F) + mn);
          store(o + j + kGroup / 2, sc * static_cast<float>(b[j] >> 4) + mn);
        }
      }
      break;
    }
    case WeightKind::Q8B: {
      const int8_t* q = L.w<int8_t>() + n * K;
      const int64_t G = L.group, ng = K / G;
      const uint8_t* S = L.sbytes +
                         n * (L.has_min ? 2 : 1) * ng * (L.f32_scales ? 4 : 2);
      const uint8_t* Mn = S + ng * (L.f32_scales ? 4 : 2);
      for (int64_t g = 0; g < ng; ++g) {
        const float sc = L.f32_scales ? scale_at<true>(S, g) : scale_at<false>(S, g);
        const float mn = !L.has_min ? 0.f
                         : L.f32_scales ? scale_at<true>(Mn, g) : scale_at<false>(Mn, g);
        for (int64_t k = g * G; k < (g + 1) * G; ++k)
          store(out + k, sc * static_cast<float>(q[k]) + mn);
      }
      break;
    }
    default:
      break;  // stored kinds: above
  }
}

template <typename T>
void decode_rows_into(const QLinear& L, int64_t n0, int64_t n1, T* out) {
  at::parallel_for(n0, n1, 16, [&](int64_t a, int64_t b) {
    for (int64_t n = a; n < b; ++n) decode_row(L, n, out + (n - n0) * L.in_features);
  });
}
}  // namespace

void QLinear::decode_rows(int64_t n0, int64_t n1, float* out) const {
  decode_rows_into(*this, n0, n1, out);
}
void QLinear::decode_row(int64_t n, float* out) const {
  TORCH_CHECK(n >= 0 && n < out_features, "row ", n, " out of range");
  kvloop::decode_row(*this, n, out);
}
void QLinear::decode_rows(int64_t n0, int64_t n1, at::BFloat16* out) const {
  decode_rows_into(*this, n0, n1, out);
}

at::Tensor QLinear::decoded(bool bf16) const {
  const auto dtype = bf16 ? at::kBFloat16 : at::kFloat;
  auto out = at::empty({out_features, in_features}, at::TensorOptions().dtype(dtype));
  if (bf16) {
    decode_rows(0, out_features, out.data_ptr<at::BFloat16>());
  } else {
    decode_rows(0, out_features, out.data_ptr<float>());
  }
  return out;
}

namespace {
// A flat scratch tensor of at least n elements of `dtype`, reallocated only to grow.
at::Tensor& grow(at::Tensor& buf, int64_t n, at::ScalarType dtype) {
  if (!buf.defined() || buf.numel() < n || buf.scalar_type() != dtype) buf = at::empty({n}, at::TensorOptions().dtype(dtype));
  return buf;
}

}  // namespace

void QLinear::run_batched_decode(const float* x, int64_t M, QuantizedActs& scratch,
                                 float* y) const {
  const int64_t N = out_features, K = in_features;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  // fp32 weights stay fp32 (the reference arithmetic, MKL/oneDNN sgemm on the weight
  // itself); quantized ones meet bf16 activations.
  const bool bf16 = kind != WeightKind::F32 && batched_bf16;
  at::Tensor xin = at::from_blob(const_cast<float*>(x), {M, K}, f32);
  if (bf16) {
    auto xb = grow(scratch.xb, M * K, at::kBFloat16).narrow(0, 0, M * K).view({M, K});
    xin = xb.copy_(xin);
  }
  auto out = at::from_blob(y, {M, N}, f32);
  // Chunks of weight rows: decoded once, applied to every activation row, so the scratch
  // stays small (a vocabulary-sized head included) and in cache while the GEMM reads it.
  const int64_t chunk = std::max<int64_t>(
      64, kDecodeChunkBytes / (K * (bf16 ? 2 : 4)) / 64 * 64);
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t rows = std::min(chunk, N - n0);
    at::Tensor w;
    if (kind == WeightKind::F32) {
      w = weight.narrow(0, n0, rows);
    } else if (bf16) {
      w = grow(scratch.wb, rows * K, at::kBFloat16).narrow(0, 0, rows * K).view({rows, K});
      decode_rows(n0, n0 + rows, w.data_ptr<at::BFloat16>());
    } else {
      w = grow(scratch.wb, rows * K, at::kFloat).narrow(0, 0, rows * K).view({rows, K});
      decode_rows(n0, n0 + rows, w.data_ptr<float>());
    }
    // [M, rows] in the weights' dtype (fp32 sums inside), widened exactly into y.
    out.narrow(1, n0, rows).copy_(at::linear(xin, w));
  }
  if (bias.has_value()) out.add_(*bias);
}

void QLinear::apply(const float* x, int64_t M, QuantizedActs& acts, float* y) const {
  if (!parts.empty()) {
    const int64_t N = out_features;
    int64_t off = 0;
    for (const auto& p : parts) {
      const int64_t Np = p->out_features;
      acts.part_y.resize(M * Np);
      p->apply(x, M, acts, acts.part_y.data());
      for (int64_t m = 0; m < M; ++m)
        std::memcpy(y + m * N + off, acts.part_y.data() + m * Np, Np * sizeof(float));
      off += Np;
    }
    return;
  }
  const bool batched = batched_decode && M >= batched_min_rows;
  if (gemm_min_rows > 0 && M >= gemm_min_rows && !batched) {
    if (wide_acts) {
      quantize_acts16(x, M, in_features, acts);
      interleave_acts16(acts, gemm_pairs());
    } else {
      quantize_acts(x, M, in_features, acts);
      interleave_acts(acts, gemm_signed_acts());
    }
    gemm_int8(*this, acts, y);
    add_bias(y, M);
  } else if (batched) {
    run_batched_decode(x, M, acts, y);
  } else if (wide_acts) {
    quantize_acts16(x, M, in_features, acts);
    if (is_stored(kind)) lane_order_acts16(acts);
    run(nullptr, &acts, M, y);
  } else if (quantized()) {
    quantize_acts(x, M, in_features, acts);
    if (paired()) pair_acts(acts);
    run(nullptr, &acts, M, y);
  } else {
    run(x, nullptr, M, y);
  }
}

namespace {
// One block of 32: scale d = max|x| / 127 (0 for a block this close to zero), codes
// round(x / d) half to even, and d * sum(codes).
void quantize_block(const float* v, int8_t* q, float* d_out, float* s_out) {
#ifdef __AVX2__
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 x[4];
  for (int j = 0; j < 4; ++j) x[j] = _mm256_loadu_ps(v + 8 * j);
  __m256 ax[4];
  for (int j = 0; j < 4; ++j) ax[j] = _mm256_andnot_ps(sign, x[j]);  // |x|
  const __m256 mx = _mm256_max_ps(_mm256_max_ps(ax[0], ax[1]), _mm256_max_ps(ax[2], ax[3]));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
#else
  float amax = 0.f;
  for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(v[i]));
#endif
  const float d = amax / 127.f >= kMinScale ? amax / 127.f : 0.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
#ifdef __AVX2__
  // vcvtps2dq rounds half to even (the default MXCSR mode), as nearbyint and torch.round.
  const __m256 idv = _mm256_set1_ps(id);
  __m256i iv[4];
  for (int j = 0; j < 4; ++j) iv[j] = _mm256_cvtps_epi32(_mm256_mul_ps(x[j], idv));
  const __m256i sum4 =
      _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum4), _mm256_extracti128_si256(sum4, 1));
  s4 = _mm_hadd_epi32(s4, s4);
  s4 = _mm_hadd_epi32(s4, s4);
  const int32_t sum = _mm_cvtsi128_si32(s4);
  // Narrow 32 x int32 -> 32 x int8; the packs interleave 128-bit lanes, the permute undoes it.
  const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]),
                                         _mm256_packs_epi32(iv[2], iv[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
  int32_t sum = 0;
  for (int64_t i = 0; i < kGroup; ++i) {
    const int32_t qi = static_cast<int32_t>(std::nearbyint(v[i] * id));
    q[i] = static_cast<int8_t>(qi);
    sum += qi;
  }
#endif
  *d_out = d;
  *s_out = d * static_cast<float>(sum);
}
}  // namespace

void pair_acts(QuantizedActs& a) {
  // Per pair of groups (g, g+1), 64 bytes: g[0:16], (g+1)[0:16], g[16:32], (g+1)[16:32],
  // the order of the low then high nibbles of the pair's 32 code bytes. An odd last group
  // stays in element order.
  const int64_t K = a.K, nb = K / kGroup, h = kGroup / 2;
  a.qp.resize(a.M * K);
  for (int64_t m = 0; m < a.M; ++m) {
    const int8_t* src = a.q.data() + m * K;
    int8_t* dst = a.qp.data() + m * K;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      const int8_t* g0 = src + b * kGroup;
      const int8_t* g1 = g0 + kGroup;
      int8_t* d = dst + b * kGroup;
      std::memcpy(d, g0, h);
      std::memcpy(d + h, g1, h);
      std::memcpy(d + 2 * h, g0 + h, h);
      std::memcpy(d + 3 * h, g1 + h, h);
    }
    if (b < nb) std::memcpy(dst + b * kGroup, src + b * kGroup, kGroup);
  }
}

void quantize_acts(const float* x, int64_t M, int64_t K, QuantizedActs& out) {
  const int64_t nb = K / kGroup;
  out.M = M;
  out.K = K;
  out.q.resize(M * K);
  out.d.resize(M * nb);
  out.s.resize(M * nb);
  out.ssum.resize(M);
  // Rows in parallel only when there are enough of them to pay for waking the threads.
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      float total = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        quantize_block(x + m * K + b * kGroup, out.q.data() + m * K + b * kGroup,
                       &out.d[m * nb + b], &out.s[m * nb + b]);
        total += out.s[m * nb + b];
      }
      out.ssum[m] = total;
    }
  });
}

void quantize_acts16(const float* x, int64_t M, int64_t K, QuantizedActs& out) {
  const int64_t nb = K / kGroup;
  out.M = M;
  out.K = K;
  out.q16.resize(M * K);
  out.d16.resize(M);
  out.s16.resize(M * nb);
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* v = x + m * K;
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(v[k]));
      const float d = amax / 32767.f >= kMinScale ? amax / 32767.f : 0.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      int16_t* q = out.q16.data() + m * K;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t sum = 0;
        for (int64_t k = b * kGroup; k < (b + 1) * kGroup; ++k) {
          // nearbyint: half to even, as torch.round (the reference)
          const int32_t qk = static_cast<int32_t>(std::nearbyint(v[k] * id));
          q[k] = static_cast<int16_t>(qk);
          sum += qk;
        }
        out.s16[m * nb + b] = d * static_cast<float>(sum);
      }
      out.d16[m] = d;
    }
  });
}

std::vector<at::Tensor> quantize_acts_tensor(const at::Tensor& x_) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && x_.dim() == 2 && x_.size(1) % kGroup == 0,
              "x must be float32 [M, K] with K divisible by 32");
  const auto x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  QuantizedActs acts;
  quantize_acts(x.data_ptr<float>(), M, K, acts);
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto d = at::empty({M, K / kGroup}, x.options());
  std::copy(acts.q.begin(), acts.q.end(), q.data_ptr<int8_t>());
  std::copy(acts.d.begin(), acts.d.end(), d.data_ptr<float>());
  return {q, d};
}

}  // namespace kvloop
