// Argument checks of the C++ CPU kernels (csrc/cpu/kernels.cpp): the second line
// of defence. The first is sylvie_comm/kernels/checks.py, the same rules with the
// same messages in Python, run before any of these kernels is entered (by the
// CPU kernels of torch.ops.sylvie_comm.* and by the entry points of
// sylvie_comm.kernels, see sylvie_comm/kernels/compiled.py) and by the Triton ops,
// so every device accepts the same inputs and a bad argument never makes a C++
// exception cross from this extension into torch (which an extension built by
// another compiler than torch's may not survive). Keep the two in step: a rule
// added here and not there would throw here.
#pragma once

#include <ATen/ATen.h>

#include <limits>

#include "common/sc_math.h"

namespace sylvie_comm {
namespace checks {

inline void on_device(const at::Tensor& t, c10::DeviceType type, const char* op) {
  TORCH_CHECK(t.device().type() == type, op, ": expected a ", c10::DeviceTypeName(type), " tensor, got device ",
              t.device());
}

// `t` on the device of `ref` (the op's residual or output).
inline void same_device(const at::Tensor& t, const at::Tensor& ref, const char* what, const char* op) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", what, " must be on ", ref.device(), ", got ", t.device());
}

inline void bits(int64_t bits, const char* op) {
  TORCH_CHECK(bits == 1 || bits == 2 || bits == 4 || bits == 8, op, ": bits must be one of {1, 2, 4, 8}, got ",
              bits);
}

inline bool is_float(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

inline void float_input(const at::Tensor& x, c10::DeviceType type, const char* op) {
  on_device(x, type, op);
  TORCH_CHECK(is_float(x.scalar_type()), op, ": expected a float32, float16 or bfloat16 tensor, got ",
              x.scalar_type());
}

inline void out_dtype(at::ScalarType t, const char* op) {
  TORCH_CHECK(is_float(t), op, ": dtype must be float32, float16 or bfloat16, got ", t);
}

inline void chunk_size(int64_t chunk, const char* op) {
  TORCH_CHECK(chunk > 0 && chunk % 8 == 0, op, ": chunk_size must be a positive multiple of 8, got ", chunk);
}

inline void contiguous_out(const at::Tensor& out, c10::DeviceType type, const char* op, int64_t dim = -1) {
  TORCH_CHECK(out.device().type() == type && out.is_contiguous() && (dim < 0 || out.dim() == dim), op,
              ": out must be a contiguous ", dim < 0 ? "" : "2-D ", c10::DeviceTypeName(type),
              " tensor, got shape ", out.sizes());
  out_dtype(out.scalar_type(), op);
}

inline void f32_contiguous(const at::Tensor& t, c10::DeviceType type, const char* op, const char* what) {
  TORCH_CHECK(t.device().type() == type && t.is_contiguous() && t.scalar_type() == at::kFloat, op, ": ", what,
              " must be a contiguous float32 ", c10::DeviceTypeName(type), " tensor, got ", t.scalar_type(),
              " of shape ", t.sizes(), " on ", t.device());
}

inline void pack_bits(const at::Tensor& values, int64_t nbits, c10::DeviceType type) {
  bits(nbits, "pack_bits");
  on_device(values, type, "pack_bits");
  TORCH_CHECK(values.dim() == 2, "pack_bits: expected a 2-D tensor, got ", values.dim(), " dimensions");
  TORCH_CHECK(values.scalar_type() == at::kByte, "pack_bits: expected uint8 values, got ", values.scalar_type());
}

inline void unpack_bits(const at::Tensor& packed, int64_t nbits, int64_t cols, c10::DeviceType type) {
  bits(nbits, "unpack_bits");
  on_device(packed, type, "unpack_bits");
  TORCH_CHECK(packed.dim() == 2, "unpack_bits: expected a 2-D tensor, got ", packed.dim(), " dimensions");
  TORCH_CHECK(packed.scalar_type() == at::kByte, "unpack_bits: expected uint8, got ", packed.scalar_type());
  TORCH_CHECK(cols >= 0, "unpack_bits: cols must be >= 0, got ", cols);
  const int64_t pc = sc_packed_cols(cols, static_cast<int>(nbits));
  TORCH_CHECK(packed.size(1) == pc, "unpack_bits: ", cols, " values of ", nbits, " bits need ", pc,
              " bytes per row, got ", packed.size(1));
}

inline void onebit_decode_into(const at::Tensor& packed, const at::Tensor& scales, int64_t chunk,
                               const at::Tensor& out, c10::DeviceType type) {
  contiguous_out(out, type, "onebit_decode_into");
  chunk_size(chunk, "onebit_decode");
  const int64_t numel = out.numel();
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.numel() == (numel + 7) / 8, "onebit_decode: expected ",
              (numel + 7) / 8, " uint8 bytes for ", numel, " values, got ", packed.numel(), " of ",
              packed.scalar_type());
  const int64_t chunks = sc_ceil_div(numel, chunk);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == chunks, "onebit_decode: expected ", chunks,
              " float32 scales, got ", scales.numel(), " of ", scales.scalar_type());
  on_device(packed, type, "onebit_decode");
  on_device(scales, type, "onebit_decode");
}

