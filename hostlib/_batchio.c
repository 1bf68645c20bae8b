/*
 * hostlib._batchio: batched UDP datagram I/O over Linux recvmmsg(2) / sendmmsg(2).
 *
 * The Python side (hostlib/batchio.py) owns every buffer; these two functions only point the kernel's
 * message headers at rows of those buffers and run the system calls with the GIL released.
 *
 *   recv_batch(fd, data, lens_out, keys_out, max_n, timeout_ms, stats, scratch) -> n
 *   send_batch(fd, data, lens, keys, n, stall_ms, stats[, index]) -> sent
 *   scratch_bytes(n) -> size of a recv scratch buffer for n rows
 *
 * data is a 2-D buffer of bytes whose rows are contiguous (strides[1] == 1); its row stride may be
 * anything, so a row-strided view of a larger buffer works without a copy. Address keys are
 * (IPv4 address as a host-order u32 << 16) | port, as hostlib.batchio.addr_key builds them.
 * stats is None or a writable int64 buffer of at least STAT_COUNT counters (see the enum below), to
 * which each call adds what it did. scratch is a writable byte buffer of scratch_bytes(rows) that keeps
 * the receive headers between calls (they point into data): a call then only touches the headers of the
 * datagrams it receives. One scratch serves one data buffer and one call at a time.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#ifndef __linux__
#error "hostlib._batchio needs Linux (recvmmsg/sendmmsg); hostlib.batchio falls back without it"
#endif

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

/* The kernel clamps vlen to UIO_MAXIOV (1024) for both calls. */
#define MAX_VLEN 1024
#define MAX_REFUSED_RETRIES 64
#define ENOBUFS_SLEEP_NS 100000L /* ENOBUFS: the device queue is full; POLLOUT would not wait */
#define POLLOUT_SLICE_MS 100

enum {
    STAT_SYSCALLS_SEND,
    STAT_SYSCALLS_RECV,
    STAT_PACKETS_SENT,
    STAT_PACKETS_RECEIVED,
    STAT_SEND_ERRORS,
    STAT_RECV_TRUNCATED,
    STAT_SEND_WAITS,
    STAT_COUNT
};

/* One message slot: kept together so a single allocation serves a whole call. */
typedef struct {
    struct iovec iov;
    struct sockaddr_in addr;
} slot_t;

/* ---------------------------------------------------------------------------------------------- */
/* Argument helpers                                                                               */
/* ---------------------------------------------------------------------------------------------- */

