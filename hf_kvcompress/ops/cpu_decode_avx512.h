// AVX-512 paths of cpu_decode.cpp: key logits 16 tokens at a time from a transposed tile, values dequantised in
// registers and mixed straight into the output rows.
//
// The portable path dequantises a tile into a buffer and takes one dot product per (query row, token): a
// horizontal sum of 16 lanes per logit and a store and reload of every dequantised value set its pace
// (docs/benchmark-notes.md, section 7). Here lane k of a vector is token t + k: the codes of 16 tokens are gathered 4
// bytes per token, each channel's codes become one vector, scaled by that channel's scale and zero point (keys per
// channel: one per group of tokens) and met by the query's channel (a broadcast, or with pre_rope keys the 16
// offsets' own queries, which sit next to each other), so 16 logits come out of FMAs alone; with one query per
// token the group's scales are folded into the query once per group instead. Keys grouped along head_dim per token
// (as values are: `int4:key_axis=token`, KVzip's int4 pairs) take the same lanes, with each group's 16 scales a
// vector gathered once per group (token_key_logits); fp8's keys (one group of head_dim per token) too. Values keep the
// token-major order (their output is a row per query, held across the tile): a token's codes become levels by one
// permute through a 16-entry table (plain codes, or L0 + a*c + b*(c >> 1)) and are scaled and mixed in registers.
// E4M3 codes (fp8) become float32 through float16 (e4m3_levels) on both sides.
//
// Included by cpu_decode.cpp inside its anonymous namespace, after Store and the Levels enum, only where the
// compiler targets AVX-512 F+BW (-march=native on such a CPU); elsewhere the portable path is the only one.

#include <immintrin.h>

namespace avx512 {

constexpr int64_t LANES = 16;  // tokens per key vector
constexpr const char* NAME = "avx512";

// Keys per channel (KIVI) in token groups of a multiple of 16, codes of whole 32-bit words per token, plain levels.
inline bool reads_keys(const Store& k) {
  return k.channel_group == 1 && k.token_group % 16 == 0 && k.width % 4 == 0 && k.levels == PLAIN &&
         (k.bits == 2 || k.bits == 4 || k.bits == 8);
}

// Values in groups along head_dim (one scale per token and group), planes of 1, 2, 4, 8 or 16 whole 16-byte
// vectors, at most 16 groups per token, plain or affine levels.
inline bool reads_values(const Store& v) {
  const int64_t blocks = v.width / 16;  // a power of two up to 16 (mix_values compiles those in)
  return v.token_group == 1 && v.channel_group > 1 && v.width % 16 == 0 && (blocks & (blocks - 1)) == 0 &&
         blocks <= 16 && v.scale_groups() <= 16 &&
         (((v.levels == PLAIN || v.levels == AFFINE) && (v.bits == 2 || v.bits == 4 || v.bits == 8)) ||
          (v.levels == FLOAT8 && v.bits == 8));
}

// The first `count` (<= 16) scales or zero points at `base + i` as float32 lanes (the rest 0).
inline __m512 load_groups(const void* base, at::ScalarType type, int64_t i, int64_t count) {
  const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1u);
  switch (type) {
    case at::kBFloat16: {  // a bfloat16 is the top half of a float32
      const __m256i half = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(base) + i);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    }
    case at::kHalf:
      return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(base) + i));
    default:
      return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(base) + i);
  }
}

// The codes at bits [shift, shift + BITS) of the 16 lanes of `bytes` (a 32-bit word per token) as float32 levels.
template <int BITS>
inline __m512 word_levels(__m512i bytes, int shift) {
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(bytes, shift), _mm512_set1_epi32((1 << BITS) - 1)));
}

// E4M3 bytes as float16 bits: the byte sign-extended to 16 bits, shifted left by 7 and bit 14 cleared puts its
// exponent and mantissa where a float16's go (both formats' subnormals line up), so the float16 is the byte's value
// / 256 (codecs/fp8.e4m3_as_float; the NaN bytes read as +-480 / 256, as e4m3_value reads them). VCVTPH2PS then
// converts 16 at a time, exactly, subnormals included and whatever MXCSR says (a float32 bit move needs a select
// for the subnormals, or a multiply whose denormal inputs DAZ would zero). Callers fold the factor 256 into a scale.
constexpr float E4M3_FACTOR = 256.0f;

// The 16 E4M3 bytes at `bytes` as float32 / 256 (values: a token's 16 channels).
inline __m512 e4m3_levels(const uint8_t* bytes) {
  const __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const __m256i half = _mm256_and_si256(_mm256_slli_epi16(wide, 7), _mm256_set1_epi16(static_cast<short>(0xbfff)));
  return _mm512_cvtph_ps(half);
}

