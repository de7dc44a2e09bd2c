// LaneStreams and DeviceBuffer: see lane_streams.h.
#include "comm/lane_streams.h"

#include <cstdlib>
#include <string>

#if DK_WITH_CUDA
#include <cuda_runtime_api.h>

#include "cuda/cuda_status.h"
#endif

namespace dk {

namespace {

#if DK_WITH_CUDA
cudaStream_t asStream(void* s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t asEvent(void* e) { return static_cast<cudaEvent_t>(e); }
#else
Status noCuda(int device) {
  return Unsupported("CUDA device " + std::to_string(device) +
                     ": dist_kernels was built without CUDA (this build is CPU-only)");
}
#endif

}  // namespace

Status DeviceBuffer::allocate(int device, size_t bytes) {
  DK_RETURN_IF_ERROR(release());
  device_ = device;
  if (bytes == 0) return Status::Ok();
  if (device < 0) {
    data_ = static_cast<char*>(std::malloc(bytes));
    return data_ != nullptr ? Status::Ok() : SystemError("malloc");
  }
#if DK_WITH_CUDA
  void* memory = nullptr;
  DK_CHECK_CUDA(cudaMalloc(&memory, bytes));
  data_ = static_cast<char*>(memory);
  return Status::Ok();
#else
  return noCuda(device);
#endif
}

Status DeviceBuffer::release() {
  char* memory = data_;
  data_ = nullptr;
  if (memory == nullptr) return Status::Ok();
  if (device_ < 0) {
    std::free(memory);
    return Status::Ok();
  }
#if DK_WITH_CUDA
  DK_CHECK_CUDA(cudaFree(memory));
#endif
  return Status::Ok();
}

Status LaneStreams::create(int device, void* stream0, int lanes) {
  if (device < 0) return Status::Ok();
#if DK_WITH_CUDA
  streams_.assign(1, stream0);
  for (int l = 0; l < lanes; ++l) {
    cudaEvent_t event = nullptr;
    DK_CHECK_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    events_.push_back(event);
    if (l == 0) continue;
    cudaStream_t stream = nullptr;
    DK_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    streams_.push_back(stream);
  }
  return Status::Ok();
#else
  return noCuda(device);
#endif
}

Status LaneStreams::destroy() {
#if DK_WITH_CUDA
  Status first;
  for (size_t l = 1; l < streams_.size(); ++l) {
    const cudaError_t e = cudaStreamDestroy(asStream(streams_[l]));
    if (e != cudaSuccess && first.ok()) first = cudaStatus(e, "cudaStreamDestroy");
  }
  for (void* event : events_) {
    const cudaError_t e = cudaEventDestroy(asEvent(event));
    if (e != cudaSuccess && first.ok()) first = cudaStatus(e, "cudaEventDestroy");
  }
  streams_.clear();
  events_.clear();
  return first;
#else
  return Status::Ok();
#endif
}

Status LaneStreams::fork() {
#if DK_WITH_CUDA
  if (streams_.size() < 2) return Status::Ok();
  DK_CHECK_CUDA(cudaEventRecord(asEvent(events_[0]), asStream(streams_[0])));
  for (size_t l = 1; l < streams_.size(); ++l) {
    DK_CHECK_CUDA(cudaStreamWaitEvent(asStream(streams_[l]), asEvent(events_[0]), 0));
  }
#endif
  return Status::Ok();
}

Status LaneStreams::join() {
#if DK_WITH_CUDA
  for (size_t l = 1; l < streams_.size(); ++l) {
    DK_CHECK_CUDA(cudaEventRecord(asEvent(events_[l]), asStream(streams_[l])));
    DK_CHECK_CUDA(cudaStreamWaitEvent(asStream(streams_[0]), asEvent(events_[l]), 0));
  }
#endif
  return Status::Ok();
}

Status LaneStreams::capturing(bool* out) const {
  *out = false;
#if DK_WITH_CUDA
  if (streams_.empty()) return Status::Ok();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  DK_CHECK_CUDA(cudaStreamIsCapturing(asStream(streams_[0]), &status));
  *out = status == cudaStreamCaptureStatusActive;
#endif
  return Status::Ok();
}

Status LaneStreams::allocateOnStream(size_t bytes, void** out) {
#if DK_WITH_CUDA
  DK_CHECK_CUDA(cudaMallocAsync(out, bytes, asStream(streams_[0])));
  return Status::Ok();
#else
  return Unsupported("stream-ordered memory needs a CUDA build");
#endif
}

Status LaneStreams::freeOnStream(void* memory) {
#if DK_WITH_CUDA
  DK_CHECK_CUDA(cudaFreeAsync(memory, asStream(streams_[0])));
#endif
  return Status::Ok();
}

Status LaneStreams::synchronize() {
#if DK_WITH_CUDA
  for (void* stream : streams_) DK_CHECK_CUDA(cudaStreamSynchronize(asStream(stream)));
#endif
  return Status::Ok();
}

Status streamCaptureId(void* stream, unsigned long long* id) {
  *id = 0;
#if DK_WITH_CUDA
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long captureId = 0;
  DK_CHECK_CUDA(cudaStreamGetCaptureInfo(asStream(stream), &status, &captureId));
  if (status == cudaStreamCaptureStatusActive) *id = captureId;
#endif
  return Status::Ok();
}

}  // namespace dk
