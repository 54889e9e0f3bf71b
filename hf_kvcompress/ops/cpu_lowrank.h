// A decode step's softmax over a joint low-rank store's latents (codecs/lowrank.py, `attend_block`), fused.
//
// A joint store holds one latent z_t [r] per token for a layer's KV heads; head h's key at position p_t is
// RoPE(p_t)(B_h z_t + mu_h). The PyTorch path rebuilds a block's keys [H, D, T] in one product, adds the mean, turns
// them in four elementwise passes and meets the query in two more products: every pass writes and rereads the
// rebuilt keys (3 KiB per token at 3 x 64 float32 dims), together about what the product costs (docs/speed.md).
// Here a tile of LANES tokens is rebuilt in registers, lane l of a vector being token t0 + l: a block of FREQS
// frequencies' two halves (channels i and i + R/2 of rotate-half RoPE) are accumulated over the rank, one FMA per
// basis entry (broadcast) and latent vector; the mean is added, the pair turned with the tile's cos and sin and met
// by each query row's two channels, so only the logits leave the registers. Channels past the rotated ones (partial
// rotary) meet the query as they are. The tile's logits are then masked (the additive mask, the slots of the exact
// sinks) and folded into one online softmax per (head, query row) (flash-decoding), whose weights mix the value
// latents (shared by the heads, as the keys' are: a value is B_v z_v + mu_v, so the mix stays in the latent and the
// caller maps it to values once). The next tile's latents are prefetched while this one's products run: at long
// contexts a layer's store comes from memory at every step.
//
// Products: float32 FMAs, or with bf16 products (lowrank's compute="bfloat16") the basis and the latents rounded to
// bf16 (round to nearest even, as torch's conversion), their products exact in float32 and summed in float32: on a
// CPU with AVX512-BF16 one VDPBF16PS per pair of rank entries (two products into the float32 lane), elsewhere the
// rounded values through the float32 path. Only the order of the float32 sums differs from the PyTorch path.
//
// Included by cpu_decode.cpp inside its anonymous namespace, after its helpers (load_float, load_floats,
// exp_nonpositive). HF_LOWRANK_VECS and HF_LOWRANK_FREQS set the register blocking: VECS x 2 x FREQS accumulators
// read VECS latent vectors and 2 x FREQS broadcast basis entries per rank entry, and loads, not products, set the
// pace when they outnumber the products' half (timed in docs/speed.md, "Low rank's decode step in one kernel call").

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifndef HF_LOWRANK_VECS
#define HF_LOWRANK_VECS 2
#endif
#ifndef HF_LOWRANK_FREQS
#define HF_LOWRANK_FREQS 4
#endif
// The value mix's register blocking (`mix_rows`): query rows and latent columns summed together per token. 1 and 16
// build the single-row form of session 28, for timing.
#ifndef HF_LOWRANK_MIX_ROWS
#define HF_LOWRANK_MIX_ROWS 3
#endif
#ifndef HF_LOWRANK_MIX_WIDTH
#define HF_LOWRANK_MIX_WIDTH 32
#endif
// Whether a tile also asks for the next tile's columns of the turn tables (`prefetch_turns`); 0 builds the variant
// without, for timing.
#ifndef HF_LOWRANK_PREFETCH_TURNS
#define HF_LOWRANK_PREFETCH_TURNS 1
#endif

