// CUDA one-bit codec: sign bits of a flat tensor plus one fp32 scale per chunk
// (see onebit_encode / onebit_decode in sylvie_comm/kernels/reference.py).
//
// Encode: the work item is a piece of a chunk, reduced by a group of G lanes of
// one warp. Lanes load G consecutive elements per step (coalesced), a warp
// ballot turns their signs into G / 8 packed bytes, and every lane accumulates
// |x| (or x * x) in float64; the group then sums its lanes with a fixed shuffle
// tree, so the result does not depend on the launch configuration.
//   * chunk_size < 256: G = 8, four chunks per warp, one byte per step.
//   * 256 <= chunk_size <= kPiece: G = 32, one warp per chunk.
//   * chunk_size > kPiece: G = 32, one warp per kPiece-element piece; the
//     pieces' float64 sums go to a workspace and a second kernel adds them up
//     per chunk (again in a fixed order), so one huge chunk still spreads over
//     the whole GPU.
// Pieces start at multiples of 8 elements, so no two groups write the same byte.
//
// Decode: one thread per packed byte writes its 8 values with one vector store.
//
// Error-fed encode (onebit_feedback_encode, fp32): the encode scheme on
// residual + grad, then residual = residual + grad - decode in the same kernel
// (a second pass of each group over its chunk, from cache) when a chunk is one
// piece; otherwise the partial-sum reduction and then an element-wise kernel.
// The residual is written once, in the last pass.
#include "common/sc_math.h"
#include "cuda/device.cuh"

