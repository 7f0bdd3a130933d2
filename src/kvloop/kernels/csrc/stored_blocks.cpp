// GGUF's block formats read as the file stores them: Q4_K, Q5_K, Q6_K (256 weights a block,
// the formats of Q4_K_M files) and Q5_0, Q5_1 (32 a block). A row of such a layer is its
// blocks back to back, so a decode step reads 4.5 (Q4_K) to 6.6 (Q6_K) bits a weight,
// where the same weights as Q8B (int8 codes plus group scales, exact too) cost 8.5 to 10.
// Q5_0 rows come with each 8 blocks' bytes moved into one group laid out as a Q5_K block
// (kQ5_0x8, kvloop.quant.stored.kernel_order): its codes then unpack as Q5_K's do.
//
// Every format is the same thing underneath: per group of 32 weights (16 for Q6_K's
// scales), unsigned codes u and w = s * u + mn in fp32 (s * u exact: see
// kvloop.quant.stored), so one kernel serves them all; only how the codes and factors come
// out of a block differs (for_each_group, block_factors). Against int8 activations (one
// scale d per 32 values, A.s = d * sum(q)):
//   sum_k w_k x_k = sum_g (s_g d_g) u_g . q_g + mn_g A.s_g
// with the u . q dot products on AVX2's u8 x s8 multiply-add or VNNI's vpdpbusd, as the
// other int8 kernels (linear.cpp). Q6_K's codes are signed (u - 32, per 16 weights), and
// take linear.cpp's Q8B sign trick instead of a min term per 16. Its scales are d times
// an int8 per 16 weights: on AVX2 without VNNI (kQ6KIntScales, simd.h) the int8 ones
// multiply the pair sums in the widening vpmaddwd, in place of its ones, so a group's
// integer sum leaves already scaled and meets one float factor (d times the activations'
// scale) as the other formats' do. Exact: a lane is at most 2 x (2 x 32 x 127) x 128 <
// 2^24, so its float is too.

#include "kvloop.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "simd.h"

