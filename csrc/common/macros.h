// Portability macros shared by host (.cc) and device (.cu) code.
#pragma once

#if defined(__CUDACC__)
#define DK_HOST_DEVICE __host__ __device__
#define DK_INLINE __forceinline__
#else
#define DK_HOST_DEVICE
#define DK_INLINE inline __attribute__((always_inline))
#endif
