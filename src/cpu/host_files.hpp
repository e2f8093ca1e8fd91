// What the kernel compiler asks of the host: running a program and writing
// cache files that readers in other processes see whole or not at all.
#pragma once

#include <string>
#include <vector>

namespace mfa::cpu {

struct ProcessResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs argv[0] (a path) with stdin from /dev/null.
ProcessResult run_process(const std::vector<std::string>& argv);

// ".tmp-<pid>-<thread>-<n>": unique per process, thread and call, so temporary names never collide.
std::string unique_suffix();

bool read_file(const std::string& path, std::string& text);
void write_file(const std::string& path, const std::string& text);
// Written under a temporary name, then renamed to `path`.
void write_atomically(const std::string& path, const std::string& text);

// A file that is removed when it goes out of scope, unless committed.
class TemporaryFile {
 public:
  explicit TemporaryFile(std::string path) : path_(std::move(path)) {}
  ~TemporaryFile();
  TemporaryFile(const TemporaryFile&) = delete;
  TemporaryFile& operator=(const TemporaryFile&) = delete;
  const std::string& path() const { return path_; }
  // Renames it to `target` (atomic within a file system) and keeps it.
  void commit(const std::string& target);

 private:
  std::string path_;
};

}  // namespace mfa::cpu