namespace kvloop {
namespace {

constexpr int64_t kGroup = 32;
constexpr int kCols = 4;  // activation rows sharing one pass over a weight row (linear.cpp)

// Weights per block, bytes per block, weights per scale, bits per code.
template <WeightKind K> struct Traits;
template <> struct Traits<WeightKind::Q4_K> { static constexpr int64_t QK = 256, BYTES = 144, SUB = 32, BITS = 4; };
template <> struct Traits<WeightKind::Q5_K> { static constexpr int64_t QK = 256, BYTES = 176, SUB = 32, BITS = 5; };
template <> struct Traits<WeightKind::Q6_K> { static constexpr int64_t QK = 256, BYTES = 210, SUB = 16, BITS = 6; };
template <> struct Traits<WeightKind::Q5_0> { static constexpr int64_t QK = 32, BYTES = 22, SUB = 32, BITS = 5; };
template <> struct Traits<WeightKind::Q5_1> { static constexpr int64_t QK = 32, BYTES = 24, SUB = 32, BITS = 5; };
// 8 Q5_0 blocks of a row as kernel_order groups them: their 8 fp16 scales (16 bytes), a
// plane of fifth bits (32 bytes: byte l, bit j is element l of block j: Q5_K's qh), the
// nibbles (128 bytes: Q5_K's qs, element l of block 2c and 2c + 1 in byte 32c + l). A
// layout of this file only, not a kind a QLinear is built with.
constexpr WeightKind kQ5_0x8 = static_cast<WeightKind>(100);
template <> struct Traits<kQ5_0x8> { static constexpr int64_t QK = 256, BYTES = 176, SUB = 32, BITS = 5; };

template <WeightKind K>
using Layout = std::integral_constant<WeightKind, K>;

// f(layout, blocks, first byte, first group of 32) for each run of one block layout along
// a row of kind K: a Q5_0 row's groups of 8 blocks, then its blocks short of 8 as stored.
template <WeightKind K, typename F>
inline void for_each_run(int64_t in_features, F&& f) {
  if constexpr (K == WeightKind::Q5_0) {
    const int64_t blocks = in_features / Traits<K>::QK, n = blocks / 8;
    f(Layout<kQ5_0x8>{}, n, int64_t{0}, int64_t{0});
    f(Layout<K>{}, blocks - 8 * n, n * Traits<kQ5_0x8>::BYTES, 8 * n);
  } else {
    f(Layout<K>{}, in_features / Traits<K>::QK, int64_t{0}, int64_t{0});
  }
}

// How many blocks for_each_run visits along a row.
template <WeightKind K>
int64_t run_blocks(int64_t in_features) {
  int64_t total = 0;
  for_each_run<K>(in_features, [&](auto, int64_t blocks, int64_t, int64_t) { total += blocks; });
  return total;
}

// f(layout, b, k0) for each block of row n of L, in order: b its bytes, k0 its first
// weight along the row (for_each_run's runs, block by block).
template <WeightKind K, typename F>
inline void for_each_block(const QLinear& L, int64_t n, F&& f) {
  const uint8_t* row = L.wbytes +
                       n * (L.in_features / Traits<K>::QK * Traits<K>::BYTES);
  for_each_run<K>(L.in_features, [&](auto layout, int64_t blocks, int64_t byte0,
                                     int64_t group0) {
    using T = Traits<decltype(layout)::value>;
    for (int64_t bi = 0; bi < blocks; ++bi)
      f(layout, row + byte0 + bi * T::BYTES, group0 * kGroup + bi * T::QK);
  });
}

// Q5_K's code layout: Q5_K itself and the Q5_0 groups.
template <WeightKind K>
constexpr bool kQ5KCodes = K == WeightKind::Q5_K || K == kQ5_0x8;

// The GEMM's codes are u - kCodeShift (unpack_t: Q5_0's and Q6_K's mins folded in).
template <WeightKind K>
constexpr int kCodeShift = K == WeightKind::Q6_K ? 32
                           : K == WeightKind::Q5_0 || K == kQ5_0x8 ? 16
                                                                    : 0;
// The largest |code| of the GEMM's codes: u in [0, 2^BITS), minus kCodeShift.
template <WeightKind K>
constexpr int kMaxCode = std::max<int>(kCodeShift<K>, (1 << Traits<K>::BITS) - 1 - kCodeShift<K>);
static_assert(kMaxCode<WeightKind::Q4_K> == 15 && kMaxCode<WeightKind::Q5_K> == 31 &&
              kMaxCode<WeightKind::Q6_K> == 32 && kMaxCode<WeightKind::Q5_0> == 16 &&
              kMaxCode<WeightKind::Q5_1> == 31 && kMaxCode<kQ5_0x8> == 16);

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}

// Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 mins (sub-blocks 0-3 in the low six bits
// of bytes 0-7; 4-7 from the nibbles of bytes 8-11 and the top two bits of bytes 0-7).
inline void k_scales(const uint8_t* q, int* sc, int* m) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = q[j] & 63;
    m[j] = q[j + 4] & 63;
  }
  for (int j = 4; j < 8; ++j) {
    sc[j] = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    m[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One block's factors: w[k] = s[k / SUB] * u[k] + mn[k / SUB], computed as the `gguf`
// package computes them (d * sc in fp32, then the min), so that the decoded weights are
// its values bit for bit.
template <WeightKind K>
inline void block_factors(const uint8_t* b, float* s, float* mn) {
  if constexpr (K == WeightKind::Q5_0) {
    s[0] = f16_at(b);
    mn[0] = -16.f * s[0];  // w = d (u - 16)
  } else if constexpr (K == kQ5_0x8) {
    for (int j = 0; j < 8; ++j) {
      s[j] = f16_at(b + 2 * j);
      mn[j] = -16.f * s[j];
    }
  } else if constexpr (K == WeightKind::Q5_1) {
    s[0] = f16_at(b);
    mn[0] = f16_at(b + 2);
  } else if constexpr (K == WeightKind::Q4_K || K == WeightKind::Q5_K) {
    const float d = f16_at(b), dmin = f16_at(b + 2);
    int sc[8], m[8];
    k_scales(b + 4, sc, m);
    for (int j = 0; j < 8; ++j) {
      s[j] = d * static_cast<float>(sc[j]);
      mn[j] = -(dmin * static_cast<float>(m[j]));
    }
  } else {  // Q6_K: w = d * sc (u - 32), 16 int8 scales
    const float d = f16_at(b + 208);
    for (int i = 0; i < 16; ++i) {
      s[i] = d * static_cast<float>(static_cast<int8_t>(b[192 + i]));
      mn[i] = -32.f * s[i];
    }
  }
}

// One block's unsigned codes in element order (u[QK]), for the scalar kernel and decode.
template <WeightKind K>
inline void unpack_codes(const uint8_t* b, uint8_t* u) {
  if constexpr (K == WeightKind::Q5_0 || K == WeightKind::Q5_1) {
    const int64_t head = K == WeightKind::Q5_0 ? 2 : 4;
    uint32_t qh;
    std::memcpy(&qh, b + head, 4);
    const uint8_t* qs = b + head + 4;  // element j low nibble, element 16 + j high
    for (int j = 0; j < 16; ++j) {
      u[j] = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
      u[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    }
  } else if constexpr (K == WeightKind::Q4_K || kQ5KCodes<K>) {
    // 32 bytes per 64 weights: low nibbles the first 32, high nibbles the next; Q5_K's
    // fifth bit of element l of group g is bit g of qh[l].
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + (K == WeightKind::Q4_K ? 16 : 48);
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) {
        int lo = qs[32 * c + l] & 0x0F, hi = qs[32 * c + l] >> 4;
        if constexpr (kQ5KCodes<K>) {
          lo |= ((qh[l] >> (2 * c)) & 1) << 4;
          hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
        }
        u[64 * c + l] = static_cast<uint8_t>(lo);
        u[64 * c + 32 + l] = static_cast<uint8_t>(hi);
      }
  } else {  // Q6_K: two halves of 128: low nibbles of ql, two high bits from qh
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l) {
        const uint8_t* L = ql + 64 * h;
        const int H = qh[32 * h + l];
        uint8_t* o = u + 128 * h;
        o[l] = static_cast<uint8_t>((L[l] & 0x0F) | ((H & 3) << 4));
        o[32 + l] = static_cast<uint8_t>((L[32 + l] & 0x0F) | (((H >> 2) & 3) << 4));
        o[64 + l] = static_cast<uint8_t>((L[l] >> 4) | (((H >> 4) & 3) << 4));
        o[96 + l] = static_cast<uint8_t>((L[32 + l] >> 4) | (((H >> 6) & 3) << 4));
      }
  }
}

#ifdef __AVX2__
// 0x10 in byte j where bit j of `bits` is set (Q5_0 / Q5_1's fifth bits): AVX-512's byte
// masks do it in two instructions, AVX2 in five.
inline __m256i fifth_bits(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_maskz_mov_epi8(static_cast<__mmask32>(bits), _mm256_set1_epi8(0x10));
#else
  const __m256i which = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                           0x0303030303030303);  // byte j <- byte j / 8
  const __m256i mask = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), which);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, mask), mask),
                          _mm256_set1_epi8(0x10));
#endif
}

