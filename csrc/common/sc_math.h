// Element math of the CPU kernels: the counter-based noise, the bf16 directed
// rounding and the quantizer. Plain C++ with no torch dependency. The pure-torch reference
// (sylvie_comm/kernels/reference.py) defines the same functions; the kernels
// must agree with it bit for bit.
#pragma once

#include <stdint.h>
#include <string.h>

#define SC_HD static inline

namespace sylvie_comm {

// Multipliers of the "lowbias32" hash (hash-prospector) and the seed keys.
constexpr uint32_t kHashM1 = 0x21F0AAADu;
constexpr uint32_t kHashM2 = 0x735A2D97u;
constexpr uint32_t kSeedK0 = 0x9E3779B9u;
constexpr uint32_t kSeedK1 = 0x85EBCA6Bu;
// 2**-16: turns 16 bits of a hash into a float in [0, 1) exactly.
constexpr float kU16 = 1.52587890625e-05f;

SC_HD uint32_t sc_mix32(uint32_t x) {
  x ^= x >> 16;
  x *= kHashM1;
  x ^= x >> 15;
  x *= kHashM2;
  x ^= x >> 15;
  return x;
}

struct ScSeedKeys {
  uint32_t k0;
  uint32_t k1;
};

SC_HD ScSeedKeys sc_seed_keys(uint64_t seed) {
  ScSeedKeys k;
  k.k0 = sc_mix32(static_cast<uint32_t>(seed) ^ kSeedK0);
  k.k1 = sc_mix32(static_cast<uint32_t>(seed >> 32) ^ kSeedK1);
  return k;
}

// Noise: counter c takes one 16-bit half (c & 1) of a hash of its pair index
// p = c >> 1, so one hash serves two values. The pair index's high word is
// folded into the key once (sc_pair_key); its low word goes through one round.
SC_HD uint32_t sc_pair_key(ScSeedKeys k, uint32_t pair_hi) { return sc_mix32(pair_hi ^ k.k1) ^ k.k0; }

SC_HD uint32_t sc_pair_hash(uint32_t key, uint32_t pair_lo) { return sc_mix32(pair_lo ^ key); }

// Uniform noise in [0, 1), a multiple of 2**-16, for a 64-bit counter.
SC_HD float sc_uniform(ScSeedKeys k, uint64_t counter) {
  const uint64_t p = counter >> 1;
  const uint32_t h = sc_pair_hash(sc_pair_key(k, static_cast<uint32_t>(p >> 32)), static_cast<uint32_t>(p));
  return static_cast<float>((h >> (16 * static_cast<uint32_t>(counter & 1u))) & 0xFFFFu) * kU16;
}

SC_HD uint32_t sc_float_bits(float x) {
  uint32_t w;
  memcpy(&w, &x, sizeof(w));
  return w;
}

SC_HD float sc_bits_float(uint32_t w) {
  float x;
  memcpy(&x, &w, sizeof(x));
  return x;
}

// Round an fp32 value to a bf16-representable value toward +inf (up) or -inf.
SC_HD float sc_round_bf16(float x, bool up) {
  uint32_t w = sc_float_bits(x);
  uint32_t t = w & 0xFFFF0000u;
  bool away = (t != w) && (up ? (x > 0.0f) : (x < 0.0f));
  return sc_bits_float(away ? t + 0x10000u : t);
}

SC_HD bool sc_isfinite(float x) {
  // Exponent bits all ones means Inf or NaN.
  return (sc_float_bits(x) & 0x7F800000u) != 0x7F800000u;
}

// Per-row quantizer metadata from the row's min and max (see qbit_meta in the reference).
struct ScQMeta {
  float scale;  // NaN for a non-finite row
  float minimum;
  float inv;    // 0 when scale is 0 or 1/scale overflows
  bool finite;
};

SC_HD ScQMeta sc_qbit_meta(float mn, float mx, int levels, bool bf16_meta) {
  ScQMeta m;
  if (bf16_meta) mn = sc_round_bf16(mn, false);
  const double span = static_cast<double>(mx) - static_cast<double>(mn);
  float scale = static_cast<float>(span / levels);
  if (bf16_meta) scale = sc_round_bf16(scale, true);
  // A range beyond fp32 would overflow in decode (q * scale) even where scale fits.
  m.finite = sc_isfinite(mn) && sc_isfinite(mx) && sc_isfinite(static_cast<float>(span)) && sc_isfinite(scale);
  if (!m.finite) {
    m.scale = sc_bits_float(0x7FC00000u);
    m.minimum = m.scale;
    m.inv = 0.0f;
    return m;
  }
  float inv = 1.0f / scale;
  m.scale = scale;
  m.minimum = mn;
  m.inv = (scale > 0.0f && sc_isfinite(inv)) ? inv : 0.0f;
  return m;
}

// floor((x - mn) * inv + u), clamped to [0, levels]; NaN -> 0. One rounding per op.
SC_HD uint32_t sc_quantize(float x, float mn, float inv, float u, float levels) {
  float t = (x - mn) * inv + u;
  t = floorf(t);
  t = t >= 0.0f ? t : 0.0f;  // also maps NaN to 0
  t = t <= levels ? t : levels;
  return static_cast<uint32_t>(t);
}

SC_HD float sc_dequantize(uint32_t q, float scale, float mn) {
  return static_cast<float>(q) * scale + mn;
}

// Bytes that `cols` >= 0 values of `bits` <= 8 bits take in a row: ceil(cols * bits / 8), without the
// overflow of (cols * bits + 7) / 8 for any int64 cols (an argument the Python checks accept is never
// judged otherwise here).
SC_HD int64_t sc_packed_cols(int64_t cols, int bits) { return cols / 8 * bits + ((cols % 8) * bits + 7) / 8; }

// ceil(n / d) for n >= 0 and d > 0, without the overflow of (n + d - 1) / d (a chunk_size near 2**63).
SC_HD int64_t sc_ceil_div(int64_t n, int64_t d) { return n == 0 ? 0 : 1 + (n - 1) / d; }


// ---------------------------------------------------------------- the one-bit chunk's sum
// The order of a one-bit chunk's fp32 sum (sylvie_comm/kernels/reference.py: onebit_sum_order, chunk_sums): element
// k of a piece adds into lane k % lanes (each lane in element order, from +0.0), the lanes are combined by the
// adjacent-pair tree (lane 2i + lane 2i+1, then the same on the halves), the pieces' sums are added in order.
constexpr int64_t kOnebitLanes = 2048;
constexpr int64_t kOnebitPiece = 16384;
constexpr int64_t kOnebitMaxPieces = 65535;

struct ScChunkSum {
  using AddFn = void (*)(float*, const float*, int64_t, bool);
  using TreeFn = float (*)(float*, float*, int64_t);
  AddFn add_lanes;  // acc[j] += term(x[j]) for j < n (the CPU's ISA)
  TreeFn tree;      // the adjacent-pair tree of `lanes` partials
  int64_t lanes, piece, at = 0;  // `at`: elements added to the current piece
  bool squares, started = false;
  float total = 0.0f;
  float acc[kOnebitLanes];
  float tmp[kOnebitLanes / 2];