namespace lowrank {

constexpr int64_t VECS = HF_LOWRANK_VECS;   // float32 vectors of AVX-512 (16 tokens each) per tile
constexpr int64_t LANES = 16 * VECS;  // tokens per tile
constexpr int FREQS = HF_LOWRANK_FREQS;  // frequencies per block: 2 x FREQS x VECS accumulators
constexpr int MIX_ROWS = HF_LOWRANK_MIX_ROWS;    // query rows per block of the value mix
constexpr int MIX_WIDTH = HF_LOWRANK_MIX_WIDTH;  // latent columns per block of the value mix

// A bf16 value's bits (round to nearest even; a NaN stays a quiet NaN), as torch converts float32.
inline uint32_t bf16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  return (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
}

inline float bf16_float(uint32_t half) {
  const uint32_t bits = half << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// A kind's 4-bit latent store read where it lies (a `lowrank+int4` stack: codecs/intn.py stores the latents): codes c
// in [0, 16), two a byte (channel 2i in the low half), a bf16 scale s and zero point m per group, per channel over
// `group` tokens (KIVI keys) or per token over `group` channels; the stored number is y = c s + m, the product and the
// sum each rounded to float32 as PyTorch's decode rounds them, and where `signs` is given the latent is
// z = fwht(y) * signs over the power-of-two blocks of r (ops/hadamard.py's `unrotate`, the same additions in the same
// order), else z = y. So a tile's latents are what the PyTorch path decodes for the whole store, bit for bit, and the
// products that follow run as they run on those latents. Tokens [0, tokens) of the store are these; the latents
// after them (the stack's held residual) are read as they lie (Keys / Values `latent`, from its token 0).
struct Codes {
  const uint8_t* codes = nullptr;   // [B, Tq, r / 2], unit stride over bytes
  int64_t codes_b = 0, codes_t = 0;  // strides in bytes
  const uint16_t* scale = nullptr;  // bf16; per channel: [B, Tq / group, r], else [B, Tq, r / group]; unit last stride
  const uint16_t* zero = nullptr;   // as scale, at the same strides
  int64_t scale_b = 0, scale_t = 0;  // strides in elements
  int64_t tokens = 0, group = 1;    // Tq (0: no codes) and the group's length
  bool per_channel = false;
  const float* signs = nullptr;     // [r]: the Hadamard rotation's signs, or null (stored unrotated)
};

// Element (t, j) of batch row b's scales or zero points.
inline int64_t group_index(const Codes& c, int64_t b, int64_t t, int64_t j) {
  return b * c.scale_b + (c.per_channel ? (t / c.group) * c.scale_t + j : t * c.scale_t + j / c.group);
}

// Portable: y for tokens [t0, t0 + nq) of row b, rank-major into zt (zt[j * LANES + l]; lanes from nq on 0). Each
// product and sum rounded apart (no fused multiply-add), as PyTorch's `levels * scale + zero`.
__attribute__((optimize("fp-contract=off"))) inline void dequantise(const Codes& c, int64_t rank, int64_t b,
                                                                     int64_t t0, int64_t nq, float* zt, int64_t lanes) {
  for (int64_t j = 0; j < rank; ++j)
    for (int64_t l = 0; l < lanes; ++l) {
      float y = 0.0f;
      if (l < nq) {
        const int64_t t = t0 + l, g = group_index(c, b, t, j);
        const uint8_t byte = c.codes[b * c.codes_b + t * c.codes_t + j / 2];
        const float code = static_cast<float>((byte >> (4 * (j & 1))) & 15);
        const float product = code * bf16_float(c.scale[g]);
        y = product + bf16_float(c.zero[g]);
      }
      zt[j * lanes + l] = y;
    }
}

// z = fwht(y) * signs in place over a rank-major tile (zt[j * lanes + l], lanes independent): per power-of-two block
// of r (largest first, ops/hadamard.py's `power_of_two_blocks`), butterflies h = 1, 2, 4, ... (a + b into a, a - b
// into b), the block divided by the float32 of its size's square root, then each entry times its sign (exact). Two
// stages run per pass over the tile (rows j, j + h, j + 2h, j + 3h: the same additions, half the loads and stores).
inline void unrotate_tile(float* zt, int64_t rank, const float* signs, int64_t lanes) {
  int64_t start = 0;
  for (int bit = 62; bit >= 0; --bit) {
    const int64_t size = int64_t{1} << bit;
    if ((rank & size) == 0) continue;
    int64_t h = 1;
    for (; 4 * h <= size; h *= 4)
      for (int64_t base = start; base < start + size; base += 4 * h)
        for (int64_t j = base; j < base + h; ++j) {
          float* a = zt + j * lanes;
          float* b = a + h * lanes;
          float* c = b + h * lanes;
          float* d = c + h * lanes;
#pragma omp simd
          for (int64_t l = 0; l < lanes; ++l) {
            const float a1 = a[l] + b[l], b1 = a[l] - b[l], c1 = c[l] + d[l], d1 = c[l] - d[l];
            a[l] = a1 + c1, c[l] = a1 - c1, b[l] = b1 + d1, d[l] = b1 - d1;
          }
        }
    if (2 * h <= size)  // an odd number of stages: the last alone
      for (int64_t base = start; base < start + size; base += 2 * h)
        for (int64_t j = base; j < base + h; ++j) {
          float* a = zt + j * lanes;
          float* c = a + h * lanes;
#pragma omp simd
          for (int64_t l = 0; l < lanes; ++l) {
            const float x = a[l], y = c[l];
            a[l] = x + y;
            c[l] = x - y;
          }
        }
    const float root = static_cast<float>(std::sqrt(static_cast<double>(size)));
    if (bit % 2 == 0) {  // a power of 4: the root a power of 2, so x / root * sign = x * (sign / root) exactly
      for (int64_t j = start; j < start + size; ++j) {
        const float factor = signs[j] / root;
        float* a = zt + j * lanes;
#pragma omp simd
        for (int64_t l = 0; l < lanes; ++l) a[l] = a[l] * factor;
      }
    } else {
      for (int64_t j = start; j < start + size; ++j) {
        const float sign = signs[j];
        float* a = zt + j * lanes;
#pragma omp simd
        for (int64_t l = 0; l < lanes; ++l) a[l] = a[l] / root * sign;
      }
    }
    start += size;
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HF_LOWRANK_CODES_VECTOR 1
inline void transpose16(__m512i r[16]);  // defined below, with the latents' gathers

inline __m512 widen_bf16(__m256i halves) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

// AVX-512 `dequantise`: 16 tokens x 16 channels at a time, each token's 8 code bytes split into 16 nibbles, times
// the scales plus the zero points (explicitly rounded products and sums: never fused), transposed into zt. Each
// token's rows are found once per 16 tokens (no division per token and channel block).
inline void dequantise_avx512(const Codes& c, int64_t rank, int64_t b, int64_t t0, int64_t nq, float* zt,
                              int64_t lanes) {
  const __m128i low = _mm_set1_epi8(0x0f);
  constexpr int RN = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const bool whole_groups = !c.per_channel && c.group % 16 == 0;  // one scale per token over 16 channels
  for (int64_t first = 0; first < lanes; first += 16) {
    const int64_t count = std::max<int64_t>(0, std::min<int64_t>(16, nq - first));  // tokens of the codes here
    const uint8_t* codes[16];
    const uint16_t *scales[16], *zeros[16];
    int64_t group = (t0 + first) / c.group, into = (t0 + first) % c.group;  // per channel: the token's group
    for (int64_t i = 0; i < count; ++i) {
      const int64_t t = t0 + first + i;
      const int64_t row = b * c.scale_b + (c.per_channel ? group : t) * c.scale_t;
      codes[i] = c.codes + b * c.codes_b + t * c.codes_t, scales[i] = c.scale + row, zeros[i] = c.zero + row;
      if (++into == c.group) ++group, into = 0;
    }
    for (int64_t j0 = 0; j0 < rank; j0 += 16) {
      const int64_t words = std::min<int64_t>(16, rank - j0);
      const __mmask16 wmask = static_cast<__mmask16>((1u << words) - 1u);
      const __mmask16 bmask = static_cast<__mmask16>((1u << ((words + 1) / 2)) - 1u);
      const int64_t column = c.per_channel ? j0 : j0 / c.group;  // the scales' column (whole groups: of all 16)
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i) {
        if (i >= count) {
          r[i] = _mm512_setzero_si512();
          continue;
        }
        const __m128i bytes = _mm_maskz_loadu_epi8(bmask, codes[i] + j0 / 2);
        const __m128i nibbles = _mm_unpacklo_epi8(_mm_and_si128(bytes, low),
                                                  _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
        const __m512 code = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nibbles));
        __m512 s, m;
        if (c.per_channel) {
          s = widen_bf16(_mm256_maskz_loadu_epi16(wmask, scales[i] + column));
          m = widen_bf16(_mm256_maskz_loadu_epi16(wmask, zeros[i] + column));
        } else if (whole_groups) {
          s = _mm512_set1_ps(bf16_float(scales[i][column])), m = _mm512_set1_ps(bf16_float(zeros[i][column]));
        } else {
          alignas(64) float sv[16] = {}, mv[16] = {};
          for (int64_t w = 0; w < words; ++w)
            sv[w] = bf16_float(scales[i][(j0 + w) / c.group]), mv[w] = bf16_float(zeros[i][(j0 + w) / c.group]);
          s = _mm512_load_ps(sv), m = _mm512_load_ps(mv);
        }
        r[i] = _mm512_castps_si512(_mm512_add_round_ps(_mm512_mul_round_ps(code, s, RN), m, RN));
      }
      transpose16(r);  // r[w]: channel j0 + w of the 16 tokens
      for (int64_t w = 0; w < words; ++w) _mm512_storeu_si512(zt + (j0 + w) * lanes + first, r[w]);
    }
  }
}
#endif

// Latents z of tokens [t0, t0 + nq) of row b from the codes, rank-major into zt [r, lanes] (lanes from nq on 0).
template <bool VECTOR>
void codes_tile(const Codes& c, int64_t rank, int64_t b, int64_t t0, int64_t nq, float* zt, int64_t lanes) {
#if defined(HF_LOWRANK_CODES_VECTOR)
  if (VECTOR && lanes % 16 == 0)
    dequantise_avx512(c, rank, b, t0, nq, zt, lanes);
  else
#endif
    dequantise(c, rank, b, t0, nq, zt, lanes);
  if (c.signs != nullptr) unrotate_tile(zt, rank, c.signs, lanes);
}

struct Keys {
  Codes codes;                   // the store's first codes.tokens tokens, where it holds codes (else none)
  const void* latent = nullptr;  // [B, T - codes.tokens, r] in latent_type, unit stride over r: the tokens after
  at::ScalarType latent_type = at::kFloat;
  int64_t latent_b = 0, latent_t = 0;  // strides in elements
  int64_t tokens = 0, rank = 0;
  const float* basis = nullptr;     // [H, r, D] float32 (bf16 values with `round`): the float32 products' operand
  const uint32_t* pairs = nullptr;  // [H, r2, D] bf16 pairs (rank entries 2j low, 2j + 1 high): VDPBF16PS
  int64_t pair_rank = 0;            // r2 = ceil(r / 2)
  bool round = false;               // latents rounded to bf16 (bf16 products)
  const float* mean = nullptr;      // [H, D]
  const float* cos = nullptr;       // [B, R / 2, T], unit stride over T
  const float* sin = nullptr;
  int64_t trig_b = 0, trig_f = 0;   // strides in elements
  const float* query = nullptr;     // [B, H, M, D] contiguous (scaled)
  int64_t heads = 0, rows = 0, dim = 0, half = 0;
};

inline float latent_at(const Keys& k, int64_t b, int64_t t, int64_t j) {
  return load_float(k.latent, k.latent_type, b * k.latent_b + (t - k.codes.tokens) * k.latent_t + j);
}

// The tile's latents, rank-major: zt[j * LANES + l] = z_{t0 + l}[j] (rounded to bf16 with `round`), 0 past n tokens.
inline void pack_floats(const Keys& k, int64_t b, int64_t t0, int64_t n, float* zt) {
  for (int64_t j = 0; j < k.rank; ++j)
    for (int64_t l = 0; l < LANES; ++l) {
      const float z = l < n ? latent_at(k, b, t0 + l, j) : 0.0f;
      zt[j * LANES + l] = k.round ? bf16_float(bf16_bits(z)) : z;
    }
}

// The tile's latents as bf16 pairs: zp[j * LANES + l] holds z_{t0 + l}[2j] (low half) and [2j + 1] (high half).
inline void pack_pairs(const Keys& k, int64_t b, int64_t t0, int64_t n, uint32_t* zp) {
  for (int64_t j = 0; j < k.pair_rank; ++j)
    for (int64_t l = 0; l < LANES; ++l) {
      const float lo = l < n ? latent_at(k, b, t0 + l, 2 * j) : 0.0f;
      const float hi = l < n && 2 * j + 1 < k.rank ? latent_at(k, b, t0 + l, 2 * j + 1) : 0.0f;
      zp[j * LANES + l] = bf16_bits(lo) | (bf16_bits(hi) << 16);
    }
}

// A float32 tile zt (rank-major, as pack_floats leaves it) as the products read it: with `round` each latent rounded
// to bf16 (what pack_floats does to a latent); zp (if given) its bf16 pairs, as pack_pairs makes them.
template <bool VECTOR>
void round_tile(const Keys& k, float* zt, uint32_t* zp) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (VECTOR && k.round) {  // VCVTNEPS2BF16 rounds to nearest even, as bf16_bits
    auto halves = [](const float* z) { return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(z))); };
    for (int64_t j = 0; j < k.rank; ++j)
      for (int64_t l = 0; l < LANES; l += 16)
        _mm512_storeu_si512(zt + j * LANES + l, _mm512_slli_epi32(halves(zt + j * LANES + l), 16));
    if (zp != nullptr)
      for (int64_t j = 0; j < k.pair_rank; ++j)
        for (int64_t l = 0; l < LANES; l += 16) {
          // zt holds bf16 values now: the high halves are the bf16 bits
          const __m512i lo = _mm512_srli_epi32(_mm512_loadu_si512(zt + 2 * j * LANES + l), 16);
          const __m512i hi = 2 * j + 1 < k.rank
                                 ? _mm512_and_si512(_mm512_loadu_si512(zt + (2 * j + 1) * LANES + l),
                                                    _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u)))
                                 : _mm512_setzero_si512();
          _mm512_storeu_si512(zp + j * LANES + l, _mm512_or_si512(lo, hi));
        }
    return;
  }
