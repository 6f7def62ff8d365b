"""Triton's words for the v2 doors' refusals.

Owns: the text and Triton status class (``V2Error.triton``) of every refusal
that Triton's server words itself, so the clients, proxies and scripts that
match on them (``ex.message().startswith("Request for unknown model")``) see
the same: a model, version or model without a ready version
(``unknown_model``, ``triton_unavailable``); an unexpected input or output; a
request's inputs against a known version's spec, in Triton's order and words
(``check_inputs``: names, count, datatype, shape); and a byte size mismatch.
The texts are Triton core's (``model_repository_manager.cc``,
``model_lifecycle.cc``, ``model.cc``, ``infer_request.cc``), read 2026-12-02;
what shmserve knows beyond them (why a version is unavailable) follows them.

The refusals keep their shmserve codes (``unknown_model``, ``bad_input``,
``bad_dtype``, ``bad_shape``...), which the doors send beside the text.

Must not: decide whether a request is served (the dispatcher checks every
request again, in shmserve's words, and its checks are the ones that count),
hold state, or do I/O.
"""

from __future__ import annotations

from shmserve.errors import ErrorCode, ShmserveError
from shmserve.v2.messages import V2_NAMES, InferRequest, V2Error

# Triton's note after a shape mismatch of a model with max_batch_size > 0 (infer_request.cc).
BATCH_NOTE = ("NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension to be "
              "prepended to each input shape. If you want to specify the full shape including the batch dim in "
              "your input dims config, try setting max_batch_size to zero. See the model configuration docs for "
              "more info on max_batch_size.")


def unknown_model(name: str, version: int | None = None) -> V2Error:
    """No model ``name`` (Triton: INVALID_ARG, HTTP 400), or it has no ``version`` (NOT_FOUND)."""
    if version is None:
        return V2Error(ErrorCode.UNKNOWN_MODEL, f"Request for unknown model: '{name}' is not found", "INVALID_ARG")
    return V2Error(ErrorCode.UNKNOWN_MODEL, f"Request for unknown model: '{name}' version {version} is not found",
                   "NOT_FOUND")


def triton_unavailable(model, name: str, version: int | None, exc: ShmserveError) -> V2Error:
    """The dispatcher's UNKNOWN_MODEL or MODEL_UNAVAILABLE refusal ``exc`` of a request for
    ``name`` (``model``: its ``frontend.models.Model``, None if there is none; ``version``: the one
    the request named, or None) in Triton's words: not found; a named version that exists but
    is not ready (UNAVAILABLE, 503); no ready version to choose (NOT_FOUND).  What shmserve
    knows of why follows Triton's text."""
    if model is None or not model.versions:
        return unknown_model(name)
    if version is not None:
        if exc.code is ErrorCode.UNKNOWN_MODEL:
            return unknown_model(name, version)
        return V2Error(ErrorCode.MODEL_UNAVAILABLE, f"Request for unknown model: '{name}' version {version} is not "
                                                    f"at ready state ({exc.message})", "UNAVAILABLE")
    return V2Error(exc.code, f"Request for unknown model: '{name}' has no available versions ({exc.message})",
                   "NOT_FOUND")


def unexpected_output(model: str, name: str) -> V2Error:
    return V2Error(ErrorCode.BAD_INPUT, f"unexpected inference output '{name}' for model '{model}'", "INVALID_ARG")


def _request(request: InferRequest) -> str:
    """Triton's prefix of a request's own refusals (``InferenceRequest::LogRequest``)."""
    return f"[request id: {request.id or '<id_unknown>'}] "


def _dims(dims) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"


def _names(names) -> str:
    return "[" + ",".join(f"'{n}'" for n in names) + "]"


def byte_size_mismatch(request: InferRequest, name: str, expected: int, got: int) -> V2Error:
    """An input whose data (or ``shared_memory_byte_size``) is not its shape's bytes."""
    return V2Error(ErrorCode.BAD_INPUT, f"{_request(request)}input byte size mismatch for input '{name}' for model "
                                        f"'{request.model}'. Expected {expected}, got {got}", "INVALID_ARG")


def check_inputs(request: InferRequest, version) -> None:
    """Check ``request``'s inputs against ``version`` (a ``frontend.models.ModelState`` whose spec
    is known) as Triton does, in its order: every input known, none missing, each datatype, each
    shape (with ``max_batch_size`` > 0 the first dimension is the batch's: it must agree across
    inputs; Triton's expected shape shows it as -1).  V2Error BAD_INPUT, BAD_DTYPE or BAD_SHAPE
    in Triton's words.  A request larger than ``max_batch_size`` is not refused: shmserve's
    ``max_batch_size`` bounds what dynamic batching gathers, not a request."""
    spec, model, batched = version.spec, request.model, version.config.max_batch_size > 0
    by_name = {t.name: t for t in spec.inputs}
    for t in request.inputs:
        if t.name not in by_name:
            raise V2Error(ErrorCode.BAD_INPUT, f"unexpected inference input '{t.name}' for model '{model}'",
                          "INVALID_ARG")
    given = [t.name for t in request.inputs]
    missing = [t.name for t in spec.inputs if t.name not in given]
    if missing:
        raise V2Error(ErrorCode.BAD_INPUT, f"{_request(request)}expected {len(spec.inputs)} inputs but got "
                                           f"{len(given)} inputs for model '{model}'. Got input(s) {_names(given)}, "
                                           f"but missing required input(s) {_names(missing)}. Please provide all "
                                           "required input(s).", "INVALID_ARG")
    batch = None
    for t in request.inputs:
        want = by_name[t.name]
        expects = V2_NAMES.get(want.dtype, want.dtype.upper())
        if t.datatype != expects:
            raise V2Error(ErrorCode.BAD_DTYPE, f"{_request(request)}inference input '{t.name}' data-type is "
                                               f"'{t.datatype}', but model '{model}' expects '{expects}'",
                          "INVALID_ARG")
        dims = [d if isinstance(d, int) else -1 for d in want.shape]
        shape = list(t.shape)
        if batched and dims:
            if not shape:
                raise V2Error(ErrorCode.BAD_SHAPE, f"{_request(request)}input '{t.name}' has no shape but model "
                                                   f"requires batch dimension for '{model}'", "INVALID_ARG")
            if batch is None:
                batch = shape[0]
            elif shape[0] != batch:
                raise V2Error(ErrorCode.BAD_SHAPE, f"{_request(request)}input '{t.name}' batch size does not match "
                                                   f"other inputs for '{model}'", "INVALID_ARG")
            config_dims, got = dims[1:], shape[1:]
        else:
            config_dims, got = dims, shape
        if len(config_dims) != len(got) or any(c != -1 and c != g for c, g in zip(config_dims, got)):
            full = [-1, *config_dims] if batched and dims else config_dims
            raise V2Error(ErrorCode.BAD_SHAPE, f"{_request(request)}unexpected shape for input '{t.name}' for model "
                                               f"'{model}'. Expected {_dims(full)}, got {_dims(shape)}. "
                                               f"{BATCH_NOTE if batched else ''}", "INVALID_ARG")
