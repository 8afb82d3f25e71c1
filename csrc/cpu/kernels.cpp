// CPU kernels of the sylvie_comm ops: argument checks, dtype conversion,
// parallel tiling and the run-time instruction-set choice. The inner loops are
// in impl.inc; the semantics are those of sylvie_comm/kernels/reference.py.
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

// ---------------------------------------------------------------- pack / unpack

at::Tensor pack_bits_cpu(const at::Tensor& values_, int64_t bits) {
  checks::pack_bits(values_, bits, kCPU);
  at::Tensor values = values_.contiguous();
  const int64_t rows = values.size(0), cols = values.size(1), pc = sc_packed_cols(cols, static_cast<int>(bits));
  at::Tensor out = at::empty({rows, pc}, values.options());
  const uint8_t* v = values.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  const Impl& f = impl();
  const uint8_t mask = static_cast<uint8_t>((1u << bits) - 1u);
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElems / std::max<int64_t>(cols, 1)), [&](int64_t b, int64_t e) {
    uint8_t buf[kConv];
    for (int64_t r = b; r < e; ++r) {
      for (int64_t c0 = 0; c0 < cols; c0 += kConv) {
        int64_t m = std::min(kConv, cols - c0);
        for (int64_t j = 0; j < m; ++j) buf[j] = v[r * cols + c0 + j] & mask;
        f.pack(buf, m, static_cast<int>(bits), o + r * pc + (c0 * bits) / 8);
      }
    }
  });
  return out;
}

at::Tensor unpack_bits_cpu(const at::Tensor& packed_, int64_t bits, int64_t cols) {
  checks::unpack_bits(packed_, bits, cols, kCPU);
  const int64_t pc = sc_packed_cols(cols, static_cast<int>(bits));
  at::Tensor packed = packed_.contiguous();
  const int64_t rows = packed.size(0);
  at::Tensor out = at::empty({rows, cols}, packed.options());
  const uint8_t* p = packed.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  const Impl& f = impl();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElems / std::max<int64_t>(cols, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) f.unpack(p + r * pc, cols, static_cast<int>(bits), o + r * cols);
  });
  return out;
}

// ---------------------------------------------------------------- one-bit

std::tuple<at::Tensor, at::Tensor> onebit_encode_cpu(const at::Tensor& x_, int64_t chunk_size, bool norm_scale) {
  checks::float_input(x_, kCPU, "onebit_encode");
  checks::chunk_size(chunk_size, "onebit_encode");
  at::Tensor x = x_.contiguous();
  const int64_t n = x.numel();
  const int64_t chunks = sc_ceil_div(n, chunk_size);
  at::Tensor packed = at::empty({(n + 7) / 8}, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({chunks}, x.options().dtype(at::kFloat));
  uint8_t* out = packed.data_ptr<uint8_t>();
  float* sc = scales.data_ptr<float>();
  const Impl& f = impl();
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, chunks, std::max<int64_t>(1, kGrainElems / chunk_size), [&](int64_t b, int64_t e) {
      for (int64_t c = b; c < e; ++c) {
        const int64_t start = c * chunk_size, len = std::min(chunk_size, n - start);
        ScChunkSum sum(chunk_size, norm_scale, f.lanes_add, f.lanes_tree);
        for_f32_blocks(xp + start, len, [&](const float* blk, int64_t m, int64_t off) {
          f.onebit_encode(blk, m, out + (start + off) / 8);
          sum.add(blk, m);
        });
        sc[c] = sc_onebit_scale(sum.sum(), len, norm_scale);
      }
    });
  });
  return {packed, scales};
}

