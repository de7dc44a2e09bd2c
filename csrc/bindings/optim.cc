// Python entry point of the fused optimizer kernels: dist_kernels._C.adamw_step. The Python layer
// (dist_kernels/optim.py) checks devices, dtypes, shapes and contiguity and passes data pointers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings/errors.h"
#include "bindings/registry.h"
#include "cuda/device_guard.h"
#include "kernels/adamw.h"

namespace py = pybind11;

namespace {

using Ptrs = std::vector<uintptr_t>;

template <typename T>
T* at(const Ptrs& ptrs, size_t i) {
  return ptrs.empty() ? nullptr : reinterpret_cast<T*>(ptrs[i]);
}

// Zips the per-tensor pointer lists into kernel descriptors; optional lists may be empty.
std::vector<dk::kernels::AdamWTensor> describe(const Ptrs& params, const Ptrs& grads,
                                               const Ptrs& exp_avgs, const Ptrs& exp_avg_sqs,
                                               const Ptrs& max_exp_avg_sqs, const Ptrs& masters,
                                               const std::vector<size_t>& counts) {
  const size_t n = params.size();
  for (const Ptrs* list : {&grads, &exp_avgs, &exp_avg_sqs}) {
    if (list->size() != n) throw py::value_error("adamw_step: pointer lists differ in length");
  }
  if (counts.size() != n || (!max_exp_avg_sqs.empty() && max_exp_avg_sqs.size() != n) ||
      (!masters.empty() && masters.size() != n)) {
    throw py::value_error("adamw_step: pointer lists differ in length");
  }
  std::vector<dk::kernels::AdamWTensor> tensors(n);
  for (size_t i = 0; i < n; ++i) {
    tensors[i] = {at<void>(params, i),
                  at<const void>(grads, i),
                  at<float>(exp_avgs, i),
                  at<float>(exp_avg_sqs, i),
                  at<float>(max_exp_avg_sqs, i),
                  at<float>(masters, i),
                  counts[i]};
  }
  return tensors;
}

void adamwStep(const Ptrs& params, const Ptrs& grads, const Ptrs& exp_avgs, const Ptrs& exp_avg_sqs,
               const Ptrs& max_exp_avg_sqs, const Ptrs& masters, const std::vector<size_t>& counts,
               int param_dtype, int grad_dtype, const dk::kernels::AdamWHyper& hyper, int device,
               uintptr_t stream) {
  if (!dk::isValidDType(param_dtype) || !dk::isValidDType(grad_dtype)) {
    throw py::type_error("adamw_step: unknown dtype code");
  }
  const auto tensors =
      describe(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, counts);
  const auto pd = static_cast<dk::DType>(param_dtype);
  const auto gd = static_cast<dk::DType>(grad_dtype);
  dk::Status status;
  {
    py::gil_scoped_release release;
    if (device < 0) {
      status =
          dk::kernels::adamwCpu(tensors.data(), static_cast<int>(tensors.size()), pd, gd, hyper);
    } else {
      // The parameters' device is current for the launch, whatever the caller's current one is.
      status = dk::onDevice(device, [&] {
#if DK_WITH_CUDA
        return dk::kernels::adamwCuda(tensors.data(), static_cast<int>(tensors.size()), pd, gd,
                                      hyper, reinterpret_cast<void*>(stream));
#else
        return dk::Unsupported("adamw_step: this build has no CUDA kernels (DK_WITH_CUDA=0)");
#endif
      });
    }
  }
  dk::bindings::check(status, "adamw_step");
}

}  // namespace

DK_REGISTER_BINDINGS(optim) {
  py::class_<dk::kernels::AdamWHyper>(m, "AdamWHyper",
                                      "Per-step AdamW scalars (see kernels/adamw_functor.h).")
      .def(py::init<>())
      .def_readwrite("step_size", &dk::kernels::AdamWHyper::step_size)
      .def_readwrite("bias_correction2_sqrt", &dk::kernels::AdamWHyper::bias_correction2_sqrt)
      .def_readwrite("decay", &dk::kernels::AdamWHyper::decay)
      .def_readwrite("one_minus_beta1", &dk::kernels::AdamWHyper::one_minus_beta1)
      .def_readwrite("beta2", &dk::kernels::AdamWHyper::beta2)
      .def_readwrite("one_minus_beta2", &dk::kernels::AdamWHyper::one_minus_beta2)
      .def_readwrite("eps", &dk::kernels::AdamWHyper::eps)
      .def_readwrite("grad_scale", &dk::kernels::AdamWHyper::grad_scale)
      .def_readwrite("amsgrad", &dk::kernels::AdamWHyper::amsgrad);
  m.def("adamw_step", &adamwStep, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("max_exp_avg_sqs"), py::arg("masters"), py::arg("counts"),
        py::arg("param_dtype"), py::arg("grad_dtype"), py::arg("hyper"), py::arg("device"),
        py::arg("stream"),
        "Fused AdamW over lists of raw buffers; device < 0 runs on the CPU, else on `stream`.");
}