#endif
  if (k.round)
#pragma omp simd
    for (int64_t i = 0; i < k.rank * LANES; ++i) zt[i] = bf16_float(bf16_bits(zt[i]));
  if (zp == nullptr) return;
  for (int64_t j = 0; j < k.pair_rank; ++j) {
    const float* lo = zt + 2 * j * LANES;
    const float* hi = 2 * j + 1 < k.rank ? zt + (2 * j + 1) * LANES : nullptr;
#pragma omp simd
    for (int64_t l = 0; l < LANES; ++l)
      zp[j * LANES + l] = bf16_bits(lo[l]) | (hi == nullptr ? 0u : bf16_bits(hi[l]) << 16);
  }
}

// Portable: K frequencies from i0 (both halves) of head h over a tile, added into lg [M, LANES]. cs / sn: the
// tile's cos and sin at frequency f, f * trig apart.
template <int K>
void turned_block(const Keys& k, int64_t h, int64_t i0, const float* zt, const float* cs, const float* sn,
                  int64_t trig, const float* q, float* lg) {
  float a1[K][LANES] = {}, a2[K][LANES] = {};
  const int64_t dim = k.dim, half = k.half;
  for (int64_t j = 0; j < k.rank; ++j) {
    const float* row = k.basis + (h * k.rank + j) * dim;
    const float* z = zt + j * LANES;
    for (int c = 0; c < K; ++c) {
      const float b1 = row[i0 + c], b2 = row[half + i0 + c];
#pragma omp simd
      for (int64_t l = 0; l < LANES; ++l) {
        a1[c][l] += b1 * z[l];
        a2[c][l] += b2 * z[l];
      }
    }
  }
  const float* mu = k.mean + h * dim;
  for (int c = 0; c < K; ++c) {
    const int64_t f = i0 + c;
    const float* co = cs + f * trig;
    const float* si = sn + f * trig;
    float t1[LANES], t2[LANES];
#pragma omp simd
    for (int64_t l = 0; l < LANES; ++l) {
      const float k1 = a1[c][l] + mu[f], k2 = a2[c][l] + mu[half + f];
      t1[l] = k1 * co[l] - k2 * si[l];
      t2[l] = k2 * co[l] + k1 * si[l];
    }
    for (int64_t m = 0; m < k.rows; ++m) {
      const float q1 = q[m * dim + f], q2 = q[m * dim + half + f];
#pragma omp simd
      for (int64_t l = 0; l < LANES; ++l) lg[m * LANES + l] += q1 * t1[l] + q2 * t2[l];
    }
  }
}

// Portable: channel d of head h past the rotated ones, as it is.
inline void plain_channel(const Keys& k, int64_t h, int64_t d, const float* zt, const float* q, float* lg) {
  float a[LANES] = {};
  for (int64_t j = 0; j < k.rank; ++j) {
    const float b = k.basis[(h * k.rank + j) * k.dim + d];
#pragma omp simd
    for (int64_t l = 0; l < LANES; ++l) a[l] += b * zt[j * LANES + l];
  }
  const float mu = k.mean[h * k.dim + d];
  for (int64_t m = 0; m < k.rows; ++m) {
    const float qd = q[m * k.dim + d];
#pragma omp simd
    for (int64_t l = 0; l < LANES; ++l) lg[m * LANES + l] += qd * (a[l] + mu);
  }
}

