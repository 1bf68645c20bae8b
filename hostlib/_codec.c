/*
 * hostlib._codec: the fixed-point codec's two hot loops, one pass over the data each.
 *
 * hostlib/codec.py is the contract and the numpy reference (docs/protocol.md, "Numbers"); this module
 * is its fast path and hostlib.codec chooses it when it imported (LTA_CODEC=numpy forces the reference).
 *
 * Why hand-written C: a worker quantizes and dequantizes every value of every gradient on every step.
 * In numpy, quantize is six passes over the tensor plus a float32 array of random draws as large as it
 * (scale, floor, fraction, draws, compare, clamp, cast, then the byte swap into the packet rows), and
 * dequantize three (byte swap, scale in float64, cast); on a 4.2M-parameter model that is ~30 ms and
 * ~15 ms per step per worker, more than the whole allreduce takes on the wire. Here each value is read
 * once and written once, straight into (or out of) the big-endian payload rows of the packet buffers, in
 * loops the compiler vectorizes, with the GIL released (rank 0 also runs the embedded softswitch in a
 * thread).
 *
 *   quantize(chunks, rows, shifts, limit, seed, out, saturated) -> None
 *       For the i-th selected row r (rows[i], or i when rows is None): out[r] = floor(v + u), v = chunks[r]
 *       * 2^shifts[i], u uniform in [0, 1) (stochastic rounding), clamped to [-limit, limit];
 *       saturated[i] = 1 when a value of the row went past the limit before the clamp (the reference's
 *       rule), else 0. Raises ValueError naming the row on NaN or Inf (the rows before it are written).
 *       The arithmetic is the reference's: v in float32 is exact (a power of two only moves the
 *       exponent; it overflows only far past the limit, where the clamp applies, and rounds only below
 *       2^-126), so every result is the floor or the ceiling of the exact product; u has 24 bits, so the
 *       round-up probability is exactly the fraction for |v| >= 1 and within 2^-24 of it below.
 *       The random bits are a splitmix64 stream started at ``seed`` (row i takes the next stretch of it):
 *       the same inputs and seed give the same output.
 *   dequantize(sums, rows, shifts, divisors, out, out_rows) -> None
 *       out[out_rows[i]] = float32(double(sums[rows[i]]) * (2^-shifts[i] / divisors[i])), exactly the
 *       reference's arithmetic (float64 scale, one product, one rounding to float32): bit-identical.
 *       divisors None: no division.
 *   stage(local, chunks, n, scale, proposals, empty_exp, nonfinite_exp) -> rows not finite
 *       A reduce's staging and exponent proposals in one pass over the data (hostlib.codec.stage): the n
 *       values of ``local`` (1-D float32; None: they are in chunks already) times ``scale`` (float32
 *       products; 1: a copy) into the C-contiguous (C, K) float32 ``chunks``, zeros after them; per row
 *       proposals[r] = the exponent e of frexp(max|row|) (max|x| < 2^e), empty_exp for a row of zeros;
 *       a row holding NaN or Inf proposes nonfinite_exp and is zeroed. The numpy path's arithmetic.
 *   maxabs(chunks, out) -> None
 *       out[r] = max |chunks[r]| (float32; NaN when the row holds a NaN, +inf for an infinity): the
 *       exponent round's proposals read the tensor once here (numpy's two row reductions over rows of
 *       K = 64 values took ~7 ms of a 4 MiB reduce on the 2-core host, this pass well under 1 ms).
 *
 * Buffers: chunks and out (quantize), sums and out (dequantize) are 2-D with contiguous rows (strides[1]
 * equal to the item size; any row stride, so a field of a structured packet batch or a column slice of a
 * receive buffer works without a copy) and the same row width. Integer rows are int32 in either byte
 * order (their buffer format says which: numpy's '>i4' exports '>i'); loads and stores go through memcpy,
 * so rows need no alignment. rows / out_rows are None or 1-D int64 arrays of row indices; shifts is
 * 1-D int32, divisors 1-D float64, saturated 1-D bool, one entry per selected row.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_quantize.h"

/* ---------------------------------------------------------------------------------------------- */
/* Argument helpers                                                                               */
/* ---------------------------------------------------------------------------------------------- */

