/*
 * shmserve._hotpath -- the lane round trip's per-call work, compiled.
 *
 * Owns: C versions of the functions of shmserve/hotpath.py (the reference, in Python), with
 * the same arguments, results, errors and bytes left in the buffer:
 *
 *   client:  submit, finished, wait_slice, read           (a lane: layout.LANE)
 *   worker:  claim, decode_lane, encode_outputs, publish  (a lane, or the arena's slot table)
 *
 * and configure(constants, ...), which shmserve.hotpath calls once at import with
 * layout.hotpath_constants(): every offset, size and encoding used here comes from there
 * (nothing below hard-codes one), checked for consistency before it is taken; constants()
 * returns what was taken.  Every function refuses to run before configure.
 *
 * Memory ordering is _atomics.c's: load-acquire / store-release on status words and ring
 * indices, sequentially consistent CAS and fetch-add; the publication sites say "order
 * matters here" as the Python does.  The futex calls are the shared ones (no PRIVATE flag).
 *
 * Untrusted input: a lane's client writes every byte of it.  Each field read from a buffer is
 * read once into a local and validated there; slot, tensor and ring positions are bounds-checked
 * against the buffer before any access; products of dimensions are checked for overflow.  No
 * argument and no buffer content can make these functions read or write outside the buffer.
 *
 * Must not: keep state between calls (beyond the configuration), call back into Python while
 * the GIL is released, or decide anything the Python callers decide.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the arena layout is little-endian; plain fields are copied in native order"
#endif

#define MAX_DTYPES 64
#define MAX_PAIRS 16
#define MAX_DIMS_CAP 16
#define MAX_STAGES_CAP 16

/* -- configuration (layout.hotpath_constants) -------------------------------------------- */

static struct {
    int ready;
    Py_ssize_t slot_size, tensors_off, tensor_size, max_tensors, max_dims, tensor_align;
    Py_ssize_t status_off, request_id_off, model_id_off, worker_off, n_inputs_off, n_outputs_off, flags_off;
    Py_ssize_t out_region_off, out_off_off, out_capacity_off, error_code_off, error_len_off, error_msg_off;
    Py_ssize_t error_msg_max, request_span, stages_off, n_stages, priority_off, deadline_off;
    Py_ssize_t stage_acquired, stage_ready, stage_claimed, stage_done;
    Py_ssize_t t_dtype_off, t_ndim_off, t_role_off, t_name_off, t_region_off, t_offset_off, t_nbytes_off, t_shape_off;
    Py_ssize_t role_input, role_output, generation_shift;
    uint64_t generation_mask;
    Py_ssize_t ring_tail, ring_head, ring_seq, ring_waiters, ring_entries;
    Py_ssize_t lane_bytes, lane_slots, lane_slot_table_off, lane_submission_off, lane_completion_off,
        lane_ring_capacity;
    Py_ssize_t hist_buckets, hist_sum_off, hist_worker_size;
    Py_ssize_t lane_outcome_off, lane_outcome_buckets, lane_sub_bits, lane_time_shift, lane_fault_mask;
    Py_ssize_t n_pairs, pair_off[MAX_PAIRS], pair_start[MAX_PAIRS], pair_end[MAX_PAIRS];
    Py_ssize_t bytes_code, n_dtypes;
    uint64_t itemsize[MAX_DTYPES];
    uint32_t st_free, st_writing, st_ready, st_running, st_done, st_error;
    uint32_t wake_all;
} K;

static PyObject *constants_dict;             /* what configure took, for constants() */
static PyObject *dtypes_by_code;             /* tuple: code -> numpy dtype or None */
static PyObject *dtype_names;                /* tuple: code -> name or None */
static PyObject *code_of_dtype;              /* dict: numpy dtype -> code */
static PyObject *no_zero_copy_bytes;         /* str */
static PyObject *LayoutError, *SlotConflict, *SlotRequest, *DtypeCode, *StateName, *MakeError, *ErrorCodeType;
static uint32_t code_internal, code_bad_input, code_bad_region, code_bad_dtype; /* ErrorCode's numbers */

static int
not_ready(void)
{
    if (!K.ready) {
        PyErr_SetString(PyExc_RuntimeError, "shmserve._hotpath is not configured (import shmserve.hotpath)");
        return 1;
    }
    return 0;
}