// The w one-bit rows of onebit_mean_feedback_encode: (w >= 1, ceil(n / 8)) uint8 bits and (w, chunks) fp32
// scales, each row contiguous (any row stride), on one device of type `type`.
inline void onebit_parts(const at::Tensor& packed, const at::Tensor& scales, int64_t n, int64_t chunks,
                         c10::DeviceType type, const char* op) {
  const int64_t nbytes = (n + 7) / 8;
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.size(0) >= 1 &&
                  packed.size(1) == nbytes && (packed.stride(1) == 1 || nbytes <= 1),
              op, ": parts_packed must be (w >= 1, ", nbytes, ") uint8 with contiguous rows, got ",
              packed.scalar_type(), " of shape ", packed.sizes(), " and strides ", packed.strides());
  TORCH_CHECK(packed.size(0) <= std::numeric_limits<int>::max(), op, ": too many rows: ", packed.size(0));
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.size(0) == packed.size(0) &&
                  scales.size(1) == chunks && (scales.stride(1) == 1 || chunks <= 1),
              op, ": parts_scales must be (", packed.size(0), ", ", chunks,
              ") float32 with contiguous rows, got ", scales.scalar_type(), " of shape ", scales.sizes(),
              " and strides ", scales.strides());
  on_device(packed, type, op);
  on_device(scales, type, op);
}

// A contiguous tensor of `dtype` and `numel` elements on ref's device (of type `type`).
inline void contiguous_like(const at::Tensor& t, at::ScalarType dtype, int64_t numel, const at::Tensor& ref,
                            c10::DeviceType type, const char* op, const char* what) {
  TORCH_CHECK(t.device().type() == type && t.is_contiguous() && t.scalar_type() == dtype && t.numel() == numel, op,
              ": ", what, " must be a contiguous ", c10::DeviceTypeName(type), " ", dtype, " tensor of ", numel,
              " elements, got ", t.scalar_type(), " of shape ", t.sizes());
  same_device(t, ref, what, op);
}

// The error-fed one-bit encodes: a contiguous fp32 residual of n elements, the packed bits (ceil(n / 8)
// uint8) and the scales (one fp32 per chunk) it is encoded into, on the residual's device. Returns n.
inline int64_t onebit_feedback(const at::Tensor& residual, int64_t chunk, const at::Tensor& packed,
                               const at::Tensor& scales, c10::DeviceType type, const char* op) {
  chunk_size(chunk, op);
  f32_contiguous(residual, type, op, "residual");
  const int64_t n = residual.numel();
  contiguous_like(packed, at::kByte, (n + 7) / 8, residual, type, op, "packed");
  contiguous_like(scales, at::kFloat, sc_ceil_div(n, chunk), residual, type, op, "scales");
  return n;
}

inline void onebit_feedback_encode(const at::Tensor& residual, const c10::optional<at::Tensor>& grad, int64_t chunk,
                                   const at::Tensor& packed, const at::Tensor& scales, c10::DeviceType type) {
  const char* op = "onebit_feedback_encode";
  const int64_t n = onebit_feedback(residual, chunk, packed, scales, type, op);
  if (grad.has_value() && grad->defined()) {
    const at::Tensor& g = *grad;
    TORCH_CHECK(g.device().type() == type && g.is_contiguous() && is_float(g.scalar_type()), op,
                ": grad must be a contiguous float32, float16 or bfloat16 ", c10::DeviceTypeName(type),
                " tensor, got ", g.scalar_type(), " of shape ", g.sizes(), " on ", g.device());
    TORCH_CHECK(grad->numel() == n, op, ": grad has ", grad->numel(), " elements, residual ", n);
    same_device(*grad, residual, "grad", op);
  }
}

