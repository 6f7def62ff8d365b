/*
 * shmserve._atomics -- memory-ordered operations on words inside shared buffers.
 *
 * Owns: the only publication mechanism of shmserve.  Python has no atomics, so
 * every status word, ring index and doorbell in the arena is read and written
 * through these functions (or, on the lane round trip's hot path, by
 * shmserve/_hotpath.c with the same builtins and the same orders).  They
 * operate on a 32- or 64-bit word at a byte offset inside any object that
 * exports a contiguous buffer (mmap, memoryview, bytearray, numpy array):
 *
 *   load32/load64(buf, off)                -> int    load-acquire
 *   store32/store64(buf, off, value)       -> None   store-release
 *   cas32/cas64(buf, off, expected, new)   -> bool   sequentially consistent CAS
 *   fetch_add32/fetch_add64(buf, off, d)   -> int    seq-cst fetch-add (wraps), returns old
 *   exchange32/exchange64(buf, off, value) -> int    seq-cst swap, returns old
 *   fence()                                -> None   full (seq-cst) fence
 *   futex_wait(buf, off, expected, timeout=None) -> WOKEN | TIMED_OUT | CHANGED
 *   futex_wake(buf, off, n=1)              -> int    number of waiters woken
 *   futex_waitv([(buf, off, expected), ...], timeout=None) -> WOKEN | TIMED_OUT | CHANGED
 *                                          sleep on up to 128 words at once (Linux >= 5.16;
 *                                          OSError(ENOSYS) on older kernels)
 *
 * Contract: every call checks that `off` is a non-negative int, that the word
 * lies wholly inside the buffer and that its absolute address is naturally
 * aligned; it raises ValueError/TypeError/OverflowError otherwise.  Stores,
 * CAS, exchange and fetch-add need a writable buffer (TypeError if not);
 * loads and futex calls accept read-only ones (the inspection tool maps
 * arenas read-only).  No argument can crash the interpreter.
 *
 * The futex calls use the *shared* futex operations (no FUTEX_PRIVATE_FLAG):
 * waiters and wakers live in different processes mapping the same memory.
 * futex_wait releases the GIL while it sleeps and holds the buffer export, so
 * the mapping cannot be closed under it.  A signal interrupting the wait is
 * reported as WOKEN after Python's signal handlers ran (callers re-check
 * their condition anyway: futex wake-ups may be spurious).
 *
 * Must not: allocate, call back into Python while the GIL is released, or
 * depend on anything but the C compiler's __atomic builtins and Linux.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Results of futex_wait. */
enum { WAIT_WOKEN = 0, WAIT_TIMED_OUT = 1, WAIT_CHANGED = 2 };

/* Positional-argument count check (the private _PyArg_CheckPositional is not stable API). */
static int
check_nargs(const char *name, Py_ssize_t n, Py_ssize_t want)
{
    if (n != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd arguments (%zd given)", name, want, n);
        return 0;
    }
    return 1;
}

/* Borrow the buffer of `obj` and return a pointer to the word at `off`.
 * On success the caller owns `view` and must PyBuffer_Release it. */
static void *
word_at(PyObject *obj, PyObject *off_obj, Py_ssize_t width, int writable, Py_buffer *view)
{
    if (!PyLong_Check(off_obj)) {
        PyErr_Format(PyExc_TypeError, "offset must be an int, not %.100s",
                     Py_TYPE(off_obj)->tp_name);
        return NULL;
    }
    Py_ssize_t off = PyLong_AsSsize_t(off_obj);
    if (off == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "offset out of range");
        return NULL;
    }
    int flags = PyBUF_SIMPLE | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) != 0) {
        /* Exporters disagree on how they refuse writes (BufferError, ValueError):
         * if a read-only export would work, callers get one TypeError. */
        if (writable && PyObject_CheckBuffer(obj)) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) == 0) {
                PyBuffer_Release(view);
                Py_XDECREF(type);
                Py_XDECREF(value);
                Py_XDECREF(tb);
                PyErr_Format(PyExc_TypeError, "cannot write: the %.100s buffer is read-only",
                             Py_TYPE(obj)->tp_name);
            } else {
                PyErr_Clear();
                PyErr_Restore(type, value, tb);
            }
        }
        return NULL;
    }
    if (off < 0 || off > view->len - width) {
        PyErr_Format(PyExc_ValueError,
                     "offset %zd out of range for a %zd-byte word in a %zd-byte buffer",
                     off, width, view->len);
        PyBuffer_Release(view);
        return NULL;
    }
    char *p = (char *)view->buf + off;
    if (((uintptr_t)p) % (uintptr_t)width != 0) {
        PyErr_Format(PyExc_ValueError,
                     "offset %zd is not %zd-byte aligned (address %p)", off, width, (void *)p);
        PyBuffer_Release(view);
        return NULL;
    }
    return p;
}