static int
take(PyObject *d, const char *key, Py_ssize_t *out)
{
    PyObject *v = PyDict_GetItemString(d, key); /* borrowed */
    if (v == NULL) {
        PyErr_Format(PyExc_KeyError, "hotpath constant %s missing", key);
        return -1;
    }
    Py_ssize_t x = PyLong_AsSsize_t(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (x < 0) {
        PyErr_Format(PyExc_ValueError, "hotpath constant %s is negative", key);
        return -1;
    }
    *out = x;
    return 0;
}

#define TAKE(name) if (take(d, #name, &K.name) < 0) return NULL

/* A field of `width` bytes at `off` must lie inside a record of `size` bytes. */
#define INSIDE(off, width, size, what)                                                         \
    if ((off) + (width) > (size)) {                                                            \
        PyErr_Format(PyExc_ValueError, "hotpath constants: %s does not fit its record", what); \
        return NULL;                                                                           \
    }
#define ALIGNED(off, width, what)                                                              \
    if ((off) % (width) != 0) {                                                                \
        PyErr_Format(PyExc_ValueError, "hotpath constants: %s is not aligned", what);          \
        return NULL;                                                                           \
    }

static PyObject *
kwarg(PyObject *kwargs, const char *key)
{
    PyObject *v = kwargs ? PyDict_GetItemString(kwargs, key) : NULL;
    if (v == NULL) PyErr_Format(PyExc_TypeError, "configure() needs %s=", key);
    return v;
}

static void
keep(PyObject **slot, PyObject *value)
{
    Py_INCREF(value);
    Py_XSETREF(*slot, value);
}

static PyObject *
configure(PyObject *self, PyObject *args, PyObject *kwargs)
{
    PyObject *d;
    if (!PyArg_ParseTuple(args, "O!:configure", &PyDict_Type, &d)) return NULL;
    K.ready = 0;
    TAKE(slot_size); TAKE(tensors_off); TAKE(tensor_size); TAKE(max_tensors); TAKE(max_dims); TAKE(tensor_align);
    TAKE(status_off); TAKE(request_id_off); TAKE(model_id_off); TAKE(worker_off); TAKE(n_inputs_off);
    TAKE(n_outputs_off); TAKE(flags_off); TAKE(out_region_off); TAKE(out_off_off); TAKE(out_capacity_off);
    TAKE(error_code_off); TAKE(error_len_off); TAKE(error_msg_off); TAKE(error_msg_max); TAKE(request_span);
    TAKE(stages_off); TAKE(n_stages); TAKE(stage_acquired); TAKE(stage_ready); TAKE(stage_claimed); TAKE(stage_done);
    TAKE(t_dtype_off); TAKE(t_ndim_off); TAKE(t_role_off); TAKE(t_name_off); TAKE(t_region_off);
    TAKE(t_offset_off); TAKE(t_nbytes_off); TAKE(t_shape_off); TAKE(role_input); TAKE(role_output);
    TAKE(generation_shift);
    TAKE(ring_tail); TAKE(ring_head); TAKE(ring_seq); TAKE(ring_waiters); TAKE(ring_entries);
    TAKE(lane_bytes); TAKE(lane_slots); TAKE(lane_slot_table_off); TAKE(lane_submission_off);
    TAKE(lane_completion_off); TAKE(lane_ring_capacity);
    TAKE(hist_buckets); TAKE(hist_sum_off); TAKE(hist_worker_size); TAKE(bytes_code);
    TAKE(lane_outcome_off); TAKE(lane_outcome_buckets); TAKE(lane_sub_bits); TAKE(lane_time_shift);
    TAKE(lane_fault_mask); TAKE(priority_off); TAKE(deadline_off);
    Py_ssize_t mask;
    if (take(d, "generation_mask", &mask) < 0) return NULL;
    K.generation_mask = (uint64_t)mask;

    /* The layout the code below relies on, checked rather than trusted. */
    INSIDE(K.tensors_off + K.max_tensors * K.tensor_size, 0, K.slot_size, "the tensor table");
    if (K.max_dims > MAX_DIMS_CAP || K.n_stages > MAX_STAGES_CAP || K.max_tensors < 1 || K.tensor_align < 1 ||
        K.generation_shift != 32 || K.generation_mask != 0xFFFFFFFFu || K.slot_size % 8 != 0 ||
        K.tensor_size > 512 || K.error_msg_max < 4) {
        PyErr_SetString(PyExc_ValueError, "hotpath constants: limits out of range");
        return NULL;
    }
    INSIDE(K.status_off, 8, K.tensors_off, "status"); ALIGNED(K.status_off, 8, "status");
    INSIDE(K.request_id_off, K.request_span, K.tensors_off, "the request");
    INSIDE(K.model_id_off, 4, K.tensors_off, "model_id"); INSIDE(K.worker_off, 4, K.tensors_off, "worker");
    INSIDE(K.n_inputs_off, 2, K.tensors_off, "n_inputs"); INSIDE(K.n_outputs_off, 2, K.tensors_off, "n_outputs");
    INSIDE(K.flags_off, 4, K.tensors_off, "flags"); INSIDE(K.out_region_off, 4, K.tensors_off, "out_region");
    INSIDE(K.out_off_off, 8, K.tensors_off, "out_off"); INSIDE(K.out_capacity_off, 8, K.tensors_off, "out_capacity");
    INSIDE(K.error_code_off, 4, K.tensors_off, "error_code"); INSIDE(K.error_len_off, 4, K.tensors_off, "error_len");
    INSIDE(K.error_msg_off, K.error_msg_max, K.tensors_off, "error_msg");
    INSIDE(K.stages_off, 8 * K.n_stages, K.tensors_off, "the stage times");
    INSIDE(K.priority_off, 8, K.tensors_off, "priority and caller"); ALIGNED(K.priority_off, 4, "priority");
    INSIDE(K.deadline_off, 8, K.tensors_off, "deadline_ns"); ALIGNED(K.deadline_off, 8, "deadline_ns");
    if (K.stage_acquired >= K.n_stages || K.stage_ready >= K.n_stages || K.stage_claimed >= K.n_stages ||
        K.stage_done >= K.n_stages) {
        PyErr_SetString(PyExc_ValueError, "hotpath constants: a stage index is out of range");
        return NULL;
    }
    INSIDE(K.t_dtype_off, 1, K.tensor_size, "dtype"); INSIDE(K.t_ndim_off, 1, K.tensor_size, "ndim");
    INSIDE(K.t_role_off, 1, K.tensor_size, "role"); INSIDE(K.t_name_off, 1, K.tensor_size, "name_index");
    INSIDE(K.t_region_off, 4, K.tensor_size, "region"); INSIDE(K.t_offset_off, 8, K.tensor_size, "offset");
    INSIDE(K.t_nbytes_off, 8, K.tensor_size, "nbytes"); INSIDE(K.t_shape_off, 8 * K.max_dims, K.tensor_size, "shape");
    ALIGNED(K.ring_tail, 8, "ring tail"); ALIGNED(K.ring_head, 8, "ring head"); ALIGNED(K.ring_seq, 4, "ring seq");
    ALIGNED(K.ring_waiters, 4, "ring waiters"); ALIGNED(K.ring_entries, 8, "ring entries");
    INSIDE(K.ring_tail, 8, K.ring_entries, "ring tail"); INSIDE(K.ring_head, 8, K.ring_entries, "ring head");
    INSIDE(K.ring_seq, 4, K.ring_entries, "ring seq"); INSIDE(K.ring_waiters, 4, K.ring_entries, "ring waiters");
    if (K.lane_ring_capacity < 1 || (K.lane_ring_capacity & (K.lane_ring_capacity - 1)) ||
        K.lane_slots < 1 || K.lane_slot_table_off % 8 != 0 || K.lane_submission_off % 8 != 0 ||
        K.lane_completion_off % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "hotpath constants: lane geometry out of range");
        return NULL;
    }
    INSIDE(K.lane_submission_off, K.ring_entries + 8 * K.lane_ring_capacity, K.lane_bytes, "the submission ring");
    INSIDE(K.lane_completion_off, K.ring_entries + 8 * K.lane_ring_capacity, K.lane_bytes, "the completion ring");
    INSIDE(K.lane_slot_table_off, K.lane_slots * K.slot_size, K.lane_bytes, "the lane's slots");
    ALIGNED(K.hist_sum_off, 8, "histogram sum"); ALIGNED(K.hist_worker_size, 8, "histogram table");
    ALIGNED(K.lane_outcome_off, 8, "lane outcomes");
    if (K.lane_outcome_off < 0 || K.lane_outcome_buckets < 1 || K.lane_sub_bits < 0 || K.lane_sub_bits > 8 ||
        K.lane_time_shift < 0 || K.lane_time_shift > 32 || K.lane_fault_mask < 0 ||
        K.lane_outcome_off + 8 * (1 + K.lane_outcome_buckets) > K.hist_worker_size) {
        PyErr_SetString(PyExc_ValueError, "hotpath constants: the lane outcomes are out of range");
        return NULL;
    }
    if (K.hist_buckets < 1 || K.hist_buckets > 64) {
        PyErr_SetString(PyExc_ValueError, "hotpath constants: histogram buckets out of range");
        return NULL;
    }

    PyObject *pairs = PyDict_GetItemString(d, "hist_pairs");
    if (pairs == NULL || !PyTuple_Check(pairs) || PyTuple_GET_SIZE(pairs) > MAX_PAIRS) {
        PyErr_SetString(PyExc_ValueError, "hotpath constants: hist_pairs must be a short tuple");
        return NULL;
    }
    K.n_pairs = PyTuple_GET_SIZE(pairs);
    for (Py_ssize_t i = 0; i < K.n_pairs; i++) {
        PyObject *p = PyTuple_GET_ITEM(pairs, i);
        if (!PyArg_ParseTuple(p, "nnn", &K.pair_off[i], &K.pair_start[i], &K.pair_end[i])) return NULL;
        if (K.pair_off[i] < 0 || K.pair_off[i] % 8 || K.pair_start[i] < 0 || K.pair_start[i] >= K.n_stages ||
            K.pair_end[i] < 0 || K.pair_end[i] >= K.n_stages ||
            K.pair_off[i] + K.hist_sum_off + 8 > K.hist_worker_size || 8 * K.hist_buckets > K.hist_sum_off) {
            PyErr_SetString(PyExc_ValueError, "hotpath constants: a histogram pair is out of range");
            return NULL;
        }
    }
    PyObject *itemsizes = PyDict_GetItemString(d, "itemsizes");
    PyObject *dtypes = PyDict_GetItemString(d, "dtypes");
    PyObject *names = PyDict_GetItemString(d, "dtype_names");
    PyObject *codes = PyDict_GetItemString(d, "code_of_dtype");
    PyObject *nzcb = PyDict_GetItemString(d, "no_zero_copy_bytes");
    if (itemsizes == NULL || !PyTuple_Check(itemsizes) || dtypes == NULL || !PyTuple_Check(dtypes) ||
        names == NULL || !PyTuple_Check(names) || codes == NULL || !PyDict_Check(codes) ||
        nzcb == NULL || !PyUnicode_Check(nzcb) || PyTuple_GET_SIZE(itemsizes) > MAX_DTYPES ||
        PyTuple_GET_SIZE(dtypes) != PyTuple_GET_SIZE(itemsizes) ||
        PyTuple_GET_SIZE(names) != PyTuple_GET_SIZE(itemsizes) || K.bytes_code >= PyTuple_GET_SIZE(itemsizes)) {
        PyErr_SetString(PyExc_ValueError, "hotpath constants: the dtype table is malformed");
        return NULL;
    }
    K.n_dtypes = PyTuple_GET_SIZE(itemsizes);
    for (Py_ssize_t i = 0; i < K.n_dtypes; i++) {
        Py_ssize_t size = PyLong_AsSsize_t(PyTuple_GET_ITEM(itemsizes, i));
        if (size < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "hotpath constants: negative itemsize");
            return NULL;
        }
        K.itemsize[i] = (uint64_t)size;
    }
    PyObject *dtype_key, *code_value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(codes, &pos, &dtype_key, &code_value)) { /* every code indexes the tables above */
        Py_ssize_t c = PyLong_AsSsize_t(code_value);
        if (c == -1 && PyErr_Occurred()) return NULL;
        if (c < 0 || c >= K.n_dtypes || PyTuple_GET_ITEM(dtypes, c) == Py_None) {
            PyErr_Format(PyExc_ValueError, "hotpath constants: dtype code %zd is not in the dtype table", c);
            return NULL;
        }
    }
    PyObject *states = kwarg(kwargs, "states");
    uint32_t st[6];
    if (states == NULL || !PyArg_ParseTuple(states, "IIIIII", &st[0], &st[1], &st[2], &st[3], &st[4], &st[5]))
        return NULL;
    K.st_free = st[0]; K.st_writing = st[1]; K.st_ready = st[2]; K.st_running = st[3]; K.st_done = st[4];
    K.st_error = st[5];
    PyObject *wake = kwarg(kwargs, "wake_all");
    if (wake == NULL) return NULL;
    K.wake_all = (uint32_t)PyLong_AsUnsignedLong(wake);
    if (PyErr_Occurred()) return NULL;

    PyObject *le = kwarg(kwargs, "layout_error"), *sc = kwarg(kwargs, "slot_conflict");
    PyObject *sr = kwarg(kwargs, "slot_request"), *dc = kwarg(kwargs, "dtype_code");
    PyObject *sn = kwarg(kwargs, "state_name"), *me = kwarg(kwargs, "error"), *ec = kwarg(kwargs, "error_code");
    if (!le || !sc || !sr || !dc || !sn || !me || !ec) return NULL;
    keep(&LayoutError, le); keep(&SlotConflict, sc); keep(&SlotRequest, sr); keep(&DtypeCode, dc);
    keep(&StateName, sn); keep(&MakeError, me); keep(&ErrorCodeType, ec);
    keep(&dtypes_by_code, dtypes); keep(&dtype_names, names); keep(&code_of_dtype, codes);
    keep(&no_zero_copy_bytes, nzcb); keep(&constants_dict, d);
    const char *code_names[] = {"INTERNAL", "BAD_INPUT", "BAD_REGION", "BAD_DTYPE"};
    uint32_t *code_slots[] = {&code_internal, &code_bad_input, &code_bad_region, &code_bad_dtype};
    for (int i = 0; i < 4; i++) {
        PyObject *member = PyObject_GetAttrString(ec, code_names[i]);
        if (member == NULL) return NULL;
        *code_slots[i] = (uint32_t)PyLong_AsUnsignedLong(member);
        Py_DECREF(member);
        if (PyErr_Occurred()) return NULL;
    }
    K.ready = 1;
    Py_RETURN_NONE;
}

