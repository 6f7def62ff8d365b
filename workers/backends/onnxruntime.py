"""ONNX Runtime backend: CPU, or the CUDA execution provider where it is installed.

Owns: turning an ONNX file into a Backend; reading input/output names,
dtypes and shapes (symbolic dimensions keep their names) from the session;
the two element types numpy and ONNX Runtime do not share:

* ``tensor(bfloat16)`` is shmserve's bfloat16 (``ml_dtypes.bfloat16``, which
  ORT's numpy conversion does not know): such a model runs through an
  ``IOBinding``, each bfloat16 input an ``OrtValue`` over the same memory
  (``ortvalue_from_numpy_with_onnx_type`` on a uint16 view: no copy), every
  output bound to CPU memory and each bfloat16 one copied out of its OrtValue.
* ``tensor(string)`` is shmserve's bytes.  ORT's string tensors hold text:
  an input's elements are decoded as UTF-8 (an element that is not fails the
  request with BAD_INPUT; ORT would take a ``bytes`` element as its repr), and
  an output's ``str`` elements go back as their UTF-8 (the worker does that for
  any bytes output).

A model with neither, on the CPU provider, runs in place (``run_into``,
issue 14 part 5): each input is bound by its address (``IOBinding.bind_input``
over the read-only shared-memory view: ORT takes the pointer and only reads
it), and each output, where its shape follows from the inputs' shapes, is
bound to the view ``allocate`` returns, so ONNX Runtime writes it straight
into the request's output area.  Rules:

* A signature (the inputs' names, dtypes and shapes) is bound only once a
  run has shown that ONNX Runtime's output shapes are the ones the spec
  predicts (``spec_shapes``): the first run of a signature (the warm-up's,
  for batch sizes 1, the preferred ones and the largest) is a plain run whose
  outputs are copied, and checks.  Exporters name dimensions that are not
  equal alike (a pre-allocated output of another shape is an ORT error, not
  a resize), so a prediction is never trusted unchecked.  An output with a
  dimension the inputs do not fix (a data-dependent one) is never bound;
  such a model copies, as before.  ``SIGNATURES_MAX`` signatures are kept.
* After a bound run every output's data pointer is compared with the
  address bound: where ONNX Runtime answered with a buffer of its own (a
  graph input that is also an output does that) the output is copied from
  it, binding is switched off for the model and that is logged once.
* A batch (``accepts_row_splits``): one request's rows are its whole output
  area, bound as above; several requests' rows are an output ONNX Runtime
  allocates, each request's rows copied into its own area (the copy the
  worker made before).
* A binding is kept per set of addresses (its inputs' and outputs'), up to
  ``BINDINGS_MAX``, and run again unchanged when a request's tensors are at
  the same addresses, as a lane's seat, a zero-copy call and a reused arena
  extent are: binding costs more than running (two binds and the outputs'
  check, ~10 us at 4 KiB against ~4 us for the run), a kept one nothing.  An
  address set met for the first time is bound only when its outputs are at
  least ``BIND_FRESH_BYTES`` (the copy then costs more than binding); a
  smaller one runs plain and copies, and is bound when it is met again.
* ``io_binding = false`` in the options keeps the plain run and its copy
  (what ``tools/bench_backend_io.py`` compares against).
* ``io`` counts the runs each way (``bound``, ``copied``; ``reused``: bound runs
  of a kept binding) and ``binding_off``
  says why binding is off, for tests and benchmarks in the same process.

Overlapping tensors: a lane client may place an input over its own output
area; ONNX Runtime then reads what it writes, and that client gets wrong
numbers in its own region (nothing outside the checked views is touched).

Options (``[models.options]``): ``intra_op_threads`` (default 1: one worker
per model instance should not fight the others for cores),
``inter_op_threads`` (default 1), ``graph_optimization`` ("all" | "basic" |
"extended" | "disabled", default "all"), ``io_binding`` (default true).
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np

from shmserve import layout
from shmserve._atomics import address as address_of  # a view's data pointer (ctypes.data costs ~2 us)
from shmserve.config import ModelConfig
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.protocol import TensorMeta
from shmserve.spec import ModelSpec, TensorSpec, bind_inputs, output_shapes
from workers.backends import RowSplit
from workers.step import RequestFailed

SIGNATURES_MAX = 1024  # input signatures whose output shapes were checked (then all forgotten at once),
                       # as workers.step.LANE_SIGNATURES_MAX
BINDINGS_MAX = 256  # bindings kept per model, by address set (then all forgotten at once)
# Outputs from this size on are bound the first time their addresses are met: measured on the 2-vCPU VM
# (2026-12-02, an Add of float32[1, n], one thread): a plain run and its copy against a fresh binding
# 5.0/10.5 us at 4 KiB, 13.4/23.4 us at 256 KiB, 53.9/43.6 us at 1 MiB; a kept binding run again
# 3.7, 8.3, 28.7 us (tools/bench_backend_io.py --binding).
BIND_FRESH_BYTES = 512 << 10
log = logging.getLogger("shmserve.worker.onnxruntime")

_ORT_TYPES = {
    "tensor(bool)": "bool", "tensor(int8)": "int8", "tensor(uint8)": "uint8", "tensor(int16)": "int16",
    "tensor(uint16)": "uint16", "tensor(int32)": "int32", "tensor(uint32)": "uint32", "tensor(int64)": "int64",
    "tensor(uint64)": "uint64", "tensor(float16)": "float16", "tensor(float)": "float32",
    "tensor(double)": "float64", "tensor(bfloat16)": "bfloat16", "tensor(string)": layout.BYTES,
}
ONNX_BFLOAT16 = 16  # onnx.TensorProto.BFLOAT16 (the onnx package is not needed to serve)
_BF16 = layout.numpy_dtype("bfloat16")


def _spec(arg) -> TensorSpec:
    dtype = _ORT_TYPES.get(arg.type)
    if dtype is None:
        raise ValueError(f"tensor {arg.name!r} has type {arg.type}, which shmserve does not carry")
    shape = tuple(d if isinstance(d, int) and d >= 0 else (d if isinstance(d, str) and d else None)
                  for d in (arg.shape or []))
    return TensorSpec(arg.name, dtype, shape)


def _text(name: str, array: np.ndarray) -> np.ndarray:
    """A bytes input as ORT's string tensors take it: its elements decoded as UTF-8 (a new object
    array of str).  RequestFailed(BAD_INPUT) naming the first element that is not UTF-8."""
    flat = array.reshape(-1)
    try:
        text = np.fromiter((element.decode() for element in flat), dtype=object, count=flat.size)
    except UnicodeDecodeError as exc:
        raise RequestFailed(ErrorCode.BAD_INPUT, f"input {name!r}: an element is not UTF-8 ({exc.reason} at byte "
                                                 f"{exc.start}), and ONNX Runtime string tensors hold text") from None
    return text.reshape(array.shape)


def _bf16_array(value) -> np.ndarray:
    """A copy of a bfloat16 OrtValue (in CPU memory) as an ml_dtypes.bfloat16 array."""
    out = np.empty(value.shape(), _BF16)
    if out.nbytes != value.tensor_size_in_bytes():
        raise RuntimeError(f"a bfloat16 output of shape {value.shape()} holds {value.tensor_size_in_bytes()} bytes")
    if out.nbytes:
        ctypes.memmove(out.ctypes.data, value.data_ptr(), out.nbytes)
    return out


_UNCHECKED = object()  # a signature not run yet


def _flag(value) -> bool:
    """An option that is a switch: a bool (TOML's), or "true"/"false"."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise ValueError(f"option io_binding must be true or false, got {value!r}")
    return value


def _write(value: np.ndarray, dst) -> None:
    """Copy an output into its view, or a batch's rows into each request's own (a RowSplit)."""
    if type(dst) is RowSplit:
        for start, stop, view in dst.parts:
            np.copyto(view, value[start:stop], casting="no")
    else:
        np.copyto(dst, value, casting="no")


class OnnxRuntimeBackend:
    def __init__(self, config: ModelConfig):
        import onnxruntime as ort

        self.ort = ort
        opts = ort.SessionOptions()
        o = config.options
        opts.intra_op_num_threads = int(o.get("intra_op_threads", 1))
        opts.inter_op_num_threads = int(o.get("inter_op_threads", 1))
        self.threads = {"runtime": "onnxruntime", "intra_op": opts.intra_op_num_threads,
                        "inter_op": opts.inter_op_num_threads}  # 0: ONNX Runtime's default (one per core)
        level = {"all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                 "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                 "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                 "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL}[o.get("graph_optimization", "all")]
        opts.graph_optimization_level = level
        providers = ["CPUExecutionProvider"]
        if config.device.startswith("cuda"):
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise RuntimeError(f"device {config.device} asked for, but this onnxruntime has no CUDA "
                                   f"provider (install onnxruntime-gpu)")
            providers = [("CUDAExecutionProvider", {"device_id": int(config.device.split(":")[1])})]
        self.session = ort.InferenceSession(config.path, opts, providers=providers)
        self.inputs = tuple(_spec(a) for a in self.session.get_inputs())
        self.outputs = tuple(_spec(a) for a in self.session.get_outputs())
        self._output_names = [t.name for t in self.outputs]
        self._text_inputs = tuple(t.name for t in self.inputs if t.dtype == layout.BYTES)
        self._bf16_inputs = frozenset(t.name for t in self.inputs if t.dtype == "bfloat16")
        self._bf16_outputs = frozenset(t.name for t in self.outputs if t.dtype == "bfloat16")
        self._declared = (self.inputs, self.outputs)  # the final specs, once the worker declares them
        self._output_dtypes: dict[str, np.dtype] = {}  # output name -> its declared dtype
        self.io = {"bound": 0, "copied": 0, "reused": 0}  # runs written in place / copied; bound runs of a kept binding
        self.binding_off: str | None = None  # why nothing is bound (None: binding is on)
        self._checked: dict[tuple, tuple | None] = {}  # signature -> output shapes to bind (None: copy)
        # Chosen once: a model with bfloat16 or string tensors, or on CUDA, keeps a run of its own; any
        # other runs in place unless the options say not to.
        strings = any(t.dtype == layout.BYTES for t in self.outputs)
        if self._bf16_inputs or self._bf16_outputs:
            self.run = self._run_bound
        elif self._text_inputs:
            self.run = self._run_text
        elif strings or providers != ["CPUExecutionProvider"] or not _flag(o.get("io_binding", True)):
            pass
        else:
            self._bindings: dict[tuple, object] = {}  # (signature, input and output addresses) -> IOBinding
            self._met: set[tuple] = set()  # address sets run once, plain: bound if met again
            self.run_into = self._run_into
            self.accepts_row_splits = True

    def declare(self, inputs, outputs) -> None:
        """The worker tells the final (config-merged) specs: what output shapes are predicted from."""
        self._declared = (tuple(inputs), tuple(outputs))
        self._output_dtypes.clear()
        self._checked.clear()

    def run(self, inputs):
        results = self.session.run(self._output_names, dict(inputs))
        return dict(zip(self._output_names, results))

    def _run_text(self, inputs):
        feeds = dict(inputs)
        for name in self._text_inputs:
            feeds[name] = _text(name, feeds[name])
        return dict(zip(self._output_names, self.session.run(self._output_names, feeds)))

    def _run_bound(self, inputs):
        """A run through an IOBinding: bfloat16 inputs as OrtValues over their own memory, outputs in
        CPU memory (bfloat16 ones copied out, the others as ORT's numpy arrays)."""
        OrtValue, binding = self.ort.OrtValue, self.session.io_binding()
        held = []  # an OrtValue does not keep the array it wraps alive: these do, until the run is over
        for name, view in inputs.items():
            if name in self._bf16_inputs:
                array = np.ascontiguousarray(view).view(np.uint16)
                value = OrtValue.ortvalue_from_numpy_with_onnx_type(array, ONNX_BFLOAT16)
            else:
                array = _text(name, view) if name in self._text_inputs else np.ascontiguousarray(view)
                value = OrtValue.ortvalue_from_numpy(array)
            held.append((array, value))
            binding.bind_ortvalue_input(name, value)
        for name in self._output_names:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        del held
        return {name: _bf16_array(value) if name in self._bf16_outputs else value.numpy()
                for name, value in zip(self._output_names, binding.get_outputs())}

    def _run_into(self, inputs, allocate) -> None:
        """Run in place: bound where this signature's output shapes were checked, else a plain
        run whose outputs are copied into ``allocate``'s views (and which checks them).  A binding
        is kept per set of addresses (``_bindings``) and run again as it is when a request's tensors
        are at the same addresses (a lane's seat, a zero-copy call, a reused arena extent); a set
        met for the first time is bound only if its outputs are large enough for the copy to cost
        more than binding (``BIND_FRESH_BYTES``), else it runs plain and is bound when met again."""
        signature = tuple((n, v.dtype, v.shape) for n, v in inputs.items())
        shapes = self._checked.get(signature, _UNCHECKED)
        if shapes is None or shapes is _UNCHECKED or self.binding_off is not None:
            self._run_copied(inputs, allocate, signature if shapes is _UNCHECKED else None)
            return
        sources, held = [], []
        for view in inputs.values():
            if not view.flags.c_contiguous:  # a warm-up sample file in Fortran order; never a slot's view
                view = np.ascontiguousarray(view)
                held.append(view)
            sources.append((view, address_of(view)))
        targets = []  # (output view or RowSplit, the address bound: 0 where ORT allocates)
        for name, shape in zip(self._output_names, shapes):
            dst = allocate(name, shape, self._output_dtype(name))
            view = dst.parts[0].view if type(dst) is RowSplit and len(dst.parts) == 1 else dst
            targets.append((view, 0 if type(view) is RowSplit else address_of(view)))
        key = (signature, *(address for _, address in sources), *(address for _, address in targets))
        binding = self._bindings.get(key)
        if binding is not None and not held:
            self.session.run_with_iobinding(binding)  # the same addresses: ORT writes where it wrote before
            self.io["bound"] += 1
            self.io["reused"] += 1
            return
        keep = not held and all(address for _, address in targets)
        if keep and key not in self._met and sum(v.nbytes for v, _ in targets) < BIND_FRESH_BYTES:
            if len(self._met) >= BINDINGS_MAX:
                self._met.clear()
            self._met.add(key)  # bound when met again: a first binding costs more than a small copy
            self._run_copied(inputs, allocate, None, targets=[v for v, _ in targets])
            return
        binding = self.session.io_binding()
        for name, (view, address) in zip(inputs, sources):
            binding.bind_input(name, "cpu", 0, view.dtype.type, view.shape, address)
        for name, (view, address) in zip(self._output_names, targets):
            if address:
                binding.bind_output(name, "cpu", 0, view.dtype.type, view.shape, address)
            else:  # several requests' rows: ORT allocates, the rows are copied
                binding.bind_output(name, "cpu")
        try:
            self.session.run_with_iobinding(binding)
        except Exception:
            self._checked[signature] = None  # whatever it was, this signature copies from now on
            raise
        own = False
        for (dst, address), value in zip(targets, binding.get_outputs()):
            if address == 0:
                _write(value.numpy(), dst)
            elif dst.nbytes and value.data_ptr() != address:
                np.copyto(dst, value.numpy(), casting="no")
                own = True
        del held
        self.io["bound"] += 1
        if own:
            self._switch_off("ONNX Runtime answered an output with a buffer of its own instead of writing into "
                             "the bound one (a graph input that is also an output does that)")
        elif keep:
            if len(self._bindings) >= BINDINGS_MAX:
                self._bindings.clear()
            self._bindings[key] = binding

    def _run_copied(self, inputs, allocate, signature: tuple | None, targets: list | None = None) -> None:
        """The plain run, each output copied into ``allocate``'s view (or into ``targets``, views
        already allocated for the shapes checked); with ``signature`` (not seen before) it also
        checks whether the spec predicts this run's output shapes."""
        results = self.session.run(self._output_names, dict(inputs))
        for i, (name, value) in enumerate(zip(self._output_names, results)):
            _write(value, targets[i] if targets is not None else allocate(name, value.shape, value.dtype))
        self.io["copied"] += 1
        if signature is None:
            return
        predicted = self._predict(inputs)
        actual = tuple(tuple(v.shape) for v in results)
        if len(self._checked) >= SIGNATURES_MAX:
            self._checked.clear()
        self._checked[signature] = predicted if predicted == actual else None
        if predicted is not None and predicted != actual:
            log.info("onnxruntime: inputs %s give outputs of shapes %s where the spec predicts %s: "
                     "copied, not bound", [v.shape for v in inputs.values()], list(actual), list(predicted))

    def _predict(self, inputs) -> tuple | None:
        """The output shapes the final specs predict for ``inputs`` (in session order), or None
        where one does not follow from the inputs' shapes."""
        specs_in, specs_out = self._declared
        try:
            symbols = bind_inputs(ModelSpec("", "onnxruntime", specs_in, specs_out),
                                  [TensorMeta(n, layout.dtype_name(v.dtype), v.shape) for n, v in inputs.items()])
        except ShmserveError:
            return None
        shapes = dict(zip((t.name for t in specs_out), output_shapes(specs_out, symbols)))
        predicted = tuple(shapes.get(name) for name in self._output_names)
        return None if any(shape is None for shape in predicted) else predicted

    def _output_dtype(self, name: str) -> np.dtype:
        dtype = self._output_dtypes.get(name)
        if dtype is None:
            for t in self._declared[1]:
                if t.name == name:
                    dtype = self._output_dtypes[name] = layout.numpy_dtype(t.dtype)
                    return dtype
            raise RequestFailed(ErrorCode.MODEL_ERROR, f"model produced an undeclared output {name!r}")
        return dtype

    def _switch_off(self, why: str) -> None:
        if self.binding_off is None:
            self.binding_off = why
            log.warning("onnxruntime: binding outputs switched off for this model: %s; its outputs are copied", why)

    def close(self) -> None:
        self.session = None


def load(config: ModelConfig) -> OnnxRuntimeBackend:
    return OnnxRuntimeBackend(config)
