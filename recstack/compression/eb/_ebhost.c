/* Python bindings of the eb codec's host loops (_ebkernels.c), ``encode_front`` (the whole host encoder up
 * to the entropy coder in one call) and ``decode_rows`` (the decoder after it).
 *
 * Buffers come through the buffer protocol, so this file needs neither the numpy nor the torch headers; the
 * caller (recstack/compression/native.py) passes arrays of the stated dtypes, and each binding checks that
 * its buffers are large enough. Loops run with the GIL released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_ebkernels.h"

static int need(Py_buffer *b, Py_ssize_t bytes, const char *what) {
    if (b->len < bytes) {
        PyErr_Format(PyExc_ValueError, "_ebhost: %s holds %zd bytes, needs %zd", what, b->len, bytes);
        return 0;
    }
    return 1;
}

#define RELEASE(...)                                                         \
    do {                                                                     \
        Py_buffer *bufs_[] = {__VA_ARGS__};                                  \
        for (size_t k_ = 0; k_ < sizeof(bufs_) / sizeof(bufs_[0]); k_++)     \
            PyBuffer_Release(bufs_[k_]);                                     \
    } while (0)

/* pair_pack(codes u8[n], center, packed u8[ceil(n/2)] out, escaped u8[n] out) -> number of escapes */
static PyObject *pair_pack(PyObject *self, PyObject *args) {
    Py_buffer codes, packed, escaped;
    int center;
    if (!PyArg_ParseTuple(args, "y*iw*w*", &codes, &center, &packed, &escaped)) return NULL;
    Py_ssize_t n = codes.len, e = 0;
    PyObject *ret = NULL;
    if (need(&packed, (n + 1) / 2, "packed") && need(&escaped, n, "escaped")) {
        Py_BEGIN_ALLOW_THREADS
        e = eb_pair_pack((const uint8_t *)codes.buf, n, center, (uint8_t *)packed.buf, (uint8_t *)escaped.buf);
        Py_END_ALLOW_THREADS
        ret = PyLong_FromSsize_t(e);
    }
    RELEASE(&codes, &packed, &escaped);
    return ret;
}

/* dedup(rows u8[n * width], n, width, first i64[n] out, tokens i64[n] out) -> u (packing.dedup_rows) */
static PyObject *dedup(PyObject *self, PyObject *args) {
    Py_buffer rows, first, tokens;
    Py_ssize_t n, width, u = 0;
    if (!PyArg_ParseTuple(args, "y*nnw*w*", &rows, &n, &width, &first, &tokens)) return NULL;
    PyObject *ret = NULL;
    if (n < 0 || width < 0 || n > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "_ebhost.dedup: bad sizes");
    } else if (need(&rows, n * width, "rows") && need(&first, n * 8, "first") && need(&tokens, n * 8, "tokens")) {
        Py_BEGIN_ALLOW_THREADS
        u = eb_dedup((const uint8_t *)rows.buf, n, width, (int64_t *)first.buf, (int64_t *)tokens.buf);
        Py_END_ALLOW_THREADS
        ret = u < 0 ? PyErr_NoMemory() : PyLong_FromSsize_t(u);
    }
    RELEASE(&rows, &first, &tokens);
    return ret;
}

/* expand(values f32[u * d], d, tokens u8[n] or [2n], n, u, wide, out f32[n * d] out) -> 0 or -1 (bad tokens) */
static PyObject *expand(PyObject *self, PyObject *args) {
    Py_buffer values, tokens, out;
    Py_ssize_t d, n, u;
    int wide, status = 0;
    if (!PyArg_ParseTuple(args, "y*ny*nniw*", &values, &d, &tokens, &n, &u, &wide, &out)) return NULL;
    PyObject *ret = NULL;
    if (n >= 0 && u >= 0 && d >= 0 && need(&values, u * d * 4, "values") &&
        need(&tokens, n * (wide ? 2 : 1), "tokens") && need(&out, n * d * 4, "out")) {
        Py_BEGIN_ALLOW_THREADS
        status = eb_expand((const float *)values.buf, d, (const uint8_t *)tokens.buf, n, u, wide, (float *)out.buf);
        Py_END_ALLOW_THREADS
        ret = PyLong_FromLong(status);
    } else if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "_ebhost.expand: bad sizes");
    }
    RELEASE(&values, &tokens, &out);
    return ret;
}

