// CUDA low-rank kernels of ACP-SGD and PowerSGD (see lowrank_project /
// lowrank_gram / lowrank_outer_into in sylvie_comm/kernels/reference.py). All
// data is fp32 and row-major: the matrix (n, k), the factors p (n, r), q (k, r).
// Sums run in a fixed order that depends on the shapes only, never on the
// launch or on timing (no atomics), so every run gives the same bits.
//
// project: a warp per matrix row, eight rows per block. The block stages
//   TJ rows of q (CB of its columns at a time, CB the rank rounded up to 1, 2,
//   4, 8, 16 or 32; TJ = 512 down to 128 as CB grows, 16 KiB at most) in
//   shared memory, for its eight rows at once; lane l of a warp takes columns
//   j = l, l + 32, ... of its row, adds grad (stored), and keeps CB partial dot
//   products in registers, which a fixed shuffle tree adds up at the row's end.
//   With subtract, a second pass over the row (from cache, like the CPU kernel)
//   writes e[j] - (p[0] q[j][0] + p[1] q[j][1] + ...), the terms left to right.
//   Ranks above 32 take one pass per 32 columns of q (grad added in the first).
// gram: a thread per matrix column, summing p[i][c] e[i][j] over the rows in
//   order (coalesced row reads). With few columns the rows are split into
//   slabs (at most n / kGramSlabRows of them, a count fixed by n and k) whose
//   partial sums go to a workspace and are added slab by slab by a second
//   kernel. A single slab (always when n < 2 * kGramSlabRows) sums exactly as
//   the CPU kernel does, so both return the same bits.
// outer: a thread per column and a run of rows, q[j][:] * alpha in registers
//   (for rank <= 32), d = p[i][0] qa[0] + p[i][1] qa[1] + ... left to right and
//   out = d or out + d: one write pass over out, the CPU kernel's arithmetic in
//   the CPU kernel's order, so both return the same bits.
#include <type_traits>

#include "cuda/device.cuh"

