"""torch backend: TorchScript files and ``torch.export`` programs (``.pt2``), on CPU or CUDA.

Owns: loading a torch model, reading what it can of its tensor specs, and
moving tensors between shared memory and the device in the model's I/O mode:

* CPU: inputs are ``torch.from_numpy`` views of shared memory (no copy);
  outputs are copied once into the output area.
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

All of it runs on the worker's own CUDA stream; ``synchronize`` waits for it
before the worker publishes DONE.  Inputs are positional in the order of the
model's declared inputs; outputs (a tensor, or a tuple/list of tensors) map to
the declared outputs in order.  TorchScript carries no shapes, so declare
``inputs``/``outputs`` in the config; ``.pt2`` programs report theirs.

bfloat16 tensors are ``torch.bfloat16`` over the same memory: numpy's side
(``ml_dtypes.bfloat16``) has no buffer torch can take, so its bytes are
taken as uint16 and viewed as bfloat16 (no conversion, no copy).  Bytes
tensors are refused at load: a torch model takes tensors of numbers.
"""

from __future__ import annotations

import warnings

import numpy as np

from shmserve import layout
from shmserve.config import ModelConfig
from shmserve.spec import TensorSpec
from workers.backends import RowSplit, refuse_bytes


_TORCH_DTYPES: dict = {}
_BF16 = layout.numpy_dtype("bfloat16")


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
        else:
            self.module = torch.jit.load(config.path, map_location=self.device)
            self.module.eval()
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._bases: dict = {}  # Registration -> flat CUDA tensor over it (mapped mode)
        self._input_names: list[str] | None = None
        self._output_names: list[str] | None = None

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
        if self.device.type == "cpu":
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
        if value.device.type == "cpu" or self.device.type == "cpu":
            self._host(dst).copy_(value)
            return
        mapped = self._mapped(dst)
        if mapped is not None:
            mapped.copy_(value)  # the GPU writes shared memory through the mapping
        else:
            self._host(dst).copy_(value, non_blocking=True)  # DMA into page-locked memory

    def _forward(self, inputs):
        names = self._input_names or list(inputs)
        out = self.module(*[self._input(inputs[n]) for n in names])
        out = out if isinstance(out, (tuple, list)) else (out,)
        out_names = self._output_names or [f"output{i}" for i in range(len(out))]
        if len(out) != len(out_names):
            raise ValueError(f"model returned {len(out)} outputs, {len(out_names)} declared")
        return dict(zip(out_names, out))

    def run_into(self, inputs, allocate) -> None:
        torch = self.torch
        with torch.inference_mode(), torch.cuda.stream(self.stream) if self.stream else _nothing():
            results = self._forward(inputs)
            for name, value in results.items():
                value = value.contiguous()
                dtype = layout.numpy_dtype(str(value.dtype).removeprefix("torch."))
                self._write(value, allocate(name, tuple(value.shape), dtype))

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def device_bytes(self) -> int | None:
        """The caching allocator's reserved bytes on the model's CUDA device (None on the CPU)."""
        return int(self.torch.cuda.memory_reserved(self.device)) if self.device.type == "cuda" else None

    def close(self) -> None:
        self.synchronize()
        self.module = None


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def load(config: ModelConfig) -> TorchBackend:
    return TorchBackend(config)
