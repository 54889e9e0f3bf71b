// AVX2 paths of cpu_decode.cpp, for CPUs without AVX-512: cpu_decode_avx512.h's scheme 8 lanes wide. Key logits
// 8 tokens at a time from codes gathered 4 bytes per token (no horizontal sums; pre_rope's offset queries side by
// side), values dequantised in registers and mixed straight into the output rows.
//
// Included by cpu_decode.cpp inside its anonymous namespace where the compiler targets AVX2 and FMA but not
// AVX-512 (-march=native on such a CPU; the tests build it on an AVX-512 CPU with -mno-avx512f).

#include <immintrin.h>

namespace avx2 {

constexpr int64_t LANES = 8;  // tokens per key vector
constexpr const char* NAME = "avx2";

// Keys per channel (KIVI) in token groups of a multiple of 8, codes of whole 32-bit words per token, plain levels.
inline bool reads_keys(const Store& k) {
  return k.channel_group == 1 && k.token_group % LANES == 0 && k.width % 4 == 0 && k.levels == PLAIN &&
         (k.bits == 2 || k.bits == 4 || k.bits == 8);
}

// E4M3 codes go through float16 (avx512::e4m3_levels), which takes F16C: every AVX2 CPU has it, but a build may not
// say so.
#if defined(__F16C__)
constexpr bool FLOAT8_CODES = true;
#else
constexpr bool FLOAT8_CODES = false;
#endif

// Values in groups along head_dim, planes of whole 8-byte runs, at most 8 groups per token, plain or affine levels
// (or E4M3 codes).
inline bool reads_values(const Store& v) {
  return v.token_group == 1 && v.channel_group > 1 && v.width % 8 == 0 && v.width <= 256 && v.scale_groups() <= 8 &&
         (((v.levels == PLAIN || v.levels == AFFINE) && (v.bits == 2 || v.bits == 4 || v.bits == 8)) ||
          (FLOAT8_CODES && v.levels == FLOAT8 && v.bits == 8));
}

// E4M3 bytes as float32 / E4M3_FACTOR through float16, exactly: see avx512::e4m3_levels. Callers fold the factor into
// a scale.
constexpr float E4M3_FACTOR = 256.0f;

#if defined(__F16C__)
// The 8 E4M3 bytes at `bytes` (values: a token's 8 channels).
inline __m256 e4m3_levels(const uint8_t* bytes) {
  const __m128i wide = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(wide, 7), _mm_set1_epi16(static_cast<short>(0xbfff))));
}

// The four E4M3 bytes of each 32-bit lane of `words` (lane k: token k) as four vectors, byte b of the 8 tokens in
// out[b] (keys: four channels of 8 tokens). Float16 halves as avx512::e4m3_word_levels; a byte shuffle puts each
// 128-bit lane's four tokens' byte 0 (2) halves in its low (high) 8 bytes, a 64-bit permute the two lanes' together.
inline void e4m3_word_levels(__m256i words, __m256* out) {
  const __m256i keep = _mm256_set1_epi16(static_cast<short>(0xbf80));
  const __m256i even = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(words, 8), 1), keep);  // bytes 0, 2
  const __m256i odd = _mm256_and_si256(_mm256_srai_epi16(words, 1), keep);                         // bytes 1, 3
  const __m256i halves = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                          0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  const __m256i low_even = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(even, halves), 0xd8);  // 64-bit 0, 2, 1, 3
  const __m256i low_odd = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(odd, halves), 0xd8);
  out[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(low_even));
  out[1] = _mm256_cvtph_ps(_mm256_castsi256_si128(low_odd));
  out[2] = _mm256_cvtph_ps(_mm256_extracti128_si256(low_even, 1));
  out[3] = _mm256_cvtph_ps(_mm256_extracti128_si256(low_odd, 1));
}
#endif