typedef struct {
    Py_buffer view;
    char *base;
    Py_ssize_t rows, width, stride;
    int big_endian; /* int32 rows: stored big-endian */
} rows_t;

static int host_is_big_endian(void) {
    const uint16_t probe = 1;
    unsigned char first;
    memcpy(&first, &probe, 1);
    return first == 0;
}

/* A format of one 4-byte item: float32 ('f') or int32 ('i', or 'l' where long is 4 bytes), with an
 * optional byte-order prefix. Sets *big for integers. */
static int check_format(const char *format, int want_float, int *big) {
    const char *f = format ? format : "B";
    int order = 0; /* 0 native, 1 big, 2 little */
    if (*f == '@' || *f == '=') {
        f++;
    } else if (*f == '>' || *f == '!') {
        order = 1;
        f++;
    } else if (*f == '<') {
        order = 2;
        f++;
    }
    if (f[0] == '\0' || f[1] != '\0')
        return -1;
    if (want_float) {
        if (f[0] != 'f')
            return -1;
        if (order != 0 && (order == 1) != host_is_big_endian())
            return -1; /* a float32 of the other byte order: the caller converts it */
        return 0;
    }
    if (f[0] != 'i' && f[0] != 'l')
        return -1;
    *big = order == 0 ? host_is_big_endian() : order == 1;
    return 0;
}

