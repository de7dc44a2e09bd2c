// _C.CudaCommunicator(comm, stream, staging, slot_bytes, num_slots, scratch): ring and tree over
// NcclTransport + CudaCompute (CUDA builds only; CPU-only builds register nothing here).
// Pointers and the stream travel as integers; each call enqueues on the stream without the GIL.
#include <pybind11/pybind11.h>

#include "bindings/registry.h"

#if DK_WITH_CUDA

#include <cstdint>
#include <memory>
#include <string>

#include "bindings/errors.h"
#include "comm/cuda_communicator.h"

namespace py = pybind11;

namespace {

using dk::CudaCommunicator;

void* ptr(uintptr_t address) { return reinterpret_cast<void*>(address); }

std::unique_ptr<CudaCommunicator> make(dk::nccl::NcclComm& comm, uintptr_t stream,
                                       uintptr_t staging, size_t slot_bytes, int num_slots,
                                       uintptr_t scratch) {
  std::unique_ptr<CudaCommunicator> out;
  dk::bindings::check(CudaCommunicator::create(&comm, ptr(stream), ptr(staging), slot_bytes,
                                               num_slots, ptr(scratch), &out),
                      "[rank " + std::to_string(comm.rank()) + "] CudaCommunicator");
  return out;
}

template <typename Fn>
void enqueue(const CudaCommunicator& c, const char* what, Fn fn) {
  dk::Status status;
  {
    py::gil_scoped_release release;
    status = fn();
  }
  dk::bindings::check(status, "[rank " + std::to_string(c.rank()) + "] " + what);
}

dk::DType dtypeOf(int code) { return static_cast<dk::DType>(code); }

}  // namespace

DK_REGISTER_BINDINGS(cuda_comm) {
  py::class_<CudaCommunicator>(m, "CudaCommunicator")
      .def(py::init(&make), py::arg("comm"), py::arg("stream"), py::arg("staging"),
           py::arg("slot_bytes"), py::arg("num_slots"), py::arg("scratch"), py::keep_alive<1, 2>())
      .def("all_reduce",
           [](CudaCommunicator& c, uintptr_t src, uintptr_t dst, size_t count, int dtype, int op,
              int algorithm) {
             enqueue(c, "all_reduce", [&] {
               return c.allReduce(ptr(src), ptr(dst), count, dtypeOf(dtype),
                                  static_cast<dk::RedOp>(op),
                                  static_cast<dk::algo::Algorithm>(algorithm));
             });
           })
      .def("reduce_scatter",
           [](CudaCommunicator& c, uintptr_t src, uintptr_t dst, size_t count, int dtype, int op) {
             enqueue(c, "reduce_scatter", [&] {
               return c.reduceScatter(ptr(src), ptr(dst), count, dtypeOf(dtype),
                                      static_cast<dk::RedOp>(op));
             });
           })
      .def("all_gather",
           [](CudaCommunicator& c, uintptr_t src, uintptr_t dst, size_t count, int dtype) {
             enqueue(c, "all_gather",
                     [&] { return c.allGather(ptr(src), ptr(dst), count, dtypeOf(dtype)); });
           })
      .def("broadcast", [](CudaCommunicator& c, uintptr_t data, size_t count, int dtype, int root) {
        enqueue(c, "broadcast",
                [&] { return c.broadcast(ptr(data), count, dtypeOf(dtype), root); });
      });
}

#else  // CPU-only build

DK_REGISTER_BINDINGS(cuda_comm) {}

#endif  // DK_WITH_CUDA
