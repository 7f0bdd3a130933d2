// The int8 GEMM: quantized weights against batches of activation rows (prefill chunks,
// decode batches of several sequences), where the row kernels of linear.cpp pay their
// per-row costs again for every few activation rows and the bf16 path decodes the whole
// weight to floats every call.
//
// The activations are the operand that repeats, so they are laid out for the vector unit
// once per call (interleave_acts): kGemmLanes rows side by side, 4 bytes of each per 32-bit
// lane, their block scales lane by lane. A weight row is unpacked into int8 codes and its
// scales once per pass over the activations (one pass for a decode batch; any format: the
// codes as they dot, the scales as the file has them),
// then each 4 of its codes are broadcast against a panel of activations: one u8 x s8 dot
// product instruction (VNNI's vpdpbusd; AVX2's vpmaddubsw + vpmaddwd) advances a panel's
// rows' sums (8, or 16 on AVX-512) by 4 weights, with no horizontal sums and no permutes.
// Per group of 16 or 32 weights the integer sums become floats once:
// sum_k w_k x_k = sc * d_x * (codes . q) (+ mn * d_x sum q).
//
// The activations go in as q + 128 (unsigned), so each sum carries 128 * sum(codes) too;
// the integer accumulator starts at minus that (per weight row and group), which removes
// it exactly. AVX2's vpmaddubsw adds pairs of u8 x s8 products in int16: with the +128
// offset that holds only for codes of |c| <= 64 (every 4- to 6-bit format). Smaller codes
// leave room for more: a pair is at most 2 x 255 x C for |c| <= C, so several vpmaddubsw
// results add up in int16 (vpaddw) before one vpmaddwd widens them (int16_sums), which
// spares most of the widening multiplies: 4 results at a time for 4-bit codes and Q5_0's,
// 2 for the other 5- and 6-bit ones. Codes that are never negative (4-bit ones with a min,
// Q4_K's, Q5_K's) need no offset at all there (Dot::kSigned): they are vpmaddubsw's unsigned
// operand and the activations the signed one, interleaved as q for such layers
// (QLinear::gemm_signed_acts), so a pair is at most 2 x 127 x C: a whole group of 4-bit
// codes sums in int16 (one widening per 32 codes, where the offset needed two, and no
// correction). 8-bit codes on AVX2 without VNNI (kSigned8) dot the other way round: the
// codes' magnitudes are the unsigned operand and the activations, signed q too, take the
// codes' signs (vpsignb), so a pair sums at most 2 x 128 x 127 < 2^15 and no offset is
// there to remove.
//
// A head's int16 activations (wide_acts) take two such panels: q16 = 256 h + l with l the
// low byte (0-255) and h + 128 the high one, each dotted with the codes; the sums combine
// exactly in int32 (|32 x 127 x 32767| < 2^31) as 256 (hi - 128 sum(c)) + lo. Twice the dot
// products of int8 activations, and still no weight decoded to floats.
//
// On AVX2 without VNNI, 8-bit codes cannot meet those byte panels (2 x 255 x 128 overflows
// vpmaddubsw's int16 pairs), so a head with 8-bit codes (Q8_0 files' tables, int8 heads)
// takes its int16 activations as they are (Dot::kPairs, QLinear::gemm_pairs), and so does
// a Q6_K head (Q4_K_M files), whose byte panels would cost two vpmaddubsw and a widening
// per 4 weights where a pair costs one vpmaddwd per 2: panels of
// 32-bit lanes holding two activations of a row, each pair of codes widened to int16 and
// broadcast, one vpmaddwd advancing 8 rows' sums by 2 weights, exact in int32. Its row
// kernel reads every activation row once per weight row, from L2: at 32 rows of Gemma 3's
// 262k-row head that traffic, not the arithmetic, set its time.

#include "kvloop.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "simd.h"