namespace sylvie_comm {
namespace cuda {
namespace {

using namespace detail;

// Elements one warp reduces when chunks are split into pieces (multiple of 32).
constexpr int64_t kPiece = 4096;
// Chunks shorter than this are handled by groups of 8 lanes.
constexpr int64_t kSmallChunk = 256;
// Loads each lane keeps in flight.
constexpr int kUnroll = 4;

// The chunk's scale from its float64 sum, rounded to fp32; NaN unless finite
// (sums of finite fp32 values cannot overflow float64, so a non-finite result
// means the chunk held NaN or Inf).
__device__ __forceinline__ float onebit_scale(double sum, int64_t len, bool norm_scale) {
  const double mean = __ddiv_rn(sum, static_cast<double>(len));
  const float s = __double2float_rn(norm_scale ? __dsqrt_rn(mean) : mean);
  return sc_isfinite(s) ? s : sc_bits_float(0x7FC00000u);
}

__device__ __forceinline__ double group_sum(double v, int group_lanes) {
  for (int o = group_lanes / 2; o > 0; o /= 2) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

// items = chunks * pieces_per_chunk; pieces are piece_len elements (the last
// piece of a chunk may be shorter, or empty for the tensor's last chunk).
template <typename T, int G>
__global__ void onebit_encode_kernel(const T* __restrict__ x, int64_t n, int64_t chunk_size, int64_t piece_len,
                                     int64_t pieces_per_chunk, int64_t items, bool norm_scale,
                                     uint8_t* __restrict__ packed, float* __restrict__ scales,
                                     double* __restrict__ partial) {
  static_assert(G == 8 || G == 32, "a group is 8 or 32 lanes");
  constexpr int kGroups = kWarpSize / G;
  const int lane = threadIdx.x % kWarpSize;
  const int gl = lane % G;       // lane within the group
  const int gbase = lane - gl;   // first lane of the group in the ballot word
  const int64_t tiles = (piece_len + G - 1) / G;

  // The loop bounds depend on the warp only: every lane reaches every ballot/shuffle.
  for (int64_t w = global_warp(); w * kGroups < items; w += warp_count()) {
    const int64_t item = w * kGroups + lane / G;
    const bool active = item < items;
    const int64_t chunk = pieces_per_chunk == 1 ? item : item / pieces_per_chunk;
    const int64_t piece = item - chunk * pieces_per_chunk;
    const int64_t chunk_start = chunk * chunk_size;
    const int64_t chunk_end = min(chunk_start + chunk_size, n);
    const int64_t start = chunk_start + piece * piece_len;
    const int64_t end = active ? min(start + piece_len, chunk_end) : start;

    double sum = 0.0;
    for (int64_t t0 = 0; t0 < tiles; t0 += kUnroll) {
      float v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t e = start + (t0 + u) * G + gl;
        v[u] = e < end ? load_f32(x + e) : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (t0 + u >= tiles) break;  // uniform across the warp
        const int64_t tile_start = start + (t0 + u) * G;  // a multiple of 8
        const bool valid = tile_start + gl < end;
        // NaN >= 0 is false: NaN packs a 0 bit, as in the reference.
        const unsigned signs = __ballot_sync(kFullMask, valid && v[u] >= 0.0f);
        if (gl < G / 8 && tile_start + 8 * gl < end)
          packed[tile_start / 8 + gl] = static_cast<uint8_t>(signs >> (gbase + 8 * gl));
        // Invalid lanes hold 0. The square of a float is exact in float64.
        const double d = static_cast<double>(v[u]);
        sum += norm_scale ? d * d : fabs(d);
      }
    }
    sum = group_sum(sum, G);
    if (active && gl == 0) {
      if (pieces_per_chunk == 1)
        scales[chunk] = onebit_scale(sum, chunk_end - chunk_start, norm_scale);
      else
        partial[item] = sum;
    }
  }
}

// One warp per chunk adds the pieces' partial sums.
__global__ void onebit_reduce_kernel(const double* __restrict__ partial, int64_t n, int64_t chunk_size,
                                     int64_t chunks, int64_t pieces_per_chunk, bool norm_scale,
                                     float* __restrict__ scales) {
  const int lane = threadIdx.x % kWarpSize;
  for (int64_t c = global_warp(); c < chunks; c += warp_count()) {
    double sum = 0.0;
    for (int64_t p = lane; p < pieces_per_chunk; p += kWarpSize) sum += partial[c * pieces_per_chunk + p];
    sum = group_sum(sum, kWarpSize);
    if (lane == 0) {
      const int64_t start = c * chunk_size;
      scales[c] = onebit_scale(sum, min(chunk_size, n - start), norm_scale);
    }
  }
}

// Error-fed encode (fp32): the encode kernel's scheme on e = residual + grad
// (recomputed from the inputs, never stored until the end). With one piece per
// chunk the group then knows the chunk's scale and makes a second pass over its
// elements (from cache): residual = e - (e >= 0 ? scale : -scale), one write.
// With several pieces it leaves the residual to onebit_feedback_residual_kernel.
//
// What is added to the residual: nothing, a gradient, or (parts != null) the mean of w one-bit rows
// (onebit_mean_feedback_encode): each row decoded, summed in fp32 in row order, divided by w.
struct FeedbackIn {
  const float* grad;
  const uint8_t* parts;
  const float* part_scales;
  int64_t parts_stride;   // bytes between rows of parts
  int64_t scales_stride;  // floats between rows of part_scales
  int w;
  int64_t chunk_size;
};

__device__ __forceinline__ float feedback_value(const float* __restrict__ res, const FeedbackIn& in, int64_t e) {
  if (in.parts != nullptr) {
    const int64_t c = split_index(e, in.chunk_size).r;
    const unsigned shift = static_cast<unsigned>(e & 7);
    float acc = 0.0f;
    for (int j = 0; j < in.w; ++j) {
      const float s = in.part_scales[j * in.scales_stride + c];
      const float d = ((in.parts[j * in.parts_stride + (e >> 3)] >> shift) & 1u) ? s : -s;
      acc = j == 0 ? d : __fadd_rn(acc, d);
    }
    return __fadd_rn(res[e], __fdiv_rn(acc, static_cast<float>(in.w)));
  }
  return in.grad == nullptr ? res[e] : __fadd_rn(res[e], in.grad[e]);
}

template <int G>
__global__ void onebit_feedback_kernel(float* __restrict__ res, const FeedbackIn in, int64_t n,
                                       int64_t chunk_size, int64_t piece_len, int64_t pieces_per_chunk,
                                       int64_t items, bool norm_scale, uint8_t* __restrict__ packed,
                                       float* __restrict__ scales, double* __restrict__ partial) {
  static_assert(G == 8 || G == 32, "a group is 8 or 32 lanes");
  constexpr int kGroups = kWarpSize / G;
  const int lane = threadIdx.x % kWarpSize;
  const int gl = lane % G;
  const int gbase = lane - gl;
  const int64_t tiles = (piece_len + G - 1) / G;

  for (int64_t w = global_warp(); w * kGroups < items; w += warp_count()) {
    const int64_t item = w * kGroups + lane / G;
    const bool active = item < items;
    const int64_t chunk = pieces_per_chunk == 1 ? item : item / pieces_per_chunk;
    const int64_t piece = item - chunk * pieces_per_chunk;
    const int64_t chunk_start = chunk * chunk_size;
    const int64_t chunk_end = min(chunk_start + chunk_size, n);
    const int64_t start = chunk_start + piece * piece_len;
    const int64_t end = active ? min(start + piece_len, chunk_end) : start;

    double sum = 0.0;
    for (int64_t t0 = 0; t0 < tiles; t0 += kUnroll) {
      float v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t e = start + (t0 + u) * G + gl;
        v[u] = e < end ? feedback_value(res, in, e) : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (t0 + u >= tiles) break;  // uniform across the warp
        const int64_t tile_start = start + (t0 + u) * G;
        const bool valid = tile_start + gl < end;
        const unsigned signs = __ballot_sync(kFullMask, valid && v[u] >= 0.0f);
        if (gl < G / 8 && tile_start + 8 * gl < end)
          packed[tile_start / 8 + gl] = static_cast<uint8_t>(signs >> (gbase + 8 * gl));
        const double d = static_cast<double>(v[u]);
        sum += norm_scale ? d * d : fabs(d);
      }
    }
    sum = group_sum(sum, G);  // every lane of the group gets the sum
    if (pieces_per_chunk != 1) {
      if (active && gl == 0) partial[item] = sum;
      continue;
    }
    if (!active) continue;
    const float s = onebit_scale(sum, chunk_end - chunk_start, norm_scale);
    if (gl == 0) scales[chunk] = s;
    // The lane's own elements again (kUnroll loads in flight, then the stores): the sign decides the decoded
    // value as it decided the bit.
    for (int64_t t0 = 0; t0 < tiles; t0 += kUnroll) {
      float v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t e = start + (t0 + u) * G + gl;
        v[u] = e < end ? feedback_value(res, in, e) : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t e = start + (t0 + u) * G + gl;
        if (e < end) res[e] = __fsub_rn(v[u], v[u] >= 0.0f ? s : -s);
      }
    }
  }
}

// residual = residual + grad - decode, one thread per element (chunks split into pieces).
__global__ void onebit_feedback_residual_kernel(float* __restrict__ res, const FeedbackIn in, int64_t n,
                                                int64_t chunk_size, const uint8_t* __restrict__ packed,
                                                const float* __restrict__ scales) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
    const float s = scales[split_index(e, chunk_size).r];
    const bool bit = (packed[e >> 3] >> (e & 7)) & 1u;
    res[e] = __fsub_rn(feedback_value(res, in, e), bit ? s : -s);
  }
}

