/* cpu_kernels, q8 Adam step, AVX-512 level (F, BW, VL, DQ; VBMI where present): 16 lanes, no
 * gathers. The map by byte-plane vpermt2b (VBMI) or by vpermt2ps from registers; codes from
 * per-octave lines of x·(1/absmax), the lanes near a boundary by q8_code; a block's codes written
 * inside the next block's Adam loop (q8_fused.h's pipeline). */
#include "q8.h"
#define Q8_LEVEL avx512

#if defined(__x86_64__)
/* Above the target pragma: plain x86-64 code, as it runs at load on every CPU (an AVX-512 build
 * of the constructor killed AVX2-only hosts with SIGILL; tests/test_x86_cpu_models.py). */
/* AVX512-VBMI (Ice Lake, Zen 4 and later; not Skylake-X): the map as 4 byte planes of 256 bytes,
 * each looked up for 64 codes by 2 vpermt2b (128 entries each) and a blend on the code's top bit,
 * then interleaved back to dwords. The unpacks put byte 16L + 4j + i of a 128-bit lane L into
 * dword vector j, so the codes are first transposed as 4x4 blocks of dwords (vpermd): vector j
 * then holds codes 16j .. 16j + 15 in order. Detected once at run time; q8_avx512_use_vbmi turns
 * it off (and on again) so the tests hold both paths to the reference. */
static int q8_vbmi;
static uint8_t q8_planes[2][4][256] __attribute__((aligned(64)));  /* [map][byte][code] */

__attribute__((constructor)) static void q8_avx512_init(void)
{
    for (int m = 0; m < 2; m++)
        for (int b = 0; b < 4; b++)
            for (int c = 0; c < 256; c++) q8_planes[m][b][c] = (uint8_t)(q8_maps[m][c] >> (8 * b));
    __builtin_cpu_init();
    q8_vbmi = __builtin_cpu_supports("avx512vbmi") ? 1 : 0;
}

/* on < 0: whether the VBMI dequantizer is in use; 0 / 1: turn it off / on (-1: this CPU lacks VBMI).
 * Not while a step runs. */
int q8_avx512_use_vbmi(int on)
{
    if (on < 0) return q8_vbmi;
    if (on && !__builtin_cpu_supports("avx512vbmi")) return -1;
    q8_vbmi = on ? 1 : 0;
    return q8_vbmi;
}

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

__attribute__((target("avx512f,avx512bw,avx512vbmi"), noinline)) static void q8_dequant_vbmi(
    float *restrict dst, const uint8_t *codes, float absmax, const uint8_t (*planes)[256], int len)
{
    __m512i t[4][4];
    for (int b = 0; b < 4; b++)
        for (int j = 0; j < 4; j++) t[b][j] = _mm512_load_si512((const void *)(planes[b] + 64 * j));
    const __m512i transpose = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512 s = _mm512_set1_ps(absmax);
    int i = 0;
    for (; i + 64 <= len; i += 64) {
        const __m512i idx = _mm512_permutexvar_epi32(transpose, _mm512_loadu_si512((const void *)(codes + i)));
        const __mmask64 top = _mm512_movepi8_mask(idx);
        __m512i p[4];
        for (int b = 0; b < 4; b++)
            p[b] = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(t[b][0], idx, t[b][1]),
                                          _mm512_permutex2var_epi8(t[b][2], idx, t[b][3]));
        const __m512i lo01 = _mm512_unpacklo_epi8(p[0], p[1]), hi01 = _mm512_unpackhi_epi8(p[0], p[1]);
        const __m512i lo23 = _mm512_unpacklo_epi8(p[2], p[3]), hi23 = _mm512_unpackhi_epi8(p[2], p[3]);
        _mm512_store_ps(dst + i, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23)), s));
        _mm512_store_ps(dst + i + 16, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23)), s));
        _mm512_store_ps(dst + i + 32, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23)), s));
        _mm512_store_ps(dst + i + 48, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23)), s));
    }
    for (; i < len; i++) {
        const uint8_t c = codes[i];
        dst[i] = bits_f32((uint32_t)planes[0][c] | (uint32_t)planes[1][c] << 8 | (uint32_t)planes[2][c] << 16 |
                          (uint32_t)planes[3][c] << 24) * absmax;
    }
}

static void q8_dequant_perm(float *restrict dst, const uint8_t *codes, float absmax, const uint32_t *map, int len)
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