namespace kvloop {
namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kLanes = kGemmLanes;
// Activation panels per pass over the weights: each weight row is unpacked once per pass,
// so where K is large (a down projection's 8192-8960) a pass of the L2's 512 KiB held only
// 32-64 rows, and at 512 rows the unpacking was repeated 8-16 times. 2 MiB passes spill
// to L3 but unpack 4x less: one thread, 512 rows, avx512vnni, K = 8960 (N = 1536) Q4_K 62.1
// -> 52.8 ms, Q6_K 75.5 -> 57.3; K = 8192 (N = 2048) Q6_K 76.6 -> 67.2; the avx2 build on
// the same CPU, K = 8960, Q6_K 97.8 -> 89.2 ms; K = 2048 layers unchanged.
constexpr int64_t kPanelsBytes = 1 << 21;
#ifdef __AVX512VL__
constexpr int kR = 4, kP = 2;  // weight rows x panels per tile: 32 vector registers
#elif defined(__AVX2__)
constexpr int kR = 4, kP = 1;  // 16 vector registers
#else
constexpr int kR = 1, kP = 1;
#endif
// int16 activations: two accumulators per lane, so half the panels per tile.
constexpr int kPW = kP > 1 ? kP / 2 : 1;

// This build's vpmaddubsw path (AVX2 without VNNI): 8-bit codes dot with signed
// activations; every other build dots them as any other code.
constexpr bool kMaddubs =
#if defined(__AVX2__) && !defined(KVLOOP_VNNI)
    true;
#else
    false;
#endif

// How a layer's codes meet the activations' bytes (see the top).
enum class Dot {
  kOffset,   // activations q + 128 (unsigned) against the codes; the corrections remove 128
  kWide,     // int16 activations as a low and a high byte panel, each as kOffset's
  kSigned,   // vpmaddubsw builds, codes >= 0: the codes unsigned against activations q
  kSigned8,  // vpmaddubsw builds, 8-bit codes: their magnitudes against q with their signs
  kPairs,    // vpmaddubsw builds, 8-bit codes, int16 activations: vpmaddwd on pairs
};

// Weight rows x activation panels per tile. kSigned summing whole groups in int16 (kSums
// 8) keeps no int32 sums beside them, which leaves AVX2's 16 registers room for 3 x 2
// (Q4_K, one thread: 1.61 against 1.71 cycles per 32 weights and activation row). The
// others measured slower so (Q5_K 1.94 against 1.88, Q5_0 1.77 / 1.71, Q6_K 2.23 / 2.14).
template <Dot kDot, int kSums>
constexpr bool kWholeGroups = kMaddubs && kDot == Dot::kSigned && kSums == 8;
template <Dot kDot, int kSums>
constexpr int kTileRows = kWholeGroups<kDot, kSums> ? 3 : kR;
template <Dot kDot, int kSums>
constexpr int kTilePanels = kWholeGroups<kDot, kSums> ? 2 : kDot == Dot::kWide ? kPW : kP;

// How a layer's codes dot: the weights per scale (16 or 32), whether a min term follows,
// the activations' form, and how many vpmaddubsw results add up in int16 (int16_sums).
struct GemmFormat {
  int64_t sub = kGroup;
  bool has_min = false;
  Dot dot = Dot::kOffset;
  int sums = 1;
};

// How many vpmaddubsw results (int16 lanes, each a pair of activation x code products) add
// up in int16 without overflow, for codes of |c| <= max_code and activation bytes of at
// most max_act (255 for q + 128, 127 for q): a pair is at most 2 x max_act x max_code, so
// n of them stay within 32767 for n <= 32767 / (2 max_act max_code):
//   q + 128, max_code  8 (-8..7): 8 (a whole group of 32 codes: 4 x 8 steps of 4)
//   q + 128, max_code 15 (0..15): 4 (4-bit codes), 16 (Q5_0's -16..15): 4
//   q + 128, max_code 31 (0..31): 2 (Q5_K, Q5_1), 32 (Q6_K's -32..31): 2
//   q + 128, max_code 64: 1 (one widening per 4 codes); 8-bit codes: 1
//   q, max_code 15: 8 (4-bit codes, Dot::kSigned); 31: 4 (Q5_K, Q5_1)
// A power of two (the steps of 4 codes per scale, 4 or 8, split evenly), at most 8.
constexpr int int16_sums(int max_code, int max_act = 255) {
  const int n = max_code <= 0 ? 8 : 32767 / (2 * max_act * max_code);
  return n >= 8 ? 8 : n >= 4 ? 4 : n >= 2 ? 2 : 1;
}
static_assert(int16_sums(8) == 8 && int16_sums(15) == 4 && int16_sums(16) == 4 &&
              int16_sums(31) == 2 && int16_sums(32) == 2 && int16_sums(64) == 1 &&
              int16_sums(128) == 1 && int16_sums(15, 127) == 8 && int16_sums(31, 127) == 4);

GemmFormat format_of(const QLinear& L) {
  GemmFormat f;
  int max_code = 128;  // 8-bit codes
  bool signed_codes = true;
  if (is_stored(L.kind)) {
    f.sub = stored_gemm_sub(L.kind);
    f.has_min = stored_gemm_has_min(L.kind);
    max_code = stored_gemm_max_code(L.kind);
    signed_codes = stored_gemm_signed_codes(L.kind);
  } else {
    switch (L.kind) {
      case WeightKind::Q4:
      case WeightKind::Q4F:  // codes 0..15, w = sc * c + mn
        f.has_min = true;
        max_code = 15;
        signed_codes = false;
        break;
      case WeightKind::Q8B:
        f.sub = L.group;
        f.has_min = L.has_min;
        break;
      default: break;  // Q8: one scale per row, repeated per group
    }
  }
  const bool eight_bit = !is_stored(L.kind) && L.eight_bit_codes();
  if (L.wide_acts) {
    f.dot = L.gemm_pairs() ? Dot::kPairs : Dot::kWide;
  } else if (kMaddubs && eight_bit) {
    f.dot = Dot::kSigned8;  // all 8 bits: no +128 offset
  } else if (kMaddubs && !signed_codes) {
    f.dot = Dot::kSigned;
  }
  // Only vpmaddubsw's int16 pair sums need this; the 8-bit paths have no room (see the
  // top), and VNNI's vpdpbusd sums in int32 already.
  if (f.dot == Dot::kOffset && kMaddubs) f.sums = int16_sums(max_code);
  if (f.dot == Dot::kSigned) f.sums = int16_sums(max_code, 127);
  return f;
}

// Whether f's activation panels hold q as signed bytes (not q + 128).
bool signed_acts(const GemmFormat& f) { return f.dot == Dot::kSigned || f.dot == Dot::kSigned8; }

#ifdef __AVX2__
// The sums of 128 bytes of codes as 16-bit lanes: each 32 bytes (v XOR 0x80 is c + 128,
// unsigned) summed by vpsadbw into 4 qwords of at most 8 x 255 = 2040, and the four
// vectors' qwords stacked 16 bits apart in one (a lane's 4 slots never carry into the next).
inline __m256i biased_sums(const int8_t* codes) {
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80)), zero = _mm256_setzero_si256();
  __m256i sums[4];
  for (int i = 0; i < 4; ++i)
    sums[i] = _mm256_sad_epu8(
        _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * i)), bias),
        zero);
  return _mm256_add_epi64(_mm256_add_epi64(sums[0], _mm256_slli_epi64(sums[1], 16)),
                          _mm256_add_epi64(_mm256_slli_epi64(sums[2], 32),
                                           _mm256_slli_epi64(sums[3], 48)));
}

// -128 * sum(codes) of each group from its biased sum: sum(c + 128) - 128 * SUB = sum(c).
template <int64_t SUB>
inline __m256i unbias(__m256i biased) {
  return _mm256_mullo_epi32(_mm256_sub_epi32(biased, _mm256_set1_epi32(128 * SUB)),
                            _mm256_set1_epi32(-128));
}
#endif

// -128 * the sum of each SUB codes. The sums are a large share of the int8 GEMM where
// 8-bit codes are read in place (recomputed per weight row and call: 11% of a Q8_0 head's
// time at 32 rows, the plain loop's horizontal sums per group). AVX2: 128 bytes of codes
// at a time through vpsadbw (biased_sums): 4 groups of 32, or 8 of 16.
template <int64_t SUB>
void corrections(const int8_t* codes, int64_t K, int32_t* corr) {
  static_assert(SUB == 16 || SUB == 32, "groups of 16 or 32 codes");
  int64_t g = 0;
#ifdef __AVX2__
  constexpr int64_t kGroupsPer128 = 128 / SUB;
  for (; (g + kGroupsPer128) * SUB <= K; g += kGroupsPer128) {
    const __m256i s = biased_sums(codes + g * SUB);
    if constexpr (SUB == 32) {
      // Each qword holds groups g..g+3 in its 4 slots; add the 4 qwords.
      const __m128i h = _mm_add_epi16(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      const __m128i t = _mm_add_epi16(h, _mm_unpackhi_epi64(h, h));
      const __m256i total = _mm256_castsi128_si256(_mm_cvtepu16_epi32(t));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(corr + g),
                       _mm256_castsi256_si128(unbias<SUB>(total)));
    } else {
      // A vector's qwords 0-1 hold the first group of its 32 bytes, 2-3 the second: slot
      // i of the qword pairs is group 2i (low half) and 2i + 1 (high half).
      const __m256i pairs = _mm256_add_epi16(s, _mm256_srli_si256(s, 8));
      const __m128i even = _mm256_castsi256_si128(pairs), odd = _mm256_extracti128_si256(pairs, 1);
      const __m256i total = _mm256_cvtepu16_epi32(_mm_unpacklo_epi16(even, odd));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(corr + g), unbias<SUB>(total));
    }
  }
