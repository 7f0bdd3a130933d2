// Declarations shared by the kernel sources; one extension module is built from all of them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "kv_dtype.h"

namespace kvloop {

// ---- paged attention (paged_attention.cpp) ----

// One unit of attention work: a sequence's kv head and a tile of its query rows.
struct AttentionItem {
  int64_t seq;
  int64_t kv_head;
  int64_t row0;   // first query row of the tile, relative to the sequence's rows
  int64_t nrows;
  int64_t g0;     // first query head of the group handled here (groups > kMaxQ are split)
  int64_t ng;
  int64_t cost;   // ~ key rows x query vectors, for load balancing
};

// One attention call's validated layout: which query rows belong to which sequence, how
// far each context reaches, every block id it will read, the work items and their split
// over threads. Built once, it runs over any cache of the shape it was checked against:
// the decode step builds one per step and runs it for every layer.
class AttentionPlan {
 public:
  // T query rows of num_heads heads; caches [2, num_kv_heads, slots, head_dim] of any KV
  // dtype. See paged_attention_varlen for the other arguments.
  AttentionPlan(int64_t T, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                int64_t slots, const at::Tensor& block_tables,
                const std::optional<at::Tensor>& query_start, const at::Tensor& context_lens,
                int64_t block_size, double scale, int64_t window = 0, double softcap = 0.0);
  // q [T, H, D] -> out [T, H, D] (raw contiguous fp32) over the cache `kv` (kv_view).
  void run(const float* q, const KVView& kv, float* out) const;

