// What the coordinator fuzz targets (coordinator.cc, state_log.cc) compare saved jobs by.
#pragma once

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include <algorithm>
#include <string>

#include "trn/coordinator/v1/coordinator.pb.h"

namespace trn::fuzz {

// A job's bytes in one canonical form: fields serialized deterministically, and the key-value
// store (a hash map, whose order in a snapshot is not part of the state) sorted by key.
inline std::string canonical_job(coordinator::v1::Snapshot::Job j) {
  std::sort(j.mutable_kv()->begin(), j.mutable_kv()->end(),
            [](const auto& a, const auto& b) { return a.key() < b.key(); });
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream stream(&bytes);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    j.SerializeToCodedStream(&coded);
  }
  return bytes;
}

}  // namespace trn::fuzz
