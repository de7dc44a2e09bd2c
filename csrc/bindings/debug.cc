// Bindings of the flight recorder and of the debug monitor's wake-up channel. Python formats
// what these return (dist_kernels/debug/): torch's dump format, traces, the desync report.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <time.h>

#include <memory>
#include <optional>
#include <string>

#include "bindings/errors.h"
#include "bindings/registry.h"
#include "bindings/trace_frames.h"
#include "comm/flight_recorder.h"
#include "common/debug_wakeup.h"

namespace py = pybind11;

namespace dk::bindings {

namespace {

// A stack deeper than this keeps its innermost frames: the call site is what matters.
constexpr size_t kMaxFrames = 64;

int64_t threadCpuNs() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

py::list framesList(const TraceFrames& frames) {
  py::list out;
  if (frames == nullptr) return out;
  for (const TraceFrame& f : *frames) {
    py::dict frame;
    frame["name"] = f.name;
    frame["filename"] = f.filename;
    frame["line"] = f.line;
    out.append(frame);
  }
  return out;
}

py::dict entryDict(const TraceEntry& e) {
  py::dict d;
  d["op_id"] = e.opId;
  d["collective_seq_id"] = e.collectiveSeq;
  d["p2p_seq_id"] = e.p2pSeq;
  d["op"] = traceOpName(e.call.op);
  d["is_p2p"] = isPointToPoint(e.call.op);
  d["dtype"] = e.call.dtype;
  d["red_op"] = e.call.redOp;
  d["peer"] = e.call.peer;
  d["algorithm"] = e.call.algorithm;
  d["in_count"] = e.call.inCount;
  d["out_count"] = e.call.outCount;
  d["state"] = traceStateName(e.state);
  d["created_ns"] = e.createdNs;
  d["started_ns"] = e.startedNs;
  d["completed_ns"] = e.completedNs;
  d["frames"] = framesList(e.call.frames);
  return d;
}

py::dict footprintDict(const FlightRecorder& recorder) {
  const TraceFootprint f = recorder.footprint();
  py::dict d;
  d["last_scheduled"] = f.lastScheduled;
  d["last_started"] = f.lastStarted;
  d["last_completed"] = f.lastCompleted;
  d["last_p2p_scheduled"] = f.lastP2pScheduled;
  d["last_p2p_completed"] = f.lastP2pCompleted;
  d["calls"] = f.calls;
  d["failed_op_id"] = f.failedOpId;
  d["failed_ns"] = f.failedNs;
  d["failure"] = recorder.failureCause();
  return d;
}

uint64_t scheduleFromPython(FlightRecorder& r, const std::string& op, int dtype, int redOp,
                            int peer, int algorithm, uint64_t inCount, uint64_t outCount) {
  static const TraceOp kOps[] = {TraceOp::kAllReduce, TraceOp::kReduceScatter, TraceOp::kAllGather,
                                 TraceOp::kBroadcast, TraceOp::kAllToAll,      TraceOp::kBarrier,
                                 TraceOp::kSend,      TraceOp::kRecv};
  for (TraceOp candidate : kOps) {
    if (op == traceOpName(candidate)) {
      TraceCall call{candidate, dtype, redOp, peer, algorithm, inCount, outCount, nullptr};
      if (r.capturesStacks()) call.frames = capturePythonStack();
      return r.schedule(std::move(call));
    }
  }
  check(InvalidArgument("unknown operation '" + op + "'"), "FlightRecorder.schedule");
  return 0;
}

// The recorder's own cost: schedule + started + completed of one call, in ns of this thread's
// CPU time (time slices lost to other processes on a loaded machine do not count), over
// `iterations` calls in C++ (no Python, no peers). benchmarks/bench_recorder.py prints it beside
// the end-to-end difference.
double recorderCostNs(size_t capacity, size_t iterations) {
  py::gil_scoped_release nogil;
  FlightRecorder recorder(capacity, false);
  TraceCall call{TraceOp::kAllReduce, 0, 0, -1, 0, 2, 2, nullptr};
  const int64_t start = threadCpuNs();
  for (size_t i = 0; i < iterations; ++i) {
    const uint64_t id = recorder.schedule(call);
    recorder.started(id, 3);
    recorder.completed(id);
  }
  return static_cast<double>(threadCpuNs() - start) /
         static_cast<double>(iterations ? iterations : 1);
}

void bindRecorder(py::module_& m) {
  py::class_<FlightRecorder, std::shared_ptr<FlightRecorder>>(
      m, "FlightRecorder", "The last N calls of one communicator (csrc/comm/flight_recorder.h).")
      .def(py::init<size_t, bool>(), py::arg("capacity"), py::arg("capture_stacks") = false)
      .def_property("capacity", &FlightRecorder::capacity, &FlightRecorder::setCapacity)
      .def_property_readonly("captures_stacks", &FlightRecorder::capturesStacks)
      .def(
          "entries",
          [](const FlightRecorder& r, std::optional<size_t> last) {
            py::list out;
            for (const TraceEntry& e : r.snapshot(last.value_or(SIZE_MAX))) {
              out.append(entryDict(e));
            }
            return out;
          },
          py::arg("last") = py::none())
      .def("footprint", &footprintDict)
      .def("next_seq", &FlightRecorder::nextSeq, py::arg("p2p"))
      // For communicators driven from Python (CUDA): the CPU one records in C++.
      .def("schedule", &scheduleFromPython, py::arg("op"), py::arg("dtype"), py::arg("red_op"),
           py::arg("peer"), py::arg("algorithm"), py::arg("in_count"), py::arg("out_count"))
      .def("started", &FlightRecorder::started, py::arg("op_id"), py::arg("algorithm"))
      .def("completed", &FlightRecorder::completed, py::arg("op_id"))
      .def("failed", &FlightRecorder::failed, py::arg("op_id"), py::arg("cause"));
  m.def("_flight_recorder_cost_ns", &recorderCostNs, py::arg("capacity"), py::arg("iterations"));
}

void bindWakeup(py::module_& m) {
  m.def("debug_wakeup_fd", [] {
    int fd = -1;
    check(debug_wakeup::open(&fd), "debug monitor");
    return fd;
  });
  m.def("debug_handle_sigusr1", [] {
    bool installed = false;
    check(debug_wakeup::handleSigusr1(&installed), "debug monitor");
    return installed;
  });
  m.def("debug_notify", [](const std::string& reason) {
    if (reason.size() == 1) debug_wakeup::notify(reason[0]);
  });
}

}  // namespace

TraceFrames capturePythonStack() {
  auto frames = std::make_shared<std::vector<TraceFrame>>();
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  while (frame != nullptr && frames->size() < kMaxFrames) {
    py::object code =
        py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(PyFrame_GetCode(frame)));
    frames->push_back({code.attr("co_name").cast<std::string>(),
                       code.attr("co_filename").cast<std::string>(), PyFrame_GetLineNumber(frame)});
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  return frames;
}

}  // namespace dk::bindings

DK_REGISTER_BINDINGS(debug) {
  dk::bindings::bindRecorder(m);
  dk::bindings::bindWakeup(m);
}
