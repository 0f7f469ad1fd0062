/* cpu_kernels, q8 Adam step, AVX2 level: 8 lanes; the map and the bucket table read by scalar loads. */
#include "q8.h"
#define Q8_LEVEL avx2

#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

/* Table reads by scalar loads, not vpgatherdd: on Zen 5 (measured per element of a block in L1)
 * 8 scalar loads inserted into a vector cost 0.17 ns, a gather of 8 0.49 ns. */
static inline __m256i q8_lookup8(const uint32_t *table, const uint32_t k[8])
{
    __m128i lo = _mm_cvtsi32_si128((int)table[k[0]]), hi = _mm_cvtsi32_si128((int)table[k[4]]);
    lo = _mm_insert_epi32(lo, (int)table[k[1]], 1);
    hi = _mm_insert_epi32(hi, (int)table[k[5]], 1);
    lo = _mm_insert_epi32(lo, (int)table[k[2]], 2);
    hi = _mm_insert_epi32(hi, (int)table[k[6]], 2);
    lo = _mm_insert_epi32(lo, (int)table[k[3]], 3);
    hi = _mm_insert_epi32(hi, (int)table[k[7]], 3);
    return _mm256_set_m128i(hi, lo);
}

static inline void q8_dequant_block(float *restrict dst, const uint8_t *codes, float absmax,
                                    const uint32_t *map, int len)
{
    const __m256 s = _mm256_set1_ps(absmax);
    int i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t c;
        memcpy(&c, codes + i, 8);
        uint32_t k[8];
        for (int j = 0; j < 8; j++) k[j] = (uint32_t)(c >> (8 * j)) & 0xffu;
        _mm256_store_ps(dst + i, _mm256_mul_ps(_mm256_castsi256_ps(q8_lookup8(map, k)), s));
    }
    for (; i < len; i++) dst[i] = bits_f32(map[codes[i]]) * absmax;
}

static inline void q8_quant_block(uint8_t *restrict codes, const float *restrict x, float absmax,
                                  const uint32_t *table, int zero, int len)
{
    const __m256 s = _mm256_set1_ps(absmax);
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), low16 = _mm256_set1_epi32(0xffff);
    const __m256i low17 = _mm256_set1_epi32(0x1ffff), first = _mm256_set1_epi32(Q8_KEY_FIRST);
    const __m256i last = _mm256_set1_epi32(Q8_KEYS - 1), keys = _mm256_set1_epi32(Q8_KEYS);
    const __m256i zero_code = _mm256_set1_epi32(zero), one = _mm256_set1_epi32(1);
    int i = 0;
    for (; i + 8 <= len; i += 8) {
        const __m256i u = _mm256_castps_si256(_mm256_div_ps(_mm256_load_ps(x + i), s));
        const __m256i mag = _mm256_and_si256(u, abs_mask);
        const __m256i neg = _mm256_srai_epi32(u, 31);  /* all ones where x <= -0 */
        __m256i key = _mm256_sub_epi32(_mm256_srli_epi32(mag, 16), first);
        key = _mm256_min_epi32(_mm256_max_epi32(key, _mm256_setzero_si256()), last);
        key = _mm256_add_epi32(key, _mm256_and_si256(neg, keys));
        uint32_t k[8] __attribute__((aligned(32)));
        _mm256_store_si256((__m256i *)k, key);
        const __m256i entry = q8_lookup8(table, k);
        /* rank = entry >> 17, + 1 unless the step lies above |x| (both below 2^17: signed compare) */
        const __m256i above = _mm256_cmpgt_epi32(_mm256_and_si256(entry, low17), _mm256_and_si256(mag, low16));
        const __m256i rank = _mm256_add_epi32(_mm256_add_epi32(_mm256_srli_epi32(entry, 17), one), above);
        const __m256i code = _mm256_blendv_epi8(_mm256_add_epi32(zero_code, rank),
                                                _mm256_sub_epi32(zero_code, rank), neg);
        const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
        _mm_storel_epi64((__m128i *)(codes + i), _mm_packus_epi16(words, words));
    }
    for (; i < len; i++) codes[i] = q8_code(x[i] / absmax, table, zero);
}

/* The generic loop (q8_body.h) serves every format; the common one below fuses its passes. */
#undef Q8_LEVEL
#define Q8_LEVEL avx2_generic
#include "q8_body.h"

/* The fused pass (q8_fused.h) over 8 lanes. */
#undef Q8_LEVEL
#define Q8_LEVEL avx2
#define Q8_GENERIC q8_range_avx2_generic
#define Q8_W 8
typedef __m256 q8_vf;
typedef __m256i q8_vi;
#define q8f_set1 _mm256_set1_ps
#define q8f_load _mm256_load_ps
#define q8f_loadu _mm256_loadu_ps
#define q8f_store _mm256_store_ps
#define q8f_storeu _mm256_storeu_ps
#define q8f_add _mm256_add_ps
#define q8f_sub _mm256_sub_ps
#define q8f_mul _mm256_mul_ps
#define q8f_div _mm256_div_ps
#define q8f_sqrt _mm256_sqrt_ps
#define q8i_zero _mm256_setzero_si256
#define q8i_max_u32 _mm256_max_epu32

static inline q8_vf q8f_bf16(const uint16_t *s)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)s)), 16));
}

static inline q8_vi q8i_abs_bits(q8_vf x)
{
    return _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fffffff));
}

static inline uint32_t q8i_hmax_u32(q8_vi x)
{
    uint32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, x);
    uint32_t m = 0;
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    return m;
}

#include "q8_fused.h"
#endif