#endif
  for (; g < K / SUB; ++g) {
    int32_t total = 0;
    for (int64_t k = 0; k < SUB; ++k) total += codes[g * SUB + k];
    corr[g] = -128 * total;
  }
}

}  // namespace

void code_corrections(const int8_t* codes, int64_t K, int64_t sub, int32_t* corr) {
  if (sub == 16) {
    corrections<16>(codes, K, corr);
  } else {
    corrections<kGroup>(codes, K, corr);
  }
}

namespace {

// nb groups of 16 bytes (element j of a group in byte j's low nibble, 16 + j in its high)
// as codes [nb * 32], and their corrections per group of 32 where corr is not null (only
// the +128 forms read them: Dot::kSigned, every 4-bit layer's on AVX2, does not). The
// weight rows of a tile are unpacked once per pass over the activations: at decode batch
// sizes (16-64 rows) that is a large share of the GEMM's time, so it runs on vectors (a
// byte loop cost ~3 ns a code).
void unpack_nibbles(const uint8_t* b, int64_t nb, int8_t* codes, int32_t* corr) {
  for (int64_t g = 0; g < nb; ++g) {
    int8_t* o = codes + g * kGroup;
#ifdef __AVX2__
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * g));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o), lo);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 16), hi);
    if (corr == nullptr) continue;
    // The codes are 0-15: psadbw against zero sums each 8 of them.
    const __m128i sums = _mm_add_epi64(_mm_sad_epu8(lo, _mm_setzero_si128()),
                                       _mm_sad_epu8(hi, _mm_setzero_si128()));
    corr[g] = -128 * static_cast<int32_t>(_mm_cvtsi128_si64(sums) +
                                          _mm_extract_epi64(sums, 1));
#else
    int32_t total = 0;
    for (int j = 0; j < 16; ++j) {
      o[j] = static_cast<int8_t>(b[16 * g + j] & 0x0F);
      o[j + 16] = static_cast<int8_t>(b[16 * g + j] >> 4);
      total += o[j] + o[j + 16];
    }
    if (corr != nullptr) corr[g] = -128 * total;
#endif
  }
}

// Row n's factors in an 8-bit-code layer: Q8's one scale repeated per group of 32, or Q8B's
// scales [K / group] (and mins [K / 32] where it has them).
void eight_bit_factors(const QLinear& L, int64_t n, float* sc, float* mn) {
  const int64_t K = L.in_features;
  if (L.kind == WeightKind::Q8) {
    std::fill(sc, sc + K / kGroup, L.s<float>()[n]);
    return;
  }
  TORCH_CHECK(L.kind == WeightKind::Q8B, "not a layer of 8-bit codes");
  const int64_t ng = K / L.group, width = L.f32_scales ? 4 : 2;
  const uint8_t* S = L.sbytes +
                     n * (L.has_min ? 2 : 1) * ng * width;
  for (int64_t g = 0; g < ng; ++g) {
    sc[g] = L.f32_scales ? scale_at<true>(S, g) : scale_at<false>(S, g);
    if (L.has_min)
      mn[g] = L.f32_scales ? scale_at<true>(S + ng * 4, g) : scale_at<false>(S + ng * 2, g);
  }
}

// Weight row n of a layer with packed codes (GGUF blocks as stored, Q4, Q4F) as codes [K],
// scales [K / 32 or 16], mins [K / 32] (where it has them), w = sc * c + mn, and the
// corrections [K / 32 or 16] where corr is not null. (8-bit codes are read where they
// are: RowTile::load.)
void unpack_row(const QLinear& L, int64_t n, int8_t* codes, float* sc, float* mn,
                int32_t* corr) {
  if (is_stored(L.kind)) return stored_unpack_row(L, n, codes, sc, mn, corr);
  TORCH_CHECK(L.kind == WeightKind::Q4 || L.kind == WeightKind::Q4F, "not a packed layout");
  // Q4 / Q4F: a row's scales, then its mins, then 16 code bytes per group
  const int64_t nb = L.in_features / kGroup;
  const bool f32s = L.kind == WeightKind::Q4F;
  const int64_t width = f32s ? 4 : 2;
  const uint8_t* row = L.wbytes + n * nb * (2 * width + 16);
  if (f32s) {
    std::memcpy(sc, row, nb * 4);
    std::memcpy(mn, row + 4 * nb, nb * 4);
  } else {
    f16_scales(row, nb, sc);
    f16_scales(row + 2 * nb, nb, mn);
  }
  unpack_nibbles(row + 2 * width * nb, nb, codes, corr);
}

// Row n of a layer with int16 activations (8-bit codes, Q6_K blocks) as tile_pairs takes
// it: its codes widened to int16 (8-bit ones straight from the weights, Q6_K's unpacked
// into `scratch` [K] first), and its factors; int16 activations in pairs carry no offset
// to correct.
void unpack_row_pairs(const QLinear& L, int64_t n, int16_t* c16, float* sc, float* mn,
                      int8_t* scratch) {
  const int64_t K = L.in_features;
  const int8_t* w = scratch;
  if (is_stored(L.kind)) {
    stored_unpack_row(L, n, scratch, sc, mn, nullptr);
  } else {
    w = L.w<int8_t>() + n * K;
    eight_bit_factors(L, n, sc, mn);
  }
  int64_t k = 0;
#ifdef __AVX2__
  for (; k + 16 <= K; k += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c16 + k),
                        _mm256_cvtepi8_epi16(
                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k))));
#endif
  for (; k < K; ++k) c16[k] = w[k];
}

// A thread's unpacked weight rows: kR rows (a tile's most) of codes, scales, mins and
// corrections.
struct RowTile {
  int64_t K = 0, sub = kGroup;
  bool pairs = false;          // codes16 instead of codes and corr (kPairs)
  bool corrected = true;       // whether the tile reads corr (the +128 forms: kOffset, kWide)
  std::vector<int8_t> codes;   // [kR, K]: the rows unpacked from packed layouts (kPairs:
                               // Q6_K's before they are widened)
  const int8_t* rows[kR] = {};   // each row's codes: in codes, or 8-bit ones in the weight
  std::vector<int16_t> codes16;  // [kR, K] the codes widened, for kPairs
  std::vector<float> sc, mn;   // [kR, K / sub], [kR, K / 32]
  std::vector<int32_t> corr;   // [kR, K / sub]: -128 * sum of the group's codes