// The four E4M3 bytes of each 32-bit lane of `words` (lane k: token k) as four vectors of float32 / 256, byte b of
// every token in out[b] (keys: four channels of 16 tokens). Bytes 0 and 2 of a lane become float16 in its two 16-bit
// halves, bytes 1 and 3 likewise in another vector; two word permutes put each byte's 16 halves side by side.
inline void e4m3_word_levels(__m512i words, __m512* out) {
  const __m512i keep = _mm512_set1_epi16(static_cast<short>(0xbf80));  // sign, exponent, mantissa; not bit 14
  const __m512i even = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(words, 8), 1), keep);  // bytes 0, 2
  const __m512i odd = _mm512_and_si512(_mm512_srai_epi16(words, 1), keep);                         // bytes 1, 3
  // Word j < 16 of `first`: half 2j of even (token j's byte 0); j >= 16: half 2(j - 16) of odd (its byte 1).
  // `second` the halves after them (bytes 2 and 3).
  const __m512i first_index = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                                               30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i first = _mm512_permutex2var_epi16(even, first_index, odd);
  const __m512i second = _mm512_permutex2var_epi16(even, _mm512_add_epi16(first_index, _mm512_set1_epi16(1)), odd);
  out[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(first));
  out[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(first, 1));
  out[2] = _mm512_cvtph_ps(_mm512_castsi512_si256(second));
  out[3] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(second, 1));
}

// Reads bytes [0, count) of `codes` with plain loads before the gathers read them. A decode step's stores outgrow the
// caches at a few thousand tokens, and gathers that miss wait on memory one group of lines at a time (the hardware
// prefetcher does not follow them, nor did a software prefetch help): plain loads of the 16 tokens' lines first cut a
// cold 8k-token int4 layer's kernel time by about a third (docs/speed.md, session 24).
inline void touch(const uint8_t* codes, int64_t count) {
  __m512i any = _mm512_setzero_si512();
  for (int64_t at = 0; at < count; at += 64) {
    const int64_t left = std::min<int64_t>(64, count - at);
    const __mmask64 bytes = left == 64 ? ~static_cast<__mmask64>(0) : (static_cast<__mmask64>(1) << left) - 1;
    any = _mm512_or_si512(any, _mm512_maskz_loadu_epi8(bytes, codes + at));
  }
  __asm__ volatile("" : : "v"(any));  // the loads are kept for their effect on the caches
}

// Token j's 32 bytes at `codes + 32 * j`, or zeros for j >= n (nothing read past the store).
inline __m256i token_bytes(const uint8_t* codes, int64_t j, int64_t n) {
  return _mm256_maskz_loadu_epi32(j < n ? static_cast<__mmask8>(0xff) : static_cast<__mmask8>(0), codes + 32 * j);
}

// words[w] = the w-th 32-bit word of each of the 16 tokens at `codes` (rows of `width` bytes; lane k: token k, zeros
// past the n valid ones), for rows of 32 bytes (int4 at head_dim 64): plain loads, tokens j and j + 8 to a vector,
// and the 8 x 8 word transpose of 256-bit registers in both halves at once (24 shuffles), instead of 8 gathers: 4%
// off a cold 8k-token int4 layer on this AVX-512 CPU (docs/speed.md, session 27). Other widths gather each word
// where it is used, after plain loads of their lines (`touch`): for int2's 16 bytes, loads and a 4 x 4 transpose
// were slower cold, and so were its gathers into an array.
inline void token_words(const uint8_t* codes, int64_t n, __m512i* words) {
  __m512i r[8];
  for (int j = 0; j < 8; ++j)
    r[j] = _mm512_inserti64x4(_mm512_castsi256_si512(token_bytes(codes, j, n)), token_bytes(codes, j + 8, n), 1);
  __m512i t[8], u[8];
  for (int j = 0; j < 4; ++j) {
    t[2 * j] = _mm512_unpacklo_epi32(r[2 * j], r[2 * j + 1]);
    t[2 * j + 1] = _mm512_unpackhi_epi32(r[2 * j], r[2 * j + 1]);
  }
  for (int j = 0; j < 2; ++j) {
    u[4 * j] = _mm512_unpacklo_epi64(t[4 * j], t[4 * j + 2]);
    u[4 * j + 1] = _mm512_unpackhi_epi64(t[4 * j], t[4 * j + 2]);
    u[4 * j + 2] = _mm512_unpacklo_epi64(t[4 * j + 1], t[4 * j + 3]);
    u[4 * j + 3] = _mm512_unpackhi_epi64(t[4 * j + 1], t[4 * j + 3]);
  }
  // 128-bit lanes: low = [a.0, b.0, a.2, b.2], high = [a.1, b.1, a.3, b.3] (in 64-bit units: 0 1 8 9 4 5 12 13)
  const __m512i low = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
  const __m512i high = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
  for (int j = 0; j < 4; ++j) {
    words[j] = _mm512_permutex2var_epi64(u[j], low, u[j + 4]);
    words[j + 4] = _mm512_permutex2var_epi64(u[j], high, u[j + 4]);
  }
}

