// Decode attention over a bit-packed KV store on CPU: one pass over the codes per (batch row, KV head).
//
// The PyTorch path (caches/store_attention.py) reads a block in a dozen passes (planes to float32, scale, matmul,
// folds, exp, matmul), each costing about as much as DynamicCache's whole matmul (docs/benchmark-notes.md, section 5).
// Here a tile of TILE tokens is dequantised into a small buffer that stays in L1, met by the KV head's query rows,
// folded into a running max and sum (flash-decoding, Dao et al. 2023) and mixed into the values the same way,
// so every code byte is read once. `decode_attention` then meets the layer's exact sinks and full-precision tail as
// one more segment of the same softmax and divides by its sum, so a decode step is one call, not the few dozen
// small tensor ops that merging the segments in PyTorch cost; `decode_attention_partials` returns the store's
// softmax partials (max, sum, unnormalised output) as the Triton kernel does.
//
// Layout (ops/bitpack.py): byte j of a token holds dims j*u + i in bits [i*bits, (i+1)*bits), u = 8 / bits. Each
// token is unpacked "plane-major" (plane i, column j at i*W + j), which is a shift and a mask over contiguous bytes
// (vectorised) instead of an interleave; the query is permuted into that order once, and the output back once.
// Scales and zero points: one per (token group, channel group); keys per channel (KIVI) have token groups of
// group_size and channel groups of 1, everything else token groups of 1 and channel groups of group_size.
//
// On a CPU with AVX-512 (or else AVX2) the layouts they read take cpu_decode_avx512.h's (cpu_decode_avx2.h's)
// paths (keys per channel or per token, values per token): 16 (8) logits per vector, values mixed in registers;
// this file's loops are the portable path and the reference those paths are tested against.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