namespace sylvie_comm {
namespace cuda {
namespace {

using namespace detail;

// Rows of q staged in shared memory at a time by the project kernel, for CB of its columns: 4096 floats
// (16 KiB) or less, at most 16 columns per lane (loads in flight) and a multiple of 32.
template <int CB>
struct ProjTile {
  static constexpr int value = CB >= 32 ? 128 : CB >= 16 ? 256 : 512;
};
// Most q columns one pass keeps in registers.
constexpr int kMaxRankBlock = 32;
// Rows per gram slab at least (n / kGramSlabRows slabs at most), and the threads the slabs aim at.
constexpr int64_t kGramSlabRows = 64;
constexpr int64_t kGramTargetThreads = int64_t{1} << 17;
// Rows whose loads a gram thread issues together.
constexpr int kGramBatch = 8;
// Rows one outer-kernel thread handles per step, and the blocks the launch aims at.
constexpr int kOuterRows = 8;
constexpr int64_t kOuterTargetBlocks = 1024;
// Largest grid y dimension.
constexpr int64_t kMaxGridY = 65535;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o /= 2) v = __fadd_rn(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// ------------------------------------------------------------ project

// Stages q[j0 + jj][c0 + c] as qs[c * TJ + jj] for the rows jj < k - j0 (zero for c >= cb; the rows past the
// matrix are left as they are and never read). Every thread of the block calls it.
template <int CB>
__device__ __forceinline__ void stage_q(float* qs, const float* __restrict__ q, int64_t k, int64_t r, int64_t j0,
                                        int64_t c0, int cb) {
  constexpr int TJ = ProjTile<CB>::value;
  const int rows = static_cast<int>(min(static_cast<int64_t>(TJ), k - j0));
  __syncthreads();  // the previous tile is consumed
  for (int idx = threadIdx.x; idx < rows * CB; idx += blockDim.x) {
    const int jj = idx / CB, c = idx - (idx / CB) * CB;
    qs[c * TJ + jj] = c < cb ? q[(j0 + jj) * r + c0 + c] : 0.0f;
  }
  __syncthreads();
}

template <int CB>
__global__ void __launch_bounds__(kThreads) lowrank_project_kernel(float* __restrict__ e, const float* __restrict__ g,
                                                                   const float* __restrict__ q, float* __restrict__ p,
                                                                   int64_t n, int64_t k, int64_t r, bool subtract) {
  constexpr int TJ = ProjTile<CB>::value;
  constexpr int PL = TJ / kWarpSize;  // columns per lane and tile
  __shared__ float qs[TJ * CB];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  // Loop bounds depend on the block only: every thread reaches every __syncthreads.
  for (int64_t row0 = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock; row0 < n;
       row0 += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const int64_t i = row0 + warp;
    const bool active = i < n;
    float* erow = e + (active ? i : 0) * k;
    const float* grow = g == nullptr ? nullptr : g + (active ? i : 0) * k;

    for (int64_t c0 = 0; c0 < r; c0 += CB) {
      const int cb = static_cast<int>(min(static_cast<int64_t>(CB), r - c0));
      const bool add = grow != nullptr && c0 == 0;
      float acc[CB];
#pragma unroll
      for (int c = 0; c < CB; ++c) acc[c] = 0.0f;
      for (int64_t j0 = 0; j0 < k; j0 += TJ) {
        stage_q<CB>(qs, q, k, r, j0, c0, cb);
        if (!active) continue;
        // All loads of the tile first (PL in flight per lane), then the adds and stores.
        float v[PL];
#pragma unroll
        for (int t = 0; t < PL; ++t) {
          const int64_t j = j0 + t * kWarpSize + lane;
          v[t] = j < k ? erow[j] : 0.0f;
        }
        if (add) {
          float gv[PL];
#pragma unroll
          for (int t = 0; t < PL; ++t) {
            const int64_t j = j0 + t * kWarpSize + lane;
            gv[t] = j < k ? grow[j] : 0.0f;
          }
#pragma unroll
          for (int t = 0; t < PL; ++t) {
            const int64_t j = j0 + t * kWarpSize + lane;
            if (j < k) {
              v[t] = __fadd_rn(v[t], gv[t]);
              erow[j] = v[t];
            }
          }
        }
#pragma unroll
        for (int t = 0; t < PL; ++t) {
          if (j0 + t * kWarpSize + lane >= k) break;  // later t are past the row too
#pragma unroll
          for (int c = 0; c < CB; ++c) acc[c] = __fadd_rn(acc[c], __fmul_rn(v[t], qs[c * TJ + t * kWarpSize + lane]));
        }
      }
      if (active) {
#pragma unroll
        for (int c = 0; c < CB; ++c) acc[c] = warp_sum(acc[c]);
        if (lane == 0) {
#pragma unroll
          for (int c = 0; c < CB; ++c)
            if (c < cb) p[i * r + c0 + c] = acc[c];
        }
      }
    }
    if (!subtract) continue;
    __syncwarp();  // the row's p, written by lane 0, is visible to the warp
    for (int64_t j0 = 0; j0 < k; j0 += TJ) {
      float d[PL];
#pragma unroll
      for (int t = 0; t < PL; ++t) d[t] = 0.0f;
      for (int64_t c0 = 0; c0 < r; c0 += CB) {
        const int cb = static_cast<int>(min(static_cast<int64_t>(CB), r - c0));
        stage_q<CB>(qs, q, k, r, j0, c0, cb);
        if (!active) continue;
        float pv[CB];
#pragma unroll
        for (int c = 0; c < CB; ++c) pv[c] = c < cb ? p[i * r + c0 + c] : 0.0f;
#pragma unroll
        for (int t = 0; t < PL; ++t) {
          if (j0 + t * kWarpSize + lane >= k) break;  // later t are past the row too
#pragma unroll
          for (int c = 0; c < CB; ++c) {
            if (c >= cb) break;
            const float term = __fmul_rn(pv[c], qs[c * TJ + t * kWarpSize + lane]);
            d[t] = (c0 == 0 && c == 0) ? term : __fadd_rn(d[t], term);
          }
        }
      }
      if (!active) continue;
      float v[PL];
#pragma unroll
      for (int t = 0; t < PL; ++t) {
        const int64_t j = j0 + t * kWarpSize + lane;
        v[t] = j < k ? erow[j] : 0.0f;
      }
#pragma unroll
      for (int t = 0; t < PL; ++t) {
        const int64_t j = j0 + t * kWarpSize + lane;
        if (j < k) erow[j] = __fsub_rn(v[t], d[t]);
      }
    }
  }
}

template <int CB>
cudaError_t launch_project(float* residual, const float* grad, int64_t n, int64_t k, const float* q, int64_t r,
                           float* p, bool subtract, cudaStream_t stream) {
  lowrank_project_kernel<CB><<<grid_for(n, kWarpsPerBlock), kThreads, 0, stream>>>(residual, grad, q, p, n, k, r,
                                                                                  subtract);
  return cudaGetLastError();
}

// ------------------------------------------------------------ gram

// Slabs the rows are split into: enough threads for the GPU, at most n / kGramSlabRows slabs.
int64_t gram_slabs(int64_t n, int64_t k) {
  const int64_t col_threads = ceil_div(k, kThreads) * kThreads;
  int64_t slabs = ceil_div(kGramTargetThreads, col_threads);
  const int64_t most = n / kGramSlabRows;
  slabs = slabs < most ? slabs : most;
  slabs = slabs < kMaxGridY ? slabs : kMaxGridY;
  if (slabs <= 1) return 1;
  return ceil_div(n, ceil_div(n, slabs));  // no empty slab
}

// Slab s = blockIdx.y sums rows [s * slab_rows, min(n, (s + 1) * slab_rows)). With one slab the sums go straight to
// q[j * r + c]; otherwise to partial[(s * r + c) * k + j].
template <int CB>
__global__ void __launch_bounds__(kThreads) lowrank_gram_kernel(float* __restrict__ e, const float* __restrict__ g,
                                                                const float* __restrict__ p, int64_t n, int64_t k,
                                                                int64_t r, int64_t slab_rows, float* __restrict__ q,
                                                                float* __restrict__ partial) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= k) return;
  const int64_t s = blockIdx.y;
  const int64_t i_begin = s * slab_rows;
  const int64_t i_end = min(n, i_begin + slab_rows);
  for (int64_t c0 = 0; c0 < r; c0 += CB) {
    const int cb = static_cast<int>(min(static_cast<int64_t>(CB), r - c0));
    const bool add = g != nullptr && c0 == 0;
    float acc[CB];
#pragma unroll
    for (int c = 0; c < CB; ++c) acc[c] = 0.0f;
    // kGramBatch rows at a time: their loads first (in flight together), then the rows in order.
    int64_t i = i_begin;
    for (; i + kGramBatch <= i_end; i += kGramBatch) {
      float v[kGramBatch];
#pragma unroll
      for (int u = 0; u < kGramBatch; ++u) v[u] = e[(i + u) * k + j];
      if (add) {
        float gv[kGramBatch];
#pragma unroll
        for (int u = 0; u < kGramBatch; ++u) gv[u] = g[(i + u) * k + j];
#pragma unroll
        for (int u = 0; u < kGramBatch; ++u) {
          v[u] = __fadd_rn(v[u], gv[u]);
          e[(i + u) * k + j] = v[u];
        }
      }
#pragma unroll
      for (int u = 0; u < kGramBatch; ++u) {
        const float* pi = p + (i + u) * r + c0;
#pragma unroll
        for (int c = 0; c < CB; ++c)
          if (c < cb) acc[c] = __fadd_rn(acc[c], __fmul_rn(pi[c], v[u]));
      }
    }
    for (; i < i_end; ++i) {
      float v = e[i * k + j];
      if (add) {
        v = __fadd_rn(v, g[i * k + j]);
        e[i * k + j] = v;
      }
      const float* pi = p + i * r + c0;
#pragma unroll
      for (int c = 0; c < CB; ++c)
        if (c < cb) acc[c] = __fadd_rn(acc[c], __fmul_rn(pi[c], v));
    }
#pragma unroll
    for (int c = 0; c < CB; ++c) {
      if (c >= cb) break;
      if (partial == nullptr)
        q[j * r + c0 + c] = acc[c];
      else
        partial[(s * r + c0 + c) * k + j] = acc[c];
    }
  }
}

// q[j * r + c] = partial of slab 0 + partial of slab 1 + ..., slabs in order.
__global__ void lowrank_gram_reduce_kernel(const float* __restrict__ partial, int64_t k, int64_t r, int64_t slabs,
                                           float* __restrict__ q) {
  const int64_t total = k * r;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += stride) {
    const RowCol cj = split_index(idx, k);  // idx = c * k + j: coalesced reads
    float sum = partial[idx];
    for (int64_t s = 1; s < slabs; ++s) sum = __fadd_rn(sum, partial[s * total + idx]);
    q[cj.c * r + cj.r] = sum;
  }
}