// Bit j of every byte of qh moved to bit 4 (0x10 or 0): Q5_K's fifth bits of group j.
// (16-bit shifts: bit 4 of either byte of a word comes from the same byte for j in 0..7.)
inline __m256i bit_to_16(__m256i qh, int j) {
  const __m256i v = j <= 4 ? _mm256_slli_epi16(qh, 4 - j) : _mm256_srli_epi16(qh, j - 4);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

// The 32 unsigned codes of group g (of 32 weights) of the block, in element order: the
// only format-specific part of the vector kernels.
template <WeightKind K, int g>
inline __m256i group_codes(const uint8_t* b) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  if constexpr (K == WeightKind::Q5_0 || K == WeightKind::Q5_1) {
    static_assert(g == 0, "one group a block");
    constexpr int64_t head = K == WeightKind::Q5_0 ? 2 : 4;
    uint32_t qh;
    std::memcpy(&qh, b + head, 4);
    // The 16 code bytes in both halves, the upper half shifted by 4: low nibbles are
    // elements 0-15, high nibbles 16-31.
    const __m256i raw = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + head + 4)));
    const __m256i lohi = _mm256_and_si256(
        _mm256_srlv_epi64(raw, _mm256_setr_epi64x(0, 0, 4, 4)), nib);
    return _mm256_or_si256(lohi, fifth_bits(qh));
  } else if constexpr (K == WeightKind::Q4_K || kQ5KCodes<K>) {
    // 32 bytes per 64 weights: low nibbles the first 32, high nibbles the next; Q5_K's
    // fifth bit of element l of group g is bit g of qh[l].
    const uint8_t* qs = b + (K == WeightKind::Q4_K ? 16 : 48);
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (g / 2)));
    __m256i u = _mm256_and_si256(g % 2 == 0 ? raw : _mm256_srli_epi16(raw, 4), nib);
    if constexpr (kQ5KCodes<K>)
      u = _mm256_or_si256(
          u, bit_to_16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)), g));
    return u;
  } else {  // Q6_K: two halves of 128 weights, each 4 groups: nibbles of ql, 2 bits of qh
    constexpr int h = g / 4, j = g % 4;
    const __m256i L =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (j % 2)));
    const __m256i H = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m256i lo = _mm256_and_si256(j < 2 ? L : _mm256_srli_epi16(L, 4), nib);
    const __m256i hi = j == 0 ? _mm256_slli_epi16(H, 4)
                     : j == 1 ? _mm256_slli_epi16(H, 2)
                     : j == 2 ? H
                              : _mm256_srli_epi16(H, 2);
    return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
  }
}

// f(g) for g = 0..N-1, each g a std::integral_constant: indices into register arrays and
// lanes stay compile-time constants, which a loop's index would not (the arrays would
// live in memory).
template <typename F, int... I>
inline void for_each_index(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
inline void for_each_index(F&& f) {
  for_each_index(f, std::make_integer_sequence<int, N>{});
}

// f(g, u) for each group g of 32 weights of the block, u its codes (group_codes).
template <WeightKind K, typename F>
inline void for_each_group(const uint8_t* b, F&& f) {
  for_each_index<static_cast<int>(Traits<K>::QK / kGroup)>(
      [&](auto g) { f(g, group_codes<K, decltype(g)::value>(b)); });
}

// Q4_K / Q5_K: block_factors' 8 scales and 8 mins as vectors (lane j: group j), the
// 6-bit fields unpacked four at a time in 32-bit words (k_scales' arithmetic, per byte):
// a fifth of the scalar unpacking's instructions, which cost as much as the dot products.
inline void k_factors(const uint8_t* b, __m256& s, __m256& mn) {
  uint32_t a, m, c;  // bytes 0-3, 4-7 and 8-11 of the packed fields
  std::memcpy(&a, b + 4, 4);
  std::memcpy(&m, b + 8, 4);
  std::memcpy(&c, b + 12, 4);
  const uint64_t sc = (uint64_t{(c & 0x0F0F0F0F) | ((a >> 2) & 0x30303030)} << 32) |
                      (a & 0x3F3F3F3F);
  const uint64_t mins = (uint64_t{((c >> 4) & 0x0F0F0F0F) | ((m >> 2) & 0x30303030)} << 32) |
                        (m & 0x3F3F3F3F);
  auto widen = [](uint64_t v) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(v))));
  };
  s = _mm256_mul_ps(_mm256_set1_ps(f16_at(b)), widen(sc));
  mn = _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(f16_at(b + 2)), widen(mins)),
                     _mm256_set1_ps(-0.f));  // -(dmin * m), exactly as block_factors
}

// Any layout of 8 groups a block with one scale and min each (Q4_K, Q5_K, the Q5_0
// groups): block_factors' values as vectors.
template <WeightKind K>
inline void group_factors(const uint8_t* b, __m256& s, __m256& mn) {
  if constexpr (K == kQ5_0x8) {
    s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    mn = _mm256_mul_ps(_mm256_set1_ps(-16.f), s);
  } else {
    k_factors(b, s, mn);
  }
}

#endif

