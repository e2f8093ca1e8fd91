#include "metal/pipeline_archive.h"

#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <system_error>

namespace mfa::metal {

namespace {

namespace fs = std::filesystem;

bool archive_switched_off() {
  const char* setting = std::getenv("MFA_NATIVE_METAL_ARCHIVE");
  return setting && std::string(setting) == "0";
}

// The cpu backend's cache variable moves every cache; else the macOS user cache directory.
fs::path cache_directory() {
  if (const char* dir = std::getenv("MFA_NATIVE_CACHE_DIR"); dir && *dir) return fs::path(dir) / "metal";
  NSURL* caches = [NSFileManager.defaultManager URLsForDirectory:NSCachesDirectory
                                                       inDomains:NSUserDomainMask].firstObject;
  if (!caches) return {};
  return fs::path(to_std_string(caches.path)) / "mfa_native" / "metal";
}

// One archive per GPU and OS release: GPU binaries are valid for exactly those.
std::string archive_file_name(id<MTLDevice> device, const MacosVersion& macos) {
  std::string name = "pipelines-" + to_std_string(device.name) + "-macos" + macos.text() + ".metalar";
  for (char& c : name)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-') c = '_';
  return name;
}

NSURL* file_url(const fs::path& path) { return [NSURL fileURLWithPath:to_ns_string(path.string())]; }

MFA_METAL_AVAILABILITY id<MTLBinaryArchive> load_archive(id<MTLDevice> device, NSURL* url) {
  MTLBinaryArchiveDescriptor* descriptor = [MTLBinaryArchiveDescriptor new];
  descriptor.url = url;
  NSError* error = nil;
  return [device newBinaryArchiveWithDescriptor:descriptor error:&error];
}

}  // namespace

std::unique_ptr<PipelineArchive> PipelineArchive::open(id<MTLDevice> device, const MacosVersion& macos) {
  if (archive_switched_off()) return nullptr;
  const fs::path directory = cache_directory();
  if (directory.empty()) return nullptr;
  std::error_code failed;
  fs::create_directories(directory, failed);
  if (failed) return nullptr;
  const fs::path path = directory / archive_file_name(device, macos);

  id<MTLBinaryArchive> archive = nil;
  if (fs::exists(path, failed)) {
    archive = load_archive(device, file_url(path));
    if (!archive) fs::remove(path, failed);  // corrupt or from another Metal: rebuild it
  }
  if (!archive) archive = load_archive(device, nil);  // a new, empty archive
  if (!archive) return nullptr;
  return std::unique_ptr<PipelineArchive>(new PipelineArchive(device, archive, path.string()));
}

id<MTLComputePipelineState> PipelineArchive::find(MTLComputePipelineDescriptor* descriptor,
                                                  MTLPipelineOption options,
                                                  MTLAutoreleasedComputePipelineReflection* reflection) {
  std::lock_guard<std::mutex> lock(mutex_);
  descriptor.binaryArchives = @[ archive_ ];
  NSError* miss = nil;
  return [device_ newComputePipelineStateWithDescriptor:descriptor
                                                options:options | MTLPipelineOptionFailOnBinaryArchiveMiss
                                             reflection:reflection
                                                  error:&miss];
}

void PipelineArchive::add(MTLComputePipelineDescriptor* descriptor) {
  std::lock_guard<std::mutex> lock(mutex_);
  NSError* error = nil;
  if (![archive_ addComputePipelineFunctionsWithDescriptor:descriptor error:&error]) return;
  // Write a private file and rename it into place, so another process never
  // reads a half-written archive.
  const std::string temporary = path_ + ".tmp" + std::to_string(::getpid());
  std::error_code failed;
  if ([archive_ serializeToURL:file_url(temporary) error:&error]) fs::rename(temporary, path_, failed);
  if (fs::exists(temporary, failed)) fs::remove(temporary, failed);  // what a failed write or rename left
}

}  // namespace mfa::metal