static inline void q8_dequant_block(float *restrict dst, const uint8_t *codes, float absmax,
                                    const uint32_t *map, int len)
{
    /* map is q8_maps[0] (signed) or q8_maps[1]: q8_body.h passes the codebook's rows */
    if (q8_vbmi) q8_dequant_vbmi(dst, codes, absmax, q8_planes[map == q8_maps[0] ? 0 : 1], len);
    else q8_dequant_perm(dst, codes, absmax, map, len);
}

/* The vector quantizer (no gather): per octave of |x| (the exponent keys vpermt2ps over 32-entry
 * tables) up to Q8_LINES lines whose minimum, raised to the top line, is t (q8.h): floor(t) is the
 * code where t's fraction is 2·Q8_NEAR or more, the lanes below take q8_code. Per 16 lanes: 4
 * permutes, 3 FMAs, 2 min/max (signed map; unsigned one line more), a bit test for the fraction. |x| is clamped to the octaves the
 * tables cover, [2^-31, 1.0] (NaN takes the top), and the unsigned map's x <= -0 (rank 0) to 2^-31 by
 * the same signed max; the signed map's negative codes are 255 - t (the lines carry the zero code:
 * t = 127 + rank + Q8_NEAR), so neither map clamps ranks per sign. bounded: the caller guarantees a
 * finite |x| <= 1 + 2^-23 (x·(1/absmax) with |x| <= absmax, both normal: q8_recip_ok), so |x| needs
 * no upper clamp, and the signed map's |x| and lower clamp are one vrangeps. */
static inline __attribute__((always_inline)) __m512 q8_rank16(__m512 xq, const int map, const int bounded)
{
    const float (*line)[2][32] = (const float (*)[2][32])(const void *)q8_lines[map];
    const __m512i u = _mm512_castps_si512(xq), lowest = _mm512_set1_epi32(0x30000000);
    __m512i mag;
    if (map == 0 && bounded) {
        mag = _mm512_castps_si512(_mm512_range_ps(xq, _mm512_castsi512_ps(lowest), 0x0b));  /* max |.|, sign 0 */
    } else {
        mag = map == 0 ? _mm512_max_epu32(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), lowest)
                       : _mm512_max_epi32(u, lowest);
        if (!bounded) mag = _mm512_min_epu32(mag, _mm512_set1_epi32(0x3f800000));
    }
    const __m512 ax = _mm512_castsi512_ps(mag);
    const int shift = map == 0 ? Q8_LINE_SHIFT_SIGNED : Q8_LINE_SHIFT_UNSIGNED;
    const __m512i key = _mm512_srli_epi32(shift ? _mm512_add_epi32(mag, _mm512_set1_epi32(shift)) : mag, 23);
#define Q8_LINE(k)                                                                                       \
    _mm512_fmadd_ps(ax, _mm512_permutex2var_ps(_mm512_load_ps(line[k][0]), key, _mm512_load_ps(line[k][0] + 16)), \
                    _mm512_permutex2var_ps(_mm512_load_ps(line[k][1]), key, _mm512_load_ps(line[k][1] + 16)))
    __m512 t = Q8_LINE(0);
    for (int k = 1; k < (map == 0 ? Q8_LINES_SIGNED : Q8_LINES_UNSIGNED); k++) t = _mm512_min_ps(t, Q8_LINE(k));
#undef Q8_LINE
    /* the top line from its first bucket on: there, and only there, it may lie above the minimum */
    const __mmask16 top = _mm512_cmpge_epu32_mask(mag, _mm512_set1_epi32((int)(((Q8_TOP_BUCKET + 96u) << 23) - shift)));
    return _mm512_mask_max_ps(t, top, t, _mm512_fmadd_ps(ax, _mm512_set1_ps(bits_f32(q8_top_line[map][0])),
                                                         _mm512_set1_ps(bits_f32(q8_top_line[map][1]))));
}

/* t lies in [256, 512) (the lines carry 256), so its fraction is its low 15 bits: below 2·Q8_NEAR
 * (8 of them) the lane takes q8_code */
static inline __mmask16 q8_near16(__m512 t)
{
    return _mm512_testn_epi32_mask(_mm512_castps_si512(t), _mm512_set1_epi32(0x7ff8));
}

/* the 16 codes (bytes) of t for x, by integer ops (no float-to-int conversion, no packing): t lies
 * in [256, 512), where its bits are 256's with floor(t) - 256 = the code in bits 15..22, so a shift
 * and the truncation to bytes give it. A negative x's signed code is 127 - rank = 254 - that, away
 * from an integer, and 0 for t in [511, 512): a saturating byte subtraction. */
