/* Loops of the eb codec's host path, free of Python: _ebkernels.c defines them, _ebhost.c binds them.
 * Sizes are int64_t counts of elements; every buffer is large enough (the bindings check). */
#ifndef RECSTACK_EBKERNELS_H
#define RECSTACK_EBKERNELS_H

#include <stdint.h>

#define EB_ESCAPE 15 /* the nibble that says "this code is in the escape list" */

/* Range of the finite values of v[n] (lo > hi when there are none); *finite = no NaN or Inf at all. */
void eb_minmax(const float *v, int64_t n, float *lo, float *hi, int *finite);

/* inv = 1 / step32 and the codes rint(lo * inv), rint(hi * inv) of the range ends, in float32. */
void eb_grid(double lo, double hi, float step32, float *inv, float *qmin, float *qmax);

/* codes[i] = rint(x[i] * inv) - qmin (0 <= code < 256, |x * inv| < 2**22 guaranteed by the caller);
 * hist[256] counts codes[::stride]. */
void eb_quantize(const float *x, int64_t n, float inv, int qmin, uint8_t *codes, int64_t *hist, int64_t stride);

/* Order-0 entropy (bits per code) of hist[k], and the share of codes more than 7 levels from center. */
void eb_profile(const int64_t *hist, int64_t k, int64_t center, double *bits, double *escapes);

/* Two nibbles per byte, nibble = code - center + 7, 15 (escape) when that is 15 or more; the escaped codes
 * go to escaped[] in order. packed holds (n + 1) / 2 bytes, escaped n. -> number of escapes. */
int64_t eb_pair_pack(const uint8_t *codes, int64_t n, int center, uint8_t *packed, uint8_t *escaped);

/* The inverses: values (float32(code) + float32(qmin)) * step. -> 0, -1 (escape count mismatch) or -2 (a code
 * outside the levels). */
int eb_pair_dequant(const uint8_t *packed, int64_t n, int center, const uint8_t *escaped, int64_t ne, int qmin,
                    float step, int levels, float *out);
int eb_byte_dequant(const uint8_t *codes, int64_t n, int qmin, float step, int levels, float *out);

/* Distinct rows (width bytes each) in order of first occurrence: first[0:u] their row numbers, tokens[r] = 0
 * where row r is a first occurrence, else 1 + the position of the row it repeats. -> u, or -1 (no memory). */
int64_t eb_dedup(const uint8_t *rows, int64_t n, int64_t width, int64_t *first, int64_t *tokens);

/* out[n, d] from distinct rows values[u, d] and tokens (u8[n], or low then high byte planes u8[2n] when wide)
 * -> 0, or -1 when the tokens do not introduce exactly u rows or repeat one not yet introduced. */
int eb_expand(const float *values, int64_t d, const uint8_t *tokens, int64_t n, int64_t u, int wide, float *out);

/* Sums of the little-endian uint32 words of p[len] (whole words only): plain and weighted by position from 1. */
void eb_word_sums(const uint8_t *p, int64_t len, uint64_t *s1, uint64_t *s2);

#endif
