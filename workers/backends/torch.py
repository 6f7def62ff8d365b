"""torch backend: TorchScript files and ``torch.export`` programs (``.pt2``), on CPU or CUDA.

Owns: loading a torch model, reading what it can of its tensor specs, and
moving tensors between shared memory and the device in the model's I/O mode:

* CPU: inputs are ``torch.from_numpy`` views of shared memory (no copy);
  outputs are copied once into the output area, by numpy from the tensor's
  own memory (``Tensor.numpy``; what numpy cannot take, bfloat16 or a tensor
  that requires grad, by torch's ``copy_``): ``_run_host``, the whole CPU call.
* CUDA, ``io_mode = "mapped"``: inputs are CUDA tensors over the device
  address of the page-locked arena (``__cuda_array_interface__``, no copy on
  the host: kernels read through the mapping); outputs are written by the GPU
  straight into the output area the same way.
* CUDA, ``io_mode = "copy"``: inputs are copied to device buffers with
  asynchronous DMA from the page-locked arena, outputs copied back the same
  way.

A batch of requests is written in place too (``accepts_row_splits``): for
each output the worker hands a ``RowSplit``, and each request's rows
(``value[start:stop]``) go straight into that request's output view the
same way as a single request's output (CPU: a copy into shared memory;
mapped: the GPU writes through the mapping; copy: one asynchronous DMA per
request into page-locked memory).

CUDA graphs (issue 14 part 3; ``[models.options] cuda_graphs``, default
true): a CUDA model in ``copy`` mode whose tensors are static but for the
leading (batch) dimension has its forward pass captured once per batch-size
bucket (``graph_buckets``: the sizes the warm-up runs, ``ModelConfig.batch_sizes_to_warm``:
1, the preferred sizes, ``max_batch_size``; a model of fixed shapes, its one
shape), each into static device buffers, the first time a request (the
warm-up's, in practice) has that bucket's exact shapes.  A request then copies
its inputs H2D into the bucket's static inputs (the same DMA from the
page-locked arena as eager), replays the graph and copies the static outputs
D2H into its output area, all on the worker's stream.  The copies stay
outside the graph: a graph's copies have fixed addresses, and the arena's
change per request, so capturing them would need a staging area and one more
copy.  Shapes outside the buckets run eagerly; so does every request of a
``mapped`` model (its tensors are views at per-request device addresses) and
of a model whose capture failed (``graphs_off`` says why; logged once).  The
graphs' memory pools are the caching allocator's, so ``device_bytes``
(``memory_reserved``) counts them in the model's footprint; ``graph_pool_bytes``
is what the captures added.  ``runs`` counts ``graph`` and ``eager`` runs.

All of it runs on the worker's own CUDA stream; ``synchronize`` waits for it
before the worker publishes DONE.  Inputs are positional in the order of the
model's declared inputs; outputs (a tensor, or a tuple/list of tensors) map to
the declared outputs in order.  TorchScript carries no shapes, so declare
``inputs``/``outputs`` in the config; ``.pt2`` programs report theirs.

bfloat16 tensors are ``torch.bfloat16`` over the same memory: numpy's side
(``ml_dtypes.bfloat16``) has no buffer torch can take, so its bytes are
taken as uint16 and viewed as bfloat16 (no conversion, no copy).  Bytes
tensors are refused at load: a torch model takes tensors of numbers.

A TorchScript file whose code names torchvision (a scripted or traced
detector calls ``torchvision::nms``) gets torchvision imported before it is
loaded, so that its operators are registered; without torchvision installed
such a file fails to load, naming the operator.

The call path is kept to the bare model's: the TorchScript method is called
directly (not through ``nn.Module.__call__``'s hook dispatch; an exported
program's module is, its hooks check its inputs), inference mode is the C++
guard, and the stream is made current with one call and left so (see
``run_into``).  Measured in docs/performance.md ("torch and Python backend
glue").
"""

from __future__ import annotations

import logging
import warnings
from typing import Sequence

import numpy as np

from shmserve import layout
from shmserve.config import ModelConfig
from shmserve.spec import TensorSpec
from workers.backends import RowSplit, refuse_bytes


