// Python entry points of the NCCL loader: _C.nccl_load(path) -> "2.x.y", _C.nccl_loaded().
#include <pybind11/pybind11.h>

#include <string>

#include "bindings/errors.h"
#include "bindings/registry.h"
#include "transport/nccl_loader.h"

namespace py = pybind11;

namespace {

std::string ncclLoad(const std::string& path) {
  const dk::nccl::NcclLibrary* library = nullptr;
  dk::Status status;
  {
    py::gil_scoped_release release;  // dlopen of NCCL can take a while (static initialisers)
    status = dk::nccl::loadNccl(path, &library);
  }
  dk::bindings::check(status, "nccl_load");
  return dk::nccl::versionString(library->version);
}

py::object ncclLoaded() {
  const dk::nccl::NcclLibrary* library = dk::nccl::loadedNccl();
  if (library == nullptr) return py::none();
  return py::make_tuple(library->path, dk::nccl::versionString(library->version));
}

}  // namespace

DK_REGISTER_BINDINGS(nccl) {
  m.def("nccl_load", &ncclLoad, py::arg("path"),
        "Loads NCCL from an absolute path (once per process); returns its version '2.x.y'.");
  m.def("nccl_loaded", &ncclLoaded, "(path, version) of the loaded NCCL, or None.");
}