#if defined(__AVX512F__)
// AVX-512: as turned_block, the accumulators in registers; PAIRS: bf16 pairs by VDPBF16PS (zp), else float32 FMAs
// (zt).
template <int K, bool PAIRS>
void turned_block_avx512(const Keys& k, int64_t h, int64_t i0, const void* tile, const float* cs, const float* sn,
                         int64_t trig, const float* q, float* lg) {
  __m512 a1[K][VECS], a2[K][VECS];
  for (int c = 0; c < K; ++c)
    for (int v = 0; v < VECS; ++v) a1[c][v] = a2[c][v] = _mm512_setzero_ps();
  const int64_t dim = k.dim, half = k.half;
  if constexpr (PAIRS) {
#if defined(__AVX512BF16__)
    const uint32_t* zp = static_cast<const uint32_t*>(tile);
    for (int64_t j = 0; j < k.pair_rank; ++j) {
      const int32_t* row = reinterpret_cast<const int32_t*>(k.pairs + (h * k.pair_rank + j) * dim);
      __m512bh z[VECS];
      for (int v = 0; v < VECS; ++v) z[v] = (__m512bh)_mm512_loadu_si512(zp + j * LANES + 16 * v);
      for (int c = 0; c < K; ++c) {
        const __m512bh b1 = (__m512bh)_mm512_set1_epi32(row[i0 + c]);
        const __m512bh b2 = (__m512bh)_mm512_set1_epi32(row[half + i0 + c]);
        for (int v = 0; v < VECS; ++v) {
          a1[c][v] = _mm512_dpbf16_ps(a1[c][v], b1, z[v]);
          a2[c][v] = _mm512_dpbf16_ps(a2[c][v], b2, z[v]);
        }
      }
    }
#endif
  } else {
    const float* zt = static_cast<const float*>(tile);
    for (int64_t j = 0; j < k.rank; ++j) {
      const float* row = k.basis + (h * k.rank + j) * dim;
      __m512 z[VECS];
      for (int v = 0; v < VECS; ++v) z[v] = _mm512_loadu_ps(zt + j * LANES + 16 * v);
      for (int c = 0; c < K; ++c) {
        const __m512 b1 = _mm512_set1_ps(row[i0 + c]), b2 = _mm512_set1_ps(row[half + i0 + c]);
        for (int v = 0; v < VECS; ++v) {
          a1[c][v] = _mm512_fmadd_ps(b1, z[v], a1[c][v]);
          a2[c][v] = _mm512_fmadd_ps(b2, z[v], a2[c][v]);
        }
      }
    }
  }
  const float* mu = k.mean + h * dim;
  for (int c = 0; c < K; ++c) {
    const int64_t f = i0 + c;
    const __m512 m1 = _mm512_set1_ps(mu[f]), m2 = _mm512_set1_ps(mu[half + f]);
    for (int v = 0; v < VECS; ++v) {
      const __m512 co = _mm512_loadu_ps(cs + f * trig + 16 * v), si = _mm512_loadu_ps(sn + f * trig + 16 * v);
      const __m512 k1 = _mm512_add_ps(a1[c][v], m1), k2 = _mm512_add_ps(a2[c][v], m2);
      a1[c][v] = _mm512_fmsub_ps(k1, co, _mm512_mul_ps(k2, si));
      a2[c][v] = _mm512_fmadd_ps(k1, si, _mm512_mul_ps(k2, co));
    }
  }
  for (int64_t m = 0; m < k.rows; ++m) {
    const float* qm = q + m * dim;
    for (int v = 0; v < VECS; ++v) {
      __m512 acc = _mm512_loadu_ps(lg + m * LANES + 16 * v);
      for (int c = 0; c < K; ++c) {
        acc = _mm512_fmadd_ps(_mm512_set1_ps(qm[i0 + c]), a1[c][v], acc);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(qm[half + i0 + c]), a2[c][v], acc);
      }
      _mm512_storeu_ps(lg + m * LANES + 16 * v, acc);
    }
  }
}
#endif

#if defined(__AVX512F__)
// r[i] (row i of a 16 x 16 matrix of 32-bit words) becomes column i: within each 128-bit lane the rows' words are
// interleaved by pairs of rows, then of row pairs (r[4g + e] holds, in lane L, word 4L + e of rows 4g .. 4g + 3), and
// the lanes of those four groups are then gathered into one vector per word.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i x0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44), x1 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xee);
    const __m512i y0 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xee);
    t[e] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    t[4 + e] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
    t[8 + e] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    t[12 + e] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// The tile's latents gathered, LANES tokens per rank entry (pack_floats / pack_pairs for float32 and bfloat16 latents
// in whole tiles; a scalar loop per element costs about what the tile's products do). False: not read here.
inline bool pack_avx512(const Keys& k, int64_t b, int64_t t0, int64_t n, float* zt, uint32_t* zp) {
  if (n < LANES || (k.latent_type != at::kFloat && k.latent_type != at::kBFloat16)) return false;
  if (k.latent_type == at::kBFloat16 && (k.rank % 2 != 0 || k.latent_t % 2 != 0 || k.latent_b % 2 != 0)) return false;
#if !defined(__AVX512BF16__)
  if (k.round && k.latent_type == at::kFloat) return false;
#endif
  const __m512i tokens = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(static_cast<int32_t>(k.latent_t)));
  for (int v = 0; v < VECS; ++v) {
    const int64_t start = b * k.latent_b + (t0 - k.codes.tokens + 16 * v) * k.latent_t;
    if (k.latent_type == at::kFloat) {
      const float* base = static_cast<const float*>(k.latent) + start;
      auto gather = [&](int64_t j) { return _mm512_i32gather_ps(tokens, base + j, 4); };
      if (zt != nullptr)
        for (int64_t j = 0; j < k.rank; ++j) {
          __m512 z = gather(j);
#if defined(__AVX512BF16__)
          if (k.round)
            z = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(z)), 16));
#endif
          _mm512_storeu_ps(zt + j * LANES + 16 * v, z);
        }
#if defined(__AVX512BF16__)
      if (zp != nullptr)
        for (int64_t j = 0; j < k.pair_rank; ++j) {
          const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(gather(2 * j)));
          const __m512i hi = 2 * j + 1 < k.rank
                                 ? _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(gather(2 * j + 1)))
                                 : _mm512_setzero_si512();
          _mm512_storeu_si512(zp + j * LANES + 16 * v, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
#endif
      continue;
    }
    // bfloat16 latents: 32-bit words of two rank entries (2j at the lower address), 16 tokens' rows of 16 words
    // loaded as they lie and transposed in registers (`transpose16`): one vector gather per word cost several times
    // that (docs/speed.md, "Low rank's float32 decode at 4k", session 32).
    const int32_t* base = reinterpret_cast<const int32_t*>(static_cast<const uint16_t*>(k.latent) + start);
    const int64_t row_words = k.latent_t / 2;
    for (int64_t j0 = 0; j0 < k.pair_rank; j0 += 16) {
      const int64_t words = std::min<int64_t>(16, k.pair_rank - j0);
      const __mmask16 mask = static_cast<__mmask16>((1u << words) - 1u);
      __m512i pair[16];
      for (int i = 0; i < 16; ++i) pair[i] = _mm512_maskz_loadu_epi32(mask, base + i * row_words + j0);
      transpose16(pair);  // pair[w]: word j0 + w of the 16 tokens
      for (int64_t w = 0; w < words; ++w) {
        const int64_t j = j0 + w;
        if (zp != nullptr) _mm512_storeu_si512(zp + j * LANES + 16 * v, pair[w]);
        if (zt != nullptr) {
          _mm512_storeu_ps(zt + 2 * j * LANES + 16 * v, _mm512_castsi512_ps(_mm512_slli_epi32(pair[w], 16)));
          _mm512_storeu_ps(zt + (2 * j + 1) * LANES + 16 * v,
                           _mm512_castsi512_ps(_mm512_and_si512(pair[w], _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u)))));
        }
      }
    }
  }
  return true;
}
#endif

