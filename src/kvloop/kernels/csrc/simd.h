// Small helpers shared by the kernel sources.
#pragma once

#include <cstdint>
#include <cstring>

#include <c10/util/Half.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

// Loops over a kernel's register arrays, unrolled whole so that the arrays stay in registers.
#define KVLOOP_UNROLL _Pragma("GCC unroll 16")

namespace kvloop {

inline float half_to_float(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// One group's scale or min of a row's table: fp32 (F32S) or fp16.
template <bool F32S>
inline float scale_at(const uint8_t* table, int64_t i) {
  if constexpr (F32S) {
    float v;
    std::memcpy(&v, table + 4 * i, 4);
    return v;
  } else {
    uint16_t h;
    std::memcpy(&h, table + 2 * i, 2);
    return half_to_float(h);
  }
}

// n fp16 scales of a row's table as floats in out: 8 at a time where F16C converts them
// (one by one they were a third of an int4 row's unpacking in the int8 GEMM).
inline void f16_scales(const uint8_t* table, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(table + 2 * i))));
#endif
  for (; i < n; ++i) out[i] = scale_at<false>(table, i);
}

#if defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KVLOOP_VNNI 1  // vpdpbusd (AVX512VL: on 256-bit registers too)
#endif

// Whether Q6_K's int8 scales are applied in integers (stored_blocks.cpp): the vpmaddubsw
// builds, where the widening vpmaddwd multiplies the pair sums by them. Otherwise each
// group's factors came from a float permute, which this Zen 3 issues at one every two
// cycles (one thread, a row at a time, in cache: 8.3 -> 7.2 cycles per 32 weights).
// VNNI's vpdpbusd leaves no int16 pair sums to scale.
constexpr bool kQ6KIntScales =
#if defined(__AVX2__) && !defined(KVLOOP_VNNI)
    true;
#else
    false;
#endif

#ifdef __AVX2__
// u8 x s8 dot products of 32 bytes: 8 int32 lanes, lane i the sum over bytes 4i..4i+3
// (u's values small enough that AVX2's pairwise int16 sums cannot saturate: 4- to 6-bit
// codes, or |w| <= 128 against |x| <= 127).
inline __m256i dot_u8s8(__m256i u, __m256i x) {
#ifdef KVLOOP_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

// s8 x s8 dot products of 32 bytes (w: int8 codes, x: int8 activations), lanes as
// dot_u8s8's: |w| as the unsigned operand against x given w's signs (-128 -> 128 as u8;
// the compiler computes |w| once where several x meet the same w).
inline __m256i dot_s8s8(__m256i w, __m256i x) {
  return dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

// Sum of the 8 lanes.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// hsum of each of a, b, c, d, as {a, b, c, d}: the same additions in the same order as
// hsum's (so bit-identical to four of them), in about half the instructions.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  // [x_lo + x_hi] for x = a, c (the 128-bit halves) and b, d: hsum's first step
  const __m256 ac = _mm256_add_ps(_mm256_permute2f128_ps(a, c, 0x20),
                                  _mm256_permute2f128_ps(a, c, 0x31));
  const __m256 bd = _mm256_add_ps(_mm256_permute2f128_ps(b, d, 0x20),
                                  _mm256_permute2f128_ps(b, d, 0x31));
  // per 128-bit half: {s0 + s2 of ac, of bd, s1 + s3 of ac, of bd}, then their sums
  const __m256 t = _mm256_add_ps(_mm256_unpacklo_ps(ac, bd), _mm256_unpackhi_ps(ac, bd));
  const __m256 u = _mm256_add_ps(t, _mm256_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_castpd_ps(_mm_unpacklo_pd(_mm_castps_pd(_mm256_castps256_ps128(u)),
                                       _mm_castps_pd(_mm256_extractf128_ps(u, 1))));
}

// out[r] = hsum(v[r]) for R vectors, R a multiple of 4.
template <int R>
inline void hsum_rows(const __m256 (&v)[R], float (&out)[R]) {
  static_assert(R % 4 == 0, "hsum_rows: a multiple of 4 rows");
  for (int r = 0; r < R; r += 4)
    _mm_storeu_ps(out + r, hsum4(v[r], v[r + 1], v[r + 2], v[r + 3]));
}

// y[r] = base[r] + the horizontal sum of acc0[r] + acc1[r]: the end of a multi-row kernel
// (R weight rows' two accumulators each, against one activation row).
template <int R>
inline void store_row_sums(const __m256 (&acc0)[R], const __m256 (&acc1)[R],
                           const float (&base)[R], float* y) {
  __m256 tot[R];
  for (int r = 0; r < R; ++r) tot[r] = _mm256_add_ps(acc0[r], acc1[r]);
  float dots[R];
  hsum_rows<R>(tot, dots);
  for (int r = 0; r < R; ++r) y[r] = base[r] + dots[r];
}

// {f[0] x4, f[1] x4}: the factors of two adjacent groups (or half blocks) for the lanes
// their dot products land in, from one 8-byte load and a permute (two broadcasts and an
// insert cost a third more per group in the AVX2 inner loops).
// (Loaded through __m128i, which may alias anything: a double* load of the float array
// let the compiler move it above the stores that fill it.)
inline __m256 pair_factors(const float* f) {
  const __m256 two = _mm256_castps128_ps256(
      _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(f))));
  return _mm256_permutevar8x32_ps(two, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

constexpr int64_t kPrefetchCalls = 2;  // how many calls ahead RowPrefetch reads
// R rows read side by side are R short streams to the hardware prefetcher, and with the
// weights coming from memory (a whole model, the head) that was slower than one row at a
// time (0.8-0.95x). So the kernel fetches the rows kPrefetchCalls calls ahead itself, a few
// lines per loop iteration (next(): all of them at the start of the call filled the
// miss buffers and stalled the loads, 0.7x on the head).
struct RowPrefetch {
  const char* p;
  int64_t step;  // bytes per next(), whole lines
  RowPrefetch(const void* rows, int64_t bytes, int64_t steps)
      : p(static_cast<const char*>(rows) + kPrefetchCalls * bytes),
        step((bytes + 64 * steps - 1) / (64 * steps) * 64) {}
  void next() {
    for (int64_t i = 0; i < step; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
    p += step;
  }
};
#endif

}  // namespace kvloop
