// The part of NCCL's C API that dist_kernels uses, declared here rather than taken from nccl.h
// (design decision 3): NCCL is dlopen'ed at run time by absolute path, so the build needs neither
// its headers nor its 350 MB wheel. These declarations follow NCCL's stable ABI (unchanged
// since 2.10 for everything below; ncclAvg, the newest required entry, appeared in 2.10).
// ncclGetLastError (2.13) is optional: older libraries load without it and errors then carry
// only ncclGetErrorString's text.
// CUDA streams are passed as void*: cudaStream_t is an opaque pointer, so the table is the same
// in CPU-only builds, which can still load and describe a library.
#pragma once

#include <cstddef>

namespace dk::nccl {

struct ncclComm;
using ncclComm_t = ncclComm*;

constexpr int kUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
struct ncclUniqueId {
  char internal[kUniqueIdBytes];
};
static_assert(sizeof(ncclUniqueId) == 128, "ncclUniqueId is 128 bytes in NCCL's ABI");

enum ncclResult_t : int {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
};

enum ncclDataType_t : int {
  ncclInt8 = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclFloat64 = 8,
  ncclBfloat16 = 9,
};

enum ncclRedOp_t : int {
  ncclSum = 0,
  ncclProd = 1,
  ncclMax = 2,
  ncclMin = 3,
  ncclAvg = 4,
};

using cudaStreamOpaque = void*;

// Prototypes, one alias each, named after the NCCL function.
using ncclGetVersion_fn = ncclResult_t (*)(int* version);
using ncclGetUniqueId_fn = ncclResult_t (*)(ncclUniqueId* id);
using ncclCommInitRank_fn = ncclResult_t (*)(ncclComm_t* comm, int nranks, ncclUniqueId id,
                                             int rank);
using ncclCommDestroy_fn = ncclResult_t (*)(ncclComm_t comm);
using ncclCommAbort_fn = ncclResult_t (*)(ncclComm_t comm);
using ncclCommGetAsyncError_fn = ncclResult_t (*)(ncclComm_t comm, ncclResult_t* async_error);
using ncclGetErrorString_fn = const char* (*)(ncclResult_t result);
// NCCL's last error in words (e.g. which socket closed); `comm` is unused by NCCL (may be null).
using ncclGetLastError_fn = const char* (*)(ncclComm_t comm);
using ncclGroupStart_fn = ncclResult_t (*)();
using ncclGroupEnd_fn = ncclResult_t (*)();
using ncclSend_fn = ncclResult_t (*)(const void* sendbuff, size_t count, ncclDataType_t datatype,
                                     int peer, ncclComm_t comm, cudaStreamOpaque stream);
using ncclRecv_fn = ncclResult_t (*)(void* recvbuff, size_t count, ncclDataType_t datatype,
                                     int peer, ncclComm_t comm, cudaStreamOpaque stream);
using ncclAllReduce_fn = ncclResult_t (*)(const void* sendbuff, void* recvbuff, size_t count,
                                          ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                          cudaStreamOpaque stream);
using ncclReduceScatter_fn = ncclResult_t (*)(const void* sendbuff, void* recvbuff,
                                              size_t recvcount, ncclDataType_t datatype,
                                              ncclRedOp_t op, ncclComm_t comm,
                                              cudaStreamOpaque stream);
using ncclAllGather_fn = ncclResult_t (*)(const void* sendbuff, void* recvbuff, size_t sendcount,
                                          ncclDataType_t datatype, ncclComm_t comm,
                                          cudaStreamOpaque stream);
using ncclBroadcast_fn = ncclResult_t (*)(const void* sendbuff, void* recvbuff, size_t count,
                                          ncclDataType_t datatype, int root, ncclComm_t comm,
                                          cudaStreamOpaque stream);

// The typed function table: every entry is resolved by the loader, or the load fails; only
// getLastError may stay null (a library older than NCCL 2.13).
struct NcclApi {
  ncclGetVersion_fn getVersion = nullptr;
  ncclGetUniqueId_fn getUniqueId = nullptr;
  ncclCommInitRank_fn commInitRank = nullptr;
  ncclCommDestroy_fn commDestroy = nullptr;
  ncclCommAbort_fn commAbort = nullptr;
  ncclCommGetAsyncError_fn commGetAsyncError = nullptr;
  ncclGetErrorString_fn getErrorString = nullptr;
  ncclGetLastError_fn getLastError = nullptr;  // optional
  ncclGroupStart_fn groupStart = nullptr;
  ncclGroupEnd_fn groupEnd = nullptr;
  ncclSend_fn send = nullptr;
  ncclRecv_fn recv = nullptr;
  ncclAllReduce_fn allReduce = nullptr;
  ncclReduceScatter_fn reduceScatter = nullptr;
  ncclAllGather_fn allGather = nullptr;
  ncclBroadcast_fn broadcast = nullptr;
};

}  // namespace dk::nccl
