// What the NCCL bindings share: the loaded library (or a clear error) and ncclUniqueId <-> bytes.
#pragma once

#include <pybind11/pybind11.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "transport/nccl_loader.h"

namespace dk::bindings {

inline const nccl::NcclLibrary& ncclLibrary() {
  const nccl::NcclLibrary* loaded = nccl::loadedNccl();
  if (loaded == nullptr) {
    throw std::runtime_error("NCCL is not loaded: call dist_kernels.comm.nccl.load() first");
  }
  return *loaded;
}

inline nccl::ncclUniqueId uniqueIdFrom(const pybind11::bytes& bytes) {
  const std::string raw = bytes;
  if (raw.size() != sizeof(nccl::ncclUniqueId)) {
    throw pybind11::value_error("unique_id: expected 128 bytes, got " + std::to_string(raw.size()));
  }
  nccl::ncclUniqueId id;
  std::memcpy(id.internal, raw.data(), raw.size());
  return id;
}

}  // namespace dk::bindings