// Weight rows n..n+R against activation rows m0..m0+C: C = kCols activation rows of a
// batch against one weight row, or at batch 1 R = kStoredRowsAtOnce weight rows against
// one activation row, which then share its loads and keep 2R FMA chains in flight.
// Measured on Zen 3 (avx2, one thread, against one row at a time): Q4_K 1.22x, Q5_K 1.1x,
// Q5_0 1.17x at Gemma 3's K = 640 (equal from K = 2048). Q6_K with its scales in
// integers: 0.93x in cache, but 1.1x with the weights read from memory (two threads,
// 8192x2048: 19.3 -> 21.4 GB/s), where RowPrefetch streams the 4 rows ahead. Every
// (weight row, activation row) pair takes the same operations in the same order either
// way: the results are bit-identical.
template <int C, int R, WeightKind K>
void rows_stored(const uint8_t* W, const QuantizedActs& A, int64_t N, int64_t n, int64_t m0,
                 float* Y) {
  constexpr int I = C * R;  // pairs, i = c * R + r
  const int64_t Kd = A.K, nb = Kd / kGroup;
  const int64_t row_bytes = Kd / Traits<K>::QK * Traits<K>::BYTES;
  const uint8_t* rows[R];
  KVLOOP_UNROLL
  for (int r = 0; r < R; ++r) rows[r] = W + (n + r) * row_bytes;
  float out[I];
  KVLOOP_UNROLL
  for (int i = 0; i < I; ++i) out[i] = 0.f;
#ifdef __AVX2__
  RowPrefetch pf(rows[0], R * row_bytes, run_blocks<K>(Kd));  // R > 1 only: see RowPrefetch
  // Two accumulators per pair (even and odd groups) keep FMA chains in flight.
  __m256 acc[2][I], zp[I];  // zp: the min terms, but Q6_K's
  KVLOOP_UNROLL
  for (int i = 0; i < I; ++i) acc[0][i] = acc[1][i] = zp[i] = _mm256_setzero_ps();
  // Per pair, the block's factor of each dot product, weight scale x activation scale:
  // per group of 32 in fac, read back broadcast; Q6_K's per 16 in registers, lanes 2g',
  // 2g' + 1 of fac16[h] for group 4h + g' (its two halves), where its int8 scales are not
  // applied in integers (VNNI builds); there, d times the activations' scale in fac and
  // the int8 scales in sc16. Measured both ways on Zen 3: memory is 8-15% faster for the
  // others, registers 10% for Q6_K's float factors.
  alignas(32) float fac[I][8];
  __m256 fac16[2][I];
  alignas(32) int16_t sc16[R][16];  // kQ6KIntScales: a block's 16 int8 scales as int16
  for_each_run<K>(Kd, [&](auto layout, int64_t blocks, int64_t byte0, int64_t group0) {
    constexpr WeightKind KB = decltype(layout)::value;
    using T = Traits<KB>;
    constexpr int64_t G = T::QK / kGroup;
    constexpr bool kSigned = KB == WeightKind::Q6_K;  // signed codes, no min term
    for (int64_t bi = 0; bi < blocks; ++bi) {
      if constexpr (R > 1) pf.next();
      const int64_t at = byte0 + bi * T::BYTES;
      const int64_t g0 = group0 + bi * G;  // the block's first group of 32 along the row
      KVLOOP_UNROLL
      for (int r = 0; r < R; ++r) {
        const uint8_t* b = rows[r] + at;
        if constexpr (kSigned && kQ6KIntScales) {
          _mm256_store_si256(reinterpret_cast<__m256i*>(sc16[r]),
                             _mm256_cvtepi8_epi16(
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
          const __m256 d = _mm256_set1_ps(f16_at(b + 208));
          KVLOOP_UNROLL
          for (int c = 0; c < C; ++c)
            _mm256_store_ps(fac[c * R + r],
                            _mm256_mul_ps(d, _mm256_loadu_ps(A.d.data() + (m0 + c) * nb + g0)));
        } else if constexpr (kSigned) {
          // 16 int8 scales times d, as block_factors: two vectors of 8 (groups 0-3, 4-7).
          const __m256 d = _mm256_set1_ps(f16_at(b + 208));
          const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
          const __m256 s0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
          const __m256 s1 = _mm256_mul_ps(
              d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
          KVLOOP_UNROLL
          for (int c = 0; c < C; ++c) {
            const __m256 dx = _mm256_loadu_ps(A.d.data() + (m0 + c) * nb + g0);
            const __m256i lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
            const __m256i hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
            fac16[0][c * R + r] = _mm256_mul_ps(s0, _mm256_permutevar8x32_ps(dx, lo));
            fac16[1][c * R + r] = _mm256_mul_ps(s1, _mm256_permutevar8x32_ps(dx, hi));
          }
        } else if constexpr (G == 8) {  // Q4_K, Q5_K, the Q5_0 groups
          __m256 sv, mv;
          group_factors<KB>(b, sv, mv);
          KVLOOP_UNROLL
          for (int c = 0; c < C; ++c) {
            const int64_t o = (m0 + c) * nb + g0;
            _mm256_store_ps(fac[c * R + r],
                            _mm256_mul_ps(sv, _mm256_loadu_ps(A.d.data() + o)));
            zp[c * R + r] =
                _mm256_fmadd_ps(mv, _mm256_loadu_ps(A.s.data() + o), zp[c * R + r]);
          }
        } else {  // Q5_0 / Q5_1 blocks: one group
          float s, mn;
          block_factors<KB>(b, &s, &mn);
          KVLOOP_UNROLL
          for (int c = 0; c < C; ++c) {
            const int64_t o = (m0 + c) * nb + g0;
            // fused explicitly: contracted or not, the compiler's choice differed between
            // the 4-row and the batched forms, and with it the results' last bits
            out[c * R + r] = std::fma(mn, A.s[o], out[c * R + r]);
            fac[c * R + r][0] = s * A.d[o];
          }
        }
      }
      for_each_index<static_cast<int>(G)>([&](auto g) {
        __m256i x[C];
        KVLOOP_UNROLL
        for (int c = 0; c < C; ++c)
          x[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
              A.q.data() + (m0 + c) * Kd + (g0 + g) * kGroup));
        KVLOOP_UNROLL
        for (int r = 0; r < R; ++r) {
          const __m256i u = group_codes<KB, decltype(g)::value>(rows[r] + at);
          __m256i w = u, aw = u;
          if constexpr (kSigned) {
            w = _mm256_sub_epi8(u, _mm256_set1_epi8(32));
            aw = _mm256_sign_epi8(w, w);  // |w| as u8; w's sign moves onto x
          }
          // kQ6KIntScales: the group's two int8 scales as int16 lanes, its first 16
          // weights' pair sums (the low half) taking scale 2g, the last 16's 2g + 1.
          __m256i sv = _mm256_setzero_si256();
          if constexpr (kSigned && kQ6KIntScales) {
            constexpr int j = 4 * (decltype(g)::value % 4);
            sv = _mm256_shuffle_epi8(
                _mm256_broadcastsi128_si256(
                    _mm_load_si128(reinterpret_cast<const __m128i*>(sc16[r] + 8 * (g / 4)))),
                _mm256_setr_epi8(j, j + 1, j, j + 1, j, j + 1, j, j + 1, j, j + 1, j, j + 1, j,
                                 j + 1, j, j + 1, j + 2, j + 3, j + 2, j + 3, j + 2, j + 3, j + 2,
                                 j + 3, j + 2, j + 3, j + 2, j + 3, j + 2, j + 3, j + 2, j + 3));
          }
          KVLOOP_UNROLL
          for (int c = 0; c < C; ++c) {
            const int i = c * R + r;
            const __m256i xs = kSigned ? _mm256_sign_epi8(x[c], w) : x[c];
            __m256i dot;
            __m256 f;
            if constexpr (kSigned && kQ6KIntScales) {
              dot = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), sv);
              f = _mm256_broadcast_ss(&fac[i][g]);
            } else if constexpr (kSigned) {
              // lanes 0-3 hold the dot product's first 16 weights, 4-7 its last 16: the
              // group's two scales
              constexpr int j = 2 * (decltype(g)::value % 4);
              dot = dot_u8s8(aw, xs);
              f = _mm256_permutevar8x32_ps(
                  fac16[g / 4][i], _mm256_setr_epi32(j, j, j, j, j + 1, j + 1, j + 1, j + 1));
            } else {
              dot = dot_u8s8(aw, xs);
              f = _mm256_broadcast_ss(&fac[i][g]);
            }
            acc[g & 1][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), f, acc[g & 1][i]);
          }
        }
      });
    }
  });
  KVLOOP_UNROLL
  for (int i = 0; i < I; ++i)
    out[i] += hsum(_mm256_add_ps(_mm256_add_ps(acc[0][i], acc[1][i]), zp[i]));
