// CUDA q-bit codec: per-row stochastic quantization to 1, 2, 4 or 8 bits with
// packed output and per-row fp32 scale and minimum (see qbit_meta / qbit_encode
// / qbit_decode in sylvie_comm/kernels/reference.py; the element math is
// sc_qbit_meta / sc_quantize / sc_dequantize of common/sc_math.h).
//
// Encode, by row length:
//   * cols <= kGroupRowCols: one group of 8, 16 or 32 lanes per row (several
//     rows per warp for narrow rows), min/max and quantization back to back.
//   * cols <= kBlockRowCols: one block per row, the same fused scheme with a
//     block-wide min/max reduction; the second pass reads the row from cache.
//   * longer rows: three kernels over (row, kSegCols-column segment) tiles, so a
//     single very long row still spreads over the whole GPU: a block per tile
//     reduces its min/max and merges it into the row's with atomicMin/atomicMax
//     on order-preserving integer keys (exact, so the order does not matter);
//     a block per tile quantizes; a thread per row writes scale and minimum.
//     The keys live in the scale and minimum outputs until that last kernel.
// In every case a sub-group of W (<= 32) lanes takes W consecutive columns per
// step (coalesced loads) and packs their codes into W * bits / 8 bytes with warp
// shuffles, so each byte is written by exactly one lane and no atomics touch
// the packed output. Tiles start at multiples of 8 columns.
//
// Decode: lane-strided over the flat (rows, cols) output, coalesced stores.
#include "common/sc_math.h"
#include "cuda/device.cuh"