/* A 2-D byte buffer with contiguous rows. */
static int get_rows(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t *rows, Py_ssize_t *width,
                    Py_ssize_t *stride) {
    if (PyObject_GetBuffer(obj, view, PyBUF_STRIDES | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->ndim != 2 || view->itemsize != 1 || (view->shape[1] > 1 && view->strides[1] != 1)) {
        PyErr_SetString(PyExc_ValueError, "data must be a 2-D byte buffer with contiguous rows");
        PyBuffer_Release(view);
        return -1;
    }
    *rows = view->shape[0];
    *width = view->shape[1];
    *stride = view->strides[0];
    return 0;
}

/* A contiguous 1-D buffer of 4- or 8-byte integers. */
static int get_ints(PyObject *obj, Py_buffer *view, int writable, int allow_int32, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    const char *fmt = view->format ? view->format : "B";
    char code = fmt[strlen(fmt) > 0 ? strlen(fmt) - 1 : 0];
    int is_int = code == 'q' || code == 'Q' || code == 'l' || code == 'L' || code == 'i' || code == 'I';
    if (!is_int || !(view->itemsize == 8 || (allow_int32 && view->itemsize == 4))) {
        PyErr_Format(PyExc_ValueError, "%s must be a contiguous int64%s array", what,
                     allow_int32 ? " or int32" : "");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static inline int64_t int_at(const Py_buffer *v, Py_ssize_t i) {
    if (v->itemsize == 4)
        return ((const int32_t *)v->buf)[i];
    return ((const int64_t *)v->buf)[i];
}

static int add_stats(PyObject *stats, const int64_t *delta) {
    if (stats == Py_None)
        return 0;
    Py_buffer v;
    if (PyObject_GetBuffer(stats, &v, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return -1;
    if (v.len < (Py_ssize_t)(STAT_COUNT * sizeof(int64_t))) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_ValueError, "stats buffer is too small");
        return -1;
    }
    int64_t *s = (int64_t *)v.buf;
    for (int i = 0; i < STAT_COUNT; i++)
        s[i] += delta[i];
    PyBuffer_Release(&v);
    return 0;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Errors that doom one datagram (its destination, its size, a filter) but not the socket. */
static int skip_errno(int err) {
    switch (err) {
    case ECONNREFUSED:
    case EHOSTUNREACH:
    case ENETUNREACH:
    case EHOSTDOWN:
    case ENETDOWN:
    case EMSGSIZE:
    case EPERM:
    case EACCES:
    case EADDRNOTAVAIL:
        return 1;
    default:
        return 0;
    }
}

/* Errors that mean "no room now": wait for the socket (or the device queue) to drain. */
static int room_errno(int err) { return err == EAGAIN || err == EWOULDBLOCK || err == ENOBUFS || err == ENOMEM; }

/* The start of a recv scratch buffer: for which rows its headers were built, and how many. */
typedef struct {
    char *base;
    Py_ssize_t stride;
    Py_ssize_t width;
    Py_ssize_t rows;
    Py_ssize_t ready; /* headers 0..ready-1 point at rows 0..ready-1 of (base, stride, width, rows) */
} scratch_head_t;

#define ALIGN_UP(x) (((x) + 63) & ~(size_t)63)

static size_t scratch_size(Py_ssize_t n) {
    return ALIGN_UP(sizeof(scratch_head_t)) + ALIGN_UP((size_t)n * sizeof(struct mmsghdr)) +
           (size_t)n * sizeof(slot_t);
}

static PyObject *scratch_bytes(PyObject *self, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0 || (size_t)n > ((size_t)PY_SSIZE_T_MAX - 256) / (sizeof(struct mmsghdr) + sizeof(slot_t))) {
        PyErr_SetString(PyExc_ValueError, "row count out of range");
        return NULL;
    }
    return PyLong_FromSize_t(scratch_size(n));
}

/* ---------------------------------------------------------------------------------------------- */
/* recv_batch                                                                                     */
/* ---------------------------------------------------------------------------------------------- */

static PyObject *recv_batch(PyObject *self, PyObject *args) {
    int fd, timeout_ms;
    Py_ssize_t max_n;
    PyObject *data_obj, *lens_obj, *keys_obj, *stats_obj, *scratch_obj;
    if (!PyArg_ParseTuple(args, "iOOOniOO:recv_batch", &fd, &data_obj, &lens_obj, &keys_obj, &max_n, &timeout_ms,
                          &stats_obj, &scratch_obj))
        return NULL;

    Py_buffer data, lens, keys, scratch;
    Py_ssize_t rows, width, stride;
    if (get_rows(data_obj, &data, 1, &rows, &width, &stride) < 0)
        return NULL;
    if (get_ints(lens_obj, &lens, 1, 1, "lens_out") < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    if (get_ints(keys_obj, &keys, 1, 0, "keys_out") < 0) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&lens);
        return NULL;
    }
    if (PyObject_GetBuffer(scratch_obj, &scratch, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&lens);
        PyBuffer_Release(&keys);
        return NULL;
    }
    Py_ssize_t cap = max_n;
    if (cap > rows)
        cap = rows;
    if (cap > lens.len / lens.itemsize)
        cap = lens.len / lens.itemsize;
    if (cap > keys.len / keys.itemsize)
        cap = keys.len / keys.itemsize;
    if (cap < 0)
        cap = 0;
    if (width > UINT32_MAX)
        width = UINT32_MAX;
    /* The layout follows the data buffer's row count, so that it stays put whatever max_n is. */
    if ((size_t)scratch.len < scratch_size(rows) || ((uintptr_t)scratch.buf & 7) != 0) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&lens);
        PyBuffer_Release(&keys);
        PyBuffer_Release(&scratch);
        PyErr_SetString(PyExc_ValueError, "scratch buffer is too small (see scratch_bytes) or misaligned");
        return NULL;
    }

    scratch_head_t *head = (scratch_head_t *)scratch.buf;
    struct mmsghdr *msgs = (struct mmsghdr *)((char *)scratch.buf + ALIGN_UP(sizeof(scratch_head_t)));
    slot_t *slots = (slot_t *)((char *)msgs + ALIGN_UP((size_t)rows * sizeof(struct mmsghdr)));
    char *base = (char *)data.buf;
    if (head->base != base || head->stride != stride || head->width != width || head->rows != rows ||
        head->ready < 0 || head->ready > rows) {
        head->base = base;
        head->stride = stride;
        head->width = width;
        head->rows = rows;
        head->ready = 0;
    }

    int64_t st[STAT_COUNT] = {0};
    Py_ssize_t total = 0;
    int err = 0, eintr = 0, polled = 0, refused = 0;
    int64_t *keys_out = (int64_t *)keys.buf;

    Py_BEGIN_ALLOW_THREADS
    while (total < cap) {
        Py_ssize_t chunk = cap - total < MAX_VLEN ? cap - total : MAX_VLEN;
        for (Py_ssize_t i = head->ready; i < total + chunk; i++) {
            slots[i].iov.iov_base = base + i * stride;
            slots[i].iov.iov_len = (size_t)width;
            struct msghdr *h = &msgs[i].msg_hdr;
            memset(h, 0, sizeof(*h));
            h->msg_name = &slots[i].addr;
            h->msg_namelen = sizeof(slots[i].addr);
            h->msg_iov = &slots[i].iov;
            h->msg_iovlen = 1;
        }
        if (head->ready < total + chunk)
            head->ready = total + chunk;
        int r = recvmmsg(fd, msgs + total, (unsigned int)chunk, MSG_DONTWAIT, NULL);
        st[STAT_SYSCALLS_RECV]++;
        if (r > 0) {
            for (Py_ssize_t row = total; row < total + r; row++) {
                if (lens.itemsize == 4)
                    ((int32_t *)lens.buf)[row] = (int32_t)msgs[row].msg_len;
                else
                    ((int64_t *)lens.buf)[row] = (int64_t)msgs[row].msg_len;
                if (msgs[row].msg_hdr.msg_flags & MSG_TRUNC)
                    st[STAT_RECV_TRUNCATED]++;
                const struct sockaddr_in *a = &slots[row].addr;
                if (msgs[row].msg_hdr.msg_namelen >= sizeof(*a) && a->sin_family == AF_INET)
                    keys_out[row] = ((int64_t)ntohl(a->sin_addr.s_addr) << 16) | (int64_t)ntohs(a->sin_port);
                else
                    keys_out[row] = -1;
                msgs[row].msg_hdr.msg_namelen = sizeof(*a); /* the kernel wrote the source's length */
            }
            total += r;
            if (r < chunk)
                break; /* the queue ran dry */
            continue;
        }
        int e = r == 0 ? EAGAIN : errno;
        if (e == ECONNREFUSED && refused < MAX_REFUSED_RETRIES) {
            refused++; /* an ICMP port-unreachable for an earlier send: not about this receive */
            continue;
        }
        if (e == EAGAIN || e == EWOULDBLOCK || e == ECONNREFUSED) {
            if (total == 0 && timeout_ms != 0 && !polled) {
                struct pollfd p = {.fd = fd, .events = POLLIN, .revents = 0};
                polled = 1;
                int pr = poll(&p, 1, timeout_ms);
                if (pr > 0)
                    continue;
                if (pr < 0 && errno == EINTR)
                    eintr = 1;
                else if (pr < 0)
                    err = errno;
            }
            break;
        }
        if (e == EINTR) {
            eintr = 1;
            break;
        }
        if (total == 0)
            err = e; /* after some datagrams the kernel reports it again on the next call */
        break;
    }
    Py_END_ALLOW_THREADS

    PyBuffer_Release(&data);
    PyBuffer_Release(&lens);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&scratch);

    st[STAT_PACKETS_RECEIVED] = total;
    if (add_stats(stats_obj, st) < 0)
        return NULL;
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (eintr && total == 0 && PyErr_CheckSignals() < 0)
        return NULL;
    return PyLong_FromSsize_t(total);
}