namespace {

constexpr int64_t TILE = 64;  // tokens per online-softmax step: keys [TILE, D] float32 stay in L1
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// How codes become levels (multiples of the scale): the code itself; L0 + a*c + b*(c >> 1) (a 4-level codebook
// symmetric about 0, codecs/plane_attention.py); or the value of an E4M3 float8 byte.
enum Levels { PLAIN = 0, AFFINE = 1, FLOAT8 = 2 };

// An E4M3 byte's value (bias 7, no infinities), by moving its bits into a float32's: a table lookup per byte does
// not vectorise. The NaN bytes (0x7f, 0xff) read as +-480, as codecs/fp8.e4m3_as_float reads them. The portable
// loop's, and the reference of the instruction-set paths, which convert through float16 (avx512::e4m3_levels).
inline float e4m3_value(uint8_t byte) {
  const int32_t magnitude = byte & 0x7f;
  const int32_t normal_bits = (magnitude << 20) + (120 << 23);  // exponent bias 7 -> 127
  const float subnormal = static_cast<float>(magnitude & 7) * (1.0f / 512.0f);  // exponent 0: m * 2^-9
  int32_t subnormal_bits;
  std::memcpy(&subnormal_bits, &subnormal, sizeof(subnormal_bits));
  const int32_t is_normal = -static_cast<int32_t>(magnitude >= 8);  // all ones or zero: a select in integers
  const int32_t bits = (normal_bits & is_normal) | (subnormal_bits & ~is_normal) | (static_cast<int32_t>(byte & 0x80) << 24);
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// exp(x) for x <= 0 or -inf, written so the compiler vectorises a loop of it (std::exp is a scalar call):
// x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor series to r^7 (relative error < 1e-8 before rounding),
// 2^n built in the exponent bits. Below -87 (and for -inf) it returns 0, as a masked entry must weigh nothing.
inline float exp_nonpositive(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23)
  const float r = (xc - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return x < -87.0f ? 0.0f : p * two_n;
}

// Element i of a float32, bfloat16 or float16 buffer as float32.
inline float load_float(const void* base, at::ScalarType type, int64_t i) {
  switch (type) {
    case at::kBFloat16: return static_cast<float>(static_cast<const c10::BFloat16*>(base)[i]);
    case at::kHalf: return static_cast<float>(static_cast<const c10::Half*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

// One kind (keys or values) of the store: codes [B, H, T, W] uint8, scale and zero [B, H, T / token_group,
// dim / channel_group] (zero may be absent: float8), and how to read them. Each row (b, h) of them may sit in a
// longer one: the store's first T token slots of a room that holds more (caches/encoded_room.py), so row `row`'s
// codes start at row * row_tokens * W and its scales at row * row_scale_rows * (dim / channel_group).
struct Store {
  const uint8_t* codes;
  const void* scale;
  const void* zero;
  at::ScalarType scale_type;
  int64_t tokens, width, dim, bits, token_group, channel_group, levels, row_tokens, row_scale_rows;
  float l0, a, b;
  // Ragged rows (a per-head store: caches/head_store.py): spans [rows, 2] holds each row's first token in a flat store
  // [1, 1, N, W] and its number of tokens; a row fills the last of `tokens` logical slots (right-aligned, as the
  // padded view lays it out), so it reads its bias columns [tokens - n, tokens) and no slot holds nothing. Null:
  // row r holds slots [0, tokens) at r * row_tokens (its scales at r * row_scale_rows). Token groups of 1 only (a
  // group of tokens cannot be ragged).
  const int64_t* spans;

  // The first logical slot row `row` holds, and the token (of the store's) at its logical slot 0.
  int64_t first(int64_t row) const { return spans ? tokens - spans[2 * row + 1] : 0; }
  int64_t base(int64_t row) const { return spans ? spans[2 * row] - first(row) : row * row_tokens; }
  // The row's first scale row (its token group 0); a token t's is scale_base(row) + t / token_group.
  int64_t scale_base(int64_t row) const { return spans ? base(row) : row * row_scale_rows; }

  int64_t unit() const { return 8 / bits; }
  int64_t scale_groups() const { return dim / channel_group; }
  // Plane-major position of dim d.
  int64_t plane_pos(int64_t d) const { return (d % unit()) * width + d / unit(); }
  // Once per group: a switch on the type costs nothing there.
  float load_scale(int64_t i) const { return load_float(scale, scale_type, i); }
  float load_zero(int64_t i) const { return zero ? load_float(zero, scale_type, i) : 0.0f; }
};

// The instruction-set paths this build reads with (`simd`), or none: the portable loops only.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HF_KVCOMPRESS_SIMD 1
#include "cpu_decode_avx512.h"
namespace simd = avx512;
#elif defined(__AVX2__) && defined(__FMA__)
#define HF_KVCOMPRESS_SIMD 1
#include "cpu_decode_avx2.h"
namespace simd = avx2;
#else
#define HF_KVCOMPRESS_SIMD 0
#endif

// Head dims known when compiling (D > 0) let the compiler unroll every per-token loop; D = 0 reads it at run time.
template <int D>
inline int64_t dims(int64_t runtime) {
  return D > 0 ? D : runtime;
}

// a . b over D values: 16 running lanes and a tree at the end (an `omp simd` reduction summed the lanes one at a
// time, a chain of 16 dependent adds per logit).
template <int D>
inline float dot(const float* a, const float* b, int64_t runtime) {
  const int64_t n = dims<D>(runtime);
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int k = 0; k < 16; ++k) lanes[k] += a[i + k] * b[i + k];
  float eight[8], four[4];  // fixed-size halvings, vectorised; a loop over the widths was not unrolled
  for (int k = 0; k < 8; ++k) eight[k] = lanes[k] + lanes[k + 8];
  for (int k = 0; k < 4; ++k) four[k] = eight[k] + eight[k + 4];
  float sum = (four[0] + four[2]) + (four[1] + four[3]);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// out [n] = x [n] @ matrix [n, n] (row-major), each sum over j in order (a row's result does not depend on other
// rows). With n known when compiling, the sums stay in registers instead of going through `out` at every j.
template <int D>
inline void times_matrix(const float* x, const float* matrix, float* out, int64_t runtime) {
  const int64_t n = dims<D>(runtime);
  if (D > 0) {
    float local[D > 0 ? D : 1] = {};
    for (int64_t j = 0; j < D; ++j) {
      const float xj = x[j];
      const float* row = matrix + j * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) local[d] += xj * row[d];
    }
    std::copy(local, local + n, out);
    return;
  }
  std::fill(out, out + n, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const float xj = x[j];
    const float* row = matrix + j * n;
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) out[d] += xj * row[d];
  }
}

// The largest of x[0..n): 16 running lanes and a tree (an `omp simd` max reduction compiled to a scalar chain of
// dependent maxima, a third of the kernel's own time outside the key and value paths).
inline float row_max(const float* x, int64_t n) {
  float lanes[16];
  for (int k = 0; k < 16; ++k) lanes[k] = NEG_INF;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int k = 0; k < 16; ++k) lanes[k] = lanes[k] > x[i + k] ? lanes[k] : x[i + k];
  for (int k = 0; k < 8; ++k) lanes[k] = lanes[k] > lanes[k + 8] ? lanes[k] : lanes[k + 8];
  for (int k = 0; k < 4; ++k) lanes[k] = lanes[k] > lanes[k + 4] ? lanes[k] : lanes[k + 4];
  float best = std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
  for (; i < n; ++i) best = std::max(best, x[i]);
  return best;
}

// Codes of one token as levels, plane-major: out[i * W + j] = level(code i of byte j).
template <int BITS, int LEVELS, int D>
inline void unpack_levels(const Store& s, const uint8_t* bytes, float* out) {
  constexpr int U = 8 / BITS;
  constexpr int MASK = (1 << BITS) - 1;
  const int64_t w = dims<D>(s.dim) * BITS / 8;
  for (int i = 0; i < U; ++i) {
    float* o = out + i * w;
    const int shift = i * BITS;
    if (LEVELS == FLOAT8) {
#pragma omp simd
      for (int64_t j = 0; j < w; ++j) o[j] = e4m3_value(bytes[j]);
    } else if (LEVELS == AFFINE) {
      const float l0 = s.l0, a = s.a, b = s.b;
#pragma omp simd
      for (int64_t j = 0; j < w; ++j) {
        const int c = (bytes[j] >> shift) & MASK;
        o[j] = l0 + a * static_cast<float>(c) + b * static_cast<float>(c >> 1);
      }
    } else {
#pragma omp simd
      for (int64_t j = 0; j < w; ++j) o[j] = static_cast<float>((bytes[j] >> shift) & MASK);
    }
  }
}

// The scale and zero point of per-channel group `group` of row `row`, plane-major, into scale_buf / zero_buf [D].
inline void load_channel_group(const Store& s, int64_t row, int64_t group, float* scale_buf, float* zero_buf) {
  const int64_t d = s.dim, unit = s.unit(), width = s.width;
  const int64_t scale_row = (s.scale_base(row) + group) * d;
  for (int64_t c = 0; c < d; ++c) {
    scale_buf[(c % unit) * width + c / unit] = s.load_scale(scale_row + c);
    zero_buf[(c % unit) * width + c / unit] = s.load_zero(scale_row + c);
  }
}

// Tokens [t0, t1) of row `row` dequantised into out [t1 - t0, D] (plane-major rows); with `levels_only`,
// per-channel groups are left unscaled (attention folds their scales into the query instead). Per-channel groups:
// the group's scale and zero point are laid out plane-major in `scale_buf` / `zero_buf` [D] once per group. Groups
// along head_dim: in plane i, group g holds columns [g * run, (g + 1) * run), run = channel_group / u; CG > 0 fixes
// channel_group when compiling (the common 32), so those runs are whole unrolled vectors.
template <int BITS, int LEVELS, int D, int CG>
void dequantise_tile(const Store& s, int64_t row, int64_t t0, int64_t t1, float* out, float* scale_buf,
                     float* zero_buf, bool levels_only) {
  constexpr int U = 8 / BITS;
  const int64_t d = dims<D>(s.dim), width = d / U, groups = s.scale_groups();
  const int64_t scale_base = s.scale_base(row) * groups;
  int64_t loaded = -1;
  for (int64_t t = t0; t < t1; ++t) {
    float* o = out + (t - t0) * d;
    unpack_levels<BITS, LEVELS, D>(s, s.codes + (s.base(row) + t) * width, o);
    const int64_t scale_row = scale_base + (t / s.token_group) * groups;
    if (s.channel_group == 1) {  // one scale per channel, shared by a group of tokens
      if (levels_only) continue;
      if (t / s.token_group != loaded) {
        loaded = t / s.token_group;
        load_channel_group(s, row, loaded, scale_buf, zero_buf);
      }
#pragma omp simd
      for (int64_t p = 0; p < dims<D>(s.dim); ++p) o[p] = o[p] * scale_buf[p] + zero_buf[p];
      continue;
    }
    const int64_t run = (CG > 0 ? CG : s.channel_group) / U;
    for (int64_t g = 0; g < (CG > 0 && D > 0 ? D / CG : groups); ++g) {
      const float scale = s.load_scale(scale_row + g), zero = s.load_zero(scale_row + g);
      for (int i = 0; i < U; ++i) {
        float* part = o + i * width + g * run;
#pragma omp simd
        for (int64_t j = 0; j < run; ++j) part[j] = part[j] * scale + zero;
      }
    }
  }
}

using TileFn = void (*)(const Store&, int64_t, int64_t, int64_t, float*, float*, float*, bool);

template <int D, int CG>
TileFn pick_tile(int64_t bits, int64_t levels) {
  if (bits == 2 && levels == PLAIN) return dequantise_tile<2, PLAIN, D, CG>;
  if (bits == 2 && levels == AFFINE) return dequantise_tile<2, AFFINE, D, CG>;
  if (bits == 4 && levels == PLAIN) return dequantise_tile<4, PLAIN, D, CG>;
  if (bits == 8 && levels == PLAIN) return dequantise_tile<8, PLAIN, D, CG>;
  if (bits == 8 && levels == FLOAT8) return dequantise_tile<8, FLOAT8, D, CG>;
  TORCH_CHECK(false, "cpu_decode: no kernel for bits=", bits, " with levels mode ", levels);
}

template <int D>
TileFn pick_tile(const Store& s) {
  return s.channel_group == 32 && D % 32 == 0 ? pick_tile<D, 32>(s.bits, s.levels) : pick_tile<D, 0>(s.bits, s.levels);
}

// The distance between rows (b, h) of `t` [B, H, n, w] in its own rows of w elements: each row's n x w elements are
// contiguous and the rows evenly spaced (a contiguous tensor, or a view of the first n slots of a longer one along
// dim 2). Any other layout fails, naming `name`.
int64_t row_stride(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4, "cpu_decode: ", name, " must be [B, H, T, W]");
  const int64_t batch = t.size(0), heads = t.size(1), n = t.size(2), w = t.size(3);
  const bool rows_packed = (w <= 1 || t.stride(3) == 1) && (n <= 1 || t.stride(2) == w);
  const int64_t stride = heads > 1 ? t.stride(1) : batch > 1 ? t.stride(0) : n * w;
  TORCH_CHECK(rows_packed && stride >= n * w && w > 0 && stride % w == 0 &&
                  (batch <= 1 || heads <= 1 || t.stride(0) == heads * stride),
              "cpu_decode: ", name, " must be [B, H, T, W] rows of contiguous T x W, evenly spaced");
  return stride / w;
}

Store make_store(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& zero,
                 int64_t dim, int64_t levels, double l0, double a, double b) {
  TORCH_CHECK(codes.scalar_type() == at::kByte, "cpu_decode: codes must be uint8 [B, H, T, W]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kBFloat16 ||
                  scale.scalar_type() == at::kHalf, "cpu_decode: scales must be float32, bfloat16 or float16");
  Store s{};
  s.spans = nullptr;
  s.row_tokens = row_stride(codes, "codes");
  s.row_scale_rows = row_stride(scale, "scale");
  s.codes = codes.data_ptr<uint8_t>();
  s.scale = scale.data_ptr();
  s.scale_type = scale.scalar_type();
  s.zero = nullptr;
  if (zero.has_value()) {
    TORCH_CHECK(zero->sizes() == scale.sizes() && zero->scalar_type() == scale.scalar_type() &&
                    row_stride(*zero, "zero") == s.row_scale_rows, "cpu_decode: zero must match scale");
    s.zero = zero->data_ptr();
  }
  s.tokens = codes.size(2);
  s.width = codes.size(3);
  s.dim = dim;
  s.bits = 8 * s.width / dim;
  TORCH_CHECK(s.bits * dim == 8 * s.width && (s.bits == 2 || s.bits == 4 || s.bits == 8),
              "cpu_decode: codes of width ", s.width, " do not pack ", dim, " values at 2, 4 or 8 bits");
  TORCH_CHECK(scale.size(2) > 0 && s.tokens % scale.size(2) == 0 && dim % scale.size(3) == 0,
              "cpu_decode: scale's shape does not divide the store");
  s.token_group = s.tokens / scale.size(2);
  s.channel_group = dim / scale.size(3);
  TORCH_CHECK(s.token_group == 1 || s.channel_group == 1,
              "cpu_decode: groups run along tokens or along head_dim, not both");
  TORCH_CHECK(s.channel_group == 1 || s.channel_group % s.unit() == 0,
              "cpu_decode: a channel group must hold whole bytes");
  s.levels = levels;
  s.l0 = static_cast<float>(l0);
  s.a = static_cast<float>(a);
  s.b = static_cast<float>(b);
  return s;
}

// Everything one call needs, shared by the rows.
struct Problem {
  const float* query;  // [B, H, M, O, D]
  int64_t heads, m_rows, offsets, dim, value_dim;
  const float* bias;
  int64_t bias_b, bias_h, bias_q, bias_rows;
  const int64_t* hidden;
  int64_t sinks;
  float *max, *sum, *acc;
  bool vectorised;  // take the instruction-set paths where they read the store (false: the portable path only)
  // The rest of the softmax, at full precision in the model's basis (decode_attention; plain_query null: the
  // store's partials only). The layer's exact sinks [B, H, S, D] sit at the slots `hidden` names (a slot outside
  // the store: no sink, or one still in the tail) and read bias column `slot`; the tail [B, H, tail_tokens, D]
  // follows the store and reads bias columns [tokens, tokens + tail_tokens).
  const float* plain_query;  // [B, H, M, D]
  const void *sink_keys, *sink_values, *tail_keys, *tail_values;
  at::ScalarType plain_type;
  int64_t tail_tokens;
  float* plain_out;  // [B, H, M, Dv]; with it, acc and plain_out are written normalised by the whole sum
  // What the kernel applies itself (decode_attention; null: nothing), `query` then holding one row per query row
  // in the model's basis: key_turns [2, O, turn_width] (cos, sin) turn it by each offset's RoPE (rotate-half form,
  // channels past turn_width unturned) into the O offset queries, and key_rotation [D, D] takes each into the keys'
  // basis (x @ key_rotation); value_back [Dv (plane-major position), Dv] brings the store's output back from the
  // values' basis (the values' rotation transposed, its rows in plane-major order).
  const float* key_turns;
  int64_t turn_width;
  const float* key_rotation;
  const float* value_back;
};

// n values of a float32, bfloat16 or float16 buffer from element `start`, as float32 into out.
inline void load_floats(const void* base, at::ScalarType type, int64_t start, int64_t n, float* out) {
  if (type == at::kFloat) {
    std::memcpy(out, static_cast<const float*>(base) + start, n * sizeof(float));
  } else if (type == at::kBFloat16) {  // a bfloat16 is the high half of a float32
    const uint16_t* in = static_cast<const uint16_t*>(base) + start;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(in[i]) << 16;
      std::memcpy(out + i, &bits, sizeof(float));
    }
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = load_float(base, type, start + i);
  }
}

