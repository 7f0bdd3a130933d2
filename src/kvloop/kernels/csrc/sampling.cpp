// A step's two reductions over its logits that every greedy row needs: the first maximum
// (the token) and the logsumexp (its log-prob, logit - lse). PyTorch's argmax and
// logsumexp took 6 and 17 ms over 32 rows of Gemma 3's 262k vocabulary (a tenth of the
// step): each a pass of its own over 32 MiB of logits, the exp in several more. Here the
// rows are cut into chunks that stay in cache between two passes, the maximum (and where it
// first is) then the sum of exp(x - max), the chunks spread over the threads, and their
// results combined per row in order.
//
// The answers are torch's: argmax gives the first maximum, a NaN counting as larger than
// any number (the first NaN, then); logsumexp is NaN with a NaN, +inf with a +inf, -inf
// when every logit is -inf. The exp is a polynomial (relative error ~2e-7), so lse
// differs from torch's by a few units in the last place.

#include "kvloop.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <limits>
#include <vector>

#include "simd.h"

namespace kvloop {
namespace {

constexpr int64_t kChunk = 16384;  // logits a work item reads twice: 64 KiB, in L2
constexpr float kInf = std::numeric_limits<float>::infinity();

// One chunk's share: its first maximum (index into the row), and the sum of exp(x - max).
struct Part {
  float max = -kInf;
  int64_t arg = -1;  // -1: no element above -inf (the chunk's first index then)
  double sum = 0.0;
  bool nan = false;  // arg is the chunk's first NaN
};

#ifdef __AVX2__
// e^x for x <= 0, 8 lanes: 2^n e^r with n = round(x / ln 2), r = x - n ln 2 in
// [-ln2/2, ln2/2] (ln 2 in two parts, so r is exact to fp32), e^r by its Taylor series to
// r^7 (error < 1e-8 there). Below -87.3 e^x is under fp32's smallest normal: 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);  // 2^n
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

Part reduce_chunk(const float* x, int64_t n, int64_t base) {
  Part p;
  int64_t i = 0;
#ifdef __AVX2__
  __m256 best = _mm256_set1_ps(-kInf);
  __m256i where = _mm256_set1_epi32(-1);
  __m256 unordered = _mm256_setzero_ps();
  __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 above = _mm256_cmp_ps(v, best, _CMP_GT_OQ);  // strictly: the first stays
    best = _mm256_blendv_ps(best, v, above);
    where = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(where), _mm256_castsi256_ps(idx), above));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    idx = _mm256_add_epi32(idx, _mm256_set1_epi32(8));
  }
  if (_mm256_movemask_ps(unordered) != 0) p.nan = true;
  alignas(32) float bv[8];
  alignas(32) int32_t bi[8];
  _mm256_store_ps(bv, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(bi), where);
  for (int l = 0; l < 8; ++l)  // the largest lane; of equals, the first index
    if (bi[l] >= 0 && (bv[l] > p.max || (bv[l] == p.max && (p.arg < 0 || bi[l] < p.arg)))) {
      p.max = bv[l];
      p.arg = bi[l];
    }
#endif
  for (; i < n; ++i) {
    if (std::isnan(x[i])) p.nan = true;
    if (x[i] > p.max) {
      p.max = x[i];
      p.arg = i;
    }
  }
  if (p.nan) {  // rare: the first NaN is the answer, and the sum is NaN anyway
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) {
        p.arg = base + j;
        break;
      }
    return p;
  }
  p.arg = p.arg < 0 ? base : base + p.arg;
  if (p.max == -kInf || p.max == kInf) return p;  // the row's combination decides
  const float m = p.max;
  i = 0;
#ifdef __AVX2__
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_add_ps(acc0, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv)));
    acc1 = _mm256_add_ps(acc1,
                         exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), mv)));
  }
  p.sum = hsum(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) p.sum += std::exp(static_cast<double>(x[i] - m));
  return p;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> argmax_logsumexp(const at::Tensor& logits_) {
  TORCH_CHECK(logits_.dim() == 2 && logits_.scalar_type() == at::kFloat,
              "logits must be float32 [B, V]");
  const auto logits = logits_.contiguous();
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "logits need at least one column");
  auto ids = at::empty({B}, logits.options().dtype(at::kLong));
  auto lse = at::empty({B}, logits.options());
  const int64_t chunks = (V + kChunk - 1) / kChunk;
  std::vector<Part> parts(B * chunks);
  const float* x = logits.data_ptr<float>();
  at::parallel_for(0, B * chunks, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / chunks, c = w % chunks;
      const int64_t start = c * kChunk;
      parts[w] = reduce_chunk(x + b * V + start, std::min(kChunk, V - start), start);
    }
  });
  int64_t* id = ids.data_ptr<int64_t>();
  float* out = lse.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const Part* row = parts.data() + b * chunks;
    Part top = row[0];
    for (int64_t c = 0; c < chunks && !top.nan; ++c)
      if (row[c].nan || row[c].max > top.max) top = row[c];
    id[b] = top.arg;
    if (top.nan) {
      out[b] = std::numeric_limits<float>::quiet_NaN();
    } else if (top.max == kInf || top.max == -kInf) {
      out[b] = top.max;
    } else {
      double sum = 0.0;
      for (int64_t c = 0; c < chunks; ++c)
        if (row[c].max > -kInf) sum += row[c].sum * std::exp(double(row[c].max) - top.max);
      out[b] = static_cast<float>(top.max + std::log(sum));
    }
  }
  return {ids, lse};
}

}  // namespace kvloop
