// The decode forward pass in one native call (see kvloop.h). Same math, same order of
// operations as the PyTorch modules (kvloop.models.llama, kvloop.models.gemma3), which
// are its reference in tests; a layer's LayerSpec says which of the families' pieces run.

#include "kvloop.h"

#include <ATen/Parallel.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace kvloop {
namespace {

// y = x * rsqrt(mean(x^2) + eps) * w, row by row ([M, H]).
void rms_norm(const float* x, const float* w, int64_t M, int64_t H, float eps, float* y) {
  // Rows over the threads (a prefill chunk's hundreds: the sum of squares is one serial
  // chain a row, ~4% of a 512-token Gemma 3 prefill on one thread); each row's arithmetic
  // as before, so the results are the same bits. One row runs inline.
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = x + m * H;
      float ss = 0.f;
      for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
      const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
      float* yr = y + m * H;
      for (int64_t i = 0; i < H; ++i) yr[i] = xr[i] * r * w[i];
    }
  });
}

// Rotate-half rotary embedding in place on `heads` vectors of size D (HF layout: element
// i pairs with i + D/2, both at angle i); cs, sn: the position's [D/2] cos / sin rows.
void rope(float* v, int64_t heads, int64_t D, const float* cs, const float* sn) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* x = v + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      x[i] = a * cs[i] - b * sn[i];
      x[i + half] = b * cs[i] + a * sn[i];
    }
  }
}

void check_vec(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 1 && t.numel() == n &&
                  t.is_contiguous(),
              what, " must be a contiguous float32 [", n, "] tensor");
}

void check_rope(const at::Tensor& cos, const at::Tensor& sin, int64_t D) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.dim() == 2 && cos.size(1) == D / 2 &&
                  sin.sizes() == cos.sizes() && sin.scalar_type() == at::kFloat,
              "cos / sin must be float32 [max_positions, head_dim / 2]");
}

}  // namespace

Decoder::Decoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                 std::shared_ptr<QLinear> embed, at::Tensor cos, at::Tensor sin,
                 at::Tensor final_norm, std::shared_ptr<QLinear> lm_head, double embed_scale,
                 double final_softcap)
    : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim),
      eps_(static_cast<float>(eps)), embed_scale_(static_cast<float>(embed_scale)),
      final_softcap_(final_softcap), final_norm_(final_norm.contiguous()),
      embed_(std::move(embed)), lm_head_(std::move(lm_head)) {
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim % 2 == 0,
              "bad head configuration");
  TORCH_CHECK(embed_ != nullptr, "embed must be a weight layout [vocab, hidden]");
  TORCH_CHECK(final_softcap >= 0.0, "final_softcap must be >= 0 (0: none)");
  hidden_ = embed_->in_features;
  add_rope(std::move(cos), std::move(sin));
  check_vec(final_norm_, hidden_, "final norm weight");
  TORCH_CHECK(lm_head_->in_features == hidden_, "lm_head in_features != hidden size");
}

int64_t Decoder::add_rope(at::Tensor cos, at::Tensor sin) {
  check_rope(cos, sin, head_dim_);
  cos_.push_back(cos.contiguous());
  sin_.push_back(sin.contiguous());
  return static_cast<int64_t>(cos_.size()) - 1;
}

void Decoder::add_layer(at::Tensor attn_norm, std::shared_ptr<QLinear> qkv,
                        std::shared_ptr<QLinear> o_proj, at::Tensor mlp_norm,
                        std::shared_ptr<QLinear> gate_up, std::shared_ptr<QLinear> down,
                        const LayerSpec& spec, const std::optional<at::Tensor>& post_attn_norm,
                        const std::optional<at::Tensor>& post_mlp_norm,
                        const std::optional<at::Tensor>& q_norm,
                        const std::optional<at::Tensor>& k_norm) {
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
  TORCH_CHECK(spec.activation == kSiLU || spec.activation == kGeluTanh,
              "unknown activation ", spec.activation);
  TORCH_CHECK(spec.scale >= 0.0 && spec.window >= 0 && spec.group >= 0 && spec.softcap >= 0.0,
              "scale, window, group and softcap must be >= 0");
  TORCH_CHECK(spec.rope >= 0 && spec.rope < static_cast<int64_t>(cos_.size()),
              "rope table ", spec.rope, " was not added");
  TORCH_CHECK(spec.post_norms == (post_attn_norm.has_value() && post_mlp_norm.has_value()),
              "post_norms needs both post-norm weights, and only then are they given");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "QK-norm needs both q and k weights");
  Layer layer{spec, attn_norm.contiguous(), mlp_norm.contiguous(), {}, {}, {}, {},
              std::move(qkv), std::move(o_proj), std::move(gate_up), std::move(down)};
  if (spec.post_norms) {
    check_vec(*post_attn_norm, H, "post-attention norm weight");
    check_vec(*post_mlp_norm, H, "post-MLP norm weight");
    layer.post_attn_norm = post_attn_norm->contiguous();
    layer.post_mlp_norm = post_mlp_norm->contiguous();
  }
  if (q_norm.has_value()) {
    check_vec(*q_norm, D, "q norm weight");
    check_vec(*k_norm, D, "k norm weight");
    layer.q_norm = q_norm->contiguous();
    layer.k_norm = k_norm->contiguous();
  }
  if (layer.spec.scale == 0.0) layer.spec.scale = 1.0 / std::sqrt(static_cast<double>(D));
  max_inter_ = std::max(max_inter_, layer.down->in_features);
  layers_.push_back(std::move(layer));
}

