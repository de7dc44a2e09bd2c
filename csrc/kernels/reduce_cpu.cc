// Portable CPU reduce / divide / cast (first version: plain loops the compiler vectorises).
#include <string>

#include "common/dispatch.h"
#include "kernels/reduce.h"
#include "kernels/reduce_functors.h"

namespace dk::kernels {

namespace {

template <typename T, typename Op>
void reduceLoop(T* dst, const T* a, const T* b, size_t count) {
  const Op op;
  for (size_t i = 0; i < count; ++i) dst[i] = store<T>(op(load(a[i]), load(b[i])));
}

template <typename T, typename Op>
void reduceMultiLoop(T* dst, const void* const* srcs, int nsrcs, size_t count) {
  const Op op;
  for (size_t i = 0; i < count; ++i) {
    auto acc = load(static_cast<const T*>(srcs[0])[i]);
    for (int s = 1; s < nsrcs; ++s) acc = op(acc, load(static_cast<const T*>(srcs[s])[i]));
    dst[i] = store<T>(acc);
  }
}

template <typename T>
void divideLoop(T* dst, const T* src, size_t count, int64_t divisor) {
  using A = typename Accum<T>::type;
  const A d = static_cast<A>(divisor);
  for (size_t i = 0; i < count; ++i) dst[i] = store<T>(static_cast<A>(load(src[i]) / d));
}

}  // namespace

Status reduceCpu(void* dst, const void* a, const void* b, size_t count, DType dtype, RedOp op) {
  DK_DISPATCH_DTYPE(
      dtype, DK_DISPATCH_REDOP(op, reduceLoop<T, Op>(static_cast<T*>(dst), static_cast<const T*>(a),
                                                     static_cast<const T*>(b), count)));
  return Status::Ok();
}

Status reduceMultiCpu(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype,
                      RedOp op) {
  if (nsrcs < 1) return InvalidArgument("reduceMulti needs at least one source");
  DK_DISPATCH_DTYPE(dtype, DK_DISPATCH_REDOP(op, reduceMultiLoop<T, Op>(static_cast<T*>(dst), srcs,
                                                                        nsrcs, count)));
  return Status::Ok();
}

Status divideCpu(void* dst, const void* src, size_t count, DType dtype, int64_t divisor) {
  if (divisor == 0) return InvalidArgument("divide by zero");
  DK_DISPATCH_DTYPE(
      dtype, divideLoop<T>(static_cast<T*>(dst), static_cast<const T*>(src), count, divisor));
  return Status::Ok();
}

Status castScaleCpu(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t count,
                    float scale) {
  return Unsupported("castScaleCpu: not implemented yet");
}

}  // namespace dk::kernels
