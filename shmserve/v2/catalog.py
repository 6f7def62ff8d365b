"""What the v2 doors say about the models: the read-only half of ``V2Service``.

Owns: the version a call names (``version``: the default, or the newest loaded; Triton's words for
one that does not exist), model metadata, readiness and configuration in Triton's forms, the one
input of a raw binary request, class labels (read once per version), the repository index and
statistics, from the model table (``frontend.models``) and the server's read-only view
(``frontend.status``).

Must not: check who asks (``V2Service`` does, before it calls here), change anything, or touch a
socket.
"""

from __future__ import annotations

import dataclasses
import time

from shmserve.errors import ErrorCode
from shmserve.frontend.models import MODEL_READY, SERVING, ModelState, Models
from shmserve.frontend.status import triton_counts
from shmserve.v2 import classify
from shmserve.v2.messages import V2_NAMES, V2Error
from shmserve.v2.wording import unknown_model

# CUDA shared memory is not among them: its register is refused (docs/v2.md, "Differences from Triton").
EXTENSIONS = ("binary_tensor_data", "classification", "model_repository", "model_configuration",
              "system_shared_memory", "statistics")
# Triton's repository states (RepositoryIndex): what each lifecycle phase is called there.
REPOSITORY_STATES = {"loading": "LOADING", SERVING: "READY", "draining": "UNLOADING", "unavailable": "UNAVAILABLE",
                     "evicted": "UNAVAILABLE", "unloaded": "UNAVAILABLE"}
# Triton's model-config backends and platforms for ours.
PLATFORMS = {"onnxruntime": ("onnxruntime", "onnxruntime_onnx"), "torch": ("pytorch", "pytorch_libtorch"),
             "tensorrt": ("tensorrt", "tensorrt_plan"), "python": ("python", "python")}


def version_number(model: str, version: str | None) -> int | None:
    """A version as a v2 URL or message gives it ('' or None: the default).  V2Error
    UNKNOWN_MODEL for one that is not a positive integer."""
    if version is None or version == "":
        return None
    if not (isinstance(version, str) and version.isascii() and version.isdigit() and len(version) <= 18
            and int(version) > 0):
        raise V2Error(ErrorCode.UNKNOWN_MODEL, f"model {model!r} has no version {str(version)[:40]!r}: "
                                               "versions are positive integers")
    return int(version)