  void reserve(int64_t K_, int64_t sub_, bool pairs_, bool corrected_) {
    K = K_;
    sub = sub_;
    pairs = pairs_;
    corrected = corrected_;
    codes.resize(kR * K);
    codes16.resize(pairs ? kR * K : 0);
    sc.resize(kR * (K / sub));
    mn.resize(kR * (K / kGroup));
    corr.resize(kR * (K / sub));
  }
  const int8_t* c(int r) const { return rows[r]; }
  const int16_t* c16(int r) const { return codes16.data() + r * K; }
  const float* s(int r) const { return sc.data() + r * (K / sub); }
  const float* m(int r) const { return mn.data() + r * (K / kGroup); }
  const int32_t* x(int r) const { return corr.data() + r * (K / sub); }

  void load(const QLinear& L, int64_t n, int r) {
    float* s = sc.data() + r * (K / sub);
    float* m = mn.data() + r * (K / kGroup);
    int32_t* x = corr.data() + r * (K / sub);
    if (pairs)
      return unpack_row_pairs(L, n, codes16.data() + r * K, s, m, codes.data() + r * K);
    if (L.kind == WeightKind::Q8 || L.kind == WeightKind::Q8B) {
      // 8-bit codes dot as they are stored: no copy, and their sums only where the tile
      // reads them (at 8 rows of Q8_0 on AVX2, copying and summing were a third of the
      // GEMM's time: perf, 8192x2048, one thread).
      rows[r] = L.w<int8_t>() + n * K;
      eight_bit_factors(L, n, s, m);
      if (corrected) code_corrections(rows[r], K, sub, x);
      return;
    }
    int8_t* unpacked = codes.data() + r * K;
    rows[r] = unpacked;
    unpack_row(L, n, unpacked, s, m, corrected ? x : nullptr);
  }
};

// Into L2 (prefetcht1), not L1: a tile's next rows are requested in one burst of a few
// dozen lines, and into L1 the burst filled its miss buffers and stalled on the prefetches
// themselves (perf: 12% of a head-shaped GEMM's time on the instruction after them).
// Weights streamed from DRAM (layers called in turn, 32 rows, 2 threads, avx512vnni):
// head-shaped 32768 x 1152 with int16 activations Q6_K 10.3-12.1 -> 9.1 ms, Q8_0 9.5-11.0
// -> 8.1-8.3 (with the vectorised corrections); 8192 x 2048 layers unchanged or faster.
inline void prefetch(const char* p) {
#ifdef __AVX2__
  _mm_prefetch(p, _MM_HINT_T1);
#else
  (void)p;
#endif
}

