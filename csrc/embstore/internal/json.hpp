// File: embstore/internal/json.hpp (private: not installed)
//
// The little JSON the checkpoint headers and group manifests need: a value tree, a strict
// parser, and a writer whose output equals Python's json.dumps(obj, sort_keys=True) with
// the given separators (objects sorted by key, non-ASCII escaped as \uXXXX, floats as
// Python's repr), so a group manifest's checksum over its re-serialised body matches.
#pragma once

#include <cstdint>    // uint64_t, int64_t
#include <map>        // std::map
#include <stdexcept>  // std::runtime_error
#include <string>     // std::string
#include <vector>     // std::vector

namespace embstore::internal {

class Json {
 public:
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };

  Json() = default;  // null
  static Json boolean(bool b);
  static Json integer(int64_t v);
  static Json unsigned_integer(uint64_t v);
  static Json number(double v);     // written as Python's repr(float)
  static Json number(float v);      // the shortest decimal that reads back as this float
  static Json string(std::string s);
  static Json number_literal(std::string text);  // an already valid JSON number
  static Json array(std::vector<Json> items = {});
  static Json object();

  // Throws std::runtime_error on malformed text.
  static Json parse(const std::string& text);
  // json.dumps(self, sort_keys=True): compact -> separators (",", ":"), else (", ", ": ").
  std::string dump(bool compact) const;

  Kind kind() const noexcept { return kind_; }
  bool is_null() const noexcept { return kind_ == Kind::kNull; }
  // Object access: member(key) throws std::runtime_error when absent; find returns nullptr.
  const Json* find(const std::string& key) const;
  const Json& member(const std::string& key) const;
  Json& set(const std::string& key, Json value);  // objects only
  const std::vector<Json>& items() const;         // arrays only
  void push(Json value);                          // arrays only

  // Conversions; each throws std::runtime_error when the value is of another kind or range.
  bool as_bool() const;
  uint64_t as_u64() const;
  int64_t as_i64() const;
  double as_double() const;
  const std::string& as_string() const;

 private:
  Kind kind_ = Kind::kNull;
  bool bool_ = false;
  std::string text_;  // a string's value, or a number's literal text
  std::vector<Json> items_;
  std::map<std::string, Json> members_;  // byte order == Python's code point order (UTF-8)

  void dump_to(std::string& out, bool compact) const;
};

}  // namespace embstore::internal
