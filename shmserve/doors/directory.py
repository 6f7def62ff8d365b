"""A door process's view of the models: names, versions, specs, and which version a request goes to.

Owns: what the main process's last ``models`` message said (``Directory.update``):
each model's default version, whether a canary or shadow rollout runs, and per
version its model id, spec, whether it serves now and how many workers it has;
and the door's routing decision (``Directory.route``), by the rule of
``shmserve.frontend.models.Models.resolve`` for the requests a door may serve
itself.  Every case that rule decides otherwise than "this serving version" —
a rollout (its split and sticky keys are main's), a model some rate limit
covers (main keeps the buckets: ``limited``), an unknown model or
version, one loading, draining, evicted or unavailable, a stopping server —
is ``None``: the request is relayed and main answers it, with main's words.

The message (``frontend/doorhouse.py`` ``models_message``)::

    {"op": "models", "stopping": bool, "max_request_bytes": n,
     "models": {name: {"default": v | null, "rollout": bool, "limited": bool,
                       "versions": {"v": {"id": n, "serving": bool, "workers": n,
                                          "max_output_bytes": n, "spec": {...} | null}}}}}

Must not: route anything main would route differently (when in doubt: None),
or touch a lane or a socket.
"""

from __future__ import annotations

from typing import NamedTuple

from shmserve.spec import ModelSpec


class VersionView(NamedTuple):
    """One version as the door sees it."""

    name: str
    version: int
    model_id: int  # the id written into lane slots (one per model name)
    spec: ModelSpec
    workers: int  # its workers: the door keeps up to this many lanes of it
    max_output_bytes: int  # what main reserves for an output whose size the inputs do not fix


class Directory:
    """The models as main last announced them."""

    def __init__(self) -> None:
        self.models: dict[str, dict] = {}
        self.versions: dict[tuple[str, int], VersionView] = {}  # serving versions with a spec
        self.stopping = False
        self.max_request_bytes = 0
        self.generation = 0  # how many messages were applied

    def update(self, message: dict) -> set[tuple[str, int]]:
        """Apply a ``models`` message; returns the (name, version) pairs that served before and do
        not now (their lanes are to be retired)."""
        before = set(self.versions)
        self.stopping = bool(message.get("stopping"))
        self.max_request_bytes = int(message.get("max_request_bytes", 0))
        self.models = message.get("models", {})
        versions = {}
        for name, model in self.models.items():
            for number, v in model.get("versions", {}).items():
                if v.get("serving") and v.get("spec"):
                    versions[(name, int(number))] = VersionView(
                        name, int(number), int(v["id"]), ModelSpec.from_dict(v["spec"]), max(1, int(v["workers"])),
                        int(v.get("max_output_bytes", 0)))
        self.versions = versions
        self.generation += 1
        return before - set(versions)

    def route(self, name: str, version: int | None, key: str | None) -> VersionView | None:
        """The version a request for ``name`` (``version``: the one it names, or None) goes to if
        the door may serve it itself; None: relay it (see the module)."""
        if self.stopping:
            return None
        model = self.models.get(name)
        if model is None or model.get("limited"):
            return None  # (limited: a rate limit covers it, which main keeps: docs/doors.md)
        if version is None:
            if model.get("rollout"):
                return None  # the split (and a key's stickiness) is main's
            version = model.get("default")
            if version is None:
                return None
        return self.versions.get((name, version))
