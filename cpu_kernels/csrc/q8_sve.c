/* cpu_kernels, q8 Adam step, SVE level: vector-length agnostic, svcntw() lanes a step and the last
 * step under a whilelt predicate (no scalar tail).
 *
 * Dequantizing gathers map[code] (LD1W, 32-bit indices) and multiplies by the absmax; quantizing
 * divides by the absmax (FDIV, IEEE) and computes q8_code's formula lane-wise — key from the bits,
 * the bucket table's entry by a gather, the rank from it. Both are bitwise the portable level by
 * construction: the same table bits, the same fp32 multiply and division (subnormals kept: FPCR.FZ
 * is off), the same integer formula, at every vector length.
 */
#include "q8.h"
#define Q8_LEVEL sve

#ifdef HYBRID_HAVE_SVE
#pragma GCC target("+sve")
#include <arm_sve.h>

static inline void q8_dequant_block(float *restrict dst, const uint8_t *codes, float absmax,
                                    const uint32_t *map, int len)
{
    const svfloat32_t s = svdup_n_f32(absmax);
    for (int i = 0; i < len; i += (int)svcntw()) {
        const svbool_t pg = svwhilelt_b32_s32(i, len);
        const svuint32_t idx = svld1ub_u32(pg, codes + i);
        const svfloat32_t v = svld1_gather_u32index_f32(pg, (const float *)map, idx);
        svst1_f32(pg, dst + i, svmul_f32_x(pg, v, s));
    }
}

static inline void q8_quant_block(uint8_t *restrict codes, const float *restrict x, float absmax,
                                  const uint32_t *table, int zero, int len)
{
    const svfloat32_t s = svdup_n_f32(absmax);
    const svuint32_t z = svdup_n_u32((uint32_t)zero);
    for (int i = 0; i < len; i += (int)svcntw()) {
        const svbool_t pg = svwhilelt_b32_s32(i, len);
        const svuint32_t u = svreinterpret_u32_f32(svdiv_f32_x(pg, svld1_f32(pg, x + i), s));
        const svuint32_t mag = svand_n_u32_x(pg, u, 0x7fffffffu);
        const svbool_t neg = svcmplt_n_s32(pg, svreinterpret_s32_u32(u), 0);  /* x <= -0 */
        svint32_t key = svsub_n_s32_x(pg, svreinterpret_s32_u32(svlsr_n_u32_x(pg, mag, 16)), Q8_KEY_FIRST);
        key = svmin_n_s32_x(pg, svmax_n_s32_x(pg, key, 0), Q8_KEYS - 1);
        const svuint32_t row = svadd_n_u32_m(neg, svreinterpret_u32_s32(key), Q8_KEYS);
        const svuint32_t entry = svld1_gather_u32index_u32(pg, table, row);
        /* rank = entry >> 17, + 1 where |x|'s low 16 bits reach the step */
        const svbool_t reached =
            svcmpge_u32(pg, svand_n_u32_x(pg, mag, 0xffffu), svand_n_u32_x(pg, entry, 0x1ffffu));
        const svuint32_t rank = svadd_n_u32_m(reached, svlsr_n_u32_x(pg, entry, 17), 1);
        svst1b_u32(pg, codes + i, svsel_u32(neg, svsub_u32_x(pg, z, rank), svadd_u32_x(pg, z, rank)));
    }
}

#include "q8_body.h"
#endif