#else
  for_each_run<K>(Kd, [&](auto layout, int64_t blocks, int64_t byte0, int64_t group0) {
    constexpr WeightKind KB = decltype(layout)::value;
    using T = Traits<KB>;
    constexpr int64_t G = T::QK / kGroup, S = T::QK / T::SUB;
    constexpr bool kSigned = KB == WeightKind::Q6_K;
    for (int r = 0; r < R; ++r)
      for (int64_t bi = 0; bi < blocks; ++bi) {
        const uint8_t* b = rows[r] + byte0 + bi * T::BYTES;
        const int64_t g0 = group0 + bi * G;  // the block's first group of 32 along the row
        float s[S], mn[S];
        block_factors<KB>(b, s, mn);
        uint8_t u[T::QK];
        unpack_codes<KB>(b, u);
        for (int c = 0; c < C; ++c) {
          float& o = out[c * R + r];
          if constexpr (!kSigned)
            for (int64_t g = 0; g < G; ++g) o += mn[g] * A.s[(m0 + c) * nb + g0 + g];
          for (int64_t i = 0; i < S; ++i) {  // per scale: SUB weights
            const int8_t* x = A.q.data() + (m0 + c) * Kd + g0 * kGroup + i * T::SUB;
            int32_t dot = 0;
            for (int64_t j = 0; j < T::SUB; ++j)
              dot += (int32_t(u[i * T::SUB + j]) - (kSigned ? 32 : 0)) * int32_t(x[j]);
            o += float(dot) * s[i] * A.d[(m0 + c) * nb + g0 + i * T::SUB / kGroup];
          }
        }
      }
  });
#endif
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) Y[(m0 + c) * N + n + r] = out[c * R + r];
}

