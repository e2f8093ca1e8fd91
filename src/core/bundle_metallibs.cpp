// A bundle's compiled Metal libraries (`bundle --metallib`, python/mfa_native/
// bundle/metallib.py): the payload's "metallibs" maps the sha256 of a kernel
// source to its library in base64. Each is decoded once, at load, and shared
// by every kernel of that source.
#include <map>
#include <memory>
#include <set>

#include "base64.hpp"
#include "bundle.hpp"
#include "sha256.hpp"

namespace mfa {

namespace {

using Binary = std::shared_ptr<const std::vector<unsigned char>>;

std::map<std::string, Binary> decoded(const json::Value& metallibs) {
  std::map<std::string, Binary> libraries;
  for (const auto& [key, value] : metallibs.as_object("metallibs")) {
    std::optional<std::vector<unsigned char>> bytes = base64_decode(value.as_string("metallibs"));
    if (!bytes) throw BundleError("bundle metallibs: the library of source " + key + " is not valid base64");
    if (bytes->empty()) throw BundleError("bundle metallibs: the library of source " + key + " is empty");
    libraries[key] = std::make_shared<const std::vector<unsigned char>>(std::move(*bytes));
  }
  return libraries;
}

// sha256 of every kernel source the payload holds, in entries of every op
// (those this reader skips too), as metallib.py keys them.
std::set<std::string> source_keys(const json::Value& payload) {
  std::set<std::string> keys;
  for (const json::Value& record : payload.at("entries").as_array("entries"))
    for (const char* direction : {"forward", "backward"})
      if (const json::Value* templates = record.find(direction))
        for (const json::Value& t : templates->as_array(direction))
          for (const json::Value& kernel : t.at("kernels").as_array("kernels"))
            keys.insert(sha256_hex(kernel.at("source").as_string("source")));
  return keys;
}

}  // namespace

void attach_metallibs(std::vector<BundleEntry>& entries, const json::Value& payload) {
  const json::Value* metallibs = payload.find("metallibs");
  if (!metallibs) return;
  const std::map<std::string, Binary> libraries = decoded(*metallibs);
  if (libraries.empty()) return;
  const std::set<std::string> sources = source_keys(payload);
  for (const auto& [key, library] : libraries)
    if (!sources.count(key))
      throw BundleError("bundle metallibs: key '" + key + "' is the sha256 of no kernel source in the bundle");
  for (BundleEntry& entry : entries)
    for (std::vector<PassTemplate>* templates : {&entry.forward, &entry.backward})
      for (PassTemplate& t : *templates)
        for (KernelTemplate& kernel : t.kernels)
          if (auto found = libraries.find(sha256_hex(kernel.source)); found != libraries.end())
            kernel.binary = found->second;
}

}  // namespace mfa