/* ---------------------------------------------------------------------------------------------- */
/* send_batch                                                                                     */
/* ---------------------------------------------------------------------------------------------- */

typedef struct {
    int is_scalar;
    int64_t scalar;
    Py_buffer view; /* valid when !is_scalar */
    int held;
} ints_arg;

static int get_ints_arg(PyObject *obj, ints_arg *a, Py_ssize_t n, int allow_int32, const char *what) {
    a->held = 0;
    if (PyLong_Check(obj)) {
        a->is_scalar = 1;
        a->scalar = PyLong_AsLongLong(obj);
        if (a->scalar == -1 && PyErr_Occurred())
            return -1;
        return 0;
    }
    a->is_scalar = 0;
    if (get_ints(obj, &a->view, 0, allow_int32, what) < 0)
        return -1;
    a->held = 1;
    Py_ssize_t count = a->view.len / a->view.itemsize;
    if (count == 1) {
        a->is_scalar = 1;
        a->scalar = int_at(&a->view, 0);
    } else if (count < n) {
        PyErr_Format(PyExc_ValueError, "%s has %zd entries for %zd datagrams", what, count, n);
        return -1;
    }
    return 0;
}

static void release_ints_arg(ints_arg *a) {
    if (a->held)
        PyBuffer_Release(&a->view);
    a->held = 0;
}