template <int CB>
cudaError_t launch_gram(float* residual, const float* grad, int64_t n, int64_t k, const float* p, int64_t r, float* q,
                        float* partial, cudaStream_t stream) {
  const int64_t slabs = gram_slabs(n, k);
  const int64_t slab_rows = slabs == 1 ? n : ceil_div(n, slabs);
  const dim3 grid(static_cast<unsigned>(ceil_div(k, kThreads)), static_cast<unsigned>(slabs));
  lowrank_gram_kernel<CB><<<grid, kThreads, 0, stream>>>(residual, grad, p, n, k, r, slab_rows, q,
                                                         slabs == 1 ? nullptr : partial);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || slabs == 1) return err;
  lowrank_gram_reduce_kernel<<<grid_for(k * r, kThreads), kThreads, 0, stream>>>(partial, k, r, slabs, q);
  return cudaGetLastError();
}

// ------------------------------------------------------------ outer

// qa[c] = qrow[c] (times alpha when scaled) for c < cb, 0 for the rest.
template <int CB>
__device__ __forceinline__ void load_scaled_q(float (&qa)[CB], const float* __restrict__ qrow, int cb, bool scaled,
                                              float alpha) {
#pragma unroll
  for (int c = 0; c < CB; ++c) {
    const float v = c < cb ? qrow[c] : 0.0f;
    qa[c] = scaled ? __fmul_rn(v, alpha) : v;
  }
}