// logits[r * stride + k] for rows r < R (query rows m0 + r) and tokens t + k, k < n (<= 8); see avx512::key_logits_16.
template <int BITS, int R>
inline void key_logits_8(const uint8_t* codes, int64_t width, int64_t dim, const float* scale, const float* zero,
                         const float* query, int64_t offsets, int64_t o0, int64_t m0, float* logits, int64_t stride,
                         int64_t n) {
  constexpr int U = 8 / BITS;
  const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  const __m256i rows = _mm256_mullo_epi32(lane, _mm256_set1_epi32(static_cast<int>(width)));
  const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane);  // all ones: a token
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t word = 0; word < width / 4; ++word) {
    const __m256i bytes = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), reinterpret_cast<const int*>(codes + 4 * word),
                                                      rows, valid, 1);
    for (int byte = 0; byte < 4; ++byte) {
      for (int i = 0; i < U; ++i) {
        const int64_t d = (4 * word + byte) * U + i;  // byte j holds dims j*U + i (ops/bitpack.py)
        const __m256i code = _mm256_and_si256(_mm256_srli_epi32(bytes, 8 * byte + BITS * i), mask);
        const __m256 value = _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), _mm256_set1_ps(scale[d]), _mm256_set1_ps(zero[d]));
        for (int r = 0; r < R; ++r) {
          const float* q = query + ((m0 + r) * dim + d) * offsets;
          const __m256 qv = offsets == 1 ? _mm256_set1_ps(q[0]) : _mm256_loadu_ps(q + o0);
          acc[r] = _mm256_fmadd_ps(qv, value, acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_maskstore_ps(logits + r * stride, valid, acc[r]);
}

template <int BITS>
void key_logits(const Store& k, int64_t row, int64_t t0, int64_t t1, const float* query, int64_t offsets,
                int64_t m_rows, float* logits, int64_t stride, float* scale_buf, float* zero_buf) {
  const int64_t width = k.width, dim = k.dim;
  int64_t loaded = -1;
  for (int64_t t = t0; t < t1; t += LANES) {
    const int64_t n = std::min<int64_t>(LANES, t1 - t);
    const int64_t group = t / k.token_group;
    if (group != loaded) {  // in channel order: scale[(row, group), d]
      loaded = group;
      const int64_t base = (k.scale_base(row) + group) * dim;
      for (int64_t d = 0; d < dim; ++d) {
        scale_buf[d] = k.load_scale(base + d);
        zero_buf[d] = k.load_zero(base + d);
      }
    }
    const uint8_t* codes = k.codes + (k.base(row) + t) * width;
    const int64_t o0 = offsets == 1 ? 0 : t % offsets;
    float* out = logits + (t - t0);
    int64_t m = 0;
    for (; m + 4 <= m_rows; m += 4)
      key_logits_8<BITS, 4>(codes, width, dim, scale_buf, zero_buf, query, offsets, o0, m, out + m * stride, stride, n);
    switch (m_rows - m) {
      case 3: key_logits_8<BITS, 3>(codes, width, dim, scale_buf, zero_buf, query, offsets, o0, m, out + m * stride, stride, n); break;
      case 2: key_logits_8<BITS, 2>(codes, width, dim, scale_buf, zero_buf, query, offsets, o0, m, out + m * stride, stride, n); break;
      case 1: key_logits_8<BITS, 1>(codes, width, dim, scale_buf, zero_buf, query, offsets, o0, m, out + m * stride, stride, n); break;
      default: break;
    }
  }
}

// `folded` / `folded_zero`: avx512's folded scales; this path keeps the per-channel scales in its FMAs (not measured
// here: no AVX2-only CPU at hand), so they go unused.
inline void key_logits_any(const Store& k, int64_t row, int64_t t0, int64_t t1, const float* query, int64_t offsets,
                           int64_t m_rows, float* logits, int64_t stride, float* scale_buf, float* zero_buf,
                           float* /*folded*/, float* /*folded_zero*/) {
  switch (k.bits) {
    case 2: return key_logits<2>(k, row, t0, t1, query, offsets, m_rows, logits, stride, scale_buf, zero_buf);
    case 4: return key_logits<4>(k, row, t0, t1, query, offsets, m_rows, logits, stride, scale_buf, zero_buf);
    default: return key_logits<8>(k, row, t0, t1, query, offsets, m_rows, logits, stride, scale_buf, zero_buf);
  }
}

// Keys in groups along head_dim, one scale and zero point per (token, group): see avx512::reads_token_keys.
inline bool reads_token_keys(const Store& k) {
  return k.token_group == 1 && k.channel_group > 1 && k.width % 4 == 0 && k.scale_groups() <= 16 &&
         (((k.levels == PLAIN || (k.levels == AFFINE && k.bits <= 4)) && (k.bits == 2 || k.bits == 4 || k.bits == 8)) ||
          (FLOAT8_CODES && k.levels == FLOAT8 && k.bits == 8));
}

// logits[r * stride + k] for rows r < R (query rows m0 + r) and tokens t + k, k < n (<= 8), keys grouped along
// head_dim per token; see avx512::token_key_logits_16. `scales` / `zeros` [groups, 8]: group g's scales of the 8
// tokens side by side (`zeros` null: none). Affine levels by arithmetic (AVX2 has no 16-entry permute).
template <int BITS, int LEVELS, int R>
inline void token_key_logits_8(const uint8_t* codes, int64_t width, int64_t dim, int64_t group_bytes,
                               int64_t groups, const float* scales, const float* zeros, const float* query,
                               const float* group_sums, const Store& k, int64_t m0, float* logits, int64_t stride,
                               int64_t n) {
  constexpr int U = 8 / BITS;
  const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  const __m256i rows = _mm256_mullo_epi32(lane, _mm256_set1_epi32(static_cast<int>(width)));
  const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane);  // all ones: a token
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  const __m256 l0 = _mm256_set1_ps(k.l0), a = _mm256_set1_ps(k.a), b = _mm256_set1_ps(k.b);
  __m256 acc[R], part[R];
  for (int r = 0; r < R; ++r) acc[r] = part[r] = _mm256_setzero_ps();
  __m256 scale = _mm256_setzero_ps(), zero = _mm256_setzero_ps();
  int64_t group = -1, left = 0;  // the group of the byte being read, and its bytes still to come
  auto close_group = [&]() {
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(scale, part[r], acc[r]);
      acc[r] = _mm256_fmadd_ps(zero, _mm256_set1_ps(group_sums[(m0 + r) * groups + group]), acc[r]);
      part[r] = _mm256_setzero_ps();
    }
  };
  for (int64_t word = 0; word < width / 4; ++word) {
    const __m256i bytes = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), reinterpret_cast<const int*>(codes + 4 * word),
                                                      rows, valid, 1);
    __m256 float8[4];  // E4M3 codes: the word's four channels of the 8 tokens, / E4M3_FACTOR