static int get_rows(PyObject *obj, rows_t *r, int writable, int want_float, const char *what) {
    if (PyObject_GetBuffer(obj, &r->view, PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    r->big_endian = 0;
    if (r->view.ndim != 2 || r->view.itemsize != 4 ||
        check_format(r->view.format, want_float, &r->big_endian) < 0) {
        PyErr_Format(PyExc_ValueError, "%s must be a 2-D %s array", what,
                     want_float ? "native float32" : "int32");
        PyBuffer_Release(&r->view);
        return -1;
    }
    r->rows = r->view.shape[0];
    r->width = r->view.shape[1];
    r->stride = r->view.strides[0];
    if (r->width > 1 && r->view.strides[1] != 4) {
        PyErr_Format(PyExc_ValueError, "%s must have contiguous rows", what);
        PyBuffer_Release(&r->view);
        return -1;
    }
    r->base = (char *)r->view.buf;
    return 0;
}

/* A 1-D C-contiguous buffer of n items of itemsize bytes (n < 0: any length, stored in *n_out). */
static int get_vector(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize, Py_ssize_t n,
                      const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->ndim != 1 || view->itemsize != itemsize || (n >= 0 && view->shape[0] != n)) {
        PyErr_Format(PyExc_ValueError, "%s must be a 1-D array of %zd-byte items%s", what, itemsize,
                     n >= 0 ? " with one entry per selected row" : "");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Row indices: None (every row, count = rows) or int64 indices all in [0, rows). */
static int get_index(PyObject *obj, Py_buffer *view, int *present, Py_ssize_t rows, const char *what) {
    *present = 0;
    if (obj == Py_None)
        return 0;
    if (get_vector(obj, view, 0, 8, -1, what) < 0)
        return -1;
    const int64_t *idx = (const int64_t *)view->buf;
    for (Py_ssize_t i = 0; i < view->shape[0]; i++) {
        if (idx[i] < 0 || idx[i] >= rows) {
            PyErr_Format(PyExc_IndexError, "%s[%zd] = %lld is out of range for %zd rows", what, i,
                         (long long)idx[i], rows);
            PyBuffer_Release(view);
            return -1;
        }
    }
    *present = 1;
    return 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* The loops                                                                                      */
/* ---------------------------------------------------------------------------------------------- */

/* ---------------------------------------------------------------------------------------------- */
/* Python entry points                                                                            */
/* ---------------------------------------------------------------------------------------------- */

static PyObject *codec_quantize(PyObject *self, PyObject *args) {
    PyObject *chunks_obj, *rows_obj, *shifts_obj, *out_obj, *sat_obj;
    long long limit;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OOOLKOO:quantize", &chunks_obj, &rows_obj, &shifts_obj, &limit, &seed,
                          &out_obj, &sat_obj))
        return NULL;
    if (limit < 1 || limit > (1LL << 30)) {
        PyErr_Format(PyExc_ValueError, "limit must be in 1..2^30, got %lld", limit);
        return NULL;
    }
    rows_t chunks, out;
    Py_buffer rows_view, shifts_view, sat_view;
    int has_rows;
    if (get_rows(chunks_obj, &chunks, 0, 1, "chunks") < 0)
        return NULL;
    if (get_rows(out_obj, &out, 1, 0, "out") < 0)
        goto fail_chunks;
    if (out.rows != chunks.rows || out.width != chunks.width) {
        PyErr_Format(PyExc_ValueError, "out is %zd x %zd, chunks %zd x %zd", out.rows, out.width, chunks.rows,
                     chunks.width);
        goto fail_out;
    }
    if (get_index(rows_obj, &rows_view, &has_rows, chunks.rows, "rows") < 0)
        goto fail_out;
    Py_ssize_t n = has_rows ? rows_view.shape[0] : chunks.rows;
    if (get_vector(shifts_obj, &shifts_view, 0, 4, n, "shifts") < 0)
        goto fail_rows;
    if (get_vector(sat_obj, &sat_view, 1, 1, n, "saturated") < 0)
        goto fail_shifts;

    const int64_t *idx = has_rows ? (const int64_t *)rows_view.buf : NULL;
    const int32_t *shifts = (const int32_t *)shifts_view.buf;
    uint8_t *sat = (uint8_t *)sat_view.buf;
    const int swap = out.big_endian != host_is_big_endian();
    const Py_ssize_t k = chunks.width, words = k / 2 + 1;
    uint64_t *bits = PyMem_RawMalloc((size_t)words * sizeof(uint64_t));
    if (!bits) {
        PyErr_NoMemory();
        goto fail_sat;
    }
    Py_ssize_t bad_row;
    Py_BEGIN_ALLOW_THREADS;
    bad_row = quantize_rows(NULL, 0, chunks.base, chunks.stride, out.base, out.stride, k, idx, n, shifts,
                            (float)limit, swap, seed, bits, sat);
    Py_END_ALLOW_THREADS;
    PyMem_RawFree(bits);
    if (bad_row >= 0)
        PyErr_Format(PyExc_ValueError, "tensor holds NaN or Inf (first in chunk %zd); refusing to send it",
                     bad_row);

fail_sat:
    PyBuffer_Release(&sat_view);
fail_shifts:
    PyBuffer_Release(&shifts_view);
fail_rows:
    if (has_rows)
        PyBuffer_Release(&rows_view);
fail_out:
    PyBuffer_Release(&out.view);
fail_chunks:
    PyBuffer_Release(&chunks.view);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *codec_dequantize(PyObject *self, PyObject *args) {
    PyObject *sums_obj, *rows_obj, *shifts_obj, *div_obj, *out_obj, *out_rows_obj;
    if (!PyArg_ParseTuple(args, "OOOOOO:dequantize", &sums_obj, &rows_obj, &shifts_obj, &div_obj, &out_obj,
                          &out_rows_obj))
        return NULL;
    rows_t sums, out;
    Py_buffer rows_view, out_rows_view, shifts_view, div_view;
    int has_rows, has_out_rows, has_div = div_obj != Py_None;
    if (get_rows(sums_obj, &sums, 0, 0, "sums") < 0)
        return NULL;
    if (get_rows(out_obj, &out, 1, 1, "out") < 0)
        goto fail_sums;
    if (out.width != sums.width) {
        PyErr_Format(PyExc_ValueError, "out rows hold %zd values, sums rows %zd", out.width, sums.width);
        goto fail_out;
    }
    if (get_index(rows_obj, &rows_view, &has_rows, sums.rows, "rows") < 0)
        goto fail_out;
    Py_ssize_t n = has_rows ? rows_view.shape[0] : sums.rows;
    if (get_index(out_rows_obj, &out_rows_view, &has_out_rows, out.rows, "out_rows") < 0)
        goto fail_rows;
    if ((has_out_rows ? out_rows_view.shape[0] : out.rows) != n) {
        PyErr_Format(PyExc_ValueError, "%zd rows selected in sums, %zd in out", n,
                     has_out_rows ? out_rows_view.shape[0] : out.rows);
        goto fail_out_rows;
    }
    if (get_vector(shifts_obj, &shifts_view, 0, 4, n, "shifts") < 0)
        goto fail_out_rows;
    if (has_div && get_vector(div_obj, &div_view, 0, 8, n, "divisors") < 0)
        goto fail_shifts;

    const int64_t *idx = has_rows ? (const int64_t *)rows_view.buf : NULL;
    const int64_t *out_idx = has_out_rows ? (const int64_t *)out_rows_view.buf : NULL;
    const int32_t *shifts = (const int32_t *)shifts_view.buf;
    const double *div = has_div ? (const double *)div_view.buf : NULL;
    const int swap = sums.big_endian != host_is_big_endian();
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t r = idx ? (Py_ssize_t)idx[i] : i;
        Py_ssize_t o = out_idx ? (Py_ssize_t)out_idx[i] : i;
        int shift = -shifts[i] < -1074 ? -1074 : (-shifts[i] > 1023 ? 1023 : -shifts[i]);
        double scale = ldexp(1.0, shift);
        if (div)
            scale = scale / div[i];
        dequantize_row(sums.base + r * sums.stride, out.base + o * out.stride, sums.width, scale, swap);
    }
    Py_END_ALLOW_THREADS;

    if (has_div)
        PyBuffer_Release(&div_view);
fail_shifts:
    PyBuffer_Release(&shifts_view);
fail_out_rows:
    if (has_out_rows)
        PyBuffer_Release(&out_rows_view);
fail_rows:
    if (has_rows)
        PyBuffer_Release(&rows_view);
fail_out:
    PyBuffer_Release(&out.view);
fail_sums:
    PyBuffer_Release(&sums.view);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* max|x| of one float32 row as its bit pattern (maxabs_bits; stage reads whole chunks with it), and as a
 * float (maxabs_row): NaN when the row holds one (as numpy's max would), +inf for an infinity.
 * On the bit patterns with the sign cleared: for floats that are not NaN their order as unsigned integers
 * is the order of the magnitudes, and every NaN lies above +inf (0x7f800000), so one integer max (which
 * the compiler vectorizes, unlike a float max with NaN semantics) gives all three answers. */
HOT_LOOP
static uint32_t maxabs_bits(const char *src, Py_ssize_t width) {
    uint32_t m = 0;
    for (Py_ssize_t j = 0; j < width; j++) {
        uint32_t bits;
        memcpy(&bits, src + 4 * j, 4);
        bits &= 0x7fffffffu;
        m = bits > m ? bits : m;
    }
    return m;
}

static float maxabs_row(const char *src, Py_ssize_t width) {
    const uint32_t m = maxabs_bits(src, width);
    if (m > 0x7f800000u)
        return NAN;
    float out;
    memcpy(&out, &m, 4);
    return out;
}

static PyObject *codec_maxabs(PyObject *self, PyObject *args) {
    PyObject *chunks_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "OO:maxabs", &chunks_obj, &out_obj))
        return NULL;
    rows_t chunks;
    Py_buffer out_view;
    if (get_rows(chunks_obj, &chunks, 0, 1, "chunks") < 0)
        return NULL;
    if (get_vector(out_obj, &out_view, 1, 4, chunks.rows, "out") < 0) {
        PyBuffer_Release(&chunks.view);
        return NULL;
    }
    float *out = (float *)out_view.buf;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t r = 0; r < chunks.rows; r++)
        out[r] = maxabs_row(chunks.base + r * chunks.stride, chunks.width);
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&out_view);
    PyBuffer_Release(&chunks.view);
    Py_RETURN_NONE;
}

