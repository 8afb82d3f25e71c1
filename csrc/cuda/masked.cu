// CUDA masked copy: copy_if (see copy_if in sylvie_comm/kernels/reference.py).
// The flag is a device bool that every thread reads first; when it is false the
// kernel returns at once, so a step whose input was finite pays one launch and
// no memory traffic, and the host never reads the flag.
#include "cuda/device.cuh"

namespace sylvie_comm {
namespace cuda {
namespace {

using namespace detail;

constexpr int kCopyThreads = 256;
constexpr int64_t kCopyMaxBlocks = 4096;

// 16-byte words where both pointers allow it, then the tail byte by byte; grid-strided.
__global__ void __launch_bounds__(kCopyThreads)
    copy_if_kernel(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, int64_t nbytes,
                   const bool* __restrict__ flag) {
  if (!*flag) return;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const bool wide = (reinterpret_cast<uintptr_t>(dst) % 16 == 0) &&
                    (src == nullptr || reinterpret_cast<uintptr_t>(src) % 16 == 0);
  const int64_t words = wide ? nbytes / 16 : 0;
  for (int64_t i = tid; i < words; i += stride) {
    uint4 v = src == nullptr ? make_uint4(0, 0, 0, 0) : reinterpret_cast<const uint4*>(src)[i];
    reinterpret_cast<uint4*>(dst)[i] = v;
  }
  for (int64_t i = words * 16 + tid; i < nbytes; i += stride) dst[i] = src == nullptr ? uint8_t{0} : src[i];
}

}  // namespace

cudaError_t copy_if(void* dst, const void* src, int64_t nbytes, const bool* flag, cudaStream_t stream) {
  if (nbytes < 0 || flag == nullptr) return cudaErrorInvalidValue;
  if (nbytes == 0) return cudaSuccess;
  int64_t blocks = ceil_div(ceil_div(nbytes, int64_t{16}), int64_t{kCopyThreads});
  blocks = blocks < kCopyMaxBlocks ? blocks : kCopyMaxBlocks;
  copy_if_kernel<<<static_cast<unsigned>(blocks), kCopyThreads, 0, stream>>>(
      static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), nbytes, flag);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace sylvie_comm