static PyObject *
constants(PyObject *self, PyObject *unused)
{
    if (not_ready()) return NULL;
    return PyDict_Copy(constants_dict);
}

/* -- words and fields ------------------------------------------------------------------ */

static inline uint64_t ld64(const char *p) { return __atomic_load_n((const uint64_t *)p, __ATOMIC_ACQUIRE); }
static inline uint32_t ld32(const char *p) { return __atomic_load_n((const uint32_t *)p, __ATOMIC_ACQUIRE); }
static inline void st64(char *p, uint64_t v) { __atomic_store_n((uint64_t *)p, v, __ATOMIC_RELEASE); }
static inline int cas64(char *p, uint64_t expected, uint64_t desired)
{
    return __atomic_compare_exchange_n((uint64_t *)p, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}
static inline uint64_t add64(char *p, uint64_t d) { return __atomic_fetch_add((uint64_t *)p, d, __ATOMIC_SEQ_CST); }
static inline uint32_t add32(char *p, uint32_t d) { return __atomic_fetch_add((uint32_t *)p, d, __ATOMIC_SEQ_CST); }

static inline uint64_t get64(const char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint32_t get32(const char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint16_t get16(const char *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline void put64(char *p, uint64_t v) { memcpy(p, &v, 8); }
static inline void put32(char *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put16(char *p, uint16_t v) { memcpy(p, &v, 2); }

static inline uint64_t pack(uint64_t generation, uint32_t state)
{
    return ((generation & K.generation_mask) << 32) | state;
}

static uint64_t
now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.monotonic_ns() */
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static long
sys_futex(void *addr, int op, uint32_t val, const struct timespec *timeout)
{
    return syscall(SYS_futex, addr, op, val, timeout, NULL, 0);
}

static inline void
cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* -- arguments ----------------------------------------------------------------------- */

static int
nargs(const char *name, Py_ssize_t n, Py_ssize_t lo, Py_ssize_t hi)
{
    if (n < lo || n > hi) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd to %zd arguments (%zd given)", name, lo, hi, n);
        return 0;
    }
    return 1;
}

static int
u64_arg(PyObject *v, uint64_t max, uint64_t *out)
{
    if (!PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "an int is required, not %.100s", Py_TYPE(v)->tp_name);
        return -1;
    }
    unsigned long long x = PyLong_AsUnsignedLongLong(v);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    if (x > max) {
        PyErr_Format(PyExc_OverflowError, "%llu is out of range (at most %llu)", x, (unsigned long long)max);
        return -1;
    }
    *out = x;
    return 0;
}

static int
ssize_arg(PyObject *v, Py_ssize_t *out)
{
    uint64_t x;
    if (u64_arg(v, PY_SSIZE_T_MAX, &x) < 0) return -1;
    *out = (Py_ssize_t)x;
    return 0;
}

/* The optional `now` argument: 0 or absent reads the clock. */
static int
now_arg(PyObject *const *args, Py_ssize_t n, Py_ssize_t at, uint64_t *out)
{
    uint64_t v = 0;
    if (n > at && u64_arg(args[at], UINT64_MAX, &v) < 0) return -1;
    *out = v ? v : now_ns();
    return 0;
}

/* A writable (or readable) export of `obj`, 8-byte aligned, at least `need` bytes. */
static char *
export(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t need)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE | (writable ? PyBUF_WRITABLE : 0)) != 0) return NULL;
    if (view->len < need || ((uintptr_t)view->buf) % 8 != 0) {
        PyErr_Format(PyExc_ValueError, "a %zd-byte buffer (aligned to 8: %s) cannot hold this slot table (%zd bytes)",
                     view->len, ((uintptr_t)view->buf) % 8 ? "no" : "yes", need);
        PyBuffer_Release(view);
        return NULL;
    }
    return (char *)view->buf;
}

/* A slot table: geometry.slot_table_off and geometry.slot_count, checked against the buffer. */
typedef struct {
    Py_ssize_t table_off, count;
} table_t;

static int
table_of(PyObject *geometry, table_t *t)
{
    PyObject *off = PyObject_GetAttrString(geometry, "slot_table_off");
    if (off == NULL) return -1;
    int rc = ssize_arg(off, &t->table_off);
    Py_DECREF(off);
    if (rc < 0) return -1;
    PyObject *count = PyObject_GetAttrString(geometry, "slot_count");
    if (count == NULL) return -1;
    rc = ssize_arg(count, &t->count);
    Py_DECREF(count);
    if (rc < 0) return -1;
    if (t->table_off % 8 || t->count > (PY_SSIZE_T_MAX - t->table_off) / K.slot_size) {
        PyErr_SetString(PyExc_ValueError, "slot table out of range");
        return -1;
    }
    return 0;
}

static inline Py_ssize_t table_end(const table_t *t) { return t->table_off + t->count * K.slot_size; }

static const table_t *
lane_table(void)
{
    static table_t lane;
    lane.table_off = K.lane_slot_table_off;
    lane.count = K.lane_slots;
    return &lane;
}

static int
slot_index(const table_t *t, PyObject *v, Py_ssize_t *out)
{
    uint64_t x;
    if (u64_arg(v, UINT64_MAX, &x) < 0) return -1;
    if (x >= (uint64_t)t->count) {
        PyErr_Format(LayoutError, "slot index %llu out of range 0..%zd", (unsigned long long)x, t->count - 1);
        return -1;
    }
    *out = (Py_ssize_t)x;
    return 0;
}

static inline char *slot_at(char *base, const table_t *t, Py_ssize_t i) { return base + t->table_off + i * K.slot_size; }
static inline char *tensor_at(char *slot, Py_ssize_t t) { return slot + K.tensors_off + t * K.tensor_size; }

static PyObject *
layout_error(const char *format, ...)
{
    va_list va;
    va_start(va, format);
    PyObject *msg = PyUnicode_FromFormatV(format, va);
    va_end(va);
    if (msg != NULL) {
        PyErr_SetObject(LayoutError, msg);
        Py_DECREF(msg);
    }
    return NULL;
}

/* Raise the exception instance `make(args)` returns (factories handed to configure). */
static PyObject *
raise_made(PyObject *make, PyObject *args)
{
    if (args == NULL) return NULL;
    PyObject *exc = PyObject_CallObject(make, args);
    Py_DECREF(args);
    if (exc == NULL) return NULL;
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
    return NULL;
}

/* ShmserveError(ErrorCode.from_number(code), message) */
static PyObject *
client_error(uint32_t code, PyObject *message)
{
    if (message == NULL) return NULL;
    return raise_made(MakeError, Py_BuildValue("(IN)", code, message));
}

/* SlotConflict(index, (generation, state) expected, (generation, state) found) */
static PyObject *
slot_conflict(Py_ssize_t index, uint64_t expected, uint64_t found)
{
    return raise_made(SlotConflict, Py_BuildValue("(n(KI)(KI))", index, (unsigned long long)(expected >> 32),
                                                  (unsigned)(expected & 0xFFFFFFFFu),
                                                  (unsigned long long)(found >> 32), (unsigned)(found & 0xFFFFFFFFu)));
}

/* A (code, message) failure as the reference returns it: (ErrorCode(code), message). */
static PyObject *
failure(long code, PyObject *message)
{
    if (message == NULL) return NULL;
    PyObject *member = PyObject_CallFunction(ErrorCodeType, "l", code);
    if (member == NULL) {
        Py_DECREF(message);
        return NULL;
    }
    return Py_BuildValue("(NN)", member, message);
}

/* -- ring push and doorbell (shmserve.rings: Ring.push, FutexDoorbell.notify) ----------- */

static int
ring_push(char *ring, Py_ssize_t capacity, uint64_t value)
{
    uint64_t tail = ld64(ring + K.ring_tail);
    if (tail - ld64(ring + K.ring_head) >= (uint64_t)capacity) return 0; /* full, or indices corrupt */
    st64(ring + K.ring_entries + 8 * (Py_ssize_t)(tail & (uint64_t)(capacity - 1)), value);
    /* Order matters here: the entry is written before tail publishes it. */
    st64(ring + K.ring_tail, tail + 1);
    return 1;
}

static void
ring_notify(char *ring)
{
    add32(ring + K.ring_seq, 1);
    if (add32(ring + K.ring_waiters, 0)) sys_futex(ring + K.ring_seq, FUTEX_WAKE, K.wake_all, NULL);
}

static inline int ring_empty(const char *ring) { return ld64(ring + K.ring_head) == ld64(ring + K.ring_tail); }

/* -- tensor descriptors (layout.encode_tensor / layout.decode_tensor) --------------------- */

