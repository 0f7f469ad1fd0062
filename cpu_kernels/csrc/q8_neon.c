/* cpu_kernels, q8 Adam step, NEON level (AArch64 Advanced SIMD): 16 codes a step.
 *
 * Dequantizing looks the map up with TBL: the 256 fp32 values are split into four byte planes
 * (plane k holds byte k of every value, built once at load time); one plane at a time, its 256
 * bytes are 16 registers and four TBL/TBX of 64 bytes each give the plane's byte of 16 codes; the
 * planes are zipped back into fp32 bits and multiplied by the absmax. Quantizing divides by the
 * absmax (FDIV, IEEE) and computes q8_code's formula on 4 lanes — key from the bits, rank from
 * the bucket table's entry — with the entries read one lane at a time (AArch64 has no gather).
 * Both are bitwise the portable level by construction: the same table bits, the same fp32
 * multiply and division (AArch64 keeps subnormals: FPCR.FZ is off), the same integer formula.
 */
#include "q8.h"
#define Q8_LEVEL neon

#if defined(__aarch64__)
#include <arm_neon.h>

/* [map][k][code]: byte k (little-endian) of q8_maps[map][code] */
static uint8_t q8_planes[2][4][256] __attribute__((aligned(64)));

__attribute__((constructor)) static void q8_planes_init(void)
{
    for (int m = 0; m < 2; m++)
        for (int k = 0; k < 4; k++)
            for (int c = 0; c < 256; c++) q8_planes[m][k][c] = (uint8_t)(q8_maps[m][c] >> (8 * k));
}

/* one plane's byte of map[code] for 16 codes (t: the plane's 256 bytes as four tables of 64): TBL
 * answers codes 0-63, each TBX the next 64 and keeps what the others answered */
static inline uint8x16_t q8_plane16(const uint8x16x4_t *t, uint8x16_t idx)
{
    const uint8x16_t q = vdupq_n_u8(64);
    uint8x16_t r = vqtbl4q_u8(t[0], idx);
    idx = vsubq_u8(idx, q);
    r = vqtbx4q_u8(r, t[1], idx);
    idx = vsubq_u8(idx, q);
    r = vqtbx4q_u8(r, t[2], idx);
    idx = vsubq_u8(idx, q);
    return vqtbx4q_u8(r, t[3], idx);
}

static inline void q8_dequant_block(float *restrict dst, const uint8_t *codes, float absmax,
                                    const uint32_t *map, int len)
{
    /* the planes are q8_maps'; another map (none today) takes the scalar loop */
    const uint8_t(*planes)[256] = map == q8_maps[0] ? q8_planes[0] : map == q8_maps[1] ? q8_planes[1] : NULL;
    const int vec = planes ? len & ~15 : 0;
    uint8_t bytes[4][Q8_BLOCK] __attribute__((aligned(16)));
    for (int k = 0; k < 4 && vec; k++) {
        uint8x16x4_t t[4];
        for (int j = 0; j < 4; j++) t[j] = vld1q_u8_x4(planes[k] + 64 * j);
        for (int i = 0; i < vec; i += 16) vst1q_u8(bytes[k] + i, q8_plane16(t, vld1q_u8(codes + i)));
    }
    const float32x4_t s = vdupq_n_f32(absmax);
    for (int i = 0; i < vec; i += 16) {
        const uint8x16_t b0 = vld1q_u8(bytes[0] + i), b1 = vld1q_u8(bytes[1] + i);
        const uint8x16_t b2 = vld1q_u8(bytes[2] + i), b3 = vld1q_u8(bytes[3] + i);
        /* byte pairs (planes 0-1, 2-3) into halfwords, then halfword pairs into words */
        const uint16x8_t lo01 = vreinterpretq_u16_u8(vzip1q_u8(b0, b1));
        const uint16x8_t hi01 = vreinterpretq_u16_u8(vzip2q_u8(b0, b1));
        const uint16x8_t lo23 = vreinterpretq_u16_u8(vzip1q_u8(b2, b3));
        const uint16x8_t hi23 = vreinterpretq_u16_u8(vzip2q_u8(b2, b3));
        const uint16x8_t w[4] = {vzip1q_u16(lo01, lo23), vzip2q_u16(lo01, lo23), vzip1q_u16(hi01, hi23),
                                 vzip2q_u16(hi01, hi23)};
        for (int j = 0; j < 4; j++) vst1q_f32(dst + i + 4 * j, vmulq_f32(vreinterpretq_f32_u16(w[j]), s));
    }
    for (int i = vec; i < len; i++) dst[i] = bits_f32(map[codes[i]]) * absmax;
}

/* q8_code of 4 lanes of x / absmax */
static inline uint32x4_t q8_code4(float32x4_t xq, const uint32_t *table, uint32x4_t zero)
{
    const uint32x4_t u = vreinterpretq_u32_f32(xq);
    const uint32x4_t mag = vandq_u32(u, vdupq_n_u32(0x7fffffffu));
    const uint32x4_t neg = vcltzq_s32(vreinterpretq_s32_u32(u));  /* all ones where x <= -0 */
    int32x4_t key = vsubq_s32(vreinterpretq_s32_u32(vshrq_n_u32(mag, 16)), vdupq_n_s32(Q8_KEY_FIRST));
    key = vminq_s32(vmaxq_s32(key, vdupq_n_s32(0)), vdupq_n_s32(Q8_KEYS - 1));
    const uint32x4_t row = vaddq_u32(vreinterpretq_u32_s32(key), vandq_u32(neg, vdupq_n_u32(Q8_KEYS)));
    uint32x4_t entry = vdupq_n_u32(0);
    entry = vld1q_lane_u32(table + vgetq_lane_u32(row, 0), entry, 0);
    entry = vld1q_lane_u32(table + vgetq_lane_u32(row, 1), entry, 1);
    entry = vld1q_lane_u32(table + vgetq_lane_u32(row, 2), entry, 2);
    entry = vld1q_lane_u32(table + vgetq_lane_u32(row, 3), entry, 3);
    /* rank = entry >> 17, + 1 where |x|'s low 16 bits reach the step (a true compare is all ones) */
    const uint32x4_t reached =
        vcgeq_u32(vandq_u32(mag, vdupq_n_u32(0xffffu)), vandq_u32(entry, vdupq_n_u32(0x1ffffu)));
    const uint32x4_t rank = vsubq_u32(vshrq_n_u32(entry, 17), reached);
    return vbslq_u32(neg, vsubq_u32(zero, rank), vaddq_u32(zero, rank));
}

static inline void q8_quant_block(uint8_t *restrict codes, const float *restrict x, float absmax,
                                  const uint32_t *table, int zero, int len)
{
    const float32x4_t s = vdupq_n_f32(absmax);
    const uint32x4_t z = vdupq_n_u32((uint32_t)zero);
    int i = 0;
    for (; i + 16 <= len; i += 16) {
        uint32x4_t c[4];
        for (int j = 0; j < 4; j++) c[j] = q8_code4(vdivq_f32(vld1q_f32(x + i + 4 * j), s), table, z);
        const uint16x8_t lo = vcombine_u16(vmovn_u32(c[0]), vmovn_u32(c[1]));
        const uint16x8_t hi = vcombine_u16(vmovn_u32(c[2]), vmovn_u32(c[3]));
        vst1q_u8(codes + i, vcombine_u8(vmovn_u16(lo), vmovn_u16(hi)));
    }
    for (; i < len; i++) codes[i] = q8_code(x[i] / absmax, table, zero);
}

#include "q8_body.h"
#endif