#ifdef __AVX2__
// The tiles' vectors: one int32 or float lane per activation row of a panel (kLanes).
// AVX-512 builds take 16 rows in 512-bit registers. On Zen 4 a 512-bit vpdpbusd issues at
// half the rate of a 256-bit one, so the multiply-adds a cycle are the same, but the rest
// of a tile (the weights' broadcasts, the activations' loads, the float stage per group)
// is spent once per 16 rows instead of 8. Measured against 8 lanes in 256-bit registers
// (one thread, 2048 x 2048, avx512vnni, both with gemm_t's output block): 512 rows
// 16.1 / 17.0 ms (Q4_K), 32 rows 1.17 / 1.28 ms; but 24 rows 1.19 / 1.02 ms, where a
// second panel of 16 is a third empty.
#ifdef KVLOOP_VNNI
using VI = __m512i;
using VF = __m512;
inline VI vi_load(const void* p) { return _mm512_loadu_si512(p); }
inline VI vi_set1(int32_t v) { return _mm512_set1_epi32(v); }
inline VI vi_zero() { return _mm512_setzero_si512(); }
inline VI vi_add32(VI a, VI b) { return _mm512_add_epi32(a, b); }
inline VI vi_shl8(VI a) { return _mm512_slli_epi32(a, 8); }
// vpmaddubsw's forms (Dot::kSigned, kSigned8, kPairs, int16 sums) run only on AVX2 builds
// without VNNI; these keep their code compiling here.
inline VI vi_set1_16(int16_t v) { return _mm512_set1_epi16(v); }
inline VI vi_add16(VI a, VI b) { return _mm512_add_epi16(a, b); }
inline VI vi_madd16(VI a, VI b) { return _mm512_madd_epi16(a, b); }
inline VI vi_maddubs(VI u, VI s) { return _mm512_maddubs_epi16(u, s); }
inline VI vi_abs8(VI a) { return _mm512_abs_epi8(a); }
inline VI vi_sign8(VI a, VI b) {  // AVX2's vpsignb: a negated where b < 0, zero where b == 0
  const VI kept = _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(b, b), a);
  return _mm512_mask_sub_epi8(kept, _mm512_movepi8_mask(b), vi_zero(), a);
}
inline VI vi_dpbusd(VI acc, VI u, VI s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline VF vf_zero() { return _mm512_setzero_ps(); }
inline VF vf_load(const float* p) { return _mm512_loadu_ps(p); }
inline VF vf_set1(float v) { return _mm512_set1_ps(v); }
inline void vf_store(float* p, VF v) { _mm512_storeu_ps(p, v); }
inline VF vf_cvt(VI v) { return _mm512_cvtepi32_ps(v); }
inline VF vf_mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF vf_fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
#else
using VI = __m256i;
using VF = __m256;
inline VI vi_load(const void* p) { return _mm256_loadu_si256(static_cast<const VI*>(p)); }
inline VI vi_set1(int32_t v) { return _mm256_set1_epi32(v); }
inline VI vi_set1_16(int16_t v) { return _mm256_set1_epi16(v); }
inline VI vi_zero() { return _mm256_setzero_si256(); }
inline VI vi_add32(VI a, VI b) { return _mm256_add_epi32(a, b); }
inline VI vi_add16(VI a, VI b) { return _mm256_add_epi16(a, b); }
inline VI vi_shl8(VI a) { return _mm256_slli_epi32(a, 8); }
inline VI vi_madd16(VI a, VI b) { return _mm256_madd_epi16(a, b); }
inline VI vi_maddubs(VI u, VI s) { return _mm256_maddubs_epi16(u, s); }
inline VI vi_abs8(VI a) { return _mm256_abs_epi8(a); }
inline VI vi_sign8(VI a, VI b) { return _mm256_sign_epi8(a, b); }
inline VF vf_zero() { return _mm256_setzero_ps(); }
inline VF vf_load(const float* p) { return _mm256_loadu_ps(p); }
inline VF vf_set1(float v) { return _mm256_set1_ps(v); }
inline void vf_store(float* p, VF v) { _mm256_storeu_ps(p, v); }
inline VF vf_cvt(VI v) { return _mm256_cvtepi32_ps(v); }
inline VF vf_mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF vf_fma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
#endif
static_assert(sizeof(VI) == 4 * kLanes && sizeof(VF) == 4 * kLanes, "a lane per row");
#endif

#ifdef __AVX2__
// acc + kLanes lanes of sums of 4 u8 x s8 products (a: activations + 128, w: 4 codes repeated).
inline VI dot4(VI acc, VI a, VI w) {
#ifdef KVLOOP_VNNI
  return vi_dpbusd(acc, a, w);
#else
  return vi_add32(acc, vi_madd16(vi_maddubs(a, w), vi_set1_16(1)));
#endif
}

// acc + kLanes lanes of int16 sums h (vpmaddubsw results added up: int16_sums) widened to int32.
inline VI widen_add(VI acc, VI h) {
  return vi_add32(acc, vi_madd16(h, vi_set1_16(1)));
}

// acc + kLanes lanes of sums of 4 products of signed activations (as: q, not q + 128) and 8-bit
// codes w, w_abs their magnitudes (-128's is 128 as an unsigned byte): vpmaddubsw's int16
// pair sums stay within 2 x 128 x 127.
inline VI dot4_signed(VI acc, VI as, VI w_abs, VI w) {
  return vi_add32(acc, vi_madd16(vi_maddubs(w_abs, vi_sign8(as, w)), vi_set1_16(1)));
}
#endif

#ifdef __AVX2__
// acc[r][p] += sub-block gs's integer sums ia[r][p] (kLanes activation rows each) in floats: times
// the weight row's scale and each activation row's, plus the min term where there is one.
template <int64_t SUB, bool kMin, int R, int P>
inline void scale_sums(const RowTile& w, int r0, int64_t gs, const float* D, const float* S,
                       int64_t pfloats, const VI (&ia)[R][P], VF (&acc)[R][P]) {
  const int64_t g = gs * SUB / kGroup;
  VF dv[P], sv[P];
  for (int p = 0; p < P; ++p) {
    dv[p] = vf_load(D + p * pfloats + g * kLanes);
    if constexpr (kMin) sv[p] = vf_load(S + p * pfloats + g * kLanes);
  }
  for (int r = 0; r < R; ++r) {
    const VF f = vf_set1(w.s(r0 + r)[gs]);
    for (int p = 0; p < P; ++p)
      acc[r][p] = vf_fma(vf_cvt(ia[r][p]), vf_mul(f, dv[p]), acc[r][p]);
    if constexpr (kMin) {
      const VF mv = vf_set1(w.m(r0 + r)[g]);
      for (int p = 0; p < P; ++p) acc[r][p] = vf_fma(mv, sv[p], acc[r][p]);
    }
  }
}
#endif

#ifdef __AVX2__
// A tile's sums into its block (see gemm_t): row r of the weights against lane l of panel p
// at out[p * pstride + l * lstride + r], so that each activation row's results lie in a
// run, as y holds them.
template <int R, int P>
inline void store_tile(const VF (&acc)[R][P], float* out, int64_t pstride, int64_t lstride) {
  for (int p = 0; p < P; ++p) {
    alignas(64) float sums[R][kLanes];
    for (int r = 0; r < R; ++r) vf_store(sums[r], acc[r][p]);
    for (int64_t l = 0; l < kLanes; ++l)
      for (int r = 0; r < R; ++r) out[p * pstride + l * lstride + r] = sums[r][l];
  }
}
#endif

// tile's kPairs variant (see the top): int16 activations in pairs, no offset to correct.
template <int64_t SUB, bool kMin, int R, int P>
[[gnu::noinline]] void tile_pairs(const RowTile& w, int r0, const QuantizedActs& a,
                                  int64_t p0, float* out, int64_t pstride, int64_t lstride) {
  const int64_t K = w.K, nsub = K / SUB;
  const int64_t pbytes = 2 * K * kLanes, pfloats = K / kGroup * kLanes;
  const uint8_t* A = a.pq.data() + p0 * pbytes;
  const float* D = a.pd.data() + p0 * pfloats;
  const float* S = a.ps.data() + p0 * pfloats;
#ifdef __AVX2__
  VF acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = vf_zero();
  for (int64_t gs = 0; gs < nsub; ++gs) {
    VI ia[R][P];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) ia[r][p] = vi_zero();
    const uint8_t* ag = A + gs * SUB * kLanes * 2;
    // Unrolled whole: a loop of 16 steps per scale left its exit (and the float work
    // after it) out of the overlap. The running sums are kept whole, as in tile.
    KVLOOP_UNROLL for (int64_t j = 0; j < SUB / 2; ++j) {  // weights gs * SUB + 2j, + 1
      VI av[P];
      for (int p = 0; p < P; ++p)
        av[p] = vi_load(ag + p * pbytes + 4 * kLanes * j);
      for (int r = 0; r < R; ++r) {
        int32_t two;
        std::memcpy(&two, w.c16(r0 + r) + gs * SUB + 2 * j, 4);
        const VI wb = vi_set1(two);
        for (int p = 0; p < P; ++p) {
          ia[r][p] = vi_add32(ia[r][p], vi_madd16(wb, av[p]));
          __asm__("" : "+v"(ia[r][p]));
        }
      }
    }
    scale_sums<SUB, kMin, R, P>(w, r0, gs, D, S, pfloats, ia, acc);
  }
  store_tile<R, P>(acc, out, pstride, lstride);
#else
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      for (int64_t l = 0; l < kLanes; ++l) {
        float total = 0.f;
        for (int64_t gs = 0; gs < nsub; ++gs) {
          int32_t dot = 0;
          for (int64_t k = gs * SUB; k < (gs + 1) * SUB; ++k) {
            int16_t q;
            std::memcpy(&q, A + p * pbytes + ((k / 2) * kLanes + l) * 4 + 2 * (k % 2), 2);
            dot += int32_t(q) * int32_t(w.c16(r0 + r)[k]);
          }
          const int64_t g = gs * SUB / kGroup;
          total += float(dot) * (w.s(r0 + r)[gs] * D[p * pfloats + g * kLanes + l]);
          if constexpr (kMin) total += w.m(r0 + r)[g] * S[p * pfloats + g * kLanes + l];
        }
        out[p * pstride + l * lstride + r] = total;
      }
#endif
}

#ifdef __AVX2__
// int16 pair sums (2 kLanes) of activation bytes av and 4 codes wb repeated, as kDot dots them:
// the activations unsigned (q + 128), or the codes (kSigned, codes >= 0).
template <Dot kDot>
inline VI byte_pairs(VI av, VI wb) {
  return kDot == Dot::kSigned ? vi_maddubs(wb, av) : vi_maddubs(av, wb);
}
#endif

