// Python bindings of the kernel module. Every entry point releases the GIL: other Python
// threads (the server's event loop) keep running while a kernel computes.

#include "kvloop.h"

#include <torch/csrc/utils/pybind.h>  // pybind11 + the at::Tensor <-> torch.Tensor casters

namespace {
bool compiled_with_avx2() {
#ifdef __AVX2__
  return true;
#else
  return false;
#endif
}

// The instruction set the kernels were compiled for (matches kvloop.kernels.build's names).
const char* compiled_isa() {
#if defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using kvloop::Decoder;
  using kvloop::LayerSpec;
  using kvloop::QLinear;
  using Release = py::call_guard<py::gil_scoped_release>;
  m.def("paged_attention_varlen", &kvloop::paged_attention_varlen,
        "Paged attention for decode rows and prefill chunks over a block-table KV cache",
        py::arg("q"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("query_start"),
        py::arg("context_lens"), py::arg("block_size"), py::arg("scale"), py::arg("window"),
        py::arg("kv_scales") = py::none(), py::arg("softcap") = 0.0, Release());
  m.def("kv_store", &kvloop::kv_store,
        "k, v [T, Hkv, D] fp32 written at slot_mapping [T] in the cache's dtype (the "
        "decoder's rounding)",
        py::arg("kv_cache"), py::arg("kv_scales"), py::arg("slot_mapping"), py::arg("k"),
        py::arg("v"), Release());
  m.def("argmax_logsumexp", &kvloop::argmax_logsumexp,
        "logits [B, V] fp32 -> (first argmax [B] int64, logsumexp [B] fp32)",
        py::arg("logits"), Release());
  m.def("compiled_with_avx2", &compiled_with_avx2);
  m.def("compiled_isa", &compiled_isa);
  m.def("quantize_acts", &kvloop::quantize_acts_tensor,
        "x [M, K] -> (int8 [M, K], scales [M, K/32]): the kernels' activation rounding",
        Release());

  py::class_<QLinear, std::shared_ptr<QLinear>>(m, "QLinear", py::module_local())
      .def(py::init<int64_t, at::Tensor, int64_t, std::optional<at::Tensor>,
                    std::optional<at::Tensor>, bool>(),
           py::arg("kind"), py::arg("weight"), py::arg("in_features"),
           py::arg("scales") = py::none(), py::arg("bias") = py::none(),
           py::arg("wide_acts") = false)
      .def_static("stack", &QLinear::stack, py::arg("parts"))
      .def_readonly("wide_acts", &QLinear::wide_acts)
      .def("set_batched_decode", &QLinear::set_batched_decode, py::arg("min_rows"),
           py::arg("bf16") = true)
      .def_readonly("batched_decode", &QLinear::batched_decode)
      .def("decoded", &QLinear::decoded, py::arg("bf16") = false, Release())
      .def_readonly("batched_min_rows", &QLinear::batched_min_rows)
      .def("set_int8_gemm", &QLinear::set_int8_gemm, py::arg("min_rows"))
      .def_property_readonly("gemm_supported", &QLinear::gemm_supported)
      .def_property_readonly("eight_bit_codes", &QLinear::eight_bit_codes)
      .def_property_readonly("gemm_pairs", &QLinear::gemm_pairs)
      .def_readonly("gemm_min_rows", &QLinear::gemm_min_rows)
      .def("forward", &QLinear::forward, Release())
      .def_readonly("out_features", &QLinear::out_features)
      .def_readonly("in_features", &QLinear::in_features)
      .def_property_readonly("weight_bytes", &QLinear::weight_bytes);

  py::class_<LayerSpec>(m, "LayerSpec", py::module_local())
      .def(py::init<>())
      .def_readwrite("post_norms", &LayerSpec::post_norms)
      .def_readwrite("activation", &LayerSpec::activation)
      .def_readwrite("scale", &LayerSpec::scale)
      .def_readwrite("window", &LayerSpec::window)
      .def_readwrite("group", &LayerSpec::group)
      .def_readwrite("rope", &LayerSpec::rope)
      .def_readwrite("softcap", &LayerSpec::softcap);
  m.attr("SILU") = kvloop::kSiLU;
  m.attr("GELU_TANH") = kvloop::kGeluTanh;

  py::class_<Decoder, std::shared_ptr<Decoder>>(m, "Decoder", py::module_local())
      .def(py::init<int64_t, int64_t, int64_t, double, std::shared_ptr<QLinear>, at::Tensor,
                    at::Tensor, at::Tensor, std::shared_ptr<QLinear>, double, double>(),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"),
           py::arg("embed"), py::arg("cos"), py::arg("sin"), py::arg("final_norm"),
           py::arg("lm_head"), py::arg("embed_scale") = 1.0, py::arg("final_softcap") = 0.0)
      .def("add_rope", &Decoder::add_rope, py::arg("cos"), py::arg("sin"))
      .def("add_layer", &Decoder::add_layer, py::arg("attn_norm"), py::arg("qkv"),
           py::arg("o_proj"), py::arg("mlp_norm"), py::arg("gate_up"), py::arg("down"),
           py::arg("spec") = LayerSpec{}, py::arg("post_attn_norm") = py::none(),
           py::arg("post_mlp_norm") = py::none(), py::arg("q_norm") = py::none(),
           py::arg("k_norm") = py::none())
      .def("forward", &Decoder::forward, py::arg("token_ids"), py::arg("positions"),
           py::arg("kv_caches"), py::arg("slot_mapping"), py::arg("block_tables"),
           py::arg("context_lens"), py::arg("block_size"), py::arg("query_start") = py::none(),
           py::arg("kv_scales") = py::none(), py::arg("group_tables") = py::none(), Release())
      .def("logits", &Decoder::logits, Release())
      .def_property_readonly("num_layers", &Decoder::num_layers);
}
