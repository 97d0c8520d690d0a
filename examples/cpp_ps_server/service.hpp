// File: service.hpp
//
// The EmbeddingPS service over a set of embstore::Table: decodes the request's bytes by
// pointer casts (little-endian host), runs one lookup_sum_many / apply_gradients_many over
// all tables of the batch, and has the core write pooled rows straight into the reply's
// bytes. Errors come back as the Python server's do: INVALID_ARGUMENT or
// FAILED_PRECONDITION with the store's message, the Python type in "embstore-error".
// Save writes through the core's checkpoint writer (save.hpp) while calls go on.
#pragma once

#include <memory>   // std::unique_ptr
#include <string>   // std::string
#include <utility>  // std::pair
#include <vector>   // std::vector

#include "embstore/table.hpp"      // embstore::Table
#include "embstore_ps.grpc.pb.h"   // embstore::ps::EmbeddingPS

namespace embstore_ps {

using NamedTable = std::pair<std::string, std::unique_ptr<embstore::Table>>;

class Service final : public embstore::ps::EmbeddingPS::Service {
 public:
  // checkpoint_dir: Save writes below it (absolute, normalised); "" lets a request name any
  // directory.
  explicit Service(std::vector<NamedTable> tables, std::string checkpoint_dir = "");

  size_t num_tables() const { return tables_.size(); }

  grpc::Status Lookup(grpc::ServerContext* ctx, const embstore::ps::LookupRequest* req,
                      embstore::ps::LookupResponse* resp) override;
  grpc::Status PushGrad(grpc::ServerContext* ctx, const embstore::ps::PushGradRequest* req,
                        embstore::ps::PushGradResponse* resp) override;
  grpc::Status Save(grpc::ServerContext* ctx, const embstore::ps::SaveRequest* req,
                    embstore::ps::SaveResponse* resp) override;
  grpc::Status Stats(grpc::ServerContext* ctx, const embstore::ps::StatsRequest* req,
                     embstore::ps::StatsResponse* resp) override;
  grpc::Status Ping(grpc::ServerContext* ctx, const embstore::ps::PingRequest* req,
                    embstore::ps::PingResponse* resp) override;

 private:
  embstore::Table& find(const std::string& name) const;  // throws UnknownTable
  std::vector<NamedTable> tables_;
  std::string checkpoint_dir_;
};

}  // namespace embstore_ps