/* Python int -> uint32/uint64 with a range check (no silent truncation). */
static int
as_u32(PyObject *v, uint32_t *out)
{
    unsigned long long x = PyLong_AsUnsignedLongLong(v);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    if (x > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "value does not fit in 32 bits unsigned");
        return -1;
    }
    *out = (uint32_t)x;
    return 0;
}

static int
as_u64(PyObject *v, uint64_t *out)
{
    unsigned long long x = PyLong_AsUnsignedLongLong(v);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    *out = (uint64_t)x;
    return 0;
}

/* A signed delta for fetch_add: any int in [-2**63, 2**64), applied modulo 2**width. */
static int
as_delta(PyObject *v, uint64_t *out)
{
    int overflow = 0;
    long long s = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow == 0) {
        if (s == -1 && PyErr_Occurred()) {
            return -1;
        }
        *out = (uint64_t)s;
        return 0;
    }
    if (overflow < 0) {
        PyErr_SetString(PyExc_OverflowError, "delta below -2**63");
        return -1;
    }
    return as_u64(v, out);
}

#define DEFINE_LOAD(NAME, TYPE, WIDTH)                                        \
    static PyObject *NAME(PyObject *self, PyObject *const *args, Py_ssize_t n) \
    {                                                                         \
        if (!check_nargs(#NAME, n, 2)) return NULL;             \
        Py_buffer view;                                                       \
        TYPE *p = word_at(args[0], args[1], WIDTH, 0, &view);                 \
        if (p == NULL) return NULL;                                           \
        TYPE v = __atomic_load_n(p, __ATOMIC_ACQUIRE);                        \
        PyBuffer_Release(&view);                                              \
        return PyLong_FromUnsignedLongLong((unsigned long long)v);            \
    }

#define DEFINE_STORE(NAME, TYPE, WIDTH, CONVERT)                              \
    static PyObject *NAME(PyObject *self, PyObject *const *args, Py_ssize_t n) \
    {                                                                         \
        if (!check_nargs(#NAME, n, 3)) return NULL;             \
        TYPE value;                                                           \
        if (CONVERT(args[2], &value) != 0) return NULL;                       \
        Py_buffer view;                                                       \
        TYPE *p = word_at(args[0], args[1], WIDTH, 1, &view);                 \
        if (p == NULL) return NULL;                                           \
        __atomic_store_n(p, value, __ATOMIC_RELEASE);                         \
        PyBuffer_Release(&view);                                              \
        Py_RETURN_NONE;                                                       \
    }

#define DEFINE_CAS(NAME, TYPE, WIDTH, CONVERT)                                \
    static PyObject *NAME(PyObject *self, PyObject *const *args, Py_ssize_t n) \
    {                                                                         \
        if (!check_nargs(#NAME, n, 4)) return NULL;             \
        TYPE expected, desired;                                               \
        if (CONVERT(args[2], &expected) != 0) return NULL;                    \
        if (CONVERT(args[3], &desired) != 0) return NULL;                     \
        Py_buffer view;                                                       \
        TYPE *p = word_at(args[0], args[1], WIDTH, 1, &view);                 \
        if (p == NULL) return NULL;                                           \
        int ok = __atomic_compare_exchange_n(p, &expected, desired, 0,        \
                                             __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); \
        PyBuffer_Release(&view);                                              \
        return PyBool_FromLong(ok);                                           \
    }

#define DEFINE_FETCH_ADD(NAME, TYPE, WIDTH)                                   \
    static PyObject *NAME(PyObject *self, PyObject *const *args, Py_ssize_t n) \
    {                                                                         \
        if (!check_nargs(#NAME, n, 3)) return NULL;             \
        uint64_t delta;                                                       \
        if (as_delta(args[2], &delta) != 0) return NULL;                      \
        Py_buffer view;                                                       \
        TYPE *p = word_at(args[0], args[1], WIDTH, 1, &view);                 \
        if (p == NULL) return NULL;                                           \
        TYPE old = __atomic_fetch_add(p, (TYPE)delta, __ATOMIC_SEQ_CST);      \
        PyBuffer_Release(&view);                                              \
        return PyLong_FromUnsignedLongLong((unsigned long long)old);          \
    }

#define DEFINE_EXCHANGE(NAME, TYPE, WIDTH, CONVERT)                           \
    static PyObject *NAME(PyObject *self, PyObject *const *args, Py_ssize_t n) \
    {                                                                         \
        if (!check_nargs(#NAME, n, 3)) return NULL;                           \
        TYPE value;                                                           \
        if (CONVERT(args[2], &value) != 0) return NULL;                       \
        Py_buffer view;                                                       \
        TYPE *p = word_at(args[0], args[1], WIDTH, 1, &view);                 \
        if (p == NULL) return NULL;                                           \
        TYPE old = __atomic_exchange_n(p, value, __ATOMIC_SEQ_CST);           \
        PyBuffer_Release(&view);                                              \
        return PyLong_FromUnsignedLongLong((unsigned long long)old);          \
    }

DEFINE_LOAD(load32, uint32_t, 4)
DEFINE_LOAD(load64, uint64_t, 8)
DEFINE_STORE(store32, uint32_t, 4, as_u32)
DEFINE_STORE(store64, uint64_t, 8, as_u64)
DEFINE_CAS(cas32, uint32_t, 4, as_u32)
DEFINE_CAS(cas64, uint64_t, 8, as_u64)
DEFINE_FETCH_ADD(fetch_add32, uint32_t, 4)
DEFINE_FETCH_ADD(fetch_add64, uint64_t, 8)
DEFINE_EXCHANGE(exchange32, uint32_t, 4, as_u32)
DEFINE_EXCHANGE(exchange64, uint64_t, 8, as_u64)

static PyObject *
fence(PyObject *self, PyObject *unused)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static long
sys_futex(uint32_t *addr, int op, uint32_t val, const struct timespec *timeout)
{
    return syscall(SYS_futex, addr, op, val, timeout, NULL, 0);
}

static PyObject *
futex_wait(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buffer", "offset", "expected", "timeout", NULL};
    PyObject *obj, *off_obj, *expected_obj, *timeout_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|O:futex_wait", kwlist,
                                     &obj, &off_obj, &expected_obj, &timeout_obj)) {
        return NULL;
    }
    uint32_t expected;
    if (as_u32(expected_obj, &expected) != 0) return NULL;

    struct timespec ts, *tsp = NULL;
    if (timeout_obj != Py_None) {
        double t = PyFloat_AsDouble(timeout_obj);
        if (t == -1.0 && PyErr_Occurred()) return NULL;
        if (!(t >= 0.0) || t > 1e9) { /* also rejects NaN */
            PyErr_SetString(PyExc_ValueError, "timeout must be None or a number of seconds in [0, 1e9]");
            return NULL;
        }
        ts.tv_sec = (time_t)t;
        ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
        if (ts.tv_nsec >= 1000000000L) ts.tv_nsec = 999999999L;
        tsp = &ts;
    }

    Py_buffer view;
    uint32_t *p = word_at(obj, off_obj, 4, 0, &view);
    if (p == NULL) return NULL;

    long rc;
    int err;
    Py_BEGIN_ALLOW_THREADS
    rc = sys_futex(p, FUTEX_WAIT, expected, tsp); /* relative timeout, CLOCK_MONOTONIC */
    err = errno;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);

    if (rc == 0) return PyLong_FromLong(WAIT_WOKEN);
    switch (err) {
    case EAGAIN:
        return PyLong_FromLong(WAIT_CHANGED);
    case ETIMEDOUT:
        return PyLong_FromLong(WAIT_TIMED_OUT);
    case EINTR:
        if (PyErr_CheckSignals() != 0) return NULL; /* e.g. KeyboardInterrupt */
        return PyLong_FromLong(WAIT_WOKEN);
    default:
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
}

static PyObject *
futex_wake(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buffer", "offset", "n", NULL};
    PyObject *obj, *off_obj;
    int nwake = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|i:futex_wake", kwlist,
                                     &obj, &off_obj, &nwake)) {
        return NULL;
    }
    if (nwake < 1) {
        PyErr_SetString(PyExc_ValueError, "n must be at least 1");
        return NULL;
    }
    Py_buffer view;
    uint32_t *p = word_at(obj, off_obj, 4, 0, &view);
    if (p == NULL) return NULL;
    long rc = sys_futex(p, FUTEX_WAKE, (uint32_t)nwake, NULL);
    int err = errno;
    PyBuffer_Release(&view);
    if (rc < 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(rc);
}

/* futex_waitv(2) (Linux 5.16): the struct and number are spelled out so that older headers build. */
#ifndef SYS_futex_waitv
#define SYS_futex_waitv 449
#endif
#define WAITV_MAX 128
#define WAITV_SIZE_U32 0x02
struct waitv_entry {
    uint64_t val;
    uint64_t uaddr;
    uint32_t flags;
    uint32_t reserved;
};

static PyObject *
futex_waitv(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"words", "timeout", NULL};
    PyObject *words_obj, *timeout_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O:futex_waitv", kwlist, &words_obj, &timeout_obj)) {
        return NULL;
    }
    struct timespec ts, *tsp = NULL;
    if (timeout_obj != Py_None) {
        double t = PyFloat_AsDouble(timeout_obj);
        if (t == -1.0 && PyErr_Occurred()) return NULL;
        if (!(t >= 0.0) || t > 1e9) {
            PyErr_SetString(PyExc_ValueError, "timeout must be None or a number of seconds in [0, 1e9]");
            return NULL;
        }
        clock_gettime(CLOCK_MONOTONIC, &ts); /* futex_waitv takes an absolute deadline */
        time_t whole = (time_t)t;
        ts.tv_sec += whole;
        ts.tv_nsec += (long)((t - (double)whole) * 1e9);
        while (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec += 1;
            ts.tv_nsec -= 1000000000L;
        }
        tsp = &ts;
    }
    PyObject *seq = PySequence_Fast(words_obj, "words must be a sequence of (buffer, offset, expected)");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > WAITV_MAX) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "futex_waitv takes 1 to %d words, not %zd", WAITV_MAX, n);
        return NULL;
    }
    struct waitv_entry entries[WAITV_MAX];
    Py_buffer views[WAITV_MAX];
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
            PyErr_SetString(PyExc_TypeError, "each word must be a (buffer, offset, expected) tuple");
            goto done;
        }
        uint32_t expected;
        if (as_u32(PyTuple_GET_ITEM(item, 2), &expected) != 0) goto done;
        uint32_t *p = word_at(PyTuple_GET_ITEM(item, 0), PyTuple_GET_ITEM(item, 1), 4, 0, &views[held]);
        if (p == NULL) goto done;
        held++;
        entries[i].val = expected;
        entries[i].uaddr = (uint64_t)(uintptr_t)p;
        entries[i].flags = WAITV_SIZE_U32; /* shared: no FUTEX_PRIVATE_FLAG */
        entries[i].reserved = 0;
    }
    long rc;
    int err;
    Py_BEGIN_ALLOW_THREADS
    rc = syscall(SYS_futex_waitv, entries, (unsigned int)n, 0, tsp, CLOCK_MONOTONIC);
    err = errno;
    Py_END_ALLOW_THREADS
    if (rc >= 0) {
        result = PyLong_FromLong(WAIT_WOKEN);
    } else if (err == EAGAIN) {
        result = PyLong_FromLong(WAIT_CHANGED);
    } else if (err == ETIMEDOUT) {
        result = PyLong_FromLong(WAIT_TIMED_OUT);
    } else if (err == EINTR) {
        if (PyErr_CheckSignals() == 0) result = PyLong_FromLong(WAIT_WOKEN);
    } else {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
    }
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    Py_DECREF(seq);
    return result;
}