/* One row staged: dst = src * scale (scale 1: a copy; float32 products, as numpy's ``chunks *= w``), the
 * values past ``len`` zero, and max|dst| over the row as maxabs_row gives it (on the bit patterns: NaN above
 * +inf above every finite magnitude). */
HOT_LOOP
static uint32_t stage_row(const char *src, char *dst, Py_ssize_t len, Py_ssize_t width, float scale) {
    uint32_t m = 0;
    for (Py_ssize_t j = 0; j < len; j++) {
        float x;
        memcpy(&x, src + 4 * j, 4);
        x *= scale; /* (times 1: the same bits, NaN aside, and a NaN row is zeroed) */
        uint32_t bits;
        memcpy(&bits, &x, 4);
        memcpy(dst + 4 * j, &x, 4);
        bits &= 0x7fffffffu;
        m = bits > m ? bits : m;
    }
    if (len < width)
        memset(dst + 4 * len, 0, (size_t)(4 * (width - len)));
    return m;
}

static PyObject *codec_stage(PyObject *self, PyObject *args) {
    PyObject *local_obj, *chunks_obj, *prop_obj;
    Py_ssize_t n, skip = 0;
    float scale;
    int empty_exp, nonfinite_exp;
    if (!PyArg_ParseTuple(args, "OOnfOii|n:stage", &local_obj, &chunks_obj, &n, &scale, &prop_obj, &empty_exp,
                          &nonfinite_exp, &skip))
        return NULL;
    if (skip < 0 || (skip > 0 && scale != 1.0f)) {
        PyErr_SetString(PyExc_ValueError, "stage: skip must be >= 0, and 0 unless scale is 1 (rows read, not staged)");
        return NULL;
    }
    rows_t chunks;
    Py_buffer local_view, prop_view;
    int has_local = local_obj != Py_None;
    if (get_rows(chunks_obj, &chunks, 1, 1, "chunks") < 0)
        return NULL;
    if (chunks.stride != 4 * chunks.width || n < 0 || n > chunks.rows * chunks.width) {
        PyErr_Format(PyExc_ValueError, "chunks must be C-contiguous and hold at least n = %zd values", n);
        PyBuffer_Release(&chunks.view);
        return NULL;
    }
    if (has_local && get_vector(local_obj, &local_view, 0, 4, n, "local") < 0) {
        PyBuffer_Release(&chunks.view);
        return NULL;
    }
    if (get_vector(prop_obj, &prop_view, 1, 4, chunks.rows, "proposals") < 0) {
        if (has_local)
            PyBuffer_Release(&local_view);
        PyBuffer_Release(&chunks.view);
        return NULL;
    }
    const char *src = has_local ? (const char *)local_view.buf : chunks.base;
    int32_t *prop = (int32_t *)prop_view.buf;
    const Py_ssize_t k = chunks.width;
    Py_ssize_t nonfinite = 0;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t r = 0; r < chunks.rows; r++) {
        const Py_ssize_t start = r * k;
        const Py_ssize_t len = n - start < 0 ? 0 : (n - start > k ? k : n - start);
        char *dst = chunks.base + r * chunks.stride;
        /* rows below ``skip`` (whole chunks of ``local``, scale 1) are read, not staged: the reduce quantizes
         * them where they lie */
        const int peek = r < skip && len == k && has_local;
        const uint32_t m = peek ? maxabs_bits(src + 4 * start, len) : stage_row(src + 4 * start, dst, len, k, scale);
        if (m >= 0x7f800000u) { /* NaN or Inf: the row proposes the non-finite exponent and sends zeros */
            prop[r] = nonfinite_exp;
            if (!peek)
                memset(dst, 0, (size_t)(4 * k));
            nonfinite++;
        } else if (m == 0) {
            prop[r] = empty_exp;
        } else {
            float mx;
            int e;
            memcpy(&mx, &m, 4);
            frexpf(mx, &e);
            prop[r] = e;
        }
    }
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&prop_view);
    if (has_local)
        PyBuffer_Release(&local_view);
    PyBuffer_Release(&chunks.view);
    return PyLong_FromSsize_t(nonfinite);
}

static PyMethodDef codec_methods[] = {
    {"quantize", codec_quantize, METH_VARARGS,
     "quantize(chunks, rows, shifts, limit, seed, out, saturated): stochastic rounding into int32 rows."},
    {"dequantize", codec_dequantize, METH_VARARGS,
     "dequantize(sums, rows, shifts, divisors, out, out_rows): int32 rows times 2^-shift / divisor."},
    {"maxabs", codec_maxabs, METH_VARARGS, "maxabs(chunks, out): out[r] = max|chunks[r]| (NaN if any)."},
    {"stage", codec_stage, METH_VARARGS,
     "stage(local, chunks, n, scale, proposals, empty, nonfinite[, skip]): stage rows (those below skip only "
     "read), propose exponents."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef codec_module = {
    PyModuleDef_HEAD_INIT, "_codec", "Fast path of hostlib.codec (see hostlib/_codec.c).", -1, codec_methods,
};

PyMODINIT_FUNC PyInit__codec(void) { return PyModule_Create(&codec_module); }
