// dlopen / dlsym of NCCL into the typed table; see nccl_loader.h.
#include "transport/nccl_loader.h"

#include <dlfcn.h>

#include <mutex>
#include <string>

namespace dk::nccl {

namespace {

// 2.10.0: the oldest NCCL with ncclAvg, the newest entry of nccl_api.h.
constexpr int kMinVersion = 21000;

std::mutex& loadMutex() {
  static std::mutex mutex;
  return mutex;
}

// Written once under loadMutex(), then only read: a pointer to a leaked, immutable library.
const NcclLibrary*& loadedSlot() {
  static const NcclLibrary* library = nullptr;
  return library;
}

template <typename Fn>
Status resolve(void* handle, const std::string& path, const char* symbol, Fn* out) {
  dlerror();  // clear a stale message so the one below belongs to this lookup
  void* address = dlsym(handle, symbol);
  if (address == nullptr) {
    const char* why = dlerror();
    return Unsupported(path + " is not a usable NCCL library: symbol " + symbol + " not found" +
                       (why ? std::string(" (") + why + ")" : std::string()));
  }
  *out = reinterpret_cast<Fn>(address);
  return Status::Ok();
}

Status resolveAll(void* handle, const std::string& path, NcclApi* api) {
  DK_RETURN_IF_ERROR(resolve(handle, path, "ncclGetVersion", &api->getVersion));
  DK_RETURN_IF_ERROR(resolve(handle, path, "ncclGetUniqueId", &api->getUniqueId));
  DK_RETURN_IF_ERROR(resolve(handle, path, "ncclCommInitRank", &api->commInitRank));
  DK_RETURN_IF_ERROR(resolve(handle, path, "ncclCommDestroy", &api->commDestroy));
  DK_RETURN_IF_ERROR(resolve(handle, path, "ncclCommAbort", &api->commAbort));
  DK_RETURN_IF_ERROR(resolve(handle, path, "ncclCommGetAsyncError", &api->commGetAsyncError));
  DK_RETURN_IF_ERROR(resolve(handle, path, "ncclGetErrorString", &api->getErrorString));
  // Optional (NCCL 2.13+): a missing symbol leaves the entry null; the failed lookup's dlerror
  // is cleared by the next resolve().
  api->getLastError = reinterpret_cast<ncclGetLastError_fn>(dlsym(handle, "ncclGetLastError"));
  DK_RETURN_IF_ERROR(resolve(handle, path, "ncclGroupStart", &api->groupStart));
  DK_RETURN_IF_ERROR(resolve(handle, path, "ncclGroupEnd", &api->groupEnd));
  DK_RETURN_IF_ERROR(resolve(handle, path, "ncclSend", &api->send));
  DK_RETURN_IF_ERROR(resolve(handle, path, "ncclRecv", &api->recv));
  DK_RETURN_IF_ERROR(resolve(handle, path, "ncclAllReduce", &api->allReduce));
  DK_RETURN_IF_ERROR(resolve(handle, path, "ncclReduceScatter", &api->reduceScatter));
  DK_RETURN_IF_ERROR(resolve(handle, path, "ncclAllGather", &api->allGather));
  return resolve(handle, path, "ncclBroadcast", &api->broadcast);
}

// dlopen + dlsym + version; on failure the handle is closed and nothing is kept.
Status openLibrary(const std::string& path, NcclLibrary* library) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return Unsupported("cannot load NCCL from " + path + ": " + (why ? why : "dlopen failed"));
  }
  Status status = resolveAll(handle, path, &library->api);
  if (status.ok()) {
    ncclResult_t result = library->api.getVersion(&library->version);
    if (result != ncclSuccess) status = ncclError(library->api, result, "ncclGetVersion");
  }
  if (status.ok() && library->version < kMinVersion) {
    status =
        Unsupported("NCCL " + versionString(library->version) + " at " + path +
                    " is too old: dist_kernels needs " + versionString(kMinVersion) + " or newer");
  }
  if (!status.ok()) dlclose(handle);
  library->path = path;
  return status;
}

}  // namespace

Status loadNccl(const std::string& path, const NcclLibrary** out) {
  if (path.empty() || path[0] != '/') {
    return InvalidArgument("NCCL library path must be absolute, got '" + path + "'");
  }
  std::lock_guard<std::mutex> lock(loadMutex());
  const NcclLibrary*& loaded = loadedSlot();
  if (loaded != nullptr) {
    if (loaded->path != path) {
      return InvalidArgument("NCCL is already loaded from " + loaded->path + "; cannot also load " +
                             path + " in the same process");
    }
    *out = loaded;
    return Status::Ok();
  }
  auto* library = new NcclLibrary();  // leaked on purpose: lives as long as the process
  Status status = openLibrary(path, library);
  if (!status.ok()) {
    delete library;
    return status;
  }
  loaded = library;
  *out = library;
  return Status::Ok();
}

const NcclLibrary* loadedNccl() {
  std::lock_guard<std::mutex> lock(loadMutex());
  return loadedSlot();
}

std::string versionString(int code) {
  // NCCL_VERSION(X,Y,Z) is X*1000+Y*100+Z up to 2.8, then X*10000+Y*100+Z.
  const bool wide = code >= 10000;
  const int major = wide ? code / 10000 : code / 1000;
  const int minor = wide ? (code % 10000) / 100 : (code % 1000) / 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

std::string lastError(const NcclApi& api) {
  const char* text = api.getLastError ? api.getLastError(nullptr) : nullptr;
  return text ? std::string(text) : std::string();
}

std::string describeResult(const NcclApi& api, ncclResult_t result) {
  const char* text = api.getErrorString ? api.getErrorString(result) : nullptr;
  std::string words = "NCCL error " + std::to_string(static_cast<int>(result)) +
                      (text ? std::string(" (") + text + ")" : std::string());
  std::string last = lastError(api);
  if (!last.empty()) words += "; NCCL's last error: " + last;
  return words;
}

Status ncclError(const NcclApi& api, ncclResult_t result, const char* what) {
  return Status(Code::kNcclError, std::string(what) + " failed: " + describeResult(api, result));
}

Status toNcclType(DType dtype, ncclDataType_t* out) {
  switch (dtype) {
    case DType::kFloat32:
      *out = ncclFloat32;
      return Status::Ok();
    case DType::kFloat64:
      *out = ncclFloat64;
      return Status::Ok();
    case DType::kFloat16:
      *out = ncclFloat16;
      return Status::Ok();
    case DType::kBFloat16:
      *out = ncclBfloat16;
      return Status::Ok();
    case DType::kInt32:
      *out = ncclInt32;
      return Status::Ok();
    case DType::kInt64:
      *out = ncclInt64;
      return Status::Ok();
    case DType::kInt8:
      *out = ncclInt8;
      return Status::Ok();
    case DType::kUInt8:
      *out = ncclUint8;
      return Status::Ok();
  }
  return TypeError("no NCCL datatype for dtype code " + std::to_string(static_cast<int>(dtype)));
}

Status toNcclOp(RedOp op, ncclRedOp_t* out) {
  if (!isValidRedOp(static_cast<int>(op))) {
    return InvalidArgument("no NCCL op for reduce op code " + std::to_string(static_cast<int>(op)));
  }
  // Our RedOp codes equal NCCL's for all five ops (sum, prod, max, min, avg).
  static_assert(static_cast<int>(RedOp::kAvg) == ncclAvg, "RedOp codes follow NCCL's");
  *out = static_cast<ncclRedOp_t>(static_cast<int>(op));
  return Status::Ok();
}

}  // namespace dk::nccl
