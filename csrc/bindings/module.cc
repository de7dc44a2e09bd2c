// The extension module: exceptions first, then every component's registered binder.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "bindings/errors.h"
#include "bindings/registry.h"

namespace py = pybind11;

namespace dk::bindings {

namespace {
std::vector<std::pair<std::string, BindFn>>& binders() {
  static std::vector<std::pair<std::string, BindFn>> list;
  return list;
}
}  // namespace

int registerBinder(const char* name, BindFn fn) {
  binders().emplace_back(name, fn);
  return 0;
}

void throwStatus(const Status& status, const std::string& context) {
  const std::string msg = context.empty() ? status.message() : context + ": " + status.message();
  switch (status.code()) {
    case Code::kOk:
      throw std::logic_error("throwStatus called with an OK status: " + msg);
    case Code::kInvalidArgument:
      throw py::value_error(msg);
    case Code::kTypeError:
      throw py::type_error(msg);
    case Code::kUnsupported:
    case Code::kInternal:
      throw std::runtime_error(msg);
    default:
      throw CommErrorException(msg);
  }
}

}  // namespace dk::bindings

PYBIND11_MODULE(_C, m) {
  m.doc() = "dist_kernels C++/CUDA core: kernels, transports, algorithms, communicator";
  py::register_exception<dk::bindings::CommErrorException>(m, "CommError", PyExc_RuntimeError);
  auto list = dk::bindings::binders();
  std::sort(list.begin(), list.end());  // deterministic order, independent of link order
  for (const auto& entry : list) entry.second(m);
}
