/* Loops of the eb codec's host path (declared in _ebkernels.h, bound to Python by _ebhost.c).
 *
 * numpy needs one pass, and one temporary, per operation; these loops do the value range, quantization
 * with the code histogram, the nibble layout, row deduplication, dequantization, row expansion and the
 * checksum sums in one pass each. They give bit for bit what the numpy code in recstack/compression
 * gives (float32 arithmetic in the same order, no FMA contraction: see setup.py).
 */
#include "_ebkernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* Whether any of the 16 nibbles of a 64-bit word is 15 (an escape): AND each nibble's four bits. */
static int has_escape(uint64_t w) {
    uint64_t t = w & (w >> 1);
    t &= t >> 2;
    return (t & 0x1111111111111111ULL) != 0;
}

/* Runs body for the index i of every nibble 15 among the first n nibbles of packed (low nibble first);
 * whole words without one are skipped with a few bit operations each. */
#define FOR_EACH_ESCAPE(packed, n, i, body)                                                 \
    do {                                                                                     \
        const int64_t nbytes_ = ((n) + 1) / 2;                                               \
        for (int64_t w_ = 0; w_ < nbytes_; w_ += 8) {                                        \
            uint64_t word_ = 0;                                                              \
            memcpy(&word_, (packed) + w_, nbytes_ - w_ < 8 ? (size_t)(nbytes_ - w_) : 8);    \
            if (!has_escape(word_)) continue;                                                \
            for (int64_t i = 2 * w_; i < 2 * w_ + 16 && i < (n); i++) {                      \
                uint8_t z_ = (i & 1) ? (uint8_t)((packed)[i >> 1] >> 4) : (uint8_t)((packed)[i >> 1] & 15); \
                if (z_ == EB_ESCAPE) { body; }                                               \
            }                                                                                \
        }                                                                                    \
    } while (0)

/* The first pass keeps 4 lanes (SSE2 where there is SSE2) and looks for NaN and Inf by their exponent bits;
 * only when there is one does a second pass skip them. */
void eb_minmax(const float *v, int64_t n, float *lo_out, float *hi_out, int *finite) {
    float lo = INFINITY, hi = -INFINITY;
    int64_t i = 0;
    uint32_t special = 0; /* nonzero when some value has an all-ones exponent (NaN or Inf) */
#ifdef __SSE2__
    __m128 l4 = _mm_set1_ps(INFINITY), h4 = _mm_set1_ps(-INFINITY);
    const __m128i expo = _mm_set1_epi32(0x7F800000);
    __m128i sp = _mm_setzero_si128();
    for (; i + 4 <= n; i += 4) {
        __m128 a = _mm_loadu_ps(v + i);
        l4 = _mm_min_ps(l4, a);
        h4 = _mm_max_ps(h4, a);
        sp = _mm_or_si128(sp, _mm_cmpeq_epi32(_mm_and_si128(_mm_castps_si128(a), expo), expo));
    }
    float l[4], h[4];
    uint32_t s4[4];
    _mm_storeu_ps(l, l4);
    _mm_storeu_ps(h, h4);
    _mm_storeu_si128((__m128i *)s4, sp);
    for (int k = 0; k < 4; k++) {
        lo = l[k] < lo ? l[k] : lo;
        hi = h[k] > hi ? h[k] : hi;
        special |= s4[k];
    }
#endif
    for (; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, v + i, 4);
        special |= (bits & 0x7F800000u) == 0x7F800000u;
        lo = v[i] < lo ? v[i] : lo;
        hi = v[i] > hi ? v[i] : hi;
    }
    *finite = special == 0;
    if (special) { /* again, over the finite values only */
        lo = INFINITY, hi = -INFINITY;
        for (int64_t k = 0; k < n; k++)
            if (isfinite(v[k])) {
                lo = v[k] < lo ? v[k] : lo;
                hi = v[k] > hi ? v[k] : hi;
            }
    }
    *lo_out = lo;
    *hi_out = hi;
}

void eb_grid(double lo, double hi, float step32, float *inv, float *qmin, float *qmax) {
    *inv = 1.0f / step32;
    *qmin = rintf((float)lo * *inv);
    *qmax = rintf((float)hi * *inv);
}

/* rint is (v + 1.5 * 2**23) - 1.5 * 2**23: exact round-half-even in float32 for |v| < 2**22, and unlike
 * rintf it vectorizes on every x86-64. */
