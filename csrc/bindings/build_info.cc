// What was compiled in: CUDA or not, runtime version, architectures, visible devices.
#include <pybind11/pybind11.h>

#include "bindings/errors.h"
#include "bindings/registry.h"
#include "common/core_probe.h"

#if DK_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace py = pybind11;

namespace {

// Never raises: a CUDA build on a machine without a driver or GPU reports 0 devices.
int visibleDeviceCount() {
#if DK_WITH_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error so later calls start clean
    return 0;
  }
  return count;
#else
  return 0;
#endif
}

py::dict buildInfo() {
  py::dict info;
  info["cuda_compiled"] = static_cast<bool>(DK_WITH_CUDA);
#if DK_WITH_CUDA
  int runtime = 0;
  if (cudaRuntimeGetVersion(&runtime) == cudaSuccess) {
    info["cuda_runtime_version"] =
        std::to_string(runtime / 1000) + "." + std::to_string((runtime % 1000) / 10);
  } else {
    cudaGetLastError();
    info["cuda_runtime_version"] = py::none();
  }
  info["cuda_archs"] = std::string(DK_CUDA_ARCHS_STR);
#else
  info["cuda_runtime_version"] = py::none();
  info["cuda_archs"] = py::none();
#endif
  info["device_count"] = visibleDeviceCount();
  return info;
}

double crossCoreRoundTrip(int cpuA, int cpuB, int iterations, int batches) {
  double ns = 0.0;
  dk::Status status;
  {
    py::gil_scoped_release spinning;  // up to milliseconds of hand-offs
    status = dk::probe::crossCoreRoundTripNs(cpuA, cpuB, iterations, batches, &ns);
  }
  dk::bindings::check(status, "cross_core_round_trip_ns");
  return ns;
}

}  // namespace

DK_REGISTER_BINDINGS(build_info) {
  m.def("build_info", &buildInfo, "What the extension was compiled with and what it sees.");
  m.def("cross_core_round_trip_ns", &crossCoreRoundTrip, py::arg("cpu_a"), py::arg("cpu_b"),
        py::arg("iterations") = 2000, py::arg("batches") = 5,
        "Median round trip of a cache line between threads pinned to two CPUs, in ns.");
}
