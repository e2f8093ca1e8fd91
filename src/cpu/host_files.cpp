#include "host_files.hpp"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>

#include "mfa/errors.hpp"

extern char** environ;

namespace mfa::cpu {

namespace fs = std::filesystem;

ProcessResult run_process(const std::vector<std::string>& argv) {
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) throw Error(std::string("pipe: ") + std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], 1);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], 2);
  std::vector<char*> args;
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  int spawn_error = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(pipe_fds[1]);
  ProcessResult result;
  if (spawn_error != 0) {
    close(pipe_fds[0]);
    result.output = "cannot run " + argv[0] + ": " + std::strerror(spawn_error);
    return result;
  }
  char chunk[4096];
  while (true) {
    ssize_t n = read(pipe_fds[0], chunk, sizeof chunk);
    if (n > 0) result.output.append(chunk, std::size_t(n));
    if (n == 0 || (n < 0 && errno != EINTR)) break;
  }
  close(pipe_fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

std::string unique_suffix() {
  static std::atomic<std::uint64_t> counter{0};
  std::ostringstream suffix;
  suffix << ".tmp-" << getpid() << "-" << std::hash<std::thread::id>()(std::this_thread::get_id()) << "-"
         << counter++;
  return suffix.str();
}

bool read_file(const std::string& path, std::string& text) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream buffer;
  buffer << in.rdbuf();
  text = buffer.str();
  return !in.bad();
}

TemporaryFile::~TemporaryFile() {
  std::error_code ignored;
  if (!path_.empty()) fs::remove(path_, ignored);
}

void TemporaryFile::commit(const std::string& target) {
  std::error_code error;
  fs::rename(path_, target, error);
  if (error) throw Error("cannot write " + target + ": " + error.message());
  path_.clear();
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  if (!out.flush()) throw Error("cannot write " + path);
}

void write_atomically(const std::string& path, const std::string& text) {
  TemporaryFile temporary(path + unique_suffix());
  write_file(temporary.path(), text);
  temporary.commit(path);
}

}  // namespace mfa::cpu
