// Bundle files: the header (magic, version, length, sha256) checked before the
// JSON payload is parsed; every failure is a BundleError.
#include "bundle.hpp"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

#include "json.hpp"
#include "sha256.hpp"

namespace mfa {

namespace {

constexpr char kMagic[8] = {'M', 'F', 'A', 'B', 'N', 'D', 'L', '\0'};
constexpr std::size_t kHeaderBytes = 56;

std::uint64_t little_endian(const unsigned char* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

std::string hex(const unsigned char* p, std::size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (std::size_t i = 0; i < n; ++i) {
    out += digits[p[i] >> 4];
    out += digits[p[i] & 15];
  }
  return out;
}

constexpr const char* kKVCache = "attention_with_kvcache";
constexpr const char* kSparse = "sparse_attention";
constexpr const char* kTopk = "sparse_topk";
constexpr const char* kInt8 = "int8_attention";
constexpr const char* kMerge = "merge_attention";
constexpr const char* kQuantize = "quantize";
constexpr const char* kVarlen = "attention_varlen";  // attention's facts (layout bshd, no mask)
constexpr const char* kBlockSparse = "block_sparse_attention";  // attention's facts and its block mask's

// The ops this reader runs (a later writer may add others: their entries are skipped).
bool known_op(const std::string& op) {
  for (const char* known : {"attention", kKVCache, kSparse, kTopk, kInt8, kMerge, kQuantize, kVarlen, kBlockSparse})
    if (op == known) return true;
  return false;
}

// An entry's "deterministic" fact ("run_to_run" when a bundle written before it has none).
bool batch_invariant_of(const json::Value& f) {
  const json::Value* mode = f.find("deterministic");
  const std::string text = mode ? mode->as_string("deterministic") : "run_to_run";
  if (text != "run_to_run" && text != "batch_invariant")
    throw json::JsonError("an entry's deterministic must be run_to_run or batch_invariant, got '" + text + "'");
  return text == "batch_invariant";
}

BundleFacts facts_of(const std::string& op, const json::Value& f) {
  BundleFacts facts;
  if (op == kMerge) {  // spec.py's EntryFacts.to_json: a merge's own facts only
    facts.op = op;
    facts.dtype = f.at("dtype").as_string("dtype");
    facts.value_dim = f.at("value_dim").as_int("value_dim");
    facts.parts = f.at("parts").as_int("parts");
    facts.layout = f.at("layout").as_string("layout");
    return facts;
  }
  if (op == kQuantize) {  // x's dtype and the format
    facts.op = op;
    facts.dtype = f.at("dtype").as_string("dtype");
    facts.format = f.at("format").as_string("format");
    facts.bits = f.at("bits").as_int("bits");
    facts.group_size = f.at("group_size").as_int("group_size");
    return facts;
  }
  facts.dtype = f.at("dtype").as_string("dtype");
  facts.head_dim = f.at("head_dim").as_int("head_dim");
  facts.value_dim = f.at("value_dim").as_int("value_dim");
  facts.gqa_ratio = f.at("gqa_ratio").as_int("gqa_ratio");
  facts.causal = f.at("causal").as_string("causal");
  facts.mask = f.at("mask").as_string("mask");
  const json::Value& mask_dtype = f.at("mask_dtype");
  if (!mask_dtype.is_null()) facts.mask_dtype = mask_dtype.as_string("mask_dtype");
  facts.window = f.at("window").as_bool("window");
  facts.sinks = f.at("sinks").as_bool("sinks");
  facts.layout = f.at("layout").as_string("layout");
  const json::Value& softcap = f.at("softcap");
  if (!softcap.is_null()) facts.softcap = softcap.as_double("softcap");
  facts.alibi = f.at("alibi").as_string("alibi");
  const json::Value& score_mod = f.at("score_mod");
  if (!score_mod.is_null()) {
    facts.score_mod = score_mod.at("text").as_string("score_mod text");
    for (const json::Value& t : score_mod.at("tensors").as_array("score_mod tensors")) {
      attention_problem::ScoreModTensor tensor{t.at("dtype").as_string("score_mod tensor dtype"), {}};
      for (const json::Value& n : t.at("shape").as_array("score_mod tensor shape"))
        tensor.shape.push_back(n.as_int("score_mod tensor shape"));
      facts.score_mod_tensors.push_back(std::move(tensor));
    }
  }
  facts.family = f.at("family").as_string("family");
  facts.backward = f.at("backward").as_bool("backward");
  facts.op = op;
  if (op == "attention" || op == kKVCache || op == kVarlen) facts.batch_invariant = batch_invariant_of(f);
  if (op == kVarlen) facts.seqused_k = f.at("seqused_k").as_bool("seqused_k");
  if (op == kKVCache || op == kVarlen) {
    const json::Value& page_size = f.at("page_size");
    if (!page_size.is_null()) facts.page_size = page_size.as_int("page_size");
  }
  if (op == kKVCache) {
    facts.cache = facts.v_cache = f.at("cache").as_string("cache");
    // v_cache, bits and group_size: written since affine and float8 caches (absent: v's storage is k's)
    if (const json::Value* v_cache = f.find("v_cache")) facts.v_cache = v_cache->as_string("v_cache");
    if (const json::Value* bits = f.find("bits")) facts.bits = bits->as_int("bits");
    if (const json::Value* group_size = f.find("group_size")) facts.group_size = group_size->as_int("group_size");
    facts.append = f.at("append").as_bool("append");
    if (const json::Value& rotary = f.at("rotary"); !rotary.is_null()) {
      facts.rotary_dim = rotary.at("dim").as_int("rotary dim");
      facts.rotary_interleaved = rotary.at("interleaved").as_bool("rotary interleaved");
      facts.rotary_starts = rotary.at("starts").as_string("rotary starts");
    }
  }
  if (op == kSparse) {
    facts.topk_length = f.at("topk_length").as_bool("topk_length");
    facts.shared_latent = f.at("shared_latent").as_bool("shared_latent");
  }
  if (op == kTopk) facts.precision = f.at("precision").as_string("precision");
  if (op == kBlockSparse) {
    const std::vector<json::Value>& size = f.at("block_size").as_array("block_size");
    if (size.size() != 2) throw BundleError("a block_sparse_attention entry's block_size is not a pair");
    facts.q_block = size[0].as_int("block_size"), facts.k_block = size[1].as_int("block_size");
    facts.shared_batch = f.at("shared_batch").as_bool("shared_batch");
    facts.shared_heads = f.at("shared_heads").as_bool("shared_heads");
    facts.full_blocks = f.at("full_blocks").as_bool("full_blocks");
    facts.mask_bits = f.at("mask_bits").as_bool("mask_bits");
    facts.q_lists = f.at("q_lists").as_bool("q_lists");
  }
  if (op == kInt8) {
    facts.qk_scale = f.at("qk_scale").as_string("qk_scale");
    facts.smooth_k = f.at("smooth_k").as_bool("smooth_k");
    facts.pv = f.at("pv").as_string("pv");
  }
  return facts;
}

const char* yes(bool flag) { return flag ? "yes" : "no"; }

std::vector<PassTemplate> templates_of(const json::Value& list, const char* what) {
  std::vector<PassTemplate> out;
  for (const json::Value& t : list.as_array(what)) out.push_back(PassTemplate::from_json(t));
  return out;
}

std::shared_ptr<const Bundle::Contents> parse_payload(std::string_view text) {
  const json::Value payload = json::parse(text);
  if (payload.at("format").as_string("format") != "mfa_native.bundle")
    throw BundleError("not an mfa_native bundle payload");
  const std::int64_t schema = payload.at("template_schema").as_int("template_schema");
  if (schema != kTemplateSchema)
    throw BundleError("bundle templates are schema " + std::to_string(schema) + "; this build reads " +
                      std::to_string(kTemplateSchema));
  auto contents = std::make_shared<Bundle::Contents>();
  for (const auto& [op, declaration] : payload.at("declarations").as_object("declarations"))
    contents->declarations.emplace(op, Declaration::from_json(declaration));
  for (const json::Value& record : payload.at("entries").as_array("entries")) {
    const std::string op = record.at("op").as_string("op");
    if (!known_op(op)) continue;  // ops a later writer may add
    BundleEntry entry;
    entry.facts = facts_of(op, record.at("facts"));
    entry.forward = templates_of(record.at("forward"), "forward");
    entry.backward = templates_of(record.at("backward"), "backward");
    if (entry.forward.empty()) throw BundleError("a bundle entry has no forward template");
    entry.line = entry_line(entry.facts, entry.forward.size(), entry.backward.size());
    contents->entries.push_back(std::move(entry));
  }
  attach_metallibs(contents->entries, payload);
  return contents;
}

}  // namespace

const Declaration& Bundle::Contents::declaration(const std::string& op) const {
  auto it = declarations.find(op);
  if (it == declarations.end()) throw BundleError("the bundle carries no declaration of " + op);
  return it->second;
}

std::string entry_line(const BundleFacts& f, std::size_t forward, std::size_t backward) {
  if (f.op == kTopk)  // writer.py's entry_line
    return f.op + " " + f.dtype + " Di=" + std::to_string(f.head_dim) + " causal=" +
           yes(f.causal != "none") + " layout=" + f.layout + " precision=" + f.precision +
           " family=" + f.family + " templates=" + std::to_string(forward) + "+" + std::to_string(backward);
  if (f.op == kQuantize)
    return f.op + " " + f.dtype + " format=" + f.format + " bits=" + std::to_string(f.bits) +
           " group_size=" + std::to_string(f.group_size) + " templates=" + std::to_string(forward) + "+" +
           std::to_string(backward);
  if (f.op == kMerge)
    return f.op + " " + f.dtype + " Dv=" + std::to_string(f.value_dim) + " parts=" + std::to_string(f.parts) +
           " layout=" + f.layout + " templates=" + std::to_string(forward) + "+" + std::to_string(backward);
  const std::string window = yes(f.window);
  const std::string mask = f.mask == "additive" ? "additive:" + f.mask_dtype : f.mask;
  std::string scores;  // writer.py's scores_text
  if (f.softcap) {
    char text[32];
    std::snprintf(text, sizeof text, "%.9g", *f.softcap);
    scores += std::string(" softcap=") + text;
  }
  if (f.alibi != "none") scores += " alibi=" + f.alibi;
  if (!f.score_mod.empty()) scores += " score_mod=" + sha256_hex(f.score_mod).substr(0, 12);
  std::string cache;  // writer.py's entry_line
  if (f.op == kSparse)
    cache = std::string(" topk_length=") + yes(f.topk_length) +
            " shared_latent=" + yes(f.shared_latent);
  if (f.op == kBlockSparse)
    cache = " block_size=" + std::to_string(f.q_block) + "x" + std::to_string(f.k_block) +
            " shared_batch=" + yes(f.shared_batch) + " shared_heads=" + yes(f.shared_heads) +
            " full_blocks=" + yes(f.full_blocks) + " mask_bits=" + yes(f.mask_bits) + " q_lists=" + yes(f.q_lists);
  if (f.op == kVarlen)
    cache = " page_size=" + (f.page_size ? std::to_string(f.page_size) : std::string("none")) + " seqused_k=" +
            yes(f.seqused_k);
  if (f.op == kKVCache)
    cache = " page_size=" + (f.page_size ? std::to_string(f.page_size) : std::string("none")) + " cache=" + f.cache +
            (f.v_cache == f.cache ? "" : "," + f.v_cache) +
            (f.bits ? " bits=" + std::to_string(f.bits) + " group_size=" + std::to_string(f.group_size) : "") +
            " append=" + yes(f.append);
  if (f.rotary_dim)
    cache += " rotary_dim=" + std::to_string(f.rotary_dim) + " rotary_interleaved=" +
             yes(f.rotary_interleaved) + " rotary_starts=" + f.rotary_starts;
  if (f.op == kInt8)
    cache = " qk_scale=" + f.qk_scale + " smooth_k=" + yes(f.smooth_k) + " pv=" + f.pv;
  return f.op + " " + f.dtype + " D=" + std::to_string(f.head_dim) + " Dv=" + std::to_string(f.value_dim) +
         " gqa=" + std::to_string(f.gqa_ratio) + " causal=" + f.causal + " mask=" + mask + " window=" + window +
         " sinks=" + yes(f.sinks) + " layout=" + f.layout + scores + cache +
         (f.batch_invariant ? " deterministic=batch_invariant" : "") + " family=" + f.family +
         " templates=" + std::to_string(forward) + "+" + std::to_string(backward);
}

Bundle Bundle::from_memory(const void* data, std::size_t size) {
  if (!data && size) throw BundleError("bundle data is null");
  const auto* bytes = static_cast<const unsigned char*>(data);
  if (size < kHeaderBytes)
    throw BundleError("not a bundle: " + std::to_string(size) + " bytes, shorter than the " +
                      std::to_string(kHeaderBytes) + "-byte header");
  if (std::memcmp(bytes, kMagic, sizeof kMagic) != 0)
    throw BundleError("not a bundle: the data does not start with the bundle magic");
  const std::uint64_t version = little_endian(bytes + 8, 4);
  if (version > kBundleFormatVersion)
    throw BundleError("bundle format version " + std::to_string(version) + " is newer than this reader's (" +
                      std::to_string(kBundleFormatVersion) + ")");
  if (version < kBundleFormatVersion)
    throw BundleError("bundle format version " + std::to_string(version) +
                      " was written by an earlier mfa_native; this reader reads version " +
                      std::to_string(kBundleFormatVersion) + ": write the bundle again with `python -m mfa_native bundle`");
  const std::uint64_t length = little_endian(bytes + 16, 8);
  if (length != size - kHeaderBytes)
    throw BundleError("bundle truncated or padded: the header says " + std::to_string(length) +
                      " payload bytes, the data has " + std::to_string(size - kHeaderBytes));
  const std::string_view payload(reinterpret_cast<const char*>(bytes + kHeaderBytes), size - kHeaderBytes);
  if (sha256_hex(payload) != hex(bytes + 24, 32))
    throw BundleError("bundle damaged: the payload's sha256 does not match the header's");
  try {
    return Bundle(parse_payload(payload));
  } catch (const BundleError&) {
    throw;
  } catch (const std::exception& error) {  // JsonError, ArgumentError from a template, ...
    throw BundleError(std::string("bundle payload unreadable: ") + error.what());
  }
}

Bundle Bundle::load(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw BundleError("cannot open bundle '" + path + "'");
  const std::string data((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (file.bad()) throw BundleError("cannot read bundle '" + path + "'");
  try {
    return from_memory(data.data(), data.size());
  } catch (const BundleError& error) {
    throw BundleError(path + ": " + error.what());
  }
}

std::vector<std::string> Bundle::entries() const {
  std::vector<std::string> lines;
  for (const BundleEntry& entry : contents_->entries) lines.push_back(entry.line);
  return lines;
}

}  // namespace mfa