#include "cpu_lowrank.h"  // low rank's fused key logits and store segment (reads load_float / load_floats above)

// Which parts of a call the instruction-set paths take: {keys, values}.
std::vector<bool> vector_parts(const Store& keys, const Store& values, int64_t offsets, bool vectorised) {
#if HF_KVCOMPRESS_SIMD
  const bool keys_fit = (simd::reads_keys(keys) && (offsets == 1 || offsets % simd::LANES == 0)) ||
                        (simd::reads_token_keys(keys) && offsets == 1);
  return {vectorised && keys_fit, vectorised && simd::reads_values(values)};
#else
  (void)keys, (void)values, (void)offsets, (void)vectorised;
  return {false, false};
#endif
}

// Row `row` of B x H after its store: the exact sinks and the full-precision tail as one more segment of the online
// softmax (the store's acc [M, Dv] is rescaled to the new max; the plain output goes to pb.plain_out, unnormalised).
// As caches/store_attention.py's PyTorch path: a sink slot outside the store [0, tokens) weighs nothing.
template <int D>
void attend_plain(const Problem& pb, int64_t row, int64_t tokens, float* acc, float* run_max, float* run_sum,
                  std::vector<float>& buf, std::vector<float>& logits) {
  const int64_t dim = dims<D>(pb.dim), value_dim = dims<D>(pb.value_dim), m_rows = pb.m_rows;
  const int64_t b = row / pb.heads, h = row % pb.heads, sinks = pb.sinks, n = sinks + pb.tail_tokens;
  const float* query = pb.plain_query + row * m_rows * dim;
  float* out = pb.plain_out + row * m_rows * value_dim;
  std::fill(out, out + m_rows * value_dim, 0.0f);
  if (n == 0) return;
  for (int64_t s = 0; s < n; ++s) {  // keys outer: each is converted once and met by every query row
    const bool sink = s < sinks;
    const int64_t slot = sink ? pb.hidden[row * sinks + s] : tokens + s - sinks;  // its bias column
    if (sink && (slot < 0 || slot >= tokens)) {
      for (int64_t m = 0; m < m_rows; ++m) logits[m * n + s] = NEG_INF;
      continue;
    }
    const void* base = sink ? pb.sink_keys : pb.tail_keys;
    const int64_t index = sink ? s : s - sinks, length = sink ? sinks : pb.tail_tokens;
    load_floats(base, pb.plain_type, ((b * pb.heads + h) * length + index) * dim, dim, buf.data());
    for (int64_t m = 0; m < m_rows; ++m) {
      float logit = dot<D>(query + m * dim, buf.data(), dim);
      if (pb.bias) logit += pb.bias[b * pb.bias_b + h * pb.bias_h + (m % pb.bias_rows) * pb.bias_q + slot];
      logits[m * n + s] = logit;
    }
  }
  for (int64_t m = 0; m < m_rows; ++m) {
    float* lg = logits.data() + m * n;
    const float new_max = std::max(run_max[m], row_max(lg, n));
    const float safe = new_max == NEG_INF ? 0.0f : new_max;  // a row masked so far: exp(-inf - 0) = 0
    const float rescale = std::exp(run_max[m] - safe);
    float total = 0.0f;
    for (int64_t s = 0; s < n; ++s) {
      lg[s] = exp_nonpositive(lg[s] - safe);
      total += lg[s];
    }
    if (rescale != 1.0f) {
      float* a = acc + m * value_dim;
#pragma omp simd
      for (int64_t c = 0; c < dims<D>(pb.value_dim); ++c) a[c] *= rescale;
    }
    run_sum[m] = run_sum[m] * rescale + total;
    run_max[m] = new_max;
  }
  for (int64_t s = 0; s < n; ++s) {
    const bool sink = s < sinks;
    const void* base = sink ? pb.sink_values : pb.tail_values;
    const int64_t index = sink ? s : s - sinks, length = sink ? sinks : pb.tail_tokens;
    bool any = false;
    for (int64_t m = 0; m < m_rows; ++m) any = any || logits[m * n + s] != 0.0f;
    if (!any) continue;  // hidden (or underflowed) for every query row
    load_floats(base, pb.plain_type, ((b * pb.heads + h) * length + index) * value_dim, value_dim, buf.data());
    for (int64_t m = 0; m < m_rows; ++m) {
      const float p = logits[m * n + s];
      float* o = out + m * value_dim;
#pragma omp simd
      for (int64_t c = 0; c < dims<D>(pb.value_dim); ++c) o[c] += p * buf[c];
    }
  }
}

