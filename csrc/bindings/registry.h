// Each component binds its own functions in its own file with DK_REGISTER_BINDINGS(name) { ... };
// module.cc runs every registered binder, so adding a component never edits a shared file.
#pragma once

#include <pybind11/pybind11.h>

namespace dk::bindings {

using BindFn = void (*)(pybind11::module_&);

// Records a binder; called from static initialisers. Returns a dummy for the initialiser.
int registerBinder(const char* name, BindFn fn);

}  // namespace dk::bindings

#define DK_REGISTER_BINDINGS(name)                                                                \
  static void dk_bind_##name(pybind11::module_& m);                                               \
  static const int dk_registered_##name = ::dk::bindings::registerBinder(#name, &dk_bind_##name); \
  static void dk_bind_##name(pybind11::module_& m)
