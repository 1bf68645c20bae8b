/*
 * softswitch._swcore: the switch contract of docs/protocol.md over a whole batch of packets, in C.
 *
 * run() takes the packets in arrival order and does, packet by packet, exactly what the per-packet reference
 * (softswitch.pipeline.SoftSwitch._process) does: the checks, the slot state machine, FLUSH, PARAM
 * replication, the emulated drop policies and every counter. The Python side (softswitch/batch.py) owns
 * every table and register (numpy arrays, shared with the reference path) and gives this module the
 * protocol's constants once (configure), so the wire layout and the counter names stay defined in
 * hostlib/protocol.py alone.
 *
 * Drop decisions come from the Python DropStreams, a batch at a time: the first time a batch needs a stream
 * it asks peek(job, direction, receiver, sender, n) for the next n decisions without consuming them (None:
 * no policy), uses as many as the packets need, and at the end tells commit(job, direction, receiver,
 * sender, used) how many it took. The decisions are those the reference draws, in the same order.
 *
 * Output: each packet emits at most one distinct packet (a RESULT, or a PARAM copy), written once into a
 * row of out_rows; its replicas are (row, length, egress key) triples in out_index/out_lens/out_egress, in
 * the order the reference emits them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "_hotloop.h" /* hostlib/_hotloop.h (setup.py puts hostlib on the include path) */

/* Header fields, in the order of hostlib.protocol.HEADER_FIELDS. */
enum { F_VERSION, F_OP, F_FLAGS, F_EXP, F_JOB, F_WORKER, F_COUNT, F_SLOT, F_NELEM, F_SEQ, F_STEP, F_CHUNK,
       F_WEIGHT, F_BITMAP, N_FIELDS };
/* Ops, flags, registers and counter roles: configure() gives their values / indices. */
enum { O_GRAD, O_RESULT, O_FLUSH, O_PARAM, O_PARAM_REQ, O_HEARTBEAT, N_OPS };
enum { FL_RETX, FL_SATURATED, FL_CRITICAL, FL_MAX, FL_OWNER, N_FLAGS };
enum { R_SEQ, R_CLOSED, R_COUNT, R_WEIGHT, R_EXP, R_FLAGS, R_NELEM, R_STEP, R_CHUNK, R_CLOSER, R_PARTS, R_STATE,
       R_OWNER, N_REGS };
enum { LS_PARTIAL, LS_FLUSHED, LS_FINAL, N_LEAF_STATES }; /* softswitch.batch.LEAF_* */
enum { RL_FLAT, RL_LEAF, RL_SPINE, N_JOB_ROLES }; /* hostlib.protocol.Role */
enum { C_RX, C_MALFORMED, C_UNKNOWN_JOB, C_SLOT_RANGE, C_BAD_WORKER, C_POLICY_UP, C_GRAD_START, C_GRAD_ADD,
       C_GRAD_DUP, C_GRAD_LATE_RESEND, C_GRAD_STALE, C_GRAD_EXP_MISMATCH, C_RESULT_QUORUM, C_FLUSH_PARTIAL,
       C_FLUSH_EMPTY, C_FLUSH_RESEND, C_FLUSH_STALE, C_PARAM_FWD, C_PARAM_REQ_FWD, C_HEARTBEAT,
       C_POLICY_DOWN, C_POLICY_PARAM, C_TX, C_UP_PARTIAL, C_UP_RESEND, C_DOWN_RESULT, C_DOWN_STALE, C_UP_HELD,
       N_ROLES };
enum { D_UP, D_DOWN, D_PARAM }; /* hostlib.emulation.dropmodels.DIRECTIONS */

#define MAX_JOBS_C 4096
#define KEYS_PER_JOB 256 /* worker_id is one byte */
#define STREAM_TABLE 4096

static struct {
    int ready;
    int off[N_FIELDS], size[N_FIELDS];
    int header_bytes, version, max_jobs, max_workers, ncounters, nregs;
    int op[N_OPS], role[N_JOB_ROLES], flag[N_FLAGS], reg[N_REGS], leaf_state[N_LEAF_STATES], counter[N_ROLES];
    uint8_t valid_op[256];
} K;

/* Header fields are 1, 2, 4 or 8 bytes: one load and a byte swap each (the loops stay for other sizes). A
 * relaying switch parses every header and writes one per packet it emits, so this is per-packet cost. */
static inline uint64_t get_be(const uint8_t *p, int size) {
    switch (size) {
    case 1:
        return p[0];
    case 2: {
        uint16_t v;
        memcpy(&v, p, 2);
        return __builtin_bswap16(v);
    }
    case 4: {
        uint32_t v;
        memcpy(&v, p, 4);
        return __builtin_bswap32(v);
    }
    case 8: {
        uint64_t v;
        memcpy(&v, p, 8);
        return __builtin_bswap64(v);
    }
    default: {
        uint64_t v = 0;
        for (int i = 0; i < size; i++)
            v = (v << 8) | p[i];
        return v;
    }
    }
}

/* Big-endian 32-bit lanes of the payload. */
static inline uint32_t load_be32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return __builtin_bswap32(v);
}

static inline void store_be32(uint8_t *p, uint32_t v) {
    v = __builtin_bswap32(v);
    memcpy(p, &v, 4);
}

static inline void put_be(uint8_t *p, int size, uint64_t v) {
    switch (size) {
    case 1:
        p[0] = (uint8_t)v;
        return;
    case 2: {
        uint16_t x = __builtin_bswap16((uint16_t)v);
        memcpy(p, &x, 2);
        return;
    }
    case 4: {
        uint32_t x = __builtin_bswap32((uint32_t)v);
        memcpy(p, &x, 4);
        return;
    }
    case 8: {
        uint64_t x = __builtin_bswap64(v);
        memcpy(p, &x, 8);
        return;
    }
    default:
        for (int i = size - 1; i >= 0; i--) {
            p[i] = (uint8_t)(v & 0xFF);
            v >>= 8;
        }
    }
}