// Rows [begin, end) of B x H: the online softmax over the store, a tile at a time.
template <int D>
void attend_rows(const Problem& pb, const Store& keys, const Store& values, TileFn key_tile, TileFn value_tile,
                 int64_t begin, int64_t end) {
  const int64_t dim = dims<D>(pb.dim), value_dim = dims<D>(pb.value_dim), m_rows = pb.m_rows;
  const int64_t offsets = pb.offsets, tokens = keys.tokens, rows_q = m_rows * offsets;
  std::vector<float> plane_q(rows_q * dim), key_buf(TILE * dim), value_buf(TILE * value_dim);
  std::vector<float> logits(m_rows * TILE), acc(m_rows * value_dim), run_max(m_rows), run_sum(m_rows);
  std::vector<float> k_scale_buf(dim), k_zero_buf(dim), v_scale_buf(value_dim), v_zero_buf(value_dim);
  std::vector<float> scaled_q(m_rows * dim);
  // The plain segments: one row of keys or values in float32, and the logits of sinks and tail per query row.
  std::vector<float> plain_buf(pb.plain_query ? std::max(dim, value_dim) : 0);
  std::vector<float> plain_logits(pb.plain_query ? m_rows * (pb.sinks + pb.tail_tokens) : 0);
  const std::vector<bool> vector = vector_parts(keys, values, offsets, pb.vectorised);
  const bool vector_keys = vector[0], vector_values = vector[1];
  // Per-channel keys fold their scales into the query (one product per group of tokens, not per token).
  const bool fold = keys.channel_group == 1 && offsets == 1 && !vector_keys;
  // The instruction-set key path reads the query by channel, each channel's offsets next to each other:
  // channel_q[(m * D + d) * O + o].
  std::vector<float> channel_q(vector_keys ? rows_q * dim : 0);
  // ... and with one query per token, that query times a key group's scales (and its dot with their zero points).
  std::vector<float> folded_q(vector_keys ? m_rows * dim : 0), folded_zero(vector_keys ? m_rows : 0);
  // Keys grouped along head_dim per token (simd::reads_token_keys): each query row's sum over each group's channels,
  // which meets the group's zero point once per token.
  const bool token_keys = vector_keys && keys.channel_group > 1;
  const int64_t key_groups = keys.scale_groups();
  std::vector<float> group_q(token_keys ? m_rows * key_groups : 0);
  const bool own_query = pb.key_turns || pb.key_rotation;  // the offset queries are built here (see Problem)
  std::vector<float> own_q(own_query ? rows_q * dim : 0), turned(own_query ? dim : 0);
  for (int64_t row = begin; row < end; ++row) {
    const int64_t b = row / pb.heads, h = row % pb.heads;
    const float* query = pb.query + row * (own_query ? m_rows : rows_q) * dim;
    if (own_query) {  // each a row's own products, summed in a fixed order: a batch row gives what it gives alone
      const int64_t rot = pb.turn_width, half = rot / 2;
      for (int64_t m = 0; m < m_rows; ++m) {
        const float* q = query + m * dim;
        for (int64_t o = 0; o < offsets; ++o) {
          const float* t = q;
          if (pb.key_turns) {  // RoPE by offset o: q * cos + rotate_half(q) * sin
            const float* cos = pb.key_turns + o * rot;
            const float* sin = pb.key_turns + (offsets + o) * rot;
            for (int64_t d = 0; d < half; ++d) turned[d] = q[d] * cos[d] - q[d + half] * sin[d];
            for (int64_t d = half; d < rot; ++d) turned[d] = q[d] * cos[d] + q[d - half] * sin[d];
            std::copy(q + rot, q + dim, turned.data() + rot);
            t = turned.data();
          }
          float* out = own_q.data() + (m * offsets + o) * dim;
          if (pb.key_rotation)
            times_matrix<D>(t, pb.key_rotation, out, dim);
          else
            std::copy(t, t + dim, out);
        }
      }
      query = own_q.data();
    }
    // The query in the order its key path reads (no division per value: with pre_rope's 32 offsets a division
    // per value here cost a tenth of the kernel).
    if (vector_keys) {
      for (int64_t m = 0; m < m_rows; ++m)
        for (int64_t o = 0; o < offsets; ++o)
          for (int64_t c = 0; c < dim; ++c) channel_q[(m * dim + c) * offsets + o] = query[(m * offsets + o) * dim + c];
      for (int64_t m = 0; m < (token_keys ? m_rows : 0); ++m)
        for (int64_t g = 0; g < key_groups; ++g) {
          const float* q = channel_q.data() + m * dim + g * keys.channel_group;
          group_q[m * key_groups + g] = std::accumulate(q, q + keys.channel_group, 0.0f);
        }
    } else {
      const int64_t unit = keys.unit();
      for (int64_t r = 0; r < rows_q; ++r)  // plane-major: dim c = j * unit + i at i * W + j
        for (int64_t j = 0; j < dim / unit; ++j)
          for (int64_t i = 0; i < unit; ++i) plane_q[r * dim + i * keys.width + j] = query[r * dim + j * unit + i];
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(run_max.begin(), run_max.end(), NEG_INF);
    std::fill(run_sum.begin(), run_sum.end(), 0.0f);
    for (int64_t t0 = keys.first(row); t0 < tokens; t0 += TILE) {  // a ragged row's slots before its first are empty
      const int64_t t1 = std::min(t0 + TILE, tokens), n = t1 - t0;
#if HF_KVCOMPRESS_SIMD
      if (token_keys)
        simd::token_key_logits_any(keys, row, t0, t1, channel_q.data(), m_rows, logits.data(), TILE, group_q.data());
      else if (vector_keys)
        simd::key_logits_any(keys, row, t0, t1, channel_q.data(), offsets, m_rows, logits.data(), TILE,
                             k_scale_buf.data(), k_zero_buf.data(), folded_q.data(), folded_zero.data());
#endif
      if (!vector_keys) key_tile(keys, row, t0, t1, key_buf.data(), k_scale_buf.data(), k_zero_buf.data(), fold);
      if (fold) {  // per group of tokens: q * scale and q . zero, then each token's logit is one dot with its levels
        for (int64_t start = t0; start < t1;) {
          const int64_t group = start / keys.token_group, stop = std::min(t1, (group + 1) * keys.token_group);
          load_channel_group(keys, row, group, k_scale_buf.data(), k_zero_buf.data());
          for (int64_t m = 0; m < m_rows; ++m) {
            const float* q = plane_q.data() + m * dim;
            float* qs = scaled_q.data() + m * dim;
#pragma omp simd
            for (int64_t c = 0; c < dims<D>(pb.dim); ++c) qs[c] = q[c] * k_scale_buf[c];
            const float qz = dot<D>(q, k_zero_buf.data(), dim);
            float* lg = logits.data() + m * TILE;
            for (int64_t t = start - t0; t < stop - t0; ++t) lg[t] = dot<D>(qs, key_buf.data() + t * dim, dim) + qz;
          }
          start = stop;
        }
      }
      for (int64_t m = 0; m < m_rows; ++m) {
        float* lg = logits.data() + m * TILE;
        if (vector_keys) {
          // the logits are in place already
        } else if (!fold && offsets == 1) {
          const float* q = plane_q.data() + m * dim;
          for (int64_t t = 0; t < n; ++t) lg[t] = dot<D>(q, key_buf.data() + t * dim, dim);
        } else if (!fold) {  // pre_rope: each offset in a key group meets its own query
          for (int64_t t = 0; t < n; ++t)
            lg[t] = dot<D>(plane_q.data() + (m * offsets + (t0 + t) % offsets) * dim, key_buf.data() + t * dim, dim);
        }
        if (pb.bias) {
          const float* bias_row = pb.bias + b * pb.bias_b + h * pb.bias_h + (m % pb.bias_rows) * pb.bias_q + t0;
#pragma omp simd
          for (int64_t t = 0; t < n; ++t) lg[t] += bias_row[t];
        }
        for (int64_t s = 0; s < pb.sinks; ++s) {  // attended exactly elsewhere (the layer's sinks)
          const int64_t slot = pb.hidden[row * pb.sinks + s];
          if (slot >= t0 && slot < t1) lg[slot - t0] = NEG_INF;
        }
      }
      bool any = false;
      for (int64_t m = 0; m < m_rows; ++m) {
        float* lg = logits.data() + m * TILE;
        const float tile_max = row_max(lg, n);
        const float new_max = std::max(run_max[m], tile_max);
        const float safe = new_max == NEG_INF ? 0.0f : new_max;  // a row masked so far: exp(-inf - 0) = 0
        const float rescale = std::exp(run_max[m] - safe);
        float tile_sum = 0.0f;
#pragma omp simd reduction(+ : tile_sum)
        for (int64_t t = 0; t < n; ++t) {
          lg[t] = exp_nonpositive(lg[t] - safe);
          tile_sum += lg[t];
        }
        if (rescale != 1.0f) {
          float* a = acc.data() + m * value_dim;
#pragma omp simd
          for (int64_t c = 0; c < dims<D>(pb.value_dim); ++c) a[c] *= rescale;
        }
        run_sum[m] = run_sum[m] * rescale + tile_sum;
        run_max[m] = new_max;
        any = any || tile_max != NEG_INF;
      }
      if (!any) continue;  // a fully masked tile (padding) adds nothing
#if HF_KVCOMPRESS_SIMD
      if (vector_values) {
        simd::mix_values_any(values, row, t0, t1, logits.data(), TILE, m_rows, acc.data());
        continue;
      }
#endif
      value_tile(values, row, t0, t1, value_buf.data(), v_scale_buf.data(), v_zero_buf.data(), false);
      for (int64_t m = 0; m < m_rows; ++m) {
        const float* probs = logits.data() + m * TILE;
        float* a = acc.data() + m * value_dim;
        if (D > 0) {  // the row's output stays in registers over the tile
          float local[D > 0 ? D : 1];
          std::memcpy(local, a, sizeof(local));
          for (int64_t t = 0; t < n; ++t) {
            const float p = probs[t];
            const float* v = value_buf.data() + t * D;
#pragma omp simd
            for (int64_t c = 0; c < D; ++c) local[c] += p * v[c];
          }
          std::memcpy(a, local, sizeof(local));
        } else {
          for (int64_t t = 0; t < n; ++t) {
            const float p = probs[t];
            const float* v = value_buf.data() + t * value_dim;
#pragma omp simd
            for (int64_t c = 0; c < value_dim; ++c) a[c] += p * v[c];
          }
        }
      }
    }
    if (pb.plain_query) {
      attend_plain<D>(pb, row, tokens, acc.data(), run_max.data(), run_sum.data(), plain_buf, plain_logits);
      for (int64_t m = 0; m < m_rows; ++m) {  // a fully masked row (padding) gives 0, not NaN
        const float norm = 1.0f / std::max(run_sum[m], std::numeric_limits<float>::min());
        float* a = acc.data() + m * value_dim;
        float* p = pb.plain_out + (row * m_rows + m) * value_dim;
#pragma omp simd
        for (int64_t c = 0; c < dims<D>(pb.value_dim); ++c) {
          a[c] *= norm;
          p[c] *= norm;
        }
      }
    }
    for (int64_t m = 0; m < m_rows; ++m) {
      const int64_t out_row = row * m_rows + m;
      if (pb.max) {
        pb.max[out_row] = run_max[m];
        pb.sum[out_row] = run_sum[m];
      }
      float* out = pb.acc + out_row * value_dim;
      if (pb.value_back) {  // out = acc @ value_back: back from the plane-major order and the values' basis at once
        times_matrix<D>(acc.data() + m * value_dim, pb.value_back, out, value_dim);
        continue;
      }
      for (int64_t c = 0; c < value_dim; ++c)  // back from the values' plane-major order
        out[c] = acc[m * value_dim + values.plane_pos(c)];
    }
  }
}

// The store's part of a call, checked, and the rows run: shared by both entry points.
struct Call {
  Store keys, values;
  Problem pb;
  int64_t batch;
};

// query [B, H, M, O, D] float32 (scaled, storage basis; O = 1, or one query per offset within a per-channel key
// group: pre_rope keys; with turned_offsets > 0, O = 1 and the kernel turns it into that many, Problem::key_turns).
// bias: [B or 1, H or 1, Q, >= columns] float32 additive mask with M a multiple of Q (row m reads bias row m % Q), or
// absent. hidden: [B, H, S] int64 slots of the store to leave out (-1: none), or absent. spans: [B, H, 2] int64 (first
// token, tokens) of each row in a flat store [1, 1, N, ...] (Store::spans), whose T is then the most any row holds;
// or absent: the store is [B, H, T, ...].
Call prepare(const at::Tensor& query, const at::Tensor& k_codes, const at::Tensor& k_scale,
             const c10::optional<at::Tensor>& k_zero, int64_t k_levels, double k_l0, double k_a, double k_b,
             const at::Tensor& v_codes, const at::Tensor& v_scale, const c10::optional<at::Tensor>& v_zero,
             int64_t v_levels, double v_l0, double v_a, double v_b, int64_t value_dim,
             const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& hidden, bool vectorised,
             int64_t extra_columns, int64_t turned_offsets = 0,
             const c10::optional<at::Tensor>& spans = c10::nullopt) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && query.dim() == 5 && query.is_contiguous(),
              "cpu_decode: query must be contiguous float32 [B, H, M, O, D]");
  TORCH_CHECK(turned_offsets == 0 || query.size(3) == 1, "cpu_decode: turned queries start from one per row");
  const int64_t batch = query.size(0), heads = query.size(1), m_rows = query.size(2);
  const int64_t offsets = turned_offsets > 0 ? turned_offsets : query.size(3);
  const int64_t dim = query.size(4);
  Store keys = make_store(k_codes, k_scale, k_zero, dim, k_levels, k_l0, k_a, k_b);
  Store values = make_store(v_codes, v_scale, v_zero, value_dim, v_levels, v_l0, v_a, v_b);
  TORCH_CHECK(values.tokens == keys.tokens, "cpu_decode: keys and values disagree on the tokens");
  if (spans.has_value()) {
    TORCH_CHECK(spans->scalar_type() == at::kLong && spans->is_contiguous() && spans->dim() == 3 &&
                    spans->size(0) == batch && spans->size(1) == heads && spans->size(2) == 2,
                "cpu_decode: spans must be contiguous int64 [B, H, 2]");
    TORCH_CHECK(k_codes.size(0) == 1 && k_codes.size(1) == 1 && v_codes.size(0) == 1 && v_codes.size(1) == 1,
                "cpu_decode: a store read by spans is flat, [1, 1, N, ...]");
    TORCH_CHECK(keys.token_group == 1 && values.token_group == 1,
                "cpu_decode: a store read by spans has one scale row per token");
    const int64_t* span = spans->data_ptr<int64_t>();
    int64_t most = 0;
    for (int64_t r = 0; r < batch * heads; ++r) {
      const int64_t start = span[2 * r], n = span[2 * r + 1];
      TORCH_CHECK(start >= 0 && n >= 0 && start + n <= keys.tokens, "cpu_decode: a span reaches outside the store");
      most = std::max(most, n);
    }
    keys.tokens = values.tokens = most;
    keys.spans = values.spans = span;
  } else {
    TORCH_CHECK(k_codes.size(0) == batch && k_codes.size(1) == heads && v_codes.size(0) == batch &&
                    v_codes.size(1) == heads, "cpu_decode: query and store disagree");
  }
  const int64_t tokens = keys.tokens;
  TORCH_CHECK(offsets == 1 || (keys.channel_group == 1 && offsets == keys.token_group),
              "cpu_decode: one query per offset needs per-channel key groups of that many tokens");
  const float* bias_data = nullptr;
  int64_t bias_b = 0, bias_h = 0, bias_q = 0, bias_rows = 1;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 4 && bias->size(3) == tokens + extra_columns &&
                    bias->stride(3) == 1 && (bias->size(0) == 1 || bias->size(0) == batch) &&
                    (bias->size(1) == 1 || bias->size(1) == heads) && m_rows % bias->size(2) == 0,
                "cpu_decode: bias must be float32 [B or 1, H or 1, Q, T] with unit stride over T");
    bias_data = bias->data_ptr<float>();
    bias_b = bias->size(0) == 1 ? 0 : bias->stride(0);
    bias_h = bias->size(1) == 1 ? 0 : bias->stride(1);
    bias_q = bias->stride(2);
    bias_rows = bias->size(2);
  }
  const int64_t* hidden_data = nullptr;
  int64_t sinks = 0;
  if (hidden.has_value()) {
    TORCH_CHECK(hidden->scalar_type() == at::kLong && hidden->dim() == 3 && hidden->size(0) == batch &&
                    hidden->size(1) == heads && hidden->is_contiguous(), "cpu_decode: hidden must be int64 [B, H, S]");
    hidden_data = hidden->data_ptr<int64_t>();
    sinks = hidden->size(2);
  }
  Problem pb{};
  pb.query = query.data_ptr<float>();
  pb.heads = heads, pb.m_rows = m_rows, pb.offsets = offsets, pb.dim = dim, pb.value_dim = value_dim;
  pb.bias = bias_data, pb.bias_b = bias_b, pb.bias_h = bias_h, pb.bias_q = bias_q, pb.bias_rows = bias_rows;
  pb.hidden = hidden_data, pb.sinks = sinks, pb.vectorised = vectorised;
  return Call{keys, values, pb, batch};
}

