// CPU kernels of the sylvie_comm ops: dtype conversion, parallel tiling and the
// run-time instruction-set choice. The inner loops are in impl.inc; the kernels
// of each op family in ops_*.inc; the semantics are those of
// sylvie_comm/kernels/reference.py.
//
// This file registers implementations only (TORCH_LIBRARY_IMPL below): every op's
// schema is declared once, in Python (sylvie_comm/kernels/opdecl.py), and defined
// from there under torch.ops.sylvie_comm_cpu when the extension is imported; the
// dispatcher then checks each kernel's C++ signature against it.
//
// These kernels are entered only once the op's Python argument checks have passed
// (sylvie_comm/kernels/checks.py, run by the public ops torch.ops.sylvie_comm.*,
// sylvie_comm/kernels/compiled.py): a bad argument is a Python exception, never a
// C++ one (a C++ exception has to unwind through this extension into torch, which an
// extension built by another compiler than torch's may not survive: segmentation
// faults on an H200 machine whose g++ 13.3 built it against a torch built by
// gcc-toolset-13). Their own TORCH_CHECKs (csrc/ops/checks.h) are a second line that
// no bad argument reaches.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "../common/sc_math.h"
#include "../ops/checks.h"
#include "isa.h"

#if defined(__x86_64__) || defined(_M_X64)
#define SC_X86 1
#include <immintrin.h>
#else
#define SC_X86 0
#endif

namespace sylvie_comm {
namespace cpu {

namespace base {
#define SC_IMPL_AVX2 0
#include "impl.inc"
#undef SC_IMPL_AVX2
}  // namespace base

#if SC_X86 && defined(__GNUC__)
#define SC_HAVE_AVX2_BUILD 1
namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2")
#define SC_IMPL_AVX2 1
#include "impl.inc"
#undef SC_IMPL_AVX2
#pragma GCC pop_options
}  // namespace avx2
// The AVX2 loops plus 512-bit q-bit noise generation (same arithmetic, sixteen lanes).
namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx2,avx512f,avx512bw,avx512vl")
#define SC_IMPL_AVX2 1
#define SC_IMPL_AVX512 1
#include "impl.inc"
#undef SC_IMPL_AVX512
#undef SC_IMPL_AVX2
#pragma GCC pop_options
}  // namespace avx512
#else
#define SC_HAVE_AVX2_BUILD 0
#endif

namespace {

// Rows the low-rank kernels take at a time (each chunk of Q^T is loaded once for all of them).
constexpr int64_t kLowRankRows = SC_LR_ROWS;

struct Impl {
  const char* name;
  decltype(&base::onebit_encode_f32) onebit_encode;
  decltype(&base::onebit_decode_f32) onebit_decode;
  decltype(&base::minmax_f32) minmax;
  decltype(&base::qbit_quantize_f32) quantize;
  decltype(&base::qbit_dequantize_f32) dequantize;
  decltype(&base::pack_f) pack;
  decltype(&base::unpack_f) unpack;
  decltype(&base::lowrank_project_rows_f32) lr_project;
  decltype(&base::lowrank_gram_tile_f32) lr_gram;
  decltype(&base::lowrank_outer_rows_f32) lr_outer;
  decltype(&base::add_into_f32) add_into;
  decltype(&base::onebit_residual_f32) onebit_residual;
  decltype(&base::onebit_mean_add_f32) onebit_mean_add;
  decltype(&base::lanes_add_f32) lanes_add;
  decltype(&base::lanes_tree_f32) lanes_tree;
};

const Impl kBase{"baseline",         base::onebit_encode_f32, base::onebit_decode_f32, base::minmax_f32,
                 base::qbit_quantize_f32, base::qbit_dequantize_f32, base::pack_f, base::unpack_f,
                 base::lowrank_project_rows_f32, base::lowrank_gram_tile_f32, base::lowrank_outer_rows_f32,
                 base::add_into_f32, base::onebit_residual_f32, base::onebit_mean_add_f32,
                 base::lanes_add_f32, base::lanes_tree_f32};
#if SC_HAVE_AVX2_BUILD
const Impl kAvx2{"avx2",             avx2::onebit_encode_f32, avx2::onebit_decode_f32, avx2::minmax_f32,
                 avx2::qbit_quantize_f32, avx2::qbit_dequantize_f32, avx2::pack_f, avx2::unpack_f,
                 avx2::lowrank_project_rows_f32, avx2::lowrank_gram_tile_f32, avx2::lowrank_outer_rows_f32,
                 avx2::add_into_f32, avx2::onebit_residual_f32, avx2::onebit_mean_add_f32,
                 avx2::lanes_add_f32, avx2::lanes_tree_f32};
const Impl kAvx512{"avx512",       avx512::onebit_encode_f32, avx512::onebit_decode_f32, avx512::minmax_f32,
                   avx512::qbit_quantize_f32, avx512::qbit_dequantize_f32, avx512::pack_f, avx512::unpack_f,
                   avx512::lowrank_project_rows_f32, avx512::lowrank_gram_tile_f32, avx512::lowrank_outer_rows_f32,
                   avx512::add_into_f32, avx512::onebit_residual_f32, avx512::onebit_mean_add_f32,
                 avx512::lanes_add_f32, avx512::lanes_tree_f32};
#endif

std::vector<const Impl*> supported() {
  std::vector<const Impl*> out{&kBase};
#if SC_HAVE_AVX2_BUILD
  if (__builtin_cpu_supports("avx2")) out.push_back(&kAvx2);
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    out.push_back(&kAvx512);
#endif
  return out;
}

const Impl* initial_impl() {
  auto all = supported();
  if (const char* env = std::getenv("SYLVIE_COMM_CPU_ISA")) {
    for (const Impl* i : all)
      if (std::string(env) == i->name) return i;
    TORCH_WARN("SYLVIE_COMM_CPU_ISA=", env, " is not available here; using ", all.back()->name);
  }
  return all.back();
}

std::atomic<const Impl*>& impl_slot() {
  static std::atomic<const Impl*> slot{initial_impl()};
  return slot;
}

const Impl& impl() { return *impl_slot().load(std::memory_order_relaxed); }

// Elements converted to fp32 at a time for fp16/bf16 inputs (a multiple of 8,
// so every block starts on a byte boundary of the packed output for any width).
constexpr int64_t kConv = 2048;
// Row segment processed as one task when rows are long.
constexpr int64_t kSegment = 1 << 16;
// Minimum elements per parallel task.
constexpr int64_t kGrainElems = 1 << 15;

constexpr c10::DeviceType kCPU = c10::DeviceType::CPU;

// Calls fn(block_ptr, block_len, block_offset) over [0, n) in fp32, converting
// from scalar_t in blocks of kConv when scalar_t is not float.
template <typename scalar_t, typename Fn>
void for_f32_blocks(const scalar_t* x, int64_t n, Fn&& fn) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    fn(x, n, int64_t{0});
  } else {
    float buf[kConv];
    for (int64_t b0 = 0; b0 < n; b0 += kConv) {
      int64_t m = std::min(kConv, n - b0);
      for (int64_t j = 0; j < m; ++j) buf[j] = static_cast<float>(x[b0 + j]);
      fn(static_cast<const float*>(buf), m, b0);
    }
  }
}

