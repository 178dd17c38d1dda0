/* Host kernels of the error-bounded codec: the per-value loops of recstack/compression/host.py in C.
 *
 * numpy needs one pass, and one temporary, per operation; these loops do the value range, quantization
 * with the code histogram, the nibble layout, row deduplication, dequantization, row expansion and the
 * checksum in one pass each. They give bit for bit what the numpy code they replace gives (float32
 * arithmetic in the same order, no FMA contraction: see setup.py), and tests compare the two on random
 * inputs. Buffers come through the buffer protocol, so this file needs neither the numpy nor
 * the torch headers; the caller (recstack/compression/native.py) checks dtypes and sizes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define ESCAPE 15

static int need(Py_buffer *b, Py_ssize_t bytes, const char *what) {
    if (b->len < bytes) {
        PyErr_Format(PyExc_ValueError, "_ebhost: %s holds %zd bytes, needs %zd", what, b->len, bytes);
        return 0;
    }
    return 1;
}

/* Whether any of the 16 nibbles of a 64-bit word is 15 (an escape): AND each nibble's four bits. */
static int has_escape(uint64_t w) {
    uint64_t t = w & (w >> 1);
    t &= t >> 2;
    return (t & 0x1111111111111111ULL) != 0;
}

/* Calls fn(i) for the index i of every nibble 15 among the first n nibbles of packed (low nibble first);
 * whole words without one are skipped with a few bit operations each. */
#define FOR_EACH_ESCAPE(packed, n, i, body)                                                 \
    do {                                                                                     \
        const Py_ssize_t nbytes_ = ((n) + 1) / 2;                                            \
        for (Py_ssize_t w_ = 0; w_ < nbytes_; w_ += 8) {                                     \
            uint64_t word_ = 0;                                                              \
            memcpy(&word_, (packed) + w_, nbytes_ - w_ < 8 ? (size_t)(nbytes_ - w_) : 8);   \
            if (!has_escape(word_)) continue;                                                \
            for (Py_ssize_t i = 2 * w_; i < 2 * w_ + 16 && i < (n); i++) {                   \
                uint8_t z_ = (i & 1) ? (uint8_t)((packed)[i >> 1] >> 4) : (uint8_t)((packed)[i >> 1] & 15); \
                if (z_ == ESCAPE) { body; }                                                  \
            }                                                                                \
        }                                                                                    \
    } while (0)

/* quantize(x f32[n], inv, qmin, codes u8[n] out, hist i64[256] out, stride)
 * codes = rint(x * inv) - qmin (the caller guarantees 0 <= code < 256 and |x * inv| < 2**22); hist counts
 * codes[::stride]. rint is (v + 1.5 * 2**23) - 1.5 * 2**23: exact round-half-even in float32 for |v| < 2**22,
 * and unlike rintf it vectorizes on every x86-64. */
static PyObject *quantize(PyObject *self, PyObject *args) {
    Py_buffer x, codes, hist;
    float inv;
    int qmin;
    Py_ssize_t stride;
    if (!PyArg_ParseTuple(args, "y*fiw*w*n", &x, &inv, &qmin, &codes, &hist, &stride)) return NULL;
    Py_ssize_t n = x.len / 4;
    PyObject *ret = NULL;
    if (need(&codes, n, "codes") && need(&hist, 256 * 8, "hist")) {
        const float *xs = (const float *)x.buf;
        uint8_t *c = (uint8_t *)codes.buf;
        int64_t *h = (int64_t *)hist.buf;
        const float fq = (float)qmin, magic = 12582912.0f;
        Py_BEGIN_ALLOW_THREADS
        Py_ssize_t i = 0;
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
        Py_ssize_t k = 0;
        for (i = 0; i < n; i += stride, k++) part[k & 3][c[i]]++;
        for (int b = 0; b < 256; b++) h[b] = part[0][b] + part[1][b] + part[2][b] + part[3][b];
        Py_END_ALLOW_THREADS
        ret = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&codes);
    PyBuffer_Release(&hist);
    return ret;
}

/* pair_pack(codes u8[n], center, packed u8[ceil(n/2)] out, escaped u8[n] out) -> number of escapes
 * nibble = (code - center + 7) mod 256, 15 when that is 15 or more (the code goes to ``escaped``).
 * A branch-free pass packs; a second one collects escapes only when there are any. */