void launch(const Call& call) {
  const Problem& pb = call.pb;
  const Store &keys = call.keys, &values = call.values;
  // The head dims of common models compiled in; any other runs with run-time loops.
  const int64_t fixed = pb.dim == pb.value_dim && (pb.dim == 32 || pb.dim == 64 || pb.dim == 128 || pb.dim == 256)
                            ? pb.dim : 0;
  at::parallel_for(0, call.batch * pb.heads, 1, [&](int64_t begin, int64_t end) {
    switch (fixed) {
      case 32: return attend_rows<32>(pb, keys, values, pick_tile<32>(keys), pick_tile<32>(values), begin, end);
      case 64: return attend_rows<64>(pb, keys, values, pick_tile<64>(keys), pick_tile<64>(values), begin, end);
      case 128: return attend_rows<128>(pb, keys, values, pick_tile<128>(keys), pick_tile<128>(values), begin, end);
      case 256: return attend_rows<256>(pb, keys, values, pick_tile<256>(keys), pick_tile<256>(values), begin, end);
      default: return attend_rows<0>(pb, keys, values, pick_tile<0>(keys), pick_tile<0>(values), begin, end);
    }
  });
}

}  // namespace

// The store's softmax partials (see `prepare` for the arguments): (max [B, H, M, 1], sum [B, H, M, 1],
// out [B, H, M, Dv]), out and sum relative to max.
std::vector<at::Tensor> decode_attention_partials(
    const at::Tensor& query, const at::Tensor& k_codes, const at::Tensor& k_scale,
    const c10::optional<at::Tensor>& k_zero, int64_t k_levels, double k_l0, double k_a, double k_b,
    const at::Tensor& v_codes, const at::Tensor& v_scale,
    const c10::optional<at::Tensor>& v_zero, int64_t v_levels, double v_l0, double v_a, double v_b,
    int64_t value_dim, const c10::optional<at::Tensor>& bias,
    const c10::optional<at::Tensor>& hidden, bool vectorised) {
  Call call = prepare(query, k_codes, k_scale, k_zero, k_levels, k_l0, k_a, k_b, v_codes, v_scale, v_zero, v_levels,
                      v_l0, v_a, v_b, value_dim, bias, hidden, vectorised, 0);
  const int64_t batch = query.size(0), heads = query.size(1), m_rows = query.size(2);
  auto options = query.options();
  at::Tensor out_max = at::empty({batch, heads, m_rows, 1}, options);
  at::Tensor out_sum = at::empty({batch, heads, m_rows, 1}, options);
  at::Tensor out_acc = at::empty({batch, heads, m_rows, value_dim}, options);
  call.pb.max = out_max.data_ptr<float>();
  call.pb.sum = out_sum.data_ptr<float>();
  call.pb.acc = out_acc.data_ptr<float>();
  launch(call);
  return {out_max, out_sum, out_acc};
}