#if defined(__F16C__)
    if constexpr (LEVELS == FLOAT8) e4m3_word_levels(bytes, float8);
#endif
    for (int byte = 0; byte < 4; ++byte) {
      if (left == 0) {  // a group starts at this byte
        if (group >= 0) close_group();
        ++group;
        left = group_bytes;
        scale = _mm256_loadu_ps(scales + 8 * group);
        if (LEVELS == FLOAT8) scale = _mm256_mul_ps(scale, _mm256_set1_ps(E4M3_FACTOR));  // exact: a power of two
        zero = zeros ? _mm256_loadu_ps(zeros + 8 * group) : _mm256_setzero_ps();
      }
      --left;
#if defined(__F16C__)
      if constexpr (LEVELS == FLOAT8) {  // 8 bits: the byte is the channel
        const int64_t d = 4 * word + byte;
        for (int r = 0; r < R; ++r)
          part[r] = _mm256_fmadd_ps(_mm256_set1_ps(query[(m0 + r) * dim + d]), float8[byte], part[r]);
        continue;
      }
#endif
      for (int i = 0; i < U; ++i) {
        const int64_t d = (4 * word + byte) * U + i;  // byte j holds dims j*U + i (ops/bitpack.py)
        const __m256i code = _mm256_and_si256(_mm256_srli_epi32(bytes, 8 * byte + BITS * i), mask);
        __m256 level = _mm256_cvtepi32_ps(code);
        if (LEVELS == AFFINE)
          level = _mm256_fmadd_ps(a, level, _mm256_fmadd_ps(b, _mm256_cvtepi32_ps(_mm256_srli_epi32(code, 1)), l0));
        for (int r = 0; r < R; ++r)
          part[r] = _mm256_fmadd_ps(_mm256_set1_ps(query[(m0 + r) * dim + d]), level, part[r]);
      }
    }
  }
  if (group >= 0) close_group();
  for (int r = 0; r < R; ++r) _mm256_maskstore_ps(logits + r * stride, valid, acc[r]);
}