namespace sylvie_comm {
namespace cuda {
namespace {

using namespace detail;

// Rows up to this many columns are quantized by one warp (or a part of one).
constexpr int64_t kGroupRowCols = 2048;
// Rows up to this many columns are quantized by one block.
constexpr int64_t kBlockRowCols = 16384;
// Row segment of the long-row kernels (a multiple of 32).
constexpr int64_t kSegCols = 8192;
// Loads each lane keeps in flight.
constexpr int kUnroll = 4;
// Output values per lane in one warp tile of the decoder.
constexpr int kDecodePerLane = 8;

// ------------------------------------------------------------ min / max keys

// Unsigned order of the key is the float order (with -0 < +0), so min/max are
// integer min/max and atomicMin/atomicMax apply.
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t w = __float_as_uint(v);
  return w ^ ((w & 0x80000000u) ? 0xFFFFFFFFu : 0x80000000u);
}

__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float(k ^ ((k & 0x80000000u) ? 0x80000000u : 0xFFFFFFFFu));
}

// Max key of a span that holds NaN or Inf: above order_key(+Inf) = 0xFF800000,
// so it survives every max and marks the row as not finite.
constexpr uint32_t kBadKey = 0xFFFFFFFFu;

struct MinMaxKeys {
  uint32_t mn;  // min key over the finite values (0xFFFFFFFF for none)
  uint32_t mx;  // max key over the finite values, or kBadKey
};

__device__ __forceinline__ MinMaxKeys empty_keys() { return {0xFFFFFFFFu, 0u}; }

__device__ __forceinline__ void minmax_add(MinMaxKeys& a, float v) {
  const uint32_t k = order_key(v);
  const bool bad = !sc_isfinite(v);
  a.mn = min(a.mn, bad ? 0xFFFFFFFFu : k);
  a.mx = max(a.mx, bad ? kBadKey : k);
}

__device__ __forceinline__ MinMaxKeys minmax_merge(MinMaxKeys a, MinMaxKeys b) {
  return {min(a.mn, b.mn), max(a.mx, b.mx)};
}

// Quantizer metadata of a non-empty row from its merged keys.
__device__ __forceinline__ ScQMeta row_meta(MinMaxKeys k, int levels, bool bf16_meta) {
  const bool finite = k.mx != kBadKey;
  return sc_qbit_meta(finite ? key_value(k.mn) : sc_bits_float(0x7FC00000u), key_value(k.mx), levels, bf16_meta);
}

// Reduces keys over aligned groups of GT threads: shuffles inside a warp, shared
// memory across the warps of a block when GT == kThreads (every thread of the
// block must call it then). All threads of a group get the result.
template <int GT>
__device__ __forceinline__ MinMaxKeys group_reduce(MinMaxKeys k) {
  constexpr int W = GT < kWarpSize ? GT : kWarpSize;
  for (int o = W / 2; o > 0; o /= 2) {
    k.mn = min(k.mn, __shfl_xor_sync(kFullMask, k.mn, o));
    k.mx = max(k.mx, __shfl_xor_sync(kFullMask, k.mx, o));
  }
  if constexpr (GT > kWarpSize) {
    static_assert(GT == kThreads, "a group larger than a warp is the whole block");
    __shared__ MinMaxKeys s_keys[kWarpsPerBlock];
    if (threadIdx.x % kWarpSize == 0) s_keys[threadIdx.x / kWarpSize] = k;
    __syncthreads();
    k = s_keys[0];
#pragma unroll
    for (int w = 1; w < kWarpsPerBlock; ++w) k = minmax_merge(k, s_keys[w]);
    __syncthreads();  // s_keys is rewritten by the next call
  }
  return k;
}

// ------------------------------------------------------------ span loops
//
// A span [c_begin, c_end) of one row is split into tiles of W columns; the nsub
// sub-groups of a group take tiles round-robin, lane sl of a sub-group takes
// column c_begin + tile * W + sl.

template <int W, typename T>
__device__ __forceinline__ MinMaxKeys span_minmax(const T* __restrict__ xrow, int64_t c_begin, int64_t c_end,
                                                  int sub, int nsub, int sl) {
  MinMaxKeys acc = empty_keys();
  const int64_t tiles = (c_end - c_begin + W - 1) / W;
  for (int64_t t0 = sub; t0 < tiles; t0 += static_cast<int64_t>(nsub) * kUnroll) {
    float v[kUnroll];
    bool ok[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c_begin + (t0 + static_cast<int64_t>(u) * nsub) * W + sl;
      ok[u] = c < c_end;
      v[u] = ok[u] ? load_f32(xrow + c) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (ok[u]) minmax_add(acc, v[u]);
  }
  return acc;
}

// Quantizes and packs the span into orow (the packed row). `tiles` must be the
// same for all lanes of a warp (the shuffles need every lane); lanes with
// nothing to do pass active = false. ctr_row: noise counter of column 0.
template <int W, typename T>
__device__ __forceinline__ void span_quantize(const T* __restrict__ xrow, uint8_t* __restrict__ orow,
                                              int64_t c_begin, int64_t c_end, int64_t tiles, int sub, int nsub,
                                              int sl, bool active, const ScQMeta& meta, ScSeedKeys keys,
                                              uint64_t ctr_row, int bits) {
  static_assert(W % 8 == 0, "a tile holds whole bytes for every width");
  const int per = 8 / bits;
  const float levels = static_cast<float>((1 << bits) - 1);
  // A non-finite row packs zeros without reading its values.
  const bool quantize = active && meta.finite;
  for (int64_t t0 = sub; t0 < tiles; t0 += static_cast<int64_t>(nsub) * kUnroll) {
    float v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c_begin + (t0 + static_cast<int64_t>(u) * nsub) * W + sl;
      v[u] = quantize && c < c_end ? load_f32(xrow + c) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (t0 + static_cast<int64_t>(u) * nsub >= tiles) break;  // uniform across the warp
      const int64_t c = c_begin + (t0 + static_cast<int64_t>(u) * nsub) * W + sl;
      const bool valid = active && c < c_end;
      uint32_t q = 0;
      if (valid && meta.finite)
        q = sc_quantize(v[u], meta.minimum, meta.inv, sc_uniform(keys, ctr_row + static_cast<uint64_t>(c)), levels);
      // Gather the codes of lanes sl .. sl + per - 1 into lane sl: after the
      // step with shift s, lane l holds the codes of lanes l .. l + 2s - 1.
      for (int s = 1; s < per; s *= 2) q |= __shfl_down_sync(kFullMask, q, s) << (s * bits);
      // Lanes past c_end hold code 0, so the padding bits of a row's last byte are zero.
      if (valid && sl % per == 0) orow[(c * bits) >> 3] = static_cast<uint8_t>(q);
    }
  }
}

// ------------------------------------------------------------ encode kernels

// Rows of up to kBlockRowCols columns: a group of GT threads (8, 16, 32 or the
// whole block) per row, kThreads / GT rows per block at a time.
template <typename T, int GT>
__global__ void qbit_rows_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, int bits, ScSeedKeys keys,
                                 uint64_t offset, bool bf16_meta, uint8_t* __restrict__ packed,
                                 float* __restrict__ scale, float* __restrict__ minimum) {
  constexpr int W = GT < kWarpSize ? GT : kWarpSize;
  constexpr int kRowsPerBlock = kThreads / GT;
  const int tid = threadIdx.x;
  const int sl = tid % W;
  const int sub = (tid % GT) / W;
  const int levels = (1 << bits) - 1;
  const int64_t pc = sc_packed_cols(cols, bits);
  const int64_t tiles = (cols + W - 1) / W;
  // The loop bound depends on the block only: every thread reaches every shuffle and barrier.
  for (int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock; r0 < rows;
       r0 += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const int64_t r_raw = r0 + tid / GT;
    const bool active = r_raw < rows;
    const int64_t r = active ? r_raw : 0;
    const T* xrow = x + r * cols;
    const MinMaxKeys k = group_reduce<GT>(span_minmax<W>(xrow, 0, active ? cols : 0, sub, GT / W, sl));
    const ScQMeta meta = row_meta(k, levels, bf16_meta);
    if (active && tid % GT == 0) {
      scale[r] = meta.scale;
      minimum[r] = meta.minimum;
    }
    span_quantize<W>(xrow, packed + r * pc, 0, cols, tiles, sub, GT / W, sl, active, meta, keys,
                     offset + static_cast<uint64_t>(r * cols), bits);
  }
}