// The whole decode attention of a layer: the store (as decode_attention_partials reads it), then its exact sinks at
// the `hidden` slots (sink_keys / sink_values [B, H, S, D], or absent) and its tail (tail_keys / tail_values
// [B, H, Tt, D]) in one softmax. plain_query [B, H, M, D] float32 (scaled, the model's basis) meets sinks and tail;
// bias, when given, covers the store's and the tail's columns [0, T + Tt). Returns (store part [B, H, M, Dv] in the
// values' storage basis, plain part [B, H, M, Dv]), each already divided by the whole softmax sum (a fully masked
// row: zeros); the output is the store part brought back from its basis plus the plain part. key_rotation [D, D]:
// `query` is in the model's basis (O = 1) and meets the keys as query @ key_rotation; value_rotation [Dv, Dv]: the
// values were stored as x @ value_rotation (orthogonal), and the store part comes back in the model's basis,
// times value_rotation's transpose. key_turns [2, O, R] (cos, sin of turning by each offset o < O, rotate-half RoPE
// over the first R channels): `query` (O = 1, model's basis) becomes O offset queries, turned and then rotated
// (pre_rope keys). Each saves the caller a few small tensor ops per layer and step. spans [B, H, 2]: the store is
// flat and ragged (see prepare); the bias's store columns are then the most any row holds.
std::vector<at::Tensor> decode_attention(
    const at::Tensor& query, const at::Tensor& plain_query, const at::Tensor& k_codes, const at::Tensor& k_scale,
    const c10::optional<at::Tensor>& k_zero, int64_t k_levels, double k_l0, double k_a, double k_b,
    const at::Tensor& v_codes, const at::Tensor& v_scale,
    const c10::optional<at::Tensor>& v_zero, int64_t v_levels, double v_l0, double v_a, double v_b,
    int64_t value_dim, const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& hidden,
    const c10::optional<at::Tensor>& sink_keys, const c10::optional<at::Tensor>& sink_values,
    const at::Tensor& tail_keys, const at::Tensor& tail_values, bool vectorised,
    const c10::optional<at::Tensor>& key_rotation, const c10::optional<at::Tensor>& value_rotation,
    const c10::optional<at::Tensor>& key_turns, const c10::optional<at::Tensor>& spans) {
  const int64_t batch = query.size(0), heads = query.size(1), m_rows = query.size(2), dim = query.size(4);
  const int64_t tail_tokens = tail_keys.size(2);
  const auto type = tail_keys.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf,
              "cpu_decode: the tail must be float32, bfloat16 or float16");
  auto plain_states = [&](const at::Tensor& t, int64_t tokens, int64_t width, const char* name) {
    TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.dim() == 4 && t.size(0) == batch &&
                    t.size(1) == heads && t.size(2) == tokens && t.size(3) == width,
                "cpu_decode: ", name, " must be contiguous [B, H, tokens, D] in the tail's dtype");
    return t.data_ptr();
  };
  TORCH_CHECK(plain_query.scalar_type() == at::kFloat && plain_query.is_contiguous() && plain_query.dim() == 4 &&
                  plain_query.size(0) == batch && plain_query.size(1) == heads && plain_query.size(2) == m_rows &&
                  plain_query.size(3) == dim, "cpu_decode: plain_query must be contiguous float32 [B, H, M, D]");
  if (key_turns.has_value())
    TORCH_CHECK(key_turns->scalar_type() == at::kFloat && key_turns->is_contiguous() && key_turns->dim() == 3 &&
                    key_turns->size(0) == 2 && key_turns->size(2) % 2 == 0 && key_turns->size(2) <= dim,
                "cpu_decode: key_turns must be contiguous float32 [2, O, R] (cos, sin), R even and <= D");
  Call call = prepare(query, k_codes, k_scale, k_zero, k_levels, k_l0, k_a, k_b, v_codes, v_scale, v_zero, v_levels,
                      v_l0, v_a, v_b, value_dim, bias, hidden, vectorised, tail_tokens,
                      key_turns.has_value() ? key_turns->size(1) : 0, spans);
  Problem& pb = call.pb;
  if (key_turns.has_value()) {
    pb.key_turns = key_turns->data_ptr<float>();
    pb.turn_width = key_turns->size(2);
  }
  TORCH_CHECK(sink_keys.has_value() == (pb.sinks > 0) && sink_values.has_value() == (pb.sinks > 0),
              "cpu_decode: sink states come with their slots (hidden)");
  if (pb.sinks > 0) {
    pb.sink_keys = plain_states(*sink_keys, pb.sinks, dim, "sink_keys");
    pb.sink_values = plain_states(*sink_values, pb.sinks, value_dim, "sink_values");
  }
  pb.tail_keys = plain_states(tail_keys, tail_tokens, dim, "tail_keys");
  pb.tail_values = plain_states(tail_values, tail_tokens, value_dim, "tail_values");
  pb.plain_type = type;
  pb.tail_tokens = tail_tokens;
  pb.plain_query = plain_query.data_ptr<float>();
  auto rotation = [](const c10::optional<at::Tensor>& r, int64_t width, const char* name) {
    TORCH_CHECK(r->scalar_type() == at::kFloat && r->is_contiguous() && r->dim() == 2 && r->size(0) == width &&
                    r->size(1) == width, "cpu_decode: ", name, " must be contiguous float32 [D, D]");
    return r->data_ptr<float>();
  };
  if (key_rotation.has_value()) {
    TORCH_CHECK(query.size(3) == 1, "cpu_decode: key_rotation takes one query per row (O = 1), turned or not");
    pb.key_rotation = rotation(key_rotation, dim, "key_rotation");
  }
  std::vector<float> value_back;  // value_back[plane_pos(j), c] = R[c, j]: the rows of R^T in plane-major order
  if (value_rotation.has_value()) {
    const float* r = rotation(value_rotation, value_dim, "value_rotation");
    value_back.resize(value_dim * value_dim);
    for (int64_t j = 0; j < value_dim; ++j)
      for (int64_t c = 0; c < value_dim; ++c)
        value_back[call.values.plane_pos(j) * value_dim + c] = r[c * value_dim + j];
    pb.value_back = value_back.data();
  }
  auto options = query.options();
  at::Tensor stored = at::empty({batch, heads, m_rows, value_dim}, options);
  at::Tensor plain = at::empty({batch, heads, m_rows, value_dim}, options);
  pb.acc = stored.data_ptr<float>();
  pb.plain_out = plain.data_ptr<float>();
  launch(call);
  return {stored, plain};
}

// Which parts of decode_attention_partials the instruction-set paths would take for this store: {keys, values}.
std::vector<bool> vector_paths(const at::Tensor& k_codes, const at::Tensor& k_scale,
                               const c10::optional<at::Tensor>& k_zero, int64_t k_levels, const at::Tensor& v_codes,
                               const at::Tensor& v_scale, const c10::optional<at::Tensor>& v_zero, int64_t v_levels,
                               int64_t dim, int64_t value_dim, int64_t offsets) {
  const Store keys = make_store(k_codes, k_scale, k_zero, dim, k_levels, 0.0, 1.0, 0.0);
  const Store values = make_store(v_codes, v_scale, v_zero, value_dim, v_levels, 0.0, 1.0, 0.0);
  return vector_parts(keys, values, offsets, true);
}

std::string instruction_set() {
#if HF_KVCOMPRESS_SIMD
  return simd::NAME;
#else
  return "portable";
#endif
}

namespace {

// A kind's 4-bit latent codes (cpu_lowrank.h `Codes`), checked: codes [B, Tq, r / 2] uint8 (unit stride over bytes),
// scale and zero bf16 at one set of strides, per channel [B, Tq / group, r] or per token [B, Tq, r / group] (unit
// stride over the last axis), signs [r] float32 or absent. No codes: Tq = 0.
lowrank::Codes lowrank_codes(const c10::optional<at::Tensor>& codes, const c10::optional<at::Tensor>& scale,
                             const c10::optional<at::Tensor>& zero, int64_t group, bool per_channel,
                             const c10::optional<at::Tensor>& signs, int64_t batch, int64_t rank, const char* kind) {
  lowrank::Codes c;
  if (!codes.has_value()) {
    TORCH_CHECK(!scale.has_value() && !zero.has_value() && !signs.has_value(),
                "lowrank: ", kind, " scale, zero and signs come with their codes");
    return c;
  }
  TORCH_CHECK(scale.has_value() && zero.has_value(), "lowrank: ", kind, " codes come with their scale and zero");
  const at::Tensor &q = *codes, &s = *scale, &z = *zero;
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 3 && q.size(0) == batch && 2 * q.size(2) == rank &&
                  (q.size(2) <= 1 || q.stride(2) == 1),
              "lowrank: ", kind, " codes must be uint8 [B, T, r / 2] (two 4-bit codes a byte) with unit stride over "
              "the bytes, r the latents' rank ", rank);
  const int64_t tokens = q.size(1);
  TORCH_CHECK(group > 0 && (per_channel ? tokens % group == 0 : rank % group == 0),
              "lowrank: ", kind, " group must be positive and divide the ", per_channel ? "tokens" : "rank");
  const int64_t rows = per_channel ? tokens / group : tokens, width = per_channel ? rank : rank / group;
  for (const at::Tensor* t : {&s, &z})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 3 && t->size(0) == batch && t->size(1) == rows &&
                    t->size(2) == width && (width <= 1 || t->stride(2) == 1),
                "lowrank: ", kind, " scale and zero must be bfloat16 [B, ", rows, ", ", width,
                "] with unit stride over the last axis");
  TORCH_CHECK(s.stride(0) == z.stride(0) && (rows <= 1 || s.stride(1) == z.stride(1)),
              "lowrank: ", kind, " scale and zero must share their strides");
  if (signs.has_value())
    TORCH_CHECK(signs->scalar_type() == at::kFloat && signs->is_contiguous() && signs->dim() == 1 &&
                    signs->size(0) == rank, "lowrank: ", kind, " signs must be contiguous float32 [r]");
  c.codes = q.data_ptr<uint8_t>(), c.codes_b = q.stride(0), c.codes_t = q.stride(1);
  c.scale = reinterpret_cast<const uint16_t*>(s.data_ptr<at::BFloat16>());
  c.zero = reinterpret_cast<const uint16_t*>(z.data_ptr<at::BFloat16>());
  c.scale_b = s.stride(0), c.scale_t = s.stride(1), c.tokens = tokens, c.group = group, c.per_channel = per_channel;
  c.signs = signs.has_value() ? signs->data_ptr<float>() : nullptr;
  return c;
}