/* The code of a dtype: the table's, else whatever layout.dtype_code says (or raises). */
static int
code_of(PyObject *dtype, Py_ssize_t *code)
{
    PyObject *c = PyDict_GetItemWithError(code_of_dtype, dtype); /* borrowed */
    if (c == NULL) {
        if (PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) return -1;
            PyErr_Clear(); /* unhashable: layout.dtype_code lets numpy say what it is */
        }
        c = PyObject_CallOneArg(DtypeCode, dtype);
        if (c == NULL) return -1;
        int rc = ssize_arg(c, code);
        Py_DECREF(c);
        if (rc == 0 && (*code >= K.n_dtypes || PyTuple_GET_ITEM(dtypes_by_code, *code) == Py_None)) {
            PyErr_Format(PyExc_ValueError, "layout.dtype_code returned %zd, not a code of the table", *code);
            return -1;
        }
        return rc;
    }
    if (ssize_arg(c, code) < 0) return -1;
    if (*code >= K.n_dtypes) { /* configure checked the table: never */
        PyErr_SetString(PyExc_ValueError, "dtype code outside the table");
        return -1;
    }
    return 0;
}

/* prod(dims[:ndim]) * itemsize as a Python int (the exact number, for messages). */
static PyObject *
big_size(const int64_t *dims, Py_ssize_t ndim, uint64_t itemsize)
{
    PyObject *acc = PyLong_FromUnsignedLongLong(itemsize);
    for (Py_ssize_t i = 0; acc != NULL && i < ndim; i++) {
        PyObject *d = PyLong_FromLongLong(dims[i]);
        PyObject *next = d ? PyNumber_Multiply(acc, d) : NULL;
        Py_XDECREF(d);
        Py_SETREF(acc, next);
    }
    return acc;
}

/* prod(dims) * itemsize in *out; 1 if it does not fit in 64 bits (a zero dim makes it 0). */
static int
size_overflows(const int64_t *dims, Py_ssize_t ndim, uint64_t itemsize, uint64_t *out)
{
    uint64_t acc = itemsize;
    int over = 0;
    for (Py_ssize_t i = 0; i < ndim; i++) {
        if (dims[i] == 0) {
            *out = 0;
            return 0;
        }
        over |= __builtin_mul_overflow(acc, (uint64_t)dims[i], &acc);
    }
    *out = acc;
    return over;
}

/* Write descriptor `t` of the slot at `slot`: layout.encode_tensor, its checks (in its order)
 * and messages.  `nbytes_obj` NULL or None: what the shape says (a bytes tensor needs it). */
static int
encode_tensor(char *slot, Py_ssize_t t, uint32_t role, PyObject *name_obj, PyObject *dtype, PyObject *shape_obj,
              PyObject *offset_obj, uint64_t region, PyObject *nbytes_obj)
{
    PyObject *shape = PySequence_Tuple(shape_obj);
    if (shape == NULL) return -1;
    int rc = -1;
    Py_ssize_t ndim = PyTuple_GET_SIZE(shape), code;
    int64_t dims[MAX_DIMS_CAP] = {0};
    int huge = 0; /* a dimension beyond int64: no descriptor holds it */
    if (ndim > K.max_dims) {
        layout_error("rank %zd exceeds the maximum of %zd", ndim, K.max_dims);
        goto done;
    }
    for (Py_ssize_t i = 0; i < ndim; i++) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(shape, i), &overflow);
        if (v == -1 && PyErr_Occurred()) goto done;
        if (overflow < 0 || (overflow == 0 && v < 0)) {
            layout_error("negative dimension in shape %R", shape);
            goto done;
        }
        huge |= overflow > 0;
        dims[i] = overflow ? INT64_MAX : (int64_t)v;
    }
    if (huge) { /* no dimension of a descriptor holds it (numpy makes no such array) */
        layout_error("shape %R does not fit a tensor descriptor", shape);
        goto done;
    }
    if (code_of(dtype, &code) < 0) goto done;
    uint64_t size, nbytes = 0;
    int over = size_overflows(dims, ndim, K.itemsize[code], &size);
    int given = nbytes_obj != NULL && nbytes_obj != Py_None, fits = 0; /* fits: 0 <= nbytes < 2**64 */
    if (given) {
        if (!PyLong_Check(nbytes_obj)) {
            PyErr_Format(PyExc_TypeError, "nbytes must be an int, not %.100s", Py_TYPE(nbytes_obj)->tp_name);
            goto done;
        }
        nbytes = (uint64_t)PyLong_AsUnsignedLongLong(nbytes_obj);
        fits = !(nbytes == (uint64_t)-1 && PyErr_Occurred());
        PyErr_Clear(); /* negative or 2**64 and more: never the right size */
    }
    if (code == K.bytes_code) { /* layout: nbytes is None or not size <= nbytes < 2**64 */
        if (!given || !fits || over || nbytes < size) {
            PyObject *big = big_size(dims, ndim, K.itemsize[code]);
            if (big == NULL) goto done;
            layout_error("a bytes tensor of shape %R needs its nbytes, at least %S; got %S", shape, big,
                         given ? nbytes_obj : Py_None);
            Py_DECREF(big);
            goto done;
        }
    } else if (given) {
        if (!fits || over || nbytes != size) {
            PyObject *big = big_size(dims, ndim, K.itemsize[code]);
            if (big == NULL) goto done;
            layout_error("shape %R of %S is %S bytes, not %S", shape, PyTuple_GET_ITEM(dtype_names, code), big,
                         nbytes_obj);
            Py_DECREF(big);
            goto done;
        }
    } else if (over) {
        layout_error("shape %R does not fit a tensor descriptor", shape);
        goto done;
    } else {
        nbytes = size;
    }
    if (t >= K.max_tensors) {
        layout_error("tensor index %zd out of range 0..%zd", t, K.max_tensors - 1);
        goto done;
    }
    uint64_t name_index, offset;
    if (u64_arg(name_obj, 255, &name_index) < 0 || u64_arg(offset_obj, UINT64_MAX, &offset) < 0) goto done;
    char *p = tensor_at(slot, t);
    p[K.t_dtype_off] = (char)code;
    p[K.t_ndim_off] = (char)ndim;
    p[K.t_role_off] = (char)role;
    p[K.t_name_off] = (char)name_index;
    put32(p + K.t_region_off, (uint32_t)region);
    put64(p + K.t_offset_off, offset);
    put64(p + K.t_nbytes_off, nbytes);
    for (Py_ssize_t i = 0; i < K.max_dims; i++) put64(p + K.t_shape_off + 8 * i, (uint64_t)dims[i]);
    rc = 0;
done:
    Py_DECREF(shape);
    return rc;
}

/* One decoded descriptor (layout.TensorDesc), and its shape as a tuple. */
typedef struct {
    uint32_t code, role, name_index, region;
    uint64_t offset, nbytes;
    PyObject *shape; /* new reference when decode_tensor returns 0 */
} desc_t;

/* Validate the descriptor bytes at `p` (copied out already: read once) against region
 * `region_id` of `region_size` bytes: layout.decode_tensor, its checks (in its order) and
 * messages.  0: valid; 1: rejected, *why the message; -1: a Python error. */
static int
decode_tensor(const char *p, uint32_t region_id, uint64_t region_size, desc_t *d, PyObject **why)
{
    uint32_t code = (uint8_t)p[K.t_dtype_off], ndim = (uint8_t)p[K.t_ndim_off];
    d->role = (uint8_t)p[K.t_role_off];
    d->name_index = (uint8_t)p[K.t_name_off];
    d->region = get32(p + K.t_region_off);
    d->offset = get64(p + K.t_offset_off);
    d->nbytes = get64(p + K.t_nbytes_off);
    d->code = code;
    d->shape = NULL;
    *why = NULL;
    if (code >= K.n_dtypes || PyTuple_GET_ITEM(dtypes_by_code, code) == Py_None) {
        *why = PyUnicode_FromFormat("unknown dtype code %u", code);
        return *why ? 1 : -1;
    }
    if (ndim > K.max_dims) {
        *why = PyUnicode_FromFormat("tensor rank %u exceeds %zd", ndim, K.max_dims);
        return *why ? 1 : -1;
    }
    if (d->role != (uint32_t)K.role_input && d->role != (uint32_t)K.role_output) {
        *why = PyUnicode_FromFormat("unknown tensor role %u", d->role);
        return *why ? 1 : -1;
    }
    int64_t dims[MAX_DIMS_CAP];
    int negative = 0;
    PyObject *shape = PyTuple_New(ndim);
    if (shape == NULL) return -1;
    for (uint32_t i = 0; i < ndim; i++) {
        dims[i] = (int64_t)get64(p + K.t_shape_off + 8 * i);
        negative |= dims[i] < 0;
        PyObject *v = PyLong_FromLongLong(dims[i]);
        if (v == NULL) {
            Py_DECREF(shape);
            return -1;
        }
        PyTuple_SET_ITEM(shape, i, v);
    }
    if (negative) {
        *why = PyUnicode_FromFormat("negative dimension in shape %R", shape);
        goto rejected;
    }
    uint64_t expected;
    int over = size_overflows(dims, ndim, K.itemsize[code], &expected);
    int is_bytes = code == (uint32_t)K.bytes_code;
    if (over || (expected != d->nbytes && (!is_bytes || d->nbytes < expected))) {
        PyObject *big = big_size(dims, ndim, K.itemsize[code]);
        if (big == NULL) goto failed;
        *why = PyUnicode_FromFormat("shape %R of %S is %s%S bytes, descriptor says %llu", shape,
                                    PyTuple_GET_ITEM(dtype_names, code), is_bytes ? "at least " : "", big,
                                    (unsigned long long)d->nbytes);
        Py_DECREF(big);
        goto rejected;
    }
    if (d->offset % (uint64_t)K.tensor_align) {
        *why = PyUnicode_FromFormat("tensor offset %llu is not %zd-byte aligned", (unsigned long long)d->offset,
                                    K.tensor_align);
        goto rejected;
    }
    if (d->region == 0) { /* a lane never names the arena's data region */
        *why = PyUnicode_FromFormat("tensor [%llu, +%llu) lies outside the data region", (unsigned long long)d->offset,
                                    (unsigned long long)d->nbytes);
        goto rejected;
    }
    if (d->region != region_id) {
        *why = PyUnicode_FromFormat("tensor lies in unknown region %u", d->region);
        goto rejected;
    }
    if ((unsigned __int128)d->offset + d->nbytes > region_size) {
        *why = PyUnicode_FromFormat("tensor [%llu, +%llu) lies outside region %u (%llu bytes)",
                                    (unsigned long long)d->offset, (unsigned long long)d->nbytes, d->region,
                                    (unsigned long long)region_size);
        goto rejected;
    }
    d->shape = shape;
    return 0;
rejected:
    Py_DECREF(shape);
    return *why ? 1 : -1;
failed:
    Py_DECREF(shape);
    return -1;
}