static int int_tuple(PyObject *seq, int *out, int n, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "%s: expected %d values, got %zd", what, n, PySequence_Fast_GET_SIZE(fast));
        Py_DECREF(fast);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        out[i] = (int)v;
    }
    Py_DECREF(fast);
    return 0;
}

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *offs, *sizes, *ops, *roles, *valid_ops, *flags, *regs, *states, *counters;
    if (!PyArg_ParseTuple(args, "OOiiiiiiOOOOOOO:configure", &offs, &sizes, &K.header_bytes, &K.version,
                          &K.max_jobs, &K.max_workers, &K.ncounters, &K.nregs, &ops, &roles, &valid_ops, &flags,
                          &regs, &states, &counters))
        return NULL;
    int valid[256];
    if (int_tuple(offs, K.off, N_FIELDS, "field offsets") < 0 || int_tuple(sizes, K.size, N_FIELDS, "field sizes") < 0 ||
        int_tuple(ops, K.op, N_OPS, "ops") < 0 || int_tuple(roles, K.role, N_JOB_ROLES, "roles") < 0 ||
        int_tuple(valid_ops, valid, 256, "valid ops") < 0 ||
        int_tuple(flags, K.flag, N_FLAGS, "flags") < 0 || int_tuple(regs, K.reg, N_REGS, "registers") < 0 ||
        int_tuple(states, K.leaf_state, N_LEAF_STATES, "leaf states") < 0 ||
        int_tuple(counters, K.counter, N_ROLES, "counters") < 0)
        return NULL;
    for (int i = 0; i < 256; i++)
        K.valid_op[i] = valid[i] != 0;
    if (K.max_jobs < 1 || K.max_jobs > MAX_JOBS_C || K.max_workers < 1 || K.max_workers > 64 || K.nregs < N_REGS) {
        PyErr_SetString(PyExc_ValueError, "configure: limits out of range");
        return NULL;
    }
    K.ready = 1;
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------------------- */

typedef struct {
    Py_buffer view;
    int held;
} buf_t;

