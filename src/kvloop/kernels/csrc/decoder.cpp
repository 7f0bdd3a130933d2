// The decode forward pass in one native call (see kvloop.h). Same math, same order of
// operations as kvloop.models.llama, which is its reference in tests.

#include "kvloop.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace kvloop {
namespace {

// y = x * rsqrt(mean(x^2) + eps) * w, row by row ([M, H]).
void rms_norm(const float* x, const float* w, int64_t M, int64_t H, float eps, float* y) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * H;
    float ss = 0.f;
    for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
    float* yr = y + m * H;
    for (int64_t i = 0; i < H; ++i) yr[i] = xr[i] * r * w[i];
  }
}

// Rotate-half rotary embedding in place on `heads` vectors of size D (HF layout: element
// i pairs with i + D/2); cs, sn: the position's [D] cos / sin rows (halves duplicated).
void rope(float* v, int64_t heads, int64_t D, const float* cs, const float* sn) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* x = v + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      x[i] = a * cs[i] - b * sn[i];
      x[i + half] = b * cs[i + half] + a * sn[i + half];
    }
  }
}

void check_vec(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 1 && t.numel() == n &&
                  t.is_contiguous(),
              what, " must be a contiguous float32 [", n, "] tensor");
}

}  // namespace

Decoder::Decoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                 std::shared_ptr<QLinear> embed, at::Tensor cos, at::Tensor sin,
                 at::Tensor final_norm, std::shared_ptr<QLinear> lm_head)
    : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim),
      eps_(static_cast<float>(eps)), cos_(cos.contiguous()), sin_(sin.contiguous()),
      final_norm_(final_norm.contiguous()), embed_(std::move(embed)),
      lm_head_(std::move(lm_head)) {
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim % 2 == 0,
              "bad head configuration");
  TORCH_CHECK(embed_ != nullptr, "embed must be a weight layout [vocab, hidden]");
  hidden_ = embed_->in_features;
  TORCH_CHECK(cos_.scalar_type() == at::kFloat && cos_.dim() == 2 &&
                  cos_.size(1) == head_dim && sin_.sizes() == cos_.sizes(),
              "cos / sin must be float32 [max_positions, head_dim]");
  check_vec(final_norm_, hidden_, "final norm weight");
  TORCH_CHECK(lm_head_->in_features == hidden_, "lm_head in_features != hidden size");
}

void Decoder::add_layer(at::Tensor attn_norm, std::shared_ptr<QLinear> qkv,
                        std::shared_ptr<QLinear> o_proj, at::Tensor mlp_norm,
                        std::shared_ptr<QLinear> gate_up, std::shared_ptr<QLinear> down) {
  const int64_t H = hidden_, D = head_dim_;
  check_vec(attn_norm, H, "attention norm weight");
  check_vec(mlp_norm, H, "mlp norm weight");
  TORCH_CHECK(qkv->in_features == H && qkv->out_features == (num_heads_ + 2 * num_kv_heads_) * D,
              "qkv projection has the wrong shape");
  TORCH_CHECK(o_proj->in_features == num_heads_ * D && o_proj->out_features == H,
              "o projection has the wrong shape");
  TORCH_CHECK(gate_up->in_features == H && gate_up->out_features % 2 == 0,
              "gate/up projection has the wrong shape");
  TORCH_CHECK(down->in_features == gate_up->out_features / 2 && down->out_features == H,
              "down projection has the wrong shape");
  max_inter_ = std::max(max_inter_, down->in_features);
  layers_.push_back({attn_norm.contiguous(), mlp_norm.contiguous(), std::move(qkv),
                     std::move(o_proj), std::move(gate_up), std::move(down)});
}

