/* cpu_kernels, q8 Adam step, portable level: plain C, one table entry per element (the same bits on
 * every architecture). */
#include "q8.h"
#define Q8_LEVEL portable

static inline void q8_dequant_block(float *restrict dst, const uint8_t *codes, float absmax,
                                    const uint32_t *map, int len)
{
    for (int i = 0; i < len; i++) dst[i] = bits_f32(map[codes[i]]) * absmax;
}

static inline void q8_quant_block(uint8_t *restrict codes, const float *restrict x, float absmax,
                                  const uint32_t *table, int zero, int len)
{
    for (int i = 0; i < len; i++) codes[i] = q8_code(x[i] / absmax, table, zero);
}

#include "q8_body.h"
