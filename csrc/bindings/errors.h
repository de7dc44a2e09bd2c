// The one place where a C++ Status becomes a Python exception.
//   kInvalidArgument -> ValueError, kTypeError -> TypeError,
//   kUnsupported / kInternal -> RuntimeError, everything from peers and the system -> CommError.
// Messages are prefixed with the context, e.g. "[rank 1] all_reduce: ...".
#pragma once

#include <stdexcept>
#include <string>

#include "common/status.h"

namespace dk::bindings {

// C++ side of dist_kernels.CommError (a RuntimeError subclass on the Python side).
class CommErrorException : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] void throwStatus(const Status& status, const std::string& context);

inline void check(const Status& status, const std::string& context) {
  if (!status.ok()) throwStatus(status, context);
}

}  // namespace dk::bindings