// ---- Q6_K against int16 activations (wide_acts: the head of a Q4_K_M file) ----
//
// A Q4_K_M file stores its output head (or the tied embedding) as Q6_K, and the head takes
// int16 activations (linear.cpp's row_wide: int8 ones moved greedy tokens). Held as Q8B
// instead (8-bit codes, an fp32 factor per 16) it read 10 bits a weight where the blocks
// hold 6.6: ~100 MB more a token on a 1.5B model's 151936 x 1536 head.
//
// Here the codes u - 32 widen to int16 within each 128-bit lane (unpack with their sign
// bytes: elements 0-7 and 16-23 in one vector, 8-15 and 24-31 in the other), against
// activations laid out the same way once per call (lane_order_acts16), and dot in
// vpmaddwd, exact in int32 (a pair is at most 2 x 32 x 32767): the two products of a
// group of 32 add into one vector whose low lanes hold scale 2g's sums and high lanes
// 2g + 1's. A half block's 4 such vectors reduce in 3 horizontal adds to its 8 scales'
// sums, which meet their factors d * sc in one conversion and one multiply-add. (Widening
// across lanes, vpmovsxbw, and a float factor per 16 weights cost 10 cycles per 32
// weights on Zen 3 at batch 1 with the weights in cache: lane-crossing shuffles and
// conversions each issue on one pipe.) The row's activation scale d16 comes last, as in
// row_wide. Weight rows n..n+R against activation rows m0..m0+C (C = kCols of a batch
// against one weight row, or below kCols rows all of them against 4 or 2 weight rows:
// stored_rows_wide_at_once; the same operations per pair either way, so bit-identical).
template <int C, int R>
void rows_q6k_wide(const uint8_t* W, const QuantizedActs& A, int64_t N, int64_t n, int64_t m0,
                   float* Y) {
  constexpr WeightKind K6 = WeightKind::Q6_K;
  using T = Traits<K6>;
  constexpr int I = C * R;  // pairs, i = c * R + r
  const int64_t Kd = A.K, blocks = Kd / T::QK, row_bytes = blocks * T::BYTES;
  const uint8_t* rows[R];
  KVLOOP_UNROLL
  for (int r = 0; r < R; ++r) rows[r] = W + (n + r) * row_bytes;
  float out[I];
#ifdef __AVX2__
  RowPrefetch pf(rows[0], R * row_bytes, blocks);  // R > 1 only: see RowPrefetch
  __m256 acc[I];
  KVLOOP_UNROLL
  for (int i = 0; i < I; ++i) acc[i] = _mm256_setzero_ps();
  // The factors' order after the reduction: scales 0, 2, 4, 6 | 1, 3, 5, 7 of a half.
  const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int64_t bi = 0; bi < blocks; ++bi) {
    if constexpr (R > 1) pf.next();
    KVLOOP_UNROLL
    for (int r = 0; r < R; ++r) {
      const uint8_t* b = rows[r] + bi * T::BYTES;
      const __m256 d = _mm256_set1_ps(f16_at(b + 208));
      const __m128i sc = _mm_shuffle_epi8(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)), order);
      for_each_index<2>([&](auto h) {  // half h: groups 4h..4h+3, scales 8h..8h+7
        constexpr int kH = decltype(h)::value;
        const __m256 f = _mm256_mul_ps(  // as block_factors: d * sc in fp32
            d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(kH == 0 ? sc : _mm_srli_si128(sc, 8))));
        __m256i e[C][2];  // groups 4h + 2j', + 1 reduced: [their 4 scales' | the same]
        for_each_index<4>([&](auto j) {
          constexpr int kJ = decltype(j)::value, kG = 4 * kH + kJ;
          const __m256i w = _mm256_sub_epi8(group_codes<K6, kG>(b), _mm256_set1_epi8(32));
          const __m256i sign = _mm256_cmpgt_epi8(_mm256_setzero_si256(), w);
          const __m256i w0 = _mm256_unpacklo_epi8(w, sign);  // elements 0-7 | 16-23
          const __m256i w1 = _mm256_unpackhi_epi8(w, sign);  // 8-15 | 24-31
          KVLOOP_UNROLL
          for (int c = 0; c < C; ++c) {
            const auto* x = reinterpret_cast<const __m256i*>(
                A.q16x.data() + (m0 + c) * Kd + bi * T::QK + kG * kGroup);
            // lanes 0-3: scale 2g's, 4-7: 2g + 1's
            const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(x)),
                                               _mm256_madd_epi16(w1, _mm256_loadu_si256(x + 1)));
            if constexpr (kJ % 2 == 0) {
              e[c][kJ / 2] = p;
            } else {  // [2g', 2g', 2g' + 2, 2g' + 2 | 2g' + 1, ...] for g' = 4h + kJ - 1
              e[c][kJ / 2] = _mm256_hadd_epi32(e[c][kJ / 2], p);
            }
          }
        });
        KVLOOP_UNROLL
        for (int c = 0; c < C; ++c)  // the half's scales 0, 2, 4, 6 | 1, 3, 5, 7: f's order
          acc[c * R + r] = _mm256_fmadd_ps(
              _mm256_cvtepi32_ps(_mm256_hadd_epi32(e[c][0], e[c][1])), f, acc[c * R + r]);
      });
    }
  }
  if constexpr (I % 4 == 0) {
    hsum_rows<I>(acc, out);
  } else {
    KVLOOP_UNROLL
    for (int i = 0; i < I; ++i) out[i] = hsum(acc[i]);
  }
#else
  for (int i = 0; i < I; ++i) out[i] = 0.f;
  for (int r = 0; r < R; ++r)
    for (int64_t bi = 0; bi < blocks; ++bi) {
      const uint8_t* b = rows[r] + bi * T::BYTES;
      float s[16], mn[16];
      block_factors<K6>(b, s, mn);
      uint8_t u[T::QK];
      unpack_codes<K6>(b, u);
      for (int c = 0; c < C; ++c)
        for (int64_t i = 0; i < 16; ++i) {  // per scale: 16 weights
          const int16_t* x = A.q16.data() + (m0 + c) * Kd + bi * T::QK + 16 * i;
          int32_t dot = 0;
          for (int64_t j = 0; j < 16; ++j) dot += (int32_t(u[16 * i + j]) - 32) * int32_t(x[j]);
          out[c * R + r] += float(dot) * s[i];
        }
    }
#endif
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) Y[(m0 + c) * N + n + r] = out[c * R + r] * A.d16[m0 + c];
}

template <WeightKind K>
void rows_t(const QLinear& L, const QuantizedActs& A, int64_t m0, int64_t m1, int64_t n,
            float* y) {
  const uint8_t* W = L.wbytes;
  int64_t m = m0;
  for (; m + kCols <= m1; m += kCols) rows_stored<kCols, 1, K>(W, A, L.out_features, n, m, y);
  for (; m < m1; ++m) rows_stored<1, 1, K>(W, A, L.out_features, n, m, y);
}

template <WeightKind K>
void decode_t(const QLinear& L, int64_t n, float* out) {
  for_each_block<K>(L, n, [&](auto layout, const uint8_t* b, int64_t k0) {
    constexpr WeightKind KB = decltype(layout)::value;
    using T = Traits<KB>;
    float s[T::QK / T::SUB], mn[T::QK / T::SUB];
    block_factors<KB>(b, s, mn);
    float* o = out + k0;
    // s * u is exact in fp32, so the fused multiply-add rounds once, as the sum does.
#ifdef __AVX2__
    // The codes as the kernel unpacks them, 8 at a time to fp32: a batched step decodes
    // every weight of the layer (prefill, large decode batches), so this runs at GEMM rates.
    for_each_group<KB>(b, [&](int64_t g, __m256i u) {
      for (int j = 0; j < 4; ++j) {
        const int64_t sub = (g * kGroup + 8 * j) / T::SUB;
        const __m128i u8 = j < 2 ? _mm256_castsi256_si128(u) : _mm256_extracti128_si256(u, 1);
        const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
            j % 2 == 0 ? u8 : _mm_srli_si128(u8, 8)));
        _mm256_storeu_ps(o + g * kGroup + 8 * j,
                         _mm256_fmadd_ps(f, _mm256_set1_ps(s[sub]), _mm256_set1_ps(mn[sub])));
      }
    });
#else
    uint8_t u[T::QK];
    unpack_codes<KB>(b, u);
    for (int64_t k = 0; k < T::QK; ++k)
      o[k] = s[k / T::SUB] * static_cast<float>(u[k]) + mn[k / T::SUB];
#endif
  });
}