// Whether this build rebuilds with VDPBF16PS (the kernel then wants the basis as bf16 pairs for bf16 products).
constexpr bool native_pairs() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// The frequencies of head h from i0 on, FREQS at a time (the last block narrower), added into lg.
template <bool VECTOR, bool PAIRS>
void turned_head(const Keys& k, int64_t h, const void* tile, const float* cs, const float* sn, int64_t trig,
                 const float* q, float* lg) {
  int64_t i0 = 0;
  for (; i0 + FREQS <= k.half; i0 += FREQS) {
#if defined(__AVX512F__)
    if constexpr (VECTOR) {
      turned_block_avx512<FREQS, PAIRS>(k, h, i0, tile, cs, sn, trig, q, lg);
      continue;
    }
#endif
    turned_block<FREQS>(k, h, i0, static_cast<const float*>(tile), cs, sn, trig, q, lg);
  }
  for (; i0 < k.half; ++i0) {
#if defined(__AVX512F__)
    if constexpr (VECTOR) {
      turned_block_avx512<1, PAIRS>(k, h, i0, tile, cs, sn, trig, q, lg);
      continue;
    }
#endif
    turned_block<1>(k, h, i0, static_cast<const float*>(tile), cs, sn, trig, q, lg);
  }
}

// A tile's working buffers, one set per thread.
struct Buffers {
  std::vector<float> zt;          // float32 latents, rank-major (also the plain channels' tile)
  std::vector<uint32_t> zp;       // bf16 pairs, rank-major
  std::vector<float> trig_tile;   // a last, partial tile's cos and sin
  Buffers(const Keys& k, bool pairs)
      : zt(static_cast<size_t>(k.rank * LANES)), zp(pairs ? static_cast<size_t>(k.pair_rank * LANES) : 0),
        trig_tile(static_cast<size_t>(2 * k.half * LANES)) {}
};

// Ask for `bytes` from `first` (the next tile's latents: a layer's store outgrows the caches between steps, and
// asked for now they arrive while this tile's products run, instead of stalling its gathers line by line).
inline void prefetch(const void* first, int64_t bytes) {
#if defined(__AVX512F__)
  for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(static_cast<const char*>(first) + offset, _MM_HINT_T0);
#else
  (void)first, (void)bytes;
#endif
}

// The bytes of rows [t0, t0 + n) of batch row b of a [B, T, r] latent with strides (latent_b, latent_t).
inline void prefetch_rows(const void* latent, at::ScalarType type, int64_t latent_b, int64_t latent_t, int64_t b,
                          int64_t t0, int64_t n) {
  const int64_t width = static_cast<int64_t>(c10::elementSize(type));
  prefetch(static_cast<const char*>(latent) + (b * latent_b + t0 * latent_t) * width, n * latent_t * width);
}

// Tokens [t0, t0 + n) of batch row b of a kind's latents: the codes' bytes, scales and zero points for those in
// the codes, the held latents' rows for those after.
inline void prefetch_latents(const Codes& c, int64_t rank, const void* latent, at::ScalarType type, int64_t latent_b,
                             int64_t latent_t, int64_t b, int64_t t0, int64_t n) {
  const int64_t nq = std::max<int64_t>(0, std::min(n, c.tokens - t0));
  if (nq > 0) {
    prefetch(c.codes + b * c.codes_b + t0 * c.codes_t, nq * c.codes_t);
    const int64_t first = group_index(c, b, t0, 0), last = group_index(c, b, t0 + nq - 1, rank - 1);
    prefetch(c.scale + first, (last - first + 1) * 2);
    prefetch(c.zero + first, (last - first + 1) * 2);
  }
  if (nq < n) prefetch_rows(latent, type, latent_b, latent_t, b, t0 + nq - c.tokens, n - nq);
}