at::Tensor Decoder::forward(const at::Tensor& token_ids_, const at::Tensor& positions_,
                            const std::vector<at::Tensor>& kv_caches,
                            const at::Tensor& slot_mapping_, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, int64_t block_size,
                            const std::optional<at::Tensor>& query_start,
                            const std::optional<std::vector<at::Tensor>>& kv_scales,
                            const std::optional<std::vector<at::Tensor>>& group_tables) const {
  const auto ids_t = token_ids_.to(at::kLong).contiguous();
  const auto pos_t = positions_.to(at::kLong).contiguous();
  const auto slot_t = slot_mapping_.to(at::kLong).contiguous();
  const int64_t M = ids_t.numel();
  TORCH_CHECK(pos_t.numel() == M && slot_t.numel() == M, "one position and slot per token");
  TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == num_layers(), "one KV cache per layer");
  const int64_t H = hidden_, D = head_dim_, Hq = num_heads_, Hkv = num_kv_heads_;
  const int64_t V = embed_->out_features;
  int64_t P = cos_.front().size(0);  // positions every rope table covers
  for (const auto& c : cos_) P = std::min(P, c.size(0));
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

  // KV cache groups past the first: each its table, and the slots its table gives the
  // step's positions (the position's own block is never a dropped one).
  std::vector<at::Tensor> group_t{tables_t};
  std::vector<std::vector<int64_t>> group_slots(1, std::vector<int64_t>(slot, slot + M));
  if (group_tables.has_value()) {
    for (const auto& t : *group_tables) {
      const auto gt = t.to(at::kLong).contiguous();
      TORCH_CHECK(gt.dim() == 2 && gt.size(0) == N, "one block-table row per sequence in "
                  "every KV cache group");
      const int64_t* g = gt.data_ptr<int64_t>();
      const int64_t width = gt.size(1);
      std::vector<int64_t> gs(M);
      for (int64_t n = 0; n < N; ++n) {
        TORCH_CHECK(ctx[n] <= width * block_size, "sequence ", n,
                    ": context exceeds its block table in KV cache group ", group_t.size());
        for (int64_t m = qs[n]; m < qs[n + 1]; ++m) {
          gs[m] = g[n * width + pos[m] / block_size] * block_size + pos[m] % block_size;
          TORCH_CHECK(gs[m] >= 0 && gs[m] < num_slots, "slot ", gs[m], " out of range (KV "
                      "cache group ", group_t.size(), ")");
        }
      }
      group_t.push_back(gt);
      group_slots.push_back(std::move(gs));
    }
  }
  // One attention plan per (group, window, scale, softcap) the layers use; the plan checks every
  // block id the step's attention reads (and again the rows and contexts checked above),
  // then every layer of its kind runs it.
  std::vector<AttentionPlan> plans;
  std::vector<size_t> plan_of(layers_.size());
  std::vector<const LayerSpec*> plan_key;
  for (size_t li = 0; li < layers_.size(); ++li) {
    const LayerSpec& sp = layers_[li].spec;
    TORCH_CHECK(sp.group < static_cast<int64_t>(group_t.size()), "layer ", li,
                " reads KV cache group ", sp.group, ": pass its block table");
    size_t k = 0;
    while (k < plan_key.size() && !(plan_key[k]->group == sp.group &&
                                    plan_key[k]->window == sp.window &&
                                    plan_key[k]->scale == sp.scale &&
                                    plan_key[k]->softcap == sp.softcap))
      ++k;
    if (k == plan_key.size()) {
      plans.emplace_back(M, Hq, Hkv, D, num_slots, group_t[sp.group], qstart_t, ctx_t,
                         block_size, sp.scale, sp.window, sp.softcap);
      plan_key.push_back(&sp);
    }
    plan_of[li] = k;
  }

  const std::lock_guard<std::mutex> guard(mu_);
  Workspace& ws = workspace(M);
  float* x = ws.x.data();
  for (int64_t m = 0; m < M; ++m) embed_->decode_row(ids[m], x + m * H);
  if (embed_scale_ != 1.f)
    for (int64_t i = 0; i < M * H; ++i) x[i] *= embed_scale_;

  const int64_t qkv_n = (Hq + 2 * Hkv) * D;
  float *h = ws.h.data(), *delta = ws.delta.data();
  // The attention's buffers in the scratch: qkv [M, qkv_n], q and o [M, Hq * D].
  float* qkv = ws.scratch.data_ptr<float>();
  float* q = qkv + M * qkv_n;
  float* o = q + M * Hq * D;

  for (size_t li = 0; li < layers_.size(); ++li) {
    const Layer& L = layers_[li];
    const LayerSpec& sp = L.spec;
    const float* cos = cos_[sp.rope].data_ptr<float>();
    const float* sin = sin_[sp.rope].data_ptr<float>();
    const int64_t* lslot = group_slots[sp.group].data();
    const bool qk_norm = L.q_norm.defined();
    // Attention block.
    rms_norm(x, L.attn_norm.data_ptr<float>(), M, H, eps_, h);
    L.qkv->apply(h, M, ws.acts, qkv);
    const KVView& cache = views[li];
    dispatch_kv(cache.dtype, [&](auto elem) {
      using T = decltype(elem);
      // Tokens over the threads: each writes its own rows and its own cache slot (a
      // prefill chunk's QK-norms, rope and cache writes ran on one thread).
      at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m) {
          float* row = qkv + m * qkv_n;  // [q: Hq*D | k: Hkv*D | v: Hkv*D]
          if (qk_norm) {  // per head, before rope
            rms_norm(row, L.q_norm.data_ptr<float>(), Hq, D, eps_, row);
            rms_norm(row + Hq * D, L.k_norm.data_ptr<float>(), Hkv, D, eps_, row + Hq * D);
          }
          rope(row, Hq + Hkv, D, cos + pos[m] * (D / 2), sin + pos[m] * (D / 2));
          std::memcpy(q + m * Hq * D, row, Hq * D * sizeof(float));
          for (int64_t kh = 0; kh < Hkv; ++kh) {  // fp32: a memcpy, as before the dtypes
            kv_store_row<T>(cache, 0, kh, lslot[m], row + (Hq + kh) * D);
            kv_store_row<T>(cache, 1, kh, lslot[m], row + (Hq + Hkv + kh) * D);
          }
        }
      });
    });
    plans[plan_of[li]].run(q, cache, o);  // [M, Hq, D]
    L.o_proj->apply(o, M, ws.acts, delta);
    if (sp.post_norms) rms_norm(delta, L.post_attn_norm.data_ptr<float>(), M, H, eps_, delta);
    for (int64_t i = 0; i < M * H; ++i) x[i] += delta[i];
    // MLP block.
    rms_norm(x, L.mlp_norm.data_ptr<float>(), M, H, eps_, h);
    const int64_t I = L.down->in_features;
    // The MLP's in the same scratch (the attention's are dead by now).
    const auto gu = ws.scratch.narrow(0, 0, M * 2 * I).view({M, 2 * I});
    auto act = ws.scratch.narrow(0, M * 2 * I, M * I).view({M, I});
    L.gate_up->apply(h, M, ws.acts, gu.data_ptr<float>());
    // act(gate) * up through ATen's vectorised activations (the ops the PyTorch path
    // uses, so both paths round alike); a scalar exp here cost ~7 ms a step at 32 rows.
    if (sp.activation == kGeluTanh)
      at::gelu_out(act, gu.narrow(1, 0, I), "tanh").mul_(gu.narrow(1, I, I));
    else
      at::silu_out(act, gu.narrow(1, 0, I)).mul_(gu.narrow(1, I, I));
    L.down->apply(act.data_ptr<float>(), M, ws.acts, delta);
    if (sp.post_norms) rms_norm(delta, L.post_mlp_norm.data_ptr<float>(), M, H, eps_, delta);
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
    const int64_t attention = (num_heads_ + 2 * num_kv_heads_) * head_dim_ + 2 * qd;
    ws_.scratch = at::empty({rows * std::max(attention, 3 * max_inter_)},
                            at::TensorOptions().dtype(at::kFloat));
    ws_.rows = rows;
  }
  return ws_;
}

at::Tensor Decoder::logits(const at::Tensor& hidden) const {
  auto out = lm_head_->forward(hidden);
  // As the modules compute it (Gemma's compute_logits): tanh(logits / cap) * cap.
  if (final_softcap_ > 0.0) out.div_(final_softcap_).tanh_().mul_(final_softcap_);
  return out;
}

}  // namespace kvloop
