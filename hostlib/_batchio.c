/*
 * hostlib._batchio: batched UDP datagram I/O over Linux recvmmsg(2) / sendmmsg(2).
 *
 * The Python side (hostlib/batchio.py) owns every buffer; these two functions only point the kernel's
 * message headers at rows of those buffers and run the system calls with the GIL released.
 *
 *   recv_batch(fd, data, lens_out, keys_out, max_n, timeout_ms, stats, scratch) -> n
 *   send_batch(fd, data, lens, keys, n, stall_ms, stats[, index]) -> sent
 *   scratch_bytes(n) -> size of a recv scratch buffer for n rows
 *   send_gso(fd, data, lens, keys, n, stall_ms, stats, index, max_segs[, trains]) -> (sent, refused_errno)
 *   recv_gro(fd, data, lens_out, keys_out, max_n, timeout_ms, stats, staging) -> n
 *   gro_staging_bytes(messages) -> size of a GRO staging buffer
 *
 * send_gso and recv_gro are the segmentation-offload paths (UDP_SEGMENT / UDP_GRO, Linux >= 5.0): equal-size
 * datagrams to one destination leave as one GSO message (the kernel, or the NIC, cuts it into datagrams),
 * and the kernel hands over a train of equal-size datagrams from one source as one coalesced buffer with
 * its segment size in a control message; recv_gro cuts it back into rows. The bytes, lengths, sources and
 * per-destination order are those of send_batch / recv_batch.
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
#include <netinet/udp.h>
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
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif
#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#define GSO_MAX_BYTES 65507 /* a GSO message is one IPv4 datagram before segmentation: 65535 - 20 - 8 */
#define GRO_BUF_BYTES 65536 /* a coalesced receive never exceeds one 64 KiB skb */
#define GRO_MAX_MSGS 1024

enum {
    STAT_SYSCALLS_SEND,
    STAT_SYSCALLS_RECV,
    STAT_PACKETS_SENT,
    STAT_PACKETS_RECEIVED,
    STAT_SEND_ERRORS,
    STAT_RECV_TRUNCATED,
    STAT_SEND_WAITS,
    STAT_GSO_TRAINS_SENT,     /* GSO messages of 2 or more datagrams sent */
    STAT_GRO_TRAINS_RECEIVED, /* coalesced buffers of 2 or more datagrams received */
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

/* Checks n datagrams before anything is sent: a count the rows hold (without index), lengths inside a row,
 * address keys, and rows of index inside data. -1 with ValueError set when one is off. */
static int check_datagrams(Py_ssize_t n, Py_ssize_t rows, Py_ssize_t width, const ints_arg *lens,
                           const ints_arg *keys, const ints_arg *index) {
    if (n < 0 || (index == NULL && n > rows)) {
        PyErr_Format(PyExc_ValueError, "n=%zd but data has %zd rows", n, rows);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t len = ints_arg_at(lens, i), key = ints_arg_at(keys, i);
        if (len < 0 || len > width) {
            PyErr_Format(PyExc_ValueError, "row %zd: length %lld outside 0..%zd", i, (long long)len, width);
            return -1;
        }
        if (key < 0 || key >= ((int64_t)1 << 48)) {
            PyErr_Format(PyExc_ValueError, "row %zd: address key %lld is not an IPv4 (host, port) key", i,
                         (long long)key);
            return -1;
        }
        if (index != NULL) {
            int64_t row = ints_arg_at(index, i);
            if (row < 0 || row >= rows) {
                PyErr_Format(PyExc_ValueError, "datagram %zd: row %lld outside 0..%zd", i, (long long)row,
                             rows - 1);
                return -1;
            }
        }
        if (lens->is_scalar && keys->is_scalar && (index == NULL || index->is_scalar))
            break; /* every datagram is the same: one check covers them all */
    }
    return 0;
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
    /* Validate everything before anything is sent: the kernel must never read outside a row. */
    if (check_datagrams(n, rows, width, &lens, &keys, has_index ? &index : NULL) < 0)
        goto done;
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
/* send_gso                                                                                       */
/* ---------------------------------------------------------------------------------------------- */

/* One GSO message: `segs` datagrams of `seg` bytes (the last may be shorter) to one address. */
typedef struct {
    struct sockaddr_in addr;
    union {
        char buf[CMSG_SPACE(sizeof(uint16_t))];
        struct cmsghdr align;
    } ctl;
    Py_ssize_t segs;
} gso_msg_t;

/* Stable grouping of datagrams by destination: order[] lists datagram numbers destination by destination,
 * each destination's in their original order. A small open-addressing table maps keys to groups. */
static int group_by_key(const ints_arg *keys, Py_ssize_t n, Py_ssize_t *order) {
    if (keys->is_scalar) {
        for (Py_ssize_t i = 0; i < n; i++)
            order[i] = i;
        return 0;
    }
    Py_ssize_t cap = 16;
    while (cap < 2 * n)
        cap <<= 1;
    int64_t *tkey = PyMem_Malloc((size_t)cap * sizeof(int64_t));
    Py_ssize_t *tgroup = PyMem_Malloc((size_t)cap * sizeof(Py_ssize_t));
    Py_ssize_t *group_of = PyMem_Malloc((size_t)n * sizeof(Py_ssize_t));
    Py_ssize_t *start = PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));
    if (!tkey || !tgroup || !group_of || !start) {
        PyMem_Free(tkey);
        PyMem_Free(tgroup);
        PyMem_Free(group_of);
        PyMem_Free(start);
        return -1;
    }
    for (Py_ssize_t j = 0; j < cap; j++)
        tgroup[j] = -1;
    Py_ssize_t groups = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t k = int_at(&keys->view, i);
        uint64_t h = ((uint64_t)k * 0x9E3779B97F4A7C15ull) >> 20;
        Py_ssize_t j = (Py_ssize_t)(h & (uint64_t)(cap - 1));
        while (tgroup[j] >= 0 && tkey[j] != k)
            j = (j + 1) & (cap - 1);
        if (tgroup[j] < 0) {
            tgroup[j] = groups++;
            tkey[j] = k;
        }
        group_of[i] = tgroup[j];
        start[tgroup[j] + 1]++;
    }
    for (Py_ssize_t g = 0; g < groups; g++)
        start[g + 1] += start[g];
    for (Py_ssize_t i = 0; i < n; i++)
        order[start[group_of[i]]++] = i;
    PyMem_Free(tkey);
    PyMem_Free(tgroup);
    PyMem_Free(group_of);
    PyMem_Free(start);
    return 0;
}

