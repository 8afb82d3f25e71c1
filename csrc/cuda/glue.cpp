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

namespace sylvie_comm {
namespace cuda {
namespace {

void check_float_input(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.is_cuda(), op, ": expected a CUDA tensor, got device ", x.device());
  auto t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16, op,
              ": expected a float32, float16 or bfloat16 tensor, got ", t);
}

void check_cuda(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.is_cuda(), op, ": expected a CUDA tensor, got device ", t.device());
}

// Every tensor an op reads or writes must be on the device its kernels run on.
void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* what, const char* op) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", what, " must be on ", ref.device(), ", got ", t.device());
}

void check_bits(int64_t bits, const char* op) {
  TORCH_CHECK(bits == 1 || bits == 2 || bits == 4 || bits == 8, op, ": bits must be one of {1, 2, 4, 8}, got ",
              bits);
}

void check_out_dtype(at::ScalarType t, const char* op) {
  TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16, op,
              ": dtype must be float32, float16 or bfloat16, got ", t);
}

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
  check_bits(bits, "pack_bits");
  check_cuda(values_, "pack_bits");
  TORCH_CHECK(values_.dim() == 2, "pack_bits: expected a 2-D tensor, got ", values_.dim(), " dimensions");
  TORCH_CHECK(values_.scalar_type() == at::kByte, "pack_bits: expected uint8 values, got ", values_.scalar_type());
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
  check_bits(bits, "unpack_bits");
  check_cuda(packed_, "unpack_bits");
  TORCH_CHECK(packed_.dim() == 2, "unpack_bits: expected a 2-D tensor, got ", packed_.dim(), " dimensions");
  TORCH_CHECK(packed_.scalar_type() == at::kByte, "unpack_bits: expected uint8, got ", packed_.scalar_type());
  TORCH_CHECK(cols >= 0, "unpack_bits: cols must be >= 0, got ", cols);
  const int b = static_cast<int>(bits);
  const int64_t pc = sc_packed_cols(cols, b);
  TORCH_CHECK(packed_.size(1) == pc, "unpack_bits: ", cols, " values of ", bits, " bits need ", pc,
              " bytes per row, got ", packed_.size(1));
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
  check_float_input(x_, "onebit_encode");
  TORCH_CHECK(chunk_size > 0 && chunk_size % 8 == 0, "onebit_encode: chunk_size must be a positive multiple of 8, got ",
              chunk_size);
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
  TORCH_CHECK(out.is_cuda() && out.is_contiguous(), "onebit_decode_into: out must be a contiguous CUDA tensor");
  check_out_dtype(out.scalar_type(), "onebit_decode_into");
  TORCH_CHECK(chunk_size > 0 && chunk_size % 8 == 0, "onebit_decode: chunk_size must be a positive multiple of 8, got ",
              chunk_size);
  const int64_t numel = out.numel();
  TORCH_CHECK(packed_.scalar_type() == at::kByte && packed_.numel() == (numel + 7) / 8,
              "onebit_decode: expected ", (numel + 7) / 8, " uint8 bytes for ", numel, " values, got ",
              packed_.numel(), " of ", packed_.scalar_type());
  const int64_t chunks = (numel + chunk_size - 1) / chunk_size;
  TORCH_CHECK(scales_.scalar_type() == at::kFloat && scales_.numel() == chunks, "onebit_decode: expected ", chunks,
              " float32 scales, got ", scales_.numel(), " of ", scales_.scalar_type());
  check_same_device(packed_, out, "packed", "onebit_decode");
  check_same_device(scales_, out, "scales", "onebit_decode");
  c10::cuda::CUDAGuard device_guard(out.device());
  at::Tensor packed = packed_.contiguous(), scales = scales_.contiguous();
  cudaError_t err = onebit_decode(packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), numel, chunk_size,
                                  out.data_ptr(), sc_dtype(out.scalar_type()), at::cuda::getCurrentCUDAStream());
  check_launch(err, "onebit_decode");
}

