// File: embstore/internal/checkpoint_file.hpp (private: not installed)
//
// The checkpoint file format, version 1 (docs/checkpoint.md), byte for byte as
// src/embstore/checkpoint.py writes and reads it: FileWriter writes a file atomically
// (temporary file, fsync, rename, directory fsync); FileReader checks the preamble, header
// and trailer on open, then walks the sections in order, checking every checksum.
// Errors: CheckpointError (the message starts with the path) for bad content,
// std::system_error for I/O failures.
#pragma once

#include <cstddef>  // size_t
#include <cstdint>  // uint32_t, uint64_t
#include <string>   // std::string

#include "embstore/internal/json.hpp"  // Json

namespace embstore::internal {

constexpr uint32_t kFormatVersion = 1;
constexpr const char* kFormatName = "embstore.checkpoint";
constexpr uint32_t kNoShard = 0xFFFFFFFFu;

// The writer's test hook (tests/test_checkpoint_crash.py): when EMBSTORE_CHECKPOINT_TEST_PAUSE
// names `point`, writes it to the file EMBSTORE_CHECKPOINT_TEST_MARKER names and sleeps; when
// EMBSTORE_CHECKPOINT_TEST_FAIL names it, throws an ENOSPC system_error (a disk that fills).
void test_pause(const std::string& point);
// Test seam: sleeps EMBSTORE_CHECKPOINT_TEST_CHUNK_US microseconds (when set) after each
// chunk a save copies out, so tests can stretch a save over many concurrent calls.
void test_chunk_pause();
void fsync_directory(const std::string& directory) noexcept;
// Writes a small file atomically (a group's manifest).
void write_atomic(const std::string& path, const std::string& data);

class FileWriter {
 public:
  FileWriter(const std::string& path, const Json& header);  // writes preamble and header
  ~FileWriter();                                            // discard() unless finished
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  // Appends a section: `name` one of ids, rows, last_step, removed, sketch (its dtype is
  // implied); cols 0 for a 1-D section; `crc` the payload's CRC-32.
  void section(const char* name, uint32_t shard, uint64_t rows, uint64_t cols, const void* data,
               uint32_t crc);
  void finish();             // trailer, fsync, rename over the path, directory fsync
  void discard() noexcept;   // closes and removes the temporary file

 private:
  void write(const void* data, size_t n);

  std::string path_, dir_, tmp_;
  int fd_ = -1;
  bool done_ = false;
  uint64_t offset_ = 0, sections_ = 0, rows_ = 0, removed_ = 0;
  uint32_t section_crc_ = 0, header_crc_ = 0;
};

struct SectionInfo {
  uint32_t number = 0;
  std::string name;
  uint32_t shard = kNoShard;
  size_t itemsize = 0;
  uint64_t rows = 0, cols = 0, nbytes = 0;
  uint32_t crc = 0;
  uint64_t offset = 0;  // of the payload
};

class FileReader {
 public:
  explicit FileReader(const std::string& path);  // checks preamble, header and trailer
  ~FileReader();
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;

  const std::string& path() const noexcept { return path_; }
  const Json& header() const noexcept { return header_; }
  std::string kind() const;           // "full" or "delta" (as written)
  std::string checkpoint_id() const;
  std::string parent_id() const;      // "" for none
  uint64_t num_sections() const noexcept { return num_sections_; }
  uint64_t num_rows() const noexcept { return num_rows_; }
  uint64_t num_removed() const noexcept { return num_removed_; }

  // The next section's header (checked), or false after the last one (then checks that the
  // sections match the trailer). Each payload must be read or skipped before the next.
  bool next(SectionInfo& sec);
  void read_payload(const SectionInfo& sec, void* out);  // nbytes into out, checked
  void skip_payload(const SectionInfo& sec);             // checked, not kept
  [[noreturn]] void fail(const std::string& what) const;

 private:
  void read_exact(void* out, size_t n, const std::string& what);
  void check_padding(const SectionInfo& sec);

  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0, pos_ = 0, next_section_ = 0;
  uint64_t num_sections_ = 0, num_rows_ = 0, num_removed_ = 0;
  uint32_t sections_crc_ = 0, running_crc_ = 0;
  bool pending_ = false, finished_ = false;
  Json header_;
};

}  // namespace embstore::internal
