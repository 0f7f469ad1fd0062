/* cpu_kernels, q8 Adam step, AVX-512 level (F, BW, VL, DQ): 16 lanes, the map and the bucket
 * table read by gathers. */
#include "q8.h"
#define Q8_LEVEL avx512

#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include <immintrin.h>

/* map[code] for 16 codes without a gather: the map's 256 values are 16 registers; permutex2var
 * picks within each pair of them (the code's low 5 bits), the top 3 bits pick the pair */
static inline __m512 q8_lookup16(__m512i idx, const __m512 *t)
{
    const __mmask16 b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
    const __mmask16 b6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
    const __mmask16 b7 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(128));
    __m512 r[8];
    for (int j = 0; j < 8; j++) r[j] = _mm512_permutex2var_ps(t[2 * j], idx, t[2 * j + 1]);
    const __m512 a0 = _mm512_mask_blend_ps(b5, r[0], r[1]), a1 = _mm512_mask_blend_ps(b5, r[2], r[3]);
    const __m512 a2 = _mm512_mask_blend_ps(b5, r[4], r[5]), a3 = _mm512_mask_blend_ps(b5, r[6], r[7]);
    const __m512 c0 = _mm512_mask_blend_ps(b6, a0, a1), c1 = _mm512_mask_blend_ps(b6, a2, a3);
    return _mm512_mask_blend_ps(b7, c0, c1);
}

static inline void q8_dequant_block(float *restrict dst, const uint8_t *codes, float absmax,
                                    const uint32_t *map, int len)
{
    __m512 t[16];
    for (int j = 0; j < 16; j++) t[j] = _mm512_load_ps((const float *)map + 16 * j);
    const __m512 s = _mm512_set1_ps(absmax);
    int i = 0;
    for (; i + 16 <= len; i += 16) {
        const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + i)));
        _mm512_store_ps(dst + i, _mm512_mul_ps(q8_lookup16(idx, t), s));
    }
    for (; i < len; i++) dst[i] = bits_f32(map[codes[i]]) * absmax;
}

static inline void q8_quant_block(uint8_t *restrict codes, const float *restrict x, float absmax,
                                  const uint32_t *table, int zero, int len)
{
    const __m512 s = _mm512_set1_ps(absmax);
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), low16 = _mm512_set1_epi32(0xffff);
    const __m512i low17 = _mm512_set1_epi32(0x1ffff), first = _mm512_set1_epi32(Q8_KEY_FIRST);
    const __m512i last = _mm512_set1_epi32(Q8_KEYS - 1), keys = _mm512_set1_epi32(Q8_KEYS);
    const __m512i zero_code = _mm512_set1_epi32(zero), one = _mm512_set1_epi32(1);
    int i = 0;
    for (; i + 16 <= len; i += 16) {
        const __m512i u = _mm512_castps_si512(_mm512_div_ps(_mm512_load_ps(x + i), s));
        const __m512i mag = _mm512_and_si512(u, abs_mask);
        const __mmask16 neg = _mm512_movepi32_mask(u);  /* x <= -0 */
        __m512i key = _mm512_sub_epi32(_mm512_srli_epi32(mag, 16), first);
        key = _mm512_min_epi32(_mm512_max_epi32(key, _mm512_setzero_si512()), last);
        key = _mm512_mask_add_epi32(key, neg, key, keys);
        const __m512i entry = _mm512_i32gather_epi32(key, (const int *)table, 4);
        const __mmask16 steps = _mm512_cmpge_epu32_mask(_mm512_and_si512(mag, low16), _mm512_and_si512(entry, low17));
        __m512i rank = _mm512_srli_epi32(entry, 17);
        rank = _mm512_mask_add_epi32(rank, steps, rank, one);
        const __m512i code = _mm512_mask_blend_epi32(neg, _mm512_add_epi32(zero_code, rank),
                                                     _mm512_sub_epi32(zero_code, rank));
        _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(code));
    }
    for (; i < len; i++) codes[i] = q8_code(x[i] / absmax, table, zero);
}

#include "q8_body.h"
#endif
