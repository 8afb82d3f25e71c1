// CUDA bit packing: pack_bits / unpack_bits of (rows, cols) uint8 matrices,
// little-endian within a byte, each row padded to whole bytes (see pack_bits in
// sylvie_comm/kernels/reference.py).
//
// Both kernels walk a flat index (output bytes for pack, output values for
// unpack) in warp tiles of 32 * kPerLane consecutive items, lane-strided so that
// every store is coalesced; the (row, column) position of an item is found with
// one division per tile and then advanced incrementally. For 8 bits the
// operation is the identity and is a device copy.
#include "common/sc_math.h"
#include "cuda/device.cuh"

namespace sylvie_comm {
namespace cuda {
namespace {

using namespace detail;

// Items per lane in one warp tile.
constexpr int kPerLane = 8;
constexpr int64_t kTile = int64_t{kWarpSize} * kPerLane;

// One thread per output byte: gathers the 8 / bits values of the byte (fewer at
// the end of a row, whose padding bits stay zero).
__global__ void pack_kernel(const uint8_t* __restrict__ values, int64_t rows, int64_t cols, int bits, int64_t pc,
                            uint8_t* __restrict__ out) {
  const int64_t total = rows * pc;
  const int lane = threadIdx.x % kWarpSize;
  const int per = 8 / bits;
  const uint32_t mask = (1u << bits) - 1u;
  for (int64_t base = global_warp() * kTile; base < total; base += warp_count() * kTile) {
    int64_t o = base + lane;
    if (o >= total) continue;
    RowCol p = split_index(o, pc);
    for (int k = 0; k < kPerLane && o < total; ++k) {
      const int64_t c0 = p.c * per;
      const uint8_t* src = values + p.r * cols + c0;
      const int64_t left = cols - c0;
      const int n = left < per ? static_cast<int>(left) : per;
      uint32_t byte = 0;
      for (int j = 0; j < n; ++j) byte |= (static_cast<uint32_t>(src[j]) & mask) << (j * bits);
      out[o] = static_cast<uint8_t>(byte);
      o += kWarpSize;
      advance(p, kWarpSize, pc);
    }
  }
}

// One thread per output value.
__global__ void unpack_kernel(const uint8_t* __restrict__ packed, int64_t rows, int64_t cols, int bits, int64_t pc,
                              uint8_t* __restrict__ out) {
  const int64_t total = rows * cols;
  const int lane = threadIdx.x % kWarpSize;
  const uint32_t mask = (1u << bits) - 1u;
  for (int64_t base = global_warp() * kTile; base < total; base += warp_count() * kTile) {
    int64_t o = base + lane;
    if (o >= total) continue;
    RowCol p = split_index(o, cols);
    for (int k = 0; k < kPerLane && o < total; ++k) {
      const int64_t bit = p.c * bits;
      out[o] = static_cast<uint8_t>((static_cast<uint32_t>(packed[p.r * pc + (bit >> 3)]) >> (bit & 7)) & mask);
      o += kWarpSize;
      advance(p, kWarpSize, cols);
    }
  }
}

}  // namespace

cudaError_t pack_bits(const uint8_t* values, int64_t rows, int64_t cols, int bits, uint8_t* out,
                      cudaStream_t stream) {
  if (!valid_bits(bits) || rows < 0 || cols < 0) return cudaErrorInvalidValue;
  const int64_t pc = sc_packed_cols(cols, bits);
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (bits == 8) {
    // Masking with 0xFF and one value per byte: a plain copy.
    cudaError_t err = cudaMemcpyAsync(out, values, static_cast<size_t>(rows * cols), cudaMemcpyDeviceToDevice, stream);
    return err != cudaSuccess ? err : cudaGetLastError();
  }
  pack_kernel<<<grid_for(rows * pc, kTile * kWarpsPerBlock), kThreads, 0, stream>>>(values, rows, cols, bits, pc,
                                                                                     out);
  return cudaGetLastError();
}

cudaError_t unpack_bits(const uint8_t* packed, int64_t rows, int64_t cols, int bits, uint8_t* out,
                        cudaStream_t stream) {
  if (!valid_bits(bits) || rows < 0 || cols < 0) return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (bits == 8) {
    cudaError_t err = cudaMemcpyAsync(out, packed, static_cast<size_t>(rows * cols), cudaMemcpyDeviceToDevice, stream);
    return err != cudaSuccess ? err : cudaGetLastError();
  }
  const int64_t pc = sc_packed_cols(cols, bits);
  unpack_kernel<<<grid_for(rows * cols, kTile * kWarpsPerBlock), kThreads, 0, stream>>>(packed, rows, cols, bits,
                                                                                         pc, out);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace sylvie_comm