// Thread (blockIdx.x * blockDim.x + threadIdx.x) = column j; blockIdx.y takes row runs of kOuterRows, grid-strided.
template <int CB>
__global__ void __launch_bounds__(kThreads) lowrank_outer_kernel(float* __restrict__ out, const float* __restrict__ p,
                                                                 const float* __restrict__ q, int64_t n, int64_t k,
                                                                 int64_t r, float alpha, bool accumulate,
                                                                 const bool* __restrict__ when) {
  if (when != nullptr && !*when) return;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= k) return;
  const bool one_block = r <= CB;
  const bool scaled = alpha != 1.0f;
  float qa[CB];
  if (one_block) load_scaled_q<CB>(qa, q + j * r, static_cast<int>(r), scaled, alpha);
  for (int64_t i0 = static_cast<int64_t>(blockIdx.y) * kOuterRows; i0 < n;
       i0 += static_cast<int64_t>(gridDim.y) * kOuterRows) {
    const int rows = static_cast<int>(min(static_cast<int64_t>(kOuterRows), n - i0));
    float d[kOuterRows];
#pragma unroll
    for (int t = 0; t < kOuterRows; ++t) d[t] = 0.0f;
    for (int64_t c0 = 0; c0 < r; c0 += CB) {
      const int cb = static_cast<int>(min(static_cast<int64_t>(CB), r - c0));
      if (!one_block) load_scaled_q<CB>(qa, q + j * r + c0, cb, scaled, alpha);
#pragma unroll
      for (int t = 0; t < kOuterRows; ++t) {
        if (t >= rows) break;
        const float* pi = p + (i0 + t) * r + c0;
#pragma unroll
        for (int c = 0; c < CB; ++c) {
          if (c >= cb) break;
          const float term = __fmul_rn(pi[c], qa[c]);
          d[t] = (c0 == 0 && c == 0) ? term : __fadd_rn(d[t], term);
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kOuterRows; ++t) {
      if (t >= rows) break;
      float* o = out + (i0 + t) * k + j;
      *o = accumulate ? __fadd_rn(*o, d[t]) : d[t];
    }
  }
}

template <int CB>
cudaError_t launch_outer(float* out, int64_t n, int64_t k, const float* p, const float* q, int64_t r, float alpha,
                         bool accumulate, cudaStream_t stream, const bool* when) {
  const int64_t col_blocks = ceil_div(k, kThreads);
  int64_t row_blocks = ceil_div(n, kOuterRows);
  const int64_t want = ceil_div(kOuterTargetBlocks, col_blocks);
  row_blocks = row_blocks < want ? row_blocks : want;
  row_blocks = row_blocks < kMaxGridY ? row_blocks : kMaxGridY;
  const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(row_blocks));
  lowrank_outer_kernel<CB><<<grid, kThreads, 0, stream>>>(out, p, q, n, k, r, alpha, accumulate, when);
  return cudaGetLastError();
}