template <int BITS, int LEVELS>
void token_key_logits(const Store& k, int64_t row, int64_t t0, int64_t t1, const float* query, int64_t m_rows,
                      float* logits, int64_t stride, const float* group_sums) {
  const int64_t width = k.width, dim = k.dim, groups = k.scale_groups(), group_bytes = k.channel_group / k.unit();
  alignas(32) float scales[16 * LANES], zeros[16 * LANES];  // [groups, 8]: reads_token_keys allows 16 groups
  for (int64_t t = t0; t < t1; t += LANES) {
    const int64_t n = std::min<int64_t>(LANES, t1 - t);
    const int64_t scale_at = (k.scale_base(row) + t) * groups;
    for (int64_t j = 0; j < LANES; ++j)  // scalar loads and conversions, the tokens past n as zeros
      for (int64_t g = 0; g < groups; ++g) {
        scales[g * LANES + j] = j < n ? k.load_scale(scale_at + j * groups + g) : 0.0f;
        zeros[g * LANES + j] = j < n ? k.load_zero(scale_at + j * groups + g) : 0.0f;
      }
    const uint8_t* codes = k.codes + (k.base(row) + t) * width;
    const float* zero = k.zero ? zeros : nullptr;
    float* out = logits + (t - t0);
    int64_t m = 0;
    auto rows = [&](auto count, int64_t m0) {
      token_key_logits_8<BITS, LEVELS, decltype(count)::value>(
          codes, width, dim, group_bytes, groups, scales, zero, query, group_sums, k, m0, out + m0 * stride, stride, n);
    };
    for (; m + 4 <= m_rows; m += 4) rows(std::integral_constant<int, 4>{}, m);
    switch (m_rows - m) {
      case 3: rows(std::integral_constant<int, 3>{}, m); break;
      case 2: rows(std::integral_constant<int, 2>{}, m); break;
      case 1: rows(std::integral_constant<int, 1>{}, m); break;
      default: break;
    }
  }
}

inline void token_key_logits_any(const Store& k, int64_t row, int64_t t0, int64_t t1, const float* query,
                                 int64_t m_rows, float* logits, int64_t stride, const float* group_sums) {
  const bool affine = k.levels == AFFINE;  // reads_token_keys: at 2 or 4 bits
  switch (k.bits) {
    case 2:
      if (affine) return token_key_logits<2, AFFINE>(k, row, t0, t1, query, m_rows, logits, stride, group_sums);
      return token_key_logits<2, PLAIN>(k, row, t0, t1, query, m_rows, logits, stride, group_sums);
    case 4:
      if (affine) return token_key_logits<4, AFFINE>(k, row, t0, t1, query, m_rows, logits, stride, group_sums);
      return token_key_logits<4, PLAIN>(k, row, t0, t1, query, m_rows, logits, stride, group_sums);
    default:
      if (FLOAT8_CODES && k.levels == FLOAT8)
        return token_key_logits<8, FLOAT8>(k, row, t0, t1, query, m_rows, logits, stride, group_sums);
      return token_key_logits<8, PLAIN>(k, row, t0, t1, query, m_rows, logits, stride, group_sums);
  }
}