void onebit_decode_into_cpu(const at::Tensor& packed_, const at::Tensor& scales_, int64_t chunk_size,
                            const at::Tensor& out) {
  checks::onebit_decode_into(packed_, scales_, chunk_size, out, kCPU);
  const int64_t numel = out.numel();
  const int64_t chunks = sc_ceil_div(numel, chunk_size);
  at::Tensor packed = packed_.contiguous(), scales = scales_.contiguous();
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const float* sc = scales.data_ptr<float>();
  const Impl& f = impl();
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, chunks, std::max<int64_t>(1, kGrainElems / chunk_size), [&](int64_t b, int64_t e) {
      for (int64_t c = b; c < e; ++c) {
        const int64_t start = c * chunk_size, len = std::min(chunk_size, numel - start);
        into_blocks(op + start, len, [&](float* blk, int64_t m, int64_t off) {
          f.onebit_decode(p + (start + off) / 8, m, sc[c], blk);
        });
      }
    });
  });
}

at::Tensor onebit_decode_cpu(const at::Tensor& packed, const at::Tensor& scales, int64_t numel, int64_t chunk_size,
                             at::ScalarType dtype) {
  checks::decode_alloc(dtype, numel, "numel", "onebit_decode");
  at::Tensor out = at::empty({numel}, packed.options().dtype(dtype));
  onebit_decode_into_cpu(packed, scales, chunk_size, out);
  return out;
}

// ---------------------------------------------------------------- q-bit

std::tuple<at::Tensor, at::Tensor, at::Tensor> qbit_encode_cpu(const at::Tensor& x_, int64_t bits, int64_t seed,
                                                               int64_t offset, at::ScalarType meta_dtype) {
  checks::qbit_encode(x_, bits, meta_dtype, kCPU);
  at::Tensor x = x_.contiguous();
  const int64_t rows = x.size(0), cols = x.size(1);
  const int b = static_cast<int>(bits);
  const int64_t pc = sc_packed_cols(cols, b);
  at::Tensor packed = at::empty({rows, pc}, x.options().dtype(at::kByte));
  at::Tensor scale = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor minimum = at::empty({rows}, x.options().dtype(at::kFloat));
  uint8_t* out = packed.data_ptr<uint8_t>();
  float* sp = scale.data_ptr<float>();
  float* mp = minimum.data_ptr<float>();
  const bool bf16 = meta_dtype == at::kBFloat16;
  const int levels = (1 << b) - 1;
  const ScSeedKeys keys = sc_seed_keys(static_cast<uint64_t>(seed));
  const uint64_t off = static_cast<uint64_t>(offset);
  const Impl& f = impl();
  const int64_t segs = cols == 0 ? 1 : (cols + kSegment - 1) / kSegment;

  dispatch_float(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    auto row_minmax = [&](int64_t r, int64_t c0, int64_t len, float* mn, float* mx, bool* finite) {
      for_f32_blocks(xp + r * cols + c0, len,
                     [&](const float* blk, int64_t m, int64_t) { f.minmax(blk, m, mn, mx, finite); });
    };
    auto quantize = [&](int64_t r, int64_t c0, int64_t len, const ScQMeta& meta) {
      uint8_t* orow = out + r * pc;
      if (!meta.finite) {
        std::memset(orow + (c0 * b) / 8, 0, static_cast<size_t>(sc_packed_cols(len, b)));
        return;
      }
      for_f32_blocks(xp + r * cols + c0, len, [&](const float* blk, int64_t m, int64_t o) {
        f.quantize(blk, m, b, keys, off + static_cast<uint64_t>(r * cols + c0 + o), meta.minimum, meta.inv,
                   orow + ((c0 + o) * b) / 8);
      });
    };
    auto store_meta = [&](int64_t r, const ScQMeta& meta) {
      sp[r] = meta.scale;
      mp[r] = meta.minimum;
    };
    if (cols == 0) {
      for (int64_t r = 0; r < rows; ++r) sp[r] = mp[r] = 0.0f;
    } else if (segs == 1) {
      // Short rows: min/max and quantization back to back while the row is in cache.
      at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElems / cols), [&](int64_t rb, int64_t re) {
        for (int64_t r = rb; r < re; ++r) {
          float mn = std::numeric_limits<float>::infinity(), mx = -mn;
          bool finite = true;
          row_minmax(r, 0, cols, &mn, &mx, &finite);
          ScQMeta meta = sc_qbit_meta(finite ? mn : nan_f(), mx, levels, bf16);
          store_meta(r, meta);
          quantize(r, 0, cols, meta);
        }
      });
    } else {
      // Long rows: partial min/max per segment, reduced per row, then quantization per segment.
      const int64_t tiles = rows * segs;
      std::vector<float> pmn(tiles), pmx(tiles);
      std::vector<char> pfin(tiles);
      at::parallel_for(0, tiles, 1, [&](int64_t tb, int64_t te) {
        for (int64_t t = tb; t < te; ++t) {
          const int64_t r = t / segs, c0 = (t % segs) * kSegment;
          float mn = std::numeric_limits<float>::infinity(), mx = -mn;
          bool finite = true;
          row_minmax(r, c0, std::min(kSegment, cols - c0), &mn, &mx, &finite);
          pmn[t] = mn;
          pmx[t] = mx;
          pfin[t] = finite;
        }
      });
      std::vector<ScQMeta> metas(rows);
      for (int64_t r = 0; r < rows; ++r) {
        float mn = std::numeric_limits<float>::infinity(), mx = -mn;
        bool finite = true;
        for (int64_t s = 0; s < segs; ++s) {
          mn = std::min(mn, pmn[r * segs + s]);
          mx = std::max(mx, pmx[r * segs + s]);
          finite = finite && pfin[r * segs + s];
        }
        metas[r] = sc_qbit_meta(finite ? mn : nan_f(), mx, levels, bf16);
        store_meta(r, metas[r]);
      }
      at::parallel_for(0, tiles, 1, [&](int64_t tb, int64_t te) {
        for (int64_t t = tb; t < te; ++t) {
          const int64_t r = t / segs, c0 = (t % segs) * kSegment;
          quantize(r, c0, std::min(kSegment, cols - c0), metas[r]);
        }
      });
    }
  });
  if (bf16) return {packed, scale.to(at::kBFloat16), minimum.to(at::kBFloat16)};
  return {packed, scale, minimum};
}

