// Decode logits over a joint low-rank store's pre-RoPE key latents (codecs/lowrank.py, `key_logits`), fused.
//
// A joint store holds one latent z_t [r] per token for a layer's KV heads; head h's key at position p_t is
// RoPE(p_t)(B_h z_t + mu_h). The PyTorch path rebuilds a block's keys [H, D, T] in one product, adds the mean, turns
// them in four elementwise passes and meets the query in two more products: every pass writes and rereads the
// rebuilt keys (3 KiB per token at 3 x 64 float32 dims), together about what the product costs (docs/speed.md).
// Here a tile of LANES tokens is rebuilt in registers, lane l of a vector being token t0 + l: a block of FREQS
// frequencies' two halves (channels i and i + R/2 of rotate-half RoPE) are accumulated over the rank, one FMA per
// basis entry (broadcast) and latent vector; the mean is added, the pair turned with the tile's cos and sin and met
// by each query row's two channels, so only the logits leave the registers. Channels past the rotated ones (partial
// rotary) meet the query as they are.
//
// Products: float32 FMAs, or with bf16 products (lowrank's compute="bfloat16") the basis and the latents rounded to
// bf16 (round to nearest even, as torch's conversion), their products exact in float32 and summed in float32: on a
// CPU with AVX512-BF16 one VDPBF16PS per pair of rank entries (two products into the float32 lane), elsewhere the
// rounded values through the float32 path. Only the order of the float32 sums differs from the PyTorch path.
//
// Included by cpu_decode.cpp inside its anonymous namespace, after its instruction-set paths (HF_KVCOMPRESS_SIMD).

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifndef HF_LOWRANK_VECS
#define HF_LOWRANK_VECS 2
#endif
#ifndef HF_LOWRANK_FREQS
#define HF_LOWRANK_FREQS 4
#endif

namespace lowrank {

constexpr int64_t VECS = HF_LOWRANK_VECS;   // float32 vectors of AVX-512 (16 tokens each) per tile
constexpr int64_t LANES = 16 * VECS;  // tokens per tile
constexpr int FREQS = HF_LOWRANK_FREQS;  // frequencies per block: 2 x FREQS x VECS accumulators

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

struct Keys {
  const void* latent = nullptr;  // [B, T, r] in latent_type, unit stride over r
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
  float* out = nullptr;             // [B, H, M, T] contiguous
  int64_t heads = 0, rows = 0, dim = 0, half = 0;
};

inline float latent_at(const Keys& k, int64_t b, int64_t t, int64_t j) {
  return load_float(k.latent, k.latent_type, b * k.latent_b + t * k.latent_t + j);
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
    const int64_t start = b * k.latent_b + (t0 + 16 * v) * k.latent_t;
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
    // bfloat16 latents: 32-bit words of two rank entries (2j at the lower address), gathered whole.
    const uint16_t* base = static_cast<const uint16_t*>(k.latent) + start;
    for (int64_t j = 0; j < k.pair_rank; ++j) {
      const __m512i pair = _mm512_i32gather_epi32(tokens, base + 2 * j, 2);
      if (zp != nullptr) _mm512_storeu_si512(zp + j * LANES + 16 * v, pair);
      if (zt != nullptr) {
        _mm512_storeu_ps(zt + 2 * j * LANES + 16 * v, _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)));
        _mm512_storeu_ps(zt + (2 * j + 1) * LANES + 16 * v,
                         _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u)))));
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

// Tiles [begin, end) of the (batch row, tile) grid: every head's logits of each tile's tokens.
template <bool VECTOR, bool PAIRS>
void key_logits_tiles(const Keys& k, int64_t begin, int64_t end) {
  const int64_t tiles = (k.tokens + LANES - 1) / LANES;
  std::vector<float> zt(static_cast<size_t>(k.rank * LANES));  // float32 latents (also the plain channels' tile)
  std::vector<uint32_t> zp(PAIRS ? static_cast<size_t>(k.pair_rank * LANES) : 0);
  std::vector<float> lg(static_cast<size_t>(k.rows * LANES));
  std::vector<float> trig_tile(static_cast<size_t>(2 * k.half * LANES));  // a last, partial tile's cos and sin
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / tiles, t0 = (task % tiles) * LANES;
    const int64_t n = std::min(LANES, k.tokens - t0);
    const bool plain_channels = 2 * k.half < k.dim;
    bool packed = false;
#if defined(__AVX512F__)
    if constexpr (VECTOR)
      packed = pack_avx512(k, b, t0, n, !PAIRS || plain_channels ? zt.data() : nullptr, PAIRS ? zp.data() : nullptr);
#endif
    if (!packed) {
      if (!PAIRS || plain_channels) pack_floats(k, b, t0, n, zt.data());
      if (PAIRS) pack_pairs(k, b, t0, n, zp.data());
    }
    const float* cs = k.cos + b * k.trig_b + t0;
    const float* sn = k.sin + b * k.trig_b + t0;
    int64_t trig = k.trig_f;
    if (n < LANES) {  // reads stay inside the tables: the tile's columns copied, the rest 0
      std::fill(trig_tile.begin(), trig_tile.end(), 0.0f);
      for (int64_t f = 0; f < k.half; ++f)
        for (int64_t l = 0; l < n; ++l) {
          trig_tile[f * LANES + l] = cs[f * k.trig_f + l];
          trig_tile[(k.half + f) * LANES + l] = sn[f * k.trig_f + l];
        }
      cs = trig_tile.data(), sn = trig_tile.data() + k.half * LANES, trig = LANES;
    }
#if defined(__AVX512F__)
    // The next tile's latents are read from memory (a layer's store outgrows the caches between steps): asked for
    // now, they arrive while this tile's products run, instead of stalling its gathers line by line.
    if (VECTOR && task + 1 < end) {
      const int64_t next = task + 1, nb = next / tiles, nt = (next % tiles) * LANES;
      const int64_t width = static_cast<int64_t>(c10::elementSize(k.latent_type));
      const char* first = static_cast<const char*>(k.latent) + (nb * k.latent_b + nt * k.latent_t) * width;
      const int64_t bytes = std::min(LANES, k.tokens - nt) * k.latent_t * width;
      for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(first + offset, _MM_HINT_T0);
    }
#endif
    const void* tile = PAIRS ? static_cast<const void*>(zp.data()) : static_cast<const void*>(zt.data());
    for (int64_t h = 0; h < k.heads; ++h) {
      const float* q = k.query + (b * k.heads + h) * k.rows * k.dim;
      std::fill(lg.begin(), lg.end(), 0.0f);
      turned_head<VECTOR, PAIRS>(k, h, tile, cs, sn, trig, q, lg.data());
      for (int64_t d = 2 * k.half; d < k.dim; ++d) plain_channel(k, h, d, zt.data(), q, lg.data());
      for (int64_t m = 0; m < k.rows; ++m)
        std::memcpy(k.out + ((b * k.heads + h) * k.rows + m) * k.tokens + t0, lg.data() + m * LANES,
                    static_cast<size_t>(n) * sizeof(float));
    }
  }
}

}  // namespace lowrank