_TORCH_DTYPES: dict = {}
_BF16 = layout.numpy_dtype("bfloat16")
GRAPH_WARMUP_RUNS = 2  # eager runs on the capture's side stream before capturing (what torch.cuda.graphs asks)
log = logging.getLogger("shmserve.worker.torch")


def graph_buckets(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                  batch_sizes: Sequence[int]) -> tuple[tuple[tuple[int, ...], ...], ...] | str:
    """The input shapes (in declared order) to capture a CUDA graph for, one tuple per bucket; or
    why none can be (a str).  Every dimension but the leading one must be fixed, in inputs and
    outputs; a leading dimension that is not fixed (the batch) takes each of ``batch_sizes``
    (all inputs alike), a model of fixed shapes has its one bucket."""
    if not inputs or not outputs:
        return "the model's tensors are not declared"
    for t in (*inputs, *outputs):
        if not t.shape or any(not isinstance(d, int) for d in t.shape[1:]):
            return f"tensor {t.name!r} has a dynamic dimension other than the leading one (shape {list(t.shape)})"
    batched = [not isinstance(t.shape[0], int) for t in inputs]
    if not any(batched):
        return (tuple(tuple(t.shape) for t in inputs),)
    if not all(batched):
        return "some inputs have a fixed leading dimension and others a batch dimension"
    sizes = sorted({int(n) for n in batch_sizes if int(n) > 0})
    return tuple(tuple((n, *t.shape[1:]) for t in inputs) for n in sizes)


def bucket_of(shapes: tuple, buckets: dict):
    """The captured graph (or pending capture) for a request's input ``shapes`` (in declared
    order), or None: a shape outside the buckets runs eagerly.  Exact match only: padding a
    batch up to a bucket would run the model on rows nobody sent."""
    return buckets.get(shapes)


def _init_dtypes(torch) -> None:
    if not _TORCH_DTYPES:
        for name in layout.ITEMSIZES:
            if hasattr(torch, name):
                _TORCH_DTYPES[name] = getattr(torch, name)


class _CudaView:
    """Just enough of ``__cuda_array_interface__`` for torch.as_tensor to wrap device memory."""

    def __init__(self, pointer: int, shape: tuple, dtype: np.dtype):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": dtype.str, "data": (pointer, False),
                                         "version": 3, "strides": None}


def _dim(d):
    """A dimension of an exported program: an int, or the name of its symbol (int(SymInt) would
    return the example's size and freeze a dynamic dimension)."""
    return d if type(d) is int else str(d)


