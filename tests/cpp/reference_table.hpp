// File: tests/cpp/reference_table.hpp
//
// RefTable: a hand-written reference table that follows docs/semantics.md line by line, one
// occurrence at a time, and CHECK_STATS, which compares a Table's counters with it.
#pragma once

#include "helpers.hpp"

namespace {

// ---- a hand-written reference table (docs/semantics.md, one occurrence at a time) ------
//
// capacity == 0: unbounded (no eviction). Otherwise one CLOCK ring of `capacity` slots in
// allocation order, erased slots reused last-freed-first, and (docs) every id of an
// apply_gradients call pinned for the whole call.
class RefTable {
 public:
  RefTable(size_t dim, OptimizerConfig opt, InitializerConfig init, size_t capacity = 0,
           Eviction eviction = Eviction::kClock)
      : dim_(dim),
        opt_(opt),
        init_(init),
        capacity_(capacity),
        eviction_(eviction),
        slot_id_(capacity),
        occupied_(capacity, false),
        ref_(capacity, false),
        read_mark_(capacity, false) {}

  uint64_t hits = 0, misses = 0, inserts = 0, evictions = 0, erased = 0;

  size_t size() const { return rows_.size(); }
  bool has(uint64_t id) const { return rows_.count(id) != 0; }
  const Floats& weights(uint64_t id) const { return rows_.at(id).w; }
  std::set<uint64_t> ids() const {
    std::set<uint64_t> s;
    for (const auto& kv : rows_) s.insert(kv.first);
    return s;
  }

  Floats lookup(const Ids& keys, bool insert) {
    Floats out(keys.size() * dim_, 0.0f);
    for (size_t i = 0; i < keys.size(); ++i) {
      const uint64_t id = keys[i];
      if (has(id)) {
        ++hits;
        if (insert) {
          touch(id);
        } else if (capacity_ != 0) {
          read_mark_[slot_of_.at(id)] = true;  // a read-only hit marks the slot, not the bit
        }
      } else {
        ++misses;
        if (!insert) continue;
        insert_row(id, {});
      }
      const Floats& w = rows_.at(id).w;
      std::copy(w.begin(), w.end(), out.begin() + static_cast<std::ptrdiff_t>(i * dim_));
    }
    return out;
  }

  Floats lookup_sum(const Ids& keys, const Offsets& offsets, const Floats* weights, PoolMode mode,
                    bool insert) {
    const Floats rows = lookup(keys, insert);
    const size_t bags = offsets.size() - 1;
    Floats out(bags * dim_);
    for (size_t b = 0; b < bags; ++b) {
      Floats s(dim_, 0.0f);
      for (int64_t i = offsets[b]; i < offsets[b + 1]; ++i) {
        for (size_t k = 0; k < dim_; ++k) {
          const float r = rows[static_cast<size_t>(i) * dim_ + k];
          s[k] = weights ? s[k] + (*weights)[static_cast<size_t>(i)] * r : s[k] + r;
        }
      }
      const int64_t count = offsets[b + 1] - offsets[b];
      if (mode == PoolMode::kMean && count > 0) {
        for (size_t k = 0; k < dim_; ++k) s[k] = s[k] / static_cast<float>(count);
      }
      std::copy(s.begin(), s.end(), out.begin() + static_cast<std::ptrdiff_t>(b * dim_));
    }
    return out;
  }

  void apply(const Ids& keys, const Floats& grads, const Offsets* offsets, const Floats* weights,
             PoolMode mode) {
    // Per-occurrence gradients g_i.
    std::vector<Floats> g(keys.size(), Floats(dim_));
    if (offsets == nullptr) {
      for (size_t i = 0; i < keys.size(); ++i) {
        for (size_t k = 0; k < dim_; ++k) g[i][k] = grads[i * dim_ + k];
      }
    } else {
      for (size_t b = 0; b + 1 < offsets->size(); ++b) {
        const int64_t lo = (*offsets)[b], hi = (*offsets)[b + 1];
        for (int64_t i = lo; i < hi; ++i) {
          const size_t ii = static_cast<size_t>(i);
          if (weights == nullptr && mode == PoolMode::kSum) {
            for (size_t k = 0; k < dim_; ++k) g[ii][k] = grads[b * dim_ + k];
            continue;
          }
          float c = weights ? (*weights)[ii] : 1.0f;
          if (mode == PoolMode::kMean) c = c / static_cast<float>(hi - lo);
          for (size_t k = 0; k < dim_; ++k) g[ii][k] = c * grads[b * dim_ + k];
        }
      }
    }
    // Sum equal ids in order, from a zero vector.
    Ids order;
    std::map<uint64_t, Floats> summed;
    for (size_t i = 0; i < keys.size(); ++i) {
      auto it = summed.find(keys[i]);
      if (it == summed.end()) {
        order.push_back(keys[i]);
        it = summed.emplace(keys[i], Floats(dim_, 0.0f)).first;
      }
      for (size_t k = 0; k < dim_; ++k) it->second[k] = it->second[k] + g[i][k];
    }
    const std::set<uint64_t> pinned(order.begin(), order.end());
    for (uint64_t id : order) {
      if (!has(id)) insert_row(id, pinned);
    }
    for (uint64_t id : order) {
      update(rows_.at(id), summed.at(id));
      touch(id);
    }
  }