// Rows r0..r0+R of the tile against panels p0..p0+P: out[p * pstride + lane * lstride + r],
// kDot any but kPairs (see Dot). kWide: pq holds the activations' low bytes and pqh their
// high ones. kSums: vpmaddubsw results summed in int16 before each widening to int32
// (int16_sums; 1 for kWide, kSigned8 and VNNI). Not inlined: inside gemm_t's loops GCC
// spilled the AVX2 tile's int16 sums to the stack (Q5_0 and Q6_K at 512 rows ran at half
// the speed).
template <int64_t SUB, bool kMin, Dot kDot, int kSums, int R, int P>
[[gnu::noinline]] void tile(const RowTile& w, int r0, const QuantizedActs& a, int64_t p0,
                            float* out, int64_t pstride, int64_t lstride) {
  constexpr bool kWide = kDot == Dot::kWide;
  static_assert(SUB % (4 * kSums) == 0, "whole int16 sums per scale");
  static_assert(kSums == 1 || (kMaddubs && (kDot == Dot::kOffset || kDot == Dot::kSigned)),
                "int16 sums: vpmaddubsw");
  const int64_t K = w.K, nsub = K / SUB;
  const int64_t pbytes = K * kLanes, pfloats = K / kGroup * kLanes;
  const uint8_t* A = (kWide ? a.pqh : a.pq).data() + p0 * pbytes;
  const uint8_t* AL = kWide ? a.pq.data() + p0 * pbytes : nullptr;
  const float* D = a.pd.data() + p0 * pfloats;
  const float* S = a.ps.data() + p0 * pfloats;
#ifdef __AVX2__
  constexpr bool kSigned8 = kDot == Dot::kSigned8;
  // Activations interleaved as signed q (gemm_signed_acts): no +128 offset in the sums.
  constexpr bool kSignedActs = kSigned8 || kDot == Dot::kSigned;
  VF acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = vf_zero();
  for (int64_t gs = 0; gs < nsub; ++gs) {
    VI ia[R][P];
    VI il[kWide ? R : 1][kWide ? P : 1];  // kWide: the low bytes' sums
    for (int r = 0; r < R; ++r) {
      const VI c = kSignedActs ? vi_zero() : vi_set1(w.x(r0 + r)[gs]);
      for (int p = 0; p < P; ++p) ia[r][p] = c;
      if constexpr (kWide)
        for (int p = 0; p < P; ++p) il[r][p] = vi_zero();
    }
    const uint8_t* ag = A + gs * SUB * kLanes;
    for (int64_t j0 = 0; j0 < SUB / 4; j0 += kSums) {
      VI ih[kSums > 1 ? R : 1][kSums > 1 ? P : 1];  // kSums > 1: the int16 sums
      if constexpr (kSums > 1)
        for (int r = 0; r < R; ++r)
          for (int p = 0; p < P; ++p) ih[r][p] = vi_zero();
      for (int64_t j = j0; j < j0 + kSums; ++j) {
        VI av[P], al[kWide ? P : 1];
        for (int p = 0; p < P; ++p) {
          av[p] = vi_load(ag + p * pbytes + 4 * kLanes * j);
          if constexpr (kWide)
            al[p] = vi_load(AL + gs * SUB * kLanes + p * pbytes + 4 * kLanes * j);
        }
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, w.c(r0 + r) + gs * SUB + 4 * j, 4);
          const VI wb = vi_set1(four);
          if constexpr (kSigned8) {
            const VI wabs = vi_abs8(wb);
            for (int p = 0; p < P; ++p) ia[r][p] = dot4_signed(ia[r][p], av[p], wabs, wb);
          } else if constexpr (kSums > 1) {
            for (int p = 0; p < P; ++p) {
              ih[r][p] = vi_add16(ih[r][p], byte_pairs<kDot>(av[p], wb));
              // The running sum kept as one: otherwise GCC reassociates the steps' sums
              // into trees whose partial results spill (one thread, cycles per 32 weights
              // and activation row: Q4_K 1.96 -> 1.72, Q5_0 1.84 -> 1.71).
              __asm__("" : "+v"(ih[r][p]));
            }
          } else if constexpr (kDot == Dot::kSigned) {
            for (int p = 0; p < P; ++p)
              ia[r][p] = widen_add(ia[r][p], byte_pairs<kDot>(av[p], wb));
          } else {
            for (int p = 0; p < P; ++p) {
              ia[r][p] = dot4(ia[r][p], av[p], wb);
              if constexpr (kWide) il[r][p] = dot4(il[r][p], al[p], wb);
            }
          }
        }
      }
      if constexpr (kSums > 1)
        for (int r = 0; r < R; ++r)
          for (int p = 0; p < P; ++p) ia[r][p] = widen_add(ia[r][p], ih[r][p]);
    }
    if constexpr (kWide)
      for (int r = 0; r < R; ++r)
        for (int p = 0; p < P; ++p)
          ia[r][p] = vi_add32(vi_shl8(ia[r][p]), il[r][p]);
    scale_sums<SUB, kMin, R, P>(w, r0, gs, D, S, pfloats, ia, acc);
  }
  store_tile<R, P>(acc, out, pstride, lstride);
#else
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      for (int64_t l = 0; l < kLanes; ++l) {
        const uint8_t* ap = A + p * pbytes + 4 * l;
        const uint8_t* lp = kWide ? AL + p * pbytes + 4 * l : nullptr;
        const float* dp = D + p * pfloats + l;
        const float* sp = S + p * pfloats + l;
        float total = 0.f;
        for (int64_t gs = 0; gs < nsub; ++gs) {
          int32_t dot = w.x(r0 + r)[gs], low = 0;
          for (int64_t k = gs * SUB; k < (gs + 1) * SUB; ++k) {
            const int64_t at = (k / 4) * kLanes * 4 + k % 4;
            dot += int32_t(ap[at]) * int32_t(w.c(r0 + r)[k]);
            if constexpr (kWide) low += int32_t(lp[at]) * int32_t(w.c(r0 + r)[k]);
          }
          if constexpr (kWide) dot = dot * 256 + low;
          const int64_t g = gs * SUB / kGroup;
          total += float(dot) * (w.s(r0 + r)[gs] * dp[g * kLanes]);
          if constexpr (kMin) total += w.m(r0 + r)[g] * sp[g * kLanes];
        }
        out[p * pstride + l * lstride + r] = total;
      }
#endif
}