// Rows [t0, t0 + n) of batch row b of the turn tables: R / 2 rows of each, T apart, so a tile reads R streams of
// LANES values (64 at SmolLM2's 32 frequencies), more than a hardware prefetcher follows; whole lines, from the line
// that holds the first value to the one that holds the last.
inline void prefetch_turns(const Keys& k, int64_t b, int64_t t0, int64_t n) {
#if defined(__AVX512F__) && HF_LOWRANK_PREFETCH_TURNS
  for (const float* table : {k.cos, k.sin})
    for (int64_t f = 0; f < k.half; ++f) {
      const uintptr_t first = reinterpret_cast<uintptr_t>(table + b * k.trig_b + f * k.trig_f + t0);
      const uintptr_t last = first + static_cast<uintptr_t>(n) * sizeof(float) - 1;
      for (uintptr_t line = first & ~uintptr_t{63}; line <= last; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
    }
#else
  (void)k, (void)b, (void)t0, (void)n;
#endif
}

// Every head's logits of the tile of row b from t0: lg [H, M, LANES] (lanes past the store's end hold garbage).
template <bool VECTOR, bool PAIRS>
void tile_logits(const Keys& k, int64_t b, int64_t t0, Buffers& buf, float* lg) {
  const int64_t n = std::min(LANES, k.tokens - t0);
  const bool plain_channels = 2 * k.half < k.dim;
  bool packed = false;
  if (t0 < k.codes.tokens) {  // the codes, and the held latents after them where the tile crosses into those
    const int64_t nq = std::min(n, k.codes.tokens - t0);
    codes_tile<VECTOR>(k.codes, k.rank, b, t0, nq, buf.zt.data(), LANES);
    for (int64_t j = 0; j < k.rank; ++j)
      for (int64_t l = nq; l < n; ++l) buf.zt[j * LANES + l] = latent_at(k, b, t0 + l, j);
    round_tile<VECTOR>(k, buf.zt.data(), PAIRS ? buf.zp.data() : nullptr);
    packed = true;
  }
#if defined(__AVX512F__)
  if constexpr (VECTOR)
    if (!packed)
      packed = pack_avx512(k, b, t0, n, !PAIRS || plain_channels ? buf.zt.data() : nullptr,
                           PAIRS ? buf.zp.data() : nullptr);
#endif
  if (!packed) {
    if (!PAIRS || plain_channels) pack_floats(k, b, t0, n, buf.zt.data());
    if (PAIRS) pack_pairs(k, b, t0, n, buf.zp.data());
  }
  const float* cs = k.cos + b * k.trig_b + t0;
  const float* sn = k.sin + b * k.trig_b + t0;
  int64_t trig = k.trig_f;
  if (n < LANES) {  // reads stay inside the tables: the tile's columns copied, the rest 0
    std::fill(buf.trig_tile.begin(), buf.trig_tile.end(), 0.0f);
    for (int64_t f = 0; f < k.half; ++f)
      for (int64_t l = 0; l < n; ++l) {
        buf.trig_tile[f * LANES + l] = cs[f * k.trig_f + l];
        buf.trig_tile[(k.half + f) * LANES + l] = sn[f * k.trig_f + l];
      }
    cs = buf.trig_tile.data(), sn = buf.trig_tile.data() + k.half * LANES, trig = LANES;
  }
  const void* tile = PAIRS ? static_cast<const void*>(buf.zp.data()) : static_cast<const void*>(buf.zt.data());
  std::fill(lg, lg + k.heads * k.rows * LANES, 0.0f);
  for (int64_t h = 0; h < k.heads; ++h) {
    const float* q = k.query + (b * k.heads + h) * k.rows * k.dim;
    float* out = lg + h * k.rows * LANES;
    turned_head<VECTOR, PAIRS>(k, h, tile, cs, sn, trig, q, out);
    for (int64_t d = 2 * k.half; d < k.dim; ++d) plain_channel(k, h, d, buf.zt.data(), q, out);
  }
}

// What the store segment's softmax reads besides the keys: the value latents (shared by the layer's heads, as the
// keys' are), the additive mask and the slots attended elsewhere (the exact sinks).
struct Values {
  Codes codes;                   // the store's first codes.tokens tokens, where it holds codes (else none)
  const void* latent = nullptr;  // [B, T - codes.tokens, rv], unit stride over rv: the tokens after
  at::ScalarType type = at::kFloat;
  int64_t latent_b = 0, latent_t = 0, rank = 0;
  const float* bias = nullptr;  // [B or 1, H or 1, Q, T]: row m of a head's M reads bias row m % Q
  int64_t bias_b = 0, bias_h = 0, bias_q = 0, bias_rows = 1;
  const int64_t* hidden = nullptr;  // [B, H, S] slots of the store left out (outside [0, T): none)
  int64_t sinks = 0;
};

// Rows [row, row + R) and columns [c, c + W) of the accumulator: acc[r, i] += sum over the tile's n tokens of
// p[r, l] * z[l, i], R x W running sums held in registers across the tokens. Each token's latent row is loaded once
// for the R rows, and the R x W / 16 vectors of sums are independent chains of FMAs: one row's single chain waits on
// each FMA's latency (4 cycles) per token, R x W / 16 of them keep the FMA units busy. Each sum still runs over the
// tokens in order, so the result does not depend on R or W.
template <int R, int W>
inline void mix_block(const float* p, const float* z, int64_t stride, int64_t n, int64_t row, int64_t c,
                      int64_t rank, float* acc) {
  float part[R][W];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < W; ++i) part[r][i] = acc[(row + r) * rank + c + i];
  for (int64_t l = 0; l < n; ++l) {
    const float* zl = z + l * stride + c;
    for (int r = 0; r < R; ++r) {
      const float w = p[(row + r) * LANES + l];
#pragma omp simd
      for (int i = 0; i < W; ++i) part[r][i] += w * zl[i];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < W; ++i) acc[(row + r) * rank + c + i] = part[r][i];
}

// Rows [row, row + R) of the accumulator over every column: MIX_WIDTH columns at a time, then 16, 8 and 1.
template <int R>
inline void mix_row_block(const float* p, const float* z, int64_t stride, int64_t n, int64_t row, int64_t rank,
                          float* acc) {
  int64_t c = 0;
  for (; c + MIX_WIDTH <= rank; c += MIX_WIDTH) mix_block<R, MIX_WIDTH>(p, z, stride, n, row, c, rank, acc);
  for (; c + 16 <= rank; c += 16) mix_block<R, 16>(p, z, stride, n, row, c, rank, acc);
  for (; c + 8 <= rank; c += 8) mix_block<R, 8>(p, z, stride, n, row, c, rank, acc);
  for (; c < rank; ++c) mix_block<R, 1>(p, z, stride, n, row, c, rank, acc);
}

// acc[row, :] += sum over the tile's n tokens of p[row, l] * z[l, :] (z's rows `stride` apart), MIX_ROWS rows at a
// time (SmolLM2's 3 KV heads x 3 query rows: three blocks of 3), the rest 2 and 1 at a time.
inline void mix_rows(const float* p, const float* z, int64_t stride, int64_t n, int64_t rows, int64_t rank,
                     float* acc) {
  int64_t row = 0;
  for (; row + MIX_ROWS <= rows; row += MIX_ROWS) mix_row_block<MIX_ROWS>(p, z, stride, n, row, rank, acc);
  for (; row + 2 <= rows; row += 2) mix_row_block<2>(p, z, stride, n, row, rank, acc);
  for (; row < rows; ++row) mix_row_block<1>(p, z, stride, n, row, rank, acc);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HF_LOWRANK_MIX_VECTOR 1
// 16 entries of a value latent's row from `z` as float32 (lanes past `mask` 0): float32 as they are, bf16 widened
// (a bf16 is the high half of a float32), so a bf16 store is mixed without a float32 copy of its tile.
inline __m512 load16(const float* z, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, z); }
inline __m512 load16(const uint16_t* z, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, z)), 16));
}

// AVX-512 `mix_block`: rows [row, row + R) and columns [c, c + 16 V) (the last vector's lanes past `last` left
// alone), R x V sums in registers across the tile's n tokens, each token's row of latents loaded (and widened) once
// for the R rows. Each sum runs over the tokens in order, one FMA per token, as `mix_block`'s.
template <int R, int V, typename T>
inline void mix_block_avx512(const float* p, const T* z, int64_t stride, int64_t n, int64_t row, int64_t c,
                             int64_t rank, __mmask16 last, float* acc) {
  __m512 part[R][V];
#pragma GCC unroll 9
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v)
      part[r][v] = _mm512_maskz_loadu_ps(v == V - 1 ? last : 0xffff, acc + (row + r) * rank + c + 16 * v);
  for (int64_t l = 0; l < n; ++l) {
    const T* zl = z + l * stride + c;
    __m512 zv[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) zv[v] = load16(zl + 16 * v, v == V - 1 ? last : 0xffff);
#pragma GCC unroll 9  // whole: the sums stay in registers (a loop over r would keep them in memory)
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(p[(row + r) * LANES + l]);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) part[r][v] = _mm512_fmadd_ps(w, zv[v], part[r][v]);
    }
  }
#pragma GCC unroll 9
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v)
      _mm512_mask_storeu_ps(acc + (row + r) * rank + c + 16 * v, v == V - 1 ? last : 0xffff, part[r][v]);
}

// Rows [row, row + R) over every column: 32 at a time, then 16, then the rest under a mask.
template <int R, typename T>
inline void mix_row_block_avx512(const float* p, const T* z, int64_t stride, int64_t n, int64_t row, int64_t rank,
                                 float* acc) {
  int64_t c = 0;
  for (; c + 32 <= rank; c += 32) mix_block_avx512<R, 2>(p, z, stride, n, row, c, rank, 0xffff, acc);
  for (; c + 16 <= rank; c += 16) mix_block_avx512<R, 1>(p, z, stride, n, row, c, rank, 0xffff, acc);
  if (c < rank)
    mix_block_avx512<R, 1>(p, z, stride, n, row, c, rank, static_cast<__mmask16>((1u << (rank - c)) - 1u), acc);
}

// `mix_rows` from float32 or bf16 latents as stored (z's rows `stride` apart): up to 9 rows per block (SmolLM2's 3 KV
// heads x 3 query rows in one: 18 sums, 2 latent vectors and a weight in registers), so each token's latents are
// read and widened once per block.
template <typename T>
inline void mix_rows_avx512(const float* p, const T* z, int64_t stride, int64_t n, int64_t rows, int64_t rank,
                            float* acc) {
  int64_t row = 0;
  for (; row + 9 <= rows; row += 9) mix_row_block_avx512<9>(p, z, stride, n, row, rank, acc);
  for (; row + 4 <= rows; row += 4) mix_row_block_avx512<4>(p, z, stride, n, row, rank, acc);
  for (; row + 2 <= rows; row += 2) mix_row_block_avx512<2>(p, z, stride, n, row, rank, acc);
  for (; row < rows; ++row) mix_row_block_avx512<1>(p, z, stride, n, row, rank, acc);
}
#endif