void eb_quantize(const float *xs, int64_t n, float inv, int qmin, uint8_t *c, int64_t *h, int64_t stride) {
    const float fq = (float)qmin, magic = 12582912.0f;
    int64_t i = 0;
#ifdef __SSE2__
    /* 16 values per round: the same float32 operations, then int32 -> int16 -> uint8 with saturation
     * (codes are within [0, 255], so saturation never changes one) */
    const __m128 vinv = _mm_set1_ps(inv), vmagic = _mm_set1_ps(magic), vfq = _mm_set1_ps(fq);
    for (; i + 16 <= n; i += 16) {
        __m128i q[4];
        for (int k = 0; k < 4; k++) {
            __m128 a = _mm_mul_ps(_mm_loadu_ps(xs + i + 4 * k), vinv);
            a = _mm_sub_ps(_mm_sub_ps(_mm_add_ps(a, vmagic), vmagic), vfq);
            q[k] = _mm_cvttps_epi32(a);
        }
        __m128i lo16 = _mm_packs_epi32(q[0], q[1]), hi16 = _mm_packs_epi32(q[2], q[3]);
        _mm_storeu_si128((__m128i *)(c + i), _mm_packus_epi16(lo16, hi16));
    }
#endif
    for (; i < n; i++) {
        float r = (xs[i] * inv + magic) - magic;
        c[i] = (uint8_t)(int32_t)(r - fq);
    }
    /* four histograms in turn: peaked codes hit one bin, and one counter would serialize the adds */
    int64_t part[4][256];
    memset(part, 0, sizeof(part));
    if (stride < 1) stride = 1;
    int64_t k = 0;
    for (i = 0; i < n; i += stride, k++) part[k & 3][c[i]]++;
    for (int b = 0; b < 256; b++) h[b] = part[0][b] + part[1][b] + part[2][b] + part[3][b];
}

void eb_profile(const int64_t *c, int64_t k, int64_t center, double *bits_out, double *escapes) {
    double total = 0, near = 0, bits = 0;
    int used = 0;
    for (int64_t i = 0; i < k; i++) {
        total += (double)c[i];
        used += c[i] > 0;
        if (i >= center - 7 && i < center + 8) near += (double)c[i];
    }
    if (total > 0 && used > 1)
        for (int64_t i = 0; i < k; i++)
            if (c[i] > 0) {
                double p = (double)c[i] / total;
                bits -= p * log2(p);
            }
    *bits_out = bits;
    *escapes = total > 0 ? 1.0 - near / total : 0.0;
}

/* A branch-free pass packs; a second one collects escapes only when there are any. */
int64_t eb_pair_pack(const uint8_t *c, int64_t n, int center, uint8_t *p, uint8_t *esc) {
    const uint8_t off = (uint8_t)((center - 7) & 0xFF);
    uint8_t top = 0;
    const int64_t half = n / 2;
    int64_t e = 0;
    for (int64_t i = 0; i < half; i++) {
        uint8_t a = (uint8_t)(c[2 * i] - off), b = (uint8_t)(c[2 * i + 1] - off);
        a = a < EB_ESCAPE ? a : EB_ESCAPE;
        b = b < EB_ESCAPE ? b : EB_ESCAPE;
        top = a > top ? a : top;
        top = b > top ? b : top;
        p[i] = (uint8_t)(a | (b << 4));
    }
    if (n % 2) {
        uint8_t a = (uint8_t)(c[n - 1] - off);
        a = a < EB_ESCAPE ? a : EB_ESCAPE;
        top = a > top ? a : top;
        p[half] = a;
    }
    if (top == EB_ESCAPE) FOR_EACH_ESCAPE(p, n, i, esc[e++] = c[i]);
    return e;
}

static float code_value(int code, float fq, float step) {
    float f = (float)code + fq;
    return f * step;
}

/* One table lookup per byte writes both values (a table of 256 value pairs built per call); a second pass
 * fills in escapes where there are any. */