/* minmax(x f32[n]) -> (min, max, all finite) of the finite values (NaN, NaN when there are none) */
static PyObject *minmax(PyObject *self, PyObject *args) {
    Py_buffer x;
    if (!PyArg_ParseTuple(args, "y*", &x)) return NULL;
    float lo, hi;
    int finite;
    Py_BEGIN_ALLOW_THREADS
    eb_minmax((const float *)x.buf, x.len / 4, &lo, &hi, &finite);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&x);
    if (lo > hi) return Py_BuildValue("ddO", NAN, NAN, finite ? Py_True : Py_False);
    return Py_BuildValue("ddO", (double)lo, (double)hi, finite ? Py_True : Py_False);
}

/* grid(lo, hi, step32) -> (inv = 1 / step32, rint(float32(lo) * inv), rint(float32(hi) * inv)) in float32 */
static PyObject *grid(PyObject *self, PyObject *args) {
    double lo, hi, step;
    if (!PyArg_ParseTuple(args, "ddd", &lo, &hi, &step)) return NULL;
    float inv, qmin, qmax;
    eb_grid(lo, hi, (float)step, &inv, &qmin, &qmax);
    return Py_BuildValue("ddd", (double)inv, (double)qmin, (double)qmax);
}

/* word_sums(body) -> (sum of the little-endian uint32 words, sum of word * position from 1), mod 2**64 */
static PyObject *word_sums(PyObject *self, PyObject *args) {
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*", &b)) return NULL;
    uint64_t s1, s2;
    Py_BEGIN_ALLOW_THREADS
    eb_word_sums((const uint8_t *)b.buf, b.len, &s1, &s2);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return Py_BuildValue("KK", (unsigned long long)s1, (unsigned long long)s2);
}

/* encode_front(x f32[n * d], n, d, bound, relative, tighten, safe_ratio, max_index, sample, pairs_max_escapes,
 *              max_distinct, codes u8[n * d] out, stream u8[n * d + (n * d + 1) / 2] out, tokens u8[2n] out)
 *
 * host.encode_composed in one call, for the common case: all values finite, a grid that needs no value check
 * (quantize.is_safe) with 2..256 levels and codes below max_index. -> (lo, hi, finite) when that case does
 * not hold (the caller goes on with the composed path), else (lo, hi, finite, eb_abs, step, qmin, levels,
 * center, u, stream bytes, token bytes, pairs): codes holds every code, stream the layout's bytes (nibble
 * pairs then escapes, or one byte per code) of the u distinct rows, tokens the row tokens' byte planes (0
 * bytes when deduplication does not pay). Each decision is the composed path's, in the same double and
 * float32 arithmetic, so both write the same message; tests compare them. */