static PyObject *pair_pack(PyObject *self, PyObject *args) {
    Py_buffer codes, packed, escaped;
    int center;
    if (!PyArg_ParseTuple(args, "y*iw*w*", &codes, &center, &packed, &escaped)) return NULL;
    Py_ssize_t n = codes.len, e = 0;
    PyObject *ret = NULL;
    if (need(&packed, (n + 1) / 2, "packed") && need(&escaped, n, "escaped")) {
        const uint8_t *c = (const uint8_t *)codes.buf;
        uint8_t *p = (uint8_t *)packed.buf, *esc = (uint8_t *)escaped.buf;
        const uint8_t off = (uint8_t)((center - 7) & 0xFF);
        Py_BEGIN_ALLOW_THREADS
        uint8_t top = 0;
        const Py_ssize_t half = n / 2;
        for (Py_ssize_t i = 0; i < half; i++) {
            uint8_t a = (uint8_t)(c[2 * i] - off), b = (uint8_t)(c[2 * i + 1] - off);
            a = a < ESCAPE ? a : ESCAPE;
            b = b < ESCAPE ? b : ESCAPE;
            top = a > top ? a : top;
            top = b > top ? b : top;
            p[i] = (uint8_t)(a | (b << 4));
        }
        if (n % 2) {
            uint8_t a = (uint8_t)(c[n - 1] - off);
            a = a < ESCAPE ? a : ESCAPE;
            top = a > top ? a : top;
            p[half] = a;
        }
        if (top == ESCAPE) FOR_EACH_ESCAPE(p, n, i, esc[e++] = c[i]);
        Py_END_ALLOW_THREADS
        ret = PyLong_FromSsize_t(e);
    }
    PyBuffer_Release(&codes);
    PyBuffer_Release(&packed);
    PyBuffer_Release(&escaped);
    return ret;
}

/* Status of the decoders: 0 fine, -1 the escape symbols and escaped codes do not match, -2 a code is
 * outside the levels. Values are (float32(code) + float32(qmin)) * step, rounded to float32 at each step. */
static float code_value(int code, float fq, float step) {
    float f = (float)code + fq;
    return f * step;
}

/* pair_dequant(packed u8[ceil(n/2)], n, center, escaped u8[E], qmin, step, levels, out f32[n] out) -> status
 * One table lookup per byte writes both values (a table of 256 value pairs built per call); a second pass
 * fills in escapes where there are any. */