void qbit_decode_into_cpu(const at::Tensor& packed_, const at::Tensor& scale_, const at::Tensor& minimum_,
                          int64_t bits, const at::Tensor& out) {
  checks::qbit_decode_into(packed_, scale_, minimum_, bits, out, kCPU);
  const int b = static_cast<int>(bits);
  const int64_t rows = out.size(0), cols = out.size(1), pc = sc_packed_cols(cols, b);
  at::Tensor packed = packed_.contiguous();
  at::Tensor scale = scale_.to(at::kFloat).contiguous(), minimum = minimum_.to(at::kFloat).contiguous();
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = minimum.data_ptr<float>();
  const Impl& f = impl();
  const int64_t segs = cols == 0 ? 1 : (cols + kSegment - 1) / kSegment;
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t tiles = rows * segs;
    const int64_t grain = segs > 1 ? 1 : std::max<int64_t>(1, kGrainElems / std::max<int64_t>(cols, 1));
    at::parallel_for(0, tiles, grain, [&](int64_t tb, int64_t te) {
      for (int64_t t = tb; t < te; ++t) {
        const int64_t r = t / segs, c0 = (t % segs) * kSegment, len = std::min(kSegment, cols - c0);
        into_blocks(op + r * cols + c0, len, [&](float* blk, int64_t m, int64_t o) {
          f.dequantize(p + r * pc + ((c0 + o) * b) / 8, m, b, sp[r], mp[r], blk);
        });
      }
    });
  });
}

at::Tensor qbit_decode_cpu(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& minimum, int64_t bits,
                           int64_t cols, at::ScalarType dtype) {
  checks::decode_alloc(dtype, cols, "cols", "qbit_decode");
  TORCH_CHECK(packed.dim() == 2, "qbit_decode: expected a 2-D uint8 packed tensor, got ", packed.dim(), "-D");
  at::Tensor out = at::empty({packed.size(0), cols}, packed.options().dtype(dtype));
  qbit_decode_into_cpu(packed, scale, minimum, bits, out);
  return out;
}


// ---------------------------------------------------------------- error feedback + one-bit

