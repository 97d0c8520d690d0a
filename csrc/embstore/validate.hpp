// File: embstore/validate.hpp
//
// The argument checks every batch call runs before anything changes (validate.cpp),
// shared with callers that must raise exactly the same errors before they split a batch.
#pragma once

#include <cstddef>  // size_t
#include <cstdint>  // int64_t
#include <string>   // std::string

namespace embstore {

// Checks CSR offsets (offsets[0] == 0, non-decreasing, offsets[num_bags] == n); returns the
// longest bag. Throws std::invalid_argument, prefixed with "table '<label>': " if a label.
size_t validate_offsets(const int64_t* offsets, size_t num_bags, size_t n,
                        const std::string& label);
// Throws std::invalid_argument naming `name` and the first non-finite element.
void validate_finite(const float* x, size_t count, const char* name, const std::string& label);

}  // namespace embstore