int eb_pair_dequant(const uint8_t *p, int64_t n, int center, const uint8_t *esc, int64_t ne, int qmin,
                    float step, int levels, float *v) {
    const int64_t half = n / 2;
    const uint8_t off = (uint8_t)((center - 7) & 0xFF);
    const float fq = (float)qmin;
    float nib[16];
    int bad[16], escapes[16];
    for (int z = 0; z < 16; z++) {
        int code = (uint8_t)(z + off);
        escapes[z] = z == EB_ESCAPE;
        bad[z] = z != EB_ESCAPE && code >= levels;
        nib[z] = code_value(code, fq, step);
    }
    float pair[256][2];
    int64_t flags[256]; /* escape nibbles of a byte + (bad nibbles << 32) */
    for (int b = 0; b < 256; b++) {
        pair[b][0] = nib[b & 15];
        pair[b][1] = nib[b >> 4];
        flags[b] = escapes[b & 15] + escapes[b >> 4] + ((int64_t)(bad[b & 15] + bad[b >> 4]) << 32);
    }
    int64_t total = 0;
    for (int64_t i = 0; i < half; i++) {
        memcpy(v + 2 * i, pair[p[i]], 8);
        total += flags[p[i]];
    }
    if (n % 2) {
        uint8_t z = p[half] & 15;
        v[n - 1] = nib[z];
        total += escapes[z] + ((int64_t)bad[z] << 32);
    }
    if (total >> 32) return -2;
    if (total != ne) return -1;
    int status = 0;
    if (ne) {
        int64_t e = 0;
        FOR_EACH_ESCAPE(p, n, i, {
            uint8_t code = esc[e++];
            if (code >= levels) status = -2;
            v[i] = code_value(code, fq, step);
        });
    }
    return status;
}

int eb_byte_dequant(const uint8_t *c, int64_t n, int qmin, float step, int levels, float *v) {
    const float fq = (float)qmin;
    uint8_t top = 0;
    float value[256];
    for (int k = 0; k < 256; k++) value[k] = code_value(k, fq, step);
    for (int64_t i = 0; i < n; i++) {
        top = c[i] > top ? c[i] : top;
        v[i] = value[c[i]];
    }
    return n && top >= levels ? -2 : 0;
}

/* An open addressing table of row hashes, with every hash match confirmed by comparing the rows themselves. */
int64_t eb_dedup(const uint8_t *r, int64_t n, int64_t width, int64_t *f, int64_t *t) {
    int64_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    int32_t *pos = (int32_t *)malloc((size_t)cap * sizeof(int32_t));
    if (pos == NULL) return -1;
    memset(pos, 0xFF, (size_t)cap * sizeof(int32_t)); /* -1: empty; else the distinct row's position */
    int64_t u = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = r + i * width;
        uint64_t h = 0x9E3779B97F4A7C15ULL;
        int64_t k = 0;
        for (; k + 8 <= width; k += 8) {
            uint64_t w;
            memcpy(&w, row + k, 8);
            h = (h ^ w) * 0xBF58476D1CE4E5B9ULL;
            h ^= h >> 31;
        }
        if (k < width) {
            uint64_t w = 0;
            memcpy(&w, row + k, (size_t)(width - k));
            h = (h ^ w) * 0xBF58476D1CE4E5B9ULL;
            h ^= h >> 31;
        }
        int64_t j = (int64_t)(h & (uint64_t)(cap - 1));
        for (;;) {
            int32_t p = pos[j];
            if (p < 0) { /* a new distinct row */
                pos[j] = (int32_t)u;
                f[u++] = i;
                t[i] = 0;
                break;
            }
            if (memcmp(r + f[p] * width, row, (size_t)width) == 0) {
                t[i] = p + 1;
                break;
            }
            j = (j + 1) & (cap - 1);
        }
    }
    free(pos);
    return u;
}

int eb_expand(const float *v, int64_t d, const uint8_t *t, int64_t n, int64_t u, int wide, float *o) {
    int64_t seen = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t tok = wide ? (int64_t)(t[i] | (t[n + i] << 8)) : (int64_t)t[i];
        int64_t row;
        if (tok == 0) {
            if (seen >= u) return -1;
            row = seen++;
        } else {
            if (tok > seen) return -1;
            row = tok - 1;
        }
        memcpy(o + i * d, v + row * d, (size_t)d * sizeof(float));
    }
    return seen == u ? 0 : -1;
}

void eb_word_sums(const uint8_t *p, int64_t len, uint64_t *s1_out, uint64_t *s2_out) {
    const int64_t words = len / 4;
    uint64_t s1 = 0, s2 = 0;
    for (int64_t i = 0; i < words; i++) {
        uint32_t w;
        memcpy(&w, p + 4 * i, 4); /* any alignment; little-endian machines only (packing.py checks) */
        s1 += w;
        s2 += (uint64_t)w * (uint64_t)(i + 1);
    }
    *s1_out = s1;
    *s2_out = s2;
}
