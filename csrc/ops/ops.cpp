// Operator schemas of the sylvie_comm kernels, declared twice from one list:
//
// * torch.ops.sylvie_comm.*: the public ops. Their CPU kernels are Python functions
//   (sylvie_comm/kernels/compiled.py) that run the op's argument checks
//   (sylvie_comm/kernels/checks.py) and then the C++ kernel of the second set: a bad argument
//   is a Python exception, never a C++ one (a C++ exception has to unwind through
//   this extension into torch, which an extension built by another compiler than
//   torch's may not survive: segmentation faults on an H200 machine whose g++ 13.3
//   built it against a torch built by gcc-toolset-13).
// * torch.ops.sylvie_comm_cpu.*: the C++ CPU kernels (csrc/cpu/kernels.cpp), entered
//   only through those checks; their own TORCH_CHECKs (csrc/ops/checks.h) are a
//   second line that no bad argument reaches.
//
// The GPU kernels are the Triton ops of the same names and schemas
// (torch.ops.sylvie_comm_triton, sylvie_comm/kernels/triton/), checked by the same
// Python checks; the pure-torch reference of each op is
// sylvie_comm/kernels/reference.py.
#include <torch/library.h>

namespace {

void define_ops(torch::Library& m) {
  // values: (rows, cols) uint8 < 2**bits -> (rows, ceil(cols * bits / 8)) uint8.
  m.def("pack_bits(Tensor values, int bits) -> Tensor");
  m.def("unpack_bits(Tensor packed, int bits, int cols) -> Tensor");
  // Sign bits of the flattened input and one fp32 scale per chunk.
  m.def("onebit_encode(Tensor x, int chunk_size, bool norm_scale) -> (Tensor, Tensor)");
  m.def("onebit_decode(Tensor packed, Tensor scales, int numel, int chunk_size, ScalarType dtype) -> Tensor");
  // Decode into an existing contiguous tensor (no allocation, no first-touch page faults).
  m.def("onebit_decode_into(Tensor packed, Tensor scales, int chunk_size, Tensor(a!) out) -> ()");
  // Per-row stochastic quantization: (packed, scale, minimum).
  m.def("qbit_encode(Tensor x, int bits, int seed, int offset, ScalarType meta_dtype) -> (Tensor, Tensor, Tensor)");
  m.def("qbit_decode(Tensor packed, Tensor scale, Tensor minimum, int bits, int cols, ScalarType dtype) -> Tensor");
  // out: a contiguous (rows, cols) tensor.
  m.def("qbit_decode_into(Tensor packed, Tensor scale, Tensor minimum, int bits, Tensor(a!) out) -> ()");
  // Error-fed one-bit encode in place: residual += grad (when given), encode it into packed and scales,
  // residual -= its decode. CPU kernels (fp32, contiguous).
  // With `saved`, the residual as it was is written there first, while it is read (one write, no extra read):
  // what a step skipped for a non-finite input restores, for this op and the three below.
  m.def("onebit_feedback_encode(Tensor(a!) residual, Tensor? grad, int chunk_size, bool norm_scale, "
        "Tensor(b!) packed, Tensor(c!) scales, Tensor(d!)? saved=None) -> ()");
  // The same with residual += the mean of w one-bit rows (parts_packed (w, ceil(n / 8)) uint8 and parts_scales
  // (w, chunks) fp32, each row contiguous, any row stride): decoded, summed in fp32 in row order, divided by w.
  m.def("onebit_mean_feedback_encode(Tensor(a!) residual, Tensor parts_packed, Tensor parts_scales, int chunk_size, "
        "bool norm_scale, Tensor(b!) packed, Tensor(c!) scales, Tensor(d!)? saved=None) -> ()");
  // Low-rank steps (CPU kernels, fp32): residual -= pending_p pending_q^T (when given; the same bits
  // as lowrank_outer_into(residual, pending_p, pending_q, -1, true)), residual += grad (when given),
  // p = residual q, and with subtract residual -= p q^T, all in one pass over the residual.
  // (saved: the residual before the pending update.)
  m.def("lowrank_project(Tensor(a!) residual, Tensor? grad, Tensor q, Tensor(b!) p, bool subtract, "
        "Tensor? pending_p=None, Tensor? pending_q=None, Tensor(c!)? saved=None) -> ()");
  // residual += grad (when given), q = residual^T p.
  m.def("lowrank_gram(Tensor(a!) residual, Tensor? grad, Tensor p, Tensor(b!) q, Tensor(c!)? saved=None) -> ()");
  // out = p (alpha q)^T, or out += p (alpha q)^T with accumulate; with `when` (a one-element bool tensor on
  // out's device, read there) nothing happens unless it is true.
  m.def("lowrank_outer_into(Tensor(a!) out, Tensor p, Tensor q, float alpha, bool accumulate, "
        "Tensor? when=None) -> ()");
  // dst <- src (zeros without src) when `flag`, a one-element bool tensor on dst's device, is true; else
  // nothing. The flag is read on the device: no host synchronisation (the masked state restore of a step
  // skipped for a non-finite input).
  m.def("copy_if(Tensor(a!) dst, Tensor? src, Tensor flag) -> ()");
}

}  // namespace

TORCH_LIBRARY(sylvie_comm, m) { define_ops(m); }

TORCH_LIBRARY(sylvie_comm_cpu, m) { define_ops(m); }
