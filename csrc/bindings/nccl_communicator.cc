// _C.NcclCommunicator(unique_ids, rank, world_size, device, stream, slot_bytes, num_slots): the
// C++ communicator over NCCL (comm/nccl_communicator.h), in every build (device -1 runs on host
// memory: the CPU tests drive it with a fake NCCL). _C.ALGORITHMS: name -> code of
// algo::Algorithm. _C.cuda_capture_id(stream): the CUDA graph capture a stream takes part in.
// Pointers and streams travel as integers; every call releases the GIL and raises on failure
// with "[rank r] <collective>: ...".
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bindings/errors.h"
#include "bindings/nccl_library.h"
#include "bindings/registry.h"
#include "comm/lane_streams.h"
#include "comm/nccl_communicator.h"

namespace py = pybind11;

namespace {

using dk::NcclCommunicator;

void* ptr(uintptr_t address) { return reinterpret_cast<void*>(address); }
dk::DType dtypeOf(int code) { return static_cast<dk::DType>(code); }
dk::RedOp opOf(int code) { return static_cast<dk::RedOp>(code); }
dk::algo::Algorithm algorithmOf(int code) { return static_cast<dk::algo::Algorithm>(code); }

std::unique_ptr<NcclCommunicator> make(const std::vector<py::bytes>& unique_ids, int rank,
                                       int world_size, int device, uintptr_t stream,
                                       size_t slot_bytes, int num_slots) {
  std::vector<dk::nccl::ncclUniqueId> ids;
  for (const py::bytes& id : unique_ids) ids.push_back(dk::bindings::uniqueIdFrom(id));
  const dk::nccl::NcclLibrary& library = dk::bindings::ncclLibrary();
  std::unique_ptr<NcclCommunicator> out;
  dk::Status status;
  {
    py::gil_scoped_release release;  // blocks until every rank has joined
    status = NcclCommunicator::create(library, ids, rank, world_size, device, ptr(stream),
                                      {slot_bytes, num_slots}, &out);
  }
  dk::bindings::check(status, "[rank " + std::to_string(rank) + "] NCCL communicator");
  return out;
}

// Runs `fn` (returning a Status) without the GIL, then raises on failure.
template <typename Fn>
void call(const NcclCommunicator& c, const char* what, Fn fn) {
  dk::Status status;
  {
    py::gil_scoped_release release;
    status = fn();
  }
  dk::bindings::check(status, "[rank " + std::to_string(c.rank()) + "] " + what);
}

py::object asyncError(const NcclCommunicator& c) {
  std::string message;
  dk::bindings::check(c.asyncError(&message), "[rank " + std::to_string(c.rank()) + "] NCCL");
  return message.empty() ? py::object(py::none()) : py::object(py::str(message));
}

void bindState(py::class_<NcclCommunicator>& c) {
  c.def_property_readonly("rank", &NcclCommunicator::rank)
      .def_property_readonly("world_size", &NcclCommunicator::worldSize)
      .def_property_readonly("device", &NcclCommunicator::device)
      .def_property_readonly("lanes", &NcclCommunicator::lanes)
      .def_property_readonly("max_message_bytes", &NcclCommunicator::maxMessageBytes)
      .def_property_readonly("closed", &NcclCommunicator::closed)
      .def(
          "resolve",
          [](const NcclCommunicator& c, int algorithm, size_t bytes) {
            return static_cast<int>(c.resolve(algorithmOf(algorithm), bytes));
          },
          py::arg("algorithm"), py::arg("bytes"), "The algorithm code `algorithm` runs.")
      .def("async_error", &asyncError, "NCCL's asynchronous error in words, or None.")
      .def("last_error", &NcclCommunicator::lastError, "ncclGetLastError's text, or ''.")
      .def("close", [](NcclCommunicator& c) { call(c, "close", [&] { return c.close(); }); })
      .def("abort", [](NcclCommunicator& c) { call(c, "abort", [&] { return c.abort(); }); });
}

void bindCollectives(py::class_<NcclCommunicator>& c) {
  c.def("all_reduce",
        [](NcclCommunicator& c, uintptr_t src, uintptr_t dst, size_t count, int dtype, int op,
           int algorithm) {
          call(c, "all_reduce", [&] {
            return c.allReduce(ptr(src), ptr(dst), count, dtypeOf(dtype), opOf(op),
                               algorithmOf(algorithm));
          });
        })
      .def("reduce_scatter", [](NcclCommunicator& c, uintptr_t src, uintptr_t dst, size_t count,
                                int dtype, int op, int algorithm) {
        call(c, "reduce_scatter", [&] {
          return c.reduceScatter(ptr(src), ptr(dst), count, dtypeOf(dtype), opOf(op),
                                 algorithmOf(algorithm));
        });
      });
  c.def("all_gather",
        [](NcclCommunicator& c, uintptr_t src, uintptr_t dst, size_t count, int dtype,
           int algorithm) {
          call(c, "all_gather", [&] {
            return c.allGather(ptr(src), ptr(dst), count, dtypeOf(dtype), algorithmOf(algorithm));
          });
        })
      .def("broadcast", [](NcclCommunicator& c, uintptr_t data, size_t count, int dtype, int root,
                           int algorithm) {
        call(c, "broadcast", [&] {
          return c.broadcast(ptr(data), count, dtypeOf(dtype), root, algorithmOf(algorithm));
        });
      });
  c.def("send_recv", [](NcclCommunicator& c, uintptr_t send, size_t send_bytes, int send_peer,
                        uintptr_t recv, size_t recv_bytes, int recv_peer) {
    call(c, "send_recv", [&] {
      return c.sendRecv(ptr(send), send_bytes, send_peer, ptr(recv), recv_bytes, recv_peer);
    });
  });
}

py::dict algorithmCodes() {
  py::dict codes;
  for (int i = 0; i < dk::algo::kNumAlgorithms; ++i) {
    codes[py::str(dk::algo::algorithmName(algorithmOf(i)))] = i;
  }
  return codes;
}

}  // namespace

DK_REGISTER_BINDINGS(nccl_communicator) {
  py::class_<NcclCommunicator> c(m, "NcclCommunicator");
  c.def(py::init(&make), py::arg("unique_ids"), py::arg("rank"), py::arg("world_size"),
        py::arg("device"), py::arg("stream"), py::arg("slot_bytes"), py::arg("num_slots"));
  bindState(c);
  bindCollectives(c);
  m.attr("ALGORITHMS") = algorithmCodes();
  m.def(
      "cuda_capture_id",
      [](uintptr_t stream) {
        unsigned long long id = 0;
        dk::bindings::check(dk::streamCaptureId(ptr(stream), &id), "cuda_capture_id");
        return id;
      },
      py::arg("stream"), "The CUDA graph capture `stream` takes part in, or 0.");
}
