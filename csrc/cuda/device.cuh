// Device helpers shared by pack.cu, onebit.cu and qbit.cu (nvcc only).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/kernels.h"

namespace sylvie_comm {
namespace cuda {
namespace detail {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
// Threads per block of every kernel.
constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / kWarpSize;
// Grid cap: kernels loop (grid-stride) over their work units, so any size fits.
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

inline bool valid_bits(int bits) { return bits == 1 || bits == 2 || bits == 4 || bits == 8; }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks for `units` work units of which one block takes `per_block`.
inline unsigned grid_for(int64_t units, int64_t per_block) {
  int64_t blocks = ceil_div(units, per_block);
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// Global warp index / number of warps of a 1-D launch.
__device__ __forceinline__ int64_t global_warp() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
}
__device__ __forceinline__ int64_t warp_count() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x / kWarpSize;
}

// Exact conversions of an input element to fp32.
__device__ __forceinline__ float load_f32(const float* p) { return *p; }
__device__ __forceinline__ float load_f32(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load_f32(const __nv_bfloat16* p) { return __bfloat162float(*p); }

// fp32 to the output type, round to nearest even (as torch's .to(dtype)).
template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// N elements stored with one vector access (the pointer must be aligned to it).
template <typename T, int N>
struct alignas(sizeof(T) * N) AlignedVec {
  T v[N];
};

// Position (row, column) of a flat index in a (rows, cols) matrix, cols > 0.
struct RowCol {
  int64_t r;
  int64_t c;
};

__device__ __forceinline__ RowCol split_index(int64_t i, int64_t cols) {
  // 32-bit division is several times cheaper than the 64-bit one; use it when it fits.
  if (((static_cast<uint64_t>(i) | static_cast<uint64_t>(cols)) >> 32) == 0) {
    const uint32_t a = static_cast<uint32_t>(i), b = static_cast<uint32_t>(cols);
    const uint32_t q = a / b;
    return {static_cast<int64_t>(q), static_cast<int64_t>(a - q * b)};
  }
  const int64_t q = i / cols;
  return {q, i - q * cols};
}

// Moves a position `step` (<= 32) flat elements forward, without a 64-bit division.
__device__ __forceinline__ void advance(RowCol& p, int step, int64_t cols) {
  p.c += step;
  if (p.c >= cols) {
    if (cols >= step) {  // p.c < cols + step <= 2 * cols: at most one row boundary
      p.c -= cols;
      ++p.r;
    } else {  // narrow rows (cols < 32): p.c < 64
      const uint32_t c = static_cast<uint32_t>(p.c), w = static_cast<uint32_t>(cols);
      const uint32_t q = c / w;
      p.r += q;
      p.c = c - q * w;
    }
  }
}

// Calls fn(T{}) with T the element type of dt; returns what fn returns.
template <typename Fn>
cudaError_t dispatch_dtype(ScDType dt, Fn&& fn) {
  switch (dt) {
    case kF32:
      return fn(float{});
    case kF16:
      return fn(__half{});
    case kBF16:
      return fn(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace detail
}  // namespace cuda
}  // namespace sylvie_comm
