"""The lifecycle soak's client processes (``tests/test_lifecycle_soak.py``): one per kind of client,
each checking every answer.

Owns: a client loop of each kind (``infer`` through lanes, ``zero_copy`` calls, ``socket``:
``infer`` with lanes off, ``http`` and ``grpc``: tritonclient against the v2 doors), what counts as
a right answer of the soak's models, and the tally a client reports.
Must not: decide whether a tally passes (the test does: only it knows when each version served).

As a script (``python -m helpers.lifecycle_soak KIND``, tests/ on the path, a JSON object of
arguments on stdin: ``socket``, ``http``, ``grpc``, ``seed``, ``stop``, and the bearer token in
$SOAK_V2_TOKEN): it prints ``ready`` once its first call was answered, then calls until the file
``stop`` exists and prints one JSON line, its tally (``Tally.to_json``).

The models: ``m`` version v answers ``x + 1000 v`` (float32, exactly), so an answer names the
version that computed it; a *flaky* version fails every input with ``0 < x[0] < 0.5`` with the
message ``soak: injected failure of version v`` (``INJECTED``), and those are the only failures a
client may see.  The on-demand models ``od_a``, ``od_b``, ``od_c`` answer ``x + OD_OFFSETS[name]``.
Every client sends 4 float32s drawn from [0, 1) to ``m``, and every ``OD_PERIOD_S`` (jittered) one
call to an on-demand model drawn at random.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import numpy as np

MODEL = "m"
OD_OFFSETS = {"od_a": 100000.0, "od_b": 200000.0, "od_c": 300000.0}
OD_PERIOD_S = 8.0
INJECTED = re.compile(r"soak: injected failure of version (\d+)")
TIMEOUT_S = 120.0  # per call: the machine is small and shared; the answer must still come, and right
N = 4  # elements per call


def answer_version(model: str, x: np.ndarray, y) -> int | None:
    """The version of ``model`` whose answer ``y`` is for input ``x`` (1 for an on-demand model);
    None if it is no version's answer (wrong values, dtype or shape)."""
    y = np.asarray(y)
    if y.dtype != np.float32 or y.shape != x.shape:
        return None
    if model == MODEL:
        v = int(round(float(y[0] - x[0]) / 1000))
        return v if v >= 1 and np.array_equal(y, x + np.float32(1000 * v)) else None
    return 1 if np.array_equal(y, x + np.float32(OD_OFFSETS[model])) else None


class Tally:
    """What one client saw.  For each (model, version) that answered, and each version whose
    injected failure came back: how many, the earliest end and the latest start of those calls
    (``time.monotonic``, one clock for every process of the host): enough for the test to check
    that each version answered only while it may have."""

    def __init__(self, kind: str):
        self.kind = kind
        self.calls = 0
        self.answers: dict[str, list] = {}  # "model:version" -> [count, min end, max start]
        self.injected: dict[str, list] = {}  # "version" -> [count, min end, max start]
        self.wrong: list[str] = []  # the first few wrong answers
        self.wrong_count = 0
        self.failures: dict[str, int] = {}  # an error's text (numbers blanked) -> count
        self.failure_samples: list[str] = []

    @staticmethod
    def _note(table: dict, key: str, t0: float, t1: float) -> None:
        entry = table.setdefault(key, [0, t1, t0])
        entry[0] += 1
        entry[1] = min(entry[1], t1)
        entry[2] = max(entry[2], t0)

    def answered(self, model: str, x: np.ndarray, y, t0: float, t1: float) -> None:
        self.calls += 1
        v = answer_version(model, x, y)
        if v is None:
            self.wrong_count += 1
            if len(self.wrong) < 5:
                self.wrong.append(f"{model}: x={x.tolist()} y={np.asarray(y).tolist()} at {t0:.3f}-{t1:.3f}")
            return
        self._note(self.answers, f"{model}:{v}", t0, t1)

    def failed(self, model: str, exc: BaseException, t0: float, t1: float) -> None:
        self.calls += 1
        text = f"{type(exc).__name__}: {exc}"
        found = INJECTED.search(text)
        if found and model == MODEL:
            self._note(self.injected, found.group(1), t0, t1)
            return
        shape = re.sub(r"\d+(\.\d+)?", "N", text)[:300]
        self.failures[shape] = self.failures.get(shape, 0) + 1
        if len(self.failure_samples) < 5:
            self.failure_samples.append(f"{model} at {t0:.3f}-{t1:.3f}: {text[:500]}")

    def to_json(self) -> dict:
        return {"kind": self.kind, "calls": self.calls, "answers": self.answers, "injected": self.injected,
                "wrong_count": self.wrong_count, "wrong": self.wrong, "failures": self.failures,
                "failure_samples": self.failure_samples}