  ScChunkSum(int64_t chunk_size, bool squares_, AddFn add_fn, TreeFn tree_fn)
      : add_lanes(add_fn), tree(tree_fn), squares(squares_) {
    lanes = 1;
    while (lanes < chunk_size && lanes < kOnebitLanes) lanes <<= 1;
    int64_t p = chunk_size < kOnebitPiece ? chunk_size : kOnebitPiece;
    const int64_t least = sc_ceil_div(chunk_size, kOnebitMaxPieces);
    if (least > p) p = least;
    piece = (p + lanes - 1) / lanes * lanes;
    memset(acc, 0, sizeof(float) * lanes);
  }

  // The next m values of the chunk (in element order).
  void add(const float* x, int64_t m) {
    for (int64_t i = 0; i < m;) {
      if (at == piece) finish_piece();
      const int64_t lane0 = at & (lanes - 1);
      int64_t run = m - i;
      if (run > lanes - lane0) run = lanes - lane0;
      if (run > piece - at) run = piece - at;
      add_lanes(acc + lane0, x + i, run, squares);
      i += run;
      at += run;
    }
  }

  void finish_piece() {
    const float part = tree(acc, tmp, lanes);
    total = started ? total + part : part;
    started = true;
    at = 0;
    memset(acc, 0, sizeof(float) * lanes);
  }

  // The chunk's sum (call once, after every value was added).
  float sum() {
    if (at > 0 || !started) finish_piece();
    return total;
  }
};

// The chunk's scale from its sum: sum / len (and its square root for the norm scale) in fp32; NaN unless finite.
SC_HD float sc_onebit_scale(float sum, int64_t len, bool norm) {
  float s = sum / static_cast<float>(len);
  if (norm) s = __builtin_sqrtf(s);
  uint32_t u;
  memcpy(&u, &s, sizeof(u));
  if ((u & 0x7F800000u) == 0x7F800000u) u = 0x7FC00000u;
  memcpy(&s, &u, sizeof(u));
  return s;
}

}  // namespace sylvie_comm