inline void onebit_mean_feedback_encode(const at::Tensor& residual, const at::Tensor& parts_packed,
                                        const at::Tensor& parts_scales, int64_t chunk, const at::Tensor& packed,
                                        const at::Tensor& scales, c10::DeviceType type) {
  const char* op = "onebit_mean_feedback_encode";
  const int64_t n = onebit_feedback(residual, chunk, packed, scales, type, op);
  onebit_parts(parts_packed, parts_scales, n, sc_ceil_div(n, chunk), type, op);
  same_device(parts_packed, residual, "parts_packed", op);
  same_device(parts_scales, residual, "parts_scales", op);
}

inline void qbit_encode(const at::Tensor& x, int64_t nbits, at::ScalarType meta_dtype, c10::DeviceType type) {
  float_input(x, type, "qbit_encode");
  bits(nbits, "qbit_encode");
  TORCH_CHECK(x.dim() == 2, "qbit_encode: expected a 2-D tensor (rows, cols), got ", x.dim(), " dimensions");
  TORCH_CHECK(meta_dtype == at::kFloat || meta_dtype == at::kBFloat16,
              "qbit_encode: meta_dtype must be float32 or bfloat16, got ", meta_dtype);
}

inline void qbit_decode_into(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& minimum,
                             int64_t nbits, const at::Tensor& out, c10::DeviceType type) {
  bits(nbits, "qbit_decode");
  contiguous_out(out, type, "qbit_decode_into", 2);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte,
              "qbit_decode: expected a 2-D uint8 packed tensor, got ", packed.dim(), "-D ", packed.scalar_type());
  const int64_t rows = out.size(0), cols = out.size(1), pc = sc_packed_cols(cols, static_cast<int>(nbits));
  TORCH_CHECK(packed.size(0) == rows && packed.size(1) == pc, "qbit_decode: ", rows, " rows of ", cols,
              " values of ", nbits, " bits need packed shape [", rows, ", ", pc, "], got ", packed.sizes());
  for (const at::Tensor* m : {&scale, &minimum}) {
    TORCH_CHECK(m->dim() == 1 && m->size(0) == rows, "qbit_decode: expected ", rows,
                " per-row scale and minimum values, got shape ", m->sizes());
    TORCH_CHECK(m->scalar_type() == at::kFloat || m->scalar_type() == at::kBFloat16,
                "qbit_decode: scale and minimum must be float32 or bfloat16, got ", m->scalar_type());
    on_device(*m, type, "qbit_decode");
  }
  on_device(packed, type, "qbit_decode");
}

inline void decode_alloc(at::ScalarType dtype, int64_t count, const char* what, const char* op) {
  out_dtype(dtype, op);
  TORCH_CHECK(count >= 0, op, ": ", what, " must be >= 0, got ", count);
}

// The low-rank ops: a 2-D fp32 contiguous residual (or output) `mat`, named `mat_name`, an optional grad of as many
// elements, and the factors `a` and `b`: 2-D, fp32, contiguous, the same number (> 0) of columns;
// every tensor on mat's device, of type `type`.
inline void lowrank(const at::Tensor& mat, const char* mat_name, const c10::optional<at::Tensor>& grad,
                    const at::Tensor& a, const at::Tensor& b, c10::DeviceType type, const char* op,
                    const char* a_name, const char* b_name) {
  f32_contiguous(mat, type, op, mat_name);
  TORCH_CHECK(mat.dim() == 2, op, ": expected a 2-D ", mat_name, ", got shape ", mat.sizes());
  if (grad.has_value() && grad->defined()) {
    f32_contiguous(*grad, type, op, "grad");
    TORCH_CHECK(grad->numel() == mat.numel(), op, ": grad has ", grad->numel(), " elements, ", mat_name, " ",
                mat.numel());
    same_device(*grad, mat, "grad", op);
  }
  f32_contiguous(a, type, op, a_name);
  f32_contiguous(b, type, op, b_name);
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1) && a.size(1) > 0, op, ": ", a_name, " and ",
              b_name, " must be 2-D with the same number (> 0) of columns, got ", a.sizes(), " and ", b.sizes());
  same_device(a, mat, a_name, op);
  same_device(b, mat, b_name, op);
}