// tile, or tile_pairs for kPairs.
template <int64_t SUB, bool kMin, Dot kDot, int kSums, int R, int P>
void run_tile(const RowTile& w, int r0, const QuantizedActs& a, int64_t p0, float* out,
              int64_t pstride, int64_t lstride) {
  if constexpr (kDot == Dot::kPairs) {
    tile_pairs<SUB, kMin, R, P>(w, r0, a, p0, out, pstride, lstride);
  } else {
    tile<SUB, kMin, kDot, kSums, R, P>(w, r0, a, p0, out, pstride, lstride);
  }
}

// Tiles per output block (see gemm_t).
constexpr int64_t kBlockTiles = 16;

template <int64_t SUB, bool kMin, Dot kDot, int kSums>
void gemm_t(const QLinear& L, const QuantizedActs& a, float* y) {
  constexpr bool kWide = kDot == Dot::kWide, kPairs = kDot == Dot::kPairs;
  constexpr int kTileR = kTileRows<kDot, kSums>, kTileP = kTilePanels<kDot, kSums>;
  const int64_t M = a.M, N = L.out_features, K = L.in_features;
  const int64_t panels = (M + kLanes - 1) / kLanes;
  const int64_t chunk = std::max<int64_t>(
      kTileP, kPanelsBytes / (K * kLanes * (kWide ? 2 : 1)) / kTileP * kTileP);
  const int64_t tiles = (N + kTileR - 1) / kTileR;
  const auto* base = static_cast<const char*>(L.weight.data_ptr());
  const int64_t row_bytes = L.weight.size(1) * L.weight.element_size();
  // Output rows split over the threads, each thread's in order; per tile of kTileR weight
  // rows the codes are unpacked once per chunk of activation panels and stay in L1 while
  // every panel of the chunk passes.
  //
  // A tile's results are a few columns of kLanes rows of y, N floats apart: where N is a
  // power of two (most layers' widths) those rows share a few L1 sets, and each tile's
  // writes evicted the lines that the next tile writes again. So the tiles of a block write
  // into a buffer laid out as y is, [panel][lane][the block's columns], whose rows lie in
  // different sets, and the block goes into y a row's run at a time (one thread, Q4_K
  // 2048 x 2048 at 512 rows, avx512vnni: N = 2048 had run 10-20% slower than N = 2040).
  for (int64_t c0 = 0; c0 < panels; c0 += chunk) {
    const int64_t c1 = std::min(panels, c0 + chunk), np = c1 - c0;
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      thread_local RowTile tile_rows;
      thread_local std::vector<float> tile_block;
      RowTile& w = tile_rows;  // one lookup of each thread-local
      std::vector<float>& block = tile_block;
      w.reserve(K, SUB, kPairs, kDot == Dot::kOffset || kDot == Dot::kWide);
      const int64_t lstride = kBlockTiles * kTileR, pstride = kLanes * lstride;
      block.resize(np * pstride);
      for (int64_t b0 = t0; b0 < t1; b0 += kBlockTiles) {
        const int64_t b1 = std::min(t1, b0 + kBlockTiles);
        for (int64_t t = b0; t < b1; ++t) {
          const int64_t n0 = t * kTileR;
          const int rows = static_cast<int>(std::min<int64_t>(kTileR, N - n0));
          for (int r = 0; r < rows; ++r) w.load(L, n0 + r, r);
          // The next tile's weight bytes requested now, read while this tile computes: the
          // unpacking otherwise waits on memory at every cache line (the hardware
          // prefetcher sees a stream that pauses for the whole tile).
          if (t + 1 < t1) {
            const int64_t end = std::min<int64_t>(N, n0 + 2 * kTileR) * row_bytes;
            for (int64_t off = (n0 + kTileR) * row_bytes; off < end; off += 64)
              prefetch(base + off);
          }
          float* out = block.data() + (t - b0) * kTileR;  // this tile's columns
          if (rows == kTileR) {
            int64_t p = c0;
            for (; p + kTileP <= c1; p += kTileP)
              run_tile<SUB, kMin, kDot, kSums, kTileR, kTileP>(
                  w, 0, a, p, out + (p - c0) * pstride, pstride, lstride);
            for (; p < c1; ++p)
              run_tile<SUB, kMin, kDot, kSums, kTileR, 1>(w, 0, a, p, out + (p - c0) * pstride,
                                                          pstride, lstride);
          } else {
            for (int r = 0; r < rows; ++r)
              for (int64_t p = c0; p < c1; ++p)
                run_tile<SUB, kMin, kDot, kSums, 1, 1>(w, r, a, p, out + (p - c0) * pstride + r,
                                                       pstride, lstride);
          }
        }
        const int64_t width = std::min(N, b1 * kTileR) - b0 * kTileR;
        for (int64_t m = c0 * kLanes; m < std::min(M, c1 * kLanes); ++m)
          std::memcpy(y + m * N + b0 * kTileR, block.data() + (m - c0 * kLanes) * lstride,
                      width * sizeof(float));
      }
    });
  }
}

// gemm_t for format f: its weights per scale (16 or 32), min term or not, and int16 sums
// (f.sums: a power of two, found from kSums up; only kOffset and kSigned have them).
template <Dot kDot, int kSums = 1>
void gemm_for(const GemmFormat& f, const QLinear& L, const QuantizedActs& a, float* y) {
  if constexpr (kMaddubs && (kDot == Dot::kOffset || kDot == Dot::kSigned) && kSums < 8) {
    if (f.sums > kSums) return gemm_for<kDot, 2 * kSums>(f, L, a, y);
  }
  if (f.sub == 16) {
    gemm_t<16, false, kDot, std::min(kSums, 4)>(L, a, y);  // 4 steps of 4 a scale
  } else if (f.has_min) {
    gemm_t<kGroup, true, kDot, kSums>(L, a, y);
  } else {
    gemm_t<kGroup, false, kDot, kSums>(L, a, y);
  }
}

}  // namespace