// One thread per packed byte; `vec`: out is aligned for an 8-element vector store.
template <typename T>
__global__ void onebit_decode_kernel(const uint8_t* __restrict__ packed, const float* __restrict__ scales, int64_t n,
                                     int64_t chunk_bytes, bool vec, T* __restrict__ out) {
  const int64_t nbytes = (n + 7) / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < nbytes; b += stride) {
    const float s = scales[split_index(b, chunk_bytes).r];
    const uint32_t bits = packed[b];
    const int64_t e0 = b * 8;
    if (vec && e0 + 8 <= n) {
      AlignedVec<T, 8> v;
#pragma unroll
      for (int j = 0; j < 8; ++j) v.v[j] = from_f32<T>(((bits >> j) & 1u) ? s : -s);
      *reinterpret_cast<AlignedVec<T, 8>*>(out + e0) = v;
    } else {
      for (int j = 0; j < 8 && e0 + j < n; ++j) out[e0 + j] = from_f32<T>(((bits >> j) & 1u) ? s : -s);
    }
  }
}

// Pieces per chunk and piece length of a launch.
void onebit_split(int64_t chunk_size, int64_t* pieces_per_chunk, int64_t* piece_len) {
  if (chunk_size <= kPiece) {
    *pieces_per_chunk = 1;
    *piece_len = chunk_size;
  } else {
    *pieces_per_chunk = ceil_div(chunk_size, kPiece);
    *piece_len = kPiece;
  }
}

}  // namespace

int64_t onebit_encode_workspace_bytes(int64_t n, int64_t chunk_size) {
  if (n <= 0 || chunk_size <= 0) return 0;
  int64_t ppc = 0, piece_len = 0;
  onebit_split(chunk_size, &ppc, &piece_len);
  return ppc == 1 ? 0 : ceil_div(n, chunk_size) * ppc * static_cast<int64_t>(sizeof(double));
}