class TorchBackend:
    accepts_row_splits = True  # a batch's outputs go straight into each request's output area

    def __init__(self, config: ModelConfig):
        import torch

        self.torch = torch
        _init_dtypes(torch)
        self.device = torch.device(config.device)
        self.io_mode = config.io_mode
        self.memory = None  # DeviceMemory, bound by a GPU worker
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        self.inputs: tuple[TensorSpec, ...] = ()
        self.outputs: tuple[TensorSpec, ...] = ()
        if config.path.endswith(".pt2"):
            program = torch.export.load(config.path)
            self.inputs, self.outputs = self._export_specs(program)
            self.module = program.module().to(self.device)
            self._call = self.module  # through its hooks: an exported module checks its inputs' constraints there
        else:
            if _names_torchvision(config.path):
                _import_torchvision()
            self.module = torch.jit.load(config.path, map_location=self.device)
            self.module.eval()
            self._call = self.module.forward  # the compiled method itself: nn.Module's hook dispatch is pure Python
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._use_stream = _stream_setter(torch, self.stream)
        self._inference = getattr(torch._C, "_InferenceMode", None)  # the C++ guard torch.inference_mode wraps
        if self._inference is None:  # pragma: no cover - every torch this supports has it
            self._inference = lambda mode: torch.inference_mode(mode)
        self._on_cpu = self.device.type == "cpu"
        self._numpy_dtypes: dict = {}  # torch dtype -> numpy dtype of an output
        self._bases: dict = {}  # Registration -> flat CUDA tensor over it (mapped mode)
        self._input_names: list[str] | None = None
        self._output_names: list[str] | None = None
        self._batch_sizes = config.batch_sizes_to_warm()
        self._graphs: dict = {}  # input shapes -> _Graph, or _PENDING (a bucket not captured yet)
        self.runs = {"graph": 0, "eager": 0}
        self.graph_pool_bytes = 0
        wanted = _switch(config.options.get("cuda_graphs", True), "cuda_graphs")
        self.graphs_off: str | None = None  # why nothing is captured (None: buckets are captured)
        if not wanted:
            self.graphs_off = "cuda_graphs = false"
        elif self.device.type != "cuda":
            self.graphs_off = "not a CUDA model"
        elif self.io_mode != "copy":
            self.graphs_off = "io_mode is mapped (tensors at per-request device addresses)"

    def _export_specs(self, program) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        sig = program.graph_signature
        user_inputs = list(sig.user_inputs)
        placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
        inputs = []
        for name in user_inputs:
            val = placeholders[name].meta.get("val")
            if val is None:
                return (), ()
            inputs.append(TensorSpec(name, str(val.dtype).removeprefix("torch."), tuple(_dim(d) for d in val.shape)))
        outputs = []
        (output_node,) = [n for n in program.graph.nodes if n.op == "output"]
        results = output_node.args[0]
        results = results if isinstance(results, (tuple, list)) else (results,)
        for i, node in enumerate(results):
            val = getattr(node, "meta", {}).get("val")
            if val is None:
                return tuple(inputs), ()
            outputs.append(TensorSpec(f"output{i}", str(val.dtype).removeprefix("torch."),
                                      tuple(_dim(d) for d in val.shape)))
        return tuple(inputs), tuple(outputs)

    def bind_memory(self, memory) -> None:
        self.memory = memory

    def declare(self, inputs, outputs) -> None:
        """The worker tells the final (config-merged) specs: positional order of inputs/outputs.
        ValueError for a bytes tensor (the model cannot load)."""
        refuse_bytes("torch", inputs, outputs)
        self._input_names = [t.name for t in inputs]
        self._output_names = [t.name for t in outputs]
        if self.graphs_off is None:
            buckets = graph_buckets(inputs, outputs, self._batch_sizes)
            if isinstance(buckets, str):
                self.graphs_off = buckets
            else:
                self._graphs = {shapes: _PENDING for shapes in buckets}

    # -- running --------------------------------------------------------------------------

    def _mapped(self, view: np.ndarray):
        """A CUDA tensor over ``view``'s page-locked memory, or None if it is not registered
        (warm-up inputs live in ordinary memory and take the copy path).

        Each registered range is wrapped once as a flat uint8 CUDA tensor; a view is a slice of
        it reinterpreted (no per-request __cuda_array_interface__ parsing)."""
        if self.io_mode != "mapped" or self.memory is None:
            return None
        try:
            reg, offset = self.memory.locate(view)
        except ValueError:
            return None
        base = self._bases.get(reg)
        if base is None:
            base = self.torch.as_tensor(_CudaView(reg.device, (reg.size,), np.dtype(np.uint8)), device=self.device)
            self._bases = {r: t for r, t in self._bases.items() if r in self.memory.registrations()}
            self._bases[reg] = base
        flat = base[offset:offset + view.nbytes].view(_TORCH_DTYPES[view.dtype.name])
        return flat.view(view.shape)

    def _host(self, array: np.ndarray):
        """A CPU tensor over ``array``'s own memory (bfloat16: its bytes viewed, see the header)."""
        if array.dtype == _BF16:
            return self.torch.from_numpy(array.view(np.uint16)).view(self.torch.bfloat16)
        return self.torch.from_numpy(array)

    def _input(self, view: np.ndarray):
        if self._on_cpu:
            return self._host(view)
        mapped = self._mapped(view)
        if mapped is not None:
            return mapped
        return self._host(view).to(self.device, non_blocking=True)  # DMA from page-locked memory

    def _write(self, value, dst) -> None:
        """Write the output ``value`` into ``dst``: a numpy view of shared memory, or a RowSplit
        (a batch: each request's rows into its own view)."""
        if type(dst) is RowSplit:
            for start, stop, view in dst.parts:
                self._write(value[start:stop], view)
            return
        if self._on_cpu or not value.is_cuda:
            self._host(dst).copy_(value)
            return
        mapped = self._mapped(dst)
        if mapped is not None:
            mapped.copy_(value)  # the GPU writes shared memory through the mapping
        else:
            self._host(dst).copy_(value, non_blocking=True)  # DMA into page-locked memory

    def _forward(self, inputs):
        names = self._input_names or list(inputs)
        return dict(self._named(self._call(*[self._input(inputs[n]) for n in names])))

    def _named(self, out) -> list[tuple[str, object]]:
        """The model's return value as (output name, tensor) pairs; ValueError for a count other than declared."""
        out = out if isinstance(out, (tuple, list)) else (out,)
        out_names = self._output_names or [f"output{i}" for i in range(len(out))]
        if len(out) != len(out_names):
            raise ValueError(f"model returned {len(out)} outputs, {len(out_names)} declared")
        return list(zip(out_names, out))

    def run_into(self, inputs, allocate) -> None:
        """Run one request (or batch) and write each output into ``allocate(name, shape, dtype)``.

        On CUDA this makes the backend's stream the current stream of the calling thread on its
        device and leaves it so (the worker's one thread runs only this model: setting it once a
        call costs one C call, where ``torch.cuda.stream``'s context costs several Python ones);
        whoever runs other CUDA work on the same thread names its own stream.  The writes are
        asynchronous: ``synchronize`` before reading them."""
        if self._on_cpu:
            self._run_host(inputs, allocate)
            return
        with self._inference(True):
            self._use_stream()
            graph = bucket_of(tuple(inputs[n].shape for n in self._input_names), self._graphs) \
                if self._graphs else None
            if graph is _PENDING:
                graph = self._capture(inputs)
            if graph is not None:
                results = graph.run(inputs, self._host)
                self.runs["graph"] += 1
            else:
                results = self._forward(inputs)
                self.runs["eager"] += 1
            for name, value in results.items():
                self._write_tensor(name, value, allocate)

    def _run_host(self, inputs, allocate) -> None:
        """``run_into`` for a CPU model: the bare call and a numpy copy of each output.

        Inputs are ``torch.from_numpy`` views (bfloat16: ``_host``); each output is taken as
        the numpy array over its memory (``Tensor.numpy``, no copy) and copied into its area
        with ``np.copyto`` (for a batch, each request's rows into its view): the same bytes as
        torch's ``copy_``, through far less code, which matters most when the call runs cold
        (a worker between requests; docs/performance.md, "issue 26's glue").  An output numpy
        cannot take (bfloat16, a tensor that requires grad, a conjugate view) goes through
        ``_write``."""
        names = self._input_names or list(inputs)
        from_numpy = self.torch.from_numpy
        try:
            args = [from_numpy(inputs[n]) for n in names]
        except TypeError:  # a bfloat16 input: its bytes viewed (see the header)
            args = [self._host(inputs[n]) for n in names]
        with self._inference(True):
            out = self._call(*args)
        del args
        named = self._named(out)
        self.runs["eager"] += 1
        for name, value in named:
            try:
                array = value.numpy()
            except (TypeError, RuntimeError):  # bfloat16, requires grad, conjugate or negative bit
                with self._inference(True):
                    self._write_tensor(name, value, allocate)
                continue
            dst = allocate(name, array.shape, array.dtype)
            if type(dst) is RowSplit:
                for start, stop, view in dst.parts:
                    np.copyto(view, array[start:stop], casting="no")
            else:
                np.copyto(dst, array, casting="no")

    def _write_tensor(self, name: str, value, allocate) -> None:
        """Write output ``name``'s tensor ``value`` into ``allocate``'s destination through torch
        (``_write``; the caller holds inference mode)."""
        if not value.is_contiguous():
            value = value.contiguous()
        dtype = self._numpy_dtypes.get(value.dtype)
        if dtype is None:
            dtype = self._numpy_dtypes[value.dtype] = layout.numpy_dtype(str(value.dtype).removeprefix("torch."))
        self._write(value, allocate(name, tuple(value.shape), dtype))

    def _capture(self, inputs):
        """Capture the forward pass for ``inputs``' bucket (its static buffers filled from them);
        the _Graph, or None if capture fails (then nothing is captured any more: logged once)."""
        torch = self.torch
        key = tuple(inputs[n].shape for n in self._input_names)
        before = int(torch.cuda.memory_reserved(self.device))
        try:
            graph = _Graph(torch, self, inputs)
        except Exception as exc:  # a model that syncs with the host or branches on data cannot be captured
            self._graphs = {}
            self.graphs_off = f"capture failed: {type(exc).__name__}: {exc}"
            log.warning("torch: CUDA graphs switched off for this model: %s; it runs eagerly", self.graphs_off)
            torch.cuda.synchronize(self.device)
            return None
        self.graph_pool_bytes += max(0, int(torch.cuda.memory_reserved(self.device)) - before)
        self._graphs[key] = graph
        return graph

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def device_bytes(self) -> int | None:
        """The caching allocator's reserved bytes on the model's CUDA device (None on the CPU)."""
        return int(self.torch.cuda.memory_reserved(self.device)) if self.device.type == "cuda" else None

    def threads(self) -> dict:
        """The CPU thread pools torch runs (it sizes them from the CPUs it may use, or OMP_NUM_THREADS)."""
        return {"runtime": "torch", "intra_op": self.torch.get_num_threads(),
                "inter_op": self.torch.get_num_interop_threads()}

    def close(self) -> None:
        self.synchronize()
        self.module = None