at::Tensor onebit_decode_cuda(const at::Tensor& packed, const at::Tensor& scales, int64_t numel, int64_t chunk_size,
                              at::ScalarType dtype) {
  check_out_dtype(dtype, "onebit_decode");
  TORCH_CHECK(numel >= 0, "onebit_decode: numel must be >= 0, got ", numel);
  check_cuda(packed, "onebit_decode");
  at::Tensor out = at::empty({numel}, packed.options().dtype(dtype));
  onebit_decode_into_cuda(packed, scales, chunk_size, out);
  return out;
}

// ---------------------------------------------------------------- q-bit

std::tuple<at::Tensor, at::Tensor, at::Tensor> qbit_encode_cuda(const at::Tensor& x_, int64_t bits, int64_t seed,
                                                                int64_t offset, at::ScalarType meta_dtype) {
  check_float_input(x_, "qbit_encode");
  check_bits(bits, "qbit_encode");
  TORCH_CHECK(x_.dim() == 2, "qbit_encode: expected a 2-D tensor (rows, cols), got ", x_.dim(), " dimensions");
  TORCH_CHECK(meta_dtype == at::kFloat || meta_dtype == at::kBFloat16,
              "qbit_encode: meta_dtype must be float32 or bfloat16, got ", meta_dtype);
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
  check_bits(bits, "qbit_decode");
  TORCH_CHECK(out.is_cuda() && out.is_contiguous() && out.dim() == 2,
              "qbit_decode_into: out must be a contiguous 2-D CUDA tensor, got shape ", out.sizes());
  check_out_dtype(out.scalar_type(), "qbit_decode");
  TORCH_CHECK(packed_.dim() == 2 && packed_.scalar_type() == at::kByte,
              "qbit_decode: expected a 2-D uint8 packed tensor, got ", packed_.dim(), "-D ", packed_.scalar_type());
  const int b = static_cast<int>(bits);
  const int64_t rows = out.size(0), cols = out.size(1), pc = sc_packed_cols(cols, b);
  TORCH_CHECK(packed_.size(0) == rows && packed_.size(1) == pc, "qbit_decode: ", rows, " rows of ", cols,
              " values of ", bits, " bits need packed shape [", rows, ", ", pc, "], got ", packed_.sizes());
  for (const at::Tensor* m : {&scale_, &minimum_}) {
    TORCH_CHECK(m->dim() == 1 && m->size(0) == rows, "qbit_decode: expected ", rows,
                " per-row scale and minimum values, got shape ", m->sizes());
    TORCH_CHECK(m->scalar_type() == at::kFloat || m->scalar_type() == at::kBFloat16,
                "qbit_decode: scale and minimum must be float32 or bfloat16, got ", m->scalar_type());
  }
  check_same_device(packed_, out, "packed", "qbit_decode");
  check_same_device(scale_, out, "scale", "qbit_decode");
  check_same_device(minimum_, out, "minimum", "qbit_decode");
  c10::cuda::CUDAGuard device_guard(out.device());
  at::Tensor packed = packed_.contiguous();
  at::Tensor scale = scale_.to(at::kFloat).contiguous(), minimum = minimum_.to(at::kFloat).contiguous();
  cudaError_t err = qbit_decode(packed.data_ptr<uint8_t>(), scale.data_ptr<float>(), minimum.data_ptr<float>(), rows,
                                cols, b, out.data_ptr(), sc_dtype(out.scalar_type()), at::cuda::getCurrentCUDAStream());
  check_launch(err, "qbit_decode");
}

at::Tensor qbit_decode_cuda(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& minimum,
                            int64_t bits, int64_t cols, at::ScalarType dtype) {
  check_out_dtype(dtype, "qbit_decode");
  TORCH_CHECK(cols >= 0, "qbit_decode: cols must be >= 0, got ", cols);
  TORCH_CHECK(packed.dim() == 2, "qbit_decode: expected a 2-D uint8 packed tensor, got ", packed.dim(), "-D");
  check_cuda(packed, "qbit_decode");
  at::Tensor out = at::empty({packed.size(0), cols}, packed.options().dtype(dtype));
  qbit_decode_into_cuda(packed, scale, minimum, bits, out);
  return out;
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
}
