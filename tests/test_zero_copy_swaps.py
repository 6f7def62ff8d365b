"""Zero-copy clients through version swaps (issue 24, bug 1), through a real server and its workers.

Each client keeps one ``ZeroCopyCall`` and loops on ``run()`` as the README shows, while the
model's default version is swapped under it: to a version whose tensors are listed in another
order, to one whose inputs take another shape, and back.  A call whose input signature the new
version still takes keeps working without the caller doing anything (the client re-reads the
spec itself); one the new version refuses gets one clear error that says what changed.  Every
answer's values are checked, not only that it came: each version computes something else, so an
answer read by the wrong spec's indices, or from the wrong version, is caught.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from shmserve import AsyncClient, ErrorCode, ShmserveError

from helpers.server import serving, wait_for
from test_model_lifecycle import add_version, repo_server_section

# Version v answers d = a - b + v and s = a + b + 1000 v: the version is in every answer, and an
# answer computed from a and b swapped (the wrong input indices) or with d and s swapped (the
# wrong output indices) does not fit any version.
MODEL = """\
import numpy as np
VERSION = {version}
def model(inputs):
    a, b = inputs["a"], inputs["b"]
    return {{"d": a - b + np.float32(VERSION), "s": a + b + np.float32(1000 * VERSION)}}
model.inputs = [{inputs}]
model.outputs = [{outputs}]
"""


def tensor(name: str, shape: str) -> str:
    return '{{"name": "%s", "dtype": "float32", "shape": %s}}' % (name, shape)


def version_body(inputs: tuple[str, str], outputs: tuple[str, str], shape: str = '["n"]') -> str:
    return MODEL.replace("{inputs}", ", ".join(tensor(n, shape) for n in inputs)) \
                .replace("{outputs}", ", ".join(tensor(n, shape) for n in outputs))


# The versions the default moves through: another order of inputs and outputs (2), inputs of a
# fixed length 8 (3: a call of 5 elements is refused, one of 8 goes on), back to any length (4).
VERSIONS = {1: version_body(("a", "b"), ("d", "s")),
            2: version_body(("b", "a"), ("s", "d")),
            3: version_body(("a", "b"), ("d", "s"), "[8]"),
            4: version_body(("b", "a"), ("d", "s"))}
FIXED_LENGTH_VERSION = 3


def answered_by(a: np.ndarray, b: np.ndarray, outputs: dict) -> int:
    """The version whose answer ``outputs`` is for inputs ``a`` and ``b``; AssertionError if it is
    no version's (values read or written by another spec's indices)."""
    v = int(round(float(outputs["s"][0] - a[0] - b[0]) / 1000))
    assert v in VERSIONS, f"no version answers s = {outputs['s'].tolist()} for a = {a.tolist()}, b = {b.tolist()}"
    np.testing.assert_array_equal(outputs["s"], a + b + np.float32(1000 * v))
    np.testing.assert_array_equal(outputs["d"], a - b + np.float32(v))
    return v


class Loop:
    """One client's loop on a zero-copy call of ``n`` elements: what it saw."""

    def __init__(self, name: str, n: int):
        self.name, self.n = name, n
        self.answers: dict[int, int] = {}  # version -> answers from it
        self.refusals: list[ShmserveError] = []  # clear errors: the new version takes no call of n elements
        self.failures: list[str] = []  # anything else: a defect

    def inputs(self, rng) -> tuple[np.ndarray, np.ndarray]:
        a = rng.integers(0, 100, self.n).astype(np.float32)
        return a, rng.integers(0, 100, self.n).astype(np.float32)

    def answered(self, a, b, outputs) -> None:
        v = answered_by(a, b, outputs)
        self.answers[v] = self.answers.get(v, 0) + 1

    def refused(self, exc: ShmserveError) -> bool:
        """Whether ``exc`` is the one clear refusal a call of ``n`` elements gets from the fixed-length
        version (then the loop goes on with a call of 8 elements)."""
        if exc.code is ErrorCode.BAD_SHAPE and f"version {FIXED_LENGTH_VERSION}" in exc.message \
                and "make a new zero_copy call" in exc.message and not self.refusals:
            self.refusals.append(exc)
            self.n = 8
            return True
        self.failures.append(f"{self.name}: {exc!r}")
        return False