// Calls fn(block_out_f32, block_len, block_offset) and stores the block into out.
template <typename scalar_t, typename Fn>
void into_blocks(scalar_t* out, int64_t n, Fn&& fn) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    fn(out, n, int64_t{0});
  } else {
    float buf[kConv];
    for (int64_t b0 = 0; b0 < n; b0 += kConv) {
      int64_t m = std::min(kConv, n - b0);
      fn(static_cast<float*>(buf), m, b0);
      for (int64_t j = 0; j < m; ++j) out[b0 + j] = static_cast<scalar_t>(buf[j]);
    }
  }
}

template <typename Fn>
void dispatch_float(at::ScalarType t, Fn&& fn) {
  switch (t) {
    case at::kFloat:
      fn(float{});
      break;
    case at::kHalf:
      fn(at::Half{});
      break;
    case at::kBFloat16:
      fn(at::BFloat16{});
      break;
    default:
      TORCH_CHECK(false, "unsupported dtype ", t);
  }
}

float nan_f() { return std::numeric_limits<float>::quiet_NaN(); }

// The kernels, one file per op family.
#include "ops_codes.inc"
#include "ops_residual.inc"

}  // namespace

std::vector<std::string> available_isas() {
  std::vector<std::string> names;
  for (const Impl* i : supported()) names.emplace_back(i->name);
  return names;
}

std::string current_isa() { return impl().name; }

bool set_isa(const std::string& name) {
  for (const Impl* i : supported()) {
    if (name == i->name) {
      impl_slot().store(i);
      return true;
    }
  }
  return false;
}

}  // namespace cpu
}  // namespace sylvie_comm

// The raw kernels, under their own namespace: torch.ops.sylvie_comm.*'s CPU kernels (sylvie_comm/kernels/compiled.py)
// call them once the op's Python checks have passed (the top of this file says why).
TORCH_LIBRARY_IMPL(sylvie_comm_cpu, CPU, m) {
  using namespace sylvie_comm::cpu;
  m.impl("pack_bits", &pack_bits_cpu);
  m.impl("unpack_bits", &unpack_bits_cpu);
  m.impl("onebit_encode", &onebit_encode_cpu);
  m.impl("onebit_decode", &onebit_decode_cpu);
  m.impl("onebit_decode_into", &onebit_decode_into_cpu);
  m.impl("qbit_encode", &qbit_encode_cpu);
  m.impl("qbit_decode", &qbit_decode_cpu);
  m.impl("qbit_decode_into", &qbit_decode_into_cpu);
  m.impl("onebit_feedback_encode", &onebit_feedback_encode_cpu);
  m.impl("onebit_mean_feedback_encode", &onebit_mean_feedback_encode_cpu);
  m.impl("lowrank_project", &lowrank_project_cpu);
  m.impl("lowrank_gram", &lowrank_gram_cpu);
  m.impl("lowrank_outer_into", &lowrank_outer_into_cpu);
  m.impl("copy_if", &copy_if_cpu);
}