// One chunk of the residual, already compensated: its sign bits and scale, then residual -= decode.
void feedback_encode_chunk(const Impl& f, float* e, int64_t len, int64_t chunk_size, bool norm_scale, uint8_t* out,
                           float* scale) {
  f.onebit_encode(e, len, out);
  ScChunkSum sum(chunk_size, norm_scale, f.lanes_add, f.lanes_tree);
  sum.add(e, len);
  *scale = sc_onebit_scale(sum.sum(), len, norm_scale);
  f.onebit_residual(e, out, len, *scale);
}

// The residual's floats as they are, copied to `saved` (when given) just before the kernel reads them.
float* saved_ptr(const c10::optional<at::Tensor>& saved) {
  return saved.has_value() && saved->defined() ? saved->data_ptr<float>() : nullptr;
}

// Streaming (non-temporal) stores where `saved` is 16-byte aligned: the copy is written once, without first
// reading its cache lines (a plain copy reads them for ownership, which costs as much as the write).
void save_floats(float* saved, const float* from, int64_t count) {
  if (saved == nullptr || count <= 0) return;
  int64_t i = 0;
  while (i < count && (reinterpret_cast<uintptr_t>(saved + i) & 15) != 0) {
    saved[i] = from[i];
    ++i;
  }
  for (; i + 4 <= count; i += 4) _mm_stream_ps(saved + i, _mm_loadu_ps(from + i));
  for (; i < count; ++i) saved[i] = from[i];
  _mm_sfence();
}

void onebit_feedback_encode_cpu(const at::Tensor& residual, const c10::optional<at::Tensor>& grad, int64_t chunk_size,
                                bool norm_scale, const at::Tensor& packed, const at::Tensor& scales,
                                const c10::optional<at::Tensor>& saved) {
  checks::onebit_feedback_encode(residual, grad, chunk_size, packed, scales, kCPU);
  checks::saved_copy(saved, residual, kCPU, "onebit_feedback_encode");
  float* sv = saved_ptr(saved);
  const int64_t n = residual.numel();
  const bool has_grad = grad.has_value() && grad->defined();
  const int64_t chunks = sc_ceil_div(n, chunk_size);
  float* e = residual.data_ptr<float>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  float* sc = scales.data_ptr<float>();
  const Impl& f = impl();
  // The gradient in any float type: widened to fp32 (exactly) block by block, then one fp32 add per element.
  dispatch_float(has_grad ? grad->scalar_type() : at::kFloat, [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* g = has_grad ? grad->data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, chunks, std::max<int64_t>(1, kGrainElems / chunk_size), [&](int64_t b, int64_t end) {
      for (int64_t c = b; c < end; ++c) {
        const int64_t start = c * chunk_size, len = std::min(chunk_size, n - start);
        save_floats(sv == nullptr ? nullptr : sv + start, e + start, len);
        if (g != nullptr) {
          for_f32_blocks(g + start, len, [&](const float* blk, int64_t m, int64_t off) {
            f.add_into(e + start + off, blk, m);
          });
        }
        feedback_encode_chunk(f, e + start, len, chunk_size, norm_scale, out + start / 8, sc + c);
      }
    });
  });
}