/* -- the client's part -------------------------------------------------------------------- */

static PyObject *
submit(PyObject *self, PyObject *const *args, Py_ssize_t n)
{
    if (not_ready() || !nargs("submit", n, 8, 13)) return NULL;
    Py_ssize_t index;
    uint64_t region, request_id, model_id, out_off, out_cap, now, priority = 0, deadline = 0, flags = 0, caller = 0;
    if (slot_index(lane_table(), args[1], &index) < 0 || u64_arg(args[2], UINT32_MAX, &region) < 0 ||
        u64_arg(args[3], UINT64_MAX, &request_id) < 0 || u64_arg(args[4], UINT32_MAX, &model_id) < 0 ||
        u64_arg(args[6], UINT64_MAX, &out_off) < 0 || u64_arg(args[7], UINT64_MAX, &out_cap) < 0 ||
        now_arg(args, n, 8, &now) < 0 || (n > 9 && u64_arg(args[9], UINT32_MAX, &priority) < 0) ||
        (n > 10 && u64_arg(args[10], UINT64_MAX, &deadline) < 0) ||
        (n > 11 && u64_arg(args[11], UINT32_MAX, &flags) < 0) || (n > 12 && u64_arg(args[12], UINT32_MAX, &caller) < 0))
        return NULL;
    PyObject *inputs = PySequence_Fast(args[5], "inputs must be a sequence of (input index, offset, view)");
    if (inputs == NULL) return NULL;
    Py_buffer view;
    char *base = export(args[0], &view, 1, K.lane_bytes);
    if (base == NULL) {
        Py_DECREF(inputs);
        return NULL;
    }
    PyObject *result = NULL;
    char *slot = slot_at(base, lane_table(), index), *status = slot + K.status_off;
    uint64_t generation = ld64(status) >> 32, next = (generation + 1) & K.generation_mask;
    if (!cas64(status, pack(generation, K.st_free), pack(next, K.st_writing))) {
        /* only this client writes a free slot: its lane was overwritten */
        client_error(code_internal, PyUnicode_FromFormat("lane slot %zd is not free", index));
        goto done;
    }
    Py_ssize_t n_inputs = PySequence_Fast_GET_SIZE(inputs);
    for (Py_ssize_t t = 0; t < n_inputs; t++) {
        PyObject *item = PySequence_Fast(PySequence_Fast_GET_ITEM(inputs, t), "an input must be (input index, offset, view)");
        if (item == NULL) goto revert;
        if (PySequence_Fast_GET_SIZE(item) != 3) {
            PyErr_Format(PyExc_ValueError, "an input is (input index, offset, view), not %zd values",
                         PySequence_Fast_GET_SIZE(item));
            Py_DECREF(item);
            goto revert;
        }
        PyObject *arr = PySequence_Fast_GET_ITEM(item, 2);
        PyObject *dtype = PyObject_GetAttrString(arr, "dtype");
        PyObject *shape = dtype ? PyObject_GetAttrString(arr, "shape") : NULL;
        int rc = shape ? encode_tensor(slot, t, (uint32_t)K.role_input, PySequence_Fast_GET_ITEM(item, 0), dtype, shape,
                                       PySequence_Fast_GET_ITEM(item, 1), region, NULL) : -1;
        Py_XDECREF(dtype);
        Py_XDECREF(shape);
        Py_DECREF(item);
        if (rc < 0) goto revert;
    }
    if (n_inputs > UINT16_MAX) { /* unreachable: descriptor 16 raised already */
        PyErr_SetString(PyExc_OverflowError, "too many inputs");
        goto revert;
    }
    char *req = slot + K.request_id_off;
    memset(req, 0, K.request_span); /* outputs and error cleared: layout.encode_slot_request */
    put64(slot + K.request_id_off, request_id);
    put32(slot + K.model_id_off, (uint32_t)model_id);
    put32(slot + K.worker_off, 0);
    put16(slot + K.n_inputs_off, (uint16_t)n_inputs);
    put32(slot + K.out_region_off, (uint32_t)region);
    put64(slot + K.out_off_off, out_off);
    put64(slot + K.out_capacity_off, out_cap);
    put32(slot + K.flags_off, (uint32_t)flags);
    put32(slot + K.priority_off, (uint32_t)priority); /* how to schedule it: layout.encode_slot_request */
    put32(slot + K.priority_off + 4, (uint32_t)caller); /* caller: heeded in a door's lane only */
    put64(slot + K.deadline_off, deadline);
    memset(slot + K.stages_off, 0, 8 * K.n_stages); /* layout.reset_stages */
    put64(slot + K.stages_off + 8 * K.stage_acquired, now);
    put64(slot + K.stages_off + 8 * K.stage_ready, now);
    /* Order matters here: descriptors (and the caller's input bytes) are complete before READY. */
    if (!cas64(status, pack(next, K.st_writing), pack(next, K.st_ready))) {
        slot_conflict(index, pack(next, K.st_writing), ld64(status));
        goto done;
    }
    char *ring = base + K.lane_submission_off;
    ring_push(ring, K.lane_ring_capacity, (next << 32) | (uint64_t)index); /* never full: one entry per slot */
    ring_notify(ring); /* a syscall only if the worker sleeps */
    result = PyLong_FromUnsignedLongLong(next);
    goto done;
revert: /* the slot is FREE again, its new generation kept */
    cas64(status, pack(next, K.st_writing), pack(next, K.st_free));
done:
    PyBuffer_Release(&view);
    Py_DECREF(inputs);
    return result;
}

static inline int
is_finished(uint64_t word, uint64_t generation)
{
    uint32_t state = (uint32_t)word;
    return (word >> 32) == generation && (state == K.st_done || state == K.st_error);
}

static PyObject *
finished(PyObject *self, PyObject *const *args, Py_ssize_t n)
{
    if (not_ready() || !nargs("finished", n, 3, 3)) return NULL;
    Py_ssize_t index;
    uint64_t generation;
    if (slot_index(lane_table(), args[1], &index) < 0 || u64_arg(args[2], UINT64_MAX, &generation) < 0) return NULL;
    Py_buffer view;
    char *base = export(args[0], &view, 0, K.lane_bytes);
    if (base == NULL) return NULL;
    int done = is_finished(ld64(slot_at(base, lane_table(), index) + K.status_off), generation);
    PyBuffer_Release(&view);
    return PyBool_FromLong(done);
}

static uint64_t
seconds_ns(double s)
{
    if (!(s > 0.0)) return 0; /* also NaN */
    if (s > 1e9) s = 1e9;
    return (uint64_t)(s * 1e9);
}