static PyObject *pair_dequant(PyObject *self, PyObject *args) {
    Py_buffer packed, escaped, out;
    Py_ssize_t n;
    int center, qmin, levels;
    float step;
    if (!PyArg_ParseTuple(args, "y*niy*ifiw*", &packed, &n, &center, &escaped, &qmin, &step, &levels, &out))
        return NULL;
    PyObject *ret = NULL;
    if (need(&packed, (n + 1) / 2, "packed") && need(&out, n * 4, "out")) {
        const uint8_t *p = (const uint8_t *)packed.buf, *esc = (const uint8_t *)escaped.buf;
        float *v = (float *)out.buf;
        const Py_ssize_t ne = escaped.len, half = n / 2;
        const uint8_t off = (uint8_t)((center - 7) & 0xFF);
        const float fq = (float)qmin;
        int status = 0;
        Py_BEGIN_ALLOW_THREADS
        float nib[16];
        int bad[16], escapes[16];
        for (int z = 0; z < 16; z++) {
            int code = (uint8_t)(z + off);
            escapes[z] = z == ESCAPE;
            bad[z] = z != ESCAPE && code >= levels;
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
        for (Py_ssize_t i = 0; i < half; i++) {
            memcpy(v + 2 * i, pair[p[i]], 8);
            total += flags[p[i]];
        }
        if (n % 2) {
            uint8_t z = p[half] & 15;
            v[n - 1] = nib[z];
            total += escapes[z] + ((int64_t)bad[z] << 32);
        }
        if (total >> 32) {
            status = -2;
        } else if (total != ne) {
            status = -1;
        } else if (ne) {
            Py_ssize_t e = 0;
            FOR_EACH_ESCAPE(p, n, i, {
                uint8_t code = esc[e++];
                if (code >= levels) status = -2;
                v[i] = code_value(code, fq, step);
            });
        }
        Py_END_ALLOW_THREADS
        ret = PyLong_FromLong(status);
    }
    PyBuffer_Release(&packed);
    PyBuffer_Release(&escaped);
    PyBuffer_Release(&out);
    return ret;
}

/* byte_dequant(codes u8[n], qmin, step, levels, out f32[n] out) -> status (0, or -2 for a code >= levels) */
static PyObject *byte_dequant(PyObject *self, PyObject *args) {
    Py_buffer codes, out;
    int qmin, levels;
    float step;
    if (!PyArg_ParseTuple(args, "y*ifiw*", &codes, &qmin, &step, &levels, &out)) return NULL;
    Py_ssize_t n = codes.len;
    PyObject *ret = NULL;
    if (need(&out, n * 4, "out")) {
        const uint8_t *c = (const uint8_t *)codes.buf;
        float *v = (float *)out.buf;
        const float fq = (float)qmin;
        uint8_t top = 0;
        Py_BEGIN_ALLOW_THREADS
        float value[256];
        for (int k = 0; k < 256; k++) value[k] = code_value(k, fq, step);
        for (Py_ssize_t i = 0; i < n; i++) {
            top = c[i] > top ? c[i] : top;
            v[i] = value[c[i]];
        }
        Py_END_ALLOW_THREADS
        ret = PyLong_FromLong(n && top >= levels ? -2 : 0);
    }
    PyBuffer_Release(&codes);
    PyBuffer_Release(&out);
    return ret;
}

/* dedup(rows u8[n * width], n, width, first i64[n] out, tokens i64[n] out) -> u
 * Distinct rows in order of first occurrence: first[0:u] are their row numbers; tokens[r] = 0 where row r
 * is a first occurrence, else 1 + the position of the distinct row it repeats (packing.dedup_rows). An open
 * addressing table of row hashes, with every hash match confirmed by comparing the rows themselves. */
static PyObject *dedup(PyObject *self, PyObject *args) {
    Py_buffer rows, first, tokens;
    Py_ssize_t n, width;
    if (!PyArg_ParseTuple(args, "y*nnw*w*", &rows, &n, &width, &first, &tokens)) return NULL;
    PyObject *ret = NULL;
    Py_ssize_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    int32_t *slot = NULL;
    if (n < 0 || width < 0 || n > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "_ebhost.dedup: bad sizes");
    } else if (need(&rows, n * width, "rows") && need(&first, n * 8, "first") && need(&tokens, n * 8, "tokens")) {
        slot = (int32_t *)malloc((size_t)cap * sizeof(int32_t));
        if (slot == NULL) PyErr_NoMemory();
    }
    if (slot != NULL) {
        const uint8_t *r = (const uint8_t *)rows.buf;
        int64_t *f = (int64_t *)first.buf, *t = (int64_t *)tokens.buf;
        Py_ssize_t u = 0;
        Py_BEGIN_ALLOW_THREADS
        int32_t *pos = (int32_t *)slot;
        memset(pos, 0xFF, (size_t)cap * sizeof(int32_t)); /* -1: empty; else the distinct row's position */
        for (Py_ssize_t i = 0; i < n; i++) {
            const uint8_t *row = r + i * width;
            uint64_t h = 0x9E3779B97F4A7C15ULL;
            Py_ssize_t k = 0;
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
            Py_ssize_t j = (Py_ssize_t)(h & (uint64_t)(cap - 1));
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
        Py_END_ALLOW_THREADS
        free(slot);
        ret = PyLong_FromSsize_t(u);
    }
    PyBuffer_Release(&rows);
    PyBuffer_Release(&first);
    PyBuffer_Release(&tokens);
    return ret;
}

/* expand(values f32[u * d], d, tokens u8[n] or [2n] (low then high byte plane), n, u, wide, out f32[n * d]
 * out) -> 0, or -1 when the tokens do not introduce exactly u rows or repeat a row not yet introduced.
 * The inverse of dedup: token 0 takes the next distinct row, token t > 0 repeats distinct row t - 1. */
static PyObject *expand(PyObject *self, PyObject *args) {
    Py_buffer values, tokens, out;
    Py_ssize_t d, n, u;
    int wide;
    if (!PyArg_ParseTuple(args, "y*ny*nniw*", &values, &d, &tokens, &n, &u, &wide, &out)) return NULL;
    PyObject *ret = NULL;
    if (n >= 0 && u >= 0 && d >= 0 && need(&values, u * d * 4, "values") &&
        need(&tokens, n * (wide ? 2 : 1), "tokens") && need(&out, n * d * 4, "out")) {
        const float *v = (const float *)values.buf;
        const uint8_t *t = (const uint8_t *)tokens.buf;
        float *o = (float *)out.buf;
        Py_ssize_t seen = 0;
        int status = 0;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t tok = wide ? (Py_ssize_t)(t[i] | (t[n + i] << 8)) : (Py_ssize_t)t[i];
            Py_ssize_t row;
            if (tok == 0) {
                if (seen >= u) { status = -1; break; }
                row = seen++;
            } else {
                if (tok > seen) { status = -1; break; }
                row = tok - 1;
            }
            memcpy(o + i * d, v + row * d, (size_t)d * sizeof(float));
        }
        if (status == 0 && seen != u) status = -1;
        Py_END_ALLOW_THREADS
        ret = PyLong_FromLong(status);
    } else if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "_ebhost.expand: bad sizes");
    }
    PyBuffer_Release(&values);
    PyBuffer_Release(&tokens);
    PyBuffer_Release(&out);
    return ret;
}

/* minmax(x f32[n]) -> (min, max, all finite): the range of the finite values of x (NaN, NaN when there
 * are none), as quantize.finite_range. The first pass keeps 4 lanes (SSE2 where there is SSE2) and looks
 * for NaN and Inf by their exponent bits; only when there is one does a second pass skip them. */