// Long rows, pass 1: min/max keys of each (row, segment) tile merged into the
// row's keys (mn_keys preset to 0xFFFFFFFF, mx_keys to 0).
template <typename T>
__global__ void qbit_seg_minmax_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, int64_t segs,
                                       uint32_t* __restrict__ mn_keys, uint32_t* __restrict__ mx_keys) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  for (int64_t t = blockIdx.x; t < rows * segs; t += gridDim.x) {
    const int64_t r = t / segs, c0 = (t - r * segs) * kSegCols;
    const int64_t c1 = min(c0 + kSegCols, cols);
    const MinMaxKeys k =
        group_reduce<kThreads>(span_minmax<kWarpSize>(x + r * cols, c0, c1, warp, kWarpsPerBlock, lane));
    if (threadIdx.x == 0) {
      atomicMin(mn_keys + r, k.mn);
      atomicMax(mx_keys + r, k.mx);
    }
  }
}

// Long rows, pass 2: quantize each (row, segment) tile with the row's metadata.
template <typename T>
__global__ void qbit_seg_quantize_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, int64_t segs, int bits,
                                         ScSeedKeys keys, uint64_t offset, bool bf16_meta,
                                         const uint32_t* __restrict__ mn_keys, const uint32_t* __restrict__ mx_keys,
                                         uint8_t* __restrict__ packed) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int levels = (1 << bits) - 1;
  const int64_t pc = sc_packed_cols(cols, bits);
  for (int64_t t = blockIdx.x; t < rows * segs; t += gridDim.x) {
    const int64_t r = t / segs, c0 = (t - r * segs) * kSegCols;
    const int64_t c1 = min(c0 + kSegCols, cols);
    const ScQMeta meta = row_meta({mn_keys[r], mx_keys[r]}, levels, bf16_meta);
    span_quantize<kWarpSize>(x + r * cols, packed + r * pc, c0, c1, (c1 - c0 + kWarpSize - 1) / kWarpSize, warp,
                             kWarpsPerBlock, lane, true, meta, keys, offset + static_cast<uint64_t>(r * cols), bits);
  }
}

// Long rows, pass 3: replace each row's keys by its scale and minimum, in place.
__global__ void qbit_seg_finalize_kernel(int64_t rows, int bits, bool bf16_meta, uint32_t* __restrict__ scale_io,
                                         uint32_t* __restrict__ minimum_io) {
  const int levels = (1 << bits) - 1;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows; r += stride) {
    const ScQMeta meta = row_meta({minimum_io[r], scale_io[r]}, levels, bf16_meta);
    scale_io[r] = __float_as_uint(meta.scale);
    minimum_io[r] = __float_as_uint(meta.minimum);
  }
}

// ------------------------------------------------------------ decode kernel

template <typename T>
__global__ void qbit_decode_kernel(const uint8_t* __restrict__ packed, const float* __restrict__ scale,
                                   const float* __restrict__ minimum, int64_t rows, int64_t cols, int bits,
                                   T* __restrict__ out) {
  constexpr int64_t kTile = int64_t{kWarpSize} * kDecodePerLane;
  const int64_t total = rows * cols;
  const int64_t pc = sc_packed_cols(cols, bits);
  const uint32_t mask = (1u << bits) - 1u;
  const int lane = threadIdx.x % kWarpSize;
  for (int64_t base = global_warp() * kTile; base < total; base += warp_count() * kTile) {
    const int64_t o0 = base + lane;
    if (o0 >= total) continue;
    // Gather first (independent loads in flight), then compute and store.
    RowCol p = split_index(o0, cols);
    uint32_t q[kDecodePerLane];
    float s[kDecodePerLane], m[kDecodePerLane];
#pragma unroll
    for (int k = 0; k < kDecodePerLane; ++k) {
      if (o0 + k * kWarpSize < total) {
        const int64_t bit = p.c * bits;
        q[k] = (static_cast<uint32_t>(packed[p.r * pc + (bit >> 3)]) >> (bit & 7)) & mask;
        s[k] = scale[p.r];
        m[k] = minimum[p.r];
      }
      advance(p, kWarpSize, cols);
    }
#pragma unroll
    for (int k = 0; k < kDecodePerLane; ++k) {
      const int64_t o = o0 + k * kWarpSize;
      if (o < total) out[o] = from_f32<T>(sc_dequantize(q[k], s[k], m[k]));
    }
  }
}

