#include "embstore/internal/json.hpp"

#include <charconv>      // std::to_chars, std::from_chars
#include <cstdio>        // std::snprintf
#include <system_error>  // std::errc
#include <utility>       // std::move

namespace embstore::internal {
namespace {

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error("JSON: " + what); }

// Python's float repr from the shortest round-trip digits in scientific form ("d.ddde+XX"):
// fixed notation for exponents in [-4, 16), otherwise d.ddde+XX with at least two digits.
std::string python_repr(const char* first, const char* last) {
  std::string s(first, last);
  if (s == "inf" || s == "-inf" || s == "nan" || s == "-nan") {
    return s[0] == '-' ? (s[1] == 'i' ? "-Infinity" : "NaN") : (s[0] == 'i' ? "Infinity" : "NaN");
  }
  std::string sign;
  if (s[0] == '-') {
    sign = "-";
    s.erase(0, 1);
  }
  const size_t e = s.find('e');
  const int exp = std::stoi(s.substr(e + 1));
  std::string digits = s.substr(0, e);
  if (digits.size() > 1) digits.erase(1, 1);  // the '.'
  std::string out;
  if (exp >= -4 && exp < 16) {
    if (exp >= 0) {
      const size_t whole = static_cast<size_t>(exp) + 1;
      if (digits.size() <= whole) {
        out = digits + std::string(whole - digits.size(), '0') + ".0";
      } else {
        out = digits.substr(0, whole) + "." + digits.substr(whole);
      }
    } else {
      out = "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char buf[16];
    std::snprintf(buf, sizeof buf, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    out += buf;
  }
  return sign + out;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

void append_u16(std::string& out, uint32_t u) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "\\u%04x", u);
  out += buf;
}

// Python's ensure_ascii escaping: printable ASCII as is, everything else as \uXXXX
// (surrogate pairs above U+FFFF).
void dump_string(std::string& out, const std::string& s) {
  out += '"';
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '"') {
      out += "\\\"";
    } else if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\b') {
      out += "\\b";
    } else if (c == '\f') {
      out += "\\f";
    } else if (c >= 0x20 && c < 0x7F) {
      out += static_cast<char>(c);
    } else if (c < 0x80) {
      append_u16(out, c);
    } else {
      const size_t len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
      uint32_t cp = len == 1 ? c : c & (0x7F >> len);
      for (size_t k = 1; k < len && i + k < s.size(); ++k) {
        cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
      }
      if (cp >= 0x10000) {
        cp -= 0x10000;
        append_u16(out, 0xD800 | (cp >> 10));
        append_u16(out, 0xDC00 | (cp & 0x3FF));
      } else {
        append_u16(out, cp);
      }
      i += len;
      continue;
    }
    ++i;
  }
  out += '"';
}

class Parser {
 public:
  explicit Parser(const std::string& s) : s_(s) {}

  Json document() {
    Json v = value(0);
    space();
    if (pos_ != s_.size()) fail("trailing characters");
    return v;
  }

 private:
  void space() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\n' || s_[pos_] == '\r' || s_[pos_] == '\t')) {
      ++pos_;
    }
  }
  bool eat(char c) {
    space();
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(std::string("expected '") + c + "' at " + std::to_string(pos_));
  }
  bool word(const char* w) {
    const std::string t(w);
    if (s_.compare(pos_, t.size(), t) != 0) return false;
    pos_ += t.size();
    return true;
  }

  Json value(int depth) {
    if (depth > 64) fail("nested too deeply");
    space();
    if (pos_ >= s_.size()) fail("unexpected end");
    const char c = s_[pos_];
    if (c == '{') return object(depth);
    if (c == '[') {
      ++pos_;
      Json a = Json::array();
      if (eat(']')) return a;
      do a.push(value(depth + 1));
      while (eat(','));
      expect(']');
      return a;
    }
    if (c == '"') return Json::string(string());
    if (word("true")) return Json::boolean(true);
    if (word("false")) return Json::boolean(false);
    if (word("null")) return Json();
    return number();
  }

  Json object(int depth) {
    ++pos_;
    Json o = Json::object();
    if (eat('}')) return o;
    do {
      space();
      if (pos_ >= s_.size() || s_[pos_] != '"') fail("expected a key");
      std::string key = string();
      expect(':');
      o.set(key, value(depth + 1));
    } while (eat(','));
    expect('}');
    return o;
  }

  uint32_t hex4() {
    if (pos_ + 4 > s_.size()) fail("bad \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      const char h = s_[pos_++];
      v <<= 4;
      if (h >= '0' && h <= '9') {
        v |= static_cast<uint32_t>(h - '0');
      } else if (h >= 'a' && h <= 'f') {
        v |= static_cast<uint32_t>(h - 'a' + 10);
      } else if (h >= 'A' && h <= 'F') {
        v |= static_cast<uint32_t>(h - 'A' + 10);
      } else {
        fail("bad \\u escape");
      }
    }
    return v;
  }

  std::string string() {
    ++pos_;  // the opening quote
    std::string out;
    while (true) {
      if (pos_ >= s_.size()) fail("unterminated string");
      const char c = s_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= s_.size()) fail("unterminated string");
      const char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp < 0xDC00 && s_.compare(pos_, 2, "\\u") == 0) {
            pos_ += 2;
            const uint32_t lo = hex4();
            if (lo < 0xDC00 || lo >= 0xE000) fail("bad surrogate pair");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          append_utf8(out, cp);
          break;
        }
        default: fail("bad escape");
      }
    }
  }

  Json number() {
    const size_t start = pos_;
    auto digits = [&] {
      const size_t from = pos_;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      return pos_ - from;
    };
    if (pos_ < s_.size() && s_[pos_] == '-') ++pos_;
    if (digits() == 0) fail("bad value at " + std::to_string(start));
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      if (digits() == 0) fail("bad number");
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (digits() == 0) fail("bad number");
    }
    return Json::number_literal(s_.substr(start, pos_ - start));
  }

  const std::string& s_;
  size_t pos_ = 0;
};

}  // namespace
}  // namespace embstore::internal

