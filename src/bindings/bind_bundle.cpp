// Test hooks over the C++ bundle reader and mfa::attention (mfa_native/_core):
// the tests run the C++ evaluator and API on what Python wrote and compare
// them with Python's own results. Arrays cross as (address, dtype, shape,
// strides in elements) tuples so every dtype (bfloat16 too) passes unchanged.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/map.h>

#include "bindings.hpp"
#include "core/pass_template.hpp"
#include "core/size_expression.hpp"
#include "mfa/attention.hpp"
#include "mfa/block_sparse.hpp"
#include "mfa/command_batch.hpp"
#include "mfa/int8.hpp"
#include "mfa/kvcache.hpp"
#include "mfa/merge.hpp"
#include "mfa/quantize.hpp"
#include "mfa/sparse.hpp"
#include "mfa/varlen.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace mfa::bindings {

namespace {

using ViewSpec = std::tuple<std::uintptr_t, std::string, std::vector<std::int64_t>, std::vector<std::int64_t>>;

DType dtype_of(const std::string& name) {
  if (name == "float32") return DType::float32;
  if (name == "float16") return DType::float16;
  if (name == "bfloat16") return DType::bfloat16;
  if (name == "bool") return DType::bool8;
  if (name == "int32") return DType::int32;
  if (name == "uint8") return DType::uint8;
  if (name == "uint32") return DType::uint32;
  if (name == "float8_e4m3fn") return DType::float8_e4m3fn;
  if (name == "float8_e5m2") return DType::float8_e5m2;
  throw TypeError("no TensorView dtype for '" + name + "'");
}

TensorView view_of(const ViewSpec& spec) {
  const auto& [address, dtype, shape, strides] = spec;
  return TensorView{reinterpret_cast<void*>(address), dtype_of(dtype), shape, strides};
}

std::optional<TensorView> view_of(const std::optional<ViewSpec>& spec) {
  if (!spec) return std::nullopt;
  return view_of(*spec);
}

AttentionOptions options_of(std::optional<double> scale, const std::string& causal,
                            std::optional<std::pair<std::int64_t, std::int64_t>> window,
                            const std::optional<ViewSpec>& mask, const std::optional<ViewSpec>& sinks,
                            const std::string& layout, std::optional<double> softcap,
                            const std::optional<ViewSpec>& alibi_slopes, const std::string& score_mod,
                            const std::vector<ViewSpec>& score_mod_tensors) {
  AttentionOptions o;
  o.softcap = softcap;
  o.alibi_slopes = view_of(alibi_slopes);
  o.score_mod = score_mod;
  for (const ViewSpec& t : score_mod_tensors) o.score_mod_tensors.push_back(view_of(t));
  o.scale = scale;
  if (causal == "none") o.causal = Causal::none;
  else if (causal == "lower_right") o.causal = Causal::lower_right;
  else if (causal == "upper_left") o.causal = Causal::upper_left;
  else throw ArgumentError("causal must be none, lower_right or upper_left");
  o.window = window;
  o.mask = view_of(mask);
  o.sinks = view_of(sinks);
  if (layout == "bhsd") o.layout = Layout::bhsd;
  else if (layout == "bshd") o.layout = Layout::bshd;
  else throw ArgumentError("layout must be bhsd or bshd");
  return o;
}

// A cache argument: its view, or with a `format` the QuantizedTensor of its data (q's `dtype`),
// and an affine one's scales, biases, bits and group size.
KVCache cache_of(const ViewSpec& spec, const std::string& format, DType dtype, const std::optional<ViewSpec>& scales,
                 const std::optional<ViewSpec>& biases, std::optional<std::int64_t> bits,
                 std::optional<std::int64_t> group_size) {
  if (format.empty()) return view_of(spec);
  return QuantizedTensor{format, view_of(spec), dtype, view_of(scales), view_of(biases), bits, group_size};
}

SparseOptions sparse_options_of(std::optional<double> scale, const std::optional<ViewSpec>& sinks,
                                std::optional<double> softcap, const std::optional<ViewSpec>& alibi_slopes,
                                const std::vector<ViewSpec>& score_mod_tensors, const std::string& score_mod,
                                const std::optional<ViewSpec>& topk_length, const std::string& layout) {
  const AttentionOptions a = options_of(scale, "none", std::nullopt, std::nullopt, sinks, layout, softcap,
                                        alibi_slopes, score_mod, score_mod_tensors);
  SparseOptions o;
  o.scale = a.scale, o.sinks = a.sinks, o.softcap = a.softcap, o.alibi_slopes = a.alibi_slopes;
  o.score_mod_tensors = a.score_mod_tensors, o.score_mod = a.score_mod, o.topk_length = view_of(topk_length);
  o.layout = a.layout;
  return o;
}

using Pair = std::pair<std::int64_t, std::int64_t>;

// A BlockMask of the hooks' arguments: its lists and bits by name (Python's), block_size,
// seq_lengths, and from_mask's rule (rule_causal: "" for none).
BlockMask block_mask_of(const std::map<std::string, ViewSpec>& lists, Pair block_size,
                        std::optional<Pair> seq_lengths, const std::string& rule_causal,
                        std::optional<Pair> rule_window, const std::optional<ViewSpec>& rule_mask) {
  const auto list = [&](const char* name) -> std::optional<TensorView> {
    auto it = lists.find(name);
    return it == lists.end() ? std::nullopt : std::optional<TensorView>(view_of(it->second));
  };
  BlockMask mask{view_of(lists.at("kv_num_blocks")), view_of(lists.at("kv_indices"))};
  mask.full_kv_num_blocks = list("full_kv_num_blocks"), mask.full_kv_indices = list("full_kv_indices");
  mask.q_num_blocks = list("q_num_blocks"), mask.q_indices = list("q_indices");
  mask.full_q_num_blocks = list("full_q_num_blocks"), mask.full_q_indices = list("full_q_indices");
  mask.kv_bit_blocks = list("kv_bit_blocks"), mask.kv_bits = list("kv_bits");
  mask.block_size = block_size, mask.seq_lengths = seq_lengths;
  if (!rule_causal.empty())
    mask.rule = BlockMaskRule{options_of({}, rule_causal, {}, {}, {}, "bhsd", {}, {}, "", {}).causal, rule_window,
                              view_of(rule_mask)};
  return mask;
}

BlockSparseOptions block_sparse_options_of(std::optional<double> scale, const std::optional<std::string>& causal,
                                           const std::optional<ViewSpec>& mask, std::optional<Pair> window,
                                           const std::optional<ViewSpec>& sinks, std::optional<double> softcap,
                                           const std::optional<ViewSpec>& alibi_slopes,
                                           const std::vector<ViewSpec>& score_mod_tensors,
                                           const std::string& score_mod, const std::string& layout) {
  const AttentionOptions a = options_of(scale, causal.value_or("none"), window, mask, sinks, layout, softcap,
                                        alibi_slopes, score_mod, score_mod_tensors);
  BlockSparseOptions o;
  o.scale = a.scale, o.mask = a.mask, o.window = a.window, o.sinks = a.sinks, o.softcap = a.softcap;
  o.alibi_slopes = a.alibi_slopes, o.score_mod_tensors = a.score_mod_tensors, o.score_mod = a.score_mod;
  o.layout = a.layout;
  if (causal) o.causal = a.causal;
  return o;
}

SizeEnv env_of(const std::map<std::string, std::int64_t>& sizes) { return SizeEnv(sizes.begin(), sizes.end()); }

nb::dict evaluated(const std::string& text, const std::map<std::string, std::int64_t>& sizes) {
  const PassTemplate t = PassTemplate::from_json(json::parse(text));
  const EvaluatedPass pass = evaluate(t, env_of(sizes));
  nb::list kernels, buffers;
  for (const EvaluatedKernel& k : pass.kernels)
    kernels.append(nb::make_tuple(k.kernel->entry, nb::make_tuple(k.threadgroups.x, k.threadgroups.y, k.threadgroups.z),
                                  k.kernel->buffers));
  for (const EvaluatedBuffer& b : pass.buffers) {
    nb::dict d;
    d["name"] = b.buffer->name;
    d["shape"] = b.shape;
    d["nbytes"] = b.nbytes;
    d["strides"] = b.buffer->caller() ? nb::cast(b.strides) : nb::none();
    d["value"] = b.buffer->role == "constant" ? nb::cast(std::vector<std::int64_t>(b.value.begin(), b.value.end()))
                                              : nb::none();
    buffers.append(d);
  }
  nb::dict out;
  out["name"] = t.name;
  out["kernels"] = kernels;
  out["buffers"] = buffers;
  return out;
}

}  // namespace