static PyObject *
address(PyObject *self, PyObject *obj)
{
    /* The address of a buffer's first byte (a numpy array's data pointer without ctypes). */
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) != 0) {
        PyErr_Clear();
        if (PyObject_GetBuffer(obj, &view, PyBUF_STRIDED_RO) != 0) return NULL;
    }
    PyObject *result = PyLong_FromVoidPtr(view.buf);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"load32", (PyCFunction)(void (*)(void))load32, METH_FASTCALL,
     "load32(buffer, offset) -> int\n\nLoad-acquire the uint32 at byte `offset`."},
    {"load64", (PyCFunction)(void (*)(void))load64, METH_FASTCALL,
     "load64(buffer, offset) -> int\n\nLoad-acquire the uint64 at byte `offset`."},
    {"store32", (PyCFunction)(void (*)(void))store32, METH_FASTCALL,
     "store32(buffer, offset, value)\n\nStore-release a uint32: every write before it is visible "
     "to a reader that load-acquires this word and sees `value`."},
    {"store64", (PyCFunction)(void (*)(void))store64, METH_FASTCALL,
     "store64(buffer, offset, value)\n\nStore-release a uint64."},
    {"cas32", (PyCFunction)(void (*)(void))cas32, METH_FASTCALL,
     "cas32(buffer, offset, expected, new) -> bool\n\nAtomically replace `expected` by `new`; "
     "True if it did (sequentially consistent)."},
    {"cas64", (PyCFunction)(void (*)(void))cas64, METH_FASTCALL,
     "cas64(buffer, offset, expected, new) -> bool\n\n64-bit compare-and-swap."},
    {"fetch_add32", (PyCFunction)(void (*)(void))fetch_add32, METH_FASTCALL,
     "fetch_add32(buffer, offset, delta) -> int\n\nAdd `delta` modulo 2**32, return the old value."},
    {"fetch_add64", (PyCFunction)(void (*)(void))fetch_add64, METH_FASTCALL,
     "fetch_add64(buffer, offset, delta) -> int\n\nAdd `delta` modulo 2**64, return the old value."},
    {"exchange32", (PyCFunction)(void (*)(void))exchange32, METH_FASTCALL,
     "exchange32(buffer, offset, value) -> int\n\nAtomically store `value`, return the old value."},
    {"exchange64", (PyCFunction)(void (*)(void))exchange64, METH_FASTCALL,
     "exchange64(buffer, offset, value) -> int\n\n64-bit atomic swap."},
    {"fence", fence, METH_NOARGS, "fence()\n\nFull sequentially consistent memory fence."},
    {"address", address, METH_O,
     "address(buffer) -> int\n\nThe address of the buffer's first byte (a read-only or strided one too): "
     "what numpy's ctypes.data says, without its cost."},
    {"futex_wait", (PyCFunction)(void (*)(void))futex_wait, METH_VARARGS | METH_KEYWORDS,
     "futex_wait(buffer, offset, expected, timeout=None) -> int\n\n"
     "Sleep while the uint32 at `offset` equals `expected` (shared futex).  Returns WOKEN, "
     "TIMED_OUT, or CHANGED (the word already differed).  Wake-ups may be spurious."},
    {"futex_wake", (PyCFunction)(void (*)(void))futex_wake, METH_VARARGS | METH_KEYWORDS,
     "futex_wake(buffer, offset, n=1) -> int\n\nWake up to `n` waiters; returns how many woke."},
    {"futex_waitv", (PyCFunction)(void (*)(void))futex_waitv, METH_VARARGS | METH_KEYWORDS,
     "futex_waitv(words, timeout=None) -> int\n\n"
     "Sleep until any of up to 128 (buffer, offset, expected) uint32 words is woken (shared "
     "futexes).  Returns WOKEN, TIMED_OUT, or CHANGED (a word already differed).  OSError(ENOSYS) "
     "before Linux 5.16."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shmserve._atomics",
    "Acquire/release atomics and shared futexes on words inside Python buffers.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__atomics(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "WOKEN", WAIT_WOKEN) < 0 ||
        PyModule_AddIntConstant(m, "TIMED_OUT", WAIT_TIMED_OUT) < 0 ||
        PyModule_AddIntConstant(m, "CHANGED", WAIT_CHANGED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