static inline int64_t ints_arg_at(const ints_arg *a, Py_ssize_t i) {
    return a->is_scalar ? a->scalar : int_at(&a->view, i);
}

static PyObject *send_batch(PyObject *self, PyObject *args) {
    int fd;
    Py_ssize_t n;
    double stall_ms;
    PyObject *data_obj, *lens_obj, *keys_obj, *stats_obj, *index_obj = Py_None;
    if (!PyArg_ParseTuple(args, "iOOOndO|O:send_batch", &fd, &data_obj, &lens_obj, &keys_obj, &n, &stall_ms,
                          &stats_obj, &index_obj))
        return NULL;

    Py_buffer data;
    Py_ssize_t rows, width, stride;
    ints_arg lens, keys, index;
    index.held = 0;
    index.is_scalar = 0;
    int has_index = index_obj != Py_None;
    if (get_rows(data_obj, &data, 0, &rows, &width, &stride) < 0)
        return NULL;
    if (get_ints_arg(lens_obj, &lens, n, 1, "lens") < 0) {
        release_ints_arg(&lens);
        PyBuffer_Release(&data);
        return NULL;
    }
    if (get_ints_arg(keys_obj, &keys, n, 0, "keys") < 0) {
        release_ints_arg(&keys);
        release_ints_arg(&lens);
        PyBuffer_Release(&data);
        return NULL;
    }
    if (has_index && get_ints_arg(index_obj, &index, n, 0, "index") < 0) {
        release_ints_arg(&index);
        release_ints_arg(&keys);
        release_ints_arg(&lens);
        PyBuffer_Release(&data);
        return NULL;
    }

    PyObject *result = NULL;
    struct mmsghdr *msgs = NULL;
    slot_t *slots = NULL;
    if (n < 0 || (!has_index && n > rows)) {
        PyErr_Format(PyExc_ValueError, "n=%zd but data has %zd rows", n, rows);
        goto done;
    }
    /* Validate everything before anything is sent: the kernel must never read outside a row. */
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t len = ints_arg_at(&lens, i), key = ints_arg_at(&keys, i);
        if (len < 0 || len > width) {
            PyErr_Format(PyExc_ValueError, "row %zd: length %lld outside 0..%zd", i, (long long)len, width);
            goto done;
        }
        if (key < 0 || key >= ((int64_t)1 << 48)) {
            PyErr_Format(PyExc_ValueError, "row %zd: address key %lld is not an IPv4 (host, port) key", i,
                         (long long)key);
            goto done;
        }
        if (has_index) {
            int64_t row = ints_arg_at(&index, i);
            if (row < 0 || row >= rows) {
                PyErr_Format(PyExc_ValueError, "datagram %zd: row %lld outside 0..%zd", i, (long long)row,
                             rows - 1);
                goto done;
            }
        }
        if (lens.is_scalar && keys.is_scalar && (!has_index || index.is_scalar))
            break;
    }
    if (n == 0) {
        result = PyLong_FromLong(0);
        goto done;
    }

    Py_ssize_t vlen = n < MAX_VLEN ? n : MAX_VLEN;
    msgs = PyMem_Calloc((size_t)vlen, sizeof(*msgs));
    slots = PyMem_Calloc((size_t)vlen, sizeof(*slots));
    if (msgs == NULL || slots == NULL) {
        PyErr_NoMemory();
        goto done;
    }

    int64_t st[STAT_COUNT] = {0};
    Py_ssize_t off = 0, chunk_start = 0, chunk_end = 0;
    int err = 0, stalled = 0, interrupted = 0;
    const char *base = (const char *)data.buf;
    double stall_s = stall_ms / 1000.0;

    Py_BEGIN_ALLOW_THREADS
    double last_progress = now_s();
    while (off < n) {
        if (off >= chunk_end) {
            chunk_start = off;
            chunk_end = n - off < vlen ? n : off + vlen;
            for (Py_ssize_t i = chunk_start; i < chunk_end; i++) {
                slot_t *s = &slots[i - chunk_start];
                int64_t key = ints_arg_at(&keys, i);
                Py_ssize_t row = has_index ? (Py_ssize_t)ints_arg_at(&index, i) : i;
                s->iov.iov_base = (void *)(base + row * stride);
                s->iov.iov_len = (size_t)ints_arg_at(&lens, i);
                s->addr.sin_family = AF_INET;
                s->addr.sin_port = htons((uint16_t)(key & 0xFFFF));
                s->addr.sin_addr.s_addr = htonl((uint32_t)(key >> 16));
                struct msghdr *h = &msgs[i - chunk_start].msg_hdr;
                h->msg_name = &s->addr;
                h->msg_namelen = sizeof(s->addr);
                h->msg_iov = &s->iov;
                h->msg_iovlen = 1;
            }
        }
        int r = sendmmsg(fd, msgs + (off - chunk_start), (unsigned int)(chunk_end - off), MSG_DONTWAIT);
        st[STAT_SYSCALLS_SEND]++;
        if (r > 0) {
            off += r;
            st[STAT_PACKETS_SENT] += r;
            stalled = 0;
            last_progress = now_s();
            continue;
        }
        int e = r == 0 ? EAGAIN : errno;
        if (e == EINTR) {
            Py_BLOCK_THREADS
            int sig = PyErr_CheckSignals();
            Py_UNBLOCK_THREADS
            if (sig < 0) {
                interrupted = 1;
                break;
            }
            continue;
        }
        if (skip_errno(e)) {
            st[STAT_SEND_ERRORS]++;
            off++;
            continue;
        }
        if (room_errno(e)) {
            double left = last_progress + stall_s - now_s();
            if (stalled || left <= 0) {
                /* No room for stall_ms: give this datagram up; until something goes out again, the
                 * rest get one try each, so a dead socket costs one stall per call, not per datagram. */
                st[STAT_SEND_ERRORS]++;
                off++;
                stalled = 1;
                continue;
            }
            st[STAT_SEND_WAITS]++;
            if (e == EAGAIN || e == EWOULDBLOCK) {
                int slice = (int)(left * 1000.0) + 1;
                if (slice > POLLOUT_SLICE_MS)
                    slice = POLLOUT_SLICE_MS;
                struct pollfd p = {.fd = fd, .events = POLLOUT, .revents = 0};
                (void)poll(&p, 1, slice);
            } else {
                struct timespec ts = {0, ENOBUFS_SLEEP_NS};
                nanosleep(&ts, NULL);
            }
            continue;
        }
        err = e;
        break;
    }
    Py_END_ALLOW_THREADS

    if (interrupted) { /* the signal handler's exception is set: keep it while the counters are added */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (add_stats(stats_obj, st) < 0)
            PyErr_Clear();
        PyErr_Restore(type, value, tb);
        goto done;
    }
    if (add_stats(stats_obj, st) < 0)
        goto done;
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = PyLong_FromSsize_t((Py_ssize_t)st[STAT_PACKETS_SENT]);

