// Host launchers of the sylvie_comm CUDA kernels: raw device pointers, sizes and
// a stream in, the result of cudaGetLastError() after the launches out. The
// torch glue (glue.cpp) checks arguments, allocates outputs and calls these;
// the semantics are those of sylvie_comm/kernels/reference.py.
//
// The public part is plain C++ (glue.cpp includes it through the host
// compiler); the device helpers shared by the .cu files follow in a section
// seen only by nvcc.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace sylvie_comm {
namespace cuda {

// Element type of a floating-point input or output buffer.
enum ScDType { kF32, kF16, kBF16 };

// Every launcher launches nothing and returns cudaSuccess when its input is
// empty, and returns cudaErrorInvalidValue for arguments the glue rejects
// (bits not in {1, 2, 4, 8}, a chunk size that is not a positive multiple of 8,
// negative sizes, a missing workspace).

// values: (rows, cols) uint8, each masked to its low `bits` bits ->
// out: (rows, ceil(cols * bits / 8)) uint8, little-endian within each byte.
cudaError_t pack_bits(const uint8_t* values, int64_t rows, int64_t cols, int bits, uint8_t* out,
                      cudaStream_t stream);

// packed: (rows, ceil(cols * bits / 8)) uint8 -> out: (rows, cols) uint8.
cudaError_t unpack_bits(const uint8_t* packed, int64_t rows, int64_t cols, int bits, uint8_t* out,
                        cudaStream_t stream);

// Bytes of device scratch memory onebit_encode needs (8-byte aligned; 0 when
// every chunk is reduced by a single warp, i.e. chunk_size <= 4096).
int64_t onebit_encode_workspace_bytes(int64_t n, int64_t chunk_size);

// x: n values of type dt -> packed: ceil(n / 8) bytes of sign bits (x >= 0),
// scales: ceil(n / chunk_size) fp32 (mean |x|, or RMS with norm_scale; NaN for a
// chunk holding NaN or Inf). workspace: onebit_encode_workspace_bytes(n,
// chunk_size) bytes, or null when that is 0.
cudaError_t onebit_encode(const void* x, ScDType dt, int64_t n, int64_t chunk_size, bool norm_scale,
                          uint8_t* packed, float* scales, void* workspace, cudaStream_t stream);

// out[i] = bit i ? scales[i / chunk_size] : -scales[i / chunk_size], n values of out_dt.
cudaError_t onebit_decode(const uint8_t* packed, const float* scales, int64_t n, int64_t chunk_size, void* out,
                          ScDType out_dt, cudaStream_t stream);

// x: (rows, cols) of type dt -> packed: (rows, ceil(cols * bits / 8)) uint8 and
// per-row fp32 scale and minimum (bf16-representable when bf16_meta). Noise
// counter of element (r, c): offset + r * cols + c. `scale` and `minimum` are
// also used as scratch space while the kernels run.
cudaError_t qbit_encode(const void* x, ScDType dt, int64_t rows, int64_t cols, int bits, uint64_t seed,
                        uint64_t offset, bool bf16_meta, uint8_t* packed, float* scale, float* minimum,
                        cudaStream_t stream);

// out[r, c] = q[r, c] * scale[r] + minimum[r] (fp32), stored as out_dt.
cudaError_t qbit_decode(const uint8_t* packed, const float* scale, const float* minimum, int64_t rows,
                        int64_t cols, int bits, void* out, ScDType out_dt, cudaStream_t stream);

}  // namespace cuda
}  // namespace sylvie_comm

#if defined(__CUDACC__)
// ---------------------------------------------------------------------------
// Device helpers shared by pack.cu, onebit.cu and qbit.cu (nvcc only).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

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
#endif  // __CUDACC__
