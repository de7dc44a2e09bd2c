// Python entry points of the NCCL loader: _C.nccl_load(path) -> "2.x.y", _C.nccl_loaded(), and
// _C.nccl_unique_id() -> 128 bytes (rank 0 makes one per lane; the Store carries them).
#include <pybind11/pybind11.h>

#include <string>

#include "bindings/errors.h"
#include "bindings/nccl_library.h"
#include "bindings/registry.h"
#include "transport/nccl_comm.h"
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

py::bytes uniqueId() {
  dk::nccl::ncclUniqueId id;
  dk::bindings::check(dk::nccl::NcclComm::newUniqueId(dk::bindings::ncclLibrary(), &id),
                      "nccl_unique_id");
  return py::bytes(id.internal, sizeof(id.internal));
}

}  // namespace

DK_REGISTER_BINDINGS(nccl) {
  m.def("nccl_load", &ncclLoad, py::arg("path"),
        "Loads NCCL from an absolute path (once per process); returns its version '2.x.y'.");
  m.def("nccl_loaded", &ncclLoaded, "(path, version) of the loaded NCCL, or None.");
  m.def("nccl_unique_id", &uniqueId, "A new ncclUniqueId (128 bytes) from the loaded NCCL.");
}
