// Loads NCCL at run time (design decision 3): dlopen of an absolute path, then dlsym of every
// entry of the typed table in nccl_api.h. The Python layer (dist_kernels/comm/nccl.py) chooses the
// path; this file only loads it. A loaded library is never unloaded: communicators created from
// it may live until the process exits.
#pragma once

#include <string>

#include "common/dtype.h"
#include "common/status.h"
#include "transport/nccl_api.h"

namespace dk::nccl {

struct NcclLibrary {
  std::string path;
  int version = 0;  // NCCL's code, e.g. 22805 for 2.28.5
  NcclApi api;
};

// Loads `path` (absolute) once per process. Loading the same path again returns the same
// library; another path after a successful load is an InvalidArgument error (two NCCLs in one
// process would each keep their own communicators and proxy threads).
Status loadNccl(const std::string& path, const NcclLibrary** out);

// The library loaded so far, or nullptr.
const NcclLibrary* loadedNccl();

// "2.28.5" from NCCL's version code (both the pre-2.9 and the current encodings).
std::string versionString(int code);

// ncclGetLastError's text, or "" (none, or a library older than 2.13).
std::string lastError(const NcclApi& api);

// "NCCL error 6 (remote process exited or there was a network error); NCCL's last error: ...".
std::string describeResult(const NcclApi& api, ncclResult_t result);

// A failed NCCL call as a Status naming the call and NCCL's own messages (describeResult).
Status ncclError(const NcclApi& api, ncclResult_t result, const char* what);

// NCCL's datatype and op for ours; InvalidArgument/TypeError when NCCL has no equivalent.
Status toNcclType(DType dtype, ncclDataType_t* out);
Status toNcclOp(RedOp op, ncclRedOp_t* out);

}  // namespace dk::nccl

// Checks an NCCL call through the table `api`: returns a kNcclError Status when it fails.
#define DK_CHECK_NCCL(api, call)                                   \
  do {                                                             \
    ::dk::nccl::ncclResult_t dk_nccl_result_ = (api).call;         \
    if (dk_nccl_result_ != ::dk::nccl::ncclSuccess)                \
      return ::dk::nccl::ncclError((api), dk_nccl_result_, #call); \
  } while (0)