 private:
  int64_t H_, Hkv_, D_, slots_, block_size_;
  float scale_;
  int64_t window_;  // sliding window (0: none)
  float softcap_;    // attention logit soft-capping (0: none)
  at::Tensor tables_t_, qstart_t_, ctx_t_;
  std::vector<AttentionItem> items_;
  std::vector<int64_t> prefix_;  // [items + 1] running cost
  int64_t parts_ = 1;            // threads the items are split over
};
at::Tensor paged_attention_varlen(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables,
                                  const std::optional<at::Tensor>& query_start,
                                  const at::Tensor& context_lens, int64_t block_size,
                                  double scale, int64_t window,
                                  const std::optional<at::Tensor>& kv_scales = std::nullopt,
                                  double softcap = 0.0);
// A layer's cache ([2, Hkv, slots, D] fp32 / bf16 / fp16 / int8, with its [2, Hkv, slots]
// fp16 scales for int8), checked, as the kernels address it.
KVView kv_view(const at::Tensor& cache, const std::optional<at::Tensor>& scales);
// The native writer: k, v [T, Hkv, D] fp32 stored at slot_mapping [T] in the cache's dtype,
// rounded as the decoder writes them (kv_dtype.h). For tests against kvloop.quant.kv.
void kv_store(const at::Tensor& kv_cache, const std::optional<at::Tensor>& kv_scales,
              const at::Tensor& slot_mapping, const at::Tensor& k, const at::Tensor& v);

// Per row of float32 logits [B, V]: the first maximum (torch.argmax's answer) and the
// logsumexp, in one pass over each chunk of the row (csrc/sampling.cpp).
std::tuple<at::Tensor, at::Tensor> argmax_logsumexp(const at::Tensor& logits);

// ---- weight-only quantized / fp32 linear layers (linear.cpp) ----

// Activations quantized per block of 32 along K to int8 (llama.cpp's Q8_1 idea): the
// integer dot products then run on AVX2's 8-bit multiply-adds, and the per-block sums
// let 4-bit weights with a zero point be handled without unpacking to floats.
struct QuantizedActs {
  int64_t M = 0, K = 0;
  std::vector<int8_t> q;  // [M, K]
  std::vector<float> d;   // [M, K / 32]  scale: x ~= d * q
  std::vector<float> s;   // [M, K / 32]  d * sum(q) of the block
  std::vector<float> ssum;  // [M]        sum of the row's s (int8 weights, VNNI path)
  std::vector<int8_t> qp;   // [M, K]     q with groups in pairs, for 4-bit weights (pair_acts)
  // The same rows as int16 codes per block of 32, for the head's kernel (wide_acts).
  std::vector<int16_t> q16;  // [M, K]
  std::vector<float> d16;    // [M]          scale: x ~= d16 * q16, one per row
  std::vector<float> s16;    // [M, K / 32]  d16 * sum(q16) of the block
  std::vector<int16_t> q16x;  // [M, K] q16, each 32 as elements 0-7, 16-23, 8-15, 24-31
                              // (lane_order_acts16: the Q6_K head's row kernel)
  at::Tensor xb;  // bf16 input of the batched path (QLinear::set_batched_decode)
  at::Tensor wb;  // a chunk of weight rows decoded for the batched path (set_batched_decode)
  std::vector<float> part_y;  // one stacked part's output (QLinear::stack)
  // The int8 GEMM's operand (interleave_acts): rows in panels of kGemmLanes, each panel
  // [K / 4][kGemmLanes][4] bytes q + 128 (unsigned, for the u8 side of the dot product;
  // q itself where pq_signed), with its block scales and sums lane by lane:
  // [panel][K / 32][kGemmLanes].
  std::vector<uint8_t> pq;
  bool pq_signed = false;  // pq holds q (QLinear::gemm_signed_acts), not q + 128
  std::vector<uint8_t> pqh;  // int16 activations (interleave_acts16): high bytes + 128; pq
                             // then holds the low bytes, pd each row's one scale
  std::vector<float> pd, ps;
};

// Activation rows per panel: one vector of int32 sums. AVX-512 builds (KVLOOP_VNNI, from
// simd.h through kv_dtype.h) hold 16 in a 512-bit register (gemm.cpp says why), the others
// 8 in a 256-bit one.
#ifdef KVLOOP_VNNI
constexpr int64_t kGemmLanes = 16;
#else
constexpr int64_t kGemmLanes = 8;
#endif

constexpr int64_t kMaxGroups = 2048;  // int4: in_features up to 65536

enum class WeightKind : int64_t {
  F32 = 0, Q8 = 1, Q4 = 2, Q4F = 3, Q8B = 4,
  // GGUF blocks as stored (stored_blocks.cpp): rows of whole blocks, read as they lie.
  Q4_K = 5, Q5_K = 6, Q6_K = 7, Q5_0 = 8, Q5_1 = 9,
  Stack = 10,  // QLinear::stack: parts of different kinds, not a layout of its own
};
constexpr int64_t kNumWeightKinds = 10;  // the layouts a QLinear is constructed with

// y[M, N] = x[M, K] W^T (+ bias), W in one of these layouts:
//   F32: weight fp32 [N, K].
//   Q8:  weight int8 [N, K], scales fp32 [N]: w = scale[n] * q (per output channel).
//   Q4:  weight uint8 [N, K / 32 * 20]: groups of 32 weights along K, each with an fp16
//        scale and an fp16 min, w = scale * q + min, q in [0, 15]. A row holds all its
//        scales, then all its mins, then 16 bytes of codes per group (byte j: element j
//        in the low nibble, element 16 + j in the high one, as in GGUF's Q4_1 blocks).
//   Q4F: as Q4 with fp32 scales and mins: [N, K / 32 * 24] (GGUF's Q4_K: d * sc is exact
//        in fp32, not in fp16).
//   Q8B: weight int8 [N, K] codes; scales fp16 or fp32, [N, K / G] with G = 16 or 32
//        (w = scale * q), or [N, 2, K / 32]: each row's scales then its mins (w = scale *
//        q + min). GGUF's Q8_0 blocks map onto it exactly, as do the other formats'
//        codes (a tied head, or a fused layer of parts none of which is read as stored).
//   Q4_K, Q5_K, Q6_K, Q5_0, Q5_1: uint8 [N, K / QK * block bytes], each row GGUF's blocks
//        of that format as the file stores them (see stored_blocks.cpp; Q5_0's bits moved
//        within each 8 blocks of a row: kvloop.quant.stored.kernel_order): decode reads
//        4.5 to 6.6 bits a weight, not the 8 + scales of Q8B.
// Quantized kinds use int8 activations (quantize_acts), or int16 ones (quantize_acts16)
// where wide_acts; F32 keeps fp32.
struct QLinear {
  WeightKind kind = WeightKind::F32;
  bool wide_acts = false;  // Q8 / Q8B: int16 activations (the head: int8 moved its logits)
  int64_t out_features = 0, in_features = 0;
  at::Tensor weight, scales;
  // weight's and scales' bytes, taken once by the constructor (neither is replaced after
  // it): the kernels read them per few weight rows, and data_ptr<T>() checks the dtype at
  // every call (2-3% of a batch-1 decode step's samples in perf, at 4 rows a call). Read
  // them as the layout's type through w<T>() and s<T>().
  const uint8_t* wbytes = nullptr;
  const uint8_t* sbytes = nullptr;  // null for layouts without scales
  template <typename T>
  const T* w() const { return reinterpret_cast<const T*>(wbytes); }
  template <typename T>
  const T* s() const { return reinterpret_cast<const T*>(sbytes); }
  std::optional<at::Tensor> bias;
  // Q8B: the group of its scales (16 or 32), whether it has mins, whether they are fp32.
  int64_t group = 32;
  bool has_min = false, f32_scales = true;
  // Batches of batched_min_rows rows or more (prefill, large decode batches: compute-bound
  // GEMMs; set_batched_decode) decode the weights, a chunk of rows at a time, into a
  // scratch (bf16 for the quantized kinds: oneDNN's bf16 GEMM, AVX512-BF16 dot products
  // with fp32 sums, runs at ~2.3x this CPU's fp32 rate where the int8 kernels, which must
  // scale every 32-wide block, run at ~1.2x; or fp32 where bf16 GEMMs are slow; fp32
  // stays fp32) and run ATen's GEMM (oneDNN / MKL) on it, holding no second copy of the
  // weights. Below that size the int8 kernels read 2-4x fewer bytes and win.
  int64_t batched_min_rows = 0;
  bool batched_decode = false;
  bool batched_bf16 = true;  // quantized kinds: decode to bf16 (false: fp32, sgemm)
  static constexpr int64_t kDecodeChunkBytes = 1 << 21;  // weight rows decoded at a time
  // Batches of gemm_min_rows rows or more (below batched_min_rows where the batched path
  // is set) run the int8 GEMM (gemm.cpp): weights unpacked once per tile of rows into int8
  // codes and held in cache while every activation row meets them, the activations spread
  // across vector lanes. 0: off. See set_int8_gemm.
  int64_t gemm_min_rows = 0;