// Tokens [0, n) of a rank-major tile zr [r, LANES] as rows z [n, r] (what the value mix reads).
inline void token_major(const float* zr, int64_t rank, int64_t n, float* z) {
#if defined(HF_LOWRANK_CODES_VECTOR)
  for (int64_t first = 0; first < n; first += 16)
    for (int64_t j0 = 0; j0 < rank; j0 += 16) {
      const int64_t words = std::min<int64_t>(16, rank - j0);
      const __mmask16 wmask = static_cast<__mmask16>((1u << words) - 1u);
      __m512i r[16];
      for (int64_t w = 0; w < 16; ++w)
        r[w] = w < words ? _mm512_loadu_si512(zr + (j0 + w) * LANES + first) : _mm512_setzero_si512();
      transpose16(r);  // r[i]: token first + i's channels j0 ..
      for (int64_t i = 0; i < 16 && first + i < n; ++i)
        _mm512_mask_storeu_epi32(z + (first + i) * rank + j0, wmask, r[i]);
    }
#else
  for (int64_t l = 0; l < n; ++l)
    for (int64_t j = 0; j < rank; ++j) z[l * rank + j] = zr[j * LANES + l];
#endif
}

// Tiles [tile_begin, tile_end) of row b folded into one online softmax per (head, query row): running max mx [R],
// sum sm [R] and value-latent mix acc [R, rv] (R = H * M), relative to mx, as caches/store_attention.py's
// _OnlineSoftmax folds a block (masked logits weigh nothing; a row masked so far keeps max -inf and zeros).
template <bool VECTOR, bool PAIRS>
void fold_tiles(const Keys& k, const Values& v, int64_t b, int64_t tile_begin, int64_t tile_end, float* mx,
                float* sm, float* acc) {
  const int64_t rows = k.heads * k.rows, rank = v.rank;
  std::fill(mx, mx + rows, NEG_INF);
  std::fill(sm, sm + rows, 0.0f);
  std::fill(acc, acc + rows * rank, 0.0f);
  Buffers buf(k, PAIRS);
  std::vector<float> lg(static_cast<size_t>(rows * LANES)), zv(static_cast<size_t>(LANES * rank));
  std::vector<float> zr(v.codes.tokens > 0 ? static_cast<size_t>(LANES * rank) : 0);  // codes' rank-major tile
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const int64_t t0 = tile * LANES, n = std::min(LANES, k.tokens - t0);
    if (VECTOR && tile + 1 < tile_end) {
      const int64_t nt = t0 + LANES, nn = std::min(LANES, k.tokens - nt);
      prefetch_latents(k.codes, k.rank, k.latent, k.latent_type, k.latent_b, k.latent_t, b, nt, nn);
      prefetch_latents(v.codes, v.rank, v.latent, v.type, v.latent_b, v.latent_t, b, nt, nn);
      prefetch_turns(k, b, nt, nn);
    }
    tile_logits<VECTOR, PAIRS>(k, b, t0, buf, lg.data());
    for (int64_t h = 0; h < k.heads; ++h)
      for (int64_t m = 0; m < k.rows; ++m) {
        float* l = lg.data() + (h * k.rows + m) * LANES;
        if (v.bias != nullptr) {
          const float* bias = v.bias + b * v.bias_b + h * v.bias_h + (m % v.bias_rows) * v.bias_q + t0;
          for (int64_t t = 0; t < n; ++t) l[t] += bias[t];
        }
        for (int64_t t = n; t < LANES; ++t) l[t] = NEG_INF;
      }
    for (int64_t h = 0; h < k.heads && v.hidden != nullptr; ++h)
      for (int64_t s = 0; s < v.sinks; ++s) {
        const int64_t slot = v.hidden[(b * k.heads + h) * v.sinks + s];
        if (slot >= t0 && slot < t0 + n)
          for (int64_t m = 0; m < k.rows; ++m) lg[(h * k.rows + m) * LANES + slot - t0] = NEG_INF;
      }
    for (int64_t row = 0; row < rows; ++row) {
      float* l = lg.data() + row * LANES;
      float top = NEG_INF;
      for (int64_t t = 0; t < LANES; ++t) top = std::max(top, l[t]);
      const float best = std::max(mx[row], top);
      if (best == NEG_INF) {  // nothing seen yet: weights 0
        std::fill(l, l + LANES, 0.0f);
        continue;
      }
      if (mx[row] != best) {
        const float scale = exp_nonpositive(mx[row] - best);  // 0 from -inf
        sm[row] *= scale;
        for (int64_t c = 0; c < rank; ++c) acc[row * rank + c] *= scale;
        mx[row] = best;
      }
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (int64_t t = 0; t < LANES; ++t) {
        l[t] = exp_nonpositive(l[t] - best);
        total += l[t];
      }
      sm[row] += total;
    }
    // The tile's value latents as float32 rows: the store's own for float32 latents; others converted, in one pass
    // where the tile's rows lie side by side (a store's room: rows `rank` apart), else a row at a time (a row's
    // remainder past whole vectors runs scalar, 13 of SmolLM2's 77 per row: a tile in one pass has none).
#if defined(HF_LOWRANK_MIX_VECTOR)
    if (VECTOR && t0 >= v.codes.tokens && (v.type == at::kFloat || v.type == at::kBFloat16)) {  // as stored, widened
      const int64_t start = b * v.latent_b + (t0 - v.codes.tokens) * v.latent_t;
      if (v.type == at::kFloat)
        mix_rows_avx512(lg.data(), static_cast<const float*>(v.latent) + start, v.latent_t, n, rows, rank, acc);
      else
        mix_rows_avx512(lg.data(), static_cast<const uint16_t*>(v.latent) + start, v.latent_t, n, rows, rank, acc);
      continue;
    }
#endif
    const float* z = nullptr;
    int64_t stride = rank;
    if (t0 < v.codes.tokens) {  // the codes as float32 rows (and the held latents after them, where the tile crosses)
      const int64_t nq = std::min(n, v.codes.tokens - t0);
      codes_tile<VECTOR>(v.codes, rank, b, t0, nq, zr.data(), LANES);
      token_major(zr.data(), rank, nq, zv.data());
      for (int64_t t = nq; t < n; ++t)
        load_floats(v.latent, v.type, b * v.latent_b + (t0 + t - v.codes.tokens) * v.latent_t, rank,
                    zv.data() + t * rank);
#if defined(HF_LOWRANK_MIX_VECTOR)
      if (VECTOR) {  // as the float32 latents of a store without codes are mixed
        mix_rows_avx512(lg.data(), zv.data(), rank, n, rows, rank, acc);
        continue;
      }
#endif
      mix_rows(lg.data(), zv.data(), rank, n, rows, rank, acc);
      continue;
    }
    if (v.type == at::kFloat) {
      z = static_cast<const float*>(v.latent) + b * v.latent_b + (t0 - v.codes.tokens) * v.latent_t;
      stride = v.latent_t;
    } else if (v.latent_t == rank) {
      load_floats(v.latent, v.type, b * v.latent_b + (t0 - v.codes.tokens) * rank, n * rank, zv.data());
      z = zv.data();
    } else {
      for (int64_t t = 0; t < n; ++t)
        load_floats(v.latent, v.type, b * v.latent_b + (t0 - v.codes.tokens + t) * v.latent_t, rank,
                    zv.data() + t * rank);
      z = zv.data();
    }
    mix_rows(lg.data(), z, stride, n, rows, rank, acc);
  }
}