static PyObject *
wait_slice(PyObject *self, PyObject *const *args, Py_ssize_t n)
{
    if (not_ready() || !nargs("wait_slice", n, 5, 5)) return NULL;
    Py_ssize_t index;
    uint64_t generation;
    if (slot_index(lane_table(), args[1], &index) < 0 || u64_arg(args[2], UINT64_MAX, &generation) < 0) return NULL;
    double timeout = PyFloat_AsDouble(args[3]), spin = PyFloat_AsDouble(args[4]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer view;
    char *base = export(args[0], &view, 1, K.lane_bytes); /* held: the mapping cannot close under the wait */
    if (base == NULL) return NULL;
    const char *status = slot_at(base, lane_table(), index) + K.status_off;
    char *ring = base + K.lane_completion_off;
    uint64_t start = now_ns(), timeout_ns = seconds_ns(timeout), spin_ns = seconds_ns(spin);
    uint64_t deadline = start + timeout_ns, spin_end = start + (spin_ns < timeout_ns ? spin_ns : timeout_ns);
    int result = 0, interrupted;
    do {
        interrupted = 0;
        Py_BEGIN_ALLOW_THREADS
        for (;;) {
            uint64_t tail = ld64(ring + K.ring_tail);
            if (tail != ld64(ring + K.ring_head)) st64(ring + K.ring_head, tail); /* wake-ups only: dropped */
            if (is_finished(ld64(status), generation)) {
                result = 1;
                break;
            }
            uint64_t t = now_ns();
            if (t >= deadline) break;
            if (t < spin_end) {
                for (int i = 0; i < 64 && ring_empty(ring) && !is_finished(ld64(status), generation); i++) cpu_relax();
                continue;
            }
            /* FutexDoorbell.wait: sequence, then waiters, re-checking the ring between each */
            uint32_t seq = ld32(ring + K.ring_seq);
            if (!ring_empty(ring)) continue;
            add32(ring + K.ring_waiters, 1);
            if (ring_empty(ring)) {
                uint64_t left = deadline - t;
                struct timespec ts = {(time_t)(left / 1000000000u), (long)(left % 1000000000u)};
                if (sys_futex(ring + K.ring_seq, FUTEX_WAIT, seq, &ts) < 0 && errno == EINTR) interrupted = 1;
            }
            add32(ring + K.ring_waiters, (uint32_t)-1);
            if (interrupted) break;
        }
        Py_END_ALLOW_THREADS
        if (interrupted && PyErr_CheckSignals() != 0) { /* e.g. KeyboardInterrupt */
            PyBuffer_Release(&view);
            return NULL;
        }
    } while (interrupted);
    PyBuffer_Release(&view);
    return PyBool_FromLong(result);
}

static PyObject *
read_outputs(char *slot, uint32_t region, uint64_t size, uint64_t out_off, uint64_t out_cap, uint32_t *code)
{
    uint32_t first = get16(slot + K.n_inputs_off), count = get16(slot + K.n_outputs_off);
    PyObject *outputs = PyDict_New();
    if (outputs == NULL) return NULL;
    for (uint32_t t = first; t < first + count; t++) {
        PyObject *why = NULL;
        desc_t d;
        if (t >= (uint32_t)K.max_tensors) {
            why = PyUnicode_FromFormat("tensor index %u out of range 0..%zd", t, K.max_tensors - 1);
        } else {
            char copy[512];
            memcpy(copy, tensor_at(slot, t), K.tensor_size < 512 ? K.tensor_size : 512);
            int rc = decode_tensor(copy, region, size, &d, &why);
            if (rc < 0) goto failed;
            if (rc == 0) {
                if (d.region != region || !(out_off <= d.offset &&
                                            (unsigned __int128)d.offset + d.nbytes <= (unsigned __int128)out_off + out_cap)) {
                    Py_DECREF(d.shape);
                    why = PyUnicode_FromString("an output lies outside the output area");
                } else if (d.code == (uint32_t)K.bytes_code) { /* no view of the region can hold one */
                    Py_DECREF(d.shape);
                    *code = code_bad_dtype;
                    PyObject *msg = PyUnicode_FromFormat("output %u is bytes: %U", d.name_index, no_zero_copy_bytes);
                    Py_DECREF(outputs);
                    return msg;
                } else {
                    PyObject *key = PyLong_FromUnsignedLong(d.name_index);
                    PyObject *value = Py_BuildValue("(ONK)", PyTuple_GET_ITEM(dtypes_by_code, d.code), d.shape,
                                                    (unsigned long long)d.offset);
                    int rc2 = key && value ? PyDict_SetItem(outputs, key, value) : -1;
                    Py_XDECREF(key);
                    Py_XDECREF(value);
                    if (rc2 < 0) goto failed;
                    continue;
                }
            }
        }
        if (why == NULL) goto failed;
        *code = code_internal;
        PyObject *msg = PyUnicode_FromFormat("the worker wrote a bad output descriptor: %U", why);
        Py_DECREF(why);
        Py_DECREF(outputs);
        return msg;
    }
    *code = 0;
    return outputs;
failed:
    Py_DECREF(outputs);
    return NULL;
}

static PyObject *
lane_read(PyObject *self, PyObject *const *args, Py_ssize_t n)
{
    if (not_ready() || !nargs("read", n, 7, 7)) return NULL;
    Py_ssize_t index;
    uint64_t generation, region, out_off, out_cap;
    PyObject *free_list = args[1];
    if (!PyList_Check(free_list)) {
        PyErr_SetString(PyExc_TypeError, "free must be a list");
        return NULL;
    }
    if (slot_index(lane_table(), args[2], &index) < 0 || u64_arg(args[3], UINT64_MAX, &generation) < 0 ||
        u64_arg(args[4], UINT32_MAX, &region) < 0 || u64_arg(args[5], UINT64_MAX, &out_off) < 0 ||
        u64_arg(args[6], UINT64_MAX, &out_cap) < 0)
        return NULL;
    Py_buffer view;
    char *base = export(args[0], &view, 1, K.lane_bytes);
    if (base == NULL) return NULL;
    char *slot = slot_at(base, lane_table(), index), *status = slot + K.status_off;
    uint64_t word = ld64(status);
    uint32_t state = (uint32_t)word, code = 0;
    int done = state == K.st_done || state == K.st_error;
    PyObject *result; /* the outputs (code 0), or the error's message (code) */
    if ((word >> 32) != generation || !done) {
        code = code_internal;
        PyObject *name = PyObject_CallFunction(StateName, "I", state);
        result = name ? PyUnicode_FromFormat("lane slot %zd finished in state %U", index, name) : NULL;
        Py_XDECREF(name);
    } else if (state == K.st_error) {
        code = get32(slot + K.error_code_off);
        uint32_t len = get32(slot + K.error_len_off);
        if (len > (uint32_t)K.error_msg_max) len = (uint32_t)K.error_msg_max;
        result = PyUnicode_DecodeUTF8(slot + K.error_msg_off, len, "replace");
    } else {
        result = read_outputs(slot, (uint32_t)region, (uint64_t)view.len, out_off, out_cap, &code);
    }
    if (done) { /* freed either way */
        uint64_t expected = word, desired = (word & ~(uint64_t)0xFFFFFFFFu) | K.st_free;
        if (!cas64(status, expected, desired)) {
            Py_XDECREF(result);
            PyErr_Clear();
            PyBuffer_Release(&view);
            return slot_conflict(index, expected, ld64(status));
        }
        PyObject *i = PyLong_FromSsize_t(index);
        if (i == NULL || PyList_Append(free_list, i) < 0) {
            Py_XDECREF(i);
            Py_XDECREF(result);
            PyBuffer_Release(&view);
            return NULL;
        }
        Py_DECREF(i);
    }
    PyBuffer_Release(&view);
    if (result == NULL || code == 0) return result;
    return client_error(code, result);
}

/* -- the worker's part -------------------------------------------------------------------- */

static PyObject *
claim(PyObject *self, PyObject *const *args, Py_ssize_t n)
{
    if (not_ready() || !nargs("claim", n, 3, 4)) return NULL;
    table_t t;
    uint64_t entry, now;
    if (table_of(args[1], &t) < 0 || u64_arg(args[2], UINT64_MAX, &entry) < 0 || now_arg(args, n, 3, &now) < 0)
        return NULL;
    uint64_t index = entry & 0xFFFFFFFFu, generation = entry >> 32;
    if (index >= (uint64_t)t.count) Py_RETURN_NONE; /* hostile or corrupt entry: nothing to answer */
    Py_buffer view;
    char *base = export(args[0], &view, 1, table_end(&t));
    if (base == NULL) return NULL;
    char *slot = slot_at(base, &t, (Py_ssize_t)index);
    int ok = cas64(slot + K.status_off, pack(generation, K.st_ready), pack(generation, K.st_running));
    if (ok) put64(slot + K.stages_off + 8 * K.stage_claimed, now);
    PyBuffer_Release(&view);
    if (!ok) Py_RETURN_NONE; /* failed or reused meanwhile */
    return PyLong_FromUnsignedLongLong(index);
}

/* hotpath.claim_checked: Scheduler.alone's rule (reject), then claim, counted. */
static PyObject *
claim_checked(PyObject *self, PyObject *const *args, Py_ssize_t n)
{
    if (not_ready() || !nargs("claim_checked", n, 9, 9)) return NULL;
    table_t t;
    uint64_t entry, now, timeout_ns, exempt, claimed_off, wait_off;
    if (table_of(args[1], &t) < 0 || u64_arg(args[2], UINT64_MAX, &entry) < 0 || now_arg(args, n, 3, &now) < 0 ||
        u64_arg(args[4], UINT64_MAX, &timeout_ns) < 0 || u64_arg(args[5], UINT32_MAX, &exempt) < 0 ||
        u64_arg(args[7], PY_SSIZE_T_MAX, &claimed_off) < 0 || u64_arg(args[8], PY_SSIZE_T_MAX, &wait_off) < 0)
        return NULL;
    uint64_t index = entry & 0xFFFFFFFFu, generation = entry >> 32;
    if (index >= (uint64_t)t.count) Py_RETURN_NONE; /* hostile or corrupt entry: nothing to answer */
    Py_buffer view, counters;
    char *base = export(args[0], &view, 1, table_end(&t));
    if (base == NULL) return NULL;
    if (PyObject_GetBuffer(args[6], &counters, PyBUF_SIMPLE | PyBUF_WRITABLE) != 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    PyObject *result = NULL;
    if ((uint64_t)counters.len < 8 || claimed_off > (uint64_t)counters.len - 8 || wait_off > (uint64_t)counters.len - 8 ||
        ((uintptr_t)counters.buf + claimed_off) % 8 || ((uintptr_t)counters.buf + wait_off) % 8) {
        PyErr_Format(PyExc_ValueError, "the counters (at %llu and %llu) lie outside or unaligned in a %zd-byte buffer",
                     (unsigned long long)claimed_off, (unsigned long long)wait_off, counters.len);
        goto done;
    }
    char *slot = slot_at(base, &t, (Py_ssize_t)index);
    /* what the slot asks (a lane's client wrote it: a wrong value only hurts its own call) */
    uint64_t t_ready = get64(slot + K.stages_off + 8 * K.stage_ready), deadline = get64(slot + K.deadline_off);
    uint32_t flags = get32(slot + K.flags_off);
    if (deadline && deadline <= now) {
        result = PyLong_FromLong(-1); /* hotpath.EXPIRED_DEADLINE */
        goto done;
    }
    if (timeout_ns && !(flags & (uint32_t)exempt)) {
        uint64_t since = (t_ready && t_ready <= now) ? t_ready : now;
        if (since + timeout_ns >= since && since + timeout_ns <= now) { /* (a sum that wraps is past any now) */
            result = PyLong_FromLong(-2); /* hotpath.EXPIRED_QUEUE */
            goto done;
        }
    }
    if (!cas64(slot + K.status_off, pack(generation, K.st_ready), pack(generation, K.st_running))) {
        Py_INCREF(Py_None); /* failed or reused meanwhile */
        result = Py_None;
        goto done;
    }
    put64(slot + K.stages_off + 8 * K.stage_claimed, now);
    add64((char *)counters.buf + claimed_off, 1);
    if (t_ready && t_ready < now) add64((char *)counters.buf + wait_off, (now - t_ready) / 1000);
    result = PyLong_FromUnsignedLongLong(index);
done:
    PyBuffer_Release(&counters);
    PyBuffer_Release(&view);
    return result;
}

static PyObject *
decode_lane(PyObject *self, PyObject *const *args, Py_ssize_t n)
{
    if (not_ready() || !nargs("decode_lane", n, 5, 5)) return NULL;
    Py_ssize_t index;
    uint64_t region, floor, n_names;
    if (slot_index(lane_table(), args[1], &index) < 0 || u64_arg(args[2], UINT32_MAX, &region) < 0 ||
        u64_arg(args[3], UINT64_MAX, &floor) < 0 || u64_arg(args[4], UINT64_MAX, &n_names) < 0)
        return NULL;
    Py_buffer view;
    char *base = export(args[0], &view, 0, K.lane_bytes);
    if (base == NULL) return NULL;
    const char *slot = slot_at(base, lane_table(), index);
    PyObject *slot_req = NULL, *descs = NULL, *sig = NULL, *fail = NULL, *result = NULL;
    uint32_t n_inputs = get16(slot + K.n_inputs_off);
    slot_req = PyObject_CallFunction(SlotRequest, "KIIHHIIKK", (unsigned long long)get64(slot + K.request_id_off),
                                     get32(slot + K.model_id_off), get32(slot + K.worker_off),
                                     (unsigned short)n_inputs, (unsigned short)get16(slot + K.n_outputs_off),
                                     get32(slot + K.flags_off), get32(slot + K.out_region_off),
                                     (unsigned long long)get64(slot + K.out_off_off),
                                     (unsigned long long)get64(slot + K.out_capacity_off));
    descs = slot_req ? PyList_New(0) : NULL;
    if (descs == NULL) goto done;
    if (!(0 < n_inputs && n_inputs <= n_names) || n_inputs >= (uint32_t)K.max_tensors) {
        fail = failure(code_bad_input, PyUnicode_FromFormat("slot has %u inputs", n_inputs));
        goto finish;
    }
    for (uint32_t t = 0; t < n_inputs; t++) {
        char copy[512]; /* the client may rewrite it meanwhile: read once, check the copy */
        memcpy(copy, tensor_at((char *)slot, t), K.tensor_size < 512 ? K.tensor_size : 512);
        if (get32(copy + K.t_region_off) != (uint32_t)region) {
            fail = failure(code_bad_region, PyUnicode_FromFormat("input %u must lie in this lane's region %u at offset "
                                                                 "%llu or above", t, (unsigned)region,
                                                                 (unsigned long long)floor));
            goto finish;
        }
        desc_t d;
        PyObject *why;
        int rc = decode_tensor(copy, (uint32_t)region, (uint64_t)view.len, &d, &why);
        if (rc < 0) goto done;
        if (rc > 0) {
            PyObject *msg = PyUnicode_FromFormat("input descriptor rejected: %U", why);
            Py_DECREF(why);
            fail = failure(code_bad_region, msg);
            goto finish;
        }
        if (d.offset < floor) {
            Py_DECREF(d.shape);
            fail = failure(code_bad_region, PyUnicode_FromFormat("input %u must lie in this lane's region %u at offset "
                                                                 "%llu or above", t, (unsigned)region,
                                                                 (unsigned long long)floor));
            goto finish;
        }
        if (d.role != (uint32_t)K.role_input || d.name_index >= n_names) {
            Py_DECREF(d.shape);
            fail = failure(code_bad_input, PyUnicode_FromFormat("tensor %u is not an input of this model", t));
            goto finish;
        }
        PyObject *desc = Py_BuildValue("(IONKK)", d.name_index, PyTuple_GET_ITEM(dtypes_by_code, d.code), d.shape,
                                       (unsigned long long)d.offset, (unsigned long long)d.nbytes);
        if (desc == NULL || PyList_Append(descs, desc) < 0) {
            Py_XDECREF(desc);
            goto done;
        }
        Py_DECREF(desc);
    }
    Py_ssize_t count = PyList_GET_SIZE(descs);
    sig = PyTuple_New(count);
    if (sig == NULL) goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *desc = PyList_GET_ITEM(descs, i);
        PyObject *part = PyTuple_GetSlice(desc, 0, 3);
        if (part == NULL) goto done;
        PyTuple_SET_ITEM(sig, i, part);
    }
finish:
    if (fail == NULL && sig == NULL) goto done; /* a failure that could not be made */
    result = Py_BuildValue("(OOOO)", slot_req, descs, sig ? sig : Py_None, fail ? fail : Py_None);
done:
    Py_XDECREF(slot_req);
    Py_XDECREF(descs);
    Py_XDECREF(sig);
    Py_XDECREF(fail);
    PyBuffer_Release(&view);
    return result;
}

static PyObject *
encode_outputs(PyObject *self, PyObject *const *args, Py_ssize_t n)
{
    if (not_ready() || !nargs("encode_outputs", n, 6, 6)) return NULL;
    table_t t;
    Py_ssize_t index, first;
    uint64_t region;
    if (table_of(args[1], &t) < 0 || slot_index(&t, args[2], &index) < 0 || ssize_arg(args[3], &first) < 0 ||
        u64_arg(args[4], UINT32_MAX, &region) < 0)
        return NULL;
    PyObject *outputs = PySequence_Fast(args[5], "outputs must be a sequence of (offset, shape, dtype, nbytes)");
    if (outputs == NULL) return NULL;
    Py_buffer view;
    char *base = export(args[0], &view, 1, table_end(&t));
    if (base == NULL) {
        Py_DECREF(outputs);
        return NULL;
    }
    char *slot = slot_at(base, &t, index);
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(outputs); i++) {
        PyObject *item = PySequence_Fast(PySequence_Fast_GET_ITEM(outputs, i), "an output is (offset, shape, dtype, nbytes)");
        if (item == NULL) goto done;
        if (PySequence_Fast_GET_SIZE(item) != 4) {
            PyErr_SetString(PyExc_ValueError, "an output is (offset, shape, dtype, nbytes)");
            Py_DECREF(item);
            goto done;
        }
        PyObject *name = PyLong_FromSsize_t(i);
        Py_ssize_t tensor = first > PY_SSIZE_T_MAX - i ? PY_SSIZE_T_MAX : first + i;
        int rc = name ? encode_tensor(slot, tensor, (uint32_t)K.role_output, name, PySequence_Fast_GET_ITEM(item, 2),
                                      PySequence_Fast_GET_ITEM(item, 1), PySequence_Fast_GET_ITEM(item, 0), region,
                                      PySequence_Fast_GET_ITEM(item, 3)) : -1;
        Py_XDECREF(name);
        Py_DECREF(item);
        if (rc < 0) goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&view);
    Py_DECREF(outputs);
    return result;
}