static PyObject *send_gso(PyObject *self, PyObject *args) {
    int fd, max_segs;
    Py_ssize_t n;
    double stall_ms;
    PyObject *data_obj, *lens_obj, *keys_obj, *stats_obj, *index_obj, *trains_obj = Py_None;
    if (!PyArg_ParseTuple(args, "iOOOndOOi|O:send_gso", &fd, &data_obj, &lens_obj, &keys_obj, &n, &stall_ms,
                          &stats_obj, &index_obj, &max_segs, &trains_obj))
        return NULL;
    if (max_segs < 1)
        max_segs = 1;

    Py_buffer data;
    Py_ssize_t rows, width, stride;
    ints_arg lens, keys, index, trains;
    index.held = trains.held = 0;
    index.is_scalar = trains.is_scalar = 0;
    int has_index = index_obj != Py_None, has_trains = trains_obj != Py_None;
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
    if (has_trains && get_ints_arg(trains_obj, &trains, n, 0, "trains") < 0) {
        release_ints_arg(&trains);
        release_ints_arg(&index);
        release_ints_arg(&keys);
        release_ints_arg(&lens);
        PyBuffer_Release(&data);
        return NULL;
    }

    PyObject *result = NULL;
    Py_ssize_t *order = NULL;
    struct mmsghdr *msgs = NULL;
    gso_msg_t *gm = NULL;
    struct iovec *iov = NULL;
    /* Validate everything before anything is sent: the kernel must never read outside a row. */
    if (check_datagrams(n, rows, width, &lens, &keys, has_index ? &index : NULL) < 0)
        goto done;
    if (n == 0) {
        result = Py_BuildValue("(ni)", (Py_ssize_t)0, 0);
        goto done;
    }

    order = PyMem_Malloc((size_t)n * sizeof(Py_ssize_t));
    msgs = PyMem_Calloc((size_t)n, sizeof(*msgs));
    gm = PyMem_Calloc((size_t)n, sizeof(*gm));
    iov = PyMem_Calloc((size_t)n, sizeof(*iov));
    if (!order || !msgs || !gm || !iov || group_by_key(&keys, n, order) < 0) {
        PyErr_NoMemory();
        goto done;
    }

    const char *base = (const char *)data.buf;
    int64_t st[STAT_COUNT] = {0};
    int err = 0, interrupted = 0, refused = 0, stalled = 0, retried = 0;
    double stall_s = stall_ms / 1000.0;

    Py_BEGIN_ALLOW_THREADS
    /* Datagrams pos..n-1 (in `order`) are still to go; msgs[0..nm-1] is the current set of messages. */
    Py_ssize_t pos = 0;
    double last_progress = now_s();
    while (pos < n && !err && !interrupted) {
        /* Build messages from pos on: runs of one destination and one length, up to max_segs datagrams and
         * GSO_MAX_BYTES bytes each; after the kernel refused GSO, one datagram per message. */
        Py_ssize_t nm = 0, p = pos;
        int limit = refused ? 1 : max_segs;
        while (p < n && nm < MAX_VLEN) {
            Py_ssize_t d = order[p];
            int64_t key = ints_arg_at(&keys, d);
            Py_ssize_t seg = (Py_ssize_t)ints_arg_at(&lens, d);
            Py_ssize_t cap_segs = limit;
            if (seg > 0 && GSO_MAX_BYTES / seg < cap_segs)
                cap_segs = GSO_MAX_BYTES / seg;
            if (cap_segs < 1 || seg == 0)
                cap_segs = 1;
            Py_ssize_t k = 0;
            struct iovec *v = &iov[p];
            while (p + k < n && k < cap_segs) {
                Py_ssize_t dk = order[p + k];
                if (k && (ints_arg_at(&keys, dk) != key || (Py_ssize_t)ints_arg_at(&lens, dk) != seg ||
                          (has_trains && ints_arg_at(&trains, dk) != ints_arg_at(&trains, d))))
                    break;
                Py_ssize_t row = has_index ? (Py_ssize_t)ints_arg_at(&index, dk) : dk;
                v[k].iov_base = (void *)(base + row * stride);
                v[k].iov_len = (size_t)seg;
                k++;
            }
            gso_msg_t *g = &gm[nm];
            g->segs = k;
            g->addr.sin_family = AF_INET;
            g->addr.sin_port = htons((uint16_t)(key & 0xFFFF));
            g->addr.sin_addr.s_addr = htonl((uint32_t)(key >> 16));
            struct msghdr *h = &msgs[nm].msg_hdr;
            memset(h, 0, sizeof(*h));
            h->msg_name = &g->addr;
            h->msg_namelen = sizeof(g->addr);
            h->msg_iov = v;
            h->msg_iovlen = (size_t)k;
            if (k > 1) {
                h->msg_control = g->ctl.buf;
                h->msg_controllen = sizeof(g->ctl.buf);
                struct cmsghdr *c = CMSG_FIRSTHDR(h);
                c->cmsg_level = SOL_UDP;
                c->cmsg_type = UDP_SEGMENT;
                c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
                uint16_t s16 = (uint16_t)seg;
                memcpy(CMSG_DATA(c), &s16, sizeof(s16));
            }
            nm++;
            p += k;
        }
        /* Send them; msgs[m0..] are still to go. */
        Py_ssize_t m0 = 0;
        while (m0 < nm) {
            int r = sendmmsg(fd, msgs + m0, (unsigned int)(nm - m0), MSG_DONTWAIT);
            st[STAT_SYSCALLS_SEND]++;
            if (r > 0) {
                for (int j = 0; j < r; j++) {
                    st[STAT_PACKETS_SENT] += gm[m0 + j].segs;
                    pos += gm[m0 + j].segs;
                    if (gm[m0 + j].segs > 1)
                        st[STAT_GSO_TRAINS_SENT]++;
                }
                m0 += r;
                stalled = 0;
                retried = 0;
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
            if ((e == EINVAL || e == EIO || e == ENOPROTOOPT || e == EOPNOTSUPP) && gm[m0].segs > 1) {
                /* The kernel (or the route's device) will not segment: rebuild from here, one datagram per
                 * message, and tell the caller. */
                refused = e;
                break;
            }
            if (e == ECONNREFUSED && !retried) {
                /* A pending ICMP error of an earlier datagram, reported on this call: it is not about this
                 * message, so try it once more rather than lose a whole train to it. */
                retried = 1;
                continue;
            }
            if (skip_errno(e)) {
                st[STAT_SEND_ERRORS] += gm[m0].segs;
                pos += gm[m0].segs;
                m0++;
                continue;
            }
            if (room_errno(e)) {
                double left = last_progress + stall_s - now_s();
                if (stalled || left <= 0) {
                    st[STAT_SEND_ERRORS] += gm[m0].segs;
                    pos += gm[m0].segs;
                    m0++;
                    stalled = 1;
                    continue;
                }
                st[STAT_SEND_WAITS]++;
                if (e == EAGAIN || e == EWOULDBLOCK) {
                    int slice = (int)(left * 1000.0) + 1;
                    if (slice > POLLOUT_SLICE_MS)
                        slice = POLLOUT_SLICE_MS;
                    struct pollfd pf = {.fd = fd, .events = POLLOUT, .revents = 0};
                    (void)poll(&pf, 1, slice);
                } else {
                    struct timespec ts = {0, ENOBUFS_SLEEP_NS};
                    nanosleep(&ts, NULL);
                }
                continue;
            }
            err = e;
            break;
        }
        if (refused && m0 < nm && gm[m0].segs > 1)
            continue; /* rebuild the rest as single datagrams */
    }
    Py_END_ALLOW_THREADS

    if (interrupted) {
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
    result = Py_BuildValue("(ni)", (Py_ssize_t)st[STAT_PACKETS_SENT], refused);

done:
    PyMem_Free(order);
    PyMem_Free(msgs);
    PyMem_Free(gm);
    PyMem_Free(iov);
    release_ints_arg(&trains);
    release_ints_arg(&index);
    release_ints_arg(&keys);
    release_ints_arg(&lens);
    PyBuffer_Release(&data);
    return result;
}

/* ---------------------------------------------------------------------------------------------- */
/* recv_gro                                                                                       */
/* ---------------------------------------------------------------------------------------------- */

/* A GRO staging buffer: message headers and 64 KiB receive buffers for `msgs` messages, and the messages
 * of the last recvmmsg not yet cut into rows (a call that fills its rows leaves the rest for the next). */
typedef struct {
    Py_ssize_t msgs;  /* capacity in messages */
    Py_ssize_t held;  /* messages the last recvmmsg returned */
    Py_ssize_t cur;   /* the first message not wholly cut into rows */
    Py_ssize_t off;   /* bytes of message cur already cut */
} gro_head_t;

typedef struct {
    struct iovec iov;
    struct sockaddr_in addr;
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } ctl;
    int64_t key;
    Py_ssize_t len;
    Py_ssize_t seg;
} gro_slot_t;

static size_t gro_size(Py_ssize_t m) {
    return ALIGN_UP(sizeof(gro_head_t)) + ALIGN_UP((size_t)m * sizeof(struct mmsghdr)) +
           ALIGN_UP((size_t)m * sizeof(gro_slot_t)) + (size_t)m * GRO_BUF_BYTES;
}

static PyObject *gro_staging_bytes(PyObject *self, PyObject *arg) {
    Py_ssize_t m = PyLong_AsSsize_t(arg);
    if (m == -1 && PyErr_Occurred())
        return NULL;
    if (m < 1 || m > GRO_MAX_MSGS) {
        PyErr_Format(PyExc_ValueError, "messages must be in 1..%d", GRO_MAX_MSGS);
        return NULL;
    }
    return PyLong_FromSize_t(gro_size(m));
}

static PyObject *recv_gro(PyObject *self, PyObject *args) {
    int fd, timeout_ms;
    Py_ssize_t max_n;
    PyObject *data_obj, *lens_obj, *keys_obj, *stats_obj, *staging_obj;
    if (!PyArg_ParseTuple(args, "iOOOniOO:recv_gro", &fd, &data_obj, &lens_obj, &keys_obj, &max_n, &timeout_ms,
                          &stats_obj, &staging_obj))
        return NULL;

    Py_buffer data, lens, keys, staging;
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
    if (PyObject_GetBuffer(staging_obj, &staging, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&lens);
        PyBuffer_Release(&keys);
        return NULL;
    }
    gro_head_t *head = (gro_head_t *)staging.buf;
    if (((uintptr_t)staging.buf & 7) != 0 || (size_t)staging.len < sizeof(gro_head_t) || head->msgs < 1 ||
        head->msgs > GRO_MAX_MSGS || (size_t)staging.len < gro_size(head->msgs) || head->held < 0 ||
        head->held > head->msgs || head->cur < 0 || head->cur > head->held) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&lens);
        PyBuffer_Release(&keys);
        PyBuffer_Release(&staging);
        PyErr_SetString(PyExc_ValueError, "not a GRO staging buffer (see gro_staging_bytes)");
        return NULL;
    }
    Py_ssize_t m = head->msgs;
    struct mmsghdr *msgs = (struct mmsghdr *)((char *)staging.buf + ALIGN_UP(sizeof(gro_head_t)));
    gro_slot_t *slots = (gro_slot_t *)((char *)msgs + ALIGN_UP((size_t)m * sizeof(struct mmsghdr)));
    char *bufs = (char *)slots + ALIGN_UP((size_t)m * sizeof(gro_slot_t));

    Py_ssize_t cap = max_n;
    if (cap > rows)
        cap = rows;
    if (cap > lens.len / lens.itemsize)
        cap = lens.len / lens.itemsize;
    if (cap > keys.len / keys.itemsize)
        cap = keys.len / keys.itemsize;
    if (cap < 0)
        cap = 0;

    int64_t st[STAT_COUNT] = {0};
    Py_ssize_t total = 0;
    int err = 0, eintr = 0, polled = 0, refused = 0, dry = 0;
    int64_t *keys_out = (int64_t *)keys.buf;
    char *base = (char *)data.buf;

    Py_BEGIN_ALLOW_THREADS
    while (total < cap) {
        if (head->cur < head->held) {
            /* Cut message cur into rows, from byte off on. */
            gro_slot_t *s = &slots[head->cur];
            const char *src = bufs + head->cur * GRO_BUF_BYTES;
            while (total < cap && (head->off < s->len || (s->len == 0 && head->off == 0))) {
                Py_ssize_t piece = s->len - head->off;
                if (piece > s->seg)
                    piece = s->seg;
                Py_ssize_t keep = piece < width ? piece : width;
                if (piece > width)
                    st[STAT_RECV_TRUNCATED]++;
                if (keep > 0)
                    memcpy(base + total * stride, src + head->off, (size_t)keep);
                if (lens.itemsize == 4)
                    ((int32_t *)lens.buf)[total] = (int32_t)keep;
                else
                    ((int64_t *)lens.buf)[total] = (int64_t)keep;
                keys_out[total] = s->key;
                total++;
                if (s->len == 0) {
                    head->off = 1; /* an empty datagram: one empty row */
                    break;
                }
                head->off += piece;
            }
            if (head->off >= s->len) {
                head->cur++;
                head->off = 0;
            }
            continue;
        }
        if (dry)
            break;
        /* Everything held is cut: receive the next messages. */
        for (Py_ssize_t i = 0; i < m; i++) {
            gro_slot_t *s = &slots[i];
            s->iov.iov_base = bufs + i * GRO_BUF_BYTES;
            s->iov.iov_len = GRO_BUF_BYTES;
            struct msghdr *h = &msgs[i].msg_hdr;
            memset(h, 0, sizeof(*h));
            h->msg_name = &s->addr;
            h->msg_namelen = sizeof(s->addr);
            h->msg_iov = &s->iov;
            h->msg_iovlen = 1;
            h->msg_control = s->ctl.buf;
            h->msg_controllen = sizeof(s->ctl.buf);
        }
        head->held = head->cur = head->off = 0;
        int r = recvmmsg(fd, msgs, (unsigned int)m, MSG_DONTWAIT, NULL);
        st[STAT_SYSCALLS_RECV]++;
        if (r > 0) {
            for (int i = 0; i < r; i++) {
                gro_slot_t *s = &slots[i];
                struct msghdr *h = &msgs[i].msg_hdr;
                s->len = (Py_ssize_t)msgs[i].msg_len;
                s->seg = s->len > 0 ? s->len : 1;
                for (struct cmsghdr *c = CMSG_FIRSTHDR(h); c != NULL; c = CMSG_NXTHDR(h, c)) {
                    if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO) {
                        int g;
                        memcpy(&g, CMSG_DATA(c), sizeof(g));
                        if (g > 0)
                            s->seg = g;
                    }
                }
                if (s->len > s->seg)
                    st[STAT_GRO_TRAINS_RECEIVED]++;
                if (h->msg_namelen >= sizeof(s->addr) && s->addr.sin_family == AF_INET)
                    s->key = ((int64_t)ntohl(s->addr.sin_addr.s_addr) << 16) | (int64_t)ntohs(s->addr.sin_port);
                else
                    s->key = -1;
            }
            head->held = r;
            if (r < m)
                dry = 1; /* the queue ran dry: cut what came, then return */
            continue;
        }
        int e = r == 0 ? EAGAIN : errno;
        if (e == ECONNREFUSED && refused < MAX_REFUSED_RETRIES) {
            refused++;
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
            err = e;
        break;
    }
    Py_END_ALLOW_THREADS

    PyBuffer_Release(&data);
    PyBuffer_Release(&lens);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&staging);

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