// The keys' half of lowrank_decode_attention's arguments, checked.
lowrank::Keys lowrank_keys(const at::Tensor& latent, const lowrank::Codes& codes, const at::Tensor& basis,
                           const c10::optional<at::Tensor>& pairs, bool round, const at::Tensor& mean,
                           const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& query, bool vectorised) {
  const auto type = latent.scalar_type();
  TORCH_CHECK(latent.dim() == 3 && latent.stride(2) == 1 &&
                  (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf),
              "lowrank: latent must be float32, bfloat16 or float16 [B, T, r] with unit stride over r");
  TORCH_CHECK(query.scalar_type() == at::kFloat && query.dim() == 4 && query.is_contiguous(),
              "lowrank: query must be contiguous float32 [B, H, M, D]");
  const int64_t batch = query.size(0), heads = query.size(1), rows = query.size(2), dim = query.size(3);
  const int64_t tokens = codes.tokens + latent.size(1), rank = latent.size(2);
  TORCH_CHECK(latent.size(0) == batch, "lowrank: latent and query disagree on the batch");
  TORCH_CHECK(basis.scalar_type() == at::kFloat && basis.is_contiguous() && basis.dim() == 3 &&
                  basis.size(0) == heads && basis.size(1) == rank && basis.size(2) == dim,
              "lowrank: basis must be contiguous float32 [H, r, D]");
  TORCH_CHECK(mean.scalar_type() == at::kFloat && mean.is_contiguous() && mean.dim() == 2 && mean.size(0) == heads &&
                  mean.size(1) == dim, "lowrank: mean must be contiguous float32 [H, D]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 3 &&
                  cos.sizes() == sin.sizes() && cos.strides() == sin.strides() && cos.size(0) == batch &&
                  cos.size(2) == tokens && cos.stride(2) == 1 && 2 * cos.size(1) <= dim,
              "lowrank: cos and sin must be float32 [B, R / 2, T] alike, unit stride over T, R <= D");
  const int64_t pair_rank = (rank + 1) / 2;
  if (pairs.has_value())
    TORCH_CHECK(pairs->scalar_type() == at::kInt && pairs->is_contiguous() && pairs->dim() == 3 &&
                    pairs->size(0) == heads && pairs->size(1) == pair_rank && pairs->size(2) == dim,
                "lowrank: pairs must be contiguous int32 [H, ceil(r / 2), D]");
  const bool use_pairs = pairs.has_value() && vectorised && lowrank::native_pairs();
  lowrank::Keys k;
  k.codes = codes;
  k.latent = latent.data_ptr(), k.latent_type = type, k.latent_b = latent.stride(0), k.latent_t = latent.stride(1);
  k.tokens = tokens, k.rank = rank, k.basis = basis.data_ptr<float>(), k.pair_rank = pair_rank, k.round = round;
  k.pairs = use_pairs ? reinterpret_cast<const uint32_t*>(pairs->data_ptr<int32_t>()) : nullptr;
  k.mean = mean.data_ptr<float>(), k.cos = cos.data_ptr<float>(), k.sin = sin.data_ptr<float>();
  k.trig_b = cos.stride(0), k.trig_f = cos.stride(1), k.query = query.data_ptr<float>();
  k.heads = heads, k.rows = rows, k.dim = dim, k.half = cos.size(1);
  return k;
}

// Run `body<VECTOR, PAIRS>` with the instantiation this call reads: VDPBF16PS pairs, float32 FMAs in AVX-512, or
// the portable loops.
template <class Body>
void lowrank_dispatch(const lowrank::Keys& k, bool vectorised, Body&& body) {
#if defined(__AVX512F__)
  if (vectorised) {
    if (k.pairs != nullptr) return body(std::true_type{}, std::true_type{});
    return body(std::true_type{}, std::false_type{});
  }
#endif
  (void)k, (void)vectorised;
  body(std::false_type{}, std::false_type{});
}

// The values' half of the arguments, checked: value_latent [B, T, rv]; bias [B or 1, H or 1, Q, columns] float32
// (unit stride over its columns, of which the store reads [0, T)); hidden [B, H, S] int64.
lowrank::Values lowrank_values(const lowrank::Keys& k, int64_t batch, const at::Tensor& value_latent,
                               const lowrank::Codes& codes, const c10::optional<at::Tensor>& bias,
                               const c10::optional<at::Tensor>& hidden, int64_t columns) {
  const auto vtype = value_latent.scalar_type();
  TORCH_CHECK(codes.tokens <= k.tokens && value_latent.dim() == 3 && value_latent.stride(2) == 1 &&
                  value_latent.size(0) == batch && value_latent.size(1) == k.tokens - codes.tokens &&
                  (vtype == at::kFloat || vtype == at::kBFloat16 || vtype == at::kHalf),
              "lowrank: value_latent must be float32, bfloat16 or float16 [B, T, rv] with unit stride over rv");
  lowrank::Values v;
  v.codes = codes;
  v.latent = value_latent.data_ptr(), v.type = vtype, v.latent_b = value_latent.stride(0);
  v.latent_t = value_latent.stride(1), v.rank = value_latent.size(2);
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 4 && bias->size(3) == columns &&
                    (columns <= 1 || bias->stride(3) == 1) && (bias->size(0) == 1 || bias->size(0) == batch) &&
                    (bias->size(1) == 1 || bias->size(1) == k.heads) && k.rows % bias->size(2) == 0,
                "lowrank: bias must be float32 [B or 1, H or 1, Q, ", columns, "] with unit stride over its columns");
    v.bias = bias->data_ptr<float>();
    v.bias_b = bias->size(0) == 1 ? 0 : bias->stride(0), v.bias_h = bias->size(1) == 1 ? 0 : bias->stride(1);
    v.bias_q = bias->stride(2), v.bias_rows = bias->size(2);
  }
  if (hidden.has_value()) {
    TORCH_CHECK(hidden->scalar_type() == at::kLong && hidden->dim() == 3 && hidden->size(0) == batch &&
                    hidden->size(1) == k.heads && hidden->is_contiguous(), "lowrank: hidden must be int64 [B, H, S]");
    v.hidden = hidden->data_ptr<int64_t>(), v.sinks = hidden->size(2);
  }
  return v;
}

// The store's softmax partials of every (batch row, head, query row) R = b * H * M + h * M + m: max o_max [B * H * M],
// sum o_sum and value-latent mix o_mix [B * H * M, rv], the sum and the mix relative to the max (a row with every
// logit masked: max -inf and zeros). Token chunks run in parallel, one per thread (one in all on one thread), whatever
// the batch, and merge at the end: a row's sums then run in the same order batched or alone, so a row gives what it
// gives alone.
void lowrank_fold(const lowrank::Keys& k, const lowrank::Values& v, int64_t batch, bool vectorised, float* o_max,
                  float* o_sum, float* o_mix) {
  const int64_t rows = k.heads * k.rows;
  std::fill(o_max, o_max + batch * rows, NEG_INF);
  std::fill(o_sum, o_sum + batch * rows, 0.0f);
  std::fill(o_mix, o_mix + batch * rows * v.rank, 0.0f);
  const int64_t tiles = (k.tokens + lowrank::LANES - 1) / lowrank::LANES;
  if (tiles == 0) return;
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(tiles, at::get_num_threads()));
  std::vector<float> mx(static_cast<size_t>(batch * chunks * rows)), sm(mx.size());
  std::vector<float> acc(static_cast<size_t>(batch * chunks * rows * v.rank));
  at::parallel_for(0, batch * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / chunks, c = task % chunks;
      lowrank_dispatch(k, vectorised, [&](auto vector, auto pairs_) {
        lowrank::fold_tiles<decltype(vector)::value, decltype(pairs_)::value>(
            k, v, b, tiles * c / chunks, tiles * (c + 1) / chunks, mx.data() + task * rows, sm.data() + task * rows,
            acc.data() + task * rows * v.rank);
      });
    }
  });
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t row = 0; row < rows; ++row) {
      float best = NEG_INF;
      for (int64_t c = 0; c < chunks; ++c) best = std::max(best, mx[(b * chunks + c) * rows + row]);
      if (best == NEG_INF) continue;  // every logit masked: max -inf, zeros
      const int64_t out = b * rows + row;
      float* mix = o_mix + out * v.rank;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t part = (b * chunks + c) * rows + row;
        const float scale = exp_nonpositive(mx[part] - best);
        o_sum[out] += scale * sm[part];
        for (int64_t i = 0; i < v.rank; ++i) mix[i] += scale * acc[part * v.rank + i];
      }
      o_max[out] = best;
    }
}

}  // namespace