cudaError_t onebit_encode(const void* x, ScDType dt, int64_t n, int64_t chunk_size, bool norm_scale,
                          uint8_t* packed, float* scales, void* workspace, cudaStream_t stream) {
  if (n < 0 || chunk_size <= 0 || chunk_size % 8 != 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (onebit_encode_workspace_bytes(n, chunk_size) > 0 && workspace == nullptr) return cudaErrorInvalidValue;
  const int64_t chunks = ceil_div(n, chunk_size);
  int64_t ppc = 0, piece_len = 0;
  onebit_split(chunk_size, &ppc, &piece_len);
  const int64_t items = chunks * ppc;
  double* partial = static_cast<double*>(workspace);
  return dispatch_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x);
    if (chunk_size < kSmallChunk) {
      constexpr int G = 8;
      const int64_t warps = ceil_div(items, kWarpSize / G);
      onebit_encode_kernel<T, G><<<grid_for(warps, kWarpsPerBlock), kThreads, 0, stream>>>(
          xp, n, chunk_size, piece_len, ppc, items, norm_scale, packed, scales, partial);
    } else {
      constexpr int G = 32;
      onebit_encode_kernel<T, G><<<grid_for(items, kWarpsPerBlock), kThreads, 0, stream>>>(
          xp, n, chunk_size, piece_len, ppc, items, norm_scale, packed, scales, partial);
    }
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess || ppc == 1) return err;
    onebit_reduce_kernel<<<grid_for(chunks, kWarpsPerBlock), kThreads, 0, stream>>>(partial, n, chunk_size, chunks,
                                                                                     ppc, norm_scale, scales);
    return cudaGetLastError();
  });
}

cudaError_t onebit_decode(const uint8_t* packed, const float* scales, int64_t n, int64_t chunk_size, void* out,
                          ScDType out_dt, cudaStream_t stream) {
  if (n < 0 || chunk_size <= 0 || chunk_size % 8 != 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const int64_t nbytes = ceil_div(n, 8);
  return dispatch_dtype(out_dt, [&](auto tag) {
    using T = decltype(tag);
    T* op = static_cast<T*>(out);
    const bool vec = reinterpret_cast<uintptr_t>(op) % sizeof(AlignedVec<T, 8>) == 0;
    onebit_decode_kernel<T><<<grid_for(nbytes, kThreads), kThreads, 0, stream>>>(packed, scales, n, chunk_size / 8,
                                                                                 vec, op);
    return cudaGetLastError();
  });
}

// The error-fed encode of residual + `in` (see FeedbackIn).
static cudaError_t feedback_encode(float* residual, const FeedbackIn& in, int64_t n, int64_t chunk_size,
                                   bool norm_scale, uint8_t* packed, float* scales, void* workspace,
                                   cudaStream_t stream) {
  if (n < 0 || chunk_size <= 0 || chunk_size % 8 != 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (onebit_encode_workspace_bytes(n, chunk_size) > 0 && workspace == nullptr) return cudaErrorInvalidValue;
  const int64_t chunks = ceil_div(n, chunk_size);
  int64_t ppc = 0, piece_len = 0;
  onebit_split(chunk_size, &ppc, &piece_len);
  const int64_t items = chunks * ppc;
  double* partial = static_cast<double*>(workspace);
  if (chunk_size < kSmallChunk) {
    constexpr int G = 8;
    const int64_t warps = ceil_div(items, kWarpSize / G);
    onebit_feedback_kernel<G><<<grid_for(warps, kWarpsPerBlock), kThreads, 0, stream>>>(
        residual, in, n, chunk_size, piece_len, ppc, items, norm_scale, packed, scales, partial);
  } else {
    constexpr int G = 32;
    onebit_feedback_kernel<G><<<grid_for(items, kWarpsPerBlock), kThreads, 0, stream>>>(
        residual, in, n, chunk_size, piece_len, ppc, items, norm_scale, packed, scales, partial);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || ppc == 1) return err;
  onebit_reduce_kernel<<<grid_for(chunks, kWarpsPerBlock), kThreads, 0, stream>>>(partial, n, chunk_size, chunks, ppc,
                                                                                   norm_scale, scales);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  onebit_feedback_residual_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(residual, in, n, chunk_size,
                                                                                  packed, scales);
  return cudaGetLastError();
}

cudaError_t onebit_feedback_encode(float* residual, const float* grad, int64_t n, int64_t chunk_size,
                                   bool norm_scale, uint8_t* packed, float* scales, void* workspace,
                                   cudaStream_t stream) {
  const FeedbackIn in{grad, nullptr, nullptr, 0, 0, 0, chunk_size};
  return feedback_encode(residual, in, n, chunk_size, norm_scale, packed, scales, workspace, stream);
}

cudaError_t onebit_mean_feedback_encode(float* residual, const uint8_t* parts, int64_t parts_stride,
                                        const float* part_scales, int64_t scales_stride, int w, int64_t n,
                                        int64_t chunk_size, bool norm_scale, uint8_t* packed, float* scales,
                                        void* workspace, cudaStream_t stream) {
  if (w < 1 || (n > 0 && (parts == nullptr || part_scales == nullptr))) return cudaErrorInvalidValue;
  const FeedbackIn in{nullptr, parts, part_scales, parts_stride, scales_stride, w, chunk_size};
  return feedback_encode(residual, in, n, chunk_size, norm_scale, packed, scales, workspace, stream);
}

}  // namespace cuda
}  // namespace sylvie_comm
