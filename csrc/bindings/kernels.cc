// dist_kernels._C kernel entry points for dist_kernels/ops.py. Tensors arrive as raw addresses
// (the extension never links torch); ops.py checks shapes, dtypes and devices before calling.
// device < 0 means host memory; otherwise the kernel is enqueued on `stream` (a cudaStream_t as
// an integer) with `device` made current for the call.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bindings/errors.h"
#include "bindings/registry.h"
#include "common/dtype.h"
#include "cuda/device_guard.h"
#include "kernels/cpu_isa.h"
#include "kernels/cpu_openmp.h"
#include "kernels/cpu_thread_pool.h"
#include "kernels/dropout_mask.h"
#include "kernels/reduce.h"

namespace py = pybind11;

namespace dk::bindings {

namespace {

using kernels::CpuIsa;

// Calls this large release the GIL: below it the release/acquire pair costs more than the work
// could overlap with other Python threads.
constexpr size_t kReleaseGilBytes = size_t{64} << 10;

void* asPointer(uintptr_t address) { return reinterpret_cast<void*>(address); }

// Runs fn with `device` current (CUDA) and the GIL released for large calls.
template <typename Fn>
Status runOn(int device, size_t bytes, Fn fn) {
  std::optional<py::gil_scoped_release> release;
  if (bytes >= kReleaseGilBytes) release.emplace();
  return onDevice(device, fn);
}

// The sources of a reduction as pointers, and the bytes it touches (they decide whether the
// GIL is released: see runOn).
struct Sources {
  std::vector<const void*> ptrs;
  size_t bytes;
};

Sources sourcesOf(const std::vector<uintptr_t>& srcs, size_t count, int dtype) {
  Sources s{{}, 0};
  for (uintptr_t src : srcs) s.ptrs.push_back(asPointer(src));
  if (isValidDType(dtype)) {
    s.bytes = count * dtypeSize(static_cast<DType>(dtype)) * (s.ptrs.size() + 1);
  }
  return s;
}

void reduce(uintptr_t dst, const std::vector<uintptr_t>& srcs, size_t count, int dtype, int op,
            int device, uintptr_t stream, bool parallel) {
  const Sources sources = sourcesOf(srcs, count, dtype);
  const auto& src_ptrs = sources.ptrs;
  const DType dt = static_cast<DType>(dtype);
  const RedOp rop = static_cast<RedOp>(op);
  const int n = static_cast<int>(src_ptrs.size());
  check(runOn(device, sources.bytes,
              [&] {
#if DK_WITH_CUDA
                if (device >= 0) {
                  return kernels::reduceMultiCuda(asPointer(dst), src_ptrs.data(), n, count, dt,
                                                  rop, asPointer(stream));
                }
#endif
                return parallel ? kernels::reduceMultiCpuParallel(asPointer(dst), src_ptrs.data(),
                                                                  n, count, dt, rop)
                                : kernels::reduceMultiCpu(asPointer(dst), src_ptrs.data(), n, count,
                                                          dt, rop);
              }),
        "reduce_");
}

void reduceAverage(uintptr_t dst, const std::vector<uintptr_t>& srcs, size_t count, int dtype,
                   int64_t divisor, int device, uintptr_t stream, bool parallel) {
  const Sources sources = sourcesOf(srcs, count, dtype);
  const auto& src_ptrs = sources.ptrs;
  const DType dt = static_cast<DType>(dtype);
  const int n = static_cast<int>(src_ptrs.size());
  check(runOn(device, sources.bytes,
              [&] {
#if DK_WITH_CUDA
                if (device >= 0) {
                  return kernels::reduceAverageCuda(asPointer(dst), src_ptrs.data(), n, count, dt,
                                                    divisor, asPointer(stream));
                }
#endif
                return parallel ? kernels::reduceAverageCpuParallel(asPointer(dst), src_ptrs.data(),
                                                                    n, count, dt, divisor)
                                : kernels::reduceAverageCpu(asPointer(dst), src_ptrs.data(), n,
                                                            count, dt, divisor);
              }),
        "reduce_average_");
}

void divide(uintptr_t dst, uintptr_t src, size_t count, int dtype, int64_t divisor, int device,
            uintptr_t stream, bool parallel) {
  const DType dt = static_cast<DType>(dtype);
  const size_t bytes = isValidDType(dtype) ? 2 * count * dtypeSize(dt) : 0;
  check(runOn(device, bytes,
              [&] {
#if DK_WITH_CUDA
                if (device >= 0) {
                  return kernels::divideCuda(asPointer(dst), asPointer(src), count, dt, divisor,
                                             asPointer(stream));
                }
#endif
                return parallel
                           ? kernels::divideCpuParallel(asPointer(dst), asPointer(src), count, dt,
                                                        divisor)
                           : kernels::divideCpu(asPointer(dst), asPointer(src), count, dt, divisor);
              }),
        "divide_");
}

void castScale(uintptr_t dst, int dst_dtype, uintptr_t src, int src_dtype, size_t count,
               float scale, int device, uintptr_t stream, bool parallel) {
  const DType dd = static_cast<DType>(dst_dtype);
  const DType sd = static_cast<DType>(src_dtype);
  const bool valid = isValidDType(dst_dtype) && isValidDType(src_dtype);
  const size_t bytes = valid ? count * (dtypeSize(dd) + dtypeSize(sd)) : 0;
  check(runOn(device, bytes,
              [&] {
#if DK_WITH_CUDA
                if (device >= 0) {
                  return kernels::castScaleCuda(asPointer(dst), dd, asPointer(src), sd, count,
                                                scale, asPointer(stream));
                }
#endif
                return parallel ? kernels::castScaleCpuParallel(asPointer(dst), dd, asPointer(src),
                                                                sd, count, scale)
                                : kernels::castScaleCpu(asPointer(dst), dd, asPointer(src), sd,
                                                        count, scale);
              }),
        "cast_");
}

// Host memory only: on a GPU the same hash runs as torch ops (dist_kernels/models/dropout.py).
void dropoutKeepMask(uintptr_t out, uintptr_t rows_hash, size_t rows, uintptr_t cols_index,
                     size_t cols, uint64_t threshold, bool parallel) {
  check(runOn(-1, rows * cols,
              [&] {
                return kernels::dropoutKeepMaskCpu(
                    static_cast<uint8_t*>(asPointer(out)),
                    static_cast<const int64_t*>(asPointer(rows_hash)), rows,
                    static_cast<const int64_t*>(asPointer(cols_index)), cols, threshold, parallel);
              }),
        "dropout keep mask");
}

void setCpuIsa(const std::string& name) {
  CpuIsa isa;
  check(kernels::parseCpuIsa(name, &isa), "set_cpu_isa");
  check(kernels::setCpuIsa(isa), "set_cpu_isa");
}

std::vector<std::string> supportedCpuIsas() {
  std::vector<std::string> names;
  const int best = static_cast<int>(kernels::bestSupportedCpuIsa());
  for (int isa = 0; isa <= best; ++isa) names.push_back(cpuIsaName(static_cast<CpuIsa>(isa)));
  return names;
}

}  // namespace

}  // namespace dk::bindings