class Catalog:
    """The models as v2 callers see them (see the module).  ``models``: the model table;
    ``status``: the server's read-only view (``repository_index``, ``snapshot``)."""

    def __init__(self, models: Models, status):
        self.models, self.status = models, status
        self.labels: dict[tuple[str, int], tuple[str, ...]] = {}  # (model, version) -> its class labels

    def version(self, name: str, version: str | None) -> ModelState:
        """The version a metadata call names (None: the default, or the newest loaded).  V2Error
        in Triton's words (``unknown_model``) for a model or version that does not exist."""
        model = self.models.get(name)
        if model is None or not model.versions:
            raise unknown_model(name)
        number = version_number(name, version)
        if number is None:
            number = model.default if model.default is not None else max(model.versions)
        v = model.versions.get(number)
        if v is None:
            raise unknown_model(name, number)
        return v

    def model_metadata(self, name: str, version: str | None) -> dict:
        """``{"name", "versions": [str], "platform", "inputs": [{"name", "datatype", "shape"}],
        "outputs": [...]}``; variable dimensions are -1.  V2Error UNKNOWN_MODEL, MODEL_UNAVAILABLE
        (a version never loaded: its tensors are not known yet)."""
        v = self.version(name, version)
        spec = v.spec
        if spec is None:
            raise V2Error(ErrorCode.MODEL_UNAVAILABLE, f"model {name!r} version {v.version} is not loaded: "
                                                       f"its inputs and outputs are not known yet")
        model = self.models.get(name)

        def tensors(ts):
            return [{"name": t.name, "datatype": V2_NAMES.get(t.dtype, t.dtype.upper()),
                     "shape": [d if isinstance(d, int) else -1 for d in t.shape]} for t in ts]

        return {"name": name, "versions": [str(n) for n in sorted(model.versions)
                                           if model.versions[n].phase == SERVING],
                "platform": PLATFORMS.get(v.config.backend, (v.config.backend,) * 2)[1],
                "inputs": tensors(spec.inputs), "outputs": tensors(spec.outputs)}

    def raw_input(self, name: str, version: str | None):
        """The one input of a model a raw binary request names, as that request gives it: a
        ``TensorSpec`` whose first dimension is 1 when the model's ``max_batch_size`` > 0 (Triton
        reads the body as a batch of one).  V2Error UNKNOWN_MODEL, MODEL_UNAVAILABLE (not loaded
        yet), BAD_INPUT (it has several inputs)."""
        v = self.version(name, version)
        if v.spec is None:
            raise V2Error(ErrorCode.MODEL_UNAVAILABLE, f"model {name!r} version {v.version} is not loaded: a raw "
                                                       "binary request needs its input's shape; send a JSON header")
        if len(v.spec.inputs) != 1:
            raise V2Error(ErrorCode.BAD_INPUT, f"[request id: <id_unknown>] Raw request must only have 1 input "
                                               f"(found 1) to be deduced but got {len(v.spec.inputs)} inputs in "
                                               f"'{name}' model configuration", "INVALID_ARG")
        spec_input = v.spec.inputs[0]
        if v.config.max_batch_size > 0 and spec_input.shape:
            spec_input = dataclasses.replace(spec_input, shape=(1, *spec_input.shape[1:]))
        return spec_input

    def model_ready(self, name: str, version: str | None) -> bool:
        """V2Error UNKNOWN_MODEL for a model (or version) that does not exist."""
        v = self.version(name, version)
        return v.phase == SERVING and v.state == MODEL_READY

    def model_config(self, name: str, version: str | None) -> dict:
        """Triton's model configuration as JSON.  V2Error UNKNOWN_MODEL, MODEL_UNAVAILABLE."""
        v = self.version(name, version)
        spec, cfg = v.spec, v.config
        if spec is None:
            raise V2Error(ErrorCode.MODEL_UNAVAILABLE, f"model {name!r} version {v.version} is not loaded")
        batch = cfg.max_batch_size

        def tensors(ts):
            out = []
            for t in ts:
                dims = [d if isinstance(d, int) else -1 for d in t.shape]
                if batch and dims:
                    dims = dims[1:]  # Triton leaves the batch dimension out when max_batch_size > 0
                dtype = V2_NAMES.get(t.dtype, t.dtype.upper())
                out.append({"name": t.name, "data_type": "TYPE_STRING" if dtype == "BYTES" else f"TYPE_{dtype}",
                            "dims": dims})
            return out

        backend, platform = PLATFORMS.get(cfg.backend, (cfg.backend,) * 2)
        config = {"name": name, "platform": platform, "backend": backend, "max_batch_size": batch,
                  "version_policy": {"specific": {"versions": [v.version]}},
                  "input": tensors(spec.inputs), "output": tensors(spec.outputs),
                  "instance_group": [{"name": f"{name}_{v.version}", "count": cfg.instances,
                                      "kind": "KIND_CPU" if cfg.device == "cpu" else "KIND_GPU",
                                      **({"gpus": [int(d.partition(":")[2] or 0) for d in cfg.placement_devices]}
                                         if cfg.device != "cpu" else {})}]}
        if batch:
            config["dynamic_batching"] = {"preferred_batch_size": list(cfg.preferred_batch_sizes),
                                          "max_queue_delay_microseconds": cfg.max_queue_delay_us}
        return config

    def labels_of(self, version: ModelState) -> tuple[str, ...]:
        """A version's class labels (``classify.read_labels``), read once."""
        labels = self.labels.get((version.name, version.version))
        if labels is None:
            labels = self.labels[(version.name, version.version)] = classify.read_labels(version.config)
        return labels

    # -- repository and statistics ---------------------------------------------------------

    def repository_index(self, ready_only: bool = False) -> list[dict]:
        """``[{"name", "version", "state", "reason"}]`` (state READY, UNAVAILABLE, LOADING,
        UNLOADING)."""
        out = []
        for e in self.status.repository_index()["models"]:
            phase = e["state"]
            state = "READY" if phase == MODEL_READY else REPOSITORY_STATES.get(phase, "UNAVAILABLE")
            if ready_only and state != "READY":
                continue
            out.append({"name": e["name"], "version": "" if e["version"] is None else str(e["version"]),
                        "state": state, "reason": e.get("reason") or ""})
        return out

    def statistics(self, name: str | None, version: str | None) -> dict:
        """Triton's statistics: ``{"model_stats": [{"name", "version", "last_inference",
        "inference_count", "execution_count", "inference_stats": {"success", "fail", "queue",
        "compute_input", "compute_infer", "compute_output": {"count", "ns"}}, "batch_stats":
        []}]}`` from the counters and histograms the server keeps (``triton_counts``).  V2Error
        UNKNOWN_MODEL."""
        if name:
            versions = [self.version(name, version)] if version else \
                [v for v in self.models.versions() if v.name == name]
            if not versions:
                raise unknown_model(name)
        else:
            versions = self.models.versions()
        snap = self.status.snapshot()
        by_version = {(m.name, m.version): m for m in snap.models}
        now_wall, now_mono = time.time(), time.monotonic()
        stats = []
        for v in versions:
            m = by_version.get((v.name, v.version))
            counts = triton_counts(snap, m) if m is not None else None

            def stage(key, m=m):
                if m is None:
                    return {"count": 0, "ns": 0}
                buckets, total_us = m.histograms[key]
                return {"count": sum(buckets), "ns": int(total_us * 1000)}

            stats.append({
                "name": v.name, "version": str(v.version),
                "last_inference": int((now_wall - (now_mono - v.last_used)) * 1000) if v.last_used else 0,
                "inference_count": counts.items if counts else 0,
                "execution_count": counts.executions if counts else 0,
                "inference_stats": {"success": {"count": counts.success if counts else 0, "ns": stage("total")["ns"]},
                                    "fail": {"count": counts.failure if counts else 0, "ns": 0},
                                    "queue": stage("queue"), "compute_input": stage("copy_in"),
                                    "compute_infer": stage("compute"), "compute_output": stage("copy_out")},
                "batch_stats": []})
        return {"model_stats": stats}