static int get_buf(PyObject *obj, buf_t *b, int writable, Py_ssize_t min_bytes, const char *what) {
    b->held = 0;
    if (PyObject_GetBuffer(obj, &b->view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    b->held = 1;
    if (b->view.len < min_bytes) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, need %zd", what, b->view.len, min_bytes);
        return -1;
    }
    return 0;
}

static void rel(buf_t *b) {
    if (b->held)
        PyBuffer_Release(&b->view);
    b->held = 0;
}

/* One job's slot registers, fetched from the Python list on the job's first packet in a batch. */
typedef struct {
    int state; /* 0 not fetched, 1 ready */
    buf_t regs, bitmap, acc;
} slots_t;

/* A drop stream's decisions for this batch. */
typedef struct {
    int64_t key; /* -1: empty */
    PyObject *obj;
    buf_t dec;
    Py_ssize_t used, len;
    int job, dir, r, s;
} stream_t;

typedef struct {
    /* inputs */
    const uint8_t *data;
    Py_ssize_t width, stride;
    const int64_t *lens, *ingress;
    const int64_t *job_row, *elems, *pool, *quorum, *nworkers, *keys, *policy;
    const int64_t *role, *uplink, *leaf_id; /* the hierarchy: per job */
    const uint64_t *local;                  /* bit w: worker w is served here */
    int64_t *counters, *worker_rx;
    PyObject *slot_list;
    slots_t *slots;
    int spared;
    PyObject *peek, *commit;
    Py_ssize_t n;
    /* outputs */
    uint8_t *out_rows;
    Py_ssize_t out_width, out_stride, rows_cap, rows_used;
    int64_t *out_lens, *out_egress, *out_index;
    Py_ssize_t rep_cap, m;
    /* drop streams */
    stream_t *streams;
    Py_ssize_t *used_list;
    Py_ssize_t nused;
} run_t;

/* The work tables of one run() call: per-job register views and the batch's drop streams. */
typedef struct {
    slots_t *slots;
    stream_t *streams;
    Py_ssize_t *used_list;
} work_t;

/* The module's own tables (allocated at import) and whether a call is using them. */
static work_t work;
static int work_busy;

static int alloc_work(work_t *w) {
    w->slots = PyMem_Calloc((size_t)MAX_JOBS_C, sizeof(slots_t));
    w->streams = PyMem_Malloc(STREAM_TABLE * sizeof(stream_t));
    w->used_list = PyMem_Malloc(STREAM_TABLE * sizeof(Py_ssize_t));
    if (!w->slots || !w->streams || !w->used_list) {
        PyMem_Free(w->slots);
        PyMem_Free(w->streams);
        PyMem_Free(w->used_list);
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < STREAM_TABLE; i++) {
        w->streams[i].key = -1;
        w->streams[i].obj = NULL;
        w->streams[i].dec.held = 0;
    }
    return 0;
}

static void free_work(work_t *w) {
    PyMem_Free(w->slots);
    PyMem_Free(w->streams);
    PyMem_Free(w->used_list);
}

static inline void count(run_t *R, int64_t row, int role) { R->counters[row * K.ncounters + K.counter[role]]++; }

static slots_t *job_slots(run_t *R, int64_t job) {
    slots_t *sl = &R->slots[job];
    if (sl->state)
        return sl;
    PyObject *entry = PyList_GetItem(R->slot_list, (Py_ssize_t)job); /* borrowed */
    if (entry == NULL)
        return NULL;
    PyObject *regs, *bitmap, *acc;
    if (!PyArg_ParseTuple(entry, "OOO:slots", &regs, &bitmap, &acc))
        return NULL;
    Py_ssize_t pool = (Py_ssize_t)R->pool[job], k = (Py_ssize_t)R->elems[job];
    if (get_buf(regs, &sl->regs, 1, pool * K.nregs * 8, "slot registers") < 0 ||
        get_buf(bitmap, &sl->bitmap, 1, pool * 8, "slot bitmaps") < 0 ||
        get_buf(acc, &sl->acc, 1, pool * k * 4, "slot accumulators") < 0) {
        rel(&sl->regs);
        rel(&sl->bitmap);
        rel(&sl->acc);
        return NULL;
    }
    sl->state = 1;
    return sl;
}

/* The next decision of stream (job, dir, r, s): 1 drop, 0 keep, -1 error (exception set). */
static int drops(run_t *R, int64_t job, int dir, int r, int s) {
    if (!(R->policy[job] >> dir & 1))
        return 0;
    int64_t key = (((job * 3 + dir) * 256 + r) * 256) + s;
    Py_ssize_t h = (Py_ssize_t)(((uint64_t)key * 0x9E3779B97F4A7C15ull) >> 52) & (STREAM_TABLE - 1);
    while (R->streams[h].key != -1 && R->streams[h].key != key)
        h = (h + 1) & (STREAM_TABLE - 1);
    stream_t *st = &R->streams[h];
    if (st->key == -1) {
        if (R->nused >= STREAM_TABLE / 2) {
            PyErr_SetString(PyExc_RuntimeError, "too many drop streams in one batch");
            return -1;
        }
        st->key = key;
        st->obj = NULL;
        st->dec.held = 0;
        st->used = st->len = 0;
        st->job = (int)job;
        st->dir = dir;
        st->r = r;
        st->s = s;
        R->used_list[R->nused++] = h;
        PyObject *res = PyObject_CallFunction(R->peek, "iiiin", (int)job, dir, r, s, R->n);
        if (res == NULL)
            return -1;
        if (res != Py_None) {
            st->obj = res;
            if (get_buf(res, &st->dec, 0, 0, "drop decisions") < 0)
                return -1;
            st->len = st->dec.view.len;
        } else {
            Py_DECREF(res);
        }
    }
    if (st->obj == NULL)
        return 0;
    if (st->used >= st->len) {
        PyErr_SetString(PyExc_RuntimeError, "drop stream ran out of peeked decisions");
        return -1;
    }
    return ((const uint8_t *)st->dec.view.buf)[st->used++] != 0;
}

static int finish_streams(run_t *R, int ok) {
    int rc = 0;
    for (Py_ssize_t i = 0; i < R->nused; i++) {
        stream_t *st = &R->streams[R->used_list[i]];
        if (ok && rc == 0 && st->obj != NULL && st->used > 0) {
            PyObject *res = PyObject_CallFunction(R->commit, "iiiin", st->job, st->dir, st->r, st->s, st->used);
            if (res == NULL)
                rc = -1;
            Py_XDECREF(res);
        }
        rel(&st->dec);
        Py_XDECREF(st->obj);
        st->obj = NULL;
        st->key = -1;
    }
    R->nused = 0;
    return rc;
}

/* A new output row of `len` bytes; NULL (exception set) when the buffers are too small. */
static uint8_t *new_row(run_t *R, Py_ssize_t len) {
    if (R->rows_used >= R->rows_cap || len > R->out_width) {
        PyErr_SetString(PyExc_RuntimeError, "output rows too small for the batch");
        return NULL;
    }
    return R->out_rows + (R->rows_used++) * R->out_stride;
}

static int add_replica(run_t *R, Py_ssize_t row, Py_ssize_t len, int64_t egress) {
    if (R->m >= R->rep_cap) {
        PyErr_SetString(PyExc_RuntimeError, "output replicas too small for the batch");
        return -1;
    }
    R->out_index[R->m] = row;
    R->out_lens[R->m] = len;
    R->out_egress[R->m] = egress;
    R->m++;
    return 0;
}

/* A RESULT's payload: the slot's accumulator as big-endian int32. */
HOT_LOOP
static void store_payload(uint8_t *p, const int32_t *acc, Py_ssize_t k) {
    for (Py_ssize_t j = 0; j < k; j++)
        store_be32(p + 4 * j, (uint32_t)acc[j]);
}

/* A packet built from slot s into a new output row: op, the round's flags | extra, worker_id `worker`,
 * the round's header fields and acc. Returns the row's number, -1 (exception set) when there is no room. */
static Py_ssize_t slot_row(run_t *R, int64_t job, slots_t *sl, Py_ssize_t s, int op, int extra, int worker) {
    const int64_t *g = (const int64_t *)sl->regs.view.buf + s * K.nregs;
    Py_ssize_t k = (Py_ssize_t)R->elems[job], len = K.header_bytes + 4 * k;
    uint8_t *row = new_row(R, len);
    if (row == NULL)
        return -1;
    memset(row, 0, (size_t)K.header_bytes);
    uint64_t v[N_FIELDS];
    v[F_VERSION] = (uint64_t)K.version;
    v[F_OP] = (uint64_t)op;
    v[F_FLAGS] = (uint64_t)(g[K.reg[R_FLAGS]] | extra);
    v[F_EXP] = (uint64_t)g[K.reg[R_EXP]];
    v[F_JOB] = (uint64_t)job;
    v[F_WORKER] = (uint64_t)worker;
    v[F_COUNT] = (uint64_t)g[K.reg[R_COUNT]];
    v[F_SLOT] = (uint64_t)s;
    v[F_NELEM] = (uint64_t)g[K.reg[R_NELEM]];
    v[F_SEQ] = (uint64_t)g[K.reg[R_SEQ]];
    v[F_STEP] = (uint64_t)g[K.reg[R_STEP]];
    v[F_CHUNK] = (uint64_t)g[K.reg[R_CHUNK]];
    v[F_WEIGHT] = (uint64_t)g[K.reg[R_WEIGHT]];
    v[F_BITMAP] = ((const uint64_t *)sl->bitmap.view.buf)[s];
    for (int f = 0; f < N_FIELDS; f++)
        put_be(row + K.off[f], K.size[f], v[f]);
    store_payload(row + K.header_bytes, (const int32_t *)sl->acc.view.buf + s * k, k);
    return R->rows_used - 1;
}

/* RESULT replicas of slot s of job to worker `only` (>= 0: a unicast resend) or to every worker served
 * here (a leaf's local workers; a spine's leaves). An owner-only round goes to its owner alone, whoever
 * asked (to no one when the owner is no worker served here). */
static int emit(run_t *R, int64_t job, slots_t *sl, Py_ssize_t s, int only, int retx) {
    const int64_t *g = (const int64_t *)sl->regs.view.buf + s * K.nregs;
    Py_ssize_t len = K.header_bytes + 4 * (Py_ssize_t)R->elems[job];
    if (g[K.reg[R_FLAGS]] & K.flag[FL_OWNER]) {
        int64_t owner = g[K.reg[R_OWNER]];
        if (owner < 0 || owner >= R->nworkers[job] || !(R->local[job] >> owner & 1))
            return 0;
        only = (int)owner;
    }
    Py_ssize_t rowno = slot_row(R, job, sl, s, K.op[O_RESULT], retx ? K.flag[FL_RETX] : 0, (int)g[K.reg[R_CLOSER]]);
    if (rowno < 0)
        return -1;
    int nw = (int)R->nworkers[job];
    const int64_t *keys = R->keys + job * KEYS_PER_JOB;
    uint64_t local = R->local[job];
    int first = only >= 0 ? only : 0, last = only >= 0 ? only + 1 : nw, sent = 0;
    for (int r = first; r < last; r++) {
        if (only < 0 && !(local >> r & 1))
            continue;
        int d = drops(R, job, D_DOWN, r, 0);
        if (d < 0)
            return -1;
        if (d) {
            count(R, job, C_POLICY_DOWN);
            continue;
        }
        if (add_replica(R, rowno, len, keys[r]) < 0)
            return -1;
        count(R, job, C_TX);
        sent++;
    }
    if (!sent)
        R->rows_used--; /* every replica was dropped: the row goes to the next packet */
    return 0;
}

/* A leaf's partial of slot s to its uplink, as `op` (GRAD: closed here; FLUSH: close the spine's round). */
static int send_up(run_t *R, int64_t job, slots_t *sl, Py_ssize_t s, int op, int retx) {
    Py_ssize_t len = K.header_bytes + 4 * (Py_ssize_t)R->elems[job];
    Py_ssize_t rowno = slot_row(R, job, sl, s, op, retx ? K.flag[FL_RETX] : 0, (int)R->leaf_id[job]);
    if (rowno < 0 || add_replica(R, rowno, len, R->uplink[job]) < 0)
        return -1;
    count(R, job, C_TX);
    return 0;
}

/* A round just closed: a leaf sends its partial up as `op`, any other role multicasts the RESULT. */
static int close_round(run_t *R, int64_t job, slots_t *sl, Py_ssize_t s, int op) {
    if (R->role[job] == K.role[RL_LEAF]) {
        count(R, job, C_UP_PARTIAL);
        return send_up(R, job, sl, s, op, 0);
    }
    return emit(R, job, sl, s, -1, 0);
}

/* acc = the packet's payload (zero for an empty partial: it carries no values). The per-element loops below
 * are HOT_LOOPs: byte swaps and adds over 32-bit lanes, K of them a packet. */
HOT_LOOP
static void store_acc(int32_t *acc, const uint8_t *payload, int64_t k, int64_t hcount) {
    if (!hcount) {
        memset(acc, 0, (size_t)k * sizeof(*acc));
        return;
    }
    for (int64_t j = 0; j < k; j++)
        acc[j] = (int32_t)load_be32(payload + 4 * j);
}

/* acc += payload (int32 wrap-around, as the switch's registers), or max with the MAX flag. */
HOT_LOOP
static void combine_acc(int32_t *acc, const uint8_t *payload, int64_t k, int is_max) {
    if (is_max) {
        for (int64_t j = 0; j < k; j++) {
            int32_t x = (int32_t)load_be32(payload + 4 * j);
            if (x > acc[j])
                acc[j] = x;
        }
    } else {
        for (int64_t j = 0; j < k; j++)
            acc[j] = (int32_t)((uint32_t)acc[j] + load_be32(payload + 4 * j));
    }
}

/* Add a contribution (count hcount, bitmap hbitmap) to an open round: a spine round opened by an empty
 * partial (count 0) takes the contribution's contents; an empty contribution adds no values. */
static void add_part(int64_t *g, uint64_t *bm, int32_t *acc, const uint8_t *payload, int64_t k, int64_t hcount,
                     uint64_t hbitmap, int64_t weight, int exp, int flags) {
    const int mx = K.flag[FL_MAX], sat = K.flag[FL_SATURATED];
    if (hcount && !g[K.reg[R_COUNT]]) {
        store_acc(acc, payload, k, hcount);
        g[K.reg[R_EXP]] = exp;
        g[K.reg[R_FLAGS]] = (g[K.reg[R_FLAGS]] & sat) | (flags & mx);
    } else if (hcount) {
        combine_acc(acc, payload, k, (int)(g[K.reg[R_FLAGS]] & mx));
    }
    g[K.reg[R_COUNT]] += hcount;
    *bm |= hbitmap;
    g[K.reg[R_WEIGHT]] = (g[K.reg[R_WEIGHT]] + weight) & 0xFFFFFFFFll;
    g[K.reg[R_FLAGS]] |= flags & sat;
}

/* A new round from a packet: its header fields, count hcount, bitmap hbitmap; closed or not. */
static void start_round(int64_t *g, uint64_t *bm, int32_t *acc, const uint8_t *payload, int64_t k, int64_t q,
                        int closed, int64_t hcount, uint64_t hbitmap, int64_t weight, int exp, int64_t flags,
                        int64_t nelem, int64_t step, int64_t chunk, int64_t closer, int64_t parts, int64_t state,
                        int64_t owner) {
    store_acc(acc, payload, k, hcount);
    g[K.reg[R_SEQ]] = q;
    g[K.reg[R_CLOSED]] = closed;
    g[K.reg[R_COUNT]] = hcount;
    *bm = hbitmap;
    g[K.reg[R_WEIGHT]] = weight;
    g[K.reg[R_EXP]] = exp;
    g[K.reg[R_FLAGS]] = flags;
    g[K.reg[R_NELEM]] = nelem;
    g[K.reg[R_STEP]] = step;
    g[K.reg[R_CHUNK]] = chunk;
    g[K.reg[R_CLOSER]] = closer;
    g[K.reg[R_PARTS]] = parts;
    g[K.reg[R_STATE]] = state;
    g[K.reg[R_OWNER]] = owner;
}

static int one_packet(run_t *R, Py_ssize_t i) {
    const uint8_t *p = R->data + i * R->stride;
    Py_ssize_t len = (Py_ssize_t)R->lens[i];
    if (len > R->width)
        len = R->width;
    if (len < K.header_bytes) {
        count(R, 0, C_RX);
        count(R, 0, C_MALFORMED);
        return 0;
    }
    int version = (int)get_be(p + K.off[F_VERSION], K.size[F_VERSION]);
    int op = (int)get_be(p + K.off[F_OP], K.size[F_OP]);
    int flags = (int)get_be(p + K.off[F_FLAGS], K.size[F_FLAGS]);
    int exp = (int)(int8_t)get_be(p + K.off[F_EXP], K.size[F_EXP]);
    int64_t job_id = (int64_t)get_be(p + K.off[F_JOB], K.size[F_JOB]);
    int w = (int)get_be(p + K.off[F_WORKER], K.size[F_WORKER]);
    int64_t hcount = (int64_t)get_be(p + K.off[F_COUNT], K.size[F_COUNT]);
    Py_ssize_t s = (Py_ssize_t)get_be(p + K.off[F_SLOT], K.size[F_SLOT]);
    int64_t nelem = (int64_t)get_be(p + K.off[F_NELEM], K.size[F_NELEM]);
    int64_t q = (int64_t)get_be(p + K.off[F_SEQ], K.size[F_SEQ]);
    uint64_t hbitmap = get_be(p + K.off[F_BITMAP], K.size[F_BITMAP]);

    int64_t job = R->job_row[job_id];
    if (job < 0 || job >= K.max_jobs)
        job = 0; /* (the table holds job ids; anything else is no job) */
    count(R, job, C_RX);
    int64_t role = R->role[job];
    /* A RESULT reaches a switch only as the spine's answer to a leaf, from the leaf's uplink. */
    int down = op == K.op[O_RESULT] && job != 0 && role == K.role[RL_LEAF] && R->ingress[i] == R->uplink[job];
    if (version != K.version || !K.valid_op[op] || (op == K.op[O_RESULT] && !down)) {
        count(R, job, C_MALFORMED);
        return 0;
    }
    if (job == 0) {
        count(R, 0, C_UNKNOWN_JOB);
        return 0;
    }
    int64_t k = R->elems[job];
    int leaf = role == K.role[RL_LEAF], spine = role == K.role[RL_SPINE];
    /* A partial's count must be the size of its bitmap: then no round's count can exceed its bitmap's. */
    int bad_partial = spine && (op == K.op[O_GRAD] || op == K.op[O_FLUSH]) && hcount != __builtin_popcountll(hbitmap);
    if (len - K.header_bytes != 4 * k || nelem > k || bad_partial) {
        count(R, job, C_MALFORMED);
        return 0;
    }
    int nw = (int)R->nworkers[job];
    const int64_t *keys = R->keys + job * KEYS_PER_JOB;
    if (!down) {
        if (w >= nw || keys[w] != R->ingress[i]) {
            count(R, job, C_BAD_WORKER);
            return 0;
        }
        R->worker_rx[job * K.max_workers + w]++;
        if (op == K.op[O_HEARTBEAT]) {
            count(R, job, C_HEARTBEAT);
            return 0;
        }
    }
    int exposed = !(flags & R->spared);
    if (op == K.op[O_PARAM] || op == K.op[O_PARAM_REQ]) {
        count(R, job, op == K.op[O_PARAM] ? C_PARAM_FWD : C_PARAM_REQ_FWD);
        Py_ssize_t rowno = -1;
        uint64_t local = R->local[job];
        for (int r = 0; r < nw; r++) {
            if (r == w || !(local >> r & 1))
                continue;
            if (exposed) {
                int d = drops(R, job, D_PARAM, r, w);
                if (d < 0)
                    return -1;
                if (d) {
                    count(R, job, C_POLICY_PARAM);
                    continue;
                }
            }
            if (rowno < 0) {
                uint8_t *row = new_row(R, len);
                if (row == NULL)
                    return -1;
                memcpy(row, p, (size_t)len);
                rowno = R->rows_used - 1;
            }
            if (add_replica(R, rowno, len, keys[r]) < 0)
                return -1;
            count(R, job, C_TX);
        }
        return 0;
    }
    if (s >= R->pool[job]) {
        count(R, job, C_SLOT_RANGE);
        return 0;
    }
    slots_t *sl = job_slots(R, job);
    if (sl == NULL)
        return -1;
    int64_t *g = (int64_t *)sl->regs.view.buf + s * K.nregs;
    uint64_t *bm = (uint64_t *)sl->bitmap.view.buf + s;
    int32_t *acc = (int32_t *)sl->acc.view.buf + s * k;
    const uint8_t *payload = p + K.header_bytes;
    int64_t step = (int64_t)get_be(p + K.off[F_STEP], K.size[F_STEP]);
    int64_t chunk = (int64_t)get_be(p + K.off[F_CHUNK], K.size[F_CHUNK]);
    int64_t weight = (int64_t)get_be(p + K.off[F_WEIGHT], K.size[F_WEIGHT]);
    const int mx = K.flag[FL_MAX], sat = K.flag[FL_SATURATED], retx_flag = K.flag[FL_RETX];
    int64_t seq = g[K.reg[R_SEQ]];

    if (down) { /* the spine's RESULT at a leaf: kept as the slot's final round, multicast to the workers */
        if (q < seq) {
            count(R, job, C_DOWN_STALE);
            return 0;
        }
        start_round(g, bm, acc, payload, k, q, 1, hcount, hbitmap, weight, exp, flags & (mx | sat), nelem, step,
                    chunk, w, 0, K.leaf_state[LS_FINAL], 0);
        store_acc(acc, payload, k, 1);
        count(R, job, C_DOWN_RESULT);
        return emit(R, job, sl, s, -1, flags & retx_flag);
    }
    /* Owner-only RESULT: a flat switch's worker names the owner in `count`; a leaf or a spine multicasts
     * as before (the flag is not kept). */
    int flat = role == K.role[RL_FLAT];
    int64_t owner = flat ? hcount : 0;
    int owner_flag = flat ? flags & K.flag[FL_OWNER] : 0;
    if (!spine) { /* a worker's packet is one contribution; a leaf's partial carries its own */
        hcount = 1;
        hbitmap = (uint64_t)1 << w;
    }

    if (op == K.op[O_FLUSH]) {
        if (spine) { /* the leaf's partial is added if the round lacks it, and the round closes */
            if (q > seq) {
                start_round(g, bm, acc, payload, k, q, 1, hcount, hbitmap, weight, exp, flags & (mx | sat), nelem,
                            step, chunk, w, (int64_t)1 << w, 0, 0);
                count(R, job, hcount ? C_FLUSH_PARTIAL : C_FLUSH_EMPTY);
                return emit(R, job, sl, s, -1, 0);
            }
            if (q < seq) {
                count(R, job, C_FLUSH_STALE);
                return 0;
            }
            if (g[K.reg[R_CLOSED]]) {
                count(R, job, C_FLUSH_RESEND);
                return emit(R, job, sl, s, w, 1);
            }
            if (g[K.reg[R_PARTS]] >> w & 1) {
                /* the leaf's partial is in already: this FLUSH only closes */
            } else if (*bm & hbitmap) {
                count(R, job, C_GRAD_DUP);
            } else {
                if (g[K.reg[R_COUNT]] && hcount && (exp != g[K.reg[R_EXP]] || ((flags ^ (int)g[K.reg[R_FLAGS]]) & mx))) {
                    count(R, job, C_GRAD_EXP_MISMATCH);
                } else {
                    add_part(g, bm, acc, payload, k, hcount, hbitmap, weight, exp, flags);
                    g[K.reg[R_PARTS]] |= (int64_t)1 << w;
                }
            }
            g[K.reg[R_CLOSED]] = 1;
            g[K.reg[R_CLOSER]] = w;
            count(R, job, C_FLUSH_PARTIAL);
            return emit(R, job, sl, s, -1, 0);
        }
        if (q > seq) {
            start_round(g, bm, acc, payload, k, q, 1, 0, 0, 0, exp, (flags & mx) | owner_flag, nelem, step, chunk,
                        w, 0, K.leaf_state[LS_PARTIAL], owner);
            count(R, job, C_FLUSH_EMPTY);
            return close_round(R, job, sl, s, K.op[O_GRAD]);
        }
        if (q < seq) {
            count(R, job, C_FLUSH_STALE);
            return 0;
        }
        if (g[K.reg[R_CLOSED]] && leaf && g[K.reg[R_STATE]] != K.leaf_state[LS_FINAL]) {
            /* a worker's repeated FLUSH (RETX): the partial up as a FLUSH, closing the spine; a first-try
               FLUSH: as a GRAD, once (the round's later first-try FLUSHes send nothing) */
            int again = (flags & retx_flag) != 0;
            if (!again && g[K.reg[R_STATE]] == K.leaf_state[LS_FLUSHED]) {
                count(R, job, C_UP_HELD);
                return 0;
            }
            count(R, job, C_UP_RESEND);
            g[K.reg[R_STATE]] = K.leaf_state[LS_FLUSHED];
            return send_up(R, job, sl, s, again ? K.op[O_FLUSH] : K.op[O_GRAD], 1);
        }
        if (g[K.reg[R_CLOSED]]) {
            count(R, job, C_FLUSH_RESEND);
            return emit(R, job, sl, s, w, 1);
        }
        g[K.reg[R_CLOSED]] = 1;
        g[K.reg[R_CLOSER]] = w;
        count(R, job, C_FLUSH_PARTIAL);
        return close_round(R, job, sl, s, K.op[O_GRAD]);
    }

    /* GRAD */
    if (exposed) {
        int d = drops(R, job, D_UP, w, 0);
        if (d < 0)
            return -1;
        if (d) {
            count(R, job, C_POLICY_UP);
            return 0;
        }
    }
    if (q > seq) {
        start_round(g, bm, acc, payload, k, q, 0, hcount, hbitmap, weight, exp, (flags & (mx | sat)) | owner_flag,
                    nelem, step, chunk, g[K.reg[R_CLOSER]], spine ? (int64_t)1 << w : 0, K.leaf_state[LS_PARTIAL],
                    owner);
        count(R, job, C_GRAD_START);
    } else if (q < seq) {
        count(R, job, C_GRAD_STALE);
        return 0;
    } else if (g[K.reg[R_CLOSED]] && leaf && g[K.reg[R_STATE]] != K.leaf_state[LS_FINAL]) {
        count(R, job, C_UP_RESEND);
        return send_up(R, job, sl, s, K.op[O_GRAD], 1);
    } else if (g[K.reg[R_CLOSED]]) {
        count(R, job, C_GRAD_LATE_RESEND);
        return emit(R, job, sl, s, w, 1);
    } else if ((spine ? (uint64_t)g[K.reg[R_PARTS]] : *bm) >> w & 1 || (spine && (*bm & hbitmap))) {
        count(R, job, C_GRAD_DUP);
        /* below the quorum nothing more; at it (the quorum was lowered under the open round) the resend
           closes the round, as the GRAD that reached the quorum would have */
    } else if (g[K.reg[R_COUNT]] && hcount && (exp != g[K.reg[R_EXP]] || ((flags ^ (int)g[K.reg[R_FLAGS]]) & mx))) {
        count(R, job, C_GRAD_EXP_MISMATCH);
        return 0;
    } else {
        add_part(g, bm, acc, payload, k, hcount, hbitmap, weight, exp, flags);
        if (spine)
            g[K.reg[R_PARTS]] |= (int64_t)1 << w;
        count(R, job, C_GRAD_ADD);
    }
    int64_t reached = spine ? __builtin_popcountll((uint64_t)g[K.reg[R_PARTS]]) : g[K.reg[R_COUNT]];
    if (reached >= R->quorum[job]) {
        g[K.reg[R_CLOSED]] = 1;
        g[K.reg[R_CLOSER]] = w;
        count(R, job, C_RESULT_QUORUM);
        return close_round(R, job, sl, s, K.op[O_GRAD]);
    }
    return 0;
}

static PyObject *run(PyObject *self, PyObject *args) {
    PyObject *data_obj, *lens_obj, *ingress_obj, *job_row_obj, *elems_obj, *pool_obj, *quorum_obj, *nw_obj,
        *keys_obj, *policy_obj, *role_obj, *uplink_obj, *leaf_obj, *local_obj, *slot_list, *counters_obj, *wrx_obj, *rows_obj, *olens_obj, *oegress_obj,
        *oindex_obj, *peek, *commit;
    Py_ssize_t n;
    int spared;
    if (!PyArg_ParseTuple(args, "OOOnOOOOOOO(OOOO)O!OOOOOOiOO:run", &data_obj, &lens_obj, &ingress_obj, &n,
                          &job_row_obj, &elems_obj, &pool_obj, &quorum_obj, &nw_obj, &keys_obj, &policy_obj, &role_obj,
                          &uplink_obj, &leaf_obj, &local_obj, &PyList_Type,
                          &slot_list, &counters_obj, &wrx_obj, &rows_obj, &olens_obj, &oegress_obj, &oindex_obj,
                          &spared, &peek, &commit))
        return NULL;
    if (!K.ready) {
        PyErr_SetString(PyExc_RuntimeError, "softswitch._swcore.configure() was not called");
        return NULL;
    }
    if (PyList_GET_SIZE(slot_list) < K.max_jobs) {
        PyErr_SetString(PyExc_ValueError, "slots: one entry per job id needed");
        return NULL;
    }
    buf_t data = {0}, lens = {0}, ingress = {0}, job_row = {0}, elems = {0}, pool = {0}, quorum = {0}, nw = {0},
          keys = {0}, policy = {0}, role = {0}, uplink = {0}, leaf_id = {0}, local = {0}, counters = {0}, wrx = {0}, rows = {0}, olens = {0}, oegress = {0},
          oindex = {0};
    PyObject *result = NULL;
    Py_ssize_t jobs_bytes = (Py_ssize_t)K.max_jobs * 8;
    run_t R;
    memset(&R, 0, sizeof(R));
    /* Work tables: the module's own, allocated once; a call made while another is inside a drop-stream
     * callback (another switch, another thread) gets fresh ones. */
    int own = work_busy;
    work_t mine = work;
    if (own && alloc_work(&mine) < 0)
        return NULL;
    work_busy = 1;
    slots_t *slots = mine.slots;
    stream_t *streams = mine.streams;
    Py_ssize_t *used_list = mine.used_list;

    /* data: a 2-D byte array with contiguous rows */
    if (PyObject_GetBuffer(data_obj, &data.view, PyBUF_STRIDES) < 0)
        goto done;
    data.held = 1;
    if (data.view.ndim != 2 || data.view.itemsize != 1 || (data.view.shape[1] > 1 && data.view.strides[1] != 1) ||
        n < 0 || n > data.view.shape[0]) {
        PyErr_SetString(PyExc_ValueError, "data must be (cap, width) bytes with contiguous rows and >= n rows");
        goto done;
    }
    if (get_buf(lens_obj, &lens, 0, n * 8, "lens") < 0 || get_buf(ingress_obj, &ingress, 0, n * 8, "ingress") < 0 ||
        get_buf(job_row_obj, &job_row, 0, 65536 * 8, "job_row") < 0 ||
        get_buf(elems_obj, &elems, 0, jobs_bytes, "elems") < 0 || get_buf(pool_obj, &pool, 0, jobs_bytes, "pool") < 0 ||
        get_buf(quorum_obj, &quorum, 0, jobs_bytes, "quorum") < 0 ||
        get_buf(nw_obj, &nw, 0, jobs_bytes, "nworkers") < 0 ||
        get_buf(keys_obj, &keys, 0, jobs_bytes * KEYS_PER_JOB, "keys") < 0 ||
        get_buf(policy_obj, &policy, 0, jobs_bytes, "policy") < 0 ||
        get_buf(role_obj, &role, 0, jobs_bytes, "role") < 0 || get_buf(uplink_obj, &uplink, 0, jobs_bytes, "uplink") < 0 ||
        get_buf(leaf_obj, &leaf_id, 0, jobs_bytes, "leaf_id") < 0 || get_buf(local_obj, &local, 0, jobs_bytes, "local") < 0 ||
        get_buf(counters_obj, &counters, 1, jobs_bytes * K.ncounters, "counters") < 0 ||
        get_buf(wrx_obj, &wrx, 1, jobs_bytes * K.max_workers, "worker_rx") < 0 ||
        get_buf(olens_obj, &olens, 1, 0, "out_lens") < 0 || get_buf(oegress_obj, &oegress, 1, 0, "out_egress") < 0 ||
        get_buf(oindex_obj, &oindex, 1, 0, "out_index") < 0)
        goto done;
    if (PyObject_GetBuffer(rows_obj, &rows.view, PyBUF_STRIDES | PyBUF_WRITABLE) < 0)
        goto done;
    rows.held = 1;
    if (rows.view.ndim != 2 || rows.view.itemsize != 1 || (rows.view.shape[1] > 1 && rows.view.strides[1] != 1)) {
        PyErr_SetString(PyExc_ValueError, "out_rows must be (cap, width) bytes with contiguous rows");
        goto done;
    }

    R.data = data.view.buf;
    R.width = data.view.shape[1];
    R.stride = data.view.strides[0];
    R.lens = lens.view.buf;
    R.ingress = ingress.view.buf;
    R.job_row = job_row.view.buf;
    R.elems = elems.view.buf;
    R.pool = pool.view.buf;
    R.quorum = quorum.view.buf;
    R.nworkers = nw.view.buf;
    R.keys = keys.view.buf;
    R.policy = policy.view.buf;
    R.role = role.view.buf;
    R.uplink = uplink.view.buf;
    R.leaf_id = leaf_id.view.buf;
    R.local = local.view.buf;
    R.counters = counters.view.buf;
    R.worker_rx = wrx.view.buf;
    R.slot_list = slot_list;
    R.slots = slots;
    R.spared = spared;
    R.peek = peek;
    R.commit = commit;
    R.n = n;
    R.out_rows = rows.view.buf;
    R.out_width = rows.view.shape[1];
    R.out_stride = rows.view.strides[0];
    R.rows_cap = rows.view.shape[0];
    R.out_lens = olens.view.buf;
    R.out_egress = oegress.view.buf;
    R.out_index = oindex.view.buf;
    R.rep_cap = olens.view.len / 8;
    if (oegress.view.len / 8 < R.rep_cap)
        R.rep_cap = oegress.view.len / 8;
    if (oindex.view.len / 8 < R.rep_cap)
        R.rep_cap = oindex.view.len / 8;
    R.streams = streams;
    R.used_list = used_list;
    for (Py_ssize_t j = 1; j < K.max_jobs; j++) {
        int64_t e = R.elems[j], w = R.nworkers[j];
        if (e < 0 || w < 0 || w > K.max_workers) {
            PyErr_SetString(PyExc_ValueError, "job tables out of range");
            goto done;
        }
    }

    int failed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (one_packet(&R, i) < 0) {
            failed = 1;
            break;
        }
    }
    if (finish_streams(&R, !failed) < 0 || failed)
        goto done;
    result = Py_BuildValue("(nn)", R.m, R.rows_used);

done:
    if (R.streams != NULL && PyErr_Occurred()) {
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        finish_streams(&R, 0);
        PyErr_Restore(t, v, tb);
    }
    for (int j = 0; j < K.max_jobs; j++) {
        if (slots[j].state) {
            rel(&slots[j].regs);
            rel(&slots[j].bitmap);
            rel(&slots[j].acc);
            slots[j].state = 0;
        }
    }
    if (own)
        free_work(&mine);
    else
        work_busy = 0;
    buf_t *all[] = {&data, &lens, &ingress, &job_row, &elems, &pool, &quorum, &nw, &keys, &policy, &role, &uplink,
                    &leaf_id, &local, &counters, &wrx,
                    &rows, &olens, &oegress, &oindex};
    for (size_t j = 0; j < sizeof(all) / sizeof(all[0]); j++)
        rel(all[j]);
    return result;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(field_offsets, field_sizes, header_bytes, version, max_jobs, max_workers, ncounters, nregs,\n"
     "          ops, roles, valid_ops, flags, registers, counters): the protocol's constants (softswitch/batch.py)"},
    {"run", run, METH_VARARGS,
     "run(data, lens, ingress, n, job_row, elems, pool, quorum, nworkers, keys, policy,\n"
     "    (role, uplink, leaf_id, local), slots, counters,\n"
     "    worker_rx, out_rows, out_lens, out_egress, out_index, spared, peek, commit) -> (replicas, rows)\n\n"
     "Run n packets through the switch contract in arrival order (see the module comment)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "softswitch._swcore", "The switch contract over a batch of packets, in C.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__swcore(void) {
    if (alloc_work(&work) < 0)
        return NULL;
    return PyModule_Create(&module);
}