namespace embstore::internal {

Json Json::boolean(bool b) {
  Json j;
  j.kind_ = Kind::kBool;
  j.bool_ = b;
  return j;
}

Json Json::number_literal(std::string text) {
  Json j;
  j.kind_ = Kind::kNumber;
  j.text_ = std::move(text);
  return j;
}

Json Json::integer(int64_t v) { return number_literal(std::to_string(v)); }
Json Json::unsigned_integer(uint64_t v) { return number_literal(std::to_string(v)); }

Json Json::number(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
  return number_literal(python_repr(buf, r.ptr));
}

Json Json::number(float v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
  return number_literal(python_repr(buf, r.ptr));
}

Json Json::string(std::string s) {
  Json j;
  j.kind_ = Kind::kString;
  j.text_ = std::move(s);
  return j;
}

Json Json::array(std::vector<Json> items) {
  Json j;
  j.kind_ = Kind::kArray;
  j.items_ = std::move(items);
  return j;
}

Json Json::object() {
  Json j;
  j.kind_ = Kind::kObject;
  return j;
}

Json Json::parse(const std::string& text) { return Parser(text).document(); }

std::string Json::dump(bool compact) const {
  std::string out;
  dump_to(out, compact);
  return out;
}

void Json::dump_to(std::string& out, bool compact) const {
  switch (kind_) {
    case Kind::kNull: out += "null"; return;
    case Kind::kBool: out += bool_ ? "true" : "false"; return;
    case Kind::kNumber: out += text_; return;
    case Kind::kString: dump_string(out, text_); return;
    case Kind::kArray: {
      out += '[';
      for (size_t k = 0; k < items_.size(); ++k) {
        if (k) out += compact ? "," : ", ";
        items_[k].dump_to(out, compact);
      }
      out += ']';
      return;
    }
    case Kind::kObject: {
      out += '{';
      bool first = true;
      for (const auto& [key, value] : members_) {
        if (!first) out += compact ? "," : ", ";
        first = false;
        dump_string(out, key);
        out += compact ? ":" : ": ";
        value.dump_to(out, compact);
      }
      out += '}';
      return;
    }
  }
}

const Json* Json::find(const std::string& key) const {
  if (kind_ != Kind::kObject) return nullptr;
  const auto it = members_.find(key);
  return it == members_.end() ? nullptr : &it->second;
}

const Json& Json::member(const std::string& key) const {
  const Json* j = find(key);
  if (j == nullptr) fail("missing key '" + key + "'");
  return *j;
}

Json& Json::set(const std::string& key, Json value) {
  if (kind_ != Kind::kObject) fail("not an object");
  return members_[key] = std::move(value);
}

const std::vector<Json>& Json::items() const {
  if (kind_ != Kind::kArray) fail("not an array");
  return items_;
}

void Json::push(Json value) {
  if (kind_ != Kind::kArray) fail("not an array");
  items_.push_back(std::move(value));
}

bool Json::as_bool() const {
  if (kind_ != Kind::kBool) fail("not a boolean");
  return bool_;
}

uint64_t Json::as_u64() const {
  uint64_t v = 0;
  const char* end = text_.data() + text_.size();
  if (kind_ != Kind::kNumber || std::from_chars(text_.data(), end, v).ptr != end) {
    fail("not a non-negative integer");
  }
  return v;
}

int64_t Json::as_i64() const {
  int64_t v = 0;
  const char* end = text_.data() + text_.size();
  if (kind_ != Kind::kNumber || std::from_chars(text_.data(), end, v).ptr != end) {
    fail("not an integer");
  }
  return v;
}

double Json::as_double() const {
  double v = 0;
  const char* end = text_.data() + text_.size();
  if (kind_ != Kind::kNumber) fail("not a number");
  const auto r = std::from_chars(text_.data(), end, v);
  if (r.ptr != end || r.ec != std::errc()) fail("not a finite number");
  return v;
}

const std::string& Json::as_string() const {
  if (kind_ != Kind::kString) fail("not a string");
  return text_;
}

}  // namespace embstore::internal
