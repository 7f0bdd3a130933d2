// KV cache dtypes shared by the kernel sources: a stored row read back as fp32 (paged
// attention's inner loops) and an fp32 row written in the cache's dtype (the decoder's K/V
// writes, kv_store). Layout and rounding as in kvloop/quant/kv.py, the PyTorch side:
// values [2, Hkv, slots, D] in fp32, bf16, fp16 or int8; int8 with scales [2, Hkv, slots]
// fp16, x = scale * code. Conversions round to nearest even (torch's .to()); an int8 row's
// scale is fp16(absmax / 127) (the division in fp32) and its codes clamp(round(x / scale),
// -127, 127), so the PyTorch modules and the native step store the same bits. int8 K rows
// are stored rotated (fwht below; why: kvloop/quant/kv.py), and attention rotates its
// queries to match.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace kvloop {

enum class KVDtype : int { F32 = 0, BF16 = 1, F16 = 2, I8 = 3 };

using bf16_t = c10::BFloat16;
using f16_t = c10::Half;

// Whether a stored row carries a scale (and its values are integer codes).
template <typename T>
constexpr bool kQuantized = std::is_same_v<T, int8_t>;

// One layer's cache as the kernels read and write it: raw pointers, checked by kv_view.
struct KVView {
  KVDtype dtype = KVDtype::F32;
  void* data = nullptr;     // [2, Hkv, slots, D] elements of `dtype`
  f16_t* scales = nullptr;  // [2, Hkv, slots], int8 only
  int64_t Hkv = 0, slots = 0, D = 0;
  int64_t key_block = 1;  // int8: K rows are stored as fwht(k, key_block); 1: as they are

  template <typename T>
  T* row(int64_t kv, int64_t head, int64_t slot) const {
    return static_cast<T*>(data) + ((kv * Hkv + head) * slots + slot) * D;
  }
  f16_t* scale(int64_t kv, int64_t head, int64_t slot) const {
    return scales + (kv * Hkv + head) * slots + slot;
  }
};

// Calls f(T{}) with T the C++ type of the cache's elements.
template <typename F>
inline void dispatch_kv(KVDtype dtype, const F& f) {
  switch (dtype) {
    case KVDtype::F32: f(float{}); break;
    case KVDtype::BF16: f(bf16_t{}); break;
    case KVDtype::F16: f(f16_t{}); break;
    case KVDtype::I8: f(int8_t{}); break;
  }
}

// ---- reading ----

inline float to_f32(float x) { return x; }
inline float to_f32(bf16_t x) { return static_cast<float>(x); }
inline float to_f32(f16_t x) { return static_cast<float>(x); }
inline float to_f32(int8_t x) { return static_cast<float>(x); }

#ifdef __AVX2__
// 8 stored values -> 8 fp32 lanes (int8: the codes, unscaled).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16_t* p) {  // bf16 is the top half of an fp32: a 16-bit shift
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const f16_t* p) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
  return _mm256_loadu_ps(f);
#endif
}
inline __m256 load8(const int8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
#endif  // __AVX2__

// The largest power of two dividing D: the block int8 K rows are rotated over.
inline int64_t key_block(int64_t D) { return D & -D; }

// In place x = H x over each block of `block` elements (a power of two dividing D), H the
// unnormalised Walsh-Hadamard transform (H H = block * I). Butterflies stage by stage,
// each output one fp32 add or subtract: kvloop.quant.kv.hadamard gives the same bits.
inline void fwht(float* x, int64_t D, int64_t block) {
  for (int64_t h = 1; h < block; h *= 2)
    for (int64_t i = 0; i < D; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}

// ---- writing ----

inline void store_row(const float* x, int64_t D, float* dst, f16_t* /*scale*/) {
  std::memcpy(dst, x, D * sizeof(float));
}

inline void store_row(const float* x, int64_t D, bf16_t* dst, f16_t* /*scale*/) {
  int64_t d = 0;
#ifdef __AVX2__
  // c10's round_to_nearest_even, 8 lanes at a time: add 0x7FFF plus the kept part's lowest
  // bit, keep the top 16 bits; NaN becomes the quiet 0x7FC0.
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF);
  const __m256i qnan = _mm256_set1_epi32(0x7FC0);
  for (; d + 8 <= D; d += 8) {
    const __m256 v = _mm256_loadu_ps(x + d);
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, bias)), 16);
    r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d), h);
  }
#endif
  for (; d < D; ++d) dst[d] = bf16_t(x[d]);
}

inline void store_row(const float* x, int64_t D, f16_t* dst, f16_t* /*scale*/) {
  int64_t d = 0;
#if defined(__AVX2__) && defined(__F16C__)
  for (; d + 8 <= D; d += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + d),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; d < D; ++d) dst[d] = f16_t(x[d]);
}

// int8: codes into dst, the row's scale into *scale. A row holding a NaN gets a NaN scale
// and zero codes (the NaN shows in attention as it would from an fp32 cache).
inline void store_row(const float* x, int64_t D, int8_t* dst, f16_t* scale) {
  float amax = 0.f;
  bool nan = false;
  int64_t d = 0;
#ifdef __AVX2__
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (; d + 8 <= D; d += 8) {
    const __m256 v = _mm256_loadu_ps(x + d);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, _mm256_and_ps(v, absmask));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, m);
  for (float l : lanes) amax = std::max(amax, l);
  nan = _mm256_movemask_ps(bad) != 0;
#endif
  for (; d < D; ++d) {
    const float a = std::fabs(x[d]);
    if (std::isnan(a))
      nan = true;
    else
      amax = std::max(amax, a);
  }
  const f16_t s = nan ? f16_t(std::numeric_limits<float>::quiet_NaN()) : f16_t(amax / 127.f);
  *scale = s;
  const float sf = static_cast<float>(s);  // codes are taken at the rounded scale
  if (!(sf > 0.f)) {  // all zeros (or a scale that underflowed fp16), or NaN
    std::memset(dst, 0, D);
    return;
  }
  d = 0;
#ifdef __AVX2__
  const __m256 sv = _mm256_set1_ps(sf), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  for (; d + 8 <= D; d += 8) {
    __m256 q = _mm256_div_ps(_mm256_loadu_ps(x + d), sv);  // a true division, as torch's
    q = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm256_min_ps(_mm256_max_ps(q, lo), hi);
    const __m256i i32 = _mm256_cvtps_epi32(q);
    const __m128i i16 =
        _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + d), _mm_packs_epi16(i16, i16));
  }
#endif
  for (; d < D; ++d)
    dst[d] = static_cast<int8_t>(std::clamp(std::nearbyint(x[d] / sf), -127.f, 127.f));
}

// Row x (D fp32 values) as K (kv = 0) or V (kv = 1) of `head` at `slot`.
template <typename T>
inline void kv_store_row(const KVView& kv, int64_t which, int64_t head, int64_t slot,
                         const float* x) {
  if constexpr (kQuantized<T>) {
    if (which == 0 && kv.key_block > 1) {  // int8 K: quantize H k
      thread_local std::vector<float> rotated;
      rotated.assign(x, x + kv.D);
      fwht(rotated.data(), kv.D, kv.key_block);
      store_row(rotated.data(), kv.D, kv.row<T>(which, head, slot), kv.scale(which, head, slot));
      return;
    }
  }
  store_row(x, kv.D, kv.row<T>(which, head, slot),
            kQuantized<T> ? kv.scale(which, head, slot) : nullptr);
}

}  // namespace kvloop