// A tile's n (<= 16) tokens of `width` code bytes as the key paths read them: the words transposed into `transposed`
// (returned) where a token is 32 bytes, else null, the tokens' lines loaded first (`touch`) for the gathers.
inline const __m512i* tile_words(const uint8_t* codes, int64_t n, int64_t width, __m512i* transposed) {
  if (width == 32) {
    token_words(codes, n, transposed);
    return transposed;
  }
  touch(codes, n * width);
  return nullptr;
}

// Word `word` of each of the 16 tokens at `codes`: from `words` (token_words) where given, else gathered (tokens
// past the valid ones read nothing: their lanes are zero and dropped at the store).
inline __m512i word_of_tokens(const __m512i* words, const uint8_t* codes, int64_t width, int64_t word,
                              __mmask16 valid) {
  if (words) return words[word];
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int>(width)));
  return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, rows, codes + 4 * word, 1);
}

// logits[r * stride + k] for rows r < R (query rows m0 + r) and tokens t + k, k < 16, over one tile's 16 tokens:
// `codes` points at token t's bytes (rows of W bytes), `scale` / `zero` [D] are the channel scales of t's group,
// `query` [M, D, O] the (offset) queries in channel order, `o0` the offset of token t within its key group.
// SHARED: one query for every token (O = 1), else the 16 offsets' own (known when compiling, with each row's start
// hoisted: the run-time test and index products per channel and row held the pre_rope keys' loop back).
template <int BITS, int R, bool SHARED>
inline void key_logits_16(const __m512i* words, const uint8_t* codes, int64_t width, int64_t dim, const float* scale,
                          const float* zero, const float* query, int64_t offsets, int64_t o0, int64_t m0, float* logits,
                          int64_t stride, __mmask16 valid) {
  constexpr int U = 8 / BITS;
  const int64_t step = SHARED ? 1 : offsets;  // between one channel's queries and the next's
  const float* rows[R];                       // row r's query at channel 0 (offset o0)
  for (int r = 0; r < R; ++r) rows[r] = query + (m0 + r) * dim * step + (SHARED ? 0 : o0);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t word = 0; word < width / 4; ++word) {
    const __m512i bytes = word_of_tokens(words, codes, width, word, valid);  // bytes 4w..4w+3 of each token
    for (int byte = 0; byte < 4; ++byte) {
      for (int i = 0; i < U; ++i) {
        const int64_t d = (4 * word + byte) * U + i;  // byte j holds dims j*U + i (ops/bitpack.py)
        const __m512 value = _mm512_fmadd_ps(word_levels<BITS>(bytes, 8 * byte + BITS * i),
                                             _mm512_set1_ps(scale[d]), _mm512_set1_ps(zero[d]));
        for (int r = 0; r < R; ++r) {
          const __m512 qv = SHARED ? _mm512_set1_ps(rows[r][d]) : _mm512_loadu_ps(rows[r] + d * step);
          acc[r] = _mm512_fmadd_ps(qv, value, acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(logits + r * stride, valid, acc[r]);
}

// As key_logits_16 for one query per token (O = 1) with the group's scales folded into the query:
// logit = sum_d (q_d * scale_d) * code_d + sum_d q_d * zero_d, so a channel costs its code's extraction and one
// FMA per query row (not also an FMA for its scale). `folded` [M, D] holds the first factors, `folded_zero` [M] the sums.
template <int BITS, int R>
inline void folded_key_logits_16(const __m512i* words, const uint8_t* codes, int64_t width, int64_t dim,
                                 const float* folded, const float* folded_zero, int64_t m0, float* logits,
                                 int64_t stride, __mmask16 valid) {
  constexpr int U = 8 / BITS;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_set1_ps(folded_zero[m0 + r]);
  for (int64_t word = 0; word < width / 4; ++word) {
    const __m512i bytes = word_of_tokens(words, codes, width, word, valid);
    for (int byte = 0; byte < 4; ++byte) {
      for (int i = 0; i < U; ++i) {
        const int64_t d = (4 * word + byte) * U + i;
        const __m512 code = word_levels<BITS>(bytes, 8 * byte + BITS * i);
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(folded[(m0 + r) * dim + d]), code, acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(logits + r * stride, valid, acc[r]);
}

// Calls f(std::integral_constant<int, R>{}, m) over query rows [0, m_rows) in blocks of R = 4 rows, then one block
// of the 1-3 rows left: the row count is a template argument of the kernels (their accumulators live in registers).
// std::integral_constant comes with torch's headers, which cpu_decode.cpp includes before this file.
template <typename F>
inline void in_row_blocks(int64_t m_rows, F&& f) {
  int64_t m = 0;
  for (; m + 4 <= m_rows; m += 4) f(std::integral_constant<int, 4>{}, m);
  switch (m_rows - m) {
    case 3: f(std::integral_constant<int, 3>{}, m); break;
    case 2: f(std::integral_constant<int, 2>{}, m); break;
    case 1: f(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

// Logits [m_rows, TILE] (row stride `stride`) of the tile's tokens [t0, t1) of KV row `row`. `query` [M, D, O]:
// query row m, channel d, offset o at (m * D + d) * O + o (O = 1: one query for every token). `scale_buf` /
// `zero_buf` [D] hold the channel scales of one key group at a time; with O = 1, `folded` [M, D] and `folded_zero`
// [M] hold them folded into the query (folded_key_logits_16), once per group instead of once per 16 tokens.
template <int BITS>
void key_logits(const Store& k, int64_t row, int64_t t0, int64_t t1, const float* query, int64_t offsets,
                int64_t m_rows, float* logits, int64_t stride, float* scale_buf, float* zero_buf, float* folded,
                float* folded_zero) {
  const int64_t width = k.width, dim = k.dim;
  // Folding moves the zero points into one sum per row, q . zero, from which the codes' terms are then taken back:
  // codes up to 255 (8 bits) lose more to that cancellation than the kernel's tests allow, codes up to 15 do not.
  const bool fold = offsets == 1 && BITS <= 4;
  int64_t loaded = -1;
  for (int64_t t = t0; t < t1; t += 16) {
    const int64_t n = std::min<int64_t>(16, t1 - t);
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
    const int64_t group = t / k.token_group;
    if (group != loaded) {  // in channel order: scale[(row, group), d], 16 channels at a time
      loaded = group;
      const int64_t base = (k.scale_base(row) + group) * dim;
      for (int64_t d = 0; d < dim; d += 16) {
        const int64_t count = std::min<int64_t>(16, dim - d);
        const __mmask16 lanes = static_cast<__mmask16>((1u << count) - 1u);
        _mm512_mask_storeu_ps(scale_buf + d, lanes, load_groups(k.scale, k.scale_type, base + d, count));
        _mm512_mask_storeu_ps(zero_buf + d, lanes,
                              k.zero ? load_groups(k.zero, k.scale_type, base + d, count) : _mm512_setzero_ps());
      }
      if (fold) {
        for (int64_t m = 0; m < m_rows; ++m) {
          __m512 zero_sum = _mm512_setzero_ps();
          for (int64_t d = 0; d < dim; d += 16) {
            const __mmask16 lanes = static_cast<__mmask16>((1u << std::min<int64_t>(16, dim - d)) - 1u);
            const __m512 q = _mm512_maskz_loadu_ps(lanes, query + m * dim + d);
            _mm512_mask_storeu_ps(folded + m * dim + d, lanes,
                                  _mm512_mul_ps(q, _mm512_maskz_loadu_ps(lanes, scale_buf + d)));
            zero_sum = _mm512_fmadd_ps(q, _mm512_maskz_loadu_ps(lanes, zero_buf + d), zero_sum);
          }
          folded_zero[m] = _mm512_reduce_add_ps(zero_sum);
        }
      }
    }
    const uint8_t* codes = k.codes + (k.base(row) + t) * width;
    __m512i transposed[8];
    const __m512i* words = tile_words(codes, n, width, transposed);
    float* out = logits + (t - t0);
    if (fold) {
      in_row_blocks(m_rows, [&](auto rows, int64_t m) {
        folded_key_logits_16<BITS, decltype(rows)::value>(words, codes, width, dim, folded, folded_zero, m,
                                                          out + m * stride, stride, valid);
      });
      continue;
    }
    const int64_t o0 = offsets == 1 ? 0 : t % offsets;
    in_row_blocks(m_rows, [&](auto rows, int64_t m) {
      if (offsets == 1)
        return key_logits_16<BITS, decltype(rows)::value, true>(words, codes, width, dim, scale_buf, zero_buf, query,
                                                                offsets, o0, m, out + m * stride, stride, valid);
      key_logits_16<BITS, decltype(rows)::value, false>(words, codes, width, dim, scale_buf, zero_buf, query, offsets,
                                                        o0, m, out + m * stride, stride, valid);
    });
  }
}

inline void key_logits_any(const Store& k, int64_t row, int64_t t0, int64_t t1, const float* query, int64_t offsets,
                           int64_t m_rows, float* logits, int64_t stride, float* scale_buf, float* zero_buf,
                           float* folded, float* folded_zero) {
  switch (k.bits) {
    case 2: return key_logits<2>(k, row, t0, t1, query, offsets, m_rows, logits, stride, scale_buf, zero_buf, folded, folded_zero);
    case 4: return key_logits<4>(k, row, t0, t1, query, offsets, m_rows, logits, stride, scale_buf, zero_buf, folded, folded_zero);
    default: return key_logits<8>(k, row, t0, t1, query, offsets, m_rows, logits, stride, scale_buf, zero_buf, folded, folded_zero);
  }
}

// Keys in groups along head_dim, one scale and zero point per (token, group), as values are stored (int4 and int2
// with key_axis=token; KVzip's per-head pairs, whose keys a token group of one must hold): codes of whole 32-bit
// words per token, at most 16 groups per token, plain levels (or affine ones at 2 and 4 bits, a 16-entry table).
inline bool reads_token_keys(const Store& k) {
  return k.token_group == 1 && k.channel_group > 1 && k.width % 4 == 0 && k.scale_groups() <= 16 &&
         (((k.levels == PLAIN || (k.levels == AFFINE && k.bits <= 4)) && (k.bits == 2 || k.bits == 4 || k.bits == 8)) ||
          (k.levels == FLOAT8 && k.bits == 8));
}

// As key_logits_16 for keys grouped along head_dim per token: lane k is token t + k, each channel's codes one
// vector, and the scales of group g for the 16 tokens one vector gathered from `scales` / `zeros` (float32
// [16, groups] from token t; `zeros` null: none). The group's sum of q_d * level_d is taken first and met by its
// scale and zero point once, logit = sum_g s_g * (q . level)_g + z_g * (sum_{d in g} q_d) (`group_sums` [M, groups]
// the second factors), so a channel costs its extraction and one FMA per query row. Unlike key_logits' fold (zero
// points per channel), a group's zero point here is its own minimum, so the two terms do not cancel: 8-bit codes
// meet the kernel's tests too. `query` [M, D] in channel order.
template <int BITS, int LEVELS, int R>
inline void token_key_logits_16(const __m512i* words, const uint8_t* codes, int64_t width, int64_t dim,
                                int64_t group_bytes, int64_t groups, const float* scales, const float* zeros,
                                const float* query, const float* group_sums, __m512 table, int64_t m0,
                                float* logits, int64_t stride, __mmask16 valid) {
  constexpr int U = 8 / BITS;
  const __m512i mask = _mm512_set1_epi32((1 << BITS) - 1);
  const __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(static_cast<int>(groups)));
  __m512 acc[R], part[R];
  for (int r = 0; r < R; ++r) acc[r] = part[r] = _mm512_setzero_ps();
  __m512 scale = _mm512_setzero_ps(), zero = _mm512_setzero_ps();
  int64_t group = -1, left = 0;  // the group of the byte being read, and its bytes still to come
  auto close_group = [&]() {     // the finished group's sums, scaled, with its zero points' share
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(scale, part[r], acc[r]);
      acc[r] = _mm512_fmadd_ps(zero, _mm512_set1_ps(group_sums[(m0 + r) * groups + group]), acc[r]);
      part[r] = _mm512_setzero_ps();
    }
  };
  for (int64_t word = 0; word < width / 4; ++word) {
    const __m512i bytes = word_of_tokens(words, codes, width, word, valid);
    __m512 float8[4];  // E4M3 codes: the word's four channels of the 16 tokens, / E4M3_FACTOR
    if constexpr (LEVELS == FLOAT8) e4m3_word_levels(bytes, float8);
    for (int byte = 0; byte < 4; ++byte) {
      if (left == 0) {  // a group starts at this byte (a group holds whole bytes: make_store)
        if (group >= 0) close_group();
        ++group;
        left = group_bytes;
        const __m512i at = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(group)));
        scale = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, at, scales, 4);
        if (LEVELS == FLOAT8) scale = _mm512_mul_ps(scale, _mm512_set1_ps(E4M3_FACTOR));  // exact: a power of two
        zero = zeros ? _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, at, zeros, 4) : _mm512_setzero_ps();
      }
      --left;
      if constexpr (LEVELS == FLOAT8) {  // 8 bits: the byte is the channel
        const int64_t d = 4 * word + byte;
        for (int r = 0; r < R; ++r)
          part[r] = _mm512_fmadd_ps(_mm512_set1_ps(query[(m0 + r) * dim + d]), float8[byte], part[r]);
        continue;
      }
      for (int i = 0; i < U; ++i) {
        const int64_t d = (4 * word + byte) * U + i;  // byte j holds dims j*U + i (ops/bitpack.py)
        const __m512i code = _mm512_and_si512(_mm512_srli_epi32(bytes, 8 * byte + BITS * i), mask);
        const __m512 level = LEVELS == AFFINE ? _mm512_permutexvar_ps(code, table) : _mm512_cvtepi32_ps(code);
        for (int r = 0; r < R; ++r)
          part[r] = _mm512_fmadd_ps(_mm512_set1_ps(query[(m0 + r) * dim + d]), level, part[r]);
      }
    }
  }
  if (group >= 0) close_group();
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(logits + r * stride, valid, acc[r]);
}

// The scales and zero points of tokens [t0, t1) of KV row `row` of a store grouped along head_dim per token, as float32
// [t1 - t0, groups]: pointed at in place when stored as float32, else converted into scale_buf / zero_buf (at most a
// tile of 64 tokens x 16 groups). `tile_zero` is left as it is when the store has no zero points.
inline void tile_groups(const Store& s, int64_t row, int64_t t0, int64_t t1, int64_t groups, float* scale_buf,
                        float* zero_buf, const float*& tile_scale, const float*& tile_zero) {
  const int64_t first = (s.scale_base(row) + t0) * groups, count = (t1 - t0) * groups;
  if (s.scale_type == at::kFloat) {
    tile_scale = static_cast<const float*>(s.scale) + first;
    if (s.zero) tile_zero = static_cast<const float*>(s.zero) + first;
    return;
  }
  for (int64_t i = 0; i < count; i += 16) {
    const int64_t n = std::min<int64_t>(16, count - i);
    const __mmask16 lanes = static_cast<__mmask16>((1u << n) - 1u);
    _mm512_mask_storeu_ps(scale_buf + i, lanes, load_groups(s.scale, s.scale_type, first + i, n));
    if (s.zero) _mm512_mask_storeu_ps(zero_buf + i, lanes, load_groups(s.zero, s.scale_type, first + i, n));
  }
}

// Logits [m_rows, TILE] (row stride `stride`) of the tile's tokens [t0, t1) of KV row `row`, keys grouped along
// head_dim per token (reads_token_keys). `query` [M, D] in channel order, `group_sums` [M, groups] each row's sum
// over each group's channels (token_key_logits_16).
template <int BITS, int LEVELS>
void token_key_logits(const Store& k, int64_t row, int64_t t0, int64_t t1, const float* query, int64_t m_rows,
                      float* logits, int64_t stride, const float* group_sums) {
  const int64_t width = k.width, dim = k.dim, groups = k.scale_groups();
  const int64_t group_bytes = k.channel_group / k.unit();
  __m512 table = _mm512_setzero_ps();  // level of code c (c < 16), affine levels only
  if (LEVELS == AFFINE) {
    alignas(64) float levels[16];
    for (int c = 0; c < 16; ++c) levels[c] = k.l0 + k.a * static_cast<float>(c) + k.b * static_cast<float>(c >> 1);
    table = _mm512_load_ps(levels);
  }
  // The tile's scales and zero points as float32 [t1 - t0, groups]: read in place when they are float32, else
  // converted here once per tile (at most 64 tokens x 16 groups), as mix_values does.
  TORCH_CHECK(t1 - t0 <= TILE, "cpu_decode: more than a tile of tokens reached the AVX-512 keys");
  alignas(64) float scale_buf[TILE * 16], zero_buf[TILE * 16];
  const float* tile_scale = scale_buf;
  const float* tile_zero = k.zero ? zero_buf : nullptr;
  tile_groups(k, row, t0, t1, groups, scale_buf, zero_buf, tile_scale, tile_zero);
  for (int64_t t = t0; t < t1; t += 16) {
    const int64_t n = std::min<int64_t>(16, t1 - t);
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
    const uint8_t* codes = k.codes + (k.base(row) + t) * width;
    __m512i transposed[8];
    const __m512i* words = tile_words(codes, n, width, transposed);
    const float* scales = tile_scale + (t - t0) * groups;
    const float* zeros = tile_zero ? tile_zero + (t - t0) * groups : nullptr;
    float* out = logits + (t - t0);
    in_row_blocks(m_rows, [&](auto rows, int64_t m) {
      token_key_logits_16<BITS, LEVELS, decltype(rows)::value>(
          words, codes, width, dim, group_bytes, groups, scales, zeros, query, group_sums, table, m,
          out + m * stride, stride, valid);
    });
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
      if (k.levels == FLOAT8) return token_key_logits<8, FLOAT8>(k, row, t0, t1, query, m_rows, logits, stride, group_sums);
      return token_key_logits<8, PLAIN>(k, row, t0, t1, query, m_rows, logits, stride, group_sums);
  }
}

// How a value block's 16 lanes find their groups' scales (mix_rows): by a permute of the token's scales (lane j of
// block c in group (16c + j) * U / channel_group, `group_index`); one group for the block (WHOLE_BLOCKS, a group of
// whole blocks: int4's groups of 32); or a group for each half (HALF_BLOCKS, groups of 8 columns: int2's groups of 32).
enum BlockGroups { PER_LANE = 0, WHOLE_BLOCKS = 1, HALF_BLOCKS = 2 };

// acc[m][plane-major D] += sum over the tile's tokens [t0, t1) of probs[m * stride + t - t0] * value(t), for the
// query rows m0 <= m < m0 + R. A token's plane i, columns 16c..16c+15 are one vector. Its scale and zero point
// vectors: with WHOLE_BLOCKS, a broadcast of that group's float32 scale from `tile_scale` / `tile_zero`
// [t - t0, groups] (block_group[c]: the group of block c), a load that leaves the shuffle unit free; with
// HALF_BLOCKS, the same for lanes 0-7 and a masked broadcast of the next group's for lanes 8-15 (2 of int2's 9
// shuffles a token gone, and its per-token scale conversions: docs/speed.md, session 31); else (PER_LANE) a permute
// per block builds them from the token's scales once per token, serving every plane. The R rows' outputs
// (R x D / 16 vectors) stay in registers over the tile: with a run-time row loop they went through memory at every
// token, half of the values' time.
template <int BITS, bool FP8, int BLOCKS, int R, int GROUPS>
void mix_rows(const Store& v, int64_t row, int64_t t0, int64_t t1, const float* probs, int64_t stride, int64_t m0,
              float* acc, __m512 table, const __m512i* group_index, const float* tile_scale, const float* tile_zero,
              const int64_t* block_group) {
  constexpr int U = 8 / BITS, VECTORS = U * BLOCKS;
  constexpr int64_t W = 16 * BLOCKS;
  const int64_t dim = v.dim, groups = v.scale_groups();
  const __m512i mask = _mm512_set1_epi32((1 << BITS) - 1);
  __m512 sum[R][VECTORS];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < U; ++i)
      for (int c = 0; c < BLOCKS; ++c) sum[r][i * BLOCKS + c] = _mm512_loadu_ps(acc + (m0 + r) * dim + i * W + 16 * c);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* bytes = v.codes + (v.base(row) + t) * W;
    __m512 token_scale = _mm512_setzero_ps(), token_zero = _mm512_setzero_ps();
    if (GROUPS == PER_LANE) {
      const int64_t scale_at = (v.scale_base(row) + t) * groups;
      token_scale = load_groups(v.scale, v.scale_type, scale_at, groups);
      token_zero = v.zero ? load_groups(v.zero, v.scale_type, scale_at, groups) : _mm512_setzero_ps();
    }
    __m512 p[R];  // E4M3 levels are the values / E4M3_FACTOR: the factor rides on the weights (exact)
    for (int r = 0; r < R; ++r) p[r] = _mm512_set1_ps(probs[(m0 + r) * stride + t - t0] * (FP8 ? E4M3_FACTOR : 1.0f));
    for (int c = 0; c < BLOCKS; ++c) {
      __m512 scale, zero;
      if (GROUPS == WHOLE_BLOCKS) {
        scale = _mm512_set1_ps(tile_scale[(t - t0) * groups + block_group[c]]);
        zero = _mm512_set1_ps(tile_zero[(t - t0) * groups + block_group[c]]);
      } else if (GROUPS == HALF_BLOCKS) {  // lanes 8-15 the second group's
        const float* s = tile_scale + (t - t0) * groups + block_group[c];
        const float* z = tile_zero + (t - t0) * groups + block_group[c];
        scale = _mm512_mask_broadcastss_ps(_mm512_set1_ps(s[0]), 0xff00, _mm_load_ss(s + 1));
        zero = _mm512_mask_broadcastss_ps(_mm512_set1_ps(z[0]), 0xff00, _mm_load_ss(z + 1));
      } else {
        scale = _mm512_permutexvar_ps(group_index[c], token_scale);
        zero = _mm512_permutexvar_ps(group_index[c], token_zero);
      }
      if constexpr (FP8) {  // 8 bits: one vector per block
        const __m512 value = _mm512_fmadd_ps(e4m3_levels(bytes + 16 * c), scale, zero);
        for (int r = 0; r < R; ++r) sum[r][c] = _mm512_fmadd_ps(p[r], value, sum[r][c]);
        continue;
      }
      const __m512i packed = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16 * c)));
      for (int i = 0; i < U; ++i) {
        const __m512i code = _mm512_and_si512(_mm512_srli_epi32(packed, BITS * i), mask);
        const __m512 level = BITS <= 4 ? _mm512_permutexvar_ps(code, table) : _mm512_cvtepi32_ps(code);
        const __m512 value = _mm512_fmadd_ps(level, scale, zero);
        for (int r = 0; r < R; ++r) sum[r][i * BLOCKS + c] = _mm512_fmadd_ps(p[r], value, sum[r][i * BLOCKS + c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < U; ++i)
      for (int c = 0; c < BLOCKS; ++c) _mm512_storeu_ps(acc + (m0 + r) * dim + i * W + 16 * c, sum[r][i * BLOCKS + c]);
}

// All query rows, a few at a time: as many as keep their outputs within 16 of the 32 vector registers.
template <int BITS, bool FP8, int BLOCKS, int GROUPS>
void mix_all_rows(const Store& v, int64_t row, int64_t t0, int64_t t1, const float* probs, int64_t stride,
                  int64_t m_rows, float* acc, __m512 table, const __m512i* group_index, const float* tile_scale,
                  const float* tile_zero, const int64_t* block_group) {
  constexpr int VECTORS = (8 / BITS) * BLOCKS;
  constexpr int CHUNK = VECTORS <= 4 ? 4 : VECTORS <= 8 ? 2 : 1;
  auto rows = [&](auto count, int64_t m) {
    mix_rows<BITS, FP8, BLOCKS, decltype(count)::value, GROUPS>(v, row, t0, t1, probs, stride, m, acc, table,
                                                                 group_index, tile_scale, tile_zero, block_group);
  };
  int64_t m = 0;
  for (; m + CHUNK <= m_rows; m += CHUNK) rows(std::integral_constant<int, CHUNK>{}, m);
  switch (m_rows - m) {  // fewer than CHUNK (<= 4) left: one more pass
    case 3: return rows(std::integral_constant<int, 3>{}, m);
    case 2: return rows(std::integral_constant<int, 2>{}, m);
    case 1: return rows(std::integral_constant<int, 1>{}, m);
    default: return;
  }
}

// acc[m][plane-major D] += the tile's values weighed by probs[m * stride + t - t0], for every query row m < m_rows.
// FP8: E4M3 codes (8 bits), else plain or affine levels.
template <int BITS, bool FP8>
void mix_values(const Store& v, int64_t row, int64_t t0, int64_t t1, const float* probs, int64_t stride,
                int64_t m_rows, float* acc) {
  const int64_t blocks = v.width / 16, groups = v.scale_groups();
  __m512 table;  // level of code c (c < 16): c, or L0 + a*c + b*(c >> 1)
  {
    alignas(64) float levels[16];
    for (int c = 0; c < 16; ++c)
      levels[c] = v.levels == AFFINE ? v.l0 + v.a * static_cast<float>(c) + v.b * static_cast<float>(c >> 1)
                                     : static_cast<float>(c);
    table = _mm512_load_ps(levels);
  }
  constexpr int MAX_BLOCKS = 16;  // width / 16 <= 16: head_dim up to 256 at 8 bits
  const int64_t run = v.channel_group / (8 / BITS);  // columns of a plane per group
  __m512i group_index[MAX_BLOCKS];
  int64_t block_group[MAX_BLOCKS];
  for (int64_t c = 0; c < blocks; ++c) {
    alignas(64) int32_t lanes[16];
    for (int j = 0; j < 16; ++j) lanes[j] = static_cast<int32_t>((16 * c + j) / run);
    group_index[c] = _mm512_load_si512(lanes);
    block_group[c] = 16 * c / run;
  }
  // Groups over whole or half blocks: the tile's scales and zero points as float32 [t - t0, groups], read in place
  // when they are float32, else converted here once per tile (at most 64 tokens x 16 groups).
  const int grouping = run % 16 == 0 ? WHOLE_BLOCKS : run == 8 ? HALF_BLOCKS : PER_LANE;
  alignas(64) float scale_buf[TILE * 16], zero_buf[TILE * 16];
  const float* tile_scale = scale_buf;
  const float* tile_zero = zero_buf;
  if (grouping != PER_LANE) {
    TORCH_CHECK(t1 - t0 <= TILE, "cpu_decode: more than a tile of tokens reached the AVX-512 values");
    tile_groups(v, row, t0, t1, groups, scale_buf, zero_buf, tile_scale, tile_zero);
    if (!v.zero) std::fill(zero_buf, zero_buf + (t1 - t0) * groups, 0.0f);
  }
  auto mix = [&](auto width_blocks) {
    constexpr int B = decltype(width_blocks)::value;
    auto rows = [&](auto grouped) {
      mix_all_rows<BITS, FP8, B, decltype(grouped)::value>(v, row, t0, t1, probs, stride, m_rows, acc, table,
                                                           group_index, tile_scale, tile_zero, block_group);
    };
    if (grouping == WHOLE_BLOCKS) return rows(std::integral_constant<int, WHOLE_BLOCKS>{});
    if (grouping == HALF_BLOCKS) return rows(std::integral_constant<int, HALF_BLOCKS>{});
    return rows(std::integral_constant<int, PER_LANE>{});
  };
  switch (blocks) {  // reads_values: width is 16 to 256 bytes, so 1 to 16 blocks; head dims of 2^k tokens are 1-16
    case 1: return mix(std::integral_constant<int, 1>{});
    case 2: return mix(std::integral_constant<int, 2>{});
    case 4: return mix(std::integral_constant<int, 4>{});
    case 8: return mix(std::integral_constant<int, 8>{});
    case 16: return mix(std::integral_constant<int, 16>{});
    default: TORCH_CHECK(false, "cpu_decode: values of ", v.width, " bytes per token reached the AVX-512 path");
  }
}

inline void mix_values_any(const Store& v, int64_t row, int64_t t0, int64_t t1, const float* probs, int64_t stride,
                           int64_t m_rows, float* acc) {
  switch (v.bits) {
    case 2: return mix_values<2, false>(v, row, t0, t1, probs, stride, m_rows, acc);
    case 4: return mix_values<4, false>(v, row, t0, t1, probs, stride, m_rows, acc);
    default:
      if (v.levels == FLOAT8) return mix_values<8, true>(v, row, t0, t1, probs, stride, m_rows, acc);
      return mix_values<8, false>(v, row, t0, t1, probs, stride, m_rows, acc);
  }
}

}  // namespace avx512
