// Host launchers of the sylvie_comm CUDA kernels: raw device pointers, sizes and
// a stream in, the result of cudaGetLastError() after the launches out. The
// torch glue (glue.cpp) checks arguments, allocates outputs and calls these;
// the semantics are those of sylvie_comm/kernels/reference.py.
//
// Plain C++: glue.cpp includes it through the host compiler. Device helpers
// shared by the .cu files are in device.cuh.
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

// ------------------------------------------------------------ fused fp32 ops
// In-place steps of error-fed one-bit and the low-rank algorithms on contiguous
// fp32 buffers (the CPU kernels take fp32 only too). A null grad means none.

// Error-fed one-bit encode: residual (n values) += grad, then sign bits and
// per-chunk scales exactly as onebit_encode of the sum, then residual -= its
// decode. workspace: onebit_encode_workspace_bytes(n, chunk_size) bytes, or null
// when that is 0. Bits and residual match the CPU kernel given the scales, and
// the scales match to one fp32 ulp (float64 sums in another order).
cudaError_t onebit_feedback_encode(float* residual, const float* grad, int64_t n, int64_t chunk_size,
                                   bool norm_scale, uint8_t* packed, float* scales, void* workspace,
                                   cudaStream_t stream);

// onebit_feedback_encode with grad the mean of w >= 1 one-bit rows: row j's bits at parts + j * parts_stride
// (ceil(n / 8) bytes), its scales at part_scales + j * scales_stride (one per chunk); each row decoded,
// summed in fp32 in row order, divided by w. Workspace as onebit_feedback_encode.
cudaError_t onebit_mean_feedback_encode(float* residual, const uint8_t* parts, int64_t parts_stride,
                                        const float* part_scales, int64_t scales_stride, int w, int64_t n,
                                        int64_t chunk_size, bool norm_scale, uint8_t* packed, float* scales,
                                        void* workspace, cudaStream_t stream);

// residual: (n, k), q: (k, r), p: (n, r), r > 0. residual += grad, p = residual q
// and, with subtract, residual -= p q^T (the terms of each element left to right).
cudaError_t lowrank_project(float* residual, const float* grad, int64_t n, int64_t k, const float* q, int64_t r,
                            float* p, bool subtract, cudaStream_t stream);

// Bytes of device scratch memory lowrank_gram needs (0 when its rows are not
// split into slabs, always when n < 128).
int64_t lowrank_gram_workspace_bytes(int64_t n, int64_t k, int64_t r);

// residual: (n, k), p: (n, r), q: (k, r). residual += grad, q = residual^T p
// (rows summed in order, by slabs when the workspace is used). workspace:
// lowrank_gram_workspace_bytes(n, k, r) bytes, or null when that is 0.
cudaError_t lowrank_gram(float* residual, const float* grad, int64_t n, int64_t k, const float* p, int64_t r,
                         float* q, void* workspace, cudaStream_t stream);

// out: (n, k), p: (n, r), q: (k, r). out = p (alpha q)^T, or out += p (alpha q)^T
// with accumulate; the same arithmetic in the same order as the CPU kernel. With
// `when` (a device bool; null: always) every thread returns at once unless it is true.
cudaError_t lowrank_outer_into(float* out, int64_t n, int64_t k, const float* p, const float* q, int64_t r,
                               float alpha, bool accumulate, cudaStream_t stream, const bool* when = nullptr);

// dst <- src (zeros when src is null), nbytes bytes, when *flag (a device bool) is true; else every thread
// returns at once. The flag is read on the device.
cudaError_t copy_if(void* dst, const void* src, int64_t nbytes, const bool* flag, cudaStream_t stream);

}  // namespace cuda
}  // namespace sylvie_comm