void bind_bundle(nb::module_& m) {
  m.def("_evaluate_size", [](const std::string& text, const std::map<std::string, std::int64_t>& sizes) {
    return SizeExpression(text).evaluate(env_of(sizes));
  }, "text"_a, "sizes"_a, "Test hook: the C++ evaluator's value of a size expression.");
  m.def("_evaluate_template", &evaluated, "template_json"_a, "sizes"_a,
        "Test hook: the C++ evaluation of a pass template: {name, kernels: [(entry, grid, buffers)], buffers: "
        "[{name, shape, nbytes, strides, value}]}.");

  nb::class_<Bundle>(m, "_Bundle", "Test hook: a bundle read by the C++ reader.")
      .def_static("load", &Bundle::load, "path"_a)
      .def_static("from_bytes", [](nb::bytes data) { return Bundle::from_memory(data.data(), data.size()); }, "data"_a)
      .def("entries", &Bundle::entries);

  m.def("_bundle_attention",
        [](const std::string& kind, const Bundle& bundle, const ViewSpec& q, const ViewSpec& k, const ViewSpec& v,
           const ViewSpec& out, const std::optional<ViewSpec>& lse, std::optional<double> scale,
           const std::string& causal, std::optional<std::pair<std::int64_t, std::int64_t>> window,
           const std::optional<ViewSpec>& mask, const std::optional<ViewSpec>& sinks, const std::string& layout,
           std::optional<double> softcap, const std::optional<ViewSpec>& alibi_slopes, const std::string& score_mod,
           const std::vector<ViewSpec>& score_mod_tensors, bool batch_invariant) {
          const Device device = Device::get(device_kind_from_string(kind));
          AttentionOptions options = options_of(scale, causal, window, mask, sinks, layout, softcap, alibi_slopes,
                                                score_mod, score_mod_tensors);
          if (batch_invariant) options.deterministic = Deterministic::batch_invariant;
          const std::optional<TensorView> rows = view_of(lse);
          nb::gil_scoped_release release;
          attention(device, bundle, view_of(q), view_of(k), view_of(v), view_of(out), options, rows ? &*rows : nullptr);
        },
        "device"_a, "bundle"_a, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a = nb::none(), "scale"_a = nb::none(),
        "causal"_a = "none", "window"_a = nb::none(), "mask"_a = nb::none(), "sinks"_a = nb::none(),
        "layout"_a = "bhsd", "softcap"_a = nb::none(), "alibi_slopes"_a = nb::none(), "score_mod"_a = "",
        "score_mod_tensors"_a = std::vector<ViewSpec>(), "batch_invariant"_a = false,
        "Test hook: mfa::attention on views of caller memory.");

  m.def("_bundle_attention_backward",
        [](const std::string& kind, const Bundle& bundle, const ViewSpec& q, const ViewSpec& k, const ViewSpec& v,
           const ViewSpec& o, const ViewSpec& lse, const ViewSpec& dout, const ViewSpec& dq, const ViewSpec& dk,
           const ViewSpec& dv, const std::optional<ViewSpec>& dsinks, std::optional<double> scale,
           const std::string& causal, std::optional<std::pair<std::int64_t, std::int64_t>> window,
           const std::optional<ViewSpec>& mask, const std::optional<ViewSpec>& sinks, const std::string& layout,
           std::optional<double> softcap, const std::optional<ViewSpec>& alibi_slopes, const std::string& score_mod,
           const std::vector<ViewSpec>& score_mod_tensors) {
          const Device device = Device::get(device_kind_from_string(kind));
          const AttentionOptions options = options_of(scale, causal, window, mask, sinks, layout, softcap, alibi_slopes,
                                                      score_mod, score_mod_tensors);
          const std::optional<TensorView> ds = view_of(dsinks);
          nb::gil_scoped_release release;
          attention_backward(device, bundle, view_of(q), view_of(k), view_of(v), view_of(o), view_of(lse),
                             view_of(dout), view_of(dq), view_of(dk), view_of(dv), options, ds ? &*ds : nullptr);
        },
        "device"_a, "bundle"_a, "q"_a, "k"_a, "v"_a, "o"_a, "lse"_a, "dout"_a, "dq"_a, "dk"_a, "dv"_a,
        "dsinks"_a = nb::none(), "scale"_a = nb::none(), "causal"_a = "none", "window"_a = nb::none(),
        "mask"_a = nb::none(), "sinks"_a = nb::none(), "layout"_a = "bhsd", "softcap"_a = nb::none(),
        "alibi_slopes"_a = nb::none(), "score_mod"_a = "", "score_mod_tensors"_a = std::vector<ViewSpec>(),
        "Test hook: mfa::attention_backward on views of caller memory.");

  m.def("_bundle_int8_attention",
        [](const std::string& kind, const Bundle& bundle, const ViewSpec& q, const ViewSpec& k, const ViewSpec& v,
           const ViewSpec& out, const std::optional<ViewSpec>& lse, std::optional<double> scale,
           const std::string& causal, std::optional<std::pair<std::int64_t, std::int64_t>> window,
           const std::optional<ViewSpec>& mask, const std::optional<ViewSpec>& sinks, const std::string& layout,
           std::optional<double> softcap, const std::optional<ViewSpec>& alibi_slopes, const std::string& qk_scale,
           bool smooth_k, const std::string& pv) {
          const Device device = Device::get(device_kind_from_string(kind));
          const AttentionOptions a = options_of(scale, causal, window, mask, sinks, layout, softcap, alibi_slopes,
                                                "", {});
          Int8AttentionOptions o;
          o.scale = a.scale, o.causal = a.causal, o.window = a.window, o.mask = a.mask, o.sinks = a.sinks;
          o.softcap = a.softcap, o.alibi_slopes = a.alibi_slopes, o.layout = a.layout;
          o.qk_scale = qk_scale, o.smooth_k = smooth_k, o.pv = pv;
          const std::optional<TensorView> rows = view_of(lse);
          nb::gil_scoped_release release;
          int8_attention(device, bundle, view_of(q), view_of(k), view_of(v), view_of(out), o, rows ? &*rows : nullptr);
        },
        "device"_a, "bundle"_a, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a = nb::none(), "scale"_a = nb::none(),
        "causal"_a = "none", "window"_a = nb::none(), "mask"_a = nb::none(), "sinks"_a = nb::none(),
        "layout"_a = "bhsd", "softcap"_a = nb::none(), "alibi_slopes"_a = nb::none(), "qk_scale"_a = "token",
        "smooth_k"_a = true, "pv"_a = "int8", "Test hook: mfa::int8_attention on views of caller memory.");

  m.def("_bundle_merge_attention",
        [](const std::string& kind, const Bundle& bundle, const std::vector<ViewSpec>& outputs,
           const std::vector<ViewSpec>& lses, const ViewSpec& out, const ViewSpec& lse, const std::string& layout) {
          const Device device = Device::get(device_kind_from_string(kind));
          const AttentionOptions a = options_of(std::nullopt, "none", std::nullopt, std::nullopt, std::nullopt, layout,
                                                std::nullopt, std::nullopt, "", {});
          std::vector<TensorView> parts, rows;
          for (const ViewSpec& o : outputs) parts.push_back(view_of(o));
          for (const ViewSpec& l : lses) rows.push_back(view_of(l));
          nb::gil_scoped_release release;
          merge_attention(device, bundle, parts, rows, view_of(out), view_of(lse), a.layout);
        },
        "device"_a, "bundle"_a, "outputs"_a, "lses"_a, "out"_a, "lse"_a, "layout"_a = "bhsd",
        "Test hook: mfa::merge_attention on views of caller memory.");

  m.def("_bundle_quantize",
        [](const std::string& kind, const Bundle& bundle, const ViewSpec& x, const ViewSpec& data,
           const std::optional<ViewSpec>& scales, const std::optional<ViewSpec>& biases, const std::string& format,
           std::optional<std::int64_t> bits, std::optional<std::int64_t> group_size) {
          const Device device = Device::get(device_kind_from_string(kind));
          const QuantizeOutputs out{view_of(data), view_of(scales), view_of(biases)};
          nb::gil_scoped_release release;
          quantize(device, bundle, view_of(x), out, format, bits, group_size);
        },
        "device"_a, "bundle"_a, "x"_a, "data"_a, "scales"_a = nb::none(), "biases"_a = nb::none(),
        "format"_a = "affine", "bits"_a = nb::none(), "group_size"_a = nb::none(),
        "Test hook: mfa::quantize on views of caller memory.");

  m.def("_bundle_attention_with_kvcache",
        [](const std::string& kind, const Bundle& bundle, const ViewSpec& q, const ViewSpec& k_cache,
           const ViewSpec& v_cache, const ViewSpec& out, const std::optional<ViewSpec>& lse,
           const std::string& cache_format, const std::optional<ViewSpec>& cache_seqlens,
           const std::optional<ViewSpec>& k, const std::optional<ViewSpec>& v,
           const std::optional<ViewSpec>& block_table, std::optional<double> scale, const std::string& causal,
           std::optional<std::pair<std::int64_t, std::int64_t>> window, const std::optional<ViewSpec>& sinks,
           std::optional<double> softcap, const std::optional<ViewSpec>& alibi_slopes,
           const std::optional<ViewSpec>& rotary_cos, const std::optional<ViewSpec>& rotary_sin,
           const std::optional<ViewSpec>& rotary_seqlens, bool rotary_interleaved, const std::string& score_mod,
           const std::vector<ViewSpec>& score_mod_tensors, const std::optional<std::string>& v_cache_format,
           const std::optional<ViewSpec>& k_scales, const std::optional<ViewSpec>& k_biases,
           const std::optional<ViewSpec>& v_scales, const std::optional<ViewSpec>& v_biases,
           std::optional<std::int64_t> k_bits, std::optional<std::int64_t> k_group_size,
           std::optional<std::int64_t> v_bits, std::optional<std::int64_t> v_group_size,
           const std::optional<ViewSpec>& q_descale, const std::optional<ViewSpec>& k_descale,
           const std::optional<ViewSpec>& v_descale, bool batch_invariant) {
          const Device device = Device::get(device_kind_from_string(kind));
          const AttentionOptions a = options_of(scale, causal, window, std::nullopt, sinks, "bshd", softcap,
                                                alibi_slopes, score_mod, score_mod_tensors);
          const TensorView query = view_of(q), output = view_of(out);
          const KVCache keys = cache_of(k_cache, cache_format, query.dtype, k_scales, k_biases, k_bits, k_group_size);
          const KVCache values = cache_of(v_cache, v_cache_format.value_or(cache_format), query.dtype, v_scales,
                                          v_biases, v_bits, v_group_size);
          const std::optional<TensorView> descales[] = {view_of(q_descale), view_of(k_descale), view_of(v_descale)};
          const std::optional<TensorView> rows = view_of(lse), lengths = view_of(cache_seqlens), new_k = view_of(k),
                                          new_v = view_of(v), table = view_of(block_table),
                                          cos = view_of(rotary_cos), sin = view_of(rotary_sin),
                                          starts = view_of(rotary_seqlens);
          KVCacheOptions o;
          o.cache_seqlens = lengths ? &*lengths : nullptr;
          o.k = new_k ? &*new_k : nullptr;
          o.v = new_v ? &*new_v : nullptr;
          o.block_table = table ? &*table : nullptr;
          o.rotary_cos = cos ? &*cos : nullptr;
          o.rotary_sin = sin ? &*sin : nullptr;
          o.rotary_seqlens = starts ? &*starts : nullptr;
          o.rotary_interleaved = rotary_interleaved;
          o.q_descale = descales[0] ? &*descales[0] : nullptr;
          o.k_descale = descales[1] ? &*descales[1] : nullptr;
          o.v_descale = descales[2] ? &*descales[2] : nullptr;
          o.scale = a.scale, o.causal = a.causal, o.window = a.window, o.sinks = a.sinks, o.softcap = a.softcap;
          o.alibi_slopes = a.alibi_slopes, o.score_mod = a.score_mod, o.score_mod_tensors = a.score_mod_tensors;
          if (batch_invariant) o.deterministic = Deterministic::batch_invariant;
          nb::gil_scoped_release release;
          attention_with_kvcache(device, bundle, query, keys, values, output, o, rows ? &*rows : nullptr);
        },
        "device"_a, "bundle"_a, "q"_a, "k_cache"_a, "v_cache"_a, "out"_a, "lse"_a = nb::none(),
        "cache_format"_a = "", "cache_seqlens"_a = nb::none(), "k"_a = nb::none(), "v"_a = nb::none(),
        "block_table"_a = nb::none(), "scale"_a = nb::none(), "causal"_a = "none", "window"_a = nb::none(),
        "sinks"_a = nb::none(), "softcap"_a = nb::none(), "alibi_slopes"_a = nb::none(),
        "rotary_cos"_a = nb::none(), "rotary_sin"_a = nb::none(), "rotary_seqlens"_a = nb::none(),
        "rotary_interleaved"_a = true, "score_mod"_a = "", "score_mod_tensors"_a = std::vector<ViewSpec>(),
        "v_cache_format"_a = nb::none(), "k_scales"_a = nb::none(), "k_biases"_a = nb::none(),
        "v_scales"_a = nb::none(), "v_biases"_a = nb::none(), "k_bits"_a = nb::none(), "k_group_size"_a = nb::none(),
        "v_bits"_a = nb::none(), "v_group_size"_a = nb::none(),
        "q_descale"_a = nb::none(), "k_descale"_a = nb::none(), "v_descale"_a = nb::none(),
        "batch_invariant"_a = false, "Test hook: mfa::attention_with_kvcache on views of caller memory (cache_format: \"\" for float and "
        "float8 caches, else the QuantizedTensor format of both caches' data; v_cache_format: v's, when it "
        "differs; an affine cache's fields, bits and group_size, each cache's; the descales).");

  m.def("_bundle_attention_varlen",
        [](const std::string& kind, const Bundle& bundle, const ViewSpec& q, const ViewSpec& k, const ViewSpec& v,
           const ViewSpec& cu_seqlens_q, const std::optional<ViewSpec>& cu_seqlens_k, const ViewSpec& out,
           const std::optional<ViewSpec>& lse, std::optional<std::int64_t> max_seqlen_q,
           std::optional<std::int64_t> max_seqlen_k, std::optional<double> scale, const std::string& causal,
           std::optional<std::pair<std::int64_t, std::int64_t>> window, const std::optional<ViewSpec>& sinks,
           std::optional<double> softcap, const std::optional<ViewSpec>& alibi_slopes,
           const std::optional<ViewSpec>& block_table, const std::optional<ViewSpec>& seqused_k,
           const std::string& score_mod, const std::vector<ViewSpec>& score_mod_tensors, CommandBatch* batch) {
          const Device device = Device::get(device_kind_from_string(kind));
          const AttentionOptions a = options_of(scale, causal, window, std::nullopt, sinks, "bshd", softcap,
                                                alibi_slopes, score_mod, score_mod_tensors);
          const TensorView query = view_of(q), keys = view_of(k), values = view_of(v), cu_q = view_of(cu_seqlens_q),
                           output = view_of(out);
          const std::optional<TensorView> cu_k = view_of(cu_seqlens_k), rows = view_of(lse),
                                          table = view_of(block_table), used = view_of(seqused_k);
          VarlenOptions o;
          o.max_seqlen_q = max_seqlen_q, o.max_seqlen_k = max_seqlen_k;
          o.scale = a.scale, o.causal = a.causal, o.window = a.window, o.sinks = a.sinks, o.softcap = a.softcap;
          o.alibi_slopes = a.alibi_slopes, o.score_mod = a.score_mod, o.score_mod_tensors = a.score_mod_tensors;
          o.block_table = table ? &*table : nullptr;
          o.seqused_k = used ? &*used : nullptr;
          nb::gil_scoped_release release;
          if (batch)
            attention_varlen(*batch, bundle, query, keys, values, cu_q, cu_k ? &*cu_k : nullptr, output, o,
                             rows ? &*rows : nullptr);
          else
            attention_varlen(device, bundle, query, keys, values, cu_q, cu_k ? &*cu_k : nullptr, output, o,
                             rows ? &*rows : nullptr);
        },
        "device"_a, "bundle"_a, "q"_a, "k"_a, "v"_a, "cu_seqlens_q"_a, "cu_seqlens_k"_a, "out"_a,
        "lse"_a = nb::none(), "max_seqlen_q"_a = nb::none(), "max_seqlen_k"_a = nb::none(), "scale"_a = nb::none(),
        "causal"_a = "none", "window"_a = nb::none(), "sinks"_a = nb::none(), "softcap"_a = nb::none(),
        "alibi_slopes"_a = nb::none(), "block_table"_a = nb::none(), "seqused_k"_a = nb::none(),
        "score_mod"_a = "", "score_mod_tensors"_a = std::vector<ViewSpec>(), "batch"_a = nb::none(),
        "Test hook: mfa::attention_varlen on views of caller memory (encoded into `batch` when given).");

  m.def("_bundle_attention_varlen_backward",
        [](const std::string& kind, const Bundle& bundle, const ViewSpec& q, const ViewSpec& k, const ViewSpec& v,
           const ViewSpec& o, const ViewSpec& lse, const ViewSpec& dout, const ViewSpec& cu_seqlens_q,
           const std::optional<ViewSpec>& cu_seqlens_k, const ViewSpec& dq, const ViewSpec& dk, const ViewSpec& dv,
           const std::optional<ViewSpec>& dsinks, std::optional<std::int64_t> max_seqlen_q,
           std::optional<std::int64_t> max_seqlen_k, std::optional<double> scale, const std::string& causal,
           std::optional<std::pair<std::int64_t, std::int64_t>> window, const std::optional<ViewSpec>& sinks,
           std::optional<double> softcap, const std::optional<ViewSpec>& alibi_slopes,
           const std::optional<ViewSpec>& block_table, const std::optional<ViewSpec>& seqused_k,
           const std::string& score_mod, const std::vector<ViewSpec>& score_mod_tensors) {
          const Device device = Device::get(device_kind_from_string(kind));
          const AttentionOptions a = options_of(scale, causal, window, std::nullopt, sinks, "bshd", softcap,
                                                alibi_slopes, score_mod, score_mod_tensors);
          const TensorView query = view_of(q), keys = view_of(k), values = view_of(v), output = view_of(o),
                           rows = view_of(lse), gradient = view_of(dout), cu_q = view_of(cu_seqlens_q),
                           dquery = view_of(dq), dkeys = view_of(dk), dvalues = view_of(dv);
          const std::optional<TensorView> cu_k = view_of(cu_seqlens_k), dsink = view_of(dsinks),
                                          table = view_of(block_table), used = view_of(seqused_k);
          VarlenOptions opts;
          opts.max_seqlen_q = max_seqlen_q, opts.max_seqlen_k = max_seqlen_k;
          opts.scale = a.scale, opts.causal = a.causal, opts.window = a.window, opts.sinks = a.sinks;
          opts.softcap = a.softcap, opts.alibi_slopes = a.alibi_slopes;
          opts.score_mod = a.score_mod, opts.score_mod_tensors = a.score_mod_tensors;
          opts.block_table = table ? &*table : nullptr;
          opts.seqused_k = used ? &*used : nullptr;
          nb::gil_scoped_release release;
          attention_varlen_backward(device, bundle, query, keys, values, output, rows, gradient, cu_q,
                                    cu_k ? &*cu_k : nullptr, dquery, dkeys, dvalues, opts,
                                    dsink ? &*dsink : nullptr);
        },
        "device"_a, "bundle"_a, "q"_a, "k"_a, "v"_a, "o"_a, "lse"_a, "do"_a, "cu_seqlens_q"_a, "cu_seqlens_k"_a,
        "dq"_a, "dk"_a, "dv"_a, "dsinks"_a = nb::none(), "max_seqlen_q"_a = nb::none(),
        "max_seqlen_k"_a = nb::none(), "scale"_a = nb::none(), "causal"_a = "none", "window"_a = nb::none(),
        "sinks"_a = nb::none(), "softcap"_a = nb::none(), "alibi_slopes"_a = nb::none(),
        "block_table"_a = nb::none(), "seqused_k"_a = nb::none(), "score_mod"_a = "",
        "score_mod_tensors"_a = std::vector<ViewSpec>(),
        "Test hook: mfa::attention_varlen_backward on views of caller memory.");

  m.def("_bundle_sparse_attention",
        [](const std::string& kind, const Bundle& bundle, const ViewSpec& q, const ViewSpec& k, const ViewSpec& v,
           const ViewSpec& indices, const ViewSpec& out, const std::optional<ViewSpec>& lse,
           std::optional<double> scale, const std::optional<ViewSpec>& sinks, std::optional<double> softcap,
           const std::optional<ViewSpec>& alibi_slopes, const std::vector<ViewSpec>& score_mod_tensors,
           const std::string& score_mod, const std::optional<ViewSpec>& topk_length, const std::string& layout) {
          const Device device = Device::get(device_kind_from_string(kind));
          const SparseOptions options = sparse_options_of(scale, sinks, softcap, alibi_slopes, score_mod_tensors,
                                                          score_mod, topk_length, layout);
          const std::optional<TensorView> rows = view_of(lse);
          nb::gil_scoped_release release;
          sparse_attention(device, bundle, view_of(q), view_of(k), view_of(v), view_of(indices), view_of(out),
                           options, rows ? &*rows : nullptr);
        },
        "device"_a, "bundle"_a, "q"_a, "k"_a, "v"_a, "indices"_a, "out"_a, "lse"_a = nb::none(),
        "scale"_a = nb::none(), "sinks"_a = nb::none(), "softcap"_a = nb::none(), "alibi_slopes"_a = nb::none(),
        "score_mod_tensors"_a = std::vector<ViewSpec>(), "score_mod"_a = "", "topk_length"_a = nb::none(),
        "layout"_a = "bhsd", "Test hook: mfa::sparse_attention on views of caller memory.");

  m.def("_bundle_sparse_attention_backward",
        [](const std::string& kind, const Bundle& bundle, const ViewSpec& q, const ViewSpec& k, const ViewSpec& v,
           const ViewSpec& indices, const ViewSpec& o, const ViewSpec& lse, const ViewSpec& dout, const ViewSpec& dq,
           const ViewSpec& dk, const ViewSpec& dv, const std::optional<ViewSpec>& dsinks, std::optional<double> scale,
           const std::optional<ViewSpec>& sinks, std::optional<double> softcap,
           const std::optional<ViewSpec>& alibi_slopes, const std::vector<ViewSpec>& score_mod_tensors,
           const std::string& score_mod, const std::optional<ViewSpec>& topk_length, const std::string& layout) {
          const Device device = Device::get(device_kind_from_string(kind));
          const SparseOptions options = sparse_options_of(scale, sinks, softcap, alibi_slopes, score_mod_tensors,
                                                          score_mod, topk_length, layout);
          const std::optional<TensorView> ds = view_of(dsinks);
          nb::gil_scoped_release release;
          sparse_attention_backward(device, bundle, view_of(q), view_of(k), view_of(v), view_of(indices), view_of(o),
                                    view_of(lse), view_of(dout), view_of(dq), view_of(dk), view_of(dv), options,
                                    ds ? &*ds : nullptr);
        },
        "device"_a, "bundle"_a, "q"_a, "k"_a, "v"_a, "indices"_a, "o"_a, "lse"_a, "dout"_a, "dq"_a, "dk"_a, "dv"_a,
        "dsinks"_a = nb::none(), "scale"_a = nb::none(), "sinks"_a = nb::none(), "softcap"_a = nb::none(),
        "alibi_slopes"_a = nb::none(), "score_mod_tensors"_a = std::vector<ViewSpec>(), "score_mod"_a = "",
        "topk_length"_a = nb::none(), "layout"_a = "bhsd",
        "Test hook: mfa::sparse_attention_backward on views of caller memory.");

  m.def("_bundle_sparse_topk",
        [](const std::string& kind, const Bundle& bundle, const ViewSpec& q, const ViewSpec& k, const ViewSpec& weights,
           std::int64_t topk, const ViewSpec& indices, const std::optional<ViewSpec>& topk_scores, bool causal,
           const std::string& layout, const std::string& precision) {
          const Device device = Device::get(device_kind_from_string(kind));
          SparseTopkOptions options;
          options.causal = causal;
          options.layout = options_of({}, "none", std::nullopt, std::nullopt, std::nullopt, layout, std::nullopt,
                                      std::nullopt, "", {}).layout;
          options.precision = precision;
          const std::optional<TensorView> scores = view_of(topk_scores);
          nb::gil_scoped_release release;
          sparse_topk(device, bundle, view_of(q), view_of(k), view_of(weights), topk, view_of(indices), options,
                      scores ? &*scores : nullptr);
        },
        "device"_a, "bundle"_a, "q"_a, "k"_a, "weights"_a, "topk"_a, "indices"_a, "topk_scores"_a = nb::none(),
        "causal"_a = true, "layout"_a = "bhsd", "precision"_a = "float",
        "Test hook: mfa::sparse_topk on views of caller memory.");

  m.def("_bundle_block_sparse_attention",
        [](const std::string& kind, const Bundle& bundle, const ViewSpec& q, const ViewSpec& k, const ViewSpec& v,
           const std::map<std::string, ViewSpec>& lists, Pair block_size, const ViewSpec& out,
           const std::optional<ViewSpec>& lse, std::optional<Pair> seq_lengths, const std::string& rule_causal,
           std::optional<Pair> rule_window, const std::optional<ViewSpec>& rule_mask, std::optional<double> scale,
           const std::optional<std::string>& causal, const std::optional<ViewSpec>& mask, std::optional<Pair> window,
           const std::optional<ViewSpec>& sinks, std::optional<double> softcap,
           const std::optional<ViewSpec>& alibi_slopes, const std::vector<ViewSpec>& score_mod_tensors,
           const std::string& score_mod, const std::string& layout) {
          const Device device = Device::get(device_kind_from_string(kind));
          const BlockMask block_mask =
              block_mask_of(lists, block_size, seq_lengths, rule_causal, rule_window, rule_mask);
          const BlockSparseOptions options = block_sparse_options_of(
              scale, causal, mask, window, sinks, softcap, alibi_slopes, score_mod_tensors, score_mod, layout);
          const std::optional<TensorView> rows = view_of(lse);
          nb::gil_scoped_release release;
          block_sparse_attention(device, bundle, view_of(q), view_of(k), view_of(v), block_mask, view_of(out), options,
                                 rows ? &*rows : nullptr);
        },
        "device"_a, "bundle"_a, "q"_a, "k"_a, "v"_a, "lists"_a, "block_size"_a, "out"_a, "lse"_a = nb::none(),
        "seq_lengths"_a = nb::none(), "rule_causal"_a = "", "rule_window"_a = nb::none(), "rule_mask"_a = nb::none(),
        "scale"_a = nb::none(), "causal"_a = nb::none(), "mask"_a = nb::none(), "window"_a = nb::none(),
        "sinks"_a = nb::none(), "softcap"_a = nb::none(), "alibi_slopes"_a = nb::none(),
        "score_mod_tensors"_a = std::vector<ViewSpec>(), "score_mod"_a = "", "layout"_a = "bhsd",
        "Test hook: mfa::block_sparse_attention on views of caller memory (lists: the BlockMask's by name).");

  m.def("_bundle_block_sparse_attention_backward",
        [](const std::string& kind, const Bundle& bundle, const ViewSpec& q, const ViewSpec& k, const ViewSpec& v,
           const ViewSpec& o, const ViewSpec& lse, const ViewSpec& dout, const std::map<std::string, ViewSpec>& lists,
           Pair block_size, const ViewSpec& dq, const ViewSpec& dk, const ViewSpec& dv,
           const std::optional<ViewSpec>& dsinks, std::optional<Pair> seq_lengths, const std::string& rule_causal,
           std::optional<Pair> rule_window, const std::optional<ViewSpec>& rule_mask, std::optional<double> scale,
           const std::optional<std::string>& causal, const std::optional<ViewSpec>& mask, std::optional<Pair> window,
           const std::optional<ViewSpec>& sinks, std::optional<double> softcap,
           const std::optional<ViewSpec>& alibi_slopes, const std::vector<ViewSpec>& score_mod_tensors,
           const std::string& score_mod, const std::string& layout) {
          const Device device = Device::get(device_kind_from_string(kind));
          const BlockMask block_mask =
              block_mask_of(lists, block_size, seq_lengths, rule_causal, rule_window, rule_mask);
          const BlockSparseOptions options = block_sparse_options_of(
              scale, causal, mask, window, sinks, softcap, alibi_slopes, score_mod_tensors, score_mod, layout);
          const std::optional<TensorView> ds = view_of(dsinks);
          nb::gil_scoped_release release;
          block_sparse_attention_backward(device, bundle, view_of(q), view_of(k), view_of(v), view_of(o), view_of(lse),
                                          view_of(dout), block_mask, view_of(dq), view_of(dk), view_of(dv), options,
                                          ds ? &*ds : nullptr);
        },
        "device"_a, "bundle"_a, "q"_a, "k"_a, "v"_a, "o"_a, "lse"_a, "dout"_a, "lists"_a, "block_size"_a, "dq"_a,
        "dk"_a, "dv"_a, "dsinks"_a = nb::none(), "seq_lengths"_a = nb::none(), "rule_causal"_a = "",
        "rule_window"_a = nb::none(), "rule_mask"_a = nb::none(), "scale"_a = nb::none(), "causal"_a = nb::none(),
        "mask"_a = nb::none(), "window"_a = nb::none(), "sinks"_a = nb::none(), "softcap"_a = nb::none(),
        "alibi_slopes"_a = nb::none(), "score_mod_tensors"_a = std::vector<ViewSpec>(), "score_mod"_a = "",
        "layout"_a = "bhsd",
        "Test hook: mfa::block_sparse_attention_backward on views of caller memory (lists: the BlockMask's by name).");
}

}  // namespace mfa::bindings
