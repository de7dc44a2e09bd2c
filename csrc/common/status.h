// Status: every fallible C++ call returns one; exceptions appear only at the binding boundary
// (csrc/bindings/errors.h), where a Status becomes a Python exception naming rank and operation.
#pragma once

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

namespace dk {

enum class Code {
  kOk = 0,
  kInvalidArgument,  // bad input from the caller -> ValueError
  kTypeError,        // unsupported dtype / wrong kind of object -> TypeError
  kUnsupported,      // feature not compiled in or not available here -> RuntimeError
  kSystemError,      // a failed system call (errno) -> CommError
  kCudaError,        // a failed CUDA runtime call -> CommError
  kNcclError,        // a failed NCCL call -> CommError
  kTimeout,          // a peer did not answer within the timeout -> CommError
  kPeerFailure,      // a peer died or closed -> CommError
  kPeerLost,         // a send's or receive's peer died; the call fails alone and the
                     // communicator stays usable with the other peers -> CommError
  kMismatch,         // ranks disagree on count / dtype / op -> CommError
  kInterrupted,      // SIGINT (Ctrl-C) while waiting -> KeyboardInterrupt (csrc/common/interrupt.h)
  kInternal,         // a broken invariant -> RuntimeError
};

class Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return Status(); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) {
  return Status(Code::kInvalidArgument, std::move(m));
}
inline Status TypeError(std::string m) { return Status(Code::kTypeError, std::move(m)); }
inline Status Unsupported(std::string m) { return Status(Code::kUnsupported, std::move(m)); }
inline Status Internal(std::string m) { return Status(Code::kInternal, std::move(m)); }

// Describes errno after a failed system call, e.g. "shm_open(/dk-1a2b): Permission denied".
inline Status SystemError(const std::string& what) {
  return Status(Code::kSystemError, what + ": " + std::strerror(errno));
}

}  // namespace dk

// Propagates a non-OK Status to the caller.
#define DK_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::dk::Status dk_status_ = (expr);        \
    if (!dk_status_.ok()) return dk_status_; \
  } while (0)

// Checks a POSIX call that returns -1 (or a negative value) and sets errno on failure.
#define DK_CHECK_SYS(call)                           \
  do {                                               \
    if ((call) < 0) return ::dk::SystemError(#call); \
  } while (0)