/* Writes a fresh GRO staging header for `messages` messages into buf. */
static PyObject *gro_staging_init(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_ssize_t m;
    if (!PyArg_ParseTuple(args, "On:gro_staging_init", &obj, &m))
        return NULL;
    Py_buffer v;
    if (PyObject_GetBuffer(obj, &v, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return NULL;
    if (m < 1 || m > GRO_MAX_MSGS || (size_t)v.len < gro_size(m) || ((uintptr_t)v.buf & 7) != 0) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_ValueError, "buffer too small or misaligned for that many messages");
        return NULL;
    }
    gro_head_t *head = (gro_head_t *)v.buf;
    head->msgs = m;
    head->held = head->cur = head->off = 0;
    PyBuffer_Release(&v);
    Py_RETURN_NONE;
}

/* Datagrams received but not yet cut into rows (0 when the staging buffer holds none). */
static PyObject *gro_pending(PyObject *self, PyObject *obj) {
    Py_buffer v;
    if (PyObject_GetBuffer(obj, &v, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    gro_head_t *head = (gro_head_t *)v.buf;
    long pending = (size_t)v.len >= sizeof(gro_head_t) && head->cur < head->held;
    PyBuffer_Release(&v);
    return PyBool_FromLong(pending);
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
    {"send_gso", send_gso, METH_VARARGS,
     "send_gso(fd, data, lens, keys, n, stall_ms, stats, index, max_segs[, trains]) -> (sent, refused_errno)\n\n"
     "As send_batch, but datagrams to one destination with one length leave as GSO messages of up to\n"
     "max_segs datagrams (UDP_SEGMENT); each destination's datagrams keep their order; a message never\n"
     "holds datagrams of two different trains[] values. If the kernel refuses\n"
     "segmentation (EINVAL/EIO), the rest go one datagram per message and refused_errno says why."},
    {"recv_gro", recv_gro, METH_VARARGS,
     "recv_gro(fd, data, lens_out, keys_out, max_n, timeout_ms, stats, staging) -> n\n\n"
     "As recv_batch on a socket with UDP_GRO set: coalesced buffers are cut into one row per datagram by\n"
     "their segment size. What does not fit in max_n rows stays in staging for the next call."},
    {"gro_staging_bytes", gro_staging_bytes, METH_O, "gro_staging_bytes(messages) -> bytes of a GRO staging buffer"},
    {"gro_staging_init", gro_staging_init, METH_VARARGS, "gro_staging_init(buf, messages): set up a staging buffer"},
    {"gro_pending", gro_pending, METH_O, "gro_pending(staging) -> whether received datagrams wait in it"},
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
        PyModule_AddIntConstant(m, "MAX_VLEN", MAX_VLEN) < 0 ||
        PyModule_AddIntConstant(m, "GSO_MAX_BYTES", GSO_MAX_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "GRO_BUF_BYTES", GRO_BUF_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