static PyObject *encode_front(PyObject *self, PyObject *args) {
    Py_buffer x, codes, stream, tokens;
    Py_ssize_t n, d, sample, max_distinct;
    double bound, tighten, safe_ratio, pairs_max;
    int relative, max_index;
    if (!PyArg_ParseTuple(args, "y*nndpddindnw*w*w*", &x, &n, &d, &bound, &relative, &tighten, &safe_ratio,
                          &max_index, &sample, &pairs_max, &max_distinct, &codes, &stream, &tokens))
        return NULL;
    PyObject *ret = NULL;
    const Py_ssize_t nd = n * d;
    if (n < 1 || d < 1 || n > INT32_MAX || sample < 1) {
        PyErr_SetString(PyExc_ValueError, "_ebhost.encode_front: bad sizes");
    } else if (need(&x, nd * 4, "x") && need(&codes, nd, "codes") && need(&stream, nd + (nd + 1) / 2, "stream") &&
               need(&tokens, 2 * n, "tokens")) {
        float lo, hi, inv, fqmin, fqmax;
        double lo_d, hi_d, m;
        int finite, ok;
        double eb_abs = 0, step = 0, bits = 0, escapes = 0;
        int qmin = 0, levels = 0, center = 0, pairs = 0;
        Py_ssize_t u = n, stream_len = 0, tokens_len = 0;
        uint8_t *c = (uint8_t *)codes.buf, *out = (uint8_t *)stream.buf, *tok = (uint8_t *)tokens.buf;
        Py_BEGIN_ALLOW_THREADS
        eb_minmax((const float *)x.buf, nd, &lo, &hi, &finite);
        lo_d = lo, hi_d = hi, m = fmax(fabs(lo_d), fabs(hi_d));
        eb_abs = relative ? bound * (hi_d - lo_d) : bound;
        step = 2.0 * eb_abs * tighten;
        /* host.quantize_safe and native.quantize: finite, safe, narrow */
        ok = finite && lo <= hi && eb_abs >= FLT_MIN && isfinite(eb_abs) && m <= safe_ratio * eb_abs &&
             step <= FLT_MAX; /* quantize.usable_bound */
        if (ok) {
            const float step32 = (float)step;
            ok = step32 >= FLT_MIN && m + step32 <= (double)FLT_MAX * (1.0 - 0x1p-20);
            eb_grid(lo_d, hi_d, step32, &inv, &fqmin, &fqmax);
            ok = ok && fabsf(fqmin) < max_index && fabsf(fqmax) < max_index;
            if (ok) {
                qmin = (int)fqmin;
                levels = (int)fqmax - qmin + 1;
                ok = levels >= 2 && levels <= 256;
            }
        }
        if (ok) {
            int64_t hist[256];
            eb_quantize((const float *)x.buf, nd, inv, qmin, c, hist, nd / sample > 1 ? nd / sample : 1);
            center = qmin <= 0 && 0 < qmin + levels ? -qmin : levels / 2;
            eb_profile(hist, 256, center, &bits, &escapes);
            /* host.dedup_rows, packing.dedup_pays */
            int64_t *first = (int64_t *)malloc((size_t)n * 8), *index = (int64_t *)malloc((size_t)n * 8);
            uint8_t *rows = (uint8_t *)malloc((size_t)nd);
            const uint8_t *src = c;
            if (first == NULL || index == NULL || rows == NULL) {
                ok = -1;
            } else if (n >= 2) {
                int64_t k = eb_dedup(c, n, d, first, index);
                const double row_bits = (double)d * fmax(bits, 1.0);
                if (k < 0) {
                    ok = -1;
                } else if (k < n && k <= max_distinct &&
                           (double)(n - k) * row_bits > (double)n * log2((double)(k > 2 ? k : 2))) {
                    u = k;
                    for (int64_t r = 0; r < u; r++) memcpy(rows + r * d, c + first[r] * d, (size_t)d);
                    src = rows;
                    const int wide = u + 1 > 256;
                    for (int64_t r = 0; r < n; r++) {
                        tok[r] = (uint8_t)(index[r] & 0xFF);
                        if (wide) tok[n + r] = (uint8_t)(index[r] >> 8);
                    }
                    tokens_len = wide ? 2 * n : n;
                }
            }
            if (ok > 0) { /* the layout: nibble pairs when few codes need an escape, else one byte per code */
                const int64_t m_codes = (int64_t)u * d, half = (m_codes + 1) / 2;
                pairs = levels <= 128 && escapes <= pairs_max;
                if (pairs) {
                    stream_len = half + eb_pair_pack(src, m_codes, center, out, out + half);
                } else {
                    center = 0;
                    memcpy(out, src, (size_t)m_codes);
                    stream_len = m_codes;
                }
            }
            free(first);
            free(index);
            free(rows);
        }
        Py_END_ALLOW_THREADS
        if (ok < 0)
            ret = PyErr_NoMemory();
        else if (!ok)
            ret = Py_BuildValue("ddO", lo > hi ? NAN : lo_d, lo > hi ? NAN : hi_d, finite ? Py_True : Py_False);
        else
            ret = Py_BuildValue("ddOddiiinnnO", lo_d, hi_d, Py_True, eb_abs, step, qmin, levels, center, u,
                                stream_len, tokens_len, pairs ? Py_True : Py_False);
    }
    RELEASE(&x, &codes, &stream, &tokens);
    return ret;
}