// lowrank_project(residual, grad, q, p, pending_p, pending_q): q is (cols x r), p (rows x r); the
// pending factors both or neither, pending_p (rows x r') and pending_q (cols x r').
inline void lowrank_project(const at::Tensor& residual, const c10::optional<at::Tensor>& grad, const at::Tensor& q,
                            const at::Tensor& p, const c10::optional<at::Tensor>& pending_p,
                            const c10::optional<at::Tensor>& pending_q, c10::DeviceType type) {
  const char* op = "lowrank_project";
  lowrank(residual, "residual", grad, q, p, type, op, "q", "p");
  const int64_t n = residual.size(0), k = residual.size(1);
  TORCH_CHECK(q.size(0) == k && p.size(0) == n, op, ": residual ", residual.sizes(), " needs q of ", k,
              " rows and p of ", n, " rows, got ", q.sizes(), " and ", p.sizes());
  const bool has_pp = pending_p.has_value() && pending_p->defined();
  const bool has_pq = pending_q.has_value() && pending_q->defined();
  TORCH_CHECK(has_pp == has_pq, op, ": pending_p and pending_q go together, got ", has_pp ? "pending_p" : "pending_q",
              " alone");
  if (has_pp) {
    lowrank(residual, "residual", c10::nullopt, *pending_p, *pending_q, type, op, "pending_p", "pending_q");
    TORCH_CHECK(pending_p->size(0) == n && pending_q->size(0) == k, op, ": residual ", residual.sizes(),
                " needs pending_p of ", n, " rows and pending_q of ", k, " rows, got ", pending_p->sizes(), " and ",
                pending_q->sizes());
  }
}

// lowrank_gram(residual, grad, p, q): p is (rows x r), q (cols x r).
inline void lowrank_gram(const at::Tensor& residual, const c10::optional<at::Tensor>& grad, const at::Tensor& p,
                         const at::Tensor& q, c10::DeviceType type) {
  const char* op = "lowrank_gram";
  lowrank(residual, "residual", grad, p, q, type, op, "p", "q");
  const int64_t n = residual.size(0), k = residual.size(1);
  TORCH_CHECK(p.size(0) == n && q.size(0) == k, op, ": residual ", residual.sizes(), " needs p of ", n,
              " rows and q of ", k, " rows, got ", p.sizes(), " and ", q.sizes());
}

// lowrank_outer_into(out, p, q): p is (rows x r), q (cols x r).
inline void lowrank_outer_into(const at::Tensor& out, const at::Tensor& p, const at::Tensor& q,
                               c10::DeviceType type) {
  const char* op = "lowrank_outer_into";
  lowrank(out, "out", c10::nullopt, p, q, type, op, "p", "q");
  const int64_t n = out.size(0), k = out.size(1);
  TORCH_CHECK(p.size(0) == n && q.size(0) == k, op, ": out ", out.sizes(), " needs p of ", n, " rows and q of ",
              k, " rows, got ", p.sizes(), " and ", q.sizes());
}

// Where a residual-updating op writes the residual as it was: a contiguous fp32 tensor of as many elements
// on the residual's device, not the residual itself.
inline void saved_copy(const c10::optional<at::Tensor>& saved, const at::Tensor& residual, c10::DeviceType type,
                       const char* op) {
  if (!saved.has_value() || !saved->defined()) return;
  f32_contiguous(*saved, type, op, "saved");
  TORCH_CHECK(saved->numel() == residual.numel(), op, ": saved has ", saved->numel(), " elements, residual ",
              residual.numel());
  same_device(*saved, residual, "saved", op);
  TORCH_CHECK(saved->numel() == 0 || saved->data_ptr() != residual.data_ptr(), op,
              ": saved must not be the residual itself");
}

// A one-element bool tensor on ref's device: the flag an op reads on the device to decide whether to act.
inline void device_flag(const at::Tensor& flag, const at::Tensor& ref, const char* what, const char* op) {
  TORCH_CHECK(flag.scalar_type() == at::kBool && flag.numel() == 1, op, ": ", what,
              " must be a one-element bool tensor, got ", flag.scalar_type(), " of shape ", flag.sizes());
  same_device(flag, ref, what, op);
}

inline void copy_if(const at::Tensor& dst, const c10::optional<at::Tensor>& src, const at::Tensor& flag,
                    c10::DeviceType type) {
  const char* op = "copy_if";
  TORCH_CHECK(dst.device().type() == type && dst.is_contiguous(), op, ": dst must be a contiguous ",
              c10::DeviceTypeName(type), " tensor, got shape ", dst.sizes(), " on ", dst.device());
  if (src.has_value() && src->defined()) {
    TORCH_CHECK(src->is_contiguous() && src->sizes() == dst.sizes() && src->scalar_type() == dst.scalar_type(), op,
                ": src must be a contiguous ", dst.scalar_type(), " tensor of shape ", dst.sizes(), ", got ",
                src->scalar_type(), " of shape ", src->sizes());
    same_device(*src, dst, "src", op);
  }
  device_flag(flag, dst, "flag", op);
}

}  // namespace checks
}  // namespace sylvie_comm
