/*
 * hostlib._engine: the reduce engine's steady state, a few calls per wake-up: settling a received batch (below),
 * the send half of a steady wake-up (Wake: the scan, the window and slot-reuse rules, quantizing and committing
 * the units that go), and the scans, quantization, slot-reuse and deadline rules each function's comment
 * describes.
 *
 * hostlib/transport/engine.py is the contract and the Python reference (ReduceEngine._handle,
 * _on_results, _settle, _time_answers, _settle_values); this module is its native path, chosen by
 * hostlib/transport/native.py (LTA_ENGINE=python forces the reference). Differential tests
 * (tests/test_engine_native.py) feed both the same RESULT batches and compare every array they write.
 *
 * Why C: a K = 64 reduce of 4 MiB is 16,384 RESULTs in about 25 batches; the reference settles a batch
 * with ~60 small numpy operations (masks, gathers, a median, the frontier's bit matrix), each a few
 * microseconds of Python and dispatch whatever the batch size. Here a batch is one pass over its rows.
 *
 *   settle(data, lens, n, params, low, now, newest_unit, state, flushes, retx, proven_lost, sent_at,
 *          flushed_at, critical_unit, count, bitmap, weight, result_flags, shift, out, exp_known,
 *          nonfinite, own_exp, exp_bitmap, frontier, later_reached, settled, side, rtt, flush) -> tuple
 *
 *   Rows 0..n-1 of ``data`` (datagram i: data[i, :lens[i]]) are one received batch. ``params`` is the
 *   tuple (packet_bytes, version, job_id, probe_slot, data_slots, n_workers, worker_id, closer_id, k,
 *   renormalize (0 count, 1 weight, 2 none), base, units, exp_units, chunks_count, headroom_bits), ``low``
 *   the plan's first unit not settled. Each row is classified as the reference does; PARAM and PARAM_REQ
 *   rows of the job are listed in ``side`` (for the Python engine, which handles them); RESULTs of the job
 *   (not the probe slot's) raise ``newest_unit[0]`` (the newest global unit answered) and are routed to
 *   the plan's units: in range and not DONE, first copy only, they are settled (state DONE, values
 *   dequantized and renormalized into ``out``, count, bitmap, weight, flags, shift; exponent units give
 *   their chunks' shifts, exp_known, nonfinite, own_exp, exp_bitmap); later units' bits go to
 *   ``later_reached``. RTT and FLUSH samples are computed as the reference's _time_answers computes them,
 *   at time ``now``. After a batch with RESULTs, units of the plan a pool or more below the newest unit
 *   are given up, overtaken (the reference's _drop_overtaken).
 *
 *   Returns (settled, results, side, any_later, retx, full, critical_short, ignored, seen_bits,
 *   any_all_bits, rtt_median_ms, rtt_min_ms, flush_median_ms, own_reached, withheld_seen, overtaken, lost,
 *   lost_retx): ``settled`` units are listed in ``settled`` (first-copy order); NaN for a sample that has
 *   none; ``lost``: in-flight units found lost (proven_lost) settled here, ``lost_retx``: those answered by
 *   a resent RESULT (their round had closed: Deadlines.lost_answers).
 *
 *   Every array is 1-D C-contiguous of the plan's dtype (state int8, the masks bool, count/flushes/
 *   retx/weight/result_flags/frontier int64, bitmap/exp_bitmap uint64, shift int32, times float64),
 *   out is (chunks, K) float32 C-contiguous; scratch arrays (settled, side, rtt, flush) hold n entries.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_quantize.h"

/* Header offsets and ops of the wire format (hostlib/protocol.py; checked by tests/test_engine_native.py). */
#define OFF_VERSION 0
#define OFF_OP 1
#define OFF_FLAGS 2
#define OFF_EXP 3
#define OFF_JOB 4
#define OFF_WORKER 6
#define OFF_COUNT 7
#define OFF_SLOT 8
#define OFF_NELEM 10
#define OFF_SEQ 12
#define OFF_STEP 16
#define OFF_CHUNK 20
#define OFF_WEIGHT 24
#define OFF_BITMAP 28
#define HEADER_BYTES 36
#define OP_RESULT 2
#define OP_PARAM 4
#define OP_PARAM_REQ 5
#define FLAG_RETX 0x01
#define FLAG_MAX 0x08
#define FLAG_SATURATED 0x02
#define ST_IN_FLIGHT 1
#define ST_DONE 2
#define ST_GAVE_UP 3
#define NONFINITE_EXPONENT (1LL << 24)
#define SHIFT_LIMIT 127
#define ROUNDS_PER_UNIT 2 /* a unit's rounds in its slot: its first and its redo (hostlib.protocol) */

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
static const int host_big_endian = 1;
#else
static const int host_big_endian = 0;
#endif

static inline uint16_t be16(const uint8_t *p) { return (uint16_t)((p[0] << 8) | p[1]); }
static inline uint32_t be32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}
static inline uint64_t be64(const uint8_t *p) { return ((uint64_t)be32(p) << 32) | be32(p + 4); }
static inline void put_be16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)(v >> 8);
    p[1] = (uint8_t)v;
}
static inline void put_be32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

typedef struct {
    Py_buffer view;
    int held;
} buf_t;