_PENDING = object()  # a bucket whose graph is captured by its first request


def _switch(value, key: str) -> bool:
    """An option that is a switch: a bool (TOML's), or "true"/"false"; ValueError otherwise."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise ValueError(f"option {key} must be true or false, got {value!r}")
    return value


class _Graph:
    """One bucket's captured forward pass: static device inputs (declared order), the graph, its
    static outputs by name.  ``run`` copies a request's inputs in (H2D from the page-locked
    arena, on the current stream), replays, and returns the static outputs (read them before
    the next replay: the caller copies them out on the same stream)."""

    def __init__(self, torch, backend: "TorchBackend", inputs):
        names = backend._input_names
        self.names = names
        self.static = [backend._host(np.ascontiguousarray(inputs[n])).to(backend.device) for n in names]
        side = torch.cuda.Stream(backend.device)
        side.wait_stream(torch.cuda.current_stream(backend.device))
        with torch.cuda.stream(side):
            for _ in range(GRAPH_WARMUP_RUNS):
                backend.module(*self.static)
        torch.cuda.current_stream(backend.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            out = backend.module(*self.static)
        out = out if isinstance(out, (tuple, list)) else (out,)
        out_names = backend._output_names or [f"output{i}" for i in range(len(out))]
        if len(out) != len(out_names):
            raise ValueError(f"model returned {len(out)} outputs, {len(out_names)} declared")
        self.outputs = dict(zip(out_names, out))

    def run(self, inputs, host) -> dict:
        for name, static in zip(self.names, self.static):
            static.copy_(host(inputs[name]), non_blocking=True)  # DMA from page-locked memory
        self.graph.replay()
        return self.outputs


def _stream_setter(torch, stream):
    """A no-argument callable making ``stream`` the calling thread's current stream on its device
    (nothing for None: a CPU model)."""
    if stream is None:
        return lambda: None
    set_stream = getattr(torch._C, "_cuda_setStream", None)
    if set_stream is None:  # pragma: no cover - a CUDA build of torch has it
        return lambda: torch.cuda.set_stream(stream)
    ids = {"stream_id": stream.stream_id, "device_index": stream.device_index, "device_type": stream.device_type}
    return lambda: set_stream(**ids)


def _names_torchvision(path: str) -> bool:
    """Whether a TorchScript archive's code names torchvision (its operators, ``ops.torchvision.nms``,
    or its classes): the code files of the zip are read, not run.  False if it is not a readable
    zip (``torch.jit.load`` then says what is wrong with it)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.filename.endswith(".py") and "/code/" in f"/{info.filename}":
                    if b"torchvision" in archive.read(info):
                        return True
    except (OSError, zipfile.BadZipFile, RuntimeError):
        return False
    return False


def _import_torchvision() -> None:
    """Import torchvision if it is installed, before a TorchScript file is loaded: its operators
    (``torchvision::nms``, ``roi_align``...) register on import, and a scripted or traced
    torchvision detector names them.  Nothing if it is not installed (such a file then fails to
    load, naming the missing operator)."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        pass
    except Exception as exc:  # a torchvision built for another torch: the model may not need it
        log.warning("torch: torchvision is installed but does not import (%s: %s); TorchScript files that use "
                    "its operators will not load", type(exc).__name__, exc)


def load(config: ModelConfig) -> TorchBackend:
    return TorchBackend(config)