def run_sync(srv, loop: Loop, stop: threading.Event, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with srv.client(timeout=60) as c:
        while not stop.is_set():
            call = c.zero_copy("m", {"a": ((loop.n,), np.float32), "b": ((loop.n,), np.float32)})
            try:
                assert call.region.lane is not None
                while not stop.is_set():
                    a, b = loop.inputs(rng)
                    call.inputs["a"][...], call.inputs["b"][...] = a, b
                    try:
                        loop.answered(a, b, call.run())
                    except ShmserveError as exc:
                        if loop.refused(exc):
                            break  # a new call for the new shape
                        return
            except Exception as exc:  # noqa: BLE001 - every failure is reported
                loop.failures.append(f"{loop.name}: {exc!r}")
                return
            finally:
                call.release()


def run_async(srv, loop: Loop, stop: threading.Event, seed: int) -> None:
    rng = np.random.default_rng(seed)

    async def main():
        async with AsyncClient(srv.socket, timeout=60) as c:
            while not stop.is_set():
                shapes = {"a": ((loop.n,), np.float32), "b": ((loop.n,), np.float32)}
                async with await c.zero_copy("m", shapes) as call:
                    assert call.region.lane is not None
                    while not stop.is_set():
                        a, b = loop.inputs(rng)
                        call.inputs["a"][...], call.inputs["b"][...] = a, b
                        try:
                            loop.answered(a, b, await call.run())
                        except ShmserveError as exc:
                            if loop.refused(exc):
                                break
                            return

    try:
        asyncio.run(main())
    except Exception as exc:  # noqa: BLE001
        loop.failures.append(f"{loop.name}: {exc!r}")


def test_zero_copy_calls_follow_every_swap_by_themselves(tmp_path):
    repo = tmp_path / "repo"
    add_version(repo, "m", 1, VERSIONS[1])
    with serving(tmp_path, "", server_section=repo_server_section(repo, "max_workers = 8")) as srv:
        # Four threads, each with its own client, as issue 24 ran them; two with calls of 8
        # elements (every version takes them), two of 5 (the fixed-length version refuses them);
        # one of each kind on the asyncio client.
        loops = [Loop("sync-8", 8), Loop("sync-5", 5), Loop("async-8", 8), Loop("async-5", 5)]
        stop = threading.Event()
        threads = [threading.Thread(target=run_async if loop.name.startswith("async") else run_sync,
                                    args=(srv, loop, stop, seed)) for seed, loop in enumerate(loops)]
        for t in threads:
            t.start()
        try:
            with srv.client(timeout=120) as admin:
                for v in (2, 3, 4):
                    counts = [sum(loop.answers.values()) for loop in loops]
                    wait_for(lambda: all(sum(loop.answers.values()) > n for loop, n in zip(loops, counts))
                             or any(loop.failures for loop in loops), "every client to be answered")
                    add_version(repo, "m", v, VERSIONS[v])
                    reply = admin.load("m", version=v)
                    assert reply["version"] == v and reply["state"] == "ready", reply
                    wait_for(lambda: all(loop.answers.get(v) for loop in loops) or
                             any(loop.failures for loop in loops), f"every client to be answered by version {v}",
                             timeout=60)
        finally:
            stop.set()
            for t in threads:
                t.join(120)
        failures = [f for loop in loops for f in loop.failures]
        assert not failures, failures[:5]
        for loop in loops:
            assert set(loop.answers) == set(VERSIONS), (loop.name, loop.answers)
        # A call every version takes never failed; one of 5 elements got exactly one error, from the
        # swap to the fixed-length version, saying what changed.
        assert [len(loop.refusals) for loop in loops] == [0, 1, 0, 1]
        message = loops[1].refusals[0].message
        assert "version 2" in message and "version 3" in message and "a" in message, message
