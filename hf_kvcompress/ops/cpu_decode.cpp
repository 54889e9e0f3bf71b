// Decode attention over a bit-packed KV store on CPU: one pass over the codes per (batch row, KV head).
//
// The PyTorch path (caches/store_attention.py) reads a block in a dozen passes (planes to float32, scale, matmul,
// folds, exp, matmul), each costing about as much as DynamicCache's whole matmul (benchmarks/NOTES.md, section 5).
// Here a tile of TILE tokens is dequantised into a small buffer that stays in L1, met by the KV head's query rows,
// folded into a running max and sum (flash-decoding, Dao et al. 2023) and mixed into the values the same way,
// so every code byte is read once. The output is the softmax partials (max, sum, unnormalised output) that the
// Triton kernel returns too; store_attention merges them with the exact sinks and the full-precision tail.
//
// Layout (ops/bitpack.py): byte j of a token holds dims j*u + i in bits [i*bits, (i+1)*bits), u = 8 / bits. Each
// token is unpacked "plane-major" (plane i, column j at i*W + j), which is a shift and a mask over contiguous bytes
// (vectorised) instead of an interleave; the query is permuted into that order once, and the output back once.
// Scales and zero points: one per (token group, channel group); keys per channel (KIVI) have token groups of
// group_size and channel groups of 1, everything else token groups of 1 and channel groups of group_size.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t TILE = 64;  // tokens per online-softmax step: keys [TILE, D] float32 stay in L1
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// How codes become levels (multiples of the scale): the code itself; L0 + a*c + b*(c >> 1) (a 4-level codebook
// symmetric about 0, codecs/plane_attention.py); or a 256-entry table (float8 bytes).
enum Levels { PLAIN = 0, AFFINE = 1, TABLE = 2 };

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

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// One kind (keys or values) of the store: codes [B, H, T, W] uint8, scale and zero [B, H, T / token_group,
// dim / channel_group] (zero may be absent: float8), and how to read them.
struct Store {
  const uint8_t* codes;
  const void* scale;
  const void* zero;
  at::ScalarType scale_type;
  int64_t tokens, width, dim, bits, token_group, channel_group, levels;
  float l0, a, b;
  const float* table;

  int64_t unit() const { return 8 / bits; }
  int64_t scale_groups() const { return dim / channel_group; }
  int64_t scale_rows() const { return tokens / token_group; }
  // Plane-major position of dim d.
  int64_t plane_pos(int64_t d) const { return (d % unit()) * width + d / unit(); }
};

template <typename S>
inline float load(const void* base, int64_t i) {
  return static_cast<float>(static_cast<const S*>(base)[i]);
}