void onebit_mean_feedback_encode_cpu(const at::Tensor& residual, const at::Tensor& parts_packed,
                                     const at::Tensor& parts_scales, int64_t chunk_size, bool norm_scale,
                                     const at::Tensor& packed, const at::Tensor& scales,
                                     const c10::optional<at::Tensor>& saved) {
  checks::onebit_mean_feedback_encode(residual, parts_packed, parts_scales, chunk_size, packed, scales, kCPU);
  checks::saved_copy(saved, residual, kCPU, "onebit_mean_feedback_encode");
  float* sv = saved_ptr(saved);
  const int64_t n = residual.numel();
  const int64_t chunks = sc_ceil_div(n, chunk_size);
  const int w = static_cast<int>(parts_packed.size(0));
  const float wf = static_cast<float>(w);
  const uint8_t* pp = parts_packed.data_ptr<uint8_t>();
  const float* ps = parts_scales.data_ptr<float>();
  const int64_t p_stride = parts_packed.stride(0), s_stride = parts_scales.stride(0);
  float* e = residual.data_ptr<float>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  float* sc = scales.data_ptr<float>();
  const Impl& f = impl();
  at::parallel_for(0, chunks, std::max<int64_t>(1, kGrainElems / chunk_size), [&](int64_t b, int64_t end) {
    std::vector<const uint8_t*> rows(static_cast<size_t>(w));
    std::vector<float> row_scales(static_cast<size_t>(w));
    for (int64_t c = b; c < end; ++c) {
      const int64_t start = c * chunk_size, len = std::min(chunk_size, n - start);
      for (int j = 0; j < w; ++j) {
        rows[j] = pp + j * p_stride + start / 8;
        row_scales[j] = ps[j * s_stride + c];
      }
      save_floats(sv == nullptr ? nullptr : sv + start, e + start, len);
      f.onebit_mean_add(e + start, rows.data(), row_scales.data(), w, len, wf);
      feedback_encode_chunk(f, e + start, len, chunk_size, norm_scale, out + start / 8, sc + c);
    }
  });
}

// ---------------------------------------------------------------- low rank

// Rows apart in a transposed factor: k plus 16 floats, so that its rows and the matrix rows (k floats
// apart, often a multiple of 4 KiB) do not fall on the same 4 KiB offsets (store-to-load aliasing stalls).
int64_t padded_stride(int64_t k) { return k + 16; }

// Q (k x r) transposed into (rp x ldq), rp >= r rows (the padding rows zero), times alpha.
std::vector<float> transposed(const at::Tensor& q, int64_t rp, int64_t ldq, float alpha) {
  const int64_t k = q.size(0), r = q.size(1);
  std::vector<float> qt(static_cast<size_t>(rp * ldq), 0.0f);
  const float* qp = q.data_ptr<float>();
  for (int64_t j = 0; j < k; ++j)
    for (int64_t c = 0; c < r; ++c) qt[c * ldq + j] = alpha == 1.0f ? qp[j * r + c] : qp[j * r + c] * alpha;
  return qt;
}

void lowrank_project_cpu(const at::Tensor& residual, const c10::optional<at::Tensor>& grad, const at::Tensor& q,
                         const at::Tensor& p, bool subtract, const c10::optional<at::Tensor>& pending_p,
                         const c10::optional<at::Tensor>& pending_q, const c10::optional<at::Tensor>& saved) {
  checks::lowrank_project(residual, grad, q, p, pending_p, pending_q, kCPU);
  checks::saved_copy(saved, residual, kCPU, "lowrank_project");
  float* sv = saved_ptr(saved);
  const int64_t n = residual.size(0), k = residual.size(1), r = q.size(1);
  if (n == 0) return;  // p, the residual, grad and saved are empty (and no factor is copied for nothing)
  const int64_t rp = (r + 3) / 4 * 4;
  const int64_t ldq = padded_stride(k);
  const std::vector<float> qt = transposed(q, rp, ldq, 1.0f);
  float* e = residual.data_ptr<float>();
  const float* g = grad.has_value() && grad->defined() ? grad->data_ptr<float>() : nullptr;
  float* pp = p.data_ptr<float>();
  // The pending update, as lowrank_outer_into(residual, pending_p, pending_q, -1, true) computes it,
  // on each block of rows inside its projection (AVX-512) or just before it, while the rows are in cache.
  const bool pending = pending_p.has_value() && pending_p->defined();
  const int64_t rpend = pending ? pending_p->size(1) : 0;
  const std::vector<float> qt_pend = pending ? transposed(*pending_q, rpend, ldq, -1.0f) : std::vector<float>();
  const float* p_pend = pending ? pending_p->data_ptr<float>() : nullptr;
  const Impl& f = impl();
  at::parallel_for(0, n, std::max<int64_t>(1, kGrainElems / std::max<int64_t>(k, 1)), [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; i += kLowRankRows) {
      const int64_t nb = std::min<int64_t>(kLowRankRows, end - i);
      save_floats(sv == nullptr ? nullptr : sv + i * k, e + i * k, nb * k);
      f.lr_project(e + i * k, g == nullptr ? nullptr : g + i * k, k, nb, k, qt.data(), ldq, r, rp, pp + i * r,
                   subtract, pending ? p_pend + i * rpend : nullptr, qt_pend.data(), rpend);
    }
  });
}