static inline __attribute__((always_inline)) __m128i q8_code16(__m512 t, __m512 xq, const int map)
{
    const __m128i c = _mm512_cvtepi32_epi8(_mm512_srli_epi32(_mm512_castps_si512(t), 15));
    if (map != 0) return c;
    return _mm_mask_subs_epu8(c, _mm512_movepi32_mask(_mm512_castps_si512(xq)), _mm_set1_epi8((char)254), c);
}

static inline __attribute__((always_inline)) __m128i q8_quant16(__m512 xq, const int map, const int bounded,
                                                                __mmask16 *near)
{
    const __m512 t = q8_rank16(xq, map, bounded);
    *near = q8_near16(t);
    return q8_code16(t, xq, map);
}

static inline void q8_store16(uint8_t *codes, __m128i code)
{
    _mm_storeu_si128((__m128i *)codes, code);
}

/* the lanes of near (16 from x) by the scalar quantizer */
static inline void q8_fix_near(uint8_t *codes, const float *x, unsigned near, float absmax, int map)
{
    for (; near; near &= near - 1) {
        const int j = __builtin_ctz(near);
        codes[j] = q8_code(x[j] / absmax, q8_buckets[map], map == 0 ? 127 : 0);
    }
}

static inline __attribute__((always_inline)) void q8_quant_map(uint8_t *restrict codes, const float *restrict x,
                                                               float absmax, const int map, int len)
{
    const int recip = q8_recip_ok(absmax);
    const __m512 s = _mm512_set1_ps(recip ? 1.0f / absmax : absmax);
    int i = 0;
    for (; i + 16 <= len; i += 16) {
        __mmask16 near;
        const __m512 xv = _mm512_load_ps(x + i);
        if (recip) q8_store16(codes + i, q8_quant16(_mm512_mul_ps(xv, s), map, 1, &near));
        else q8_store16(codes + i, q8_quant16(_mm512_div_ps(xv, s), map, 0, &near));
        if (__builtin_expect(near != 0, 0)) q8_fix_near(codes + i, x + i, near, absmax, map);
    }
    for (; i < len; i++) codes[i] = q8_code(x[i] / absmax, q8_buckets[map], map == 0 ? 127 : 0);
}

static inline void q8_quant_block(uint8_t *restrict codes, const float *restrict x, float absmax,
                                  const uint32_t *table, int zero, int len)
{
    (void)table;  /* q8_buckets[map]: q8_body.h passes the codebook's rows */
    if (zero) q8_quant_map(codes, x, absmax, 0, len);
    else q8_quant_map(codes, x, absmax, 1, len);
}

/* Test hook (tests/test_q8_cpu.py): the vector quantizer on the fp32 bit patterns [first, first +
 * count) of map (0 signed, 1 unsigned; + 2: its bounded form, for the patterns it may see) against
 * q8_code at every pattern within Q8_SLACK of each (q8_slack_agrees); returns the mismatches,
 * *near_lanes the lanes that took q8_code. */
static inline __attribute__((always_inline)) int64_t q8_check_quant_map(const int map, const int bounded,
                                                                       uint32_t first, uint64_t count,
                                                                       int64_t *near_lanes)
{
    const int zero = map == 0 ? 127 : 0;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int64_t bad = 0, nears = 0;
    for (uint64_t k = 0; k < count; k += 16) {
        const uint32_t base = first + (uint32_t)k;
        const __m512i u = _mm512_add_epi32(_mm512_set1_epi32((int)base), lane);
        __mmask16 near;
        const __m512i code = _mm512_cvtepu8_epi32(q8_quant16(_mm512_castsi512_ps(u), map, bounded, &near));
        uint32_t c[16];
        _mm512_storeu_si512(c, code);
        nears += __builtin_popcount(near);
        for (int j = 0; j < 16 && k + (uint64_t)j < count; j++) {
            if (near >> j & 1) continue;
            bad += !q8_slack_agrees(c[j] & 0xffu, base + (uint32_t)j, q8_buckets[map], zero);
        }
    }
    *near_lanes = nears;
    return bad;
}

int64_t q8_check_quant_avx512(int map, uint32_t first, uint64_t count, int64_t *near_lanes)
{
    switch (map) {
    case 0: return q8_check_quant_map(0, 0, first, count, near_lanes);
    case 1: return q8_check_quant_map(1, 0, first, count, near_lanes);
    case 2: return q8_check_quant_map(0, 1, first, count, near_lanes);
    default: return q8_check_quant_map(1, 1, first, count, near_lanes);
    }
}