  // A fused layer whose checkpoint parts no one layout holds exactly (q/k as Q4_K blocks
  // with v as Q6_K): their rows stacked along N, each part run by its own kernel into its
  // columns. Biases stay with the parts.
  std::vector<std::shared_ptr<QLinear>> parts;

  QLinear() = default;  // for stack
  QLinear(int64_t kind, at::Tensor weight, int64_t in_features,
          std::optional<at::Tensor> scales, std::optional<at::Tensor> bias,
          bool wide_acts = false);
  static std::shared_ptr<QLinear> stack(const std::vector<std::shared_ptr<QLinear>>& parts);
  // Whether the kernel takes quantized activations (int8, or int16: wide_acts) rather than
  // fp32 rows.
  bool quantized() const { return kind != WeightKind::F32; }
  // Whether the kernel reads activations in pair order (pair_acts): the 4-bit kinds.
  bool paired() const { return kind == WeightKind::Q4 || kind == WeightKind::Q4F; }
  // x: [M, K] fp32 rows (F32), or acts quantized from them (Q8/Q4). y: [M, N] fp32.
  void run(const float* x, const QuantizedActs* acts, int64_t M, float* y) const;
  // x [M, K] fp32 rows -> y [M, N], quantizing x into `acts` (scratch the caller may
  // reuse across layers) first when the kernel takes quantized activations.
  void apply(const float* x, int64_t M, QuantizedActs& acts, float* y) const;
  at::Tensor forward(const at::Tensor& x) const;  // [M, K] -> [M, N], for Python and tests
  int64_t weight_bytes() const;
  void set_batched_decode(int64_t min_rows, bool bf16 = true);  // see `batched_decode`
  // Whether this layer's format runs in the int8 GEMM on this build (stacks: every part).
  bool gemm_supported() const;
  // Whether its codes use all 8 bits (Q8, Q8B; stacks: any part), which dot slower in the
  // int8 GEMM without VNNI (kvloop.dispatch starts them there at more rows).
  bool eight_bit_codes() const;
  // Whether the int8 GEMM takes this layer's int16 activations as int16 (vpmaddwd against
  // its codes widened) rather than split into bytes: 8-bit codes on AVX2 without VNNI.
  bool gemm_pairs() const;
  // Whether the int8 GEMM dots this layer's codes with signed activation bytes q rather
  // than q + 128 (vpmaddubsw builds: codes >= 0 and 8-bit codes; see gemm.cpp).
  bool gemm_signed_acts() const;
  void set_int8_gemm(int64_t min_rows);  // see `gemm_min_rows`; 0 turns it off
  // Rows n0..n1 of the weights as the kernels decode them (w = scale * code + min, fp32),
  // rounded to bf16 (round to nearest even, as torch's .to(bfloat16)) unless fp32 out.
  void decode_rows(int64_t n0, int64_t n1, float* out) const;
  void decode_row(int64_t n, float* out) const;  // one row, on the calling thread
  void decode_rows(int64_t n0, int64_t n1, at::BFloat16* out) const;
  at::Tensor decoded(bool bf16) const;  // [N, K], for Python and tests