DK_REGISTER_BINDINGS(kernels) {
  using namespace dk::bindings;
  m.def("kernels_reduce", &reduce, py::arg("dst"), py::arg("srcs"), py::arg("count"),
        py::arg("dtype"), py::arg("op"), py::arg("device") = -1, py::arg("stream") = 0,
        py::arg("parallel") = true, "dst = op(srcs...) element-wise (dst may be srcs[0]).");
  m.def("kernels_reduce_average", &reduceAverage, py::arg("dst"), py::arg("srcs"), py::arg("count"),
        py::arg("dtype"), py::arg("divisor"), py::arg("device") = -1, py::arg("stream") = 0,
        py::arg("parallel") = true,
        "dst = sum(srcs...) / divisor element-wise in one pass (AVG's last step; dst may be "
        "srcs[0]; integers truncate toward zero).");
  m.def("kernels_divide", &divide, py::arg("dst"), py::arg("src"), py::arg("count"),
        py::arg("dtype"), py::arg("divisor"), py::arg("device") = -1, py::arg("stream") = 0,
        py::arg("parallel") = true, "dst = src / divisor (integers truncate toward zero).");
  m.def("kernels_cast_scale", &castScale, py::arg("dst"), py::arg("dst_dtype"), py::arg("src"),
        py::arg("src_dtype"), py::arg("count"), py::arg("scale"), py::arg("device") = -1,
        py::arg("stream") = 0, py::arg("parallel") = true,
        "dst = (dst_dtype)(src * scale), computed in FP32 and rounded once to nearest even.");
  m.def("kernels_dropout_keep_mask", &dropoutKeepMask, py::arg("out"), py::arg("rows_hash"),
        py::arg("rows"), py::arg("cols_index"), py::arg("cols"), py::arg("threshold"),
        py::arg("parallel") = true,
        "out[r, c] = lowbias32(rows_hash[r] ^ cols_index[c]) >= threshold (bool bytes; host).");
  m.def("kernels_set_cpu_isa", &setCpuIsa, py::arg("isa"),
        "Forces the CPU kernel build: 'baseline', 'avx2' or 'avx512' (testing and benchmarks).");
  m.def(
      "kernels_cpu_isa", [] { return std::string(cpuIsaName(dk::kernels::activeCpuIsa())); },
      "The CPU kernel build in use.");
  m.def("kernels_supported_cpu_isas", &supportedCpuIsas,
        "The CPU kernel builds this CPU can run, baseline first.");
  m.def("kernels_set_cpu_parallel_min_bytes", &dk::kernels::setCpuParallelMinBytes,
        py::arg("bytes"),
        "Sets the size (bytes read + written) from which standalone CPU calls use the thread "
        "pool; returns the previous value.");
  m.def("kernels_cpu_threads", &dk::kernels::cpuPoolThreads,
        "Threads a standalone CPU kernel call may use (DK_NUM_THREADS, else on torch's OpenMP "
        "runtime torch's intra-op threads, else OMP_NUM_THREADS, else the core count).");
  m.def(
      "kernels_cpu_pool", [] { return std::string(dk::kernels::cpuPoolBackend()); },
      "Where standalone CPU kernel calls run their parts: 'openmp' (the process's OpenMP "
      "runtime, torch's) or 'dk' (our own pool: no runtime loaded, or DK_CPU_POOL=dk).");
}
