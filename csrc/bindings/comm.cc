// Bindings of the CPU communicator: shared-memory segments (with the buffer protocol, so
// torch.frombuffer can view them), the communicator and its Work handles. Pointers arrive as
// integers (tensor.data_ptr()); the Python layer checks tensors before they get here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "algorithm/select.h"
#include "algorithm/topology.h"
#include "bindings/errors.h"
#include "bindings/registry.h"
#include "bindings/trace_frames.h"
#include "comm/cpu_communicator.h"
#include "transport/shm_layout.h"
#include "transport/shm_segment.h"

namespace py = pybind11;

namespace dk::bindings {

namespace {

using SegmentPtr = std::shared_ptr<shm::Segment>;

// A communicator plus the rank name used in error messages ("[rank 3] all_reduce").
// Shared: every call takes its own reference (under the GIL) before releasing the GIL, so a
// close() from another thread never frees the communicator under a running call.
struct PyCommunicator {
  std::shared_ptr<CpuCommunicator> comm;
  int label;
  bool captureStacks = false;  // its flight recorder wants each call's Python stack
  std::string context(const std::string& what) const {
    return "[rank " + std::to_string(label) + "] " + what;
  }
  std::string context(const Request& r) const { return context(requestName(r)); }
  // The communicator, or a CommError naming `what` once it is closed. `what` is a C string:
  // the hot path of a small collective builds no string unless it fails.
  std::shared_ptr<CpuCommunicator> live(const char* what) const {
    if (!comm) check(Status(Code::kPeerFailure, "the communicator is closed"), context(what));
    return comm;
  }
};

SegmentPtr createSegment(size_t bytes) {
  SegmentPtr seg;
  check(shm::Segment::create(bytes, &seg), "shared memory");
  return seg;
}

SegmentPtr openSegment(const std::string& name, size_t bytes) {
  SegmentPtr seg;
  check(shm::Segment::open(name, bytes, &seg), "shared memory");
  return seg;
}

void formatSegment(shm::Segment& seg, int worldSize) {
  check(shm::ShmTransport::formatSegment(seg, shm::defaultGeometry(worldSize)), "shared memory");
}

// (alpha, beta, knee, beta beyond the knee) of ring, tree, one-shot all-reduce, then ring,
// one-shot all-gather and reduce-scatter (dist_kernels.comm.cost_model.FITTED_ORDER); empty:
// none fitted.
std::optional<algo::AlgorithmCosts> fittedModels(const std::vector<double>& costs) {
  constexpr size_t kPerModel = 4, kModels = 7;
  if (costs.empty()) return std::nullopt;
  if (costs.size() != kPerModel * kModels) {
    throw py::value_error(
        "fitted_costs: 28 numbers (alpha, beta, knee, beta far of 7 "
        "algorithms), got " +
        std::to_string(costs.size()));
  }
  auto at = [&](size_t i) {
    const double* c = &costs[kPerModel * i];
    return algo::CostModel{c[0], c[1], c[2], c[3]};
  };
  return algo::AlgorithmCosts{at(0), at(1), at(2), at(3), at(4), at(5), at(6)};
}

std::unique_ptr<PyCommunicator> makeCommunicator(SegmentPtr seg, int rank, double timeoutSec,
                                                 bool oversubscribed, bool debug, int label,
                                                 bool checkDescriptors,
                                                 std::shared_ptr<FlightRecorder> recorder,
                                                 const std::vector<double>& fittedCosts) {
  auto out = std::make_unique<PyCommunicator>();
  out->label = label;
  out->captureStacks = recorder != nullptr && recorder->capturesStacks();
  CpuCommunicator::Options options{
      timeoutSec,       oversubscribed,      debug,
      checkDescriptors, std::move(recorder), fittedModels(fittedCosts)};
  std::unique_ptr<CpuCommunicator> comm;
  Status s;
  {
    py::gil_scoped_release nogil;
    s = CpuCommunicator::create(std::move(seg), rank, options, &comm);
  }
  check(s, out->context("Communicator"));
  out->comm = std::move(comm);
  return out;
}

// Python runs signal handlers on its main thread only, so only a call blocked there can turn
// a Ctrl-C into KeyboardInterrupt (the thread that imported the extension: the main one).
bool onMainThread() {
  static const unsigned long mainThread = PyThread_get_thread_ident();
  return PyThread_get_thread_ident() == mainThread;
}

// A wait that a SIGINT ended (the communicator is failed by then): let Python run its SIGINT
// handler, which raises KeyboardInterrupt; a handler that raises nothing leaves a CommError.
void checkInterrupted(const Status& s, const std::string& context) {
  if (s.code() == Code::kInterrupted && PyErr_CheckSignals() != 0) throw py::error_already_set();
  check(s, context);
}

// Runs inline (GIL released) or queues and returns a Work; a synchronous receive from any
// source returns the sender's rank.
py::object runRequest(PyCommunicator& c, Request r, bool asyncOp) {
  const std::shared_ptr<CpuCommunicator> comm = c.live(requestName(r));
  r.interruptible = !asyncOp && onMainThread();
  if (c.captureStacks) r.frames = capturePythonStack();
  Status s;
  std::shared_ptr<Work> work;
  {
    py::gil_scoped_release nogil;
    s = asyncOp ? comm->submit(r, &work) : comm->run(r);
  }
  if (!s.ok()) checkInterrupted(s, c.context(r));
  if (asyncOp) {
    work->context = c.context(r);
    work->source = r.source;
    work->onInterrupt = [weak = std::weak_ptr<CpuCommunicator>(comm), label = c.label,
                         what = std::string(requestName(r))](const Status&) {
      if (const auto live = weak.lock()) {
        live->abort(Status(
            Code::kInterrupted,
            "rank " + std::to_string(label) + " was interrupted (SIGINT) in Work.wait of " + what));
      }
    };
    return py::cast(work);
  }
  if (r.source) return py::int_(*r.source);
  return py::none();
}

Request makeRequest(shm::CollectiveKind kind, uintptr_t src, uintptr_t dst, size_t count, int dtype,
                    int op, int root, int algorithm) {
  Request r;
  r.kind = kind;
  r.algorithm = static_cast<algo::Algorithm>(algorithm);
  r.args.src = reinterpret_cast<const void*>(src);
  r.args.dst = reinterpret_cast<void*>(dst);
  r.args.count = count;
  r.args.dtype = static_cast<DType>(dtype);
  r.args.op = static_cast<RedOp>(op);
  r.args.root = root;
  return r;
}

void bindSegment(py::module_& m) {
  py::class_<shm::Segment, SegmentPtr>(m, "ShmSegment", py::buffer_protocol(),
                                       "A mapped POSIX shared-memory segment.")
      .def_static("create", &createSegment, py::arg("bytes"))
      .def_static("open", &openSegment, py::arg("name"), py::arg("bytes"))
      .def_property_readonly("name", &shm::Segment::name)
      .def_property_readonly("size", &shm::Segment::size)
      .def_property_readonly(
          "address", [](const shm::Segment& s) { return reinterpret_cast<uintptr_t>(s.data()); })
      .def("unlink", [](shm::Segment& s) { check(s.unlink(), "shared memory"); })
      .def_buffer([](shm::Segment& s) {
        return py::buffer_info(s.data(), 1, py::format_descriptor<uint8_t>::format(), 1, {s.size()},
                               {1});
      });
  m.def("shm_segment_bytes",
        [](int worldSize) { return shm::defaultGeometry(worldSize).totalBytes; });
  m.def("shm_slot_bytes", [](int worldSize) { return shm::defaultGeometry(worldSize).slotBytes; });
  // The largest message of the small-message boxes (ShmTransport::exchangeSmall), and so of
  // `auto`'s one-shot rule under the built-in cost model.
  m.def("shm_small_message_bytes", [] { return shm::kLowLatencyBytes; });
  m.def("shm_format", &formatSegment, py::arg("segment"), py::arg("world_size"));
}

void bindWork(py::module_& m) {
  py::class_<Work, std::shared_ptr<Work>>(m, "CommWork")
      .def(
          "wait",
          [](const Work& w, std::optional<double> timeout) {
            const bool interruptible = onMainThread();
            Status s;
            {
              py::gil_scoped_release nogil;
              s = w.wait(timeout ? *timeout : -1.0, interruptible);
              if (s.code() == Code::kInterrupted && w.onInterrupt) w.onInterrupt(s);
            }
            checkInterrupted(s, w.context);
          },
          py::arg("timeout") = py::none())
      .def("is_completed", &Work::isCompleted)
      // The sender of a completed receive from any source (-1 otherwise).
      .def("source_rank",
           [](const Work& w) { return w.source && w.isCompleted() ? *w.source : -1; });
}

void bindCommunicator(py::module_& m) {
  using K = shm::CollectiveKind;
  onMainThread();  // pins the importing thread (the main one) as the one signals reach
  py::class_<PyCommunicator>(m, "CpuCommunicator")
      .def(py::init(&makeCommunicator), py::arg("segment"), py::arg("rank"), py::arg("timeout_s"),
           py::arg("oversubscribed"), py::arg("debug"), py::arg("label"),
           py::arg("check_descriptors") = true, py::arg("recorder") = nullptr,
           py::arg("fitted_costs") = std::vector<double>{})
      .def_property_readonly("rank", [](PyCommunicator& c) { return c.live("rank")->rank(); })
      .def_property_readonly("world_size",
                             [](PyCommunicator& c) { return c.live("world_size")->worldSize(); })
      .def("all_reduce",
           [](PyCommunicator& c, uintptr_t ptr, size_t count, int dtype, int op, int algorithm,
              bool asyncOp) {
             return runRequest(
                 c, makeRequest(K::kAllReduce, ptr, ptr, count, dtype, op, 0, algorithm), asyncOp);
           })
      .def("reduce_scatter",
           [](PyCommunicator& c, uintptr_t out, uintptr_t in, size_t count, int dtype, int op,
              int algorithm, bool asyncOp) {
             return runRequest(
                 c, makeRequest(K::kReduceScatter, in, out, count, dtype, op, 0, algorithm),
                 asyncOp);
           })
      .def("all_gather",
           [](PyCommunicator& c, uintptr_t out, uintptr_t in, size_t count, int dtype,
              int algorithm, bool asyncOp) {
             return runRequest(
                 c, makeRequest(K::kAllGather, in, out, count, dtype, 0, 0, algorithm), asyncOp);
           })
      .def("broadcast",
           [](PyCommunicator& c, uintptr_t ptr, size_t count, int dtype, int root, bool asyncOp) {
             return runRequest(c, makeRequest(K::kBroadcast, ptr, ptr, count, dtype, 0, root, 0),
                               asyncOp);
           })
      // `tag`: torch's point-to-point tag (TaggedReceiver matches receives by it).
      .def("send",
           [](PyCommunicator& c, uintptr_t ptr, size_t count, int dtype, int peer, bool asyncOp,
              int32_t tag) {
             Request r = makeRequest(K::kSendRecv, ptr, ptr, count, dtype, 0, peer, 0);
             r.isSend = true;
             r.tag = tag;
             return runRequest(c, r, asyncOp);
           })
      .def("recv",
           [](PyCommunicator& c, uintptr_t ptr, size_t count, int dtype, int peer, bool asyncOp,
              int32_t tag) {
             Request r = makeRequest(K::kSendRecv, ptr, ptr, count, dtype, 0, peer, 0);
             r.tag = tag;
             return runRequest(c, r, asyncOp);
           })
      .def(
          "recv_any",
          [](PyCommunicator& c, uintptr_t ptr, size_t count, int dtype, bool asyncOp, int32_t tag) {
            Request r = makeRequest(K::kSendRecv, ptr, ptr, count, dtype, 0, -1, 0);
            r.source = std::make_shared<int>(-1);
            r.tag = tag;
            return runRequest(c, r, asyncOp);
          })
      .def("set_timeout",
           [](PyCommunicator& c, double seconds) { c.live("set_timeout")->setTimeout(seconds); })
      .def("dead_peers", [](PyCommunicator& c) { return c.live("dead_peers")->deadPeers(); })
      .def("all_to_all",
           [](PyCommunicator& c, uintptr_t out, uintptr_t in, std::vector<size_t> sendCounts,
              std::vector<size_t> recvCounts, int dtype, bool asyncOp) {
             // Checked here, before anything is queued: a failure inside the collective
             // would poison the communicator.
             const auto comm = c.live("all_to_all");
             const size_t n = static_cast<size_t>(comm->worldSize());
             if (sendCounts.size() != n || recvCounts.size() != n) {
               check(InvalidArgument("send and receive counts must have world_size (" +
                                     std::to_string(n) + ") entries"),
                     c.context("all_to_all"));
             }
             const int me = comm->rank();
             if (sendCounts[me] != recvCounts[me]) {
               check(InvalidArgument("this rank sends itself " + std::to_string(sendCounts[me]) +
                                     " elements but expects to receive " +
                                     std::to_string(recvCounts[me])),
                     c.context("all_to_all"));
             }
             Request r = makeRequest(K::kAllToAll, in, out, 0, dtype, 0, 0, 0);
             r.sendCounts = std::move(sendCounts);
             r.recvCounts = std::move(recvCounts);
             return runRequest(c, std::move(r), asyncOp);
           })
      .def("barrier",
           [](PyCommunicator& c, bool asyncOp) {
             return runRequest(c, makeRequest(K::kBarrier, 0, 0, 0, 0, 0, 0, 0), asyncOp);
           })
      .def("resolve_all_reduce",
           [](PyCommunicator& c, size_t count, int dtype, int algorithm) {
             Request r = makeRequest(K::kAllReduce, 0, 0, count, dtype, 0, 0, algorithm);
             return static_cast<int>(c.live("all_reduce")->resolve(r));
           })
      // count: elements per rank (the per-peer chunk), as the collectives take it.
      .def("resolve_all_gather",
           [](PyCommunicator& c, size_t count, int dtype, int algorithm) {
             Request r = makeRequest(K::kAllGather, 0, 0, count, dtype, 0, 0, algorithm);
             return static_cast<int>(c.live("all_gather")->resolve(r));
           })
      .def("resolve_reduce_scatter",
           [](PyCommunicator& c, size_t count, int dtype, int algorithm) {
             Request r = makeRequest(K::kReduceScatter, 0, 0, count, dtype, 0, 0, algorithm);
             return static_cast<int>(c.live("reduce_scatter")->resolve(r));
           })
      .def("register_buffer",
           [](PyCommunicator& c, uint32_t id, SegmentPtr local, std::vector<SegmentPtr> peers) {
             const std::shared_ptr<CpuCommunicator> comm = c.live("empty");
             Status s;
             {
               py::gil_scoped_release nogil;
               s = comm->registerBuffer(id, std::move(local), std::move(peers));
             }
             check(s, c.context("empty"));
           })
      .def("abort",
           [](PyCommunicator& c, const std::string& reason) {
             const std::shared_ptr<CpuCommunicator> comm = c.comm;
             if (!comm) return;
             py::gil_scoped_release nogil;
             comm->abort(
                 Status(Code::kPeerFailure, "rank " + std::to_string(c.label) + " " + reason));
           })
      .def("close", [](PyCommunicator& c) {
        // Later calls see the communicator closed at once; calls running on other threads
        // hold their own reference and are cancelled by close().
        std::shared_ptr<CpuCommunicator> comm = std::move(c.comm);
        if (!comm) return;
        py::gil_scoped_release nogil;
        comm->close();
        comm.reset();  // the last reference, unless a cancelled call still returns
      });
}

py::tuple treeTuple(const algo::TreeNode& node) {
  std::vector<int> children(node.children, node.children + node.numChildren);
  return py::make_tuple(node.parent, children);
}

// The pure planners, for tests/test_topology.py and for printing plans.
void bindTopology(py::module_& m) {
  m.def("_ring_order", &algo::ringOrder, py::arg("world_size"));
  m.def(
      "_double_tree_node",
      [](int tree, int n, int rank) { return treeTuple(algo::doubleTreeNode(tree, n, rank)); },
      py::arg("tree"), py::arg("world_size"), py::arg("rank"));
  m.def(
      "_chain_node",
      [](int n, int root, int rank) { return treeTuple(algo::chainNode(n, root, rank)); },
      py::arg("world_size"), py::arg("root"), py::arg("rank"));
  m.def(
      "_heap_tree_node",
      [](int n, int root, int rank) { return treeTuple(algo::heapTreeNode(n, root, rank)); },
      py::arg("world_size"), py::arg("root"), py::arg("rank"));
  m.def(
      "_chunk_range",
      [](size_t count, int parts, int index, size_t granule) {
        const algo::Range r = algo::chunkRange(count, parts, index, granule);
        return py::make_tuple(r.offset, r.count);
      },
      py::arg("count"), py::arg("parts"), py::arg("index"), py::arg("granule"));
  m.def(
      "_shm_builtin_cost",
      [](bool oversubscribed) {
        const auto model = algo::shmCostModel(oversubscribed);
        return py::make_tuple(model.alphaUs, model.betaUsPerB);
      },
      py::arg("oversubscribed") = false);
  m.def(
      "_shm_all_reduce_cost_us",
      [](int n, size_t bytes, bool oversubscribed) {
        const auto model = algo::shmCostModel(oversubscribed);
        return py::make_tuple(algo::ringAllReduceUs(model, n, bytes),
                              algo::treeAllReduceUs(model, n, bytes),
                              algo::oneShotAllReduceUs(model, n, bytes));
      },
      py::arg("world_size"), py::arg("bytes"), py::arg("oversubscribed") = false);
  // bytes: the whole buffer (all-gather's output, reduce-scatter's input); returns (ring,
  // one_shot).
  m.def(
      "_shm_all_gather_cost_us",
      [](int n, size_t bytes, bool oversubscribed) {
        const auto model = algo::shmCostModel(oversubscribed);
        return py::make_tuple(algo::ringAllGatherUs(model, n, bytes),
                              algo::oneShotAllGatherUs(model, n, bytes));
      },
      py::arg("world_size"), py::arg("bytes"), py::arg("oversubscribed") = false);
  m.def(
      "_shm_reduce_scatter_cost_us",
      [](int n, size_t bytes, bool oversubscribed) {
        const auto model = algo::shmCostModel(oversubscribed);
        return py::make_tuple(algo::ringReduceScatterUs(model, n, bytes),
                              algo::oneShotReduceScatterUs(model, n, bytes));
      },
      py::arg("world_size"), py::arg("bytes"), py::arg("oversubscribed") = false);
}

}  // namespace

}  // namespace dk::bindings

DK_REGISTER_BINDINGS(comm) {
  dk::bindings::bindSegment(m);
  dk::bindings::bindWork(m);
  dk::bindings::bindCommunicator(m);
  dk::bindings::bindTopology(m);
}