 private:
  void run_batched_decode(const float* x, int64_t M, QuantizedActs& scratch, float* y) const;
  void add_bias(float* y, int64_t M) const;  // y [M, N] += bias, where there is one
};

// GGUF blocks as stored (stored_blocks.cpp).
bool is_stored(WeightKind kind);
// Bytes of one row of K weights in a stored kind; 0 when K is not a whole number of blocks.
int64_t stored_row_bytes(WeightKind kind, int64_t K);
// Weight row n against activation rows m0..m1 (int8, element order): y[m, n].
void stored_rows(const QLinear& L, const QuantizedActs& A, int64_t m0, int64_t m1, int64_t n,
                 float* y);
// Row n of the weights, w = scale * code + min in fp32: the `gguf` package's values.
void stored_decode_row(const QLinear& L, int64_t n, float* out);
// Batch 1: weight rows n..n+kStoredRowsAtOnce against activation row m, into y[m, n...]
// (bit-identical to stored_rows; the rows share the activation loads).
constexpr int kStoredRowsAtOnce = 4;
void stored_rows_at_once(const QLinear& L, const QuantizedActs& A, int64_t m, int64_t n,
                         float* y);
// Whether a stored kind has kernels for int16 activations (wide_acts: Q6_K, the head of
// Q4_K_M files), and those kernels: as stored_rows, and as stored_rows_at_once for all of
// activation rows m0..m1 (fewer than kCols) in one pass, with A.q16x.
bool stored_takes_wide_acts(WeightKind kind);
// a.q16x from a.q16: what stored_rows_wide reads.
void lane_order_acts16(QuantizedActs& a);
void stored_rows_wide(const QLinear& L, const QuantizedActs& A, int64_t m0, int64_t m1,
                      int64_t n, float* y);
void stored_rows_wide_at_once(const QLinear& L, const QuantizedActs& A, int64_t m0, int64_t m1,
                              int64_t n, float* y);
// Row n as the int8 GEMM takes it: signed codes [K], w = sc[k / SUB] * code + mn[k / 32],
// SUB = stored_gemm_sub (16 or 32), mn written only where stored_gemm_has_min; corr
// [K / SUB] (unless null): -128 * the sum of each scale's codes (the GEMM's offset
// correction, which only its +128 forms read).
void stored_unpack_row(const QLinear& L, int64_t n, int8_t* codes, float* sc, float* mn,
                       int32_t* corr);
int64_t stored_gemm_sub(WeightKind kind);
bool stored_gemm_has_min(WeightKind kind);
// The largest |code| stored_unpack_row writes (15 for Q4_K, 32 for Q6_K's u - 32, ...).
int stored_gemm_max_code(WeightKind kind);
// Whether those codes can be negative (Q5_0's and Q6_K's, their mins folded in).
bool stored_gemm_signed_codes(WeightKind kind);
// corr[g] = -128 * the sum of codes [g * sub, (g + 1) * sub) (sub 16 or 32), for g < K / sub.
void code_corrections(const int8_t* codes, int64_t K, int64_t sub, int32_t* corr);

// ---- the int8 GEMM (gemm.cpp) ----

// The panels of `a` (QuantizedActs::pq, pd, ps) from its q, d and s: bytes q where
// `signed_bytes` (QLinear::gemm_signed_acts), else q + 128.
void interleave_acts(QuantizedActs& a, bool signed_bytes);
// The same from its int16 activations (q16, d16, s16): pq and pqh, pd, ps. `pairs`: the
// layout of the int16 path instead (QLinear::gemm_pairs): pq [K / 2][kGemmLanes] 32-bit
// lanes, each two int16 activations of its row (k, k + 1); pqh empty.
void interleave_acts16(QuantizedActs& a, bool pairs = false);
// y[M, N] = x W^T for a layer whose gemm_supported(), from activations quantized and
// interleaved for it (no bias).
void gemm_int8(const QLinear& L, const QuantizedActs& a, float* y);

void quantize_acts(const float* x, int64_t M, int64_t K, QuantizedActs& out);
// q16, d16 and s16 of `out` (int16 codes per block of 32; M and K too).
void quantize_acts16(const float* x, int64_t M, int64_t K, QuantizedActs& out);
// The order the 4-bit kernel reads activations in (QuantizedActs::qp), from a.q.
void pair_acts(QuantizedActs& a);
// Python-facing: (q int8 [M, K], d fp32 [M, K/32]), the exact rounding the kernels use.
std::vector<at::Tensor> quantize_acts_tensor(const at::Tensor& x);

// ---- the decode forward pass of a decoder-only model (decoder.cpp) ----

// How one layer computes: the families' differences as data (kvloop.models.base.LayerSpec,
// which each architecture module fills in). Its weights come with it in add_layer.
struct LayerSpec {
  bool post_norms = false;  // Gemma's "sandwich": each block's output RMS-normed before its
                            // residual add (the norms' weights come with add_layer)
  int64_t activation = 0;   // the gated MLP's activation: kSiLU or kGeluTanh
  double scale = 0.0;       // attention scale; 0: head_dim^-0.5
  int64_t window = 0;       // sliding window (keys a query sees, its own included); 0: all
  int64_t group = 0;        // KV cache group: whose block table the layer's cache follows
  int64_t rope = 0;         // which rope table (Decoder::add_rope; 0: the constructor's)
  double softcap = 0.0;     // > 0: scores = softcap * tanh(scores / softcap) (Gemma 2)
};
constexpr int64_t kSiLU = 0, kGeluTanh = 1;

// All layers of one step in one call: embedding rows (times an embedding scale), then per
// layer RMSNorm, fused QKV (with its bias), optional QK-norm, rotary embedding from the
// layer's table, K/V written into the paged cache of the layer's KV cache group, paged
// attention (windowed for sliding layers, soft-capped where asked), output projection (optionally post-normed),
// residual, RMSNorm, fused gate/up, act(gate) x up, down projection (optionally
// post-normed), residual; final norm. The head's logits optionally soft-capped.
// Python dispatch of ~15 small ops per layer costs more than the arithmetic at batch 1,
// so decode steps run here; so do prefill steps, whose GEMMs go to oneDNN (the layers'
// batched weights) and whose elementwise work (norms, rope, activation, residuals, K/V
// writes) costs less fused here than as separate PyTorch ops over [tokens, hidden] tensors.
class Decoder {
 public:
  // embed: the embedding table as a weight layout ([vocab, hidden]: fp32, or a
  // checkpoint's blocks, whose rows are decoded as tokens look them up). cos / sin: rope
  // table 0 ([max_positions, head_dim / 2]: a position's angles). embed_scale multiplies
  // the embedding rows (Gemma: sqrt(hidden)); final_softcap > 0: logits = cap * tanh(logits
  // / cap).
  Decoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
          std::shared_ptr<QLinear> embed, at::Tensor cos, at::Tensor sin,
          at::Tensor final_norm, std::shared_ptr<QLinear> lm_head, double embed_scale = 1.0,
          double final_softcap = 0.0);
  // Another rope table (another base or scaling); returns its index for LayerSpec::rope.
  int64_t add_rope(at::Tensor cos, at::Tensor sin);
  // Norm weights are the factors multiplied in (Gemma's 1 + w folded already). post_*_norm
  // when spec.post_norms; q_norm and k_norm ([head_dim]) both or neither (QK-norm).
  void add_layer(at::Tensor attn_norm, std::shared_ptr<QLinear> qkv,
                 std::shared_ptr<QLinear> o_proj, at::Tensor mlp_norm,
                 std::shared_ptr<QLinear> gate_up, std::shared_ptr<QLinear> down,
                 const LayerSpec& spec = LayerSpec{},
                 const std::optional<at::Tensor>& post_attn_norm = std::nullopt,
                 const std::optional<at::Tensor>& post_mlp_norm = std::nullopt,
                 const std::optional<at::Tensor>& q_norm = std::nullopt,
                 const std::optional<at::Tensor>& k_norm = std::nullopt);
  // token_ids, positions, slot_mapping: [M] int64, one per token; block_tables
  // [N, max_blocks] and context_lens [N] int64, one per sequence; query_start [N + 1]: the
  // sequences' rows (None: one token each, a decode step, N == M). A sequence's rows are
  // the last positions of its context (prefill chunks after a cached prefix included).
  // One [2, Hkv, slots, D] cache per layer, all of one shape and dtype (fp32, bf16, fp16,
  // or int8 with kv_scales: one [2, Hkv, slots] fp16 tensor per layer); K/V are written in
  // it rounded as kv_dtype.h says. block_tables and slot_mapping are KV cache group 0's;
  // group_tables [N, *] those of groups 1.. (a layer of group g > 0 writes at the slot its
  // group's table gives a position; a sliding group's dropped blocks are never read).
  // Returns final-normed [M, hidden].
  at::Tensor forward(const at::Tensor& token_ids, const at::Tensor& positions,
                     const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& context_lens,
                     int64_t block_size,
                     const std::optional<at::Tensor>& query_start = std::nullopt,
                     const std::optional<std::vector<at::Tensor>>& kv_scales = std::nullopt,
                     const std::optional<std::vector<at::Tensor>>& group_tables =
                         std::nullopt) const;
  at::Tensor logits(const at::Tensor& hidden) const;  // [N, hidden] -> [N, vocab]
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  struct Layer {
    LayerSpec spec;
    at::Tensor attn_norm, mlp_norm;
    at::Tensor post_attn_norm, post_mlp_norm, q_norm, k_norm;  // undefined when unused
    std::shared_ptr<QLinear> qkv, o_proj, gate_up, down;
  };
  int64_t num_heads_, num_kv_heads_, head_dim_, hidden_;
  int64_t max_inter_ = 0;  // widest MLP of any layer: sizes the gate/up buffers
  float eps_;
  float embed_scale_;
  double final_softcap_;
  std::vector<at::Tensor> cos_, sin_;  // rope tables, [max_positions, head_dim / 2] each
  at::Tensor final_norm_;
  std::shared_ptr<QLinear> embed_, lm_head_;
  std::vector<Layer> layers_;
  // The step's intermediate buffers, kept from step to step (grown when a step has more
  // rows than any before), so a step allocates only the hidden states it returns.
  struct Workspace {
    int64_t rows = 0;
    std::vector<float> x, h, delta;  // [rows, hidden] each
    // One buffer for what only one half of a layer uses: the attention's qkv, q and o,
    // then the MLP's gate/up and activations (ATen's, hence a tensor). Apart they cost
    // ~60% more (Gemma 3 270M: 7 MiB at a 512-token chunk).
    at::Tensor scratch;
    QuantizedActs acts;
  };
  Workspace& workspace(int64_t rows) const;
  mutable std::mutex mu_;  // one step at a time owns the workspace
  mutable Workspace ws_;
};

}  // namespace kvloop