/* A ring object's (offset, capacity), checked to lie in `view` (its buffer must be `buf`). */
static int
ring_of(PyObject *ring, PyObject *buf, const Py_buffer *view, Py_ssize_t *off, Py_ssize_t *capacity)
{
    PyObject *rbuf = PyObject_GetAttrString(ring, "buf");
    if (rbuf == NULL) return -1;
    int same = rbuf == buf;
    Py_DECREF(rbuf);
    PyObject *o = same ? PyObject_GetAttrString(ring, "offset") : NULL;
    PyObject *c = o ? PyObject_GetAttrString(ring, "capacity") : NULL;
    int rc = c ? (ssize_arg(o, off) < 0 || ssize_arg(c, capacity) < 0 ? -1 : 0) : -1;
    Py_XDECREF(o);
    Py_XDECREF(c);
    if (!same) PyErr_SetString(PyExc_ValueError, "the completion ring must lie in the slots' buffer");
    if (rc < 0) return -1;
    if (*capacity < 1 || (*capacity & (*capacity - 1)) || *off % 8 ||
        *capacity > (view->len / 8) || *off > view->len - K.ring_entries - 8 * *capacity) {
        PyErr_SetString(PyExc_ValueError, "the completion ring lies outside its buffer");
        return -1;
    }
    return 0;
}

