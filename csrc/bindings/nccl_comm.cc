// Python classes over NCCL:
//   _C.nccl_unique_id() -> bytes
//   _C.NcclComm(unique_id, rank, world_size, device): NCCL's own collectives (algorithm="nccl"),
//       abort, async_error, last_error. In every build: a CPU-only build drives a fake NCCL in
//       the tests of the error paths (device -1 = no cudaSetDevice).
//   _C.NcclTransport(comm, stream, staging, slot_bytes, num_slots).send_recv(...): CUDA builds.
// Pointers and streams travel as integers (data_ptr(), cuda_stream); calls release the GIL.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "bindings/errors.h"
#include "bindings/registry.h"
#include "transport/nccl_collectives.h"
#include "transport/nccl_comm.h"

#if DK_WITH_CUDA
#include "algorithm/cuda_compute.h"
#include "algorithm/pairwise_exchange.h"
#include "transport/nccl_transport.h"
#endif

namespace py = pybind11;

namespace {

using dk::nccl::NcclComm;

void* ptr(uintptr_t address) { return reinterpret_cast<void*>(address); }

const dk::nccl::NcclLibrary& library() {
  const dk::nccl::NcclLibrary* loaded = dk::nccl::loadedNccl();
  if (loaded == nullptr) {
    throw std::runtime_error("NCCL is not loaded: call dist_kernels.comm.nccl.load() first");
  }
  return *loaded;
}

py::bytes uniqueId() {
  dk::nccl::ncclUniqueId id;
  dk::bindings::check(NcclComm::newUniqueId(library(), &id), "nccl_unique_id");
  return py::bytes(id.internal, sizeof(id.internal));
}

std::unique_ptr<NcclComm> makeComm(const py::bytes& unique_id, int rank, int world_size,
                                   int device) {
  std::string raw = unique_id;
  if (raw.size() != sizeof(dk::nccl::ncclUniqueId)) {
    throw py::value_error("unique_id: expected 128 bytes, got " + std::to_string(raw.size()));
  }
  dk::nccl::ncclUniqueId id;
  std::memcpy(id.internal, raw.data(), raw.size());
  const dk::nccl::NcclLibrary& lib = library();
  std::unique_ptr<NcclComm> comm;
  dk::Status status;
  {
    py::gil_scoped_release release;  // blocks until every rank has joined
    status = NcclComm::create(lib, id, rank, world_size, device, &comm);
  }
  dk::bindings::check(status, "[rank " + std::to_string(rank) + "] NCCL communicator");
  return comm;
}

// Runs `fn` (returning a Status) without the GIL, then raises on failure.
template <typename Fn>
void callReleased(const NcclComm& comm, const char* what, Fn fn) {
  dk::Status status;
  {
    py::gil_scoped_release release;
    status = fn();
  }
  dk::bindings::check(status, "[rank " + std::to_string(comm.rank()) + "] " + what);
}

void bindComm(py::module_& m) {
  py::class_<NcclComm>(m, "NcclComm")
      .def(py::init(&makeComm), py::arg("unique_id"), py::arg("rank"), py::arg("world_size"),
           py::arg("device"))
      .def_property_readonly("rank", &NcclComm::rank)
      .def_property_readonly("world_size", &NcclComm::worldSize)
      .def_property_readonly("device", &NcclComm::device)
      .def("close", [](NcclComm& c) { callReleased(c, "close", [&] { return c.close(); }); })
      .def("abort", [](NcclComm& c) { callReleased(c, "abort", [&] { return c.abort(); }); })
      .def_property_readonly("closed", &NcclComm::closed)
      .def(
          "async_error",
          [](NcclComm& c) -> py::object {
            std::string message;
            dk::bindings::check(c.asyncError(&message),
                                "[rank " + std::to_string(c.rank()) + "] async_error");
            return message.empty() ? py::object(py::none()) : py::object(py::str(message));
          },
          "NCCL's asynchronous error in words, or None while there is none.")
      .def(
          "last_error", [](NcclComm& c) { return dk::nccl::lastError(c.api()); },
          "ncclGetLastError's text ('' when none, or NCCL older than 2.13).")
      .def("all_reduce",
           [](NcclComm& c, uintptr_t send, uintptr_t recv, size_t count, int dtype, int op,
              uintptr_t stream) {
             callReleased(c, "all_reduce", [&] {
               return dk::nccl::allReduce(c, ptr(send), ptr(recv), count,
                                          static_cast<dk::DType>(dtype), static_cast<dk::RedOp>(op),
                                          ptr(stream));
             });
           })
      .def("reduce_scatter",
           [](NcclComm& c, uintptr_t send, uintptr_t recv, size_t count, int dtype, int op,
              uintptr_t stream) {
             callReleased(c, "reduce_scatter", [&] {
               return dk::nccl::reduceScatter(c, ptr(send), ptr(recv), count,
                                              static_cast<dk::DType>(dtype),
                                              static_cast<dk::RedOp>(op), ptr(stream));
             });
           })
      .def("all_gather",
           [](NcclComm& c, uintptr_t send, uintptr_t recv, size_t count, int dtype,
              uintptr_t stream) {
             callReleased(c, "all_gather", [&] {
               return dk::nccl::allGather(c, ptr(send), ptr(recv), count,
                                          static_cast<dk::DType>(dtype), ptr(stream));
             });
           })
      .def("broadcast", [](NcclComm& c, uintptr_t send, uintptr_t recv, size_t count, int dtype,
                           int root, uintptr_t stream) {
        callReleased(c, "broadcast", [&] {
          return dk::nccl::broadcast(c, ptr(send), ptr(recv), count, static_cast<dk::DType>(dtype),
                                     root, ptr(stream));
        });
      });
}

#if DK_WITH_CUDA

using dk::nccl::NcclTransport;

// A transport and the compute on its stream, bound together for Python.
struct TransportHandle {
  NcclComm* comm;
  std::unique_ptr<NcclTransport> transport;
  std::unique_ptr<dk::CudaCompute> compute;
};

std::unique_ptr<TransportHandle> makeTransport(NcclComm& comm, uintptr_t stream, uintptr_t staging,
                                               size_t slot_bytes, int num_slots) {
  auto handle = std::make_unique<TransportHandle>();
  handle->comm = &comm;
  dk::bindings::check(NcclTransport::create(&comm, ptr(stream), ptr(staging), slot_bytes, num_slots,
                                            &handle->transport),
                      "NcclTransport");
  handle->compute = std::make_unique<dk::CudaCompute>(ptr(stream));
  return handle;
}

void bindTransport(py::module_& m) {
  py::class_<TransportHandle>(m, "NcclTransport")
      .def(py::init(&makeTransport), py::arg("comm"), py::arg("stream"), py::arg("staging"),
           py::arg("slot_bytes"), py::arg("num_slots"), py::keep_alive<1, 2>())
      .def_property_readonly("max_message_bytes",
                             [](TransportHandle& h) { return h.transport->maxMessageBytes(); })
      .def(
          "send_recv",
          [](TransportHandle& h, uintptr_t send, size_t send_bytes, int send_peer, uintptr_t recv,
             size_t recv_bytes, int recv_peer) {
            callReleased(*h.comm, "send_recv", [&] {
              return dk::pairwiseExchange(*h.transport, *h.compute, ptr(send), send_bytes,
                                          send_peer, ptr(recv), recv_bytes, recv_peer);
            });
          },
          py::arg("send"), py::arg("send_bytes"), py::arg("send_peer"), py::arg("recv"),
          py::arg("recv_bytes"), py::arg("recv_peer"));
}

#endif  // DK_WITH_CUDA

}  // namespace

DK_REGISTER_BINDINGS(nccl_comm) {
  m.def("nccl_unique_id", &uniqueId, "A new ncclUniqueId (128 bytes) from the loaded NCCL.");
  bindComm(m);
#if DK_WITH_CUDA
  bindTransport(m);  // CPU-only builds have none; dist_kernels' CUDA communicator says why
#endif
}