// Encode of non-empty rows with cols <= kBlockRowCols: one group of GT threads per row.
template <typename T, int GT>
cudaError_t launch_rows(const T* x, int64_t rows, int64_t cols, int bits, ScSeedKeys keys, uint64_t offset,
                        bool bf16_meta, uint8_t* packed, float* scale, float* minimum, cudaStream_t stream) {
  qbit_rows_kernel<T, GT><<<grid_for(rows, kThreads / GT), kThreads, 0, stream>>>(x, rows, cols, bits, keys, offset,
                                                                                   bf16_meta, packed, scale, minimum);
  return cudaGetLastError();
}

}  // namespace

cudaError_t qbit_encode(const void* x, ScDType dt, int64_t rows, int64_t cols, int bits, uint64_t seed,
                        uint64_t offset, bool bf16_meta, uint8_t* packed, float* scale, float* minimum,
                        cudaStream_t stream) {
  if (!valid_bits(bits) || rows < 0 || cols < 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const size_t meta_bytes = static_cast<size_t>(rows) * sizeof(float);
  if (cols == 0) {
    // Empty rows: scale 0 and minimum 0 (all-zero bits are +0.0f).
    cudaError_t err = cudaMemsetAsync(scale, 0, meta_bytes, stream);
    if (err == cudaSuccess) err = cudaMemsetAsync(minimum, 0, meta_bytes, stream);
    return err != cudaSuccess ? err : cudaGetLastError();
  }
  const ScSeedKeys keys = sc_seed_keys(seed);
  return dispatch_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x);
    if (cols <= 8) return launch_rows<T, 8>(xp, rows, cols, bits, keys, offset, bf16_meta, packed, scale, minimum, stream);
    if (cols <= 16)
      return launch_rows<T, 16>(xp, rows, cols, bits, keys, offset, bf16_meta, packed, scale, minimum, stream);
    if (cols <= kGroupRowCols)
      return launch_rows<T, kWarpSize>(xp, rows, cols, bits, keys, offset, bf16_meta, packed, scale, minimum, stream);
    if (cols <= kBlockRowCols)
      return launch_rows<T, kThreads>(xp, rows, cols, bits, keys, offset, bf16_meta, packed, scale, minimum, stream);

    // Long rows. The row keys live in the outputs until the finalize kernel:
    // min keys start at the top of the order, max keys at the bottom.
    uint32_t* mn_keys = reinterpret_cast<uint32_t*>(minimum);
    uint32_t* mx_keys = reinterpret_cast<uint32_t*>(scale);
    cudaError_t err = cudaMemsetAsync(mn_keys, 0xFF, meta_bytes, stream);
    if (err == cudaSuccess) err = cudaMemsetAsync(mx_keys, 0, meta_bytes, stream);
    if (err != cudaSuccess) return err;
    const int64_t segs = ceil_div(cols, kSegCols);
    const unsigned tile_blocks = grid_for(rows * segs, 1);
    qbit_seg_minmax_kernel<T><<<tile_blocks, kThreads, 0, stream>>>(xp, rows, cols, segs, mn_keys, mx_keys);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    qbit_seg_quantize_kernel<T><<<tile_blocks, kThreads, 0, stream>>>(xp, rows, cols, segs, bits, keys, offset,
                                                                      bf16_meta, mn_keys, mx_keys, packed);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    qbit_seg_finalize_kernel<<<grid_for(rows, kThreads), kThreads, 0, stream>>>(rows, bits, bf16_meta, mx_keys,
                                                                                 mn_keys);
    return cudaGetLastError();
  });
}

cudaError_t qbit_decode(const uint8_t* packed, const float* scale, const float* minimum, int64_t rows,
                        int64_t cols, int bits, void* out, ScDType out_dt, cudaStream_t stream) {
  if (!valid_bits(bits) || rows < 0 || cols < 0) return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0) return cudaSuccess;
  return dispatch_dtype(out_dt, [&](auto tag) {
    using T = decltype(tag);
    constexpr int64_t kTile = int64_t{kWarpSize} * kDecodePerLane;
    qbit_decode_kernel<T><<<grid_for(rows * cols, kTile * kWarpsPerBlock), kThreads, 0, stream>>>(
        packed, scale, minimum, rows, cols, bits, static_cast<T*>(out));
    return cudaGetLastError();
  });
}

}  // namespace cuda
}  // namespace sylvie_comm