/* The generic loop (q8_body.h) serves every format; the common one below fuses its passes. */
#undef Q8_LEVEL
#define Q8_LEVEL avx512_generic
#include "q8_body.h"

/* The fused pass (q8_fused.h) over 16 lanes. */
#undef Q8_LEVEL
#define Q8_LEVEL avx512
#define Q8_GENERIC q8_range_avx512_generic
#define Q8_W 16
typedef __m512 q8_vf;
typedef __m512i q8_vi;
#define q8f_set1 _mm512_set1_ps
#define q8f_load _mm512_load_ps
#define q8f_loadu _mm512_loadu_ps
#define q8f_store _mm512_store_ps
#define q8f_storeu _mm512_storeu_ps
#define q8f_add _mm512_add_ps
#define q8f_sub _mm512_sub_ps
#define q8f_mul _mm512_mul_ps
#define q8f_div _mm512_div_ps
#define q8f_sqrt _mm512_sqrt_ps
#define q8i_zero _mm512_setzero_si512
#define q8i_max_u32 _mm512_max_epu32

static inline q8_vf q8f_bf16(const uint16_t *s)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)s)), 16));
}

static inline q8_vi q8i_abs_bits(q8_vf x)
{
    return _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
}

static inline uint32_t q8i_hmax_u32(q8_vi x) { return (uint32_t)_mm512_reduce_max_epu32(x); }

/* 16 lanes of both moments' codes: mb and vb their new values, sm and sv the reciprocals of their
 * absmaxes ma and va (both q8_recip_ok). Two independent chains for the scheduler and one near-lane
 * branch: a lane near in either moment takes q8_code in both. */
static inline __attribute__((always_inline)) void q8_pair16(uint8_t *mc, const float *mb, __m512 sm, float ma,
                                                            uint8_t *vc, const float *vb, __m512 sv, float va)
{
    const __m512 xm = _mm512_mul_ps(_mm512_load_ps(mb), sm), xv = _mm512_mul_ps(_mm512_load_ps(vb), sv);
    const __m512 tm = q8_rank16(xm, 0, 1), tv = q8_rank16(xv, 1, 1);
    const __mmask16 near = q8_near16(tm) | q8_near16(tv);
    _mm_storeu_si128((__m128i *)mc, q8_code16(tm, xm, 0));
    _mm_storeu_si128((__m128i *)vc, q8_code16(tv, xv, 1));
    if (__builtin_expect(near != 0, 0)) {
        q8_fix_near(mc, mb, near, ma, 0);
        q8_fix_near(vc, vb, near, va, 1);
    }
}

/* Both moments' codes of a whole block (q8_fused.h's Q8_CODES_OUT_PAIR). A block whose absmax is 0 or
 * takes the division (q8_recip_ok) goes the one-moment way. */
static inline void q8_codes_out_pair(uint8_t *mc, float *ma_out, const float *restrict mb, uint32_t mx_m, uint8_t *vc,
                                     float *va_out, const float *restrict vb, uint32_t mx_v, int len)
{
    const float ma = bits_f32(mx_m), va = bits_f32(mx_v);
    if (len != Q8_BLOCK || !q8_recip_ok(ma) || !q8_recip_ok(va)) {
        q8_codes_out(mc, ma_out, mb, mx_m, 0, len);
        q8_codes_out(vc, va_out, vb, mx_v, 1, len);
        return;
    }
    *ma_out = ma;
    *va_out = va;
    const __m512 sm = _mm512_set1_ps(1.0f / ma), sv = _mm512_set1_ps(1.0f / va);
    for (int i = 0; i < Q8_BLOCK; i += 16) q8_pair16(mc + i, mb + i, sm, ma, vc + i, vb + i, sv, va);
}
#define Q8_CODES_OUT_PAIR q8_codes_out_pair
/* a block's codes written by the next block's arithmetic loop, beside its divisions */
#define Q8_PAIR_CHUNK q8_pair16

/* The streams prefetched 2048 lanes ahead, a line of each as the arithmetic loop reaches it (q8_fused.h):
 * 2 threads, 16 Mi elements, an Intel Xeon with AVX-512 (docs/benchmarks.md). Forty prefetches at
 * each block's start (4 blocks ahead) left the pipelined loop waiting on its loads from DRAM. */
#define Q8_LANES_AHEAD 2048

#include "q8_fused.h"
#endif