// acc[m][plane-major D] += sum over tokens [t0, t1) of probs[m * stride + t - t0] * value(t); see
// avx512::mix_values. Levels by arithmetic (AVX2 has no 16-entry permute): c, or L0 + a*c + b*(c >> 1); FP8: E4M3
// codes (8 bits).
template <int BITS, bool FP8>
void mix_values(const Store& v, int64_t row, int64_t t0, int64_t t1, const float* probs, int64_t stride,
                int64_t m_rows, float* acc) {
  constexpr int U = 8 / BITS;
  const int64_t width = v.width, blocks = width / 8, groups = v.scale_groups();
  const bool affine = v.levels == AFFINE;
  const __m256 l0 = _mm256_set1_ps(v.l0), a = _mm256_set1_ps(v.a), b = _mm256_set1_ps(v.b);
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  constexpr int MAX_BLOCKS = 32;  // width / 8 <= 32: head_dim up to 256 at 8 bits
  const int64_t run = v.channel_group / U;  // columns of a plane per group
  __m256i group_index[MAX_BLOCKS];
  for (int64_t c = 0; c < blocks; ++c) {
    alignas(32) int32_t lanes[8];
    for (int j = 0; j < 8; ++j) lanes[j] = static_cast<int32_t>((8 * c + j) / run);
    group_index[c] = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
  }
  alignas(32) float scales[8] = {}, zeros[8] = {};
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* bytes = v.codes + (v.base(row) + t) * width;
    const int64_t scale_at = (v.scale_base(row) + t) * groups;
    for (int64_t g = 0; g < groups; ++g) {  // a few per token: scalar loads and conversions
      scales[g] = v.load_scale(scale_at + g);
      zeros[g] = v.load_zero(scale_at + g);
    }
    __m256 token_scale = _mm256_load_ps(scales);
    const __m256 token_zero = _mm256_load_ps(zeros);
    if (FP8) token_scale = _mm256_mul_ps(token_scale, _mm256_set1_ps(E4M3_FACTOR));  // exact: a power of two
    for (int64_t c = 0; c < blocks; ++c) {
      const __m256 scale = _mm256_permutevar8x32_ps(token_scale, group_index[c]);
      const __m256 zero = _mm256_permutevar8x32_ps(token_zero, group_index[c]);
#if defined(__F16C__)
      if constexpr (FP8) {  // 8 bits: one vector per run
        const __m256 value = _mm256_fmadd_ps(e4m3_levels(bytes + 8 * c), scale, zero);
        float* out = acc + 8 * c;
        for (int64_t m = 0; m < m_rows; ++m) {
          float* o = out + m * v.dim;
          _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_set1_ps(probs[m * stride + t - t0]), value, _mm256_loadu_ps(o)));
        }
        continue;
      }
#endif
      const __m256i packed = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * c)));
      for (int i = 0; i < U; ++i) {
        const __m256i code = _mm256_and_si256(_mm256_srli_epi32(packed, BITS * i), mask);
        __m256 level = _mm256_cvtepi32_ps(code);
        if (affine)
          level = _mm256_fmadd_ps(a, level, _mm256_fmadd_ps(b, _mm256_cvtepi32_ps(_mm256_srli_epi32(code, 1)), l0));
        const __m256 value = _mm256_fmadd_ps(level, scale, zero);
        float* out = acc + i * width + 8 * c;
        for (int64_t m = 0; m < m_rows; ++m) {
          float* o = out + m * v.dim;
          _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_set1_ps(probs[m * stride + t - t0]), value, _mm256_loadu_ps(o)));
        }
      }
    }
  }
}

inline void mix_values_any(const Store& v, int64_t row, int64_t t0, int64_t t1, const float* probs, int64_t stride,
                           int64_t m_rows, float* acc) {
  switch (v.bits) {
    case 2: return mix_values<2, false>(v, row, t0, t1, probs, stride, m_rows, acc);
    case 4: return mix_values<4, false>(v, row, t0, t1, probs, stride, m_rows, acc);
    default:
      if (FLOAT8_CODES && v.levels == FLOAT8) return mix_values<8, true>(v, row, t0, t1, probs, stride, m_rows, acc);
      return mix_values<8, false>(v, row, t0, t1, probs, stride, m_rows, acc);
  }
}

}  // namespace avx2