at::Tensor Decoder::forward(const at::Tensor& token_ids_, const at::Tensor& positions_,
                            const std::vector<at::Tensor>& kv_caches,
                            const at::Tensor& slot_mapping_, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, int64_t block_size,
                            const std::optional<at::Tensor>& query_start,
                            const std::optional<std::vector<at::Tensor>>& kv_scales) const {
  const auto ids_t = token_ids_.to(at::kLong).contiguous();
  const auto pos_t = positions_.to(at::kLong).contiguous();
  const auto slot_t = slot_mapping_.to(at::kLong).contiguous();
  const int64_t M = ids_t.numel();
  TORCH_CHECK(pos_t.numel() == M && slot_t.numel() == M, "one position and slot per token");
  TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == num_layers(), "one KV cache per layer");
  const int64_t H = hidden_, D = head_dim_, Hq = num_heads_, Hkv = num_kv_heads_;
  const int64_t V = embed_->out_features, P = cos_.size(0);
  const int64_t* ids = ids_t.data_ptr<int64_t>();
  const int64_t* pos = pos_t.data_ptr<int64_t>();
  const int64_t* slot = slot_t.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(ids[m] >= 0 && ids[m] < V, "token id ", ids[m], " out of range");
    TORCH_CHECK(pos[m] >= 0 && pos[m] < P, "position ", pos[m], " beyond the rope table");
  }
  // Everything the step will read is checked before anything is written: a bad call
  // raises with the KV cache untouched.
  const auto tables_t = block_tables.to(at::kLong).contiguous();
  const auto ctx_t = context_lens.to(at::kLong).contiguous();
  TORCH_CHECK(tables_t.dim() == 2 && ctx_t.dim() == 1 && ctx_t.numel() == tables_t.size(0),
              "one block-table row and one context length per sequence");
  const int64_t N = tables_t.size(0);  // sequences
  // Row offsets of each sequence's tokens; none: one token per sequence (decode).
  const auto qstart_t = query_start.has_value() ? query_start->to(at::kLong).contiguous()
                                                : at::arange(N + 1, at::kLong);
  TORCH_CHECK(query_start.has_value() || N == M,
              "one block-table row and one context length per token");
  TORCH_CHECK(qstart_t.dim() == 1 && qstart_t.numel() == N + 1, "query_start must be [N + 1]");
  const int64_t* qs = qstart_t.data_ptr<int64_t>();
  TORCH_CHECK(qs[0] == 0 && qs[N] == M, "query_start must run from 0 to the number of tokens");
  const int64_t* ctx = ctx_t.data_ptr<int64_t>();
  const int64_t* tables = tables_t.data_ptr<int64_t>();
  const int64_t max_blocks = tables_t.size(1);
  TORCH_CHECK(block_size > 0, "block_size must be positive");
  for (int64_t n = 0; n < N; ++n) {
    const int64_t L = qs[n + 1] - qs[n];
    TORCH_CHECK(L >= 1, "sequence ", n, ": no tokens (query_start must increase)");
    TORCH_CHECK(ctx[n] <= max_blocks * block_size, "sequence ", n,
                ": context exceeds its block table");
    // A sequence's tokens are the last L positions of its context, in order.
    for (int64_t m = qs[n]; m < qs[n + 1]; ++m) {
      const int64_t want = ctx[n] - L + (m - qs[n]);
      TORCH_CHECK(pos[m] == want, "row ", m, ": context length ", ctx[n],
                  " != position + 1 (a decode step appends one token)", L > 1 ? " or" : "",
                  L > 1 ? " not the sequence's next position" : "");
      TORCH_CHECK(tables[n * max_blocks + pos[m] / block_size] * block_size +
                          pos[m] % block_size == slot[m],
                  "row ", m, ": slot ", slot[m], " is not the block table's slot for position ",
                  pos[m]);
    }
  }
  // All layers' caches have one shape and dtype, so the slots and block ids are checked
  // once.
  TORCH_CHECK(!kv_scales.has_value() || kv_scales->size() == kv_caches.size(),
              "one kv_scales tensor per layer's KV cache");
  std::vector<KVView> views;
  views.reserve(kv_caches.size());
  for (size_t i = 0; i < kv_caches.size(); ++i) {
    const auto& c = kv_caches[i];
    TORCH_CHECK(c.dim() == 4 && c.size(0) == 2 && c.size(1) == Hkv && c.size(3) == D &&
                    c.is_contiguous() && c.sizes() == kv_caches.front().sizes() &&
                    c.scalar_type() == kv_caches.front().scalar_type(),
                "each KV cache must be a contiguous [2, Hkv, slots, D] tensor (float32, "
                "bfloat16, float16 or int8), all of one shape and dtype");
    views.push_back(kv_view(c, kv_scales.has_value()
                                   ? std::optional<at::Tensor>((*kv_scales)[i])
                                   : std::nullopt));
  }
  const int64_t num_slots = kv_caches.empty() ? 0 : kv_caches.front().size(2);
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(slot[m] >= 0 && slot[m] < num_slots, "slot ", slot[m], " out of range");
  // The plan checks every block id the step's attention reads (and again the rows and
  // contexts checked above); every layer then runs it.
  const AttentionPlan attention(M, Hq, Hkv, D, num_slots, tables_t, qstart_t, ctx_t, block_size,
                                1.0 / std::sqrt(static_cast<double>(D)));

  const std::lock_guard<std::mutex> guard(mu_);
  Workspace& ws = workspace(M);
  float* x = ws.x.data();
  for (int64_t m = 0; m < M; ++m) embed_->decode_row(ids[m], x + m * H);

  const int64_t qkv_n = (Hq + 2 * Hkv) * D;
  float *h = ws.h.data(), *qkv = ws.qkv.data(), *delta = ws.delta.data(), *q = ws.q.data(),
        *o = ws.o.data();
  const float* cos = cos_.data_ptr<float>();
  const float* sin = sin_.data_ptr<float>();

  for (size_t li = 0; li < layers_.size(); ++li) {
    const Layer& L = layers_[li];
    // Attention block.
    rms_norm(x, L.attn_norm.data_ptr<float>(), M, H, eps_, h);
    L.qkv->apply(h, M, ws.acts, qkv);
    const KVView& cache = views[li];
    dispatch_kv(cache.dtype, [&](auto elem) {
      using T = decltype(elem);
      for (int64_t m = 0; m < M; ++m) {
        float* row = qkv + m * qkv_n;  // [q: Hq*D | k: Hkv*D | v: Hkv*D]
        rope(row, Hq + Hkv, D, cos + pos[m] * D, sin + pos[m] * D);
        std::memcpy(q + m * Hq * D, row, Hq * D * sizeof(float));
        for (int64_t kh = 0; kh < Hkv; ++kh) {  // fp32: a memcpy, as before the dtypes
          kv_store_row<T>(cache, 0, kh, slot[m], row + (Hq + kh) * D);
          kv_store_row<T>(cache, 1, kh, slot[m], row + (Hq + Hkv + kh) * D);
        }
      }
    });
    attention.run(q, cache, o);  // [M, Hq, D]
    L.o_proj->apply(o, M, ws.acts, delta);
    for (int64_t i = 0; i < M * H; ++i) x[i] += delta[i];
    // MLP block.
    rms_norm(x, L.mlp_norm.data_ptr<float>(), M, H, eps_, h);
    const int64_t I = L.down->in_features;
    const auto gu = ws.gu.narrow(0, 0, M * 2 * I).view({M, 2 * I});
    auto act = ws.act.narrow(0, 0, M * I).view({M, I});
    L.gate_up->apply(h, M, ws.acts, gu.data_ptr<float>());
    // SiLU(gate) * up through ATen's vectorised SiLU (the op the PyTorch path uses, so
    // both paths round alike); a scalar exp here cost ~7 ms a step at 32 rows.
    at::silu_out(act, gu.narrow(1, 0, I)).mul_(gu.narrow(1, I, I));
    L.down->apply(act.data_ptr<float>(), M, ws.acts, delta);
    for (int64_t i = 0; i < M * H; ++i) x[i] += delta[i];
  }
  auto out = at::empty({M, H}, at::TensorOptions().dtype(at::kFloat));
  rms_norm(x, final_norm_.data_ptr<float>(), M, H, eps_, out.data_ptr<float>());
  return out;
}

Decoder::Workspace& Decoder::workspace(int64_t rows) const {
  if (rows > ws_.rows) {
    const int64_t H = hidden_, qd = num_heads_ * head_dim_;
    ws_.x.resize(rows * H);
    ws_.h.resize(rows * H);
    ws_.delta.resize(rows * H);
    ws_.qkv.resize(rows * (num_heads_ + 2 * num_kv_heads_) * head_dim_);
    ws_.q.resize(rows * qd);
    ws_.o.resize(rows * qd);
    ws_.gu = at::empty({rows * 2 * max_inter_}, at::TensorOptions().dtype(at::kFloat));
    ws_.act = at::empty({rows * max_inter_}, at::TensorOptions().dtype(at::kFloat));
    ws_.rows = rows;
  }
  return ws_;
}

at::Tensor Decoder::logits(const at::Tensor& hidden) const { return lm_head_->forward(hidden); }

}  // namespace kvloop
