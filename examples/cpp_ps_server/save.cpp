#include "save.hpp"

#include <fcntl.h>   // open
#include <unistd.h>  // write, fsync, close

#include <cerrno>        // errno
#include <cstdio>        // std::snprintf, std::rename
#include <filesystem>    // std::filesystem
#include <stdexcept>     // std::invalid_argument
#include <string>        // std::string
#include <system_error>  // std::system_error

#include "embstore/checkpoint.hpp"  // embstore::save_delta, TableLabel

namespace embstore_ps {
namespace {

namespace fs = std::filesystem;

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char esc[8];
      std::snprintf(esc, sizeof esc, "\\u%04x", static_cast<unsigned>(c));
      out += esc;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

[[noreturn]] void fail(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

// Temporary file, fsync, rename, fsync of the directory: a crash leaves the old file or
// the new one, never a torn manifest.
void write_atomic(const std::string& directory, const std::string& name, const std::string& data) {
  const std::string path = directory + "/" + name, tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(tmp);
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      ::close(fd);
      fail(tmp);
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    ::close(fd);
    fail(tmp);
  }
  ::close(fd);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) fail(path);
  const int dfd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace

std::string save_directory(const std::string& checkpoint_dir, const std::string& given) {
  if (checkpoint_dir.empty()) {
    if (given.empty()) {
      throw std::invalid_argument(
          "dir: the server has no --checkpoint-dir, so a directory is required");
    }
    return given;
  }
  fs::path path = (fs::path(checkpoint_dir) / given).lexically_normal();
  if (!path.has_filename()) path = path.parent_path();  // "DIR/x/" -> "DIR/x"
  const fs::path rel = path.lexically_relative(checkpoint_dir);
  if (rel.empty() || *rel.begin() == "..") {
    throw std::invalid_argument("dir: '" + given +
                                "' is outside the server's checkpoint directory");
  }
  return path.string();
}

void save_group_delta(const std::vector<NamedTable>& tables, const std::string& directory) {
  fs::create_directories(directory);
  std::string order, files;
  for (size_t k = 0; k < tables.size(); ++k) {
    char file[32];
    std::snprintf(file, sizeof file, "t%03zu.delta", k);
    embstore::TableLabel label;
    label.name = tables[k].first;
    embstore::save_delta(*tables[k].second, directory + "/" + file, label);
    const std::string sep = k == 0 ? "" : ", ";
    order += sep + json_string(tables[k].first);
    files += sep + json_string(tables[k].first) + ": " + json_string(file);
  }
  write_atomic(directory, "DELTAS.json",
               "{\"format\": \"embstore.ps.deltas\", \"order\": [" + order + "], \"files\": {" +
                   files + "}}");
}

}  // namespace embstore_ps