done:
    PyMem_Free(msgs);
    PyMem_Free(slots);
    release_ints_arg(&index);
    release_ints_arg(&keys);
    release_ints_arg(&lens);
    PyBuffer_Release(&data);
    return result;
}

/* ---------------------------------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    {"recv_batch", recv_batch, METH_VARARGS,
     "recv_batch(fd, data, lens_out, keys_out, max_n, timeout_ms, stats, scratch) -> n\n\n"
     "Receive up to max_n queued datagrams into rows of data (recvmmsg, MSG_DONTWAIT). If none is queued\n"
     "and timeout_ms != 0, poll once for up to timeout_ms (-1: no limit) and try again. Writes each\n"
     "datagram's length and source address key. ECONNREFUSED is skipped. Returns the count (may be 0)."},
    {"send_batch", send_batch, METH_VARARGS,
     "send_batch(fd, data, lens, keys, n, stall_ms, stats[, index]) -> sent\n\n"
     "Send n datagrams (sendmmsg): datagram i is row index[i] of data (row i without index; rows may\n"
     "repeat: replicas need no copies); lens and keys are int arrays or one int for every row. No room\n"
     "(EAGAIN/ENOBUFS) is waited out for up to stall_ms without progress, then the datagram is given up;\n"
     "per-datagram errors (unreachable, too big) count as send errors. Returns the number sent."},
    {"scratch_bytes", scratch_bytes, METH_O, "scratch_bytes(n) -> bytes of a recv scratch buffer for n rows"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "hostlib._batchio", "Batched UDP I/O over recvmmsg/sendmmsg (Linux).", -1, methods,
};

PyMODINIT_FUNC PyInit__batchio(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "STAT_COUNT", STAT_COUNT) < 0 ||
        PyModule_AddIntConstant(m, "MAX_VLEN", MAX_VLEN) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
