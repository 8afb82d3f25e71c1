// CUDA registrations of the sylvie_comm ops: argument checks and outputs as in
// csrc/cpu/kernels.cpp (with CUDA in place of CPU), then the raw-pointer
// launchers of kernels.h on the current stream of the input's device. Compiled
// only when torch has CUDA (see setup.py).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

#include "common/sc_math.h"
#include "cuda/kernels.h"
#include "ops/checks.h"

namespace sylvie_comm {
namespace cuda {
namespace {

constexpr c10::DeviceType kCUDA = c10::DeviceType::CUDA;

void check_cuda(const at::Tensor& t, const char* op) { checks::on_device(t, kCUDA, op); }

// Every tensor an op reads or writes must be on the device its kernels run on.
void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

// Element type of a float32 / float16 / bfloat16 tensor (checked by the caller).
ScDType sc_dtype(at::ScalarType t) {
  if (t == at::kHalf) return kF16;
  if (t == at::kBFloat16) return kBF16;
  TORCH_CHECK(t == at::kFloat, "unsupported dtype ", t);
  return kF32;
}

// ---------------------------------------------------------------- pack / unpack

at::Tensor pack_bits_cuda(const at::Tensor& values_, int64_t bits) {
  checks::pack_bits(values_, bits, kCUDA);
  c10::cuda::CUDAGuard device_guard(values_.device());
  at::Tensor values = values_.contiguous();
  const int b = static_cast<int>(bits);
  const int64_t rows = values.size(0), cols = values.size(1), pc = sc_packed_cols(cols, b);
  at::Tensor out = at::empty({rows, pc}, values.options());
  cudaError_t err = pack_bits(values.data_ptr<uint8_t>(), rows, cols, b, out.data_ptr<uint8_t>(),
                              at::cuda::getCurrentCUDAStream());
  check_launch(err, "pack_bits");
  return out;
}

at::Tensor unpack_bits_cuda(const at::Tensor& packed_, int64_t bits, int64_t cols) {
  checks::unpack_bits(packed_, bits, cols, kCUDA);
  const int b = static_cast<int>(bits);
  c10::cuda::CUDAGuard device_guard(packed_.device());
  at::Tensor packed = packed_.contiguous();
  const int64_t rows = packed.size(0);
  at::Tensor out = at::empty({rows, cols}, packed.options());
  cudaError_t err = unpack_bits(packed.data_ptr<uint8_t>(), rows, cols, b, out.data_ptr<uint8_t>(),
                                at::cuda::getCurrentCUDAStream());
  check_launch(err, "unpack_bits");
  return out;
}

// ---------------------------------------------------------------- one-bit

std::tuple<at::Tensor, at::Tensor> onebit_encode_cuda(const at::Tensor& x_, int64_t chunk_size, bool norm_scale) {
  checks::float_input(x_, kCUDA, "onebit_encode");
  checks::chunk_size(chunk_size, "onebit_encode");
  c10::cuda::CUDAGuard device_guard(x_.device());
  at::Tensor x = x_.contiguous();
  const int64_t n = x.numel();
  const int64_t chunks = (n + chunk_size - 1) / chunk_size;
  at::Tensor packed = at::empty({(n + 7) / 8}, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({chunks}, x.options().dtype(at::kFloat));
  // Float64 partial sums when a chunk is split over several warps (empty otherwise).
  at::Tensor workspace = at::empty({onebit_encode_workspace_bytes(n, chunk_size)}, x.options().dtype(at::kByte));
  cudaError_t err = onebit_encode(x.data_ptr(), sc_dtype(x.scalar_type()), n, chunk_size, norm_scale,
                                  packed.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                                  workspace.numel() > 0 ? workspace.data_ptr() : nullptr,
                                  at::cuda::getCurrentCUDAStream());
  check_launch(err, "onebit_encode");
  return {packed, scales};
}

void onebit_decode_into_cuda(const at::Tensor& packed_, const at::Tensor& scales_, int64_t chunk_size,
                             const at::Tensor& out) {
  checks::onebit_decode_into(packed_, scales_, chunk_size, out, kCUDA);
  const int64_t numel = out.numel();
  checks::same_device(packed_, out, "packed", "onebit_decode");
  checks::same_device(scales_, out, "scales", "onebit_decode");
  c10::cuda::CUDAGuard device_guard(out.device());
  at::Tensor packed = packed_.contiguous(), scales = scales_.contiguous();
  cudaError_t err = onebit_decode(packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), numel, chunk_size,
                                  out.data_ptr(), sc_dtype(out.scalar_type()), at::cuda::getCurrentCUDAStream());
  check_launch(err, "onebit_decode");
}

at::Tensor onebit_decode_cuda(const at::Tensor& packed, const at::Tensor& scales, int64_t numel, int64_t chunk_size,
                              at::ScalarType dtype) {
  checks::decode_alloc(dtype, numel, "numel", "onebit_decode");
  check_cuda(packed, "onebit_decode");
  at::Tensor out = at::empty({numel}, packed.options().dtype(dtype));
  onebit_decode_into_cuda(packed, scales, chunk_size, out);
  return out;
}

// ---------------------------------------------------------------- q-bit

std::tuple<at::Tensor, at::Tensor, at::Tensor> qbit_encode_cuda(const at::Tensor& x_, int64_t bits, int64_t seed,
                                                                int64_t offset, at::ScalarType meta_dtype) {
  checks::qbit_encode(x_, bits, meta_dtype, kCUDA);
  c10::cuda::CUDAGuard device_guard(x_.device());
  at::Tensor x = x_.contiguous();
  const int64_t rows = x.size(0), cols = x.size(1);
  const int b = static_cast<int>(bits);
  at::Tensor packed = at::empty({rows, sc_packed_cols(cols, b)}, x.options().dtype(at::kByte));
  at::Tensor scale = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor minimum = at::empty({rows}, x.options().dtype(at::kFloat));
  const bool bf16 = meta_dtype == at::kBFloat16;
  cudaError_t err = qbit_encode(x.data_ptr(), sc_dtype(x.scalar_type()), rows, cols, b, static_cast<uint64_t>(seed),
                                static_cast<uint64_t>(offset), bf16, packed.data_ptr<uint8_t>(),
                                scale.data_ptr<float>(), minimum.data_ptr<float>(), at::cuda::getCurrentCUDAStream());
  check_launch(err, "qbit_encode");
  // With bf16 metadata the values are already bf16-representable: the cast is exact.
  if (bf16) return {packed, scale.to(at::kBFloat16), minimum.to(at::kBFloat16)};
  return {packed, scale, minimum};
}

void qbit_decode_into_cuda(const at::Tensor& packed_, const at::Tensor& scale_, const at::Tensor& minimum_,
                           int64_t bits, const at::Tensor& out) {
  checks::qbit_decode_into(packed_, scale_, minimum_, bits, out, kCUDA);
  const int b = static_cast<int>(bits);
  const int64_t rows = out.size(0), cols = out.size(1);
  checks::same_device(packed_, out, "packed", "qbit_decode");
  checks::same_device(scale_, out, "scale", "qbit_decode");
  checks::same_device(minimum_, out, "minimum", "qbit_decode");
  c10::cuda::CUDAGuard device_guard(out.device());
  at::Tensor packed = packed_.contiguous();
  at::Tensor scale = scale_.to(at::kFloat).contiguous(), minimum = minimum_.to(at::kFloat).contiguous();
  cudaError_t err = qbit_decode(packed.data_ptr<uint8_t>(), scale.data_ptr<float>(), minimum.data_ptr<float>(), rows,
                                cols, b, out.data_ptr(), sc_dtype(out.scalar_type()), at::cuda::getCurrentCUDAStream());
  check_launch(err, "qbit_decode");
}

at::Tensor qbit_decode_cuda(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& minimum,
                            int64_t bits, int64_t cols, at::ScalarType dtype) {
  checks::decode_alloc(dtype, cols, "cols", "qbit_decode");
  TORCH_CHECK(packed.dim() == 2, "qbit_decode: expected a 2-D uint8 packed tensor, got ", packed.dim(), "-D");
  check_cuda(packed, "qbit_decode");
  at::Tensor out = at::empty({packed.size(0), cols}, packed.options().dtype(dtype));
  qbit_decode_into_cuda(packed, scale, minimum, bits, out);
  return out;
}

// ---------------------------------------------------------------- fused fp32 ops
// The checks of csrc/ops/checks.h, as the CPU registrations make them, with CUDA in place of CPU and every
// tensor on the residual's device.

bool has_tensor(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// The residual as it is, into `saved` (when given), on the stream, before the op's kernel changes it. (The CPU
// kernels copy each block as they reach it; here one device copy, at the device's bandwidth.)
void save_residual(const c10::optional<at::Tensor>& saved, const at::Tensor& residual, const char* op) {
  checks::saved_copy(saved, residual, kCUDA, op);
  if (has_tensor(saved)) saved->view(-1).copy_(residual.view(-1));
}

void onebit_feedback_encode_cuda(const at::Tensor& residual, const c10::optional<at::Tensor>& grad,
                                 int64_t chunk_size, bool norm_scale, const at::Tensor& packed,
                                 const at::Tensor& scales, const c10::optional<at::Tensor>& saved) {
  const char* op = "onebit_feedback_encode";
  checks::onebit_feedback_encode(residual, grad, chunk_size, packed, scales, kCUDA);
  const int64_t n = residual.numel();
  const bool with_grad = has_tensor(grad);
  c10::cuda::CUDAGuard device_guard(residual.device());
  save_residual(saved, residual, op);
  // Float64 partial sums when a chunk is split over several warps (empty otherwise), as onebit_encode.
  at::Tensor workspace =
      at::empty({onebit_encode_workspace_bytes(n, chunk_size)}, residual.options().dtype(at::kByte));
  cudaError_t err = onebit_feedback_encode(residual.data_ptr<float>(), with_grad ? grad->data_ptr<float>() : nullptr,
                                           n, chunk_size, norm_scale, packed.data_ptr<uint8_t>(),
                                           scales.data_ptr<float>(),
                                           workspace.numel() > 0 ? workspace.data_ptr() : nullptr,
                                           at::cuda::getCurrentCUDAStream());
  check_launch(err, op);
}

void onebit_mean_feedback_encode_cuda(const at::Tensor& residual, const at::Tensor& parts_packed,
                                      const at::Tensor& parts_scales, int64_t chunk_size, bool norm_scale,
                                      const at::Tensor& packed, const at::Tensor& scales,
                                      const c10::optional<at::Tensor>& saved) {
  const char* op = "onebit_mean_feedback_encode";
  checks::onebit_mean_feedback_encode(residual, parts_packed, parts_scales, chunk_size, packed, scales, kCUDA);
  const int64_t n = residual.numel();
  c10::cuda::CUDAGuard device_guard(residual.device());
  save_residual(saved, residual, op);
  at::Tensor workspace =
      at::empty({onebit_encode_workspace_bytes(n, chunk_size)}, residual.options().dtype(at::kByte));
  cudaError_t err = onebit_mean_feedback_encode(
      residual.data_ptr<float>(), parts_packed.data_ptr<uint8_t>(), parts_packed.stride(0),
      parts_scales.data_ptr<float>(), parts_scales.stride(0), static_cast<int>(parts_packed.size(0)), n, chunk_size,
      norm_scale, packed.data_ptr<uint8_t>(), scales.data_ptr<float>(),
      workspace.numel() > 0 ? workspace.data_ptr() : nullptr, at::cuda::getCurrentCUDAStream());
  check_launch(err, op);
}

void lowrank_project_cuda(const at::Tensor& residual, const c10::optional<at::Tensor>& grad, const at::Tensor& q,
                          const at::Tensor& p, bool subtract, const c10::optional<at::Tensor>& pending_p,
                          const c10::optional<at::Tensor>& pending_q, const c10::optional<at::Tensor>& saved) {
  const char* op = "lowrank_project";
  checks::lowrank_project(residual, grad, q, p, pending_p, pending_q, kCUDA);
  const int64_t n = residual.size(0), k = residual.size(1), r = q.size(1);
  c10::cuda::CUDAGuard device_guard(residual.device());
  save_residual(saved, residual, op);
  if (has_tensor(pending_p)) {
    // The pending update first, as lowrank_outer_into(residual, pending_p, pending_q, -1, true).
    cudaError_t perr = lowrank_outer_into(residual.data_ptr<float>(), n, k, pending_p->data_ptr<float>(),
                                          pending_q->data_ptr<float>(), pending_p->size(1), -1.0f, true,
                                          at::cuda::getCurrentCUDAStream());
    check_launch(perr, op);
  }
  cudaError_t err = lowrank_project(residual.data_ptr<float>(), has_tensor(grad) ? grad->data_ptr<float>() : nullptr,
                                    n, k, q.data_ptr<float>(), r, p.data_ptr<float>(), subtract,
                                    at::cuda::getCurrentCUDAStream());
  check_launch(err, op);
}

void lowrank_gram_cuda(const at::Tensor& residual, const c10::optional<at::Tensor>& grad, const at::Tensor& p,
                       const at::Tensor& q, const c10::optional<at::Tensor>& saved) {
  const char* op = "lowrank_gram";
  checks::lowrank_gram(residual, grad, p, q, kCUDA);
  const int64_t n = residual.size(0), k = residual.size(1), r = p.size(1);
  c10::cuda::CUDAGuard device_guard(residual.device());
  save_residual(saved, residual, op);
  // Fp32 partial sums of row slabs when the rows are split (empty otherwise).
  at::Tensor workspace = at::empty({lowrank_gram_workspace_bytes(n, k, r)}, residual.options().dtype(at::kByte));
  cudaError_t err = lowrank_gram(residual.data_ptr<float>(), has_tensor(grad) ? grad->data_ptr<float>() : nullptr, n,
                                 k, p.data_ptr<float>(), r, q.data_ptr<float>(),
                                 workspace.numel() > 0 ? workspace.data_ptr() : nullptr,
                                 at::cuda::getCurrentCUDAStream());
  check_launch(err, op);
}

void lowrank_outer_into_cuda(const at::Tensor& out, const at::Tensor& p, const at::Tensor& q, double alpha,
                             bool accumulate, const c10::optional<at::Tensor>& when) {
  const char* op = "lowrank_outer_into";
  checks::lowrank_outer_into(out, p, q, kCUDA);
  if (has_tensor(when)) checks::device_flag(*when, out, "when", op);
  const int64_t n = out.size(0), k = out.size(1), r = p.size(1);
  c10::cuda::CUDAGuard device_guard(out.device());
  cudaError_t err = lowrank_outer_into(out.data_ptr<float>(), n, k, p.data_ptr<float>(), q.data_ptr<float>(), r,
                                       static_cast<float>(alpha), accumulate, at::cuda::getCurrentCUDAStream(),
                                       has_tensor(when) ? when->data_ptr<bool>() : nullptr);
  check_launch(err, op);
}

// ---------------------------------------------------------------- masked restore

void copy_if_cuda(const at::Tensor& dst, const c10::optional<at::Tensor>& src, const at::Tensor& flag) {
  const char* op = "copy_if";
  checks::copy_if(dst, src, flag, kCUDA);
  c10::cuda::CUDAGuard device_guard(dst.device());
  const int64_t nbytes = dst.numel() * static_cast<int64_t>(dst.element_size());
  cudaError_t err = copy_if(dst.data_ptr(), has_tensor(src) ? src->data_ptr() : nullptr, nbytes,
                            flag.data_ptr<bool>(), at::cuda::getCurrentCUDAStream());
  check_launch(err, op);
}

}  // namespace
}  // namespace cuda
}  // namespace sylvie_comm

TORCH_LIBRARY_IMPL(sylvie_comm, CUDA, m) {
  m.impl("pack_bits", &sylvie_comm::cuda::pack_bits_cuda);
  m.impl("unpack_bits", &sylvie_comm::cuda::unpack_bits_cuda);
  m.impl("onebit_encode", &sylvie_comm::cuda::onebit_encode_cuda);
  m.impl("onebit_decode", &sylvie_comm::cuda::onebit_decode_cuda);
  m.impl("onebit_decode_into", &sylvie_comm::cuda::onebit_decode_into_cuda);
  m.impl("qbit_encode", &sylvie_comm::cuda::qbit_encode_cuda);
  m.impl("qbit_decode", &sylvie_comm::cuda::qbit_decode_cuda);
  m.impl("qbit_decode_into", &sylvie_comm::cuda::qbit_decode_into_cuda);
  m.impl("onebit_feedback_encode", &sylvie_comm::cuda::onebit_feedback_encode_cuda);
  m.impl("onebit_mean_feedback_encode", &sylvie_comm::cuda::onebit_mean_feedback_encode_cuda);
  m.impl("lowrank_project", &sylvie_comm::cuda::lowrank_project_cuda);
  m.impl("lowrank_gram", &sylvie_comm::cuda::lowrank_gram_cuda);
  m.impl("lowrank_outer_into", &sylvie_comm::cuda::lowrank_outer_into_cuda);
  m.impl("copy_if", &sylvie_comm::cuda::copy_if_cuda);
}