// Codes of one token as levels, plane-major: out[i * W + j] = level(code i of byte j).
template <int BITS, int LEVELS>
inline void unpack_levels(const Store& s, const uint8_t* bytes, float* out) {
  constexpr int U = 8 / BITS;
  constexpr int MASK = (1 << BITS) - 1;
  const int64_t w = s.width;
  for (int i = 0; i < U; ++i) {
    float* o = out + i * w;
    const int shift = i * BITS;
    if (LEVELS == TABLE) {
      for (int64_t j = 0; j < w; ++j) o[j] = s.table[bytes[j]];
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

// Tokens [t0, t1) of row `row` dequantised into out [t1 - t0, D] (plane-major rows). `group_scale` / `group_zero`
// [D] are scratch for per-channel groups (the group's scale and zero point in plane-major order).
template <int BITS, int LEVELS, typename S>
void dequantise_tile(const Store& s, int64_t row, int64_t t0, int64_t t1, float* out, float* group_scale,
                     float* group_zero) {
  const int64_t d = s.dim, w = s.width, groups = s.scale_groups();
  const int64_t scale_base = row * s.scale_rows() * groups;
  int64_t loaded = -1;
  for (int64_t t = t0; t < t1; ++t) {
    float* o = out + (t - t0) * d;
    unpack_levels<BITS, LEVELS>(s, s.codes + (row * s.tokens + t) * w, o);
    const int64_t scale_row = scale_base + (t / s.token_group) * groups;
    if (s.channel_group == 1) {  // one scale per channel, shared by a group of tokens
      if (t / s.token_group != loaded) {
        loaded = t / s.token_group;
        for (int64_t c = 0; c < d; ++c) {
          group_scale[s.plane_pos(c)] = load<S>(s.scale, scale_row + c);
          group_zero[s.plane_pos(c)] = s.zero ? load<S>(s.zero, scale_row + c) : 0.0f;
        }
      }
#pragma omp simd
      for (int64_t p = 0; p < d; ++p) o[p] = o[p] * group_scale[p] + group_zero[p];
    } else {  // groups along head_dim: in plane i, columns [g * run, (g + 1) * run) belong to group g
      const int64_t run = s.channel_group / (8 / BITS);
      for (int64_t g = 0; g < groups; ++g) {
        const float scale = load<S>(s.scale, scale_row + g);
        const float zero = s.zero ? load<S>(s.zero, scale_row + g) : 0.0f;
        for (int64_t i = 0; i < 8 / BITS; ++i) {
          float* part = o + i * w + g * run;
#pragma omp simd
          for (int64_t j = 0; j < run; ++j) part[j] = part[j] * scale + zero;
        }
      }
    }
  }
}

using TileFn = void (*)(const Store&, int64_t, int64_t, int64_t, float*, float*, float*);

template <typename S>
TileFn pick_for_scale(int64_t bits, int64_t levels) {
  if (bits == 2 && levels == PLAIN) return dequantise_tile<2, PLAIN, S>;
  if (bits == 2 && levels == AFFINE) return dequantise_tile<2, AFFINE, S>;
  if (bits == 4 && levels == PLAIN) return dequantise_tile<4, PLAIN, S>;
  if (bits == 8 && levels == PLAIN) return dequantise_tile<8, PLAIN, S>;
  if (bits == 8 && levels == TABLE) return dequantise_tile<8, TABLE, S>;
  TORCH_CHECK(false, "cpu_decode: no kernel for bits=", bits, " with levels mode ", levels);
}

TileFn pick(const Store& s) {
  switch (s.scale_type) {
    case at::kFloat: return pick_for_scale<float>(s.bits, s.levels);
    case at::kBFloat16: return pick_for_scale<c10::BFloat16>(s.bits, s.levels);
    case at::kHalf: return pick_for_scale<c10::Half>(s.bits, s.levels);
    default: TORCH_CHECK(false, "cpu_decode: scales must be float32, bfloat16 or float16, got ", s.scale_type);
  }
}

Store make_store(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& zero,
                 int64_t dim, int64_t levels, double l0, double a, double b, const c10::optional<at::Tensor>& table) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 4 && codes.is_contiguous(),
              "cpu_decode: codes must be contiguous uint8 [B, H, T, W]");
  TORCH_CHECK(scale.dim() == 4 && scale.is_contiguous(), "cpu_decode: scale must be contiguous [B, H, T', G]");
  Store s{};
  s.codes = codes.data_ptr<uint8_t>();
  s.scale = scale.data_ptr();
  s.scale_type = scale.scalar_type();
  s.zero = nullptr;
  if (zero.has_value()) {
    TORCH_CHECK(zero->sizes() == scale.sizes() && zero->scalar_type() == scale.scalar_type() && zero->is_contiguous(),
                "cpu_decode: zero must match scale");
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
  s.table = nullptr;
  if (levels == TABLE) {
    TORCH_CHECK(table.has_value() && table->scalar_type() == at::kFloat && table->numel() == 256 &&
                    table->is_contiguous(), "cpu_decode: levels=TABLE needs a float32 table of 256 entries");
    s.table = table->data_ptr<float>();
  }
  return s;
}

}  // namespace

// query [B, H, M, O, D] float32 (scaled, storage basis; O = 1, or one query per offset within a per-channel key
// group: pre_rope keys). bias: [B or 1, H or 1, Q, T] float32 additive mask with M a multiple of Q (row m reads
// bias row m % Q), or absent. hidden: [B, H, S] int64 slots of the store to leave out (-1: none), or absent.
// Returns (max [B, H, M, 1], sum [B, H, M, 1], out [B, H, M, Dv]): out and sum relative to max.
std::vector<at::Tensor> decode_attention_partials(
    const at::Tensor& query, const at::Tensor& k_codes, const at::Tensor& k_scale,
    const c10::optional<at::Tensor>& k_zero, int64_t k_levels, double k_l0, double k_a, double k_b,
    const c10::optional<at::Tensor>& k_table, const at::Tensor& v_codes, const at::Tensor& v_scale,
    const c10::optional<at::Tensor>& v_zero, int64_t v_levels, double v_l0, double v_a, double v_b,
    const c10::optional<at::Tensor>& v_table, int64_t value_dim, const c10::optional<at::Tensor>& bias,
    const c10::optional<at::Tensor>& hidden) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && query.dim() == 5 && query.is_contiguous(),
              "cpu_decode: query must be contiguous float32 [B, H, M, O, D]");
  const int64_t batch = query.size(0), heads = query.size(1), m_rows = query.size(2), offsets = query.size(3);
  const int64_t dim = query.size(4);
  const Store keys = make_store(k_codes, k_scale, k_zero, dim, k_levels, k_l0, k_a, k_b, k_table);
  const Store values = make_store(v_codes, v_scale, v_zero, value_dim, v_levels, v_l0, v_a, v_b, v_table);
  const int64_t tokens = keys.tokens;
  TORCH_CHECK(k_codes.size(0) == batch && k_codes.size(1) == heads && v_codes.size(0) == batch &&
                  v_codes.size(1) == heads && values.tokens == tokens, "cpu_decode: query and store disagree");
  TORCH_CHECK(offsets == 1 || (keys.channel_group == 1 && offsets == keys.token_group),
              "cpu_decode: one query per offset needs per-channel key groups of that many tokens");
  const float* bias_data = nullptr;
  int64_t bias_b = 0, bias_h = 0, bias_q = 0, bias_rows = 1;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 4 && bias->size(3) == tokens &&
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
  const TileFn key_tile = pick(keys), value_tile = pick(values);
  auto options = query.options();
  at::Tensor out_max = at::empty({batch, heads, m_rows, 1}, options);
  at::Tensor out_sum = at::empty({batch, heads, m_rows, 1}, options);
  at::Tensor out_acc = at::empty({batch, heads, m_rows, value_dim}, options);
  const float* q_data = query.data_ptr<float>();
  float* max_data = out_max.data_ptr<float>();
  float* sum_data = out_sum.data_ptr<float>();
  float* acc_data = out_acc.data_ptr<float>();

  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows_q = m_rows * offsets;
    std::vector<float> plane_q(rows_q * dim), key_buf(TILE * dim), value_buf(TILE * value_dim);
    std::vector<float> logits(m_rows * TILE), acc(m_rows * value_dim), run_max(m_rows), run_sum(m_rows);
    std::vector<float> k_scale_buf(dim), k_zero_buf(dim), v_scale_buf(value_dim), v_zero_buf(value_dim);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / heads, h = row % heads;
      for (int64_t r = 0; r < rows_q; ++r)  // the query in the keys' plane-major order
        for (int64_t c = 0; c < dim; ++c) plane_q[r * dim + keys.plane_pos(c)] = q_data[(row * rows_q + r) * dim + c];
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(run_max.begin(), run_max.end(), NEG_INF);
      std::fill(run_sum.begin(), run_sum.end(), 0.0f);
      for (int64_t t0 = 0; t0 < tokens; t0 += TILE) {
        const int64_t t1 = std::min(t0 + TILE, tokens), n = t1 - t0;
        key_tile(keys, row, t0, t1, key_buf.data(), k_scale_buf.data(), k_zero_buf.data());
        for (int64_t m = 0; m < m_rows; ++m) {
          float* lg = logits.data() + m * TILE;
          for (int64_t t = 0; t < n; ++t) {
            const int64_t offset = offsets == 1 ? 0 : (t0 + t) % offsets;
            lg[t] = dot(plane_q.data() + (m * offsets + offset) * dim, key_buf.data() + t * dim, dim);
          }
          if (bias_data) {
            const float* bias_row = bias_data + b * bias_b + h * bias_h + (m % bias_rows) * bias_q + t0;
#pragma omp simd
            for (int64_t t = 0; t < n; ++t) lg[t] += bias_row[t];
          }
          for (int64_t s = 0; s < sinks; ++s) {  // attended exactly elsewhere (the layer's sinks)
            const int64_t slot = hidden_data[row * sinks + s];
            if (slot >= t0 && slot < t1) lg[slot - t0] = NEG_INF;
          }
        }
        bool any = false;
        for (int64_t m = 0; m < m_rows; ++m) {
          float* lg = logits.data() + m * TILE;
          float tile_max = NEG_INF;
#pragma omp simd reduction(max : tile_max)
          for (int64_t t = 0; t < n; ++t) tile_max = std::max(tile_max, lg[t]);
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
            for (int64_t c = 0; c < value_dim; ++c) a[c] *= rescale;
          }
          run_sum[m] = run_sum[m] * rescale + tile_sum;
          run_max[m] = new_max;
          any = any || tile_max != NEG_INF;
        }
        if (!any) continue;  // a fully masked tile (padding) adds nothing
        value_tile(values, row, t0, t1, value_buf.data(), v_scale_buf.data(), v_zero_buf.data());
        for (int64_t t = 0; t < n; ++t) {
          const float* v = value_buf.data() + t * value_dim;
          for (int64_t m = 0; m < m_rows; ++m) {
            const float p = logits[m * TILE + t];
            if (p == 0.0f) continue;
            float* a = acc.data() + m * value_dim;
#pragma omp simd
            for (int64_t c = 0; c < value_dim; ++c) a[c] += p * v[c];
          }
        }
      }
      for (int64_t m = 0; m < m_rows; ++m) {
        const int64_t out_row = row * m_rows + m;
        max_data[out_row] = run_max[m];
        sum_data[out_row] = run_sum[m];
        for (int64_t c = 0; c < value_dim; ++c)  // back from the values' plane-major order
          acc_data[out_row * value_dim + c] = acc[m * value_dim + values.plane_pos(c)];
      }
    }
  });
  return {out_max, out_sum, out_acc};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("decode_attention_partials", &decode_attention_partials,
             "Softmax partials of decode queries over a bit-packed KV store (max, sum, unnormalised output)");
}