#ifdef __AVX2__
// corr[i] = -128 * (sum of scale i's codes - shift * SUB), from each group's 8 lanes of
// 4-code sums: the 8 groups of a 256-weight block reduced together in a tree of hadds.
template <int64_t SUB, int64_t G, int kShift>
inline void block_corrections(const __m256i* sums, int32_t* corr) {
  const __m128i base = _mm_set1_epi32(kShift * static_cast<int>(SUB));
  auto store = [&](int32_t* out, __m128i total) {  // (shift * SUB - total) * 128
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                     _mm_slli_epi32(_mm_sub_epi32(base, total), 7));
  };
  if constexpr (G == 8) {
    for (int h = 0; h < 2; ++h) {  // groups 4h..4h+3
      const __m256i* s = sums + 4 * h;
      // [g lo, g+1 lo, g+2 lo, g+3 lo | g hi, ...]: lo the first 16 codes, hi the last
      const __m256i q = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]),
                                          _mm256_hadd_epi32(s[2], s[3]));
      const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
      if constexpr (SUB == kGroup) {
        store(corr + 4 * h, _mm_add_epi32(lo, hi));
      } else {  // 16: each group's two halves, in order
        store(corr + 8 * h, _mm_unpacklo_epi32(lo, hi));
        store(corr + 8 * h + 4, _mm_unpackhi_epi32(lo, hi));
      }
    }
  } else {
    static_assert(G == 1 && SUB == kGroup, "one group of 32 a block otherwise");
    __m128i v = _mm_add_epi32(_mm256_castsi256_si128(sums[0]),
                              _mm256_extracti128_si256(sums[0], 1));
    v = _mm_hadd_epi32(v, v);
    v = _mm_hadd_epi32(v, v);
    corr[0] = (kShift * static_cast<int32_t>(SUB) - _mm_cvtsi128_si32(v)) * 128;
  }
}
#endif

// Row n as the GEMM takes it (gemm.cpp): signed codes c with w = sc[k / SUB] * c + mn[k / 32]
// (mn only for the formats with a min), and per scale -128 * the sum of its codes. Formats
// whose min is a fixed multiple of the scale (Q5_0: -16 d; Q6_K: -32 d sc) fold it into the
// codes, which then need no min term.
template <WeightKind K>
void unpack_t(const QLinear& L, int64_t n, int8_t* codes, float* sc, float* mn, int32_t* corr) {
  for_each_block<K>(L, n, [&](auto layout, const uint8_t* b, int64_t k0) {
    constexpr WeightKind KB = decltype(layout)::value;
    using T = Traits<KB>;
    constexpr int64_t S = T::QK / T::SUB, G = T::QK / kGroup;
    constexpr int kShift = kCodeShift<KB>;
    float* bs = sc + k0 / T::SUB;
    float* bm = mn + k0 / kGroup;
#ifdef __AVX2__
    if constexpr (G == 8 && T::SUB == kGroup) {  // Q4_K, Q5_K, the Q5_0 groups
      __m256 sv, mv;  // the vector unpacking of Q4_K's 6-bit fields: the scalar one cost
      group_factors<KB>(b, sv, mv);  // as much as the rest of the block
      _mm256_storeu_ps(bs, sv);
      if constexpr (kShift == 0) _mm256_storeu_ps(bm, mv);
    } else
#endif
    {
      float s[S], m[S];
      block_factors<KB>(b, s, m);
      for (int64_t i = 0; i < S; ++i) bs[i] = s[i];
      if constexpr (kShift == 0)
        for (int64_t g = 0; g < G; ++g) bm[g] = m[g];
    }
    int8_t* o = codes + k0;
#ifdef __AVX2__
    if (corr == nullptr) {  // a form that reads no corrections (Dot::kSigned, kPairs)
      for_each_group<KB>(b, [&](int64_t g, __m256i u) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + g * kGroup),
                            _mm256_sub_epi8(u, _mm256_set1_epi8(kShift)));
      });
      return;
    }
    // -128 * sum of each scale's codes: sum(u) - kShift * SUB. Per group, 8 lanes of sums
    // of 4 codes (lanes 0-3: its first 16 codes); the groups' horizontal sums then all at
    // once below (a third of the instructions of one each).
    __m256i sums[G];
    for_each_group<KB>(b, [&](int64_t g, __m256i u) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + g * kGroup),
                          _mm256_sub_epi8(u, _mm256_set1_epi8(kShift)));
      sums[g] = _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_set1_epi8(1)),
                                  _mm256_set1_epi16(1));
    });
    block_corrections<T::SUB, G, kShift>(sums, corr + k0 / T::SUB);
#else
    uint8_t u[T::QK];
    unpack_codes<KB>(b, u);
    for (int64_t k = 0; k < T::QK; ++k) o[k] = static_cast<int8_t>(u[k] - kShift);
    if (corr != nullptr) code_corrections(o, T::QK, T::SUB, corr + k0 / T::SUB);
#endif
  });
}