  std::vector<bool> contains(const Ids& keys) const {
    std::vector<bool> out;
    for (uint64_t id : keys) out.push_back(has(id));
    return out;
  }

  size_t erase(const Ids& keys) {
    size_t removed = 0;
    for (uint64_t id : keys) {
      if (!has(id)) continue;
      rows_.erase(id);
      if (capacity_ != 0) {
        const size_t slot = slot_of_.at(id);
        slot_of_.erase(id);
        occupied_[slot] = false;
        ref_[slot] = false;
        read_mark_[slot] = false;
        free_.push_back(slot);
      }
      ++removed;
    }
    erased += removed;
    return removed;
  }

 private:
  struct Row {
    Floats w, acc;
  };

  void touch(uint64_t id) {
    if (capacity_ != 0) ref_[slot_of_.at(id)] = true;
  }

  void insert_row(uint64_t id, const std::set<uint64_t>& pinned) {
    if (capacity_ != 0) {
      size_t slot;
      if (!free_.empty()) {
        slot = free_.back();
        free_.pop_back();
      } else if (bump_ < capacity_) {
        slot = bump_++;
      } else if (eviction_ == Eviction::kNone) {
        throw CapacityError("reference: table full");
      } else {
        slot = victim(pinned);
        const uint64_t old = slot_id_[slot];
        rows_.erase(old);
        slot_of_.erase(old);
        ++evictions;
      }
      slot_id_[slot] = id;
      occupied_[slot] = true;
      ref_[slot] = true;
      read_mark_[slot] = false;
      slot_of_[id] = slot;
    }
    Row r;
    r.w = doc_initial_row(init_, id, dim_);
    if (opt_.kind == OptimizerKind::kAdagrad) r.acc.assign(dim_, opt_.initial_accumulator);
    rows_[id] = r;
    ++inserts;
  }

  size_t victim(const std::set<uint64_t>& pinned) {
    for (size_t step = 0; step < 3 * capacity_ + 1; ++step) {
      const size_t slot = hand_;
      hand_ = (hand_ + 1) % capacity_;
      if (!occupied_[slot] || pinned.count(slot_id_[slot])) continue;
      if (ref_[slot]) {  // the bit first, the read mark the next time round
        ref_[slot] = false;
        continue;
      }
      if (read_mark_[slot]) {
        read_mark_[slot] = false;
        continue;
      }
      return slot;
    }
    throw CapacityError("reference: every row is pinned");
  }

  void update(Row& r, const Floats& g) {
    const float lr = opt_.lr;
    for (size_t k = 0; k < dim_; ++k) {
      if (opt_.kind == OptimizerKind::kSgd) {
        r.w[k] = r.w[k] - lr * g[k];
      } else {
        const float a = r.acc[k] + g[k] * g[k];
        r.acc[k] = a;
        r.w[k] = r.w[k] - (lr * g[k]) / (std::sqrt(a) + opt_.eps);
      }
    }
  }

  size_t dim_;
  OptimizerConfig opt_;
  InitializerConfig init_;
  size_t capacity_;
  Eviction eviction_;
  std::map<uint64_t, Row> rows_;
  // CLOCK ring (capacity_ != 0)
  std::vector<uint64_t> slot_id_;
  std::vector<bool> occupied_, ref_, read_mark_;
  std::map<uint64_t, size_t> slot_of_;
  std::vector<size_t> free_;
  size_t bump_ = 0, hand_ = 0;
};

inline void check_stats(Table& t, const RefTable& ref, const char* file, int line) {
  const TableStats st = t.stats();
  auto eq = [&](const char* what, uint64_t got, uint64_t want) {
    if (got != want) {
      embstore_test::fail(file, line,
                          std::string("stats.") + what + " = " + std::to_string(got) +
                              ", reference " + std::to_string(want));
    }
  };
  eq("size", st.size, ref.size());
  eq("hits", st.hits, ref.hits);
  eq("misses", st.misses, ref.misses);
  eq("inserts", st.inserts, ref.inserts);
  eq("evictions", st.evictions, ref.evictions);
  eq("erased", st.erased, ref.erased);
}

}  // namespace

#define CHECK_STATS(t, ref) check_stats((t), (ref), __FILE__, __LINE__)