void lowrank_gram_cpu(const at::Tensor& residual, const c10::optional<at::Tensor>& grad, const at::Tensor& p,
                      const at::Tensor& q, const c10::optional<at::Tensor>& saved) {
  checks::lowrank_gram(residual, grad, p, q, kCPU);
  checks::saved_copy(saved, residual, kCPU, "lowrank_gram");
  float* sv = saved_ptr(saved);
  const int64_t n = residual.size(0), k = residual.size(1), r = p.size(1);
  if (k == 0) return;  // q, the residual, grad and saved are empty
  // Column tiles: each element of Q^T sums the rows in order whatever the tiling, so any thread count
  // gives the same bits. A tile's accumulators (r x width floats) stay within 16 KiB, half of a
  // common L1, so they stay there while the rows stream past.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t width = std::max<int64_t>(64, (4096 / r) / 16 * 16);
  width = std::min(width, std::max<int64_t>(16, ((k + threads - 1) / threads + 15) / 16 * 16));
  const int64_t tiles = (k + width - 1) / width;
  const int64_t ldq = padded_stride(k);
  std::vector<float> qt(static_cast<size_t>(r * ldq), 0.0f);
  float* e = residual.data_ptr<float>();
  const float* g = grad.has_value() && grad->defined() ? grad->data_ptr<float>() : nullptr;
  const float* pp = p.data_ptr<float>();
  const Impl& f = impl();
  at::parallel_for(0, tiles, 1, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const int64_t j0 = t * width;
      f.lr_gram(e, sv, g, n, k, j0, std::min(width, k - j0), pp, r, qt.data(), ldq);
    }
  });
  float* qp = q.data_ptr<float>();
  for (int64_t j = 0; j < k; ++j)
    for (int64_t c = 0; c < r; ++c) qp[j * r + c] = qt[c * ldq + j];
}

void lowrank_outer_into_cpu(const at::Tensor& out, const at::Tensor& p, const at::Tensor& q, double alpha,
                            bool accumulate, const c10::optional<at::Tensor>& when) {
  checks::lowrank_outer_into(out, p, q, kCPU);
  if (when.has_value() && when->defined()) {
    checks::device_flag(*when, out, "when", "lowrank_outer_into");
    if (!*when->data_ptr<bool>()) return;
  }
  const int64_t n = out.size(0), k = out.size(1), r = p.size(1);
  if (n == 0 || k == 0) return;  // out is empty
  const int64_t ldq = padded_stride(k);
  const std::vector<float> qt = transposed(q, r, ldq, static_cast<float>(alpha));
  float* o = out.data_ptr<float>();
  const float* pp = p.data_ptr<float>();
  const Impl& f = impl();
  at::parallel_for(0, n, std::max<int64_t>(1, kGrainElems / std::max<int64_t>(k, 1)), [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; i += kLowRankRows) {
      const int64_t nb = std::min<int64_t>(kLowRankRows, end - i);
      f.lr_outer(o + i * k, k, nb, pp + i * r, qt.data(), k, ldq, r, accumulate, false);
    }
  });
}

// ---------------------------------------------------------------- masked restore

void copy_if_cpu(const at::Tensor& dst, const c10::optional<at::Tensor>& src, const at::Tensor& flag) {
  checks::copy_if(dst, src, flag, kCPU);
  if (!*flag.data_ptr<bool>()) return;
  if (src.has_value() && src->defined()) {
    dst.copy_(*src);
  } else {
    dst.zero_();
  }
}

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
// call them once the op's Python checks have passed (csrc/ops/ops.cpp says why).
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
