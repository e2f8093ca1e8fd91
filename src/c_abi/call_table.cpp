// The C ABI's op tables: one row per argument, Python's names and values.
#include "call_table.hpp"

#include <algorithm>

#include "mfa/errors.hpp"
#ifdef MFA_HAVE_METAL
#include "mfa/metal.hpp"
#endif

namespace mfa::c_abi {

namespace {

std::string quoted(const std::string& text) { return "'" + text + "'"; }

// Option rows' conversions: Python's values (ops/arguments.py) and messages.
void scale(const Value& value, AttentionOptions& o) { o.scale = std::get<double>(value); }

void causal(const Value& value, AttentionOptions& o) {
  if (const bool* b = std::get_if<bool>(&value)) {
    o.causal = *b ? Causal::lower_right : Causal::none;
    return;
  }
  const std::string& text = std::get<std::string>(value);
  if (text == "none") o.causal = Causal::none;
  else if (text == "lower_right") o.causal = Causal::lower_right;
  else if (text == "upper_left") o.causal = Causal::upper_left;
  else
    throw ArgumentError("causal must be False, True, 'lower_right' or 'upper_left' (or 'none'), got " + quoted(text));
}

void window(const Value& value, AttentionOptions& o) {
  o.window = std::get<std::pair<std::int64_t, std::int64_t>>(value);
}
void mask(const Value& value, AttentionOptions& o) { o.mask = std::get<TensorView>(value); }
void sinks(const Value& value, AttentionOptions& o) { o.sinks = std::get<TensorView>(value); }

void layout(const Value& value, AttentionOptions& o) {
  const std::string& text = std::get<std::string>(value);
  if (text == "bhsd") o.layout = Layout::bhsd;
  else if (text == "bshd") o.layout = Layout::bshd;
  else throw ArgumentError("layout must be 'bhsd' or 'bshd', got " + quoted(text));
}

void softcap(const Value& value, AttentionOptions& o) { o.softcap = std::get<double>(value); }
void alibi_slopes(const Value& value, AttentionOptions& o) { o.alibi_slopes = std::get<TensorView>(value); }
void score_mod(const Value& value, AttentionOptions& o) { o.score_mod = std::get<std::string>(value); }
void score_mod_tensors(const Value& value, AttentionOptions& o) {
  o.score_mod_tensors = std::get<std::vector<TensorView>>(value);
}

// ops/arguments.deterministic_mode: False and True are run_to_run.
void deterministic(const Value& value, AttentionOptions& o) {
  if (std::get_if<bool>(&value)) {
    o.deterministic = Deterministic::run_to_run;
    return;
  }
  const std::string& text = std::get<std::string>(value);
  if (text == "run_to_run") o.deterministic = Deterministic::run_to_run;
  else if (text == "batch_invariant") o.deterministic = Deterministic::batch_invariant;
  else
    throw ArgumentError("deterministic must be False, True, 'run_to_run' or 'batch_invariant', got " + quoted(text));
}

constexpr unsigned kTensor = bit(Kind::tensor);

// The options attention and attention_backward share (Python's ops/attention.py).
const std::vector<Param> kAttentionOptions = {
    {"scale", bit(Kind::real), false, scale},
    {"causal", bit(Kind::text) | bit(Kind::boolean), false, causal},
    {"window", bit(Kind::int_pair), false, window},
    {"mask", kTensor, false, mask},
    {"sinks", kTensor, false, sinks},
    {"layout", bit(Kind::text), false, layout},
    {"softcap", bit(Kind::real), false, softcap},
    {"alibi_slopes", kTensor, false, alibi_slopes},
    {"score_mod", bit(Kind::text), false, score_mod},
    {"score_mod_tensors", bit(Kind::tensors), false, score_mod_tensors},
};

// The rows of attention's options named `names`.
std::vector<Param> attention_options(const std::vector<std::string>& names) {
  std::vector<Param> rows;
  for (const Param& p : kAttentionOptions)
    if (std::find(names.begin(), names.end(), p.name) != names.end()) rows.push_back(p);
  return rows;
}

// attention_with_kvcache's: attention's but the mask and the layout (bshd).
const std::vector<Param> kKVCacheOptions = attention_options(
    {"scale", "causal", "window", "sinks", "softcap", "alibi_slopes", "score_mod", "score_mod_tensors"});
// sparse_attention's: attention's but causal, the window and the mask.
const std::vector<Param> kSparseOptions =
    attention_options({"scale", "sinks", "layout", "softcap", "alibi_slopes", "score_mod", "score_mod_tensors"});

// int8_attention's: attention's but score_mod (its quantization choices are rows of its own).
const std::vector<Param> kInt8Options =
    attention_options({"scale", "causal", "window", "mask", "sinks", "layout", "softcap", "alibi_slopes"});

// A forward's options: `options` and deterministic (Python's forwards take it, their backwards do not).
std::vector<Param> forward_options(std::vector<Param> options) {
  options.push_back({"deterministic", bit(Kind::text) | bit(Kind::boolean), false, deterministic});
  return options;
}

std::vector<Param> with_options(std::vector<Param> arrays, const std::vector<Param>& options = kAttentionOptions) {
  arrays.insert(arrays.end(), options.begin(), options.end());
  return arrays;
}

void run_attention(const Device& device, const Bundle& bundle, const Given& g) {
  attention(device, bundle, g.tensor("q"), g.tensor("k"), g.tensor("v"), g.tensor("out"), g.options(),
            g.optional_tensor("lse"));
}

void run_attention_backward(const Device& device, const Bundle& bundle, const Given& g) {
  attention_backward(device, bundle, g.tensor("q"), g.tensor("k"), g.tensor("v"), g.tensor("o"), g.tensor("lse"),
                     g.tensor("do"), g.tensor("dq"), g.tensor("dk"), g.tensor("dv"), g.options(),
                     g.optional_tensor("dsinks"));
}

// int8_attention's options: attention's it takes, and its quantization choices.
Int8AttentionOptions int8_options(const Given& g) {
  const AttentionOptions a = g.options();
  Int8AttentionOptions o;
  o.scale = a.scale, o.causal = a.causal, o.window = a.window, o.mask = a.mask, o.sinks = a.sinks;
  o.layout = a.layout, o.softcap = a.softcap, o.alibi_slopes = a.alibi_slopes;
  o.qk_scale = g.value("qk_scale", o.qk_scale), o.smooth_k = g.value("smooth_k", o.smooth_k);
  o.pv = g.value("pv", o.pv);
  return o;
}

// quantize's outputs: the data, and an affine format's scales and biases.
QuantizeOutputs quantize_outputs(const Given& g) {
  QuantizeOutputs out{g.tensor("data"), {}, {}};
  if (const TensorView* scales = g.optional_tensor("scales")) out.scales = *scales;
  if (const TensorView* biases = g.optional_tensor("biases")) out.biases = *biases;
  return out;
}

void run_int8_attention(const Device& device, const Bundle& bundle, const Given& g) {
  int8_attention(device, bundle, g.tensor("q"), g.tensor("k"), g.tensor("v"), g.tensor("out"), int8_options(g),
                 g.optional_tensor("lse"));
}

void run_merge_attention(const Device& device, const Bundle& bundle, const Given& g) {
  merge_attention(device, bundle, g.tensors("outputs"), g.tensors("lses"), g.tensor("out"), g.tensor("lse"),
                  g.options().layout);
}

void run_quantize(const Device& device, const Bundle& bundle, const Given& g) {
  quantize(device, bundle, g.tensor("x"), quantize_outputs(g), g.value<std::string>("format", "affine"),
           g.integer("bits"), g.integer("group_size"));
}

#ifdef MFA_HAVE_METAL
std::shared_future<void> encode_int8_attention(const Device& device, const Bundle& bundle, const Given& g,
                                               void* command_buffer) {
  return metal::int8_attention(device, bundle, g.tensor("q"), g.tensor("k"), g.tensor("v"), g.tensor("out"),
                               int8_options(g), g.optional_tensor("lse"), command_buffer);
}

std::shared_future<void> encode_merge_attention(const Device& device, const Bundle& bundle, const Given& g,
                                                void* command_buffer) {
  return metal::merge_attention(device, bundle, g.tensors("outputs"), g.tensors("lses"), g.tensor("out"),
                                g.tensor("lse"), g.options().layout, command_buffer);
}

std::shared_future<void> encode_quantize(const Device& device, const Bundle& bundle, const Given& g,
                                         void* command_buffer) {
  return metal::quantize(device, bundle, g.tensor("x"), quantize_outputs(g), g.value<std::string>("format", "affine"),
                         g.integer("bits"), g.integer("group_size"), command_buffer);
}
#else
constexpr std::nullptr_t encode_int8_attention = nullptr, encode_merge_attention = nullptr, encode_quantize = nullptr;
#endif

// The call's KV-cache arguments: its tensors by name and attention's options it takes.
KVCacheOptions kvcache_options(const Given& g) {
  const AttentionOptions a = g.options();
  KVCacheOptions o;
  o.cache_seqlens = g.optional_tensor("cache_seqlens");
  o.k = g.optional_tensor("k"), o.v = g.optional_tensor("v");
  o.block_table = g.optional_tensor("block_table");
  o.rotary_cos = g.optional_tensor("rotary_cos"), o.rotary_sin = g.optional_tensor("rotary_sin");
  o.rotary_seqlens = g.optional_tensor("rotary_seqlens");
  o.rotary_interleaved = g.value("rotary_interleaved", true);
  o.q_descale = g.optional_tensor("q_descale"), o.k_descale = g.optional_tensor("k_descale");
  o.v_descale = g.optional_tensor("v_descale");
  o.scale = a.scale, o.causal = a.causal, o.window = a.window, o.sinks = a.sinks, o.softcap = a.softcap;
  o.alibi_slopes = a.alibi_slopes, o.score_mod = a.score_mod, o.score_mod_tensors = a.score_mod_tensors;
  o.deterministic = a.deterministic;
  return o;
}

void run_attention_with_kvcache(const Device& device, const Bundle& bundle, const Given& g) {
  const TensorView& q = g.tensor("q");
  attention_with_kvcache(device, bundle, q, g.cache("k_cache", q.dtype), g.cache("v_cache", q.dtype),
                         g.tensor("out"), kvcache_options(g), g.optional_tensor("lse"));
}

// sparse_attention's options: attention's it takes, and topk_length.
SparseOptions sparse_options(const Given& g) {
  const AttentionOptions a = g.options();
  SparseOptions o;
  o.scale = a.scale, o.sinks = a.sinks, o.softcap = a.softcap, o.alibi_slopes = a.alibi_slopes;
  o.score_mod = a.score_mod, o.score_mod_tensors = a.score_mod_tensors, o.layout = a.layout;
  if (const TensorView* lengths = g.optional_tensor("topk_length")) o.topk_length = *lengths;
  return o;
}

// sparse_topk's: causal (True by default, as Python's), layout, precision.
SparseTopkOptions topk_options(const Given& g) {
  SparseTopkOptions o;
  o.causal = g.value("causal", true);
  o.layout = g.options().layout;
  o.precision = g.value<std::string>("precision", "float");
  return o;
}

void run_sparse_attention(const Device& device, const Bundle& bundle, const Given& g) {
  sparse_attention(device, bundle, g.tensor("q"), g.tensor("k"), g.tensor("v"), g.tensor("indices"), g.tensor("out"),
                   sparse_options(g), g.optional_tensor("lse"));
}

void run_sparse_attention_backward(const Device& device, const Bundle& bundle, const Given& g) {
  sparse_attention_backward(device, bundle, g.tensor("q"), g.tensor("k"), g.tensor("v"), g.tensor("indices"),
                            g.tensor("o"), g.tensor("lse"), g.tensor("do"), g.tensor("dq"), g.tensor("dk"),
                            g.tensor("dv"), sparse_options(g), g.optional_tensor("dsinks"));
}

void run_sparse_topk(const Device& device, const Bundle& bundle, const Given& g) {
  sparse_topk(device, bundle, g.tensor("q"), g.tensor("k"), g.tensor("weights"), g.value<std::int64_t>("topk", 0),
              g.tensor("indices"), topk_options(g), g.optional_tensor("topk_scores"));
}

// A BlockMask's rows (Python's names: the lists, block_size and seq_lengths, as its torch schema
// takes it apart), between v and the outputs as block_sparse_attention's block_mask.
const std::vector<Param> kBlockMask = {
    {"kv_num_blocks", kTensor, true, nullptr},       {"kv_indices", kTensor, true, nullptr},
    {"full_kv_num_blocks", kTensor, false, nullptr}, {"full_kv_indices", kTensor, false, nullptr},
    {"q_num_blocks", kTensor, false, nullptr},       {"q_indices", kTensor, false, nullptr},
    {"full_q_num_blocks", kTensor, false, nullptr},  {"full_q_indices", kTensor, false, nullptr},
    {"kv_bit_blocks", kTensor, false, nullptr},      {"kv_bits", kTensor, false, nullptr},
    {"block_size", bit(Kind::integer) | bit(Kind::int_pair), false, nullptr},
    {"seq_lengths", bit(Kind::int_pair), false, nullptr}};

// `arrays` with the block mask's rows after its first `at`.
std::vector<Param> with_block_mask(std::vector<Param> arrays, std::size_t at) {
  arrays.insert(arrays.begin() + std::ptrdiff_t(at), kBlockMask.begin(), kBlockMask.end());
  return arrays;
}

// The call's BlockMask: its lists by name, block_size (an int or a pair; default 128) and seq_lengths.
BlockMask block_mask(const Given& g) {
  using Pair = std::pair<std::int64_t, std::int64_t>;
  BlockMask mask(g.tensor("kv_num_blocks"), g.tensor("kv_indices"));
  const auto list = [&](const char* name) {
    const TensorView* view = g.optional_tensor(name);
    return view ? std::optional<TensorView>(*view) : std::nullopt;
  };
  mask.full_kv_num_blocks = list("full_kv_num_blocks"), mask.full_kv_indices = list("full_kv_indices");
  mask.q_num_blocks = list("q_num_blocks"), mask.q_indices = list("q_indices");
  mask.full_q_num_blocks = list("full_q_num_blocks"), mask.full_q_indices = list("full_q_indices");
  mask.kv_bit_blocks = list("kv_bit_blocks"), mask.kv_bits = list("kv_bits");
  if (const Value* size = g.find("block_size")) {
    const std::int64_t* square = std::get_if<std::int64_t>(size);
    mask.block_size = square ? Pair(*square, *square) : std::get<Pair>(*size);
  }
  if (const Value* lengths = g.find("seq_lengths")) mask.seq_lengths = std::get<Pair>(*lengths);
  return mask;
}

// block_sparse_attention's options: attention's, causal only when given (else the mask's rule).
BlockSparseOptions block_sparse_options(const Given& g) {
  const AttentionOptions a = g.options();
  BlockSparseOptions o;
  o.scale = a.scale, o.mask = a.mask, o.window = a.window, o.sinks = a.sinks, o.softcap = a.softcap;
  o.alibi_slopes = a.alibi_slopes, o.score_mod = a.score_mod, o.score_mod_tensors = a.score_mod_tensors;
  o.layout = a.layout;
  if (g.find("causal")) o.causal = a.causal;
  return o;
}

void run_block_sparse_attention(const Device& device, const Bundle& bundle, const Given& g) {
  block_sparse_attention(device, bundle, g.tensor("q"), g.tensor("k"), g.tensor("v"), block_mask(g), g.tensor("out"),
                         block_sparse_options(g), g.optional_tensor("lse"));
}

void run_block_sparse_attention_backward(const Device& device, const Bundle& bundle, const Given& g) {
  block_sparse_attention_backward(device, bundle, g.tensor("q"), g.tensor("k"), g.tensor("v"), g.tensor("o"),
                                  g.tensor("lse"), g.tensor("do"), block_mask(g), g.tensor("dq"), g.tensor("dk"),
                                  g.tensor("dv"), block_sparse_options(g), g.optional_tensor("dsinks"));
}

#ifdef MFA_HAVE_METAL
std::shared_future<void> encode_block_sparse_attention(const Device& device, const Bundle& bundle, const Given& g,
                                                       void* command_buffer) {
  return metal::block_sparse_attention(device, bundle, g.tensor("q"), g.tensor("k"), g.tensor("v"), block_mask(g),
                                       g.tensor("out"), block_sparse_options(g), g.optional_tensor("lse"),
                                       command_buffer);
}

std::shared_future<void> encode_block_sparse_attention_backward(const Device& device, const Bundle& bundle,
                                                                const Given& g, void* command_buffer) {
  return metal::block_sparse_attention_backward(device, bundle, g.tensor("q"), g.tensor("k"), g.tensor("v"),
                                                g.tensor("o"), g.tensor("lse"), g.tensor("do"), block_mask(g),
                                                g.tensor("dq"), g.tensor("dk"), g.tensor("dv"),
                                                block_sparse_options(g), g.optional_tensor("dsinks"), command_buffer);
}
#else
constexpr std::nullptr_t encode_block_sparse_attention = nullptr, encode_block_sparse_attention_backward = nullptr;
#endif

// attention_varlen's: attention's but the mask and the layout (bshd).
const std::vector<Param> kVarlenOptions = attention_options(
    {"scale", "causal", "window", "sinks", "softcap", "alibi_slopes", "score_mod", "score_mod_tensors"});

VarlenOptions varlen_options(const Given& g) {
  const AttentionOptions a = g.options();
  VarlenOptions o;
  o.max_seqlen_q = g.integer("max_seqlen_q"), o.max_seqlen_k = g.integer("max_seqlen_k");
  o.scale = a.scale, o.causal = a.causal, o.window = a.window, o.sinks = a.sinks, o.softcap = a.softcap;
  o.alibi_slopes = a.alibi_slopes, o.score_mod = a.score_mod, o.score_mod_tensors = a.score_mod_tensors;
  o.deterministic = a.deterministic;
  o.block_table = g.optional_tensor("block_table"), o.seqused_k = g.optional_tensor("seqused_k");
  return o;
}

void run_attention_varlen(const Device& device, const Bundle& bundle, const Given& g) {
  attention_varlen(device, bundle, g.tensor("q"), g.tensor("k"), g.tensor("v"), g.tensor("cu_seqlens_q"),
                   g.optional_tensor("cu_seqlens_k"), g.tensor("out"), varlen_options(g), g.optional_tensor("lse"));
}

void run_attention_varlen_backward(const Device& device, const Bundle& bundle, const Given& g) {
  attention_varlen_backward(device, bundle, g.tensor("q"), g.tensor("k"), g.tensor("v"), g.tensor("o"),
                            g.tensor("lse"), g.tensor("do"), g.tensor("cu_seqlens_q"), g.optional_tensor("cu_seqlens_k"),
                            g.tensor("dq"), g.tensor("dk"), g.tensor("dv"), varlen_options(g),
                            g.optional_tensor("dsinks"));
}

#ifdef MFA_HAVE_METAL
std::shared_future<void> encode_attention_varlen(const Device& device, const Bundle& bundle, const Given& g,
                                                 void* command_buffer) {
  return metal::attention_varlen(device, bundle, g.tensor("q"), g.tensor("k"), g.tensor("v"), g.tensor("cu_seqlens_q"),
                                 g.optional_tensor("cu_seqlens_k"), g.tensor("out"), varlen_options(g),
                                 g.optional_tensor("lse"), command_buffer);
}

std::shared_future<void> encode_attention_varlen_backward(const Device& device, const Bundle& bundle, const Given& g,
                                                          void* command_buffer) {
  return metal::attention_varlen_backward(device, bundle, g.tensor("q"), g.tensor("k"), g.tensor("v"), g.tensor("o"),
                                          g.tensor("lse"), g.tensor("do"), g.tensor("cu_seqlens_q"),
                                          g.optional_tensor("cu_seqlens_k"), g.tensor("dq"), g.tensor("dk"),
                                          g.tensor("dv"), varlen_options(g), g.optional_tensor("dsinks"),
                                          command_buffer);
}
#else
constexpr std::nullptr_t encode_attention_varlen = nullptr, encode_attention_varlen_backward = nullptr;
#endif

#ifdef MFA_HAVE_METAL
std::shared_future<void> encode_sparse_attention(const Device& device, const Bundle& bundle, const Given& g,
                                                 void* command_buffer) {
  return metal::sparse_attention(device, bundle, g.tensor("q"), g.tensor("k"), g.tensor("v"), g.tensor("indices"),
                                 g.tensor("out"), sparse_options(g), g.optional_tensor("lse"), command_buffer);
}

std::shared_future<void> encode_sparse_attention_backward(const Device& device, const Bundle& bundle, const Given& g,
                                                          void* command_buffer) {
  return metal::sparse_attention_backward(device, bundle, g.tensor("q"), g.tensor("k"), g.tensor("v"),
                                          g.tensor("indices"), g.tensor("o"), g.tensor("lse"), g.tensor("do"),
                                          g.tensor("dq"), g.tensor("dk"), g.tensor("dv"), sparse_options(g),
                                          g.optional_tensor("dsinks"), command_buffer);
}

std::shared_future<void> encode_sparse_topk(const Device& device, const Bundle& bundle, const Given& g,
                                            void* command_buffer) {
  return metal::sparse_topk(device, bundle, g.tensor("q"), g.tensor("k"), g.tensor("weights"), g.value<std::int64_t>("topk", 0),
                            g.tensor("indices"), topk_options(g), g.optional_tensor("topk_scores"), command_buffer);
}

std::shared_future<void> encode_attention_with_kvcache(const Device& device, const Bundle& bundle, const Given& g,
                                                       void* command_buffer) {
  const TensorView& q = g.tensor("q");
  return metal::attention_with_kvcache(device, bundle, q, g.cache("k_cache", q.dtype), g.cache("v_cache", q.dtype),
                                       g.tensor("out"), kvcache_options(g), g.optional_tensor("lse"), command_buffer);
}

std::shared_future<void> encode_attention(const Device& device, const Bundle& bundle, const Given& g,
                                          void* command_buffer) {
  return metal::attention(device, bundle, g.tensor("q"), g.tensor("k"), g.tensor("v"), g.tensor("out"), g.options(),
                          g.optional_tensor("lse"), command_buffer);
}

std::shared_future<void> encode_attention_backward(const Device& device, const Bundle& bundle, const Given& g,
                                                   void* command_buffer) {
  return metal::attention_backward(device, bundle, g.tensor("q"), g.tensor("k"), g.tensor("v"), g.tensor("o"),
                                   g.tensor("lse"), g.tensor("do"), g.tensor("dq"), g.tensor("dk"), g.tensor("dv"),
                                   g.options(), g.optional_tensor("dsinks"), command_buffer);
}
#else
constexpr std::nullptr_t encode_attention = nullptr, encode_attention_backward = nullptr,
                         encode_attention_with_kvcache = nullptr, encode_sparse_attention = nullptr,
                         encode_sparse_attention_backward = nullptr, encode_sparse_topk = nullptr;
#endif

const std::vector<Op>& ops() {
  static const std::vector<Op> table = {
      {"attention",
       with_options({{"q", kTensor, true, nullptr}, {"k", kTensor, true, nullptr}, {"v", kTensor, true, nullptr},
                     {"out", kTensor, true, nullptr}, {"lse", kTensor, false, nullptr}},
                    forward_options(kAttentionOptions)),
       run_attention, encode_attention},
      {"attention_backward",
       with_options({{"q", kTensor, true, nullptr}, {"k", kTensor, true, nullptr}, {"v", kTensor, true, nullptr},
                     {"o", kTensor, true, nullptr}, {"lse", kTensor, true, nullptr}, {"do", kTensor, true, nullptr},
                     {"dq", kTensor, true, nullptr}, {"dk", kTensor, true, nullptr}, {"dv", kTensor, true, nullptr},
                     {"dsinks", kTensor, false, nullptr}}),
       run_attention_backward, encode_attention_backward},
      {"attention_with_kvcache",
       with_options({{"q", kTensor, true, nullptr},
                     {"k_cache", kTensor | bit(Kind::quantized), true, nullptr},
                     {"v_cache", kTensor | bit(Kind::quantized), true, nullptr},
                     {"out", kTensor, true, nullptr}, {"lse", kTensor, false, nullptr},
                     {"cache_seqlens", kTensor, false, nullptr}, {"k", kTensor, false, nullptr},
                     {"v", kTensor, false, nullptr}, {"block_table", kTensor, false, nullptr},
                     {"rotary_cos", kTensor, false, nullptr}, {"rotary_sin", kTensor, false, nullptr},
                     {"rotary_seqlens", kTensor, false, nullptr},
                     {"rotary_interleaved", bit(Kind::boolean), false, nullptr},
                     {"q_descale", kTensor, false, nullptr}, {"k_descale", kTensor, false, nullptr},
                     {"v_descale", kTensor, false, nullptr}},
                    forward_options(kKVCacheOptions)),
       run_attention_with_kvcache, encode_attention_with_kvcache},
      {"sparse_attention",
       with_options({{"q", kTensor, true, nullptr}, {"k", kTensor, true, nullptr}, {"v", kTensor, true, nullptr},
                     {"indices", kTensor, true, nullptr}, {"out", kTensor, true, nullptr},
                     {"lse", kTensor, false, nullptr}, {"topk_length", kTensor, false, nullptr}},
                    kSparseOptions),
       run_sparse_attention, encode_sparse_attention},
      {"sparse_attention_backward",
       with_options({{"q", kTensor, true, nullptr}, {"k", kTensor, true, nullptr}, {"v", kTensor, true, nullptr},
                     {"indices", kTensor, true, nullptr}, {"o", kTensor, true, nullptr},
                     {"lse", kTensor, true, nullptr}, {"do", kTensor, true, nullptr}, {"dq", kTensor, true, nullptr},
                     {"dk", kTensor, true, nullptr}, {"dv", kTensor, true, nullptr},
                     {"dsinks", kTensor, false, nullptr}, {"topk_length", kTensor, false, nullptr}},
                    kSparseOptions),
       run_sparse_attention_backward, encode_sparse_attention_backward},
      {"sparse_topk",
       with_options({{"q", kTensor, true, nullptr}, {"k", kTensor, true, nullptr},
                     {"weights", kTensor, true, nullptr}, {"topk", bit(Kind::integer), true, nullptr},
                     {"indices", kTensor, true, nullptr}, {"topk_scores", kTensor, false, nullptr},
                     {"causal", bit(Kind::boolean), false, nullptr},
                     {"precision", bit(Kind::text), false, nullptr}},
                    attention_options({"layout"})),
       run_sparse_topk, encode_sparse_topk},
      {"block_sparse_attention",
       with_options(with_block_mask({{"q", kTensor, true, nullptr}, {"k", kTensor, true, nullptr},
                                     {"v", kTensor, true, nullptr}, {"out", kTensor, true, nullptr},
                                     {"lse", kTensor, false, nullptr}},
                                    3)),
       run_block_sparse_attention, encode_block_sparse_attention},
      {"block_sparse_attention_backward",
       with_options(with_block_mask({{"q", kTensor, true, nullptr}, {"k", kTensor, true, nullptr},
                                     {"v", kTensor, true, nullptr}, {"o", kTensor, true, nullptr},
                                     {"lse", kTensor, true, nullptr}, {"do", kTensor, true, nullptr},
                                     {"dq", kTensor, true, nullptr}, {"dk", kTensor, true, nullptr},
                                     {"dv", kTensor, true, nullptr}, {"dsinks", kTensor, false, nullptr}},
                                    6)),
       run_block_sparse_attention_backward, encode_block_sparse_attention_backward},
      {"int8_attention",
       with_options({{"q", kTensor, true, nullptr}, {"k", kTensor, true, nullptr}, {"v", kTensor, true, nullptr},
                     {"out", kTensor, true, nullptr}, {"lse", kTensor, false, nullptr},
                     {"qk_scale", bit(Kind::text), false, nullptr}, {"smooth_k", bit(Kind::boolean), false, nullptr},
                     {"pv", bit(Kind::text), false, nullptr}},
                    kInt8Options),
       run_int8_attention, encode_int8_attention},
      {"merge_attention",
       with_options({{"outputs", bit(Kind::tensors), true, nullptr}, {"lses", bit(Kind::tensors), true, nullptr},
                     {"out", kTensor, true, nullptr}, {"lse", kTensor, true, nullptr}},
                    attention_options({"layout"})),
       run_merge_attention, encode_merge_attention},
      {"quantize",
       {{"x", kTensor, true, nullptr}, {"data", kTensor, true, nullptr}, {"scales", kTensor, false, nullptr},
        {"biases", kTensor, false, nullptr}, {"format", bit(Kind::text), false, nullptr},
        {"bits", bit(Kind::integer), false, nullptr}, {"group_size", bit(Kind::integer), false, nullptr}},
       run_quantize, encode_quantize},
      {"attention_varlen",
       with_options({{"q", kTensor, true, nullptr}, {"k", kTensor, true, nullptr}, {"v", kTensor, true, nullptr},
                     {"cu_seqlens_q", kTensor, true, nullptr}, {"cu_seqlens_k", kTensor, false, nullptr},
                     {"out", kTensor, true, nullptr}, {"lse", kTensor, false, nullptr},
                     {"max_seqlen_q", bit(Kind::integer), false, nullptr},
                     {"max_seqlen_k", bit(Kind::integer), false, nullptr},
                     {"block_table", kTensor, false, nullptr}, {"seqused_k", kTensor, false, nullptr}},
                    forward_options(kVarlenOptions)),
       run_attention_varlen, encode_attention_varlen},
      {"attention_varlen_backward",
       with_options({{"q", kTensor, true, nullptr}, {"k", kTensor, true, nullptr}, {"v", kTensor, true, nullptr},
                     {"o", kTensor, true, nullptr}, {"lse", kTensor, true, nullptr}, {"do", kTensor, true, nullptr},
                     {"cu_seqlens_q", kTensor, true, nullptr}, {"cu_seqlens_k", kTensor, false, nullptr},
                     {"dq", kTensor, true, nullptr}, {"dk", kTensor, true, nullptr}, {"dv", kTensor, true, nullptr},
                     {"dsinks", kTensor, false, nullptr},
                     {"max_seqlen_q", bit(Kind::integer), false, nullptr},
                     {"max_seqlen_k", bit(Kind::integer), false, nullptr},
                     {"block_table", kTensor, false, nullptr}, {"seqused_k", kTensor, false, nullptr}},
                    kVarlenOptions),
       run_attention_varlen_backward, encode_attention_varlen_backward},
  };
  return table;
}

}  // namespace

const char* setter_name(Kind kind) {
  switch (kind) {
    case Kind::tensor: return "mfa_call_set_tensor";
    case Kind::tensors: return "mfa_call_set_tensors";
    case Kind::real: return "mfa_call_set_float";
    case Kind::integer: return "mfa_call_set_int";
    case Kind::boolean: return "mfa_call_set_bool";
    case Kind::text: return "mfa_call_set_string";
    case Kind::int_pair: return "mfa_call_set_int_pair";
    case Kind::quantized: return "mfa_call_set_quantized";
  }
  return "?";
}

const TensorView& Given::tensor(const std::string& name) const {
  const TensorView* view = optional_tensor(name);
  if (!view) throw TypeError(std::string(op_.name) + "() missing 1 required argument: " + quoted(name));
  return *view;
}

const TensorView* Given::optional_tensor(const std::string& name) const {
  auto it = values_.find(name);
  return it == values_.end() ? nullptr : std::get_if<TensorView>(&it->second);
}

KVCache Given::cache(const std::string& name, DType dtype) const {
  auto it = values_.find(name);
  if (it == values_.end()) throw TypeError(std::string(op_.name) + "() missing 1 required argument: " + quoted(name));
  if (const Quantized* q = std::get_if<Quantized>(&it->second))
    return QuantizedTensor{q->format, q->data, dtype, q->scales, q->biases, q->bits, q->group_size};
  return std::get<TensorView>(it->second);
}

AttentionOptions Given::options() const {
  AttentionOptions options;
  for (const Param& p : op_.params) {
    auto it = values_.find(p.name);
    if (p.option && it != values_.end()) p.option(it->second, options);
  }
  return options;
}

const Value* Given::find(const std::string& name) const {
  auto it = values_.find(name);
  return it == values_.end() ? nullptr : &it->second;
}

std::optional<std::int64_t> Given::integer(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return std::get<std::int64_t>(it->second);
}

const std::vector<TensorView>& Given::tensors(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) throw TypeError(std::string(op_.name) + "() missing 1 required argument: " + quoted(name));
  return std::get<std::vector<TensorView>>(it->second);
}

const Param* Op::param(const std::string& wanted) const {
  for (const Param& p : params)
    if (wanted == p.name) return &p;
  return nullptr;
}

const Op* find_op(const std::string& name) {
  for (const Op& op : ops())
    if (name == op.name) return &op;
  return nullptr;
}

std::string op_names() {
  std::string names;
  for (const Op& op : ops()) names += (names.empty() ? "" : ", ") + std::string(op.name);
  return names;
}

}  // namespace mfa::c_abi