namespace {
// The panels of M rows: bytes(m, k4, hi) the 4 bytes of row m at k4 (hi: the high bytes'
// panel), d(m, g) and s(m, g) its factors per block of 32. Lanes past the last row hold
// the bytes of q = 0 (128 in the offset panels, 0 in a low-byte one) and factors 0: they
// add nothing.
template <typename Bytes, typename D, typename S>
void fill_panels(QuantizedActs& a, bool wide, bool signed_bytes, Bytes bytes, D d, S s) {
  const int64_t M = a.M, K = a.K, nb = K / kGroup;
  const int64_t panels = (M + kLanes - 1) / kLanes;
  a.pq.resize(panels * K * kLanes);
  a.pq_signed = signed_bytes;
  a.pqh.resize(wide ? panels * K * kLanes : 0);
  a.pd.resize(panels * nb * kLanes);
  a.ps.resize(panels * nb * kLanes);
  at::parallel_for(0, panels, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      for (int h = 0; h < (wide ? 2 : 1); ++h) {
        uint8_t* dst = (h ? a.pqh : a.pq).data() + p * K * kLanes;
        const uint32_t empty = (wide && h == 0) || signed_bytes ? 0u : 0x80808080u;
        for (int64_t l = 0; l < kLanes; ++l) {
          const int64_t m = p * kLanes + l;
          for (int64_t k4 = 0; k4 < K / 4; ++k4) {
            const uint32_t four = m < M ? bytes(m, k4, h) : empty;
            std::memcpy(dst + (k4 * kLanes + l) * 4, &four, 4);
          }
        }
      }
      float* pd = a.pd.data() + p * nb * kLanes;
      float* ps = a.ps.data() + p * nb * kLanes;
      for (int64_t l = 0; l < kLanes; ++l) {
        const int64_t m = p * kLanes + l;
        for (int64_t g = 0; g < nb; ++g) {
          pd[g * kLanes + l] = m < M ? d(m, g) : 0.f;
          ps[g * kLanes + l] = m < M ? s(m, g) : 0.f;
        }
      }
    }
  });
}
}  // namespace

void interleave_acts(QuantizedActs& a, bool signed_bytes) {
  const int64_t K = a.K, nb = K / kGroup;
  const uint32_t offset = signed_bytes ? 0u : 0x80808080u;  // q + 128 as unsigned bytes
  fill_panels(
      a, false, signed_bytes,
      [&](int64_t m, int64_t k4, int) {
        uint32_t four;
        std::memcpy(&four, a.q.data() + m * K + 4 * k4, 4);
        return four ^ offset;
      },
      [&](int64_t m, int64_t g) { return a.d[m * nb + g]; },
      [&](int64_t m, int64_t g) { return a.s[m * nb + g]; });
}

void interleave_acts16(QuantizedActs& a, bool pairs) {
  const int64_t K = a.K, nb = K / kGroup;
  if (pairs) {  // [panel][K / 2][lane]: q16[m, 2 k2] | q16[m, 2 k2 + 1] << 16
    const int64_t M = a.M, panels = (M + kLanes - 1) / kLanes;
    a.pq.resize(panels * 2 * K * kLanes);
    a.pq_signed = false;  // int16 pairs: not byte panels of either form
    a.pqh.clear();
    a.pd.resize(panels * nb * kLanes);
    a.ps.resize(panels * nb * kLanes);
    at::parallel_for(0, panels, 4, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        uint8_t* dst = a.pq.data() + p * 2 * K * kLanes;
        for (int64_t l = 0; l < kLanes; ++l) {
          const int64_t m = p * kLanes + l;
          for (int64_t k2 = 0; k2 < K / 2; ++k2) {
            uint32_t two = 0;  // rows past M: activations 0
            if (m < M) std::memcpy(&two, a.q16.data() + m * K + 2 * k2, 4);
            std::memcpy(dst + (k2 * kLanes + l) * 4, &two, 4);
          }
          for (int64_t g = 0; g < nb; ++g) {
            a.pd[(p * nb + g) * kLanes + l] = m < M ? a.d16[m] : 0.f;
            a.ps[(p * nb + g) * kLanes + l] = m < M ? a.s16[m * nb + g] : 0.f;
          }
        }
      }
    });
    return;
  }
  fill_panels(
      a, true, false,
      [&](int64_t m, int64_t k4, int hi) {
        const int16_t* q = a.q16.data() + m * K + 4 * k4;
        uint32_t four = 0;
        for (int i = 0; i < 4; ++i) {  // low byte as is; high byte + 128
          const auto u = static_cast<uint16_t>(q[i]);
          const uint32_t b = hi ? ((u >> 8) ^ 0x80u) : (u & 0xFFu);
          four |= b << (8 * i);
        }
        return four;
      },
      [&](int64_t m, int64_t) { return a.d16[m]; },  // one scale a row
      [&](int64_t m, int64_t g) { return a.s16[m * nb + g]; });
}

void gemm_int8(const QLinear& L, const QuantizedActs& a, float* y) {
  TORCH_CHECK(L.gemm_supported(), "this layer's format does not run in the int8 GEMM");
  const size_t panel_bytes = (a.M + kLanes - 1) / kLanes * a.K * kLanes;
  const bool pairs = L.gemm_pairs();
  TORCH_CHECK(a.K == L.in_features && a.pq.size() == (pairs ? 2 : 1) * panel_bytes &&
                  (!L.wide_acts || a.pqh.size() == (pairs ? 0 : panel_bytes)),
              "the int8 GEMM needs activations quantized and interleaved for it");
  const GemmFormat f = format_of(L);
  TORCH_CHECK(L.wide_acts || a.pq_signed == signed_acts(f),
              "the int8 GEMM needs activation bytes interleaved as this layer dots them");
  if constexpr (kMaddubs) {
    switch (f.dot) {
      case Dot::kPairs: return gemm_for<Dot::kPairs>(f, L, a, y);
      case Dot::kSigned8: return gemm_for<Dot::kSigned8>(f, L, a, y);
      case Dot::kSigned: return gemm_for<Dot::kSigned>(f, L, a, y);
      default: break;
    }
  }
  if (f.dot == Dot::kWide) return gemm_for<Dot::kWide>(f, L, a, y);
  gemm_for<Dot::kOffset>(f, L, a, y);
}

bool QLinear::eight_bit_codes() const {
  if (!parts.empty())
    return std::any_of(parts.begin(), parts.end(),
                       [](const auto& p) { return p->eight_bit_codes(); });
  return kind == WeightKind::Q8 || kind == WeightKind::Q8B;
}

bool QLinear::gemm_supported() const {
  if (!parts.empty())
    return std::all_of(parts.begin(), parts.end(),
                       [](const auto& p) { return p->gemm_supported(); });
  if (kind == WeightKind::F32 || kind == WeightKind::Stack) return false;
  if (kind == WeightKind::Q8B && has_min && group != kGroup) return false;
  return true;
}

bool QLinear::gemm_signed_acts() const { return signed_acts(format_of(*this)); }

bool QLinear::gemm_pairs() const {
  return kMaddubs && wide_acts;  // 8-bit codes and Q6_K alike (see the top)
}

void QLinear::set_int8_gemm(int64_t min_rows) {
  TORCH_CHECK(min_rows >= 0, "min_rows must be >= 0");
  TORCH_CHECK(min_rows == 0 || gemm_supported(),
              "this layer's format does not run in the int8 GEMM on this build");
  for (const auto& p : parts) p->set_int8_gemm(min_rows);
  gemm_min_rows = min_rows;
}

}  // namespace kvloop