// Calls fn(std::integral_constant<int, CB>{}) with CB the rank rounded up to a power of two, at most 32.
template <typename Fn>
cudaError_t dispatch_rank(int64_t r, Fn&& fn) {
  if (r <= 1) return fn(std::integral_constant<int, 1>{});
  if (r <= 2) return fn(std::integral_constant<int, 2>{});
  if (r <= 4) return fn(std::integral_constant<int, 4>{});
  if (r <= 8) return fn(std::integral_constant<int, 8>{});
  if (r <= 16) return fn(std::integral_constant<int, 16>{});
  return fn(std::integral_constant<int, kMaxRankBlock>{});
}

bool valid_sizes(int64_t n, int64_t k, int64_t r) { return n >= 0 && k >= 0 && r > 0; }

}  // namespace

cudaError_t lowrank_project(float* residual, const float* grad, int64_t n, int64_t k, const float* q, int64_t r,
                            float* p, bool subtract, cudaStream_t stream) {
  if (!valid_sizes(n, k, r)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;  // (k == 0 still writes p = 0)
  return dispatch_rank(r, [&](auto cb) {
    return launch_project<decltype(cb)::value>(residual, grad, n, k, q, r, p, subtract, stream);
  });
}

int64_t lowrank_gram_workspace_bytes(int64_t n, int64_t k, int64_t r) {
  if (!valid_sizes(n, k, r) || k == 0) return 0;
  const int64_t slabs = gram_slabs(n, k);
  return slabs == 1 ? 0 : slabs * k * r * static_cast<int64_t>(sizeof(float));
}

cudaError_t lowrank_gram(float* residual, const float* grad, int64_t n, int64_t k, const float* p, int64_t r,
                         float* q, void* workspace, cudaStream_t stream) {
  if (!valid_sizes(n, k, r)) return cudaErrorInvalidValue;
  if (k == 0) return cudaSuccess;  // (n == 0 still writes q = 0)
  if (lowrank_gram_workspace_bytes(n, k, r) > 0 && workspace == nullptr) return cudaErrorInvalidValue;
  float* partial = static_cast<float*>(workspace);
  return dispatch_rank(
      r, [&](auto cb) { return launch_gram<decltype(cb)::value>(residual, grad, n, k, p, r, q, partial, stream); });
}

cudaError_t lowrank_outer_into(float* out, int64_t n, int64_t k, const float* p, const float* q, int64_t r,
                               float alpha, bool accumulate, cudaStream_t stream, const bool* when) {
  if (!valid_sizes(n, k, r)) return cudaErrorInvalidValue;
  if (n == 0 || k == 0) return cudaSuccess;
  return dispatch_rank(r, [&](auto cb) {
    return launch_outer<decltype(cb)::value>(out, n, k, p, q, r, alpha, accumulate, stream, when);
  });
}

}  // namespace cuda
}  // namespace sylvie_comm