static PyObject *minmax(PyObject *self, PyObject *args) {
    Py_buffer x;
    if (!PyArg_ParseTuple(args, "y*", &x)) return NULL;
    const float *v = (const float *)x.buf;
    Py_ssize_t n = x.len / 4, i = 0;
    float lo = INFINITY, hi = -INFINITY;
    int finite = 1;
    Py_BEGIN_ALLOW_THREADS
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
    if (special) { /* again, over the finite values only */
        finite = 0;
        lo = INFINITY, hi = -INFINITY;
        for (Py_ssize_t k = 0; k < n; k++)
            if (isfinite(v[k])) {
                lo = v[k] < lo ? v[k] : lo;
                hi = v[k] > hi ? v[k] : hi;
            }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&x);
    if (lo > hi) return Py_BuildValue("ddO", NAN, NAN, finite ? Py_True : Py_False);
    return Py_BuildValue("ddO", (double)lo, (double)hi, finite ? Py_True : Py_False);
}

/* grid(lo, hi, step32) -> (inv = 1 / step32, rint(float32(lo) * inv), rint(float32(hi) * inv)), in float32 as
 * host.quantize_safe computes them with numpy scalars; step32 is a normal float32. */
static PyObject *grid(PyObject *self, PyObject *args) {
    double lo, hi, step;
    if (!PyArg_ParseTuple(args, "ddd", &lo, &hi, &step)) return NULL;
    float inv = 1.0f / (float)step;
    float qmin = rintf((float)lo * inv), qmax = rintf((float)hi * inv);
    return Py_BuildValue("ddd", (double)inv, (double)qmin, (double)qmax);
}

/* profile(counts i64[K], center) -> (order-0 entropy in bits per code, share of codes more than 7 levels
 * from the centre): packing.profile_from_counts. */
static PyObject *profile(PyObject *self, PyObject *args) {
    Py_buffer counts;
    Py_ssize_t center;
    if (!PyArg_ParseTuple(args, "y*n", &counts, &center)) return NULL;
    const int64_t *c = (const int64_t *)counts.buf;
    Py_ssize_t k = counts.len / 8;
    double total = 0, near = 0, bits = 0;
    int used = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        total += (double)c[i];
        used += c[i] > 0;
        if (i >= center - 7 && i < center + 8) near += (double)c[i];
    }
    if (total > 0 && used > 1)
        for (Py_ssize_t i = 0; i < k; i++)
            if (c[i] > 0) {
                double p = (double)c[i] / total;
                bits -= p * log2(p);
            }
    PyBuffer_Release(&counts);
    return Py_BuildValue("dd", bits, total > 0 ? 1.0 - near / total : 0.0);
}

/* word_sums(body) -> (sum of the little-endian uint32 words, sum of word * position from 1), both mod 2**64,
 * over the whole words of ``body`` (format.checksum_np adds the tail bytes and mixes). */
static PyObject *word_sums(PyObject *self, PyObject *args) {
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*", &b)) return NULL;
    const uint8_t *p = (const uint8_t *)b.buf;
    Py_ssize_t words = b.len / 4;
    uint64_t s1 = 0, s2 = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < words; i++) {
        uint32_t w;
        memcpy(&w, p + 4 * i, 4); /* any alignment; little-endian machines only (packing.py checks) */
        s1 += w;
        s2 += (uint64_t)w * (uint64_t)(i + 1);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return Py_BuildValue("KK", (unsigned long long)s1, (unsigned long long)s2);
}

static PyMethodDef methods[] = {
    {"quantize", quantize, METH_VARARGS, "codes = rint(x * inv) - qmin, and a histogram of codes[::stride]"},
    {"pair_pack", pair_pack, METH_VARARGS, "two nibbles per byte around a centre, escapes apart"},
    {"pair_dequant", pair_dequant, METH_VARARGS, "nibble pairs + escapes -> float32 values"},
    {"byte_dequant", byte_dequant, METH_VARARGS, "one code per byte -> float32 values"},
    {"dedup", dedup, METH_VARARGS, "distinct rows in order of first occurrence, and a token per row"},
    {"expand", expand, METH_VARARGS, "distinct rows + row tokens -> every row"},
    {"minmax", minmax, METH_VARARGS, "range of the finite values, and whether all are finite"},
    {"grid", grid, METH_VARARGS, "float32 step, inverse and the code range of [lo, hi]"},
    {"profile", profile, METH_VARARGS, "entropy and escape share of a code histogram"},
    {"word_sums", word_sums, METH_VARARGS, "plain and position-weighted sums of uint32 words"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ebhost", "host kernels of the eb codec", -1, methods};

PyMODINIT_FUNC PyInit__ebhost(void) { return PyModule_Create(&module); }