# -- the kinds: each a function (model, x) -> y, made once per process --------------------------

def native(args: dict, lanes: bool, keyed: bool):
    from shmserve import Client

    client = Client(args["socket"], timeout=TIMEOUT_S, lanes=lanes)
    rng = np.random.default_rng(args["seed"] + 1)

    def call(model, x):
        key = f"k{rng.integers(64)}" if keyed and rng.random() < 0.5 else None  # sticky routing, half the time
        return client.infer(model, {"x": x}, key=key)["y"]

    return call, client.close


def zero_copy(args: dict):
    from shmserve import Client

    client = Client(args["socket"], timeout=TIMEOUT_S)
    calls = {}  # one ZeroCopyCall per model, kept across calls (as the README's loop does)

    def call(model, x):
        zc = calls.get(model)
        if zc is None:
            zc = calls[model] = client.zero_copy(model, {"x": ((N,), np.float32)})
        zc.inputs["x"][...] = x
        return np.array(zc.run()["y"])  # a copy: the views are valid only until the next run

    def close():
        for zc in calls.values():
            zc.release()
        client.close()

    return call, close


def triton(args: dict, protocol: str):
    if protocol == "http":
        import tritonclient.http as tc

        client = tc.InferenceServerClient(args["http"], connection_timeout=TIMEOUT_S, network_timeout=TIMEOUT_S)
    else:
        import tritonclient.grpc as tc

        client = tc.InferenceServerClient(args["grpc"])
    token = os.environ["SOAK_V2_TOKEN"]

    def bearer(request):
        request.headers["authorization"] = f"Bearer {token}"

    client.register_plugin(bearer)

    def call(model, x):
        given = tc.InferInput("x", [N], "FP32")
        given.set_data_from_numpy(x)
        options = {} if protocol == "http" else {"client_timeout": TIMEOUT_S}
        result = client.infer(model, [given], outputs=[tc.InferRequestedOutput("y")], **options)
        return result.as_numpy("y")

    return call, client.close


KINDS = {
    "infer": lambda args: native(args, lanes=True, keyed=False),
    "zero_copy": zero_copy,
    "socket": lambda args: native(args, lanes=False, keyed=True),
    "http": lambda args: triton(args, "http"),
    "grpc": lambda args: triton(args, "grpc"),
}


def run(kind: str, args: dict) -> dict:
    """Call until ``args["stop"]`` exists (looked at every 50 calls and before each on-demand
    call); the tally."""
    call, close = KINDS[kind](args)
    rng = np.random.default_rng(args["seed"])
    tally = Tally(kind)

    def one(model: str) -> None:
        x = rng.random(N, dtype=np.float32)
        t0 = time.monotonic()
        try:
            y = call(model, x)
        except Exception as exc:  # noqa: BLE001 - every failure is tallied, and the test judges it
            tally.failed(model, exc, t0, time.monotonic())
            return
        tally.answered(model, x, y, t0, time.monotonic())

    one(MODEL)
    print("ready", flush=True)
    next_od = time.monotonic() + rng.uniform(0, OD_PERIOD_S)
    try:
        while True:
            for _ in range(50):
                one(MODEL)
                if time.monotonic() >= next_od:
                    break
            if os.path.exists(args["stop"]):
                break
            if time.monotonic() >= next_od:
                one(str(rng.choice(sorted(OD_OFFSETS))))
                next_od = time.monotonic() + rng.uniform(0.5, 1.5) * OD_PERIOD_S
    finally:
        close()
    return tally.to_json()


if __name__ == "__main__":
    from helpers.soak import die_with_parent

    die_with_parent()
    print(json.dumps(run(sys.argv[1], json.loads(sys.stdin.readline()))), flush=True)