/* A 1-D C-contiguous buffer of at least min_len items of itemsize bytes. */
static int get_vec(PyObject *obj, buf_t *b, Py_ssize_t itemsize, Py_ssize_t min_len, int writable,
                   const char *what) {
    if (PyObject_GetBuffer(obj, &b->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    b->held = 1;
    if (b->view.ndim != 1 || b->view.itemsize != itemsize || b->view.shape[0] < min_len) {
        PyErr_Format(PyExc_ValueError, "%s must be a 1-D contiguous array of %zd-byte items, at least %zd long",
                     what, itemsize, min_len);
        return -1;
    }
    return 0;
}

/* What a function expects of each of its 1-D arrays: the item size, whether it writes it, its name. */
typedef struct {
    Py_ssize_t item;
    int writable;
    const char *name;
} vec_spec_t;

/* get_vec for objs[0..n-1] by spec[0..n-1], each at least min_len long; -1 (an exception set) at the first that
 * does not fit. The buffers taken are released by release_vecs, whatever was returned. */
static int get_vecs(PyObject *const *objs, buf_t *b, const vec_spec_t *spec, int n, Py_ssize_t min_len) {
    for (int i = 0; i < n; i++)
        if (get_vec(objs[i], &b[i], spec[i].item, min_len, spec[i].writable, spec[i].name) < 0)
            return -1;
    return 0;
}

static void release_vecs(buf_t *b, int n) {
    for (int i = 0; i < n; i++)
        if (b[i].held)
            PyBuffer_Release(&b[i].view);
}

/* A settled chunk's values go to two places at once: the plan's rows (kept for the prev fallback) and the
 * caller's buffer (times its scale). Neither is read again in this reduce, and at 64 KiB datagrams each
 * is a pass over the whole gradient, so on x86-64 the stores bypass the cache (a store to a line not in
 * cache otherwise reads it first: a 16 MB pair of writes took 6.3-6.5 ms one way and 3.9-4.2 ms this
 * way, a C test on the 2-core host). The values are dequantize_row's, bit for bit: each group of 16 is
 * dequantized by its body, the caller's copy is that times the scale in float32, as the plain path.
 * Only for long rows: a row's first and last cache lines are written the plain way, and where rows are
 * short those shared lines are most of them (at K = 64 streaming made the settle 4x slower: 1.6-1.9 ->
 * 6.7-7.2 ms a 4 MiB reduce, the rows landing in arrival order, their lines part streamed, part not). */
#define STREAM_MIN_VALUES 1024

/* The plain way: values [lo, hi) of a row dequantized into ``out``, and those below ``m`` (the caller's
 * share of the row) times the scale into ``user``. */
static void deliver_plain(const char *src, float *out, float *user, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t m,
                          double scale, float user_scale, int swap) {
    dequantize_row(src + 4 * lo, (char *)(out + lo), hi - lo, scale, swap);
    const Py_ssize_t top = hi < m ? hi : m;
    if (top <= lo)
        return;
    if (user_scale == 1.0f)
        memcpy(user + lo, out + lo, (size_t)(top - lo) * 4);
    else
        for (Py_ssize_t e = lo; e < top; e++)
            user[e] = out[e] * user_scale;
}

#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#define STREAM_GROUP 16
static inline __attribute__((always_inline)) void put_group(float *dst, __m128 v, int aligned) {
    if (aligned)
        _mm_stream_ps(dst, v);
    else
        _mm_storeu_ps(dst, v);
}

HOT_LOOP
static void deliver_row(const char *src, float *out, float *user, Py_ssize_t k, double scale, float user_scale,
                        int swap) {
    /* up to out's first cache line boundary the plain way, then whole lines around the cache */
    Py_ssize_t j = (Py_ssize_t)((64 - ((uintptr_t)out & 63)) & 63) / 4;
    j = j < k ? j : k;
    deliver_plain(src, out, user, 0, j, k, scale, user_scale, swap);
    float t[STREAM_GROUP];
    const int user_aligned = ((uintptr_t)(user + j) & 15) == 0, scaled = user_scale != 1.0f;
    const __m128 s = _mm_set1_ps(user_scale);
    for (; j + STREAM_GROUP <= k; j += STREAM_GROUP) {
        if (swap)
            dequantize_body(src + 4 * j, (char *)t, STREAM_GROUP, scale, 1);
        else
            dequantize_body(src + 4 * j, (char *)t, STREAM_GROUP, scale, 0);
        for (int q = 0; q < STREAM_GROUP; q += 4) {
            __m128 v = _mm_loadu_ps(t + q);
            _mm_stream_ps(out + j + q, v);
            put_group(user + j + q, scaled ? _mm_mul_ps(v, s) : v, user_aligned);
        }
    }
    deliver_plain(src, out, user, j, k, k, scale, user_scale, swap);
}

/* Streamed stores are weakly ordered: one fence before the values are handed on. */
static inline void stream_fence(int streamed) {
    if (streamed)
        _mm_sfence();
}
#else
static void deliver_row(const char *src, float *out, float *user, Py_ssize_t k, double scale, float user_scale,
                        int swap) {
    deliver_plain(src, out, user, 0, k, k, scale, user_scale, swap);
}

static inline void stream_fence(int streamed) { (void)streamed; }
#endif

/* The reference's np.partition(v, len // 2)[len // 2]: the upper median, by Wirth's selection (v is
 * reordered). A batch of K = 64 RESULTs brings ~500 RTT samples; sorting 550 with qsort and its comparator
 * took 10 us, selecting 0.3 us (-O3, this host). Any selection gives the same value: the (m / 2)-th smallest. */
static double upper_median(double *v, Py_ssize_t m) {
    const Py_ssize_t k = m / 2;
    Py_ssize_t lo = 0, hi = m - 1;
    while (lo < hi) {
        const double x = v[k];
        Py_ssize_t i = lo, j = hi;
        do {
            while (v[i] < x)
                i++;
            while (x < v[j])
                j--;
            if (i <= j) {
                const double t = v[i];
                v[i] = v[j];
                v[j] = t;
                i++;
                j--;
            }
        } while (i <= j);
        if (j < k)
            lo = i;
        if (k < i)
            hi = j;
    }
    return v[k];
}

enum {
    A_NEWEST_UNIT,
    A_STATE,
    A_FLUSHES,
    A_RETX,
    A_PROVEN_LOST,
    A_SENT_AT,
    A_FLUSHED_AT,
    A_CRITICAL_UNIT,
    A_COUNT,
    A_BITMAP,
    A_WEIGHT,
    A_RESULT_FLAGS,
    A_SHIFT,
    A_OUT,
    A_EXP_KNOWN,
    A_NONFINITE,
    A_OWN_EXP,
    A_EXP_BITMAP,
    A_FRONTIER,
    A_LATER,
    A_SETTLED,
    A_SIDE,
    A_RTT,
    A_FLUSH,
    A_SPEC,
    A_AGREED_EXP,
    A_AGREED_BITS,
    A_REDO,
    N_ARRAYS
};

static PyObject *engine_settle(PyObject *self, PyObject *args) {
    PyObject *data_obj, *lens_obj, *objs[N_ARRAYS];
    Py_ssize_t n, packet_bytes, version, job_id, probe_slot, slots, n_workers, worker_id, closer_id, k, renorm;
    long long base;
    Py_ssize_t units, exp_units, chunks_count, headroom, low;
    double now;
    PyObject *deliver_obj = Py_None, *user_out_obj = NULL, *quantized_obj = NULL, *delivered_obj = NULL;
    double user_scale = 1.0;
    if (!PyArg_ParseTuple(args, "OOn(nnnnnnnnnnLnnnn)ndOOOOOOOOOOOOOOOOOOOOOOOOOOOO|O:settle", &data_obj, &lens_obj, &n,
                          &packet_bytes, &version, &job_id, &probe_slot, &slots, &n_workers, &worker_id,
                          &closer_id, &k, &renorm, &base, &units, &exp_units, &chunks_count, &headroom, &low, &now,
                          &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5], &objs[6], &objs[7],
                          &objs[8], &objs[9], &objs[10], &objs[11], &objs[12], &objs[13], &objs[14], &objs[15],
                          &objs[16], &objs[17], &objs[18], &objs[19], &objs[20], &objs[21], &objs[22], &objs[23],
                          &objs[24], &objs[25], &objs[26], &objs[27], &deliver_obj))
        return NULL;
    if (deliver_obj != Py_None && !PyArg_ParseTuple(deliver_obj, "OdOO:settle deliver", &user_out_obj, &user_scale,
                                                    &quantized_obj, &delivered_obj))
        return NULL;
    if (n_workers < 1 || n_workers > 64 || worker_id < 0 || worker_id >= n_workers || k < 1 || slots < 1 ||
        units < 1 || exp_units < 0 || exp_units > units || chunks_count != units - exp_units || n < 0 || low < 0 ||
        packet_bytes != HEADER_BYTES + 4 * k) {
        PyErr_SetString(PyExc_ValueError, "settle: inconsistent plan parameters");
        return NULL;
    }
    Py_buffer data_view;
    buf_t lens = {0}, a[N_ARRAYS], user_out_b = {0}, quantized_b = {0}, delivered_b = {0};
    memset(a, 0, sizeof(a));
    PyObject *result = NULL;
    if (PyObject_GetBuffer(data_obj, &data_view, PyBUF_STRIDES) < 0)
        return NULL;
    if (data_view.ndim != 2 || data_view.itemsize != 1 || data_view.shape[0] < n ||
        data_view.shape[1] < packet_bytes || data_view.strides[1] != 1) {
        PyErr_SetString(PyExc_ValueError, "settle: data must be a 2-D uint8 receive buffer of packet rows");
        goto done;
    }
    const Py_ssize_t c_count = chunks_count;
    const struct {
        Py_ssize_t item, len;
        int writable;
        const char *name;
    } spec[N_ARRAYS] = {
        {8, 1, 1, "newest_unit"},      {1, units, 1, "state"},        {8, units, 0, "flushes"},
        {8, units, 0, "retx"},         {1, units, 0, "proven_lost"},  {8, units, 0, "sent_at"},
        {8, units, 0, "flushed_at"},   {1, units, 0, "critical_unit"}, {8, c_count, 1, "count"},
        {8, c_count, 1, "bitmap"},     {8, c_count, 1, "weight"},     {8, c_count, 1, "result_flags"},
        {4, c_count, 1, "shift"},      {4, c_count * k, 1, "out"},    {1, c_count, 1, "exp_known"},
        {1, c_count, 1, "nonfinite"},  {1, c_count, 1, "own_exp"},    {8, c_count, 1, "exp_bitmap"},
        {8, n_workers, 1, "frontier"}, {8, n_workers, 1, "later_reached"}, {8, n, 1, "settled"},
        {8, n, 1, "side"},             {8, n, 1, "rtt"},              {8, n, 1, "flush"},
        {1, c_count, 0, "spec"},       {4, c_count, 1, "agreed_exp"}, {8, c_count, 1, "agreed_bits"},
        {8, n, 1, "redo"},
    };
    if (get_vec(lens_obj, &lens, 8, n, 0, "lens") < 0)
        goto done;
    for (int i = 0; i < N_ARRAYS; i++) {
        if (i == A_OUT) { /* (chunks, K) float32: read as one flat run of values */
            if (PyObject_GetBuffer(objs[i], &a[i].view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
                goto done;
            a[i].held = 1;
            if (a[i].view.itemsize != 4 || a[i].view.len < (Py_ssize_t)4 * c_count * k) {
                PyErr_SetString(PyExc_ValueError, "out must be a (chunks, K) float32 array");
                goto done;
            }
            continue;
        }
        if (get_vec(objs[i], &a[i], spec[i].item, spec[i].len, spec[i].writable, spec[i].name) < 0)
            goto done;
    }
    /* deliver = (user_out, scale, quantized, delivered): the caller's output (float32, at most the chunks'
     * values) gets each data chunk's values times scale as it is settled with a count > 0, once the chunk
     * was quantized (its input is never read again then: user_out may be the input itself), and
     * delivered[c] is set; ReduceEngine._finish writes the rest (ReducePlan.deliver_to). */
    Py_ssize_t user_n = 0;
    float *user_out = NULL;
    const uint8_t *quantized = NULL;
    uint8_t *delivered = NULL;
    if (deliver_obj != Py_None) {
        if (PyObject_GetBuffer(user_out_obj, &user_out_b.view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0)
            goto done;
        user_out_b.held = 1;
        user_n = user_out_b.view.len / 4;
        if (user_out_b.view.itemsize != 4 || user_n > c_count * k) {
            PyErr_SetString(PyExc_ValueError, "settle: deliver's out must be float32, at most chunks * K values");
            goto done;
        }
        if (get_vec(quantized_obj, &quantized_b, 1, c_count, 0, "quantized") < 0 ||
            get_vec(delivered_obj, &delivered_b, 1, c_count, 1, "delivered") < 0)
            goto done;
        user_out = (float *)user_out_b.view.buf;
        quantized = (const uint8_t *)quantized_b.view.buf;
        delivered = (uint8_t *)delivered_b.view.buf;
    }
    const float user_scale_f = (float)user_scale;
    int streamed = 0; /* deliver_row wrote around the cache: fenced before the caller may read */

    const uint8_t *data = (const uint8_t *)data_view.buf;
    const Py_ssize_t row_stride = data_view.strides[0];
    const int64_t *len = (const int64_t *)lens.view.buf;
    int64_t *newest_unit = (int64_t *)a[A_NEWEST_UNIT].view.buf;
    int8_t *state = (int8_t *)a[A_STATE].view.buf;
    const int64_t *flushes = (const int64_t *)a[A_FLUSHES].view.buf;
    const int64_t *retx_sent = (const int64_t *)a[A_RETX].view.buf;
    const uint8_t *proven_lost = (const uint8_t *)a[A_PROVEN_LOST].view.buf;
    const double *sent_at = (const double *)a[A_SENT_AT].view.buf;
    const double *flushed_at = (const double *)a[A_FLUSHED_AT].view.buf;
    const uint8_t *critical_unit = (const uint8_t *)a[A_CRITICAL_UNIT].view.buf;
    int64_t *count = (int64_t *)a[A_COUNT].view.buf;
    uint64_t *bitmap = (uint64_t *)a[A_BITMAP].view.buf;
    int64_t *weight = (int64_t *)a[A_WEIGHT].view.buf;
    int64_t *result_flags = (int64_t *)a[A_RESULT_FLAGS].view.buf;
    int32_t *shift = (int32_t *)a[A_SHIFT].view.buf;
    float *out = (float *)a[A_OUT].view.buf;
    uint8_t *exp_known = (uint8_t *)a[A_EXP_KNOWN].view.buf;
    uint8_t *nonfinite = (uint8_t *)a[A_NONFINITE].view.buf;
    uint8_t *own_exp = (uint8_t *)a[A_OWN_EXP].view.buf;
    uint64_t *exp_bitmap = (uint64_t *)a[A_EXP_BITMAP].view.buf;
    int64_t *frontier = (int64_t *)a[A_FRONTIER].view.buf;
    int64_t *later = (int64_t *)a[A_LATER].view.buf;
    int64_t *settled = (int64_t *)a[A_SETTLED].view.buf;
    int64_t *side = (int64_t *)a[A_SIDE].view.buf;
    double *rtt = (double *)a[A_RTT].view.buf;
    double *flush = (double *)a[A_FLUSH].view.buf;
    const uint8_t *spec_c = (const uint8_t *)a[A_SPEC].view.buf;
    int32_t *agreed_exp = (int32_t *)a[A_AGREED_EXP].view.buf;
    uint64_t *agreed_bits = (uint64_t *)a[A_AGREED_BITS].view.buf;
    int64_t *redo = (int64_t *)a[A_REDO].view.buf;

    const uint64_t all_bits = n_workers == 64 ? ~0ULL : ((1ULL << n_workers) - 1);
    Py_ssize_t n_settled = 0, n_results = 0, n_side = 0, n_rtt = 0, n_flush = 0, n_redo = 0;
    long long retx_count = 0, full = 0, critical_short = 0, lost = 0, lost_retx = 0;
    int any_later = 0, any_all_bits = 0, withheld_seen = 0;
    uint64_t seen_bits = 0;
    double rtt_min = NAN;
    int64_t reached[64];
    for (Py_ssize_t w = 0; w < n_workers; w++)
        reached[w] = -1, later[w] = -1;
    Py_ssize_t overtaken = 0;

    Py_BEGIN_ALLOW_THREADS;
    /* Pass 1: classify, route, settle the unit states and take the samples (reference: _handle,
     * _on_results, _settle, _time_answers). */
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *h = data + i * row_stride;
        if (len[i] != packet_bytes || h[OFF_VERSION] != version || be16(h + OFF_JOB) != job_id)
            continue;
        const int op = h[OFF_OP];
        if (op == OP_PARAM || op == OP_PARAM_REQ) {
            side[n_side++] = i;
            continue;
        }
        const int64_t slot = be16(h + OFF_SLOT);
        if (op != OP_RESULT || slot == probe_slot)
            continue;
        const int64_t round = (int64_t)be32(h + OFF_SEQ) - 1; /* (hostlib.protocol.seq_unit) */
        const int64_t pair = round < 0 ? -1 : round / ROUNDS_PER_UNIT; /* (seq 0: below every unit) */
        const int64_t global = pair * slots + slot;
        const int phase = (int)(round - pair * ROUNDS_PER_UNIT);
        if (slot < slots && newest_unit[0] < global)
            newest_unit[0] = global;
        n_results++;
        const int64_t u = global - base;
        const uint64_t bits = be64(h + OFF_BITMAP);
        /* A worker's bit proves it sent every unit up to this one (units go in order): in a redo's round only
         * the first round's contributors' (weight 2^w) do; the others' zeros went out of order */
        const uint64_t proof = phase == 1 ? bits & (uint64_t)be32(h + OFF_WEIGHT) : bits;
        const int flagged = phase == 0 && (h[OFF_FLAGS] & FLAG_SATURATED) && h[OFF_COUNT] > 0;
        if (u >= units) { /* a later reduce's: what its bits prove the peers sent (reuse.py) */
            any_later = 1;
            for (Py_ssize_t w = 0; w < n_workers; w++)
                if ((proof >> w) & 1 && later[w] < u)
                    later[w] = u;
            if (phase == 1 || flagged)
                redo[n_redo++] = i; /* a later unit redone: this worker joins its redo there (_on_redo) */
            continue;
        }
        if (u < 0 || state[u] == ST_DONE)
            continue; /* (a later copy of a unit settled in this batch too: the first copy wins) */
        if (flagged && u >= exp_units) {
            redo[n_redo++] = i; /* a first round some contributor clamped: redone in the unit's second round */
            continue;
        }
        const int prior = state[u];
        state[u] = ST_DONE;
        settled[n_settled] = u;
        side[n - 1 - n_settled] = i; /* the row of each settled unit, from the far end of side */
        n_settled++;
        const int flags = h[OFF_FLAGS];
        const int64_t cnt = h[OFF_COUNT];
        const int retx = (flags & FLAG_RETX) != 0;
        retx_count += retx;
        seen_bits |= bits;
        any_all_bits |= bits == all_bits;
        full += cnt == n_workers;
        critical_short += critical_unit[u] && cnt < n_workers;
        if (prior == ST_IN_FLIGHT && proven_lost[u]) { /* a unit found lost: was its round closed? */
            lost++;
            lost_retx += retx;
        }
        if (prior == ST_IN_FLIGHT && retx_sent[u] == 0) {
            if (!retx && (flushes[u] == 0 || (cnt == n_workers && !proven_lost[u]))) {
                double ms = (now - sent_at[u]) * 1000.0;
                rtt[n_rtt++] = ms;
                if (!(rtt_min <= ms)) /* (NaN at first) */
                    rtt_min = ms;
            }
            if (flushes[u] == 1 && (retx || h[OFF_WORKER] == closer_id))
                flush[n_flush++] = (now - flushed_at[u]) * 1000.0;
        }
        if (proof == all_bits) {
            for (Py_ssize_t w = 0; w < n_workers; w++)
                if (reached[w] < u)
                    reached[w] = u;
        } else {
            for (Py_ssize_t w = 0; w < n_workers; w++)
                if ((proof >> w) & 1 && reached[w] < u)
                    reached[w] = u;
        }
    }
    for (Py_ssize_t w = 0; w < n_workers; w++)
        if (frontier[w] < reached[w])
            frontier[w] = reached[w];

    /* Pass 2: exponent units (every chunk they cover gets its agreed exponent), then pass 3: data units,
     * in that order as the reference's _settle_values (a data RESULT a peer's FLUSH closed may share a
     * batch with its chunk's exponent RESULT; the data RESULT's shift is the one kept). */
    for (int pass = 0; pass < 2; pass++) {
        for (Py_ssize_t j = 0; j < n_settled; j++) {
            const int64_t u = settled[j];
            const int is_exp = u < exp_units;
            if (is_exp != (pass == 0))
                continue;
            const uint8_t *h = data + side[n - 1 - j] * row_stride;
            const uint8_t *payload = h + HEADER_BYTES;
            const int64_t cnt = h[OFF_COUNT];
            const uint64_t bits = be64(h + OFF_BITMAP);
            if (is_exp) {
                if (cnt <= 0)
                    continue;
                for (Py_ssize_t e = 0; e < k; e++) {
                    const int64_t c = u * k + e;
                    if (c >= c_count)
                        break;
                    const int64_t agreed = (int32_t)be32(payload + 4 * e);
                    agreed_exp[c] = (int32_t)agreed;
                    agreed_bits[c] = bits;
                    exp_known[c] = 1;
                    nonfinite[c] = agreed >= NONFINITE_EXPONENT;
                    if (spec_c[c]) /* sent at a speculated exponent: its shift and its withholding stay */
                        continue;
                    withheld_seen |= bits != all_bits;
                    int64_t s = (30 - headroom) - agreed;
                    shift[c] = (int32_t)(s < -SHIFT_LIMIT ? -SHIFT_LIMIT : (s > SHIFT_LIMIT ? SHIFT_LIMIT : s));
                    own_exp[c] = (bits >> worker_id) & 1;
                    exp_bitmap[c] = bits;
                }
                continue;
            }
            const int64_t c = u - exp_units;
            const int64_t w = be32(h + OFF_WEIGHT);
            const int32_t s = (int8_t)h[OFF_EXP];
            /* A redo's round (its unit's second): every worker sends, the first round's contributors their
             * values with weight 2^w, the others zeros with weight 0, so the weights' sum is the contributors
             * counted (docs/protocol.md, "Speculated exponents") */
            const int redone = ((int64_t)be32(h + OFF_SEQ) - 1) % ROUNDS_PER_UNIT == 1;
            const uint64_t in = redone ? bits & (uint64_t)w : bits;
            const int64_t counted = redone ? (int64_t)__builtin_popcountll(in) : cnt;
            count[c] = counted;
            bitmap[c] = in;
            weight[c] = w;
            result_flags[c] = h[OFF_FLAGS];
            shift[c] = s;
            if (counted <= 0)
                continue;
            const double divisor = renorm == 0   ? (double)counted
                                   : renorm == 1 ? (double)(w > 0 ? w : counted)
                                                 : (double)n_workers;
            const double scale = ldexp(1.0, -s) / divisor;
            /* (the payload is big-endian: swapped on a little-endian host) */
            if (user_out == NULL || !quantized[c] || c * k >= user_n) {
                dequantize_row((const char *)payload, (char *)(out + c * k), k, scale, !host_big_endian);
                continue;
            }
            const Py_ssize_t m = user_n - c * k < k ? user_n - c * k : k; /* (less in the caller's last chunk) */
            if (k >= STREAM_MIN_VALUES && m == k) { /* a whole long chunk: around the cache (64 KiB datagrams) */
                deliver_row((const char *)payload, out + c * k, user_out + c * k, k, scale, user_scale_f,
                            !host_big_endian);
                streamed = 1;
            } else {
                deliver_plain((const char *)payload, out + c * k, user_out + c * k, 0, k, m, scale, user_scale_f,
                              !host_big_endian);
            }
            delivered[c] = 1;
        }
    }

    /* Units overtaken (reference: ReduceEngine._drop_overtaken, after every batch with RESULTs): a RESULT
     * for global unit g shows its sender sent every unit before it, so the slot of each unit up to g - D
     * moved past that unit's round: units of this reduce still open there can never be answered: given up. */
    if (n_results) {
        int64_t hi = newest_unit[0] - base - slots + 1;
        if (hi > units)
            hi = units;
        for (int64_t v = low; v < hi; v++)
            if (state[v] < ST_DONE) {
                state[v] = ST_GAVE_UP;
                overtaken++;
            }
    }
    stream_fence(streamed);
    Py_END_ALLOW_THREADS;

    double rtt_median = n_rtt ? upper_median(rtt, n_rtt) : NAN;
    double flush_median = n_flush ? upper_median(flush, n_flush) : NAN;
    result = Py_BuildValue("nnniLLLnKidddLinLLn", n_settled, n_results, n_side, any_later, retx_count, full,
                           critical_short, n - n_side - n_settled - n_redo, (unsigned long long)seen_bits,
                           any_all_bits, rtt_median, rtt_min, flush_median, (long long)reached[worker_id],
                           withheld_seen, overtaken, lost, lost_retx, n_redo);
done:
    PyBuffer_Release(&data_view);
    if (lens.held)
        PyBuffer_Release(&lens.view);
    release_vecs(a, N_ARRAYS);
    release_vecs(&user_out_b, 1);
    release_vecs(&quantized_b, 1);
    release_vecs(&delivered_b, 1);
    return result;
}

/* scan's work: *low moved past the settled prefix (up to next_unit), whether any unit is unsettled, and the
 * units in flight in [*low, next_unit) in *in_flight. */
static int scan_core(const int8_t *state, Py_ssize_t units, Py_ssize_t *low_io, Py_ssize_t next_unit,
                     Py_ssize_t *in_flight_out) {
    Py_ssize_t low = *low_io;
    Py_ssize_t i = low, top = next_unit > low ? next_unit : low;
    while (i < top && state[i] >= ST_DONE)
        i++;
    low = i;
    int unsettled = low < next_unit;
    for (Py_ssize_t j = low; !unsettled && j < units; j++)
        unsettled = state[j] < ST_DONE;
    Py_ssize_t in_flight = 0;
    for (Py_ssize_t j = low; j < next_unit; j++)
        in_flight += state[j] == ST_IN_FLIGHT;
    *low_io = low;
    *in_flight_out = in_flight;
    return unsettled;
}

/* scan(state, low, next_unit) -> (low, unsettled, in_flight): ReducePlan.advance_low, then
 * ReducePlan.unsettled, then the units in flight in [low, next_unit) (ReduceEngine._send_ready's count). */
static PyObject *engine_scan(PyObject *self, PyObject *args) {
    PyObject *state_obj;
    Py_ssize_t low, next_unit;
    if (!PyArg_ParseTuple(args, "Onn:scan", &state_obj, &low, &next_unit))
        return NULL;
    buf_t st = {0};
    if (get_vec(state_obj, &st, 1, 0, 0, "state") < 0) {
        if (st.held)
            PyBuffer_Release(&st.view);
        return NULL;
    }
    const int8_t *state = (const int8_t *)st.view.buf;
    const Py_ssize_t units = st.view.shape[0];
    if (low < 0 || next_unit < 0 || low > units || next_unit > units) {
        PyBuffer_Release(&st.view);
        PyErr_SetString(PyExc_ValueError, "scan: low and next_unit must lie in the plan");
        return NULL;
    }
    Py_ssize_t in_flight;
    const int unsettled = scan_core(state, units, &low, next_unit, &in_flight);
    PyBuffer_Release(&st.view);
    return Py_BuildValue("nin", low, unsettled, in_flight);
}

/* due's work on its arrays: the units due listed in out, their number returned, the earliest deadline in *next. */
static Py_ssize_t due_core(const int8_t *state, const double *deadline, Py_ssize_t low, Py_ssize_t next_unit, double now,
                           int64_t *due, const uint8_t *proven_lost, const int64_t *flushes, double strict,
                           double *next) {
    const int recovering = proven_lost != NULL;
    Py_ssize_t n_due = 0;
    double next_at = INFINITY;
    for (Py_ssize_t j = low; j < next_unit; j++) {
        if (state[j] != ST_IN_FLIGHT)
            continue;
        if (deadline[j] < next_at)
            next_at = deadline[j];
        if (due != NULL && deadline[j] <= now &&
            (!recovering || deadline[j] <= strict || proven_lost[j] || flushes[j] > 0))
            due[n_due++] = j;
    }
    *next = next_at;
    return n_due;
}

/* due(state, deadline_at, low, next_unit, now, out[, proven_lost, flushes, strict]) -> (n_due, next_at): the units
 * in flight in [low, next_unit) whose deadline is at or before ``now``, in order, into out[:n_due] (Deadlines.due),
 * and the earliest deadline of a unit in flight (Deadlines.next_at; inf when none is). With ``proven_lost``,
 * ``flushes`` and ``strict`` (Deadlines.due_or_recovering, ``now`` then being strict + the recovery slack): of
 * those, the ones due by ``strict`` and the ones being recovered (proven lost, or FLUSHed already). */
static PyObject *engine_due(PyObject *self, PyObject *args) {
    PyObject *state_obj, *at_obj, *out_obj, *lost_obj = NULL, *flushes_obj = NULL;
    Py_ssize_t low, next_unit;
    double now, strict = INFINITY;
    if (!PyArg_ParseTuple(args, "OOnndO|OOd:due", &state_obj, &at_obj, &low, &next_unit, &now, &out_obj, &lost_obj,
                          &flushes_obj, &strict))
        return NULL;
    buf_t b[5] = {{{0}}};
    buf_t *const st = &b[0], *const at = &b[1], *const out = &b[2], *const lost = &b[3], *const fl = &b[4];
    PyObject *result = NULL;
    if (get_vec(state_obj, st, 1, 0, 0, "state") < 0 || get_vec(at_obj, at, 8, st->view.shape[0], 0, "deadline_at") < 0 ||
        get_vec(out_obj, out, 8, st->view.shape[0], 1, "out") < 0)
        goto done;
    const int recovering = lost_obj != NULL;
    if (recovering && (flushes_obj == NULL || get_vec(lost_obj, lost, 1, st->view.shape[0], 0, "proven_lost") < 0 ||
                       get_vec(flushes_obj, fl, 8, st->view.shape[0], 0, "flushes") < 0)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "due: proven_lost, flushes and strict go together");
        goto done;
    }
    if (low < 0 || next_unit > st->view.shape[0]) {
        PyErr_SetString(PyExc_ValueError, "due: low and next_unit must lie in the plan");
        goto done;
    }
    const int8_t *state = (const int8_t *)st->view.buf;
    const double *deadline = (const double *)at->view.buf;
    const uint8_t *proven_lost = recovering ? (const uint8_t *)lost->view.buf : NULL;
    const int64_t *flushes = recovering ? (const int64_t *)fl->view.buf : NULL;
    int64_t *due = (int64_t *)out->view.buf;
    double next_at;
    const Py_ssize_t n_due = due_core(state, deadline, low, next_unit, now, due, proven_lost, flushes, strict, &next_at);
    result = Py_BuildValue("nd", n_due, next_at);
done:
    release_vecs(b, 5);
    return result;
}

/* quantize_ahead(chunks, rows, exp_known, quantized, own_exp, critical, owner, shift, has_exp, todo,
 *                saturated, c0, c1, block, limit, flags, bit_generator[, direct[, stamp]]) -> quantized rows
 * ReduceEngine._quantize_ahead in one call: the chunks of [c0, c1) not quantized yet whose exponent is known,
 * and the known ones after them up to ``block`` chunks from c0, quantized straight into the payload of their
 * packet rows (``rows``: the plan's data rows, big-endian) with their shifts; each row's exp byte and flags
 * (flags = (CRITICAL, SATURATED, OWNER) bits: critical chunk, clamped while its proposal was counted, owner
 * set) written, has_exp = own_exp and quantized set. The random bits: one draw of ``bit_generator``'s
 * random_raw() per call that quantizes anything, then the rows in order, as hostlib.codec.quantize_into's C
 * path: the same integers. ``todo`` and ``saturated`` are scratch, one entry per chunk. ``direct`` (or
 * None): the reduce's input where the caller holds it, whole chunks only; chunk j below their number is
 * read from it instead of chunks[j] (ReduceEngine._begin did not stage it). ``stamp`` (or None): (g0, D, step),
 * the global unit of chunk 0, the pool and the step; each quantized row then also gets its slot (g mod D),
 * first round (2 (g div D) + 1: hostlib.protocol.unit_seq) and step, g = g0 + j, written here where the row is being written anyway, instead of
 * by ReducePlan.reset's strided pass over every row (``stamp_data=False``). */
/* What quantize_core reads and writes: the plan's arrays (C chunks of K values) and the call's constants. */
typedef struct {
    const char *chunks; /* staged rows, (C, K) float32 */
    Py_ssize_t c, k;
    char *rows; /* the data rows, (C, 36 + 4K) bytes, row stride below */
    Py_ssize_t stride;
    const char *direct; /* the caller's first ``split`` whole chunks, or NULL */
    Py_ssize_t split;
    const uint8_t *exp_known, *own_exp, *critical, *spec_sat;
    uint8_t *quantized, *has_exp, *saturated;
    const int64_t *owner;
    const int32_t *shift;
    int64_t *todo;
    Py_ssize_t block;
    long long limit;
    int f_critical, f_saturated, f_owner;
    PyObject *bitgen;
    int stamp;
    long long g0, pool, step;
} qa_t;

/* quantize_ahead's work once its arguments are checked: the rows quantized, or -1 with an exception set. */
static Py_ssize_t quantize_core(const qa_t *q, Py_ssize_t c0, Py_ssize_t c1) {
    const Py_ssize_t c = q->c, k = q->k;
    /* (reference: hi = min(C, max(c1, c0 + block)), cut at the first unknown exponent from c1 on) */
    Py_ssize_t hi = c0 + q->block > c1 ? c0 + q->block : c1;
    if (hi > c)
        hi = c;
    for (Py_ssize_t j = c1; j < hi; j++)
        if (!q->exp_known[j]) {
            hi = j;
            break;
        }
    Py_ssize_t n = 0;
    for (Py_ssize_t j = c0; j < hi; j++)
        if (q->exp_known[j] && !q->quantized[j])
            q->todo[n++] = j;
    if (n == 0)
        return 0;
    PyObject *raw = PyObject_CallMethod(q->bitgen, "random_raw", NULL);
    if (raw == NULL)
        return -1;
    const unsigned long long seed = PyLong_AsUnsignedLongLong(raw);
    Py_DECREF(raw);
    if (PyErr_Occurred())
        return -1;
    uint64_t *bits = PyMem_RawMalloc((size_t)(k / 2 + 1) * sizeof(uint64_t));
    /* the shifts of the rows in order, as the reference passes plan.shift[sel] */
    int32_t *shifts = PyMem_RawMalloc((size_t)n * sizeof(int32_t));
    if (bits == NULL || shifts == NULL) {
        PyMem_RawFree(bits);
        PyMem_RawFree(shifts);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        shifts[i] = q->shift[q->todo[i]];
    char *rows = q->rows;
    const Py_ssize_t stride = q->stride;
    Py_ssize_t bad;
    Py_BEGIN_ALLOW_THREADS;
    bad = quantize_rows(q->direct, q->split, q->chunks, 4 * k, rows + HEADER_BYTES, stride, k, q->todo, n, shifts,
                        (float)q->limit, 1, (uint64_t)seed, bits, q->saturated);
    if (bad < 0)
        for (Py_ssize_t i = 0; i < n; i++) {
            const int64_t j = q->todo[i];
            char *h = rows + j * stride;
            if (q->stamp) {
                const long long g = q->g0 + j;
                put_be16((uint8_t *)h + OFF_SLOT, (uint16_t)(g % q->pool));
                put_be32((uint8_t *)h + OFF_SEQ, (uint32_t)((g / q->pool) * ROUNDS_PER_UNIT + 1));
                put_be32((uint8_t *)h + OFF_STEP, (uint32_t)q->step);
            }
            h[OFF_EXP] = (char)(int8_t)shifts[i];
            h[OFF_FLAGS] = (char)((q->critical[j] ? q->f_critical : 0) |
                                  ((q->saturated[i] && q->own_exp[j]) || q->spec_sat[j] ? q->f_saturated : 0) |
                                  (q->owner[j] >= 0 ? q->f_owner : 0));
            q->has_exp[j] = q->own_exp[j];
            q->quantized[j] = 1;
        }
    Py_END_ALLOW_THREADS;
    PyMem_RawFree(shifts);
    PyMem_RawFree(bits);
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "tensor holds NaN or Inf (first in chunk %zd); refusing to send it", bad);
        return -1;
    }
    return n;
}

/* The buffers of quantize_ahead's arrays (chunks, rows, direct, then the nine below), taken and checked into ``q``;
 * -1 with an exception set. Released by qa_release whatever was returned. */
typedef struct {
    Py_buffer cv, rv, dv;
    int have_cv, have_rv, have_dv;
    buf_t b[10];
} qa_bufs_t;

static void qa_release(qa_bufs_t *u) {
    if (u->have_cv)
        PyBuffer_Release(&u->cv);
    if (u->have_rv)
        PyBuffer_Release(&u->rv);
    if (u->have_dv)
        PyBuffer_Release(&u->dv);
    u->have_cv = u->have_rv = u->have_dv = 0;
    release_vecs(u->b, 10);
    memset(u->b, 0, sizeof(u->b));
}

static int qa_take(qa_bufs_t *u, qa_t *q, PyObject *chunks_obj, PyObject *rows_obj, PyObject *const *objs,
                   PyObject *direct_obj) {
    memset(u, 0, sizeof(*u));
    if (PyObject_GetBuffer(chunks_obj, &u->cv, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    u->have_cv = 1;
    if (PyObject_GetBuffer(rows_obj, &u->rv, PyBUF_STRIDES | PyBUF_WRITABLE) < 0)
        return -1;
    u->have_rv = 1;
    if (u->cv.ndim != 2 || u->cv.itemsize != 4 || u->rv.ndim != 2 || u->rv.itemsize != 1 || u->rv.strides[1] != 1 ||
        u->rv.shape[0] != u->cv.shape[0] || u->rv.shape[1] != HEADER_BYTES + 4 * u->cv.shape[1] || q->limit < 1 ||
        q->limit > (1LL << 30)) {
        PyErr_SetString(PyExc_ValueError, "quantize_ahead: chunks must be (C, K) float32 and rows (C, 36 + 4K) uint8");
        return -1;
    }
    const Py_ssize_t c = u->cv.shape[0], k = u->cv.shape[1];
    /* direct: the caller's first ``split`` chunks where they lie (C-contiguous float32, split * K values),
     * read instead of their staged rows */
    Py_ssize_t split = 0;
    if (direct_obj != Py_None) {
        if (PyObject_GetBuffer(direct_obj, &u->dv, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            return -1;
        u->have_dv = 1;
        split = u->dv.itemsize == 4 ? u->dv.len / (4 * k) : -1;
        if (split < 0 || split * 4 * k != u->dv.len || split > c) {
            PyErr_SetString(PyExc_ValueError, "quantize_ahead: direct must hold whole chunks of K float32, at most C");
            return -1;
        }
    }
    static const vec_spec_t spec[10] = {{1, 0, "exp_known"}, {1, 1, "quantized"}, {1, 0, "own_exp"},
                                        {1, 0, "critical"},  {8, 0, "owner"},     {4, 0, "shift"},
                                        {1, 1, "has_exp"},   {8, 1, "todo"},      {1, 1, "saturated"},
                                        {1, 0, "spec_sat"}};
    if (get_vecs(objs, u->b, spec, 10, c) < 0)
        return -1;
    q->chunks = (const char *)u->cv.buf;
    q->c = c;
    q->k = k;
    q->rows = (char *)u->rv.buf;
    q->stride = u->rv.strides[0];
    q->direct = u->have_dv ? (const char *)u->dv.buf : NULL;
    q->split = split;
    q->exp_known = (const uint8_t *)u->b[0].view.buf;
    q->quantized = (uint8_t *)u->b[1].view.buf;
    q->own_exp = (const uint8_t *)u->b[2].view.buf;
    q->critical = (const uint8_t *)u->b[3].view.buf;
    q->owner = (const int64_t *)u->b[4].view.buf;
    q->shift = (const int32_t *)u->b[5].view.buf;
    q->has_exp = (uint8_t *)u->b[6].view.buf;
    q->todo = (int64_t *)u->b[7].view.buf;
    q->saturated = (uint8_t *)u->b[8].view.buf;
    q->spec_sat = (const uint8_t *)u->b[9].view.buf;
    return 0;
}

static int qa_stamp(qa_t *q, PyObject *stamp_obj) {
    q->stamp = stamp_obj != Py_None;
    q->g0 = q->pool = q->step = 0;
    if (q->stamp && !PyArg_ParseTuple(stamp_obj, "LLL:quantize_ahead stamp", &q->g0, &q->pool, &q->step))
        return -1;
    if (q->stamp && (q->g0 < 0 || q->pool < 1 || q->step < 0 || q->step > 0xffffffffLL)) {
        PyErr_SetString(PyExc_ValueError, "quantize_ahead: stamp must be (g0 >= 0, pool >= 1, 0 <= step < 2**32)");
        return -1;
    }
    return 0;
}

static PyObject *engine_quantize_ahead(PyObject *self, PyObject *args) {
    PyObject *chunks_obj, *rows_obj, *objs[10], *direct_obj = Py_None, *stamp_obj = Py_None;
    Py_ssize_t c0, c1;
    qa_t q;
    memset(&q, 0, sizeof(q));
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOnnnL(iii)O|OO:quantize_ahead", &chunks_obj, &rows_obj, &objs[0],
                          &objs[1], &objs[2], &objs[3], &objs[4], &objs[5], &objs[6], &objs[7], &objs[8], &objs[9],
                          &c0, &c1, &q.block,
                          &q.limit, &q.f_critical, &q.f_saturated, &q.f_owner, &q.bitgen, &direct_obj, &stamp_obj))
        return NULL;
    if (qa_stamp(&q, stamp_obj) < 0)
        return NULL;
    qa_bufs_t u;
    PyObject *result = NULL;
    if (qa_take(&u, &q, chunks_obj, rows_obj, objs, direct_obj) < 0)
        goto done;
    if (c0 < 0 || c1 < c0 || c1 > q.c || q.block < 1) {
        PyErr_SetString(PyExc_ValueError, "quantize_ahead: need 0 <= c0 <= c1 <= chunks and block >= 1");
        goto done;
    }
    const Py_ssize_t n = quantize_core(&q, c0, c1);
    if (n >= 0)
        result = PyLong_FromSsize_t(n);
done:
    qa_release(&u);
    return result;
}

/* stall's work on its arrays: the unit whose deadline was brought forward, or -1. */
static int64_t stall_core(const int8_t *state, const int64_t *flushes, const uint8_t *critical_unit, double *deadline,
                          const int64_t *frontier, Py_ssize_t n_workers, Py_ssize_t units, unsigned long long dead,
                          Py_ssize_t low, Py_ssize_t permitted, Py_ssize_t next_unit, double at) {
    int64_t slowest = INT64_MAX, top = INT64_MIN;
    for (Py_ssize_t w = 0; w < n_workers; w++) {
        if (frontier[w] > top)
            top = frontier[w];
        if (!(w < 64 && (dead >> w) & 1) && frontier[w] < slowest)
            slowest = frontier[w];
    }
    if (slowest == INT64_MAX)
        slowest = top;
    int64_t lo = slowest + 1 > low ? slowest + 1 : low;
    int64_t hi = permitted < next_unit ? permitted : next_unit;
    if (hi > units)
        hi = units;
    int64_t newest = -1;
    for (int64_t u = hi - 1; u >= lo && u >= 0; u--)
        if (state[u] == ST_IN_FLIGHT && flushes[u] == 0 && !critical_unit[u]) {
            newest = u;
            break;
        }
    if (newest >= 0 && at < deadline[newest])
        deadline[newest] = at;
    return newest;
}

/* stall(state, flushes, critical_unit, deadline_at, frontier, presumed_dead, low, permitted, next_unit, at)
 * -> the unit whose deadline was brought forward, or -1: Deadlines.stall_flush. The newest unit in flight in
 * [max(low, slowest live frontier + 1), min(permitted, next_unit)) that was not FLUSHed and is not critical
 * gets the deadline min(its deadline, at). The slowest live frontier: the lowest frontier of a worker whose
 * bit is not in presumed_dead (the highest of all when every one is). */
static PyObject *engine_stall(PyObject *self, PyObject *args) {
    PyObject *objs[5];
    unsigned long long dead;
    Py_ssize_t low, permitted, next_unit;
    double at;
    if (!PyArg_ParseTuple(args, "OOOOOKnnnd:stall", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &dead, &low,
                          &permitted, &next_unit, &at))
        return NULL;
    buf_t b[5];
    memset(b, 0, sizeof(b));
    PyObject *result = NULL;
    if (get_vec(objs[0], &b[0], 1, 0, 0, "state") < 0)
        goto done;
    const Py_ssize_t units = b[0].view.shape[0];
    if (get_vec(objs[1], &b[1], 8, units, 0, "flushes") < 0 || get_vec(objs[2], &b[2], 1, units, 0, "critical_unit") < 0 ||
        get_vec(objs[3], &b[3], 8, units, 1, "deadline_at") < 0 || get_vec(objs[4], &b[4], 8, 1, 0, "frontier") < 0)
        goto done;
    const int8_t *state = (const int8_t *)b[0].view.buf;
    const int64_t *flushes = (const int64_t *)b[1].view.buf, *frontier = (const int64_t *)b[4].view.buf;
    const uint8_t *critical_unit = (const uint8_t *)b[2].view.buf;
    double *deadline = (double *)b[3].view.buf;
    const Py_ssize_t n_workers = b[4].view.shape[0];
    const int64_t newest = stall_core(state, flushes, critical_unit, deadline, frontier, n_workers, units, dead, low,
                                      permitted, next_unit, at);
    result = PyLong_FromLongLong(newest);
done:
    release_vecs(b, 5);
    return result;
}

/* peers_news's work on its arrays (n <= 64 workers). */
static void peers_news_core(int64_t *settled, int64_t *sent, const uint8_t *peers, uint8_t *excused,
                            int64_t *excused_to, uint8_t *presumed, const int64_t *frontier, Py_ssize_t n,
                            unsigned long long dead_bits, long long base, long long span, long long d) {
    /* set_presumed_dead */
    for (Py_ssize_t w = 0; w < n; w++) {
        const int dead = (dead_bits >> w) & 1;
        if (presumed[w] && !dead && excused[w] && excused_to[w] == INT64_MAX)
            excused_to[w] = settled[w] + 2 * d + 1;
        presumed[w] = (uint8_t)dead;
    }
    /* saw */
    int any_seen = 0, any_excused = 0;
    for (Py_ssize_t w = 0; w < n; w++)
        any_seen |= frontier[w] >= 0, any_excused |= excused[w] != 0;
    if (!any_seen)
        return;
    for (Py_ssize_t w = 0; w < n; w++) {
        const int seen = frontier[w] >= 0;
        const int64_t s = seen ? base + frontier[w] : -1;
        if (s > sent[w])
            sent[w] = s;
        int64_t proven = -1;
        if (seen)
            proven = base - 1 > base + frontier[w] - span ? base - 1 : base + frontier[w] - span;
        if (any_excused)
            excused[w] = excused[w] && proven <= settled[w];
        if (proven > settled[w])
            settled[w] = proven;
    }
    int64_t newest[64];
    Py_ssize_t top = 0;
    for (Py_ssize_t w = 0; w < n; w++) {
        newest[w] = peers[w] ? sent[w] : -1;
        if (newest[w] > newest[top])
            top = w; /* (the first of the largest, as argmax) */
    }
    const int64_t top_value = newest[top];
    newest[top] = -1;
    int64_t second = newest[0];
    for (Py_ssize_t w = 1; w < n; w++)
        if (newest[w] > second)
            second = newest[w];
    for (Py_ssize_t w = 0; w < n; w++) {
        const int64_t others = w == top ? second : top_value;
        if (!(peers[w] && others > settled[w] + d))
            continue;
        int64_t reach = settled[w] + 2 * d + 1 > others + 1 ? settled[w] + 2 * d + 1 : others + 1;
        if (presumed[w])
            reach = INT64_MAX;
        if (reach > excused_to[w])
            excused_to[w] = reach;
        excused[w] = 1;
    }
}

/* peers_news(settled, sent, peers, excused, excused_to, presumed_dead, frontier, dead_bits, base, span,
 *            data_slots) -> None: SlotReuse.set_presumed_dead (bit w of dead_bits: peer w presumed dead),
 * then SlotReuse.saw(base, frontier), on the slot-reuse state's arrays (int64, the masks bool; one entry
 * per worker), as ReduceEngine._run_units calls them after a wake-up that brought RESULTs. */
static PyObject *engine_peers_news(PyObject *self, PyObject *args) {
    PyObject *objs[7];
    unsigned long long dead_bits;
    long long base, span, d;
    if (!PyArg_ParseTuple(args, "OOOOOOOKLLL:peers_news", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                          &objs[6], &dead_bits, &base, &span, &d))
        return NULL;
    buf_t b[7];
    memset(b, 0, sizeof(b));
    PyObject *result = NULL;
    if (get_vec(objs[0], &b[0], 8, 1, 1, "settled") < 0)
        goto done;
    const Py_ssize_t n = b[0].view.shape[0];
    if (n > 64) {
        PyErr_SetString(PyExc_ValueError, "peers_news: at most 64 workers");
        goto done;
    }
    static const vec_spec_t spec[6] = {{8, 1, "sent"},       {1, 0, "peers"},         {1, 1, "excused"},
                                       {8, 1, "excused_to"}, {1, 1, "presumed_dead"}, {8, 0, "frontier"}};
    if (get_vecs(objs + 1, b + 1, spec, 6, n) < 0)
        goto done;
    int64_t *settled = (int64_t *)b[0].view.buf, *sent = (int64_t *)b[1].view.buf;
    const uint8_t *peers = (const uint8_t *)b[2].view.buf;
    uint8_t *excused = (uint8_t *)b[3].view.buf, *presumed = (uint8_t *)b[5].view.buf;
    int64_t *excused_to = (int64_t *)b[4].view.buf;
    const int64_t *frontier = (const int64_t *)b[6].view.buf;
    peers_news_core(settled, sent, peers, excused, excused_to, presumed, frontier, n, dead_bits, base, span, d);
    Py_INCREF(Py_None);
    result = Py_None;
done:
    release_vecs(b, 7);
    return result;
}

/* run's work: the end of the units of [u0, hi) that may go, and whether every one of them is pending. */
static Py_ssize_t run_core(const int8_t *state, const uint8_t *exp_known, Py_ssize_t exp_units, Py_ssize_t k,
                           Py_ssize_t u0, Py_ssize_t hi, int *pending) {
    Py_ssize_t u1 = u0;
    *pending = 1;
    for (; u1 < hi; u1++) {
        if (u1 >= exp_units && state[(u1 - exp_units) / k] < ST_DONE && !exp_known[u1 - exp_units])
            break;
        *pending &= state[u1] == 0;
    }
    return u1;
}

/* run(state, exp_known, exp_units, k, u0, hi) -> (u1, pending): the units u0..u1-1 of [u0, hi) that may go before
 * the first data unit whose exponent unit is not settled and whose exponent is not known (a speculated one is:
 * ReduceEngine._send_units' "blocked" rule), and whether every one of them is still pending. */
static PyObject *engine_run(PyObject *self, PyObject *args) {
    PyObject *state_obj, *known_obj;
    Py_ssize_t exp_units, k, u0, hi;
    if (!PyArg_ParseTuple(args, "OOnnnn:run", &state_obj, &known_obj, &exp_units, &k, &u0, &hi))
        return NULL;
    buf_t b[2] = {{{0}}};
    PyObject *result = NULL;
    if (get_vec(state_obj, &b[0], 1, 0, 0, "state") < 0)
        goto done;
    const Py_ssize_t units = b[0].view.shape[0];
    if (u0 < 0 || hi > units || k < 1 || exp_units < 0 || exp_units > units) {
        PyErr_SetString(PyExc_ValueError, "run: u0 and hi must lie in the plan");
        goto done;
    }
    if (get_vec(known_obj, &b[1], 1, units - exp_units, 0, "exp_known") < 0)
        goto done;
    int pending;
    const Py_ssize_t u1 = run_core((const int8_t *)b[0].view.buf, (const uint8_t *)b[1].view.buf, exp_units, k, u0,
                                   hi, &pending);
    result = Py_BuildValue("ni", u1, pending);
done:
    release_vecs(b, 2);
    return result;
}

/* gather_rows(src, units, n, offset, copies, slots, out, out_slots): rows src[units[i] - offset] for i < n, each
 * ``copies`` times side by side, into out[:n * copies] (ReduceEngine._probe_data's gather and repeat in one
 * pass), and the units' slots (slots[units[i]]) likewise into out_slots, for the send's GSO train keys. */
static PyObject *engine_gather_rows(PyObject *self, PyObject *args) {
    PyObject *src_obj, *units_obj, *slots_obj, *out_obj, *out_slots_obj;
    Py_ssize_t n, offset, copies;
    if (!PyArg_ParseTuple(args, "OOnnnOOO:gather_rows", &src_obj, &units_obj, &n, &offset, &copies, &slots_obj,
                          &out_obj, &out_slots_obj))
        return NULL;
    buf_t b[5] = {{{0}}}; /* src and out, (rows, width) byte matrices; units, slots, out_slots */
    Py_buffer *const src = &b[0].view, *const out = &b[1].view;
    buf_t *const u = &b[2], *const sl = &b[3], *const os = &b[4];
    PyObject *result = NULL;
    if (PyObject_GetBuffer(src_obj, src, PyBUF_STRIDES) < 0)
        goto done;
    b[0].held = 1;
    if (PyObject_GetBuffer(out_obj, out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        goto done;
    b[1].held = 1;
    if (get_vec(units_obj, u, 8, n, 0, "units") < 0 || get_vec(slots_obj, sl, 8, 0, 0, "slots") < 0 ||
        get_vec(out_slots_obj, os, 8, 0, 1, "out_slots") < 0)
        goto done;
    if (src->ndim != 2 || src->itemsize != 1 || src->strides[1] != 1 || out->ndim != 2 ||
        out->shape[1] != src->shape[1] || n < 0 || copies < 1 || out->shape[0] < n * copies ||
        os->view.shape[0] < n * copies) {
        PyErr_SetString(PyExc_ValueError, "gather_rows: src and out must be (rows, width) bytes with room for n x copies");
        goto done;
    }
    const int64_t *unit = (const int64_t *)u->view.buf, *slot = (const int64_t *)sl->view.buf;
    int64_t *out_slot = (int64_t *)os->view.buf;
    const Py_ssize_t width = src->shape[1];
    for (Py_ssize_t i = 0; i < n; i++)
        if (unit[i] - offset < 0 || unit[i] - offset >= src->shape[0] || unit[i] < 0 || unit[i] >= sl->view.shape[0]) {
            PyErr_SetString(PyExc_ValueError, "gather_rows: a unit lies outside the rows");
            goto done;
        }
    uint8_t *dst = (uint8_t *)out->buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *row = (const uint8_t *)src->buf + (unit[i] - offset) * src->strides[0];
        for (Py_ssize_t c = 0; c < copies; c++) {
            memcpy(dst + (i * copies + c) * width, row, (size_t)width);
            out_slot[i * copies + c] = slot[unit[i]];
        }
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    release_vecs(b, 5);
    return result;
}

/* reuse_first's work: the first global unit the peers do not let this worker send (INT64_MAX with none). */
static int64_t reuse_first_core(const int64_t *settled, const uint8_t *excused, const int64_t *excused_to,
                                const uint8_t *peers, Py_ssize_t n, long long data_slots) {
    int64_t first = INT64_MAX;
    for (Py_ssize_t w = 0; w < n; w++) {
        if (!peers[w])
            continue;
        const int64_t bound = excused[w] ? excused_to[w] : settled[w] + data_slots + 1;
        if (bound < first)
            first = bound;
    }
    return first;
}

/* reuse_first(settled, excused, excused_to, peers, data_slots) -> first: SlotReuse.limit's first value, the
 * first global unit this worker may not send yet (the peers' bound: excused_to for an excused peer, its
 * settled unit + data_slots + 1 otherwise; the largest int64 with no peer). */
static PyObject *engine_reuse_first(PyObject *self, PyObject *args) {
    PyObject *objs[4];
    long long data_slots;
    if (!PyArg_ParseTuple(args, "OOOOL:reuse_first", &objs[0], &objs[1], &objs[2], &objs[3], &data_slots))
        return NULL;
    static const vec_spec_t spec[4] = {{8, 0, "settled"}, {1, 0, "excused"}, {8, 0, "excused_to"}, {1, 0, "peers"}};
    buf_t b[4] = {{{0}}};
    PyObject *result = NULL;
    if (get_vecs(objs, b, spec, 4, 0) < 0)
        goto done;
    const Py_ssize_t n = b[0].view.shape[0];
    if (b[1].view.shape[0] != n || b[2].view.shape[0] != n || b[3].view.shape[0] != n) {
        PyErr_SetString(PyExc_ValueError, "reuse_first: the arrays must have one entry per worker");
        goto done;
    }
    const int64_t *settled = (const int64_t *)b[0].view.buf, *excused_to = (const int64_t *)b[2].view.buf;
    const uint8_t *excused = (const uint8_t *)b[1].view.buf, *peers = (const uint8_t *)b[3].view.buf;
    result = PyLong_FromLongLong(reuse_first_core(settled, excused, excused_to, peers, n, data_slots));
done:
    release_vecs(b, 4);
    return result;
}

/* fast_flush's work on its arrays: the units probed, listed in out. */
static Py_ssize_t fast_flush_core(const int8_t *state, uint8_t *proven_lost, double *deadline, const int64_t *flushes,
                                  const int64_t *retx, const uint8_t *critical, const int64_t *retx_spent,
                                  const uint8_t *has_exp, const int64_t *owner, Py_ssize_t lo, Py_ssize_t hi,
                                  Py_ssize_t exp_units, Py_ssize_t group_size, Py_ssize_t group_pos, double now,
                                  double srtt_s, double probe_at, Py_ssize_t resend_max, int64_t *out) {
    const int probing = probe_at == probe_at;
    Py_ssize_t n_probe = 0;
    for (Py_ssize_t u = lo; u < hi; u++) {
        if (state[u] != ST_IN_FLIGHT)
            continue;
        proven_lost[u] = 1;
        const int data = u >= exp_units;
        const int designated = u % group_size == group_pos || (data && owner[u - exp_units] >= 0);
        const int crit = resend_max >= 0 && critical[u] && retx_spent[u] < resend_max;
        double at = crit || designated ? now : now + srtt_s;
        const int first_try = crit ? retx[u] == 0 : flushes[u] == 0;
        if (probing && first_try && !designated && !crit && data && has_exp[u - exp_units]) {
            at = probe_at;
            out[n_probe++] = u;
        }
        if (first_try && deadline[u] > at)
            deadline[u] = at;
    }
    return n_probe;
}

/* Wake: a steady wake-up of one reduce in a few calls (ReduceEngine._wake_send, _wake_after).
 *
 *   wake(state, sent_at, deadline_at, settled, excused, excused_to, peers, chunks, rows, exp_known, quantized,
 *        own_exp, critical, owner, shift, has_exp, todo, saturated,
 *        (exp_units, span, data_slots, base, block, limit, (f_critical, f_saturated, f_owner)),
 *        bit_generator, direct, stamp,
 *        (frontier, sent, presumed_dead, proven_lost, flushes, retx, critical_unit, retx_spent, probe_out, due_out),
 *        (group_size, group_pos, worker_id)) -> Wake
 *
 * holds the plan's arrays (the first three and the quantize_ahead ones, as quantize_ahead takes them) and the
 * slot-reuse arrays (reuse.py) for the reduce. Its send half is two calls around the system call that sends:
 *
 *   send(low, next_unit, room, any_withheld) -> (code, low, in_flight, u1, held, checked)
 *
 * is ReduceEngine._advance, then _send_ready up to the send, for a reduce in its steady state (synced, not in
 * its tail, no peer presumed dead; no pacing, owners, critical units, exact mode or early close: the caller
 * makes a Wake only then): scan's low and units in flight; the window (``room`` units in flight at most), the
 * own span and the peers' bound (reuse_first: _peer_limit's first branch); run's units and quantize_ahead's
 * rows. ``code``: 0 nothing is left to settle; 1 nothing to send; 2 units [next_unit, u1) to send, every one
 * pending and with this worker's exponent; 4 the same but some of them were settled before they went (a
 * peer's FLUSH) or are withheld (has_exp false): the rows to send are the pending ones' with has_exp (the
 * caller sends the reduce's last chunks' rows again, TransportConfig.tail_units); 3 the reference must decide
 * (_peer_limit's other branches, exponent units): nothing was changed. ``held``: what holds sending once these units went (0 nothing, 1 the
 * own span, 2 the peers), as _send_ready's _count_held leaves it; ``checked``: the peers' bound was taken
 * (the caller's peer-wait clock stops, as in _peer_limit). Then commit (below) puts the pending units in
 * flight from the time they went, as the reference stamps them after its send. */
enum { WAKE_DONE = 0, WAKE_IDLE = 1, WAKE_SENT = 2, WAKE_BAIL = 3, WAKE_SENT_SOME = 4 };
enum { HELD_NONE = 0, HELD_SPAN = 1, HELD_PEERS = 2 };

typedef struct {
    PyObject_HEAD
    qa_bufs_t qb;
    qa_t q;
    buf_t v[7]; /* state, sent_at, deadline_at, settled, excused, excused_to, peers */
    /* after's: frontier, sent, presumed_dead (reuse), proven_lost, flushes, retx, critical_unit, retx_spent,
     * probe_out, due_out */
    buf_t a[10];
    Py_ssize_t units, exp_units, span, workers, group_size, group_pos, worker;
    long long data_slots, base;
    int ready;
} WakeObject;

static void wake_dealloc(WakeObject *w) {
    if (w->ready) {
        qa_release(&w->qb);
        release_vecs(w->v, 7);
        release_vecs(w->a, 10);
        Py_XDECREF(w->q.bitgen);
    }
    Py_TYPE(w)->tp_free((PyObject *)w);
}

/* after(results, dead_bits, fast_flushed_to, low, next_unit, any_withheld, now, others_wait_s, probe_at,
 *       resend_max, slack) -> (code, fast_flushed_to, n_probe, n_due)
 * What ReduceEngine._run_units does after a wake-up's receive, for a reduce synced before it and still steady
 * (not in its tail, no peer presumed dead, no early close): SlotReuse.news where RESULTs came (``results``;
 * peers_news), Deadlines.fast_flush (fast_flush: its units to probe in probe_out[:n_probe]), then, unless a
 * worker withholds units (``any_withheld``: Deadlines.flush_withheld is the reference's), the due scan
 * (ReduceEngine._due with the recovery ``slack``: due; its units in due_out[:n_due]). ``code`` 0: all of it
 * done; 1: done up to the fast flush, the reference goes on from flush_withheld. ``probe_at``, ``resend_max``
 * and ``others_wait_s`` as fast_flush takes them. */
static PyObject *wake_after(WakeObject *w, PyObject *args) {
    int results, any_withheld;
    unsigned long long dead_bits;
    Py_ssize_t ff, low, next_unit, resend_max;
    double now, others_wait_s, probe_at, slack;
    if (!PyArg_ParseTuple(args, "pKnnnpdddnd:after", &results, &dead_bits, &ff, &low, &next_unit, &any_withheld, &now,
                          &others_wait_s, &probe_at, &resend_max, &slack))
        return NULL;
    const Py_ssize_t units = w->units, e = w->exp_units;
    if (low < 0 || next_unit < low || next_unit > units) {
        PyErr_SetString(PyExc_ValueError, "Wake.after: low and next_unit must lie in the plan");
        return NULL;
    }
    const int64_t *frontier = (const int64_t *)w->a[0].view.buf;
    if (results)
        peers_news_core((int64_t *)w->v[3].view.buf, (int64_t *)w->a[1].view.buf, (const uint8_t *)w->v[6].view.buf,
                        (uint8_t *)w->v[4].view.buf, (int64_t *)w->v[5].view.buf, (uint8_t *)w->a[2].view.buf,
                        frontier, w->workers, dead_bits, w->base, w->span, w->data_slots);
    int8_t *state = (int8_t *)w->v[0].view.buf;
    double *deadline = (double *)w->v[2].view.buf;
    const int64_t *flushes = (const int64_t *)w->a[4].view.buf;
    const uint8_t *proven_lost = (const uint8_t *)w->a[3].view.buf;
    int64_t slowest = INT64_MAX;
    for (Py_ssize_t p = 0; p < w->workers; p++)
        if (frontier[p] < slowest)
            slowest = frontier[p];
    Py_ssize_t n_probe = 0, n_due = 0;
    if (slowest > ff) {
        const Py_ssize_t lo = low > ff ? low : ff, hi = (Py_ssize_t)slowest;
        ff = hi;
        if (hi > lo) {
            if (hi > units) {
                PyErr_SetString(PyExc_ValueError, "Wake.after: a frontier lies past the plan");
                return NULL;
            }
            n_probe = fast_flush_core(state, (uint8_t *)w->a[3].view.buf, deadline, flushes,
                                      (const int64_t *)w->a[5].view.buf, (const uint8_t *)w->a[6].view.buf,
                                      (const int64_t *)w->a[7].view.buf, w->q.has_exp, w->q.owner, lo, hi, e,
                                      w->group_size, w->group_pos, now, others_wait_s, probe_at, resend_max,
                                      (int64_t *)w->a[8].view.buf);
        }
    }
    if (any_withheld)
        return Py_BuildValue("innn", 1, ff, n_probe, (Py_ssize_t)0);
    double next_at;
    if (slack)
        n_due = due_core(state, deadline, low, next_unit, now + slack, (int64_t *)w->a[9].view.buf, proven_lost,
                         flushes, now, &next_at);
    else
        n_due = due_core(state, deadline, low, next_unit, now, (int64_t *)w->a[9].view.buf, NULL, NULL, INFINITY,
                         &next_at);
    return Py_BuildValue("innn", 0, ff, n_probe, n_due);
}

static PyObject *wake_send(WakeObject *w, PyObject *args) {
    Py_ssize_t low, next_unit, room;
    int any_withheld;
    if (!PyArg_ParseTuple(args, "nnnp:send", &low, &next_unit, &room, &any_withheld))
        return NULL;
    const Py_ssize_t units = w->units, e = w->exp_units, k = w->q.k;
    if (low < 0 || next_unit < 0 || low > units || next_unit > units) {
        PyErr_SetString(PyExc_ValueError, "Wake.send: low and next_unit must lie in the plan");
        return NULL;
    }
    const int8_t *state = (const int8_t *)w->v[0].view.buf;
    Py_ssize_t in_flight;
    const int unsettled = scan_core(state, units, &low, next_unit, &in_flight);
    const Py_ssize_t u0 = next_unit;
    if (!unsettled)
        return Py_BuildValue("innnii", WAKE_DONE, low, in_flight, u0, HELD_NONE, 0);
    const Py_ssize_t left = room - in_flight;
    if (left <= 0 || u0 >= units)
        return Py_BuildValue("innnii", WAKE_IDLE, low, in_flight, u0, HELD_NONE, 0);
    /* the own span and the peers' bound (reuse_first), local to the plan */
    const int64_t *settled = (const int64_t *)w->v[3].view.buf, *excused_to = (const int64_t *)w->v[5].view.buf;
    const uint8_t *excused = (const uint8_t *)w->v[4].view.buf, *peers = (const uint8_t *)w->v[6].view.buf;
    const int64_t first = reuse_first_core(settled, excused, excused_to, peers, w->workers, w->data_slots);
    const int64_t local = first - w->base, own = (int64_t)low + w->span;
    if (!(local > u0 || (in_flight && !any_withheld)))
        return Py_BuildValue("innnii", WAKE_BAIL, low, in_flight, u0, HELD_NONE, 0);
    const int64_t cap = units < u0 + left ? units : u0 + left;
    int64_t hi = cap < own ? cap : own;
    hi = hi < local ? hi : local;
    const int held = (own < local ? own : local) < cap ? (own <= local ? HELD_SPAN : HELD_PEERS) : HELD_NONE;
    if (hi <= u0)
        return Py_BuildValue("innnii", WAKE_IDLE, low, in_flight, u0, held, 1);
    /* run: the units that may go before the first data unit whose exponent is not settled */
    int all_pending;
    const Py_ssize_t u1 = run_core(state, w->q.exp_known, e, k, u0, hi, &all_pending);
    if (u1 <= u0)
        return Py_BuildValue("innnii", WAKE_IDLE, low, in_flight, u0, HELD_NONE, 1);
    if (u0 < e)
        return Py_BuildValue("innnii", WAKE_BAIL, low, in_flight, u0, HELD_NONE, 0);
    /* The pending ones go (the others were settled before they went: a peer's FLUSH); their chunks are
     * quantized from the first to the last, as _send_units asks */
    const int held_now = u1 >= hi ? held : HELD_NONE;
    Py_ssize_t first_pending = all_pending ? u0 : -1, last_pending = all_pending ? u1 - 1 : -1;
    for (Py_ssize_t u = u0; !all_pending && u < u1; u++)
        if (state[u] == 0) {
            if (first_pending < 0)
                first_pending = u;
            last_pending = u;
        }
    if (first_pending < 0)
        return Py_BuildValue("innnii", WAKE_SENT_SOME, low, in_flight, u1, held_now, 1);
    if (quantize_core(&w->q, first_pending - e, last_pending + 1 - e) < 0)
        return NULL;
    int code = all_pending ? WAKE_SENT : WAKE_SENT_SOME;
    for (Py_ssize_t u = u0; u < u1 && code == WAKE_SENT; u++)
        if (!w->q.has_exp[u - e])
            code = WAKE_SENT_SOME;
    return Py_BuildValue("innnii", code, low, in_flight, u1, held_now, 1);
}

/* commit(u0, u1, low, now, arm_at, (own_shown, dead_bits, stall_at, all_sent), held) -> next_at
 * After a send's packets went (or none did: u0 == u1): its pending units of [u0, u1) in flight from ``now``, due
 * at ``arm_at`` (Deadlines.arm_run); then what _run_units does after a send: this worker's frontier, the stall
 * rule while the peers hold it (``held`` 2; Deadlines.stall_flush from ``own_shown``, at ``stall_at``), and the
 * earliest deadline in flight, NaN where the tail starts here (the caller re-arms first). */
static PyObject *wake_commit(WakeObject *w, PyObject *args) {
    Py_ssize_t u0, u1, low, own_shown;
    int all_sent, held;
    unsigned long long dead_bits;
    double now, arm_at, stall_at;
    if (!PyArg_ParseTuple(args, "nnndd(nKdp)i:commit", &u0, &u1, &low, &now, &arm_at, &own_shown, &dead_bits, &stall_at,
                          &all_sent, &held))
        return NULL;
    const Py_ssize_t units = w->units;
    if (u0 < 0 || u1 < u0 || u1 > units || low < 0 || low > u1) {
        PyErr_SetString(PyExc_ValueError, "Wake.commit: the units must lie in the plan");
        return NULL;
    }
    int8_t *state = (int8_t *)w->v[0].view.buf;
    double *sent_at = (double *)w->v[1].view.buf, *deadline = (double *)w->v[2].view.buf;
    for (Py_ssize_t u = u0; u < u1; u++)
        if (state[u] == 0) {
            state[u] = ST_IN_FLIGHT;
            sent_at[u] = now;
            deadline[u] = arm_at;
        }
    int64_t *frontier = (int64_t *)w->a[0].view.buf;
    frontier[w->worker] = (int64_t)u1 - 1;
    if (held == HELD_PEERS && own_shown >= 0) {
        const Py_ssize_t shown = own_shown - w->span > -1 ? own_shown - w->span : -1;
        stall_core(state, (const int64_t *)w->a[4].view.buf, (const uint8_t *)w->a[6].view.buf, deadline, frontier,
                   w->workers, units, dead_bits, low, shown + (Py_ssize_t)w->data_slots + 1, u1, stall_at);
    }
    double next_at = NAN;
    if (!(u1 == units && !all_sent))
        due_core(state, deadline, low, u1, -INFINITY, NULL, NULL, NULL, INFINITY, &next_at);
    return PyFloat_FromDouble(next_at);
}

static PyMethodDef wake_methods[] = {
    {"send", (PyCFunction)wake_send, METH_VARARGS, "The send half of a steady wake-up (see hostlib/_engine.c)."},
    {"commit", (PyCFunction)wake_commit, METH_VARARGS, "A steady send's units in flight, then the rules after it."},
    {"after", (PyCFunction)wake_after, METH_VARARGS, "What a steady wake-up does after its receive (hostlib/_engine.c)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WakeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hostlib._engine.Wake",
    .tp_basicsize = sizeof(WakeObject),
    .tp_dealloc = (destructor)wake_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The send half of a steady wake-up, for one reduce (hostlib/_engine.c).",
    .tp_methods = wake_methods,
};

static PyObject *engine_wake(PyObject *self, PyObject *args) {
    PyObject *vobjs[7], *chunks_obj, *rows_obj, *qobjs[10], *bitgen, *direct_obj, *stamp_obj, *aobjs[10];
    Py_ssize_t exp_units, span, group_size, group_pos, worker;
    long long data_slots, base;
    qa_t q;
    memset(&q, 0, sizeof(q));
    /* the quantize_ahead arrays come in its order: exp_known, quantized, own_exp, critical, owner, shift, has_exp,
     * todo, saturated, spec_sat */
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOOOOOOOO(nnLLnL(iii))OOO(OOOOOOOOOO)(nnn):wake", &vobjs[0], &vobjs[1],
                          &vobjs[2], &vobjs[3], &vobjs[4], &vobjs[5], &vobjs[6], &chunks_obj, &rows_obj, &qobjs[0],
                          &qobjs[1], &qobjs[2], &qobjs[3], &qobjs[4], &qobjs[5], &qobjs[6], &qobjs[7], &qobjs[8],
                          &qobjs[9],
                          &exp_units, &span, &data_slots, &base, &q.block, &q.limit, &q.f_critical, &q.f_saturated,
                          &q.f_owner, &bitgen, &direct_obj, &stamp_obj, &aobjs[0], &aobjs[1], &aobjs[2], &aobjs[3],
                          &aobjs[4], &aobjs[5], &aobjs[6], &aobjs[7], &aobjs[8], &aobjs[9], &group_size, &group_pos,
                          &worker))
        return NULL;
    if (qa_stamp(&q, stamp_obj) < 0)
        return NULL;
    WakeObject *w = PyObject_New(WakeObject, &WakeType);
    if (w == NULL)
        return NULL;
    w->ready = 0;
    memset(w->v, 0, sizeof(w->v));
    memset(w->a, 0, sizeof(w->a));
    if (qa_take(&w->qb, &q, chunks_obj, rows_obj, qobjs, direct_obj) < 0)
        goto fail;
    static const vec_spec_t spec[7] = {{1, 1, "state"},    {8, 1, "sent_at"},    {8, 1, "deadline_at"},
                                       {8, 0, "settled"},  {1, 0, "excused"},    {8, 0, "excused_to"},
                                       {1, 0, "peers"}};
    if (get_vecs(vobjs, w->v, spec, 3, 0) < 0 || get_vecs(vobjs + 3, w->v + 3, spec + 3, 4, 0) < 0)
        goto fail;
    const Py_ssize_t units = w->v[0].view.shape[0], workers = w->v[3].view.shape[0];
    static const vec_spec_t aspec[10] = {{8, 0, "frontier"},   {8, 1, "sent"},  {1, 1, "presumed_dead"},
                                         {1, 1, "proven_lost"}, {8, 0, "flushes"}, {8, 0, "retx"},
                                         {1, 0, "critical_unit"}, {8, 0, "retx_spent"}, {8, 1, "probe_out"},
                                         {8, 1, "due_out"}};
    if (get_vecs(aobjs, w->a, aspec, 3, workers) < 0 || get_vecs(aobjs + 3, w->a + 3, aspec + 3, 7, units) < 0)
        goto fail;
    if (w->v[1].view.shape[0] < units || w->v[2].view.shape[0] < units || w->v[4].view.shape[0] != workers ||
        w->v[5].view.shape[0] != workers || w->v[6].view.shape[0] != workers || w->a[0].view.shape[0] != workers ||
        workers > 64 || exp_units < 0 || span < 1 || data_slots < 1 || base < 0 || q.block < 1 ||
        units - exp_units > q.c || group_size < 1 || group_pos < 0 || worker < 0 || worker >= workers) {
        PyErr_SetString(PyExc_ValueError, "wake: the plan's arrays, the reuse arrays or the constants do not fit");
        goto fail;
    }
    w->q = q;
    Py_INCREF(bitgen);
    w->q.bitgen = bitgen;
    w->units = units;
    w->exp_units = exp_units;
    w->span = span;
    w->workers = workers;
    w->data_slots = data_slots;
    w->base = base;
    w->group_size = group_size;
    w->group_pos = group_pos;
    w->worker = worker;
    w->ready = 1;
    return (PyObject *)w;
fail:
    qa_release(&w->qb);
    release_vecs(w->v, 7);
    release_vecs(w->a, 10);
    Py_TYPE(w)->tp_free((PyObject *)w);
    return NULL;
}

/* flush(units, n, state, flushes, first_flush_at, flushed_at, deadline_at, proven_in, critical_unit, retx_spent,
 *       retx, probes, slots, seqs, shift, template, rows, out_slots, params) -> (flushed, on_timer, gave_up)
 * ReduceEngine._deadline_actions from its FLUSH rule on, for ``units[:n]`` (due, neither resent nor probed), and
 * _send_flushes and Deadlines.arm for the units it FLUSHes, for a worker that is not its own leaf. A unit is
 * FLUSHed again while it has had fewer than max_flushes FLUSHes, or while the give-up time since its first has
 * not passed; else it is given up. A FLUSHed unit's rows (``template``, a FLUSH packet of this worker with
 * step, slot, seq, flags, exp, chunk and nelem set per unit) go to ``rows``, ``copies`` side by side, in unit
 * order (their slots, for the send's GSO train keys, to ``out_slots``); its deadline is its retry's (the
 * backoff doubling per FLUSH from the FLUSH RTO, capped, never past its give-up time; a critical unit's resend
 * timer; an exponent unit's early probe before the reduce synced).
 * params = (now, t_flush, step, exp_units, frontier_min, max_flushes, give_up_s, flush_rto_s, max_deadline_s,
 * stagger, rto_s, resend_max (-1: none), synced, copies). Returns the units FLUSHed (their rows: flushed x
 * copies), those flushed on a timer's word (at or past frontier_min, not proven in), and those given up. */
static PyObject *engine_flush(PyObject *self, PyObject *args) {
    PyObject *objs[17];
    Py_ssize_t n, exp_units, frontier_min, max_flushes, resend_max, copies;
    long long step;
    int synced;
    double now, t_flush, give_up_s, flush_rto_s, max_deadline_s, stagger, rto_s;
    if (!PyArg_ParseTuple(args, "OnOOOOOOOOOOOOOOOO(ddLnnndddddnpn):flush", &objs[0], &n, &objs[1], &objs[2],
                          &objs[3], &objs[4], &objs[5], &objs[6], &objs[7], &objs[8], &objs[9], &objs[10],
                          &objs[11], &objs[12], &objs[13], &objs[14], &objs[15], &objs[16], &now, &t_flush, &step,
                          &exp_units, &frontier_min, &max_flushes, &give_up_s, &flush_rto_s, &max_deadline_s,
                          &stagger, &rto_s, &resend_max, &synced, &copies))
        return NULL;
    /* units, state, flushes, first_flush_at, flushed_at, deadline_at, proven_in, critical_unit, retx_spent,
     * retx, probes, slots, seqs, shift, template */
    static const vec_spec_t spec[15] = {
        {8, 0, "units"},         {1, 1, "state"},      {8, 1, "flushes"},    {8, 1, "first_flush_at"},
        {8, 1, "flushed_at"},    {8, 1, "deadline_at"}, {1, 0, "proven_in"}, {1, 0, "critical_unit"},
        {8, 0, "retx_spent"},    {8, 0, "retx"},        {8, 0, "probes"},    {8, 0, "slots"},
        {8, 0, "seqs"},          {4, 0, "shift"},       {1, 0, "template"}};
    buf_t b[15] = {{{0}}}, rows = {0}, os = {0};
    PyObject *result = NULL;
    if (get_vecs(objs, b, spec, 15, 0) < 0)
        goto done;
    if (PyObject_GetBuffer(objs[15], &rows.view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        goto done;
    rows.held = 1;
    if (get_vec(objs[16], &os, 8, 0, 1, "out_slots") < 0)
        goto done;
    const Py_ssize_t units = b[1].view.shape[0], row_bytes = b[14].view.shape[0];
    for (int i = 2; i < 13; i++)
        if (b[i].view.shape[0] < units) {
            PyErr_Format(PyExc_ValueError, "flush: %s is shorter than state", spec[i].name);
            goto done;
        }
    if (n < 0 || n > b[0].view.shape[0] || copies < 1 || row_bytes < HEADER_BYTES || exp_units < 0 ||
        exp_units > units || b[13].view.shape[0] < units - exp_units || max_flushes < 0 || max_flushes > 60 ||
        rows.view.len < n * copies * row_bytes || os.view.shape[0] < n * copies) {
        PyErr_SetString(PyExc_ValueError, "flush: n, the rows buffer and the plan do not fit");
        goto done;
    }
    const int64_t *unit = (const int64_t *)b[0].view.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (unit[i] < 0 || unit[i] >= units) {
            PyErr_SetString(PyExc_ValueError, "flush: a unit lies outside the plan");
            goto done;
        }
    int8_t *state = (int8_t *)b[1].view.buf;
    int64_t *flushes = (int64_t *)b[2].view.buf;
    double *first_flush_at = (double *)b[3].view.buf, *flushed_at = (double *)b[4].view.buf;
    double *deadline = (double *)b[5].view.buf;
    const uint8_t *proven_in = (const uint8_t *)b[6].view.buf, *critical = (const uint8_t *)b[7].view.buf;
    const int64_t *retx_spent = (const int64_t *)b[8].view.buf, *retx = (const int64_t *)b[9].view.buf;
    const int64_t *probes = (const int64_t *)b[10].view.buf, *slot = (const int64_t *)b[11].view.buf;
    const int64_t *seq = (const int64_t *)b[12].view.buf;
    const int32_t *shift = (const int32_t *)b[13].view.buf;
    const uint8_t *template = (const uint8_t *)b[14].view.buf;
    uint8_t *out = (uint8_t *)rows.view.buf;
    int64_t *out_slot = (int64_t *)os.view.buf;
    Py_ssize_t flushed = 0, on_timer = 0, gave_up = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t u = unit[i];
        const int64_t f = flushes[u];
        if (!(f < max_flushes || (f > 0 && now < first_flush_at[u] + give_up_s))) {
            state[u] = ST_GAVE_UP;  /* an exponent unit given up leaves its chunks without has_exp */
            gave_up++;
            continue;
        }
        on_timer += u >= frontier_min && !proven_in[u];
        if (f == 0)
            first_flush_at[u] = now;
        flushes[u] = f + 1;
        const int is_exp = u < exp_units;
        uint8_t *row = out + flushed * copies * row_bytes;
        memcpy(row, template, (size_t)row_bytes);
        row[OFF_FLAGS] = (uint8_t)((is_exp ? FLAG_MAX : 0) | (f + 1 > 1 ? FLAG_RETX : 0));
        row[OFF_EXP] = (uint8_t)(int8_t)(is_exp ? 0 : shift[u - exp_units]);
        put_be16(row + OFF_SLOT, (uint16_t)slot[u]);
        put_be16(row + OFF_NELEM, 0);
        put_be32(row + OFF_SEQ, (uint32_t)seq[u]);
        put_be32(row + OFF_STEP, (uint32_t)step);
        put_be32(row + OFF_CHUNK, (uint32_t)(is_exp ? u : u - exp_units));
        for (Py_ssize_t c = 1; c < copies; c++)
            memcpy(row + c * row_bytes, row, (size_t)row_bytes);
        for (Py_ssize_t c = 0; c < copies; c++)
            out_slot[flushed * copies + c] = slot[u];
        flushed_at[u] = t_flush;
        /* Deadlines.arm for a retry (flushes > 0) */
        double backoff = flush_rto_s * (double)(1LL << (f + 1));
        if (backoff > max_deadline_s)
            backoff = max_deadline_s;
        double at = now + backoff * stagger;
        if (first_flush_at[u] + give_up_s < at)
            at = first_flush_at[u] + give_up_s;
        if (resend_max >= 0 && critical[u] && retx_spent[u] < resend_max)
            at = now + rto_s * (retx[u] > 0 ? 2.0 : 1.0);
        if (!synced && is_exp && !critical[u]) {
            const double probe_at = now + rto_s * (double)(1LL << probes[u]);
            if (probe_at < at)
                at = probe_at;
        }
        deadline[u] = at;
        flushed++;
    }
    result = Py_BuildValue("nnn", flushed, on_timer, gave_up);
done:
    release_vecs(b, 15);
    if (rows.held)
        PyBuffer_Release(&rows.view);
    if (os.held)
        PyBuffer_Release(&os.view);
    return result;
}

/* fast_flush(state, proven_lost, deadline_at, flushes, retx, critical_unit, retx_spent, has_exp, owner, lo, hi,
 *            exp_units, group_size, group_pos, now, srtt_s, probe_at, resend_max, out) -> n_probe
 * Deadlines.fast_flush for the units in flight in [lo, hi), the range every worker's frontier has passed: each
 * is proven lost; the designated worker of its group (unit mod group_size == group_pos) or its owner flushes it
 * at ``now``, the others one round trip later (``srtt_s``); a critical unit (resend_max >= 0: resent, not
 * flushed, up to resend_max resends) is resent by every worker at once. A first try moves its deadline only
 * forward. ``probe_at`` is NaN unless RESULT loss dominates (Deadlines.probing_lost); then the others' first
 * tries of data units with a GRAD are probed, their deadline ``probe_at``, and listed in out[:n_probe]. */
static PyObject *engine_fast_flush(PyObject *self, PyObject *args) {
    PyObject *objs[10];
    Py_ssize_t lo, hi, exp_units, group_size, group_pos, resend_max;
    double now, srtt_s, probe_at;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOnnnnndddnO:fast_flush", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4],
                          &objs[5], &objs[6], &objs[7], &objs[8], &lo, &hi, &exp_units, &group_size, &group_pos,
                          &now, &srtt_s, &probe_at, &resend_max, &objs[9]))
        return NULL;
    /* state, proven_lost, deadline_at, flushes, retx, critical_unit, retx_spent, has_exp, owner, out */
    static const vec_spec_t spec[10] = {{1, 0, "state"},        {1, 1, "proven_lost"}, {8, 1, "deadline_at"},
                                        {8, 0, "flushes"},      {8, 0, "retx"},        {1, 0, "critical_unit"},
                                        {8, 0, "retx_spent"},   {1, 0, "has_exp"},     {8, 0, "owner"},
                                        {8, 1, "out"}};
    buf_t b[10] = {{{0}}};
    PyObject *result = NULL;
    if (get_vecs(objs, b, spec, 10, 0) < 0)
        goto done;
    const Py_ssize_t units = b[0].view.shape[0];
    for (int i = 1; i < 7; i++)
        if (b[i].view.shape[0] < units) {
            PyErr_Format(PyExc_ValueError, "fast_flush: %s is shorter than state", spec[i].name);
            goto done;
        }
    if (lo < 0 || hi > units || exp_units < 0 || exp_units > units || group_size < 1 ||
        b[7].view.shape[0] < units - exp_units || b[8].view.shape[0] < units - exp_units ||
        b[9].view.shape[0] < (hi > lo ? hi - lo : 0)) {
        PyErr_SetString(PyExc_ValueError, "fast_flush: lo, hi and the arrays must fit the plan");
        goto done;
    }
    const int8_t *state = (const int8_t *)b[0].view.buf;
    uint8_t *proven_lost = (uint8_t *)b[1].view.buf;
    double *deadline = (double *)b[2].view.buf;
    const int64_t *flushes = (const int64_t *)b[3].view.buf, *retx = (const int64_t *)b[4].view.buf;
    const uint8_t *critical = (const uint8_t *)b[5].view.buf, *has_exp = (const uint8_t *)b[7].view.buf;
    const int64_t *retx_spent = (const int64_t *)b[6].view.buf, *owner = (const int64_t *)b[8].view.buf;
    int64_t *out = (int64_t *)b[9].view.buf;
    const Py_ssize_t n_probe = fast_flush_core(state, proven_lost, deadline, flushes, retx, critical, retx_spent,
                                               has_exp, owner, lo, hi, exp_units, group_size, group_pos, now, srtt_s,
                                               probe_at, resend_max, out);
    result = PyLong_FromSsize_t(n_probe);
done:
    release_vecs(b, 10);
    return result;
}

static PyMethodDef engine_methods[] = {
    {"gather_rows", engine_gather_rows, METH_VARARGS, "Rows of units, each copies times, and their slots."},
    {"reuse_first", engine_reuse_first, METH_VARARGS, "SlotReuse.limit's first unit, without the holders."},
    {"flush", engine_flush, METH_VARARGS, "The FLUSH rule of ReduceEngine._deadline_actions: rows, flushes, deadlines."},
    {"fast_flush", engine_fast_flush, METH_VARARGS, "Deadlines.fast_flush for the units every frontier passed."},
    {"run", engine_run, METH_VARARGS, "The units of [u0, hi) whose exponent is settled; (u1, all pending)."},
    {"peers_news", engine_peers_news, METH_VARARGS, "SlotReuse.set_presumed_dead, then SlotReuse.saw."},
    {"stall", engine_stall, METH_VARARGS, "Deadlines.stall_flush: bring the newest stalled unit's deadline forward."},
    {"quantize_ahead", engine_quantize_ahead, METH_VARARGS, "Quantize the next chunks into their packet rows."},
    {"settle", engine_settle, METH_VARARGS, "Route and settle one received batch of RESULTs (see hostlib/_engine.c)."},
    {"scan", engine_scan, METH_VARARGS, "Advance low past the settled prefix; (low, unsettled, in_flight)."},
    {"due", engine_due, METH_VARARGS, "Units in flight past their deadline; (n_due, next_at)."},
    {"wake", engine_wake, METH_VARARGS, "A Wake for one reduce: the send half of a steady wake-up in one call."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef engine_module = {
    PyModuleDef_HEAD_INIT, "_engine", "Native steady state of hostlib.transport's reduce engine.", -1, engine_methods,
};

PyMODINIT_FUNC PyInit__engine(void) {
    if (PyType_Ready(&WakeType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&engine_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&WakeType);
    if (PyModule_AddObject(m, "Wake", (PyObject *)&WakeType) < 0) {
        Py_DECREF(&WakeType);
        Py_DECREF(m);
        return NULL;
    }
    /* The wire constants compiled in, for the test that checks them against hostlib.protocol. */
    const struct {
        const char *name;
        long value;
    } constants[] = {
        {"OFF_VERSION", OFF_VERSION}, {"OFF_OP", OFF_OP},         {"OFF_FLAGS", OFF_FLAGS},
        {"OFF_EXP", OFF_EXP},         {"OFF_JOB", OFF_JOB},       {"OFF_WORKER", OFF_WORKER},
        {"OFF_COUNT", OFF_COUNT},     {"OFF_SLOT", OFF_SLOT},     {"OFF_SEQ", OFF_SEQ},
        {"OFF_WEIGHT", OFF_WEIGHT},   {"OFF_BITMAP", OFF_BITMAP}, {"HEADER_BYTES", HEADER_BYTES},
        {"OP_RESULT", OP_RESULT},     {"OP_PARAM", OP_PARAM},     {"OP_PARAM_REQ", OP_PARAM_REQ},
        {"FLAG_RETX", FLAG_RETX},     {"ST_IN_FLIGHT", ST_IN_FLIGHT}, {"ST_DONE", ST_DONE}, {"ST_GAVE_UP", ST_GAVE_UP},
        {"NONFINITE_EXPONENT", (long)NONFINITE_EXPONENT}, {"SHIFT_LIMIT", SHIFT_LIMIT},
    };
    for (size_t i = 0; i < sizeof(constants) / sizeof(constants[0]); i++)
        if (PyModule_AddIntConstant(m, constants[i].name, constants[i].value) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    return m;
}
