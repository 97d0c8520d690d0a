#include "embstore/internal/checkpoint_file.hpp"

#include <fcntl.h>     // open, O_*
#include <sys/stat.h>  // fstat
#include <unistd.h>    // write, pread, fsync, close, unlink

#include <cerrno>        // errno, EINTR, ENOSPC
#include <chrono>        // std::chrono::hours
#include <cstdio>        // std::rename, std::snprintf
#include <cstdlib>       // std::getenv
#include <cstring>       // std::memcpy, std::memcmp, std::strlen
#include <fstream>       // std::ofstream
#include <random>        // std::random_device
#include <system_error>  // std::system_error
#include <thread>        // std::this_thread::sleep_for
#include <vector>        // std::vector

#include "embstore/errors.hpp"           // CheckpointError
#include "embstore/internal/crc32.hpp"  // crc32

namespace embstore::internal {
namespace {

constexpr unsigned char kMagic[16] = {'E',  'M', 'B', 'S', 'T',  'O',  'R',  'E',
                                      0x89, 'C', 'K', 'P', '\r', '\n', 0x1A, '\n'};
constexpr size_t kAlign = 64;
constexpr size_t kPreamble = 32;
constexpr size_t kSectionHeader = 64;
constexpr size_t kTrailer = 64;
constexpr uint64_t kMaxHeader = 1u << 24;

uint64_t pad(uint64_t n) { return (kAlign - n % kAlign) % kAlign; }

[[noreturn]] void io_error(const std::string& path, const char* what) {
  throw std::system_error(errno, std::generic_category(), path + ": " + what);
}

template <typename T>
void put(unsigned char* p, T v) {
  std::memcpy(p, &v, sizeof v);  // little-endian hosts only (as the whole format)
}
template <typename T>
T get(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

struct DtypeOf {
  const char* name;
  const char* code;
  size_t itemsize;
  bool two_d;
};
constexpr DtypeOf kSections[] = {{"ids", "<u8", 8, false},
                                 {"rows", "<f4", 4, true},
                                 {"last_step", "<u4", 4, false},
                                 {"removed", "<u8", 8, false},
                                 {"sketch", "<u2", 2, false}};

const DtypeOf* section_kind(const std::string& name) {
  for (const auto& k : kSections) {
    if (name == k.name) return &k;
  }
  return nullptr;
}

std::string random_hex(size_t digits) {
  std::random_device rd;
  std::string out;
  while (out.size() < digits) {
    char buf[16];
    std::snprintf(buf, sizeof buf, "%08x", rd());
    out += buf;
  }
  return out.substr(0, digits);
}

void split_path(const std::string& path, std::string& dir, std::string& base) {
  const size_t slash = path.rfind('/');
  dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  base = slash == std::string::npos ? path : path.substr(slash + 1);
}

}  // namespace

void test_pause(const std::string& point) {
  const char* fail_at = std::getenv("EMBSTORE_CHECKPOINT_TEST_FAIL");
  if (fail_at != nullptr && point == fail_at) {
    throw std::system_error(ENOSPC, std::generic_category(), "No space left on device (test)");
  }
  const char* want = std::getenv("EMBSTORE_CHECKPOINT_TEST_PAUSE");
  if (want == nullptr || point != want) return;
  if (const char* marker = std::getenv("EMBSTORE_CHECKPOINT_TEST_MARKER")) {
    // written whole, then renamed: a test that sees the marker also sees its contents
    const std::string tmp = std::string(marker) + ".tmp";
    std::ofstream(tmp) << point;
    std::rename(tmp.c_str(), marker);
  }
  std::this_thread::sleep_for(std::chrono::hours(1));
}

void test_chunk_pause() {
  const char* us = std::getenv("EMBSTORE_CHECKPOINT_TEST_CHUNK_US");
  if (us != nullptr) std::this_thread::sleep_for(std::chrono::microseconds(std::atol(us)));
}

void fsync_directory(const std::string& directory) noexcept {
  const int fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  (void)::fsync(fd);
  ::close(fd);
}

static void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::write(fd, p, n);
    if (k < 0) {
      if (errno == EINTR) continue;
      io_error(path, "write failed");
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void write_atomic(const std::string& path, const std::string& data) {
  std::string dir, base;
  split_path(path, dir, base);
  const std::string tmp = dir + "/." + base + "." + random_hex(12) + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) io_error(tmp, "cannot create");
  try {
    write_all(fd, data.data(), data.size(), tmp);
    if (::fsync(fd) != 0) io_error(tmp, "fsync failed");
    ::close(fd);
    test_pause("small-replace");
    if (std::rename(tmp.c_str(), path.c_str()) != 0) io_error(path, "rename failed");
  } catch (...) {
    ::close(fd);  // harmless EBADF when already closed
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_directory(dir);
}

// ----------------------------------------------------------------------------------------
// FileWriter

FileWriter::FileWriter(const std::string& path, const Json& header) : path_(path) {
  std::string base;
  split_path(path, dir_, base);
  const std::string body = header.dump(true);
  if (body.size() > kMaxHeader) {
    throw std::invalid_argument(path + ": checkpoint header too large");
  }
  tmp_ = dir_ + "/." + base + "." + random_hex(12) + ".tmp";
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd_ < 0) io_error(tmp_, "cannot create the temporary checkpoint file");
  header_crc_ = crc32(body.data(), body.size());
  unsigned char pre[kPreamble];
  std::memcpy(pre, kMagic, 16);
  put<uint32_t>(pre + 16, kFormatVersion);
  put<uint32_t>(pre + 20, static_cast<uint32_t>(body.size()));
  put<uint32_t>(pre + 24, header_crc_);
  put<uint32_t>(pre + 28, crc32(pre, 28));
  std::string head(reinterpret_cast<const char*>(pre), kPreamble);
  head += body;
  head.append(pad(head.size()), '\0');
  write(head.data(), head.size());
  test_pause("header");
}

FileWriter::~FileWriter() {
  if (!done_) discard();
}

void FileWriter::write(const void* data, size_t n) {
  write_all(fd_, data, n, tmp_);
  offset_ += n;
}

void FileWriter::section(const char* name, uint32_t shard, uint64_t rows, uint64_t cols,
                         const void* data, uint32_t crc) {
  const DtypeOf* kind = section_kind(name);
  if (kind == nullptr || kind->two_d != (cols != 0)) {
    throw std::logic_error(std::string("section ") + name + ": bad shape");
  }
  test_pause("section:" + std::to_string(sections_));
  const uint64_t nbytes = rows * (cols ? cols : 1) * kind->itemsize;
  unsigned char head[kSectionHeader] = {};
  std::memcpy(head, "ESEC", 4);
  put<uint32_t>(head + 4, static_cast<uint32_t>(sections_));
  std::memcpy(head + 8, name, std::strlen(name));
  put<uint32_t>(head + 24, shard);
  std::memcpy(head + 28, kind->code, 3);
  put<uint64_t>(head + 32, rows);
  put<uint64_t>(head + 40, cols);
  put<uint64_t>(head + 48, nbytes);
  put<uint32_t>(head + 56, crc);
  put<uint32_t>(head + 60, crc32(head, 60));
  section_crc_ = crc32(head, kSectionHeader, section_crc_);
  write(head, kSectionHeader);
  if (nbytes) write(data, nbytes);
  static const unsigned char zeros[kAlign] = {};
  if (const uint64_t p = pad(nbytes)) write(zeros, p);
  ++sections_;
  if (std::strcmp(name, "rows") == 0) rows_ += rows;
  if (std::strcmp(name, "removed") == 0) removed_ += rows;
}

void FileWriter::finish() {
  test_pause("trailer");
  unsigned char t[kTrailer] = {};
  std::memcpy(t, "EMBSTEND", 8);
  put<uint64_t>(t + 8, sections_);
  put<uint64_t>(t + 16, rows_);
  put<uint64_t>(t + 24, removed_);
  put<uint64_t>(t + 32, offset_);
  put<uint32_t>(t + 40, section_crc_);
  put<uint32_t>(t + 44, header_crc_);
  put<uint32_t>(t + 60, crc32(t, 60));
  write(t, kTrailer);
  test_pause("fsync");
  if (::fsync(fd_) != 0) io_error(tmp_, "fsync failed");
  ::close(fd_);
  fd_ = -1;
  test_pause("replace");
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0) io_error(path_, "rename failed");
  done_ = true;
  test_pause("dirsync");
  fsync_directory(dir_);
}

void FileWriter::discard() noexcept {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
  ::unlink(tmp_.c_str());
}

// ----------------------------------------------------------------------------------------
// FileReader

void FileReader::fail(const std::string& what) const { throw CheckpointError(path_ + ": " + what); }

void FileReader::read_exact(void* out, size_t n, const std::string& what) {
  auto* p = static_cast<char*>(out);
  size_t got = 0;
  while (got < n) {
    const ssize_t k = ::pread(fd_, p + got, n - got, static_cast<off_t>(pos_ + got));
    if (k < 0) {
      if (errno == EINTR) continue;
      io_error(path_, "read failed");
    }
    if (k == 0) fail("truncated (" + what + ")");
    got += static_cast<size_t>(k);
  }
  pos_ += n;
}

FileReader::FileReader(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) io_error(path, "cannot open");
  try {
    struct stat st{};
    if (::fstat(fd_, &st) != 0) io_error(path, "stat failed");
    size_ = static_cast<uint64_t>(st.st_size);
    unsigned char pre[kPreamble] = {};
    const size_t have = static_cast<size_t>(std::min<uint64_t>(size_, kPreamble));
    read_exact(pre, have, "preamble");
    if (have < 16 || std::memcmp(pre, kMagic, 16) != 0) {
      fail("not an embstore checkpoint (bad magic bytes)");
    }
    if (have < kPreamble) fail("truncated (preamble)");
    const uint32_t version = get<uint32_t>(pre + 16), hlen = get<uint32_t>(pre + 20);
    const uint32_t hcrc = get<uint32_t>(pre + 24);
    if (crc32(pre, 28) != get<uint32_t>(pre + 28)) fail("corrupted preamble (checksum mismatch)");
    if (version != kFormatVersion) {
      fail("unsupported checkpoint format version " + std::to_string(version) +
           " (this embstore reads version " + std::to_string(kFormatVersion) + ")");
    }
    if (hlen > kMaxHeader || kPreamble + hlen > size_) {
      fail("truncated or corrupted header (bad length)");
    }
    std::string body(hlen, '\0');
    read_exact(body.data(), hlen, "header");
    if (crc32(body.data(), body.size()) != hcrc) fail("corrupted header (checksum mismatch)");
    try {
      header_ = Json::parse(body);
    } catch (const std::runtime_error& e) {
      fail(std::string("corrupted header (bad JSON: ") + e.what() + ")");
    }
    const Json* format = header_.find("format");
    if (format == nullptr || format->kind() != Json::Kind::kString ||
        format->as_string() != kFormatName) {
      fail("not an embstore checkpoint header");
    }
    const uint64_t hpad = pad(kPreamble + hlen);
    const uint64_t data_start = kPreamble + hlen + hpad;
    if (size_ < data_start + kTrailer) fail("truncated (no trailer)");
    pos_ = size_ - kTrailer;
    unsigned char t[kTrailer];
    read_exact(t, kTrailer, "trailer");
    if (std::memcmp(t, "EMBSTEND", 8) != 0) {
      fail("truncated or corrupted (no trailer at the end of the file)");
    }
    if (crc32(t, 60) != get<uint32_t>(t + 60)) fail("corrupted trailer (checksum mismatch)");
    if (get<uint64_t>(t + 32) != size_ - kTrailer || get<uint32_t>(t + 44) != hcrc) {
      fail("corrupted trailer (does not match the file)");
    }
    pos_ = kPreamble + hlen;
    unsigned char zeros[kAlign] = {}, padding[kAlign];
    read_exact(padding, hpad, "header padding");
    if (std::memcmp(padding, zeros, hpad) != 0) fail("corrupted header (non-zero padding)");
    if (std::memcmp(t + 48, zeros, 12) != 0) {
      fail("corrupted trailer (reserved bytes are not zero)");
    }
    num_sections_ = get<uint64_t>(t + 8);
    num_rows_ = get<uint64_t>(t + 16);
    num_removed_ = get<uint64_t>(t + 24);
    sections_crc_ = get<uint32_t>(t + 40);
    pos_ = data_start;
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

FileReader::~FileReader() {
  if (fd_ >= 0) ::close(fd_);
}

std::string FileReader::kind() const {
  const Json* k = header_.find("kind");
  return k != nullptr && k->kind() == Json::Kind::kString ? k->as_string() : std::string();
}

std::string FileReader::checkpoint_id() const {
  const Json* k = header_.find("checkpoint_id");
  return k != nullptr && k->kind() == Json::Kind::kString ? k->as_string() : std::string();
}

std::string FileReader::parent_id() const {
  const Json* k = header_.find("parent_id");
  return k != nullptr && k->kind() == Json::Kind::kString ? k->as_string() : std::string();
}

bool FileReader::next(SectionInfo& sec) {
  if (pending_) throw std::logic_error("read_payload or skip_payload must come first");
  if (next_section_ == num_sections_) {
    if (!finished_) {
      finished_ = true;
      if (running_crc_ != sections_crc_ || pos_ != size_ - kTrailer) {
        fail("corrupted (sections do not match the trailer)");
      }
    }
    return false;
  }
  const uint64_t k = next_section_;
  const std::string where = "section " + std::to_string(k);
  unsigned char h[kSectionHeader];
  read_exact(h, kSectionHeader, where + " header");
  running_crc_ = crc32(h, kSectionHeader, running_crc_);
  if (std::memcmp(h, "ESEC", 4) != 0 || crc32(h, 60) != get<uint32_t>(h + 60)) {
    fail("corrupted " + where + " header (checksum mismatch)");
  }
  const char* name = reinterpret_cast<const char*>(h + 8);
  sec.name.assign(name, strnlen(name, 16));
  const char* code = reinterpret_cast<const char*>(h + 28);
  const std::string scode(code, strnlen(code, 4));
  const DtypeOf* kind = section_kind(sec.name);
  if (get<uint32_t>(h + 4) != k || kind == nullptr || scode != kind->code) {
    fail("corrupted " + where + " header (unexpected content)");
  }
  sec.number = static_cast<uint32_t>(k);
  sec.shard = get<uint32_t>(h + 24);
  sec.itemsize = kind->itemsize;
  sec.rows = get<uint64_t>(h + 32);
  sec.cols = get<uint64_t>(h + 40);
  sec.nbytes = get<uint64_t>(h + 48);
  sec.crc = get<uint32_t>(h + 56);
  const bool shape_ok = kind->two_d || sec.cols == 0;
  const uint64_t elems = sec.rows * (kind->two_d ? sec.cols : 1);
  const bool overflow = kind->two_d && sec.cols != 0 && elems / sec.cols != sec.rows;
  if (!shape_ok || overflow || elems > size_ || sec.nbytes != elems * kind->itemsize) {
    fail("corrupted " + where + " header (shape and length differ)");
  }
  sec.offset = pos_;
  if (sec.offset + sec.nbytes + pad(sec.nbytes) > size_ - kTrailer) {
    fail("truncated or corrupted (" + where + " overruns the file)");
  }
  pending_ = true;
  ++next_section_;
  return true;
}

void FileReader::check_padding(const SectionInfo& sec) {
  const uint64_t p = pad(sec.nbytes);
  unsigned char zeros[kAlign] = {}, padding[kAlign];
  read_exact(padding, p, "section " + std::to_string(sec.number) + " padding");
  if (std::memcmp(padding, zeros, p) != 0) {
    fail("corrupted section " + std::to_string(sec.number) + " (non-zero padding)");
  }
  pending_ = false;
}

static std::string shard_text(uint32_t shard) {
  return shard == kNoShard ? "None" : std::to_string(shard);
}

void FileReader::read_payload(const SectionInfo& sec, void* out) {
  if (!pending_ || pos_ != sec.offset)
    throw std::logic_error("read_payload: not the current section");
  read_exact(out, sec.nbytes, "section " + std::to_string(sec.number) + " payload");
  if (crc32(out, sec.nbytes) != sec.crc) {
    fail("corrupted section " + std::to_string(sec.number) + " (" + sec.name + ", shard " +
         shard_text(sec.shard) + "): checksum mismatch");
  }
  check_padding(sec);
}

void FileReader::skip_payload(const SectionInfo& sec) {
  if (!pending_ || pos_ != sec.offset)
    throw std::logic_error("skip_payload: not the current section");
  std::vector<unsigned char> scratch(std::min<uint64_t>(sec.nbytes, 1u << 20));
  uint32_t crc = 0;
  uint64_t left = sec.nbytes;
  while (left) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(left, scratch.size()));
    read_exact(scratch.data(), n, "section " + std::to_string(sec.number) + " payload");
    crc = crc32(scratch.data(), n, crc);
    left -= n;
  }
  if (crc != sec.crc) {
    fail("corrupted section " + std::to_string(sec.number) + " (" + sec.name + ", shard " +
         shard_text(sec.shard) + "): checksum mismatch");
  }
  check_padding(sec);
}

}  // namespace embstore::internal
