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

/* The vector quantizer (no gather): per octave of |x| (the exponent keys vpermt2ps over 32-entry
 * tables) up to Q8_LINES lines whose minimum t interpolates the rank through every code boundary
 * (q8_codegen.line_tables); rank = floor(t) where t lies 2^-10 or more from an integer, the lanes
 * nearer are returned in *near for q8_code. The positive side of the signed map has one boundary
 * more than the negative (+1.0), the unsigned map none below 0: the rank is clamped per sign. */
typedef struct {
    __m512 line[Q8_LINES][4];  /* slope lo/hi half, offset lo/hi half */
    __m512i zero_code, pos_max, neg_max, top_first;
} q8_quant16_t;

static inline void q8_quant16_init(q8_quant16_t *q, int zero)
{
    const int map = zero ? 0 : 1;
    for (int k = 0; k < Q8_LINES; k++)
        for (int j = 0; j < 4; j++) q->line[k][j] = _mm512_load_ps((const float *)q8_lines[map][k][j >> 1] + 16 * (j & 1));
    q->zero_code = _mm512_set1_epi32(zero);
    q->pos_max = _mm512_set1_epi32(255 - zero);
    q->neg_max = _mm512_set1_epi32(zero);
    q->top_first = _mm512_set1_epi32((int)q8_top_first[map]);
}

static inline __m512i q8_quant16(const q8_quant16_t *q, __m512 xq, __mmask16 *near)
{
    const __m512i u = _mm512_castps_si512(xq);
    const __mmask16 neg = _mm512_movepi32_mask(u);
    /* |x| clamped to [2^-31, 1.0] (rank 0 below, the top rank above, NaN included): its exponent's
     * low 5 bits are the octave */
    __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    mag = _mm512_min_epu32(_mm512_max_epu32(mag, _mm512_set1_epi32(0x30000000)), _mm512_set1_epi32(0x3f800000));
    const __m512 ax = _mm512_castsi512_ps(mag);
    const __m512i key = _mm512_srli_epi32(mag, 23);
    __m512 t = _mm512_fmadd_ps(ax, _mm512_permutex2var_ps(q->line[0][0], key, q->line[0][1]),
                               _mm512_permutex2var_ps(q->line[0][2], key, q->line[0][3]));
    for (int k = 1; k < Q8_LINES; k++)
        t = _mm512_min_ps(t, _mm512_fmadd_ps(ax, _mm512_permutex2var_ps(q->line[k][0], key, q->line[k][1]),
                                             _mm512_permutex2var_ps(q->line[k][2], key, q->line[k][3])));
    const __m512 dist = _mm512_abs_ps(_mm512_sub_ps(t, _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    *near = _mm512_cmp_ps_mask(dist, _mm512_set1_ps(Q8_NEAR), _CMP_LT_OQ);
    __m512i rank = _mm512_cvttps_epi32(t);
    rank = _mm512_mask_mov_epi32(rank, _mm512_cmpge_epu32_mask(mag, q->top_first), q->pos_max);
    rank = _mm512_min_epi32(rank, _mm512_mask_blend_epi32(neg, q->pos_max, q->neg_max));
    return _mm512_mask_blend_epi32(neg, _mm512_add_epi32(q->zero_code, rank), _mm512_sub_epi32(q->zero_code, rank));
}

static inline void q8_quant_block(uint8_t *restrict codes, const float *restrict x, float absmax,
                                  const uint32_t *table, int zero, int len)
{
    q8_quant16_t q;
    q8_quant16_init(&q, zero);
    const __m512 s = _mm512_set1_ps(absmax);
    int i = 0;
    for (; i + 16 <= len; i += 16) {
        __mmask16 near;
        const __m512i code = q8_quant16(&q, _mm512_div_ps(_mm512_load_ps(x + i), s), &near);
        _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(code));
        for (unsigned m = near; m; m &= m - 1) {
            const int j = i + __builtin_ctz(m);
            codes[j] = q8_code(x[j] / absmax, table, zero);
        }
    }
    for (; i < len; i++) codes[i] = q8_code(x[i] / absmax, table, zero);
}

/* Test hook (tests/test_q8_cpu.py): the vector quantizer on the fp32 bit patterns [first, first +
 * count) of map (0 signed, 1 unsigned) against q8_code; returns the mismatches, *near_lanes the
 * lanes that took q8_code. */
int64_t q8_check_quant_avx512(int map, uint32_t first, uint64_t count, int64_t *near_lanes)
{
    q8_quant16_t q;
    const int zero = map == 0 ? 127 : 0;
    q8_quant16_init(&q, zero);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int64_t bad = 0, nears = 0;
    for (uint64_t k = 0; k < count; k += 16) {
        const uint32_t base = first + (uint32_t)k;
        const __m512i u = _mm512_add_epi32(_mm512_set1_epi32((int)base), lane);
        __mmask16 near;
        const __m512i code = q8_quant16(&q, _mm512_castsi512_ps(u), &near);
        uint32_t c[16];
        _mm512_storeu_si512(c, code);
        nears += __builtin_popcount(near);
        for (int j = 0; j < 16 && k + (uint64_t)j < count; j++) {
            if (near >> j & 1) continue;
            bad += c[j] != q8_code(bits_f32(base + (uint32_t)j), q8_buckets[map], zero);
        }
    }
    *near_lanes = nears;
    return bad;
}

#include "q8_body.h"
#endif