// A decode step's whole attention over a layer that holds a joint low-rank store (cpu_lowrank.h). The store's keys'
// logits: latent [B, T, r] (float32, bfloat16 or float16, unit stride over r); basis [H, r, D] float32 (the layer's
// key basis transposed; bf16 values when `round`); pairs [H, ceil(r / 2), D] int32 (the bf16 basis as pairs of rank
// entries) or absent; round: the latents rounded to bf16 (bf16 products); mean [H, D] float32; cos, sin [B, R / 2, T]
// float32 (unit stride over T); query [B, H, M, D] float32 (scaled): query . RoPE(p_t)(basis z_t + mean). Plus bias
// [B or 1, H or 1, Q, T + Tt] float32 (row m reads bias row m % Q; unit stride over the columns, the store's and the
// tail's) or absent, and the store slots `hidden` [B, H, S] int64 attended as exact sinks (outside [0, T): none) or
// absent, folded into an online softmax that mixes the value latents value_latent [B, T, rv] (float32, bfloat16 or
// float16, unit stride over rv); token chunks run in parallel and merge at the end. Then the exact sinks at the `hidden` slots (sink_keys / sink_values [B, H, S, D] / [.., Dv] in the
// tail's dtype, contiguous, given with hidden) and the full-precision tail (tail_keys / tail_values [B, H, Tt, D] /
// [.., Dv], contiguous) met by the same query rows in one softmax, and the store's value-latent mix mapped to values
// by value_basis [H, Dv, rv] and value_mean [H, Dv] (float32, contiguous). Returns the output [B, H, M, Dv] float32,
// normalised (a row with every logit masked: zeros): what caches/store_attention.py's segments and codecs/lowrank.py's
// `from_basis` make of the store's partials, in one call instead of a dozen tensor ops per layer.
// key_* / value_* (all absent, or codes, scale and zero given): the store's first Tq tokens as 4-bit codes read where
// they lie (`lowrank_codes`, cpu_lowrank.h `Codes`: decoded a tile at a time to what the PyTorch decode gives); latent
// and value_latent then hold the tokens after them (T - Tq of them, maybe none), and cos, sin and bias cover all T.
at::Tensor lowrank_decode_attention(
    const at::Tensor& latent, const at::Tensor& basis, const c10::optional<at::Tensor>& pairs, bool round,
    const at::Tensor& mean, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& query,
    const at::Tensor& value_latent, const at::Tensor& value_basis, const at::Tensor& value_mean,
    const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& hidden,
    const c10::optional<at::Tensor>& sink_keys, const c10::optional<at::Tensor>& sink_values,
    const at::Tensor& tail_keys, const at::Tensor& tail_values, bool vectorised,
    const c10::optional<at::Tensor>& key_codes, const c10::optional<at::Tensor>& key_scale,
    const c10::optional<at::Tensor>& key_zero, int64_t key_group, bool key_per_channel,
    const c10::optional<at::Tensor>& key_signs, const c10::optional<at::Tensor>& value_codes,
    const c10::optional<at::Tensor>& value_scale, const c10::optional<at::Tensor>& value_zero, int64_t value_group,
    bool value_per_channel, const c10::optional<at::Tensor>& value_signs) {
  const int64_t batch = query.size(0);
  const lowrank::Codes kc = lowrank_codes(key_codes, key_scale, key_zero, key_group, key_per_channel, key_signs,
                                          batch, latent.dim() == 3 ? latent.size(2) : 0, "key");
  const lowrank::Keys k = lowrank_keys(latent, kc, basis, pairs, round, mean, cos, sin, query, vectorised);
  const int64_t rows = k.heads * k.rows;
  const int64_t tail = tail_keys.dim() == 4 ? tail_keys.size(2) : 0;
  const lowrank::Codes vc = lowrank_codes(value_codes, value_scale, value_zero, value_group, value_per_channel,
                                          value_signs, batch, value_latent.dim() == 3 ? value_latent.size(2) : 0,
                                          "value");
  TORCH_CHECK(vc.tokens == kc.tokens, "lowrank: the key and value codes must hold the same tokens");
  const lowrank::Values v = lowrank_values(k, batch, value_latent, vc, bias, hidden, k.tokens + tail);
  TORCH_CHECK(value_basis.scalar_type() == at::kFloat && value_basis.is_contiguous() && value_basis.dim() == 3 &&
                  value_basis.size(0) == k.heads && value_basis.size(2) == v.rank,
              "lowrank: value_basis must be contiguous float32 [H, Dv, rv]");
  const int64_t value_dim = value_basis.size(1);
  TORCH_CHECK(value_mean.scalar_type() == at::kFloat && value_mean.is_contiguous() && value_mean.dim() == 2 &&
                  value_mean.size(0) == k.heads && value_mean.size(1) == value_dim,
              "lowrank: value_mean must be contiguous float32 [H, Dv]");
  const auto type = tail_keys.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf,
              "lowrank: the tail must be float32, bfloat16 or float16");
  auto exact_states = [&](const at::Tensor& t, int64_t tokens, int64_t width, const char* name) {
    TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.dim() == 4 && t.size(0) == batch &&
                    t.size(1) == k.heads && t.size(2) == tokens && t.size(3) == width,
                "lowrank: ", name, " must be contiguous [B, H, tokens, D] in the tail's dtype");
    return t.data_ptr();
  };
  TORCH_CHECK(sink_keys.has_value() == (v.sinks > 0) && sink_values.has_value() == (v.sinks > 0),
              "lowrank: sink states come with their slots (hidden)");
  lowrank::Exact e;
  if (v.sinks > 0) {
    e.sink_keys = exact_states(*sink_keys, v.sinks, k.dim, "sink_keys");
    e.sink_values = exact_states(*sink_values, v.sinks, value_dim, "sink_values");
  }
  e.tail_keys = exact_states(tail_keys, tail, k.dim, "tail_keys");
  e.tail_values = exact_states(tail_values, tail, value_dim, "tail_values");
  e.type = type, e.tail = tail, e.value_dim = value_dim;
  e.value_basis = value_basis.data_ptr<float>(), e.value_mean = value_mean.data_ptr<float>();
  std::vector<float> mx(static_cast<size_t>(batch * rows)), sm(mx.size());
  std::vector<float> mix(static_cast<size_t>(batch * rows * v.rank));
  lowrank_fold(k, v, batch, vectorised, mx.data(), sm.data(), mix.data());
  at::Tensor out = at::empty({batch, k.heads, k.rows, value_dim}, query.options());
  float* o = out.data_ptr<float>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < k.heads; ++h) {
      const int64_t first = (b * k.heads + h) * k.rows;
      lowrank::finish_head(k, v, e, b, h, mx.data() + first, sm.data() + first, mix.data() + first * v.rank,
                           o + first * value_dim);
    }
  return out;
}

// A few tokens' latents for a joint low-rank store (codecs/lowrank.py's `encode`, a decode step's new token), in one
// call instead of the dozen tensor ops of the rotation, the mean and the projection: states [B, H, n, D] (float32,
// bfloat16 or float16, any strides) turned by RoPE where cos and sin [B, H, n, R / 2] (float32, contiguous; the turn
// to apply, the keys' own positions negated by the caller) are given, on the first R channels; the mean [H, D]
// subtracted; the whole [H * D] projected on encoder [H, D, r] (float32, contiguous). Returns [B, 1, n, r] float32.
// The rotation's and the mean's float32 roundings are PyTorch's; the projection's sums run in another order.
at::Tensor lowrank_encode(const at::Tensor& states, const c10::optional<at::Tensor>& cos,
                          const c10::optional<at::Tensor>& sin, const at::Tensor& mean, const at::Tensor& encoder) {
  const auto type = states.scalar_type();
  TORCH_CHECK(states.dim() == 4 && (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf),
              "lowrank_encode: states must be float32, bfloat16 or float16 [B, H, n, D]");
  const int64_t batch = states.size(0), heads = states.size(1), tokens = states.size(2), dim = states.size(3);
  TORCH_CHECK(mean.scalar_type() == at::kFloat && mean.is_contiguous() && mean.dim() == 2 && mean.size(0) == heads &&
                  mean.size(1) == dim,
              "lowrank_encode: mean must be contiguous float32 [H, D]");
  TORCH_CHECK(encoder.scalar_type() == at::kFloat && encoder.is_contiguous() && encoder.dim() == 3 &&
                  encoder.size(0) == heads && encoder.size(1) == dim,
              "lowrank_encode: encoder must be contiguous float32 [H, D, r]");
  TORCH_CHECK(cos.has_value() == sin.has_value(), "lowrank_encode: cos and sin come together");
  int64_t half = 0;
  if (cos.has_value()) {
    half = cos->dim() == 4 ? cos->size(3) : 0;
    for (const at::Tensor* t : {&*cos, &*sin})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 4 && t->size(0) == batch &&
                      t->size(1) == heads && t->size(2) == tokens && t->size(3) == half && 2 * half <= dim,
                  "lowrank_encode: cos and sin must be contiguous float32 [B, H, n, R / 2] alike, R <= D");
  }
  const int64_t rank = encoder.size(2), width = heads * dim;
  at::Tensor out = at::empty({batch, 1, tokens, rank}, states.options().dtype(at::kFloat));
  const void* base = states.data_ptr();
  const float* mu = mean.data_ptr<float>();
  std::vector<float> x(static_cast<size_t>(width));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        float* xh = x.data() + h * dim;
        const int64_t start = b * states.stride(0) + h * states.stride(1) + t * states.stride(2);
        for (int64_t d = 0; d < dim; ++d) xh[d] = load_float(base, type, start + d * states.stride(3));
        if (half > 0) {
          const int64_t at_turn = ((b * heads + h) * tokens + t) * half;
          lowrank::turn_in_place(xh, cos->data_ptr<float>() + at_turn, sin->data_ptr<float>() + at_turn, half);
        }
        for (int64_t d = 0; d < dim; ++d) xh[d] -= mu[h * dim + d];
      }
      lowrank::project(x.data(), encoder.data_ptr<float>(), width, rank,
                       out.data_ptr<float>() + (b * tokens + t) * rank);
    }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("lowrank_encode", &lowrank_encode,
             "A few tokens' latents for a joint low-rank store: turned back, centred and projected, in one call");
  module.def("lowrank_decode_attention", &lowrank_decode_attention,
             "Decode attention over a joint low-rank store, its exact sinks and its tail, normalised, fused");
  module.def("decode_attention_partials", &decode_attention_partials,
             "Softmax partials of decode queries over a bit-packed KV store (max, sum, unnormalised output)");
  module.def("decode_attention", &decode_attention,
             "Decode attention over a bit-packed KV store, its exact sinks and its tail: the normalised output's parts");
  module.def("vector_paths", &vector_paths, "Which parts ({keys, values}) the instruction-set paths read");
  module.def("instruction_set", &instruction_set, "The instruction-set paths compiled in: avx512 or portable");
}
