// record_param_comms events for torch.profiler, the way torch's own process groups emit them
// (RECORD_PARAM_COMMS_DATA in torch/csrc/distributed/c10d/ParamCommsUtils.hpp): a
// RecordFunction named "record_param_comms" while a ParamCommsDebugInfo describing the call is
// the thread's PARAM_COMMS_INFO, from which the profiler writes the event's "Collective name",
// "In msg nelems", "Out msg nelems", "dtype", "Group size", "Process Group Name", "Seq", ...
//
// The one part of dist_kernels that links libtorch: torch.utils.cpp_extension compiles it at
// first use against the torch in use (dist_kernels/debug/profiler.py), so dist_kernels._C stays
// free of libtorch (design decision 1). Only called while a profiler runs.
#include <ATen/record_function.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/distributed/c10d/ParamCommsUtils.hpp>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace py = pybind11;

namespace {

// One call's event: the debug info is the thread's while the RecordFunction is open.
class ParamCommsEvent {
 public:
  ParamCommsEvent(const std::string& group, const std::string& desc, int rank,
                  const std::string& name, int64_t inCount, int64_t outCount, py::handle dtype,
                  int rankStart, int rankStride, int groupSize, int64_t seq, bool pointToPoint,
                  bool async) {
    if (!THPDtype_Check(dtype.ptr())) throw py::type_error("dtype must be a torch.dtype");
    const at::ScalarType type = reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
    auto info = std::make_shared<torch::ParamCommsDebugInfo>(
        std::make_tuple(group, desc), rank, std::string(name), inCount, outCount, type,
        std::vector<int64_t>{}, std::vector<int64_t>{}, rankStart, rankStride, groupSize, async);
    info->setSequenceInfo(seq, pointToPoint);
    guard_.emplace(c10::DebugInfoKind::PARAM_COMMS_INFO, info);
    function_.emplace(at::RecordScope::FUNCTION);
    if (function_->isActive()) {
      // The inputs RECORD_PARAM_COMMS passes, for consumers that read them (execution traces).
      const std::vector<c10::IValue> inputs{
          c10::IValue(seq),       c10::IValue(std::make_tuple(group, desc)),
          c10::IValue(rank),      c10::IValue(name),
          c10::IValue(rankStart), c10::IValue(rankStride),
          c10::IValue(groupSize), c10::IValue(async)};
      at::detail::record_function_with_scope(
          *function_, at::kParamCommsCallName,
          c10::ArrayRef<const c10::IValue>(inputs.data(), inputs.size()));
    }
  }

  // Closes the event (the profiler reads the debug info before it is popped).
  void end() {
    function_.reset();
    guard_.reset();
  }

 private:
  std::optional<c10::DebugInfoGuard> guard_;
  std::optional<at::RecordFunction> function_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<ParamCommsEvent>(m, "ParamCommsEvent")
      .def(py::init<const std::string&, const std::string&, int, const std::string&, int64_t,
                    int64_t, py::handle, int, int, int, int64_t, bool, bool>(),
           py::arg("group"), py::arg("desc"), py::arg("rank"), py::arg("name"), py::arg("in_count"),
           py::arg("out_count"), py::arg("dtype"), py::arg("rank_start"), py::arg("rank_stride"),
           py::arg("group_size"), py::arg("seq"), py::arg("p2p"), py::arg("async_op"))
      .def("end", &ParamCommsEvent::end);
}