/* decode_rows(stream u8[], tokens u8[] (empty without deduplication), n, d, u, pairs, center, qmin, step,
 *             levels, out f32[n * d] out) -> status
 * The inverse of encode_front's layouts after the entropy coder: the u distinct rows' codes (nibble pairs then
 * escapes, or one byte per code) to values, then the rows by their tokens (byte planes, two when u + 1 > 256).
 * Status: 0; -1 escape count mismatch; -2 a code outside the levels; -3 a stream of the wrong size; -4 tokens
 * that do not describe u distinct rows. */
static PyObject *decode_rows(PyObject *self, PyObject *args) {
    Py_buffer stream, tokens, out;
    Py_ssize_t n, d, u;
    int pairs, center, qmin, levels, status = 0;
    float step;
    if (!PyArg_ParseTuple(args, "y*y*nnnpiifiw*", &stream, &tokens, &n, &d, &u, &pairs, &center, &qmin, &step,
                          &levels, &out))
        return NULL;
    PyObject *ret = NULL;
    const int dedup = tokens.len > 0, wide = u + 1 > 256;
    if (n < 0 || d < 0 || u < 0 || u > n || (!dedup && u != n)) {
        PyErr_SetString(PyExc_ValueError, "_ebhost.decode_rows: bad sizes");
    } else if (need(&out, n * d * 4, "out")) {
        const Py_ssize_t m = u * d, half = (m + 1) / 2;
        const uint8_t *sb = (const uint8_t *)stream.buf;
        float *o = (float *)out.buf;
        Py_BEGIN_ALLOW_THREADS
        float *rows = dedup ? (float *)malloc((size_t)(m > 0 ? m : 1) * sizeof(float)) : o;
        if (rows == NULL)
            status = -5;
        else if (pairs ? stream.len < half : stream.len != m)
            status = -3;
        else if (dedup && tokens.len != (wide ? 2 * n : n))
            status = -4;
        else if (pairs)
            status = eb_pair_dequant(sb, m, center, sb + half, stream.len - half, qmin, step, levels, rows);
        else
            status = eb_byte_dequant(sb, m, qmin, step, levels, rows);
        if (status == 0 && dedup && eb_expand(rows, d, (const uint8_t *)tokens.buf, n, u, wide, o)) status = -4;
        if (dedup) free(rows);
        Py_END_ALLOW_THREADS
        ret = status == -5 ? PyErr_NoMemory() : PyLong_FromLong(status);
    }
    RELEASE(&stream, &tokens, &out);
    return ret;
}

static PyMethodDef methods[] = {
    {"pair_pack", pair_pack, METH_VARARGS, "two nibbles per byte around a centre, escapes apart"},
    {"dedup", dedup, METH_VARARGS, "distinct rows in order of first occurrence, and a token per row"},
    {"expand", expand, METH_VARARGS, "distinct rows + row tokens -> every row"},
    {"minmax", minmax, METH_VARARGS, "range of the finite values, and whether all are finite"},
    {"grid", grid, METH_VARARGS, "float32 step, inverse and the code range of [lo, hi]"},
    {"word_sums", word_sums, METH_VARARGS, "plain and position-weighted sums of uint32 words"},
    {"encode_front", encode_front, METH_VARARGS, "the host encoder up to the entropy coder, in one call"},
    {"decode_rows", decode_rows, METH_VARARGS, "the host decoder after the entropy coder, in one call"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ebhost", "host kernels of the eb codec", -1, methods};

PyMODINIT_FUNC PyInit__ebhost(void) { return PyModule_Create(&module); }
