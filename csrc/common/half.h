// IEEE binary16 and bfloat16 as plain 16-bit storage types with one definition of their
// conversions, shared by host and device code so CPU tests check the arithmetic the GPU runs.
//
// Rounding: float -> half and float -> bfloat16 round to nearest, ties to even; values beyond
// the format's range become +-inf as IEEE 754 says; NaN stays NaN (quiet).
#pragma once

#include <cstdint>
#include <cstring>

#include "common/macros.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace dk {

struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};
static_assert(sizeof(Half) == 2 && sizeof(BFloat16) == 2, "16-bit storage types");

DK_HOST_DEVICE DK_INLINE uint32_t floatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

DK_HOST_DEVICE DK_INLINE float bitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// half -> float, exact. Software path: the magic-number method (normal values rescaled by
// 2^-112, subnormals recovered by subtracting 0.5 from a float built from the mantissa).
DK_HOST_DEVICE DK_INLINE float halfToFloat(Half h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h.bits));
#elif !defined(__CUDACC__) && defined(__F16C__)
  _Float16 v;
  std::memcpy(&v, &h.bits, sizeof(v));
  return static_cast<float>(v);
#else
  const uint32_t w = static_cast<uint32_t>(h.bits) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = bitsFloat((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bitsFloat((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t magnitude = two_w < (1u << 27) ? floatBits(denormalized) : floatBits(normalized);
  return bitsFloat(sign | magnitude);
#endif
}

// float -> half, round to nearest even. Software path: scale so the hardware float adder does
// the rounding at the half's precision, then read the half's fields off the result.
DK_HOST_DEVICE DK_INLINE Half floatToHalf(float f) {
#if defined(__CUDA_ARCH__)
  return Half{__half_as_ushort(__float2half_rn(f))};
#elif !defined(__CUDACC__) && defined(__F16C__)
  const _Float16 v = static_cast<_Float16>(f);
  Half h;
  std::memcpy(&h.bits, &v, sizeof(v));
  return h;
#else
  const uint32_t w = floatBits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  float base = (bitsFloat(floatBits(f) & 0x7FFFFFFFu) * 0x1.0p+112f) * 0x1.0p-110f;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bitsFloat((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = floatBits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return Half{static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign))};
#endif
}

// bfloat16 -> float is exact: bfloat16 is the top half of a float.
DK_HOST_DEVICE DK_INLINE float bfloat16ToFloat(BFloat16 b) {
  return bitsFloat(static_cast<uint32_t>(b.bits) << 16);
}

// float -> bfloat16, round to nearest even; NaN becomes a quiet NaN of the same sign.
DK_HOST_DEVICE DK_INLINE BFloat16 floatToBFloat16(float f) {
  const uint32_t u = floatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    return BFloat16{static_cast<uint16_t>((u >> 16) | 0x0040u)};
  }
  const uint32_t rounding_bias = 0x7FFFu + ((u >> 16) & 1u);
  return BFloat16{static_cast<uint16_t>((u + rounding_bias) >> 16)};
}

// Compute type: FP16 and BF16 are loaded into float, operated on, and rounded once on store.
template <typename T>
struct Accum {
  using type = T;
};
template <>
struct Accum<Half> {
  using type = float;
};
template <>
struct Accum<BFloat16> {
  using type = float;
};

template <typename T>
DK_HOST_DEVICE DK_INLINE typename Accum<T>::type load(T v) {
  return v;
}
template <>
DK_HOST_DEVICE DK_INLINE float load<Half>(Half v) {
  return halfToFloat(v);
}
template <>
DK_HOST_DEVICE DK_INLINE float load<BFloat16>(BFloat16 v) {
  return bfloat16ToFloat(v);
}

template <typename T>
DK_HOST_DEVICE DK_INLINE T store(typename Accum<T>::type v) {
  return v;
}
template <>
DK_HOST_DEVICE DK_INLINE Half store<Half>(float v) {
  return floatToHalf(v);
}
template <>
DK_HOST_DEVICE DK_INLINE BFloat16 store<BFloat16>(float v) {
  return floatToBFloat16(v);
}

}  // namespace dk