// `case` labels for each stored kind, running CALL(kind) (a compile-time argument).
#define KVLOOP_STORED_KINDS(CALL)                     \
  case WeightKind::Q4_K: CALL(WeightKind::Q4_K); break; \
  case WeightKind::Q5_K: CALL(WeightKind::Q5_K); break; \
  case WeightKind::Q6_K: CALL(WeightKind::Q6_K); break; \
  case WeightKind::Q5_0: CALL(WeightKind::Q5_0); break; \
  case WeightKind::Q5_1: CALL(WeightKind::Q5_1); break; \
  default: TORCH_CHECK(false, "not a stored block kind: ", static_cast<int64_t>(kind));

}  // namespace

bool is_stored(WeightKind kind) {
  return kind >= WeightKind::Q4_K && kind <= WeightKind::Q5_1;
}

int64_t stored_row_bytes(WeightKind kind, int64_t K) {
  int64_t bytes = 0;
#define ROW_BYTES(F) bytes = K % Traits<F>::QK == 0 ? K / Traits<F>::QK * Traits<F>::BYTES : 0
  switch (kind) { KVLOOP_STORED_KINDS(ROW_BYTES) }
#undef ROW_BYTES
  return bytes;
}

void stored_rows(const QLinear& L, const QuantizedActs& A, int64_t m0, int64_t m1, int64_t n,
                 float* y) {
  const WeightKind kind = L.kind;
#define ROWS(F) rows_t<F>(L, A, m0, m1, n, y)
  switch (kind) { KVLOOP_STORED_KINDS(ROWS) }
#undef ROWS
}

void stored_rows_at_once(const QLinear& L, const QuantizedActs& A, int64_t m, int64_t n,
                         float* y) {
  const WeightKind kind = L.kind;
  const uint8_t* W = L.wbytes;
#define ROWS_AT_ONCE(F) rows_stored<1, kStoredRowsAtOnce, F>(W, A, L.out_features, n, m, y)
  switch (kind) { KVLOOP_STORED_KINDS(ROWS_AT_ONCE) }
#undef ROWS_AT_ONCE
}

bool stored_takes_wide_acts(WeightKind kind) { return kind == WeightKind::Q6_K; }

void lane_order_acts16(QuantizedActs& a) {
#ifndef __AVX2__
  (void)a;  // the scalar rows_q6k_wide reads q16 as it is
#else
  a.q16x.resize(a.q16.size());
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t g = 0; g < a.K / kGroup; ++g) {
      const int16_t* src = a.q16.data() + m * a.K + g * kGroup;
      int16_t* dst = a.q16x.data() + m * a.K + g * kGroup;
      for (int q = 0; q < 4; ++q)  // quarters 0, 2, 1, 3 of the group
        std::memcpy(dst + 8 * q, src + 8 * ((q % 2) * 2 + q / 2), 8 * sizeof(int16_t));
    }
#endif
}

// The two below serve layers whose constructor took wide_acts, which it does for Q6_K only
// (stored_takes_wide_acts): called per weight row, they check nothing again.
void stored_rows_wide(const QLinear& L, const QuantizedActs& A, int64_t m0, int64_t m1,
                      int64_t n, float* y) {
  const uint8_t* W = L.wbytes;
  int64_t m = m0;
  for (; m + kCols <= m1; m += kCols) rows_q6k_wide<kCols, 1>(W, A, L.out_features, n, m, y);
  for (; m < m1; ++m) rows_q6k_wide<1, 1>(W, A, L.out_features, n, m, y);
}

void stored_rows_wide_at_once(const QLinear& L, const QuantizedActs& A, int64_t m0, int64_t m1,
                              int64_t n, float* y) {
  const uint8_t* W = L.wbytes;
  const int64_t N = L.out_features;
  static_assert(kStoredRowsAtOnce == 4 && kCols == 4, "the cases below");
  switch (m1 - m0) {  // one pass over the rows for all of them (12 pairs would spill: 2 + 2)
    case 1: rows_q6k_wide<1, 4>(W, A, N, n, m0, y); break;
    case 2: rows_q6k_wide<2, 4>(W, A, N, n, m0, y); break;
    case 3:
      rows_q6k_wide<3, 2>(W, A, N, n, m0, y);
      rows_q6k_wide<3, 2>(W, A, N, n + 2, m0, y);
      break;
    default: TORCH_CHECK(false, "batch-1 rows: 1 to 3 activation rows");
  }
}

void stored_decode_row(const QLinear& L, int64_t n, float* out) {
  const WeightKind kind = L.kind;
#define DECODE(F) decode_t<F>(L, n, out)
  switch (kind) { KVLOOP_STORED_KINDS(DECODE) }
#undef DECODE
}

int64_t stored_gemm_sub(WeightKind kind) {
  return kind == WeightKind::Q6_K ? 16 : kGroup;
}

bool stored_gemm_has_min(WeightKind kind) {
  return kind == WeightKind::Q4_K || kind == WeightKind::Q5_K || kind == WeightKind::Q5_1;
}

bool stored_gemm_signed_codes(WeightKind kind) {
  bool shifted = false;
#define SHIFTED(F) shifted = kCodeShift<F> > 0
  switch (kind) { KVLOOP_STORED_KINDS(SHIFTED) }
#undef SHIFTED
  return shifted;
}

int stored_gemm_max_code(WeightKind kind) {
  int c = 0;
#define MAX_CODE(F) c = kMaxCode<F>
  switch (kind) { KVLOOP_STORED_KINDS(MAX_CODE) }
#undef MAX_CODE
  return c;
}

void stored_unpack_row(const QLinear& L, int64_t n, int8_t* codes, float* sc, float* mn,
                       int32_t* corr) {
  const WeightKind kind = L.kind;
#define UNPACK(F) unpack_t<F>(L, n, codes, sc, mn, corr)
  switch (kind) { KVLOOP_STORED_KINDS(UNPACK) }
#undef UNPACK
}

}  // namespace kvloop