// The rest of a layer's decode softmax beside its store (cpu_decode.cpp's `lowrank_decode_attention`): the exact sinks
// at the store slots `Values::hidden` names (a slot outside [0, T): none, or one still in the tail; a sink reads bias
// column `slot`) and the full-precision tail after the store (bias columns [T, T + Tt)), both in the model's basis and
// met by the same query rows, and the value basis and mean that map the store's latent mix to values.
struct Exact {
  const void *sink_keys = nullptr, *sink_values = nullptr;  // [B, H, S, D] / [B, H, S, Dv], contiguous
  const void *tail_keys = nullptr, *tail_values = nullptr;  // [B, H, Tt, D] / [B, H, Tt, Dv], contiguous
  at::ScalarType type = at::kFloat;
  int64_t tail = 0, value_dim = 0;
  const float* value_basis = nullptr;  // [H, Dv, rv]
  const float* value_mean = nullptr;   // [H, Dv]
};

// Head h of batch row b: the store's partials for its M query rows (max mx [M], sum sm [M], value-latent mix acc
// [M, rv], the sum and the mix relative to the max) joined by the exact segment in the same softmax (as
// caches/store_attention.py's segments), the mix mapped to values (basis times mix plus mean times the store's
// weight, codecs/lowrank.py's `from_basis`) and the whole divided by the softmax's sum: out [M, Dv]. A row masked
// throughout gives zeros.
inline void finish_head(const Keys& k, const Values& v, const Exact& e, int64_t b, int64_t h, const float* mx,
                        const float* sm, const float* acc, float* out) {
  const int64_t rows = k.rows, dim = k.dim, vdim = e.value_dim, rank = v.rank, sinks = v.sinks;
  const int64_t n = sinks + e.tail, head = b * k.heads + h;
  std::vector<float> lg(static_cast<size_t>(rows * n)), state(static_cast<size_t>(std::max(dim, vdim)));
  std::vector<float> totals(static_cast<size_t>(rows), 1.0f);  // each row's softmax sum (1 where masked throughout)
  const float* q = k.query + head * rows * dim;
  auto bias_at = [&](int64_t m, int64_t column) {
    return v.bias == nullptr ? 0.0f : v.bias[b * v.bias_b + h * v.bias_h + (m % v.bias_rows) * v.bias_q + column];
  };
  for (int64_t s = 0; s < n; ++s) {  // keys outer: each is converted once and met by every query row
    const bool sink = s < sinks;
    const int64_t slot = sink ? v.hidden[head * sinks + s] : k.tokens + s - sinks;  // its bias column
    if (sink && (slot < 0 || slot >= k.tokens)) {
      for (int64_t m = 0; m < rows; ++m) lg[m * n + s] = NEG_INF;
      continue;
    }
    const int64_t index = sink ? s : s - sinks, length = sink ? sinks : e.tail;
    load_floats(sink ? e.sink_keys : e.tail_keys, e.type, (head * length + index) * dim, dim, state.data());
    for (int64_t m = 0; m < rows; ++m) {
      float logit = 0.0f;
#pragma omp simd reduction(+ : logit)
      for (int64_t d = 0; d < dim; ++d) logit += q[m * dim + d] * state[d];
      lg[m * n + s] = logit + bias_at(m, slot);
    }
  }
  for (int64_t m = 0; m < rows; ++m) {
    float* o = out + m * vdim;
    float* p = lg.data() + m * n;
    float best = mx[m];
    for (int64_t s = 0; s < n; ++s) best = std::max(best, p[s]);
    if (best == NEG_INF) {  // every logit masked: zeros (the PyTorch path divides 0 by its sum clamped above 0)
      std::fill(o, o + vdim, 0.0f);
      std::fill(p, p + n, 0.0f);
      continue;
    }
    const float scale = exp_nonpositive(mx[m] - best);  // 0 for a store masked throughout
    float total = sm[m] * scale;
    for (int64_t s = 0; s < n; ++s) {
      p[s] = exp_nonpositive(p[s] - best);
      total += p[s];
    }
    totals[m] = total;  // >= 1: the largest logit weighs exp(0)
    const float* a = acc + m * rank;
    for (int64_t c = 0; c < vdim; ++c) {
      const float* basis = e.value_basis + (h * vdim + c) * rank;
      float mixed = 0.0f;
#pragma omp simd reduction(+ : mixed)
      for (int64_t j = 0; j < rank; ++j) mixed += basis[j] * a[j];
      o[c] = scale * (mixed + e.value_mean[h * vdim + c] * sm[m]);
    }
  }
  for (int64_t s = 0; s < n; ++s) {
    bool any = false;
    for (int64_t m = 0; m < rows; ++m) any = any || lg[m * n + s] != 0.0f;
    if (!any) continue;  // masked (or underflowed) for every query row
    const bool sink = s < sinks;
    const int64_t index = sink ? s : s - sinks, length = sink ? sinks : e.tail;
    load_floats(sink ? e.sink_values : e.tail_values, e.type, (head * length + index) * vdim, vdim, state.data());
    for (int64_t m = 0; m < rows; ++m) {
      const float w = lg[m * n + s];
      float* o = out + m * vdim;
#pragma omp simd
      for (int64_t c = 0; c < vdim; ++c) o[c] += w * state[c];
    }
  }
  for (int64_t m = 0; m < rows; ++m) {
    const float inverse = 1.0f / totals[m];
    float* o = out + m * vdim;
#pragma omp simd
    for (int64_t c = 0; c < vdim; ++c) o[c] *= inverse;
  }
}

// x [2 * half] in place: rotate-half RoPE by the turn whose cos and sin [half] are given. Each product is rounded
// before the sum, as PyTorch's elementwise `turn` (ops/rerotate.py) rounds it: no fused multiply-add here.
__attribute__((optimize("fp-contract=off"))) inline void turn_in_place(float* x, const float* cs, const float* sn,
                                                                        int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    const float a = x1 * cs[i], b = x2 * sn[i], c = x2 * cs[i], d = x1 * sn[i];
    x[i] = a - b;  // x1 cos + (-x2) sin
    x[half + i] = c + d;
  }
}

// One token's latent (cpu_decode.cpp's `lowrank_encode`): its H heads' states x [H * D] (float32, the heads side by
// side) with the mean subtracted, projected on the encoder [H * D, r] (row-major): latent[j] = sum over i of
// x[i] * encoder[i, j], the sum over i in order, r columns at a time.
inline void project(const float* x, const float* encoder, int64_t width, int64_t rank, float* latent) {
  std::fill(latent, latent + rank, 0.0f);
  for (int64_t i = 0; i < width; ++i) {
    const float xi = x[i];
    const float* row = encoder + i * rank;
#pragma omp simd
    for (int64_t j = 0; j < rank; ++j) latent[j] += xi * row[j];
  }
}

}  // namespace lowrank