static int
counter_at(const Py_buffer *view, Py_ssize_t off, Py_ssize_t width)
{
    if (off % 8 || off > view->len - width) {
        PyErr_Format(PyExc_ValueError, "offset %zd out of range for %zd bytes in a %zd-byte arena", off, width, view->len);
        return -1;
    }
    return 0;
}

static PyObject *
publish(PyObject *self, PyObject *const *args, Py_ssize_t n)
{
    if (not_ready() || !nargs("publish", n, 12, 13)) return NULL;
    table_t t;
    Py_ssize_t index, requests_off, errors_off, hist_off, ring_off, capacity;
    uint64_t entry, n_outputs, now, code = 0;
    PyObject *fail = args[5], *message = NULL;
    /* hotpath.ARENA, LANE_FUTEX, LANE_EVENTFD (True and False are 1 and 0) */
    long lane = PyLong_AsLong(args[7]);
    if (lane == -1 && PyErr_Occurred()) return NULL;
    if (lane < 0 || lane > 2) {
        PyErr_SetString(PyExc_ValueError, "lane must be 0, 1 or 2 (hotpath.ARENA, LANE_FUTEX, LANE_EVENTFD)");
        return NULL;
    }
    if (table_of(args[1], &t) < 0 || slot_index(&t, args[2], &index) < 0 ||
        u64_arg(args[3], UINT64_MAX, &entry) < 0 || u64_arg(args[4], UINT16_MAX, &n_outputs) < 0 ||
        ssize_arg(args[9], &requests_off) < 0 || ssize_arg(args[10], &errors_off) < 0 ||
        ssize_arg(args[11], &hist_off) < 0 || now_arg(args, n, 12, &now) < 0)
        return NULL;
    Py_ssize_t msg_len = 0;
    const char *msg = NULL;
    if (fail != Py_None) {
        if (!PyTuple_Check(fail) || PyTuple_GET_SIZE(fail) != 2 || !PyUnicode_Check(PyTuple_GET_ITEM(fail, 1))) {
            PyErr_SetString(PyExc_TypeError, "failure must be None or (code, message)");
            return NULL;
        }
        message = PyTuple_GET_ITEM(fail, 1);
        if (u64_arg(PyTuple_GET_ITEM(fail, 0), UINT32_MAX, &code) < 0) return NULL;
        msg = PyUnicode_AsUTF8AndSize(message, &msg_len);
        if (msg == NULL) return NULL;
        if (msg_len > K.error_msg_max) { /* truncated on a UTF-8 boundary: layout.encode_error */
            msg_len = K.error_msg_max;
            while (msg_len > 0 && (msg[msg_len] & 0xC0) == 0x80) msg_len--;
        }
    }
    Py_buffer view, arena;
    char *base = export(args[0], &view, 1, table_end(&t));
    if (base == NULL) return NULL;
    char *hist = NULL;
    if (ring_of(args[6], args[0], &view, &ring_off, &capacity) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    char *ab = export(args[8], &arena, 1, 0);
    if (ab == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    PyObject *result = NULL;
    if (counter_at(&arena, requests_off, 8) < 0 || counter_at(&arena, errors_off, 8) < 0 ||
        counter_at(&arena, hist_off, K.hist_worker_size) < 0)
        goto done;
    hist = ab + hist_off;
    char *slot = slot_at(base, &t, index), *status = slot + K.status_off;
    uint64_t generation = entry >> 32;
    if (msg != NULL) {
        put32(slot + K.error_code_off, (uint32_t)code);
        put32(slot + K.error_len_off, (uint32_t)msg_len);
        memset(slot + K.error_msg_off, 0, K.error_msg_max);
        memcpy(slot + K.error_msg_off, msg, msg_len);
        n_outputs = 0;
    }
    put16(slot + K.n_outputs_off, (uint16_t)n_outputs);
    put64(slot + K.stages_off + 8 * K.stage_done, now);
    uint32_t to = msg != NULL ? K.st_error : K.st_done;
    /* Order matters here: outputs and descriptors are written before DONE is published. */
    if (!cas64(status, pack(generation, K.st_running), pack(generation, to))) {
        if (lane) { /* the lane's client rewrote a running slot: nothing to publish */
            result = Py_NewRef(Py_False);
        } else {
            slot_conflict(index, pack(generation, K.st_running), ld64(status));
        }
        goto done;
    }
    add64(ab + requests_off, 1);
    if (msg != NULL) add64(ab + errors_off, 1);
    /* layout.record_stages: times a lane's client wrote may be nonsense (end before start: skipped) */
    uint64_t times[MAX_STAGES_CAP];
    for (Py_ssize_t i = 0; i < K.n_stages; i++) times[i] = get64(slot + K.stages_off + 8 * i);
    for (Py_ssize_t i = 0; i < K.n_pairs; i++) {
        uint64_t t0 = times[K.pair_start[i]], t1 = times[K.pair_end[i]];
        if (t0 && t1 >= t0) {
            uint64_t micros = (t1 - t0) / 1000, v = micros ? micros : 1;
            Py_ssize_t bucket = 63 - __builtin_clzll(v);
            if (bucket > K.hist_buckets - 1) bucket = K.hist_buckets - 1;
            add64(hist + K.pair_off[i] + 8 * bucket, 1);
            add64(hist + K.pair_off[i] + K.hist_sum_off, micros);
        }
    }
    /* layout.record_lane_outcome: its version's outcome (canary windows), DONE or ERROR for its own fault */
    if (lane && (msg == NULL || (code < 64 && ((uint64_t)K.lane_fault_mask >> code) & 1))) {
        uint64_t claimed = times[K.stage_claimed];
        if (claimed && now >= claimed) { /* (the client writes the lane: nonsense is no outcome) */
            uint64_t v = (now - claimed) >> K.lane_time_shift, bucket;
            if (v < (1ULL << K.lane_sub_bits)) {
                bucket = v;
            } else {
                uint64_t e = 63 - __builtin_clzll(v), sub = K.lane_sub_bits;
                bucket = ((e - sub + 1) << sub) + ((v >> (e - sub)) & ((1ULL << sub) - 1));
            }
            if (bucket > (uint64_t)K.lane_outcome_buckets - 1) bucket = K.lane_outcome_buckets - 1;
            char *outcomes = hist + K.lane_outcome_off;
            if (msg != NULL) add64(outcomes, 1);
            add64(outcomes + 8 + 8 * bucket, 1);
        }
    }
    char *ring = base + ring_off;
    ring_push(ring, capacity, entry); /* a lane's ring may be full if its client does not drain it: the */
    if (lane == 1) ring_notify(ring); /* entry is only a wake-up there, the status word is the answer */
    result = Py_NewRef(Py_True);
done:
    PyBuffer_Release(&arena);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "configure(constants, **factories)\n\nTake layout.hotpath_constants() and the classes and factories the "
     "functions raise and build (shmserve.hotpath calls this once, at import)."},
    {"constants", constants, METH_NOARGS, "constants() -> dict\n\nWhat configure took."},
    {"submit", (PyCFunction)(void (*)(void))submit, METH_FASTCALL, "hotpath.submit, compiled."},
    {"finished", (PyCFunction)(void (*)(void))finished, METH_FASTCALL, "hotpath.finished, compiled."},
    {"wait_slice", (PyCFunction)(void (*)(void))wait_slice, METH_FASTCALL,
     "hotpath.wait_slice, compiled: spins and sleeps with the GIL released."},
    {"read", (PyCFunction)(void (*)(void))lane_read, METH_FASTCALL, "hotpath.read, compiled."},
    {"claim", (PyCFunction)(void (*)(void))claim, METH_FASTCALL, "hotpath.claim, compiled."},
    {"claim_checked", (PyCFunction)(void (*)(void))claim_checked, METH_FASTCALL, "hotpath.claim_checked, compiled."},
    {"decode_lane", (PyCFunction)(void (*)(void))decode_lane, METH_FASTCALL, "hotpath.decode_lane, compiled."},
    {"encode_outputs", (PyCFunction)(void (*)(void))encode_outputs, METH_FASTCALL, "hotpath.encode_outputs, compiled."},
    {"publish", (PyCFunction)(void (*)(void))publish, METH_FASTCALL, "hotpath.publish, compiled."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shmserve._hotpath",
    "The lane round trip's per-call work, compiled (shmserve.hotpath is the reference and the chooser).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__hotpath(void)
{
    return PyModule_Create(&module);
}
