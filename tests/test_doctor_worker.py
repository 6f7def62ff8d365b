"""What a worker tells for `shmserve doctor`, in one process with real parts (an arena, the step,
the worker, a python backend): the requests that bring an input signature it had not met,
counted on the arena's path (the lanes' is the live tests'), told at most once a second while
busy and at once when idle, with a clock the test moves; and its runtime's thread pools, asked
of the backend once through the adapter."""

from __future__ import annotations

import contextlib

import numpy as np

from shmserve.config import ModelConfig
from shmserve.spec import TensorSpec
from workers.adapter import BackendAdapter
from workers.worker import SIGNATURES_EVERY_S

from test_worker_batching import serving


class Echo:
    inputs = (TensorSpec("x", "float32", ("n",)),)
    outputs = (TensorSpec("y", "float32", ("n",)),)

    def run(self, inputs):
        return {"y": np.asarray(inputs["x"])}


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def worker_over(instance: str, backend, clock: Clock, told: list):
    """(FrontEnd, Worker) as test_worker_batching makes them, the worker telling ``told`` on ``clock``."""
    with serving(instance, ModelConfig(name="echo", backend="python", path="x:y"), backend) as (front, worker):
        worker.tell_signatures, worker.clock = told.append, clock
        yield front, worker


def run(front, worker, n: int):
    call = front.submit(np.zeros(n, np.float32))
    (work,), stop = worker.gather()
    worker.step.serve(*work)
    assert front.answer(call)["y"].shape == (n,)


def test_new_input_signatures_are_counted_and_told_at_most_once_a_second_while_busy(instance_name):
    clock, told = Clock(), []
    with worker_over(instance_name("sig"), Echo(), clock, told) as (front, worker):
        for n in (4, 4, 5, 6, 4, 5):
            run(front, worker, n)
        assert (worker.step.new_signatures, worker.step.distinct_signatures) == (3, 3)
        worker.tell_signatures_now(idle=False)
        assert told == [{"new": 3, "distinct": 3, "short": 0}]
        run(front, worker, 7)
        clock.now += SIGNATURES_EVERY_S / 2
        worker.tell_signatures_now(idle=False)  # busy, and told half a second ago: not yet
        assert len(told) == 1
        worker.tell_signatures_now(idle=True)  # idle: at once
        assert told[-1] == {"new": 4, "distinct": 4, "short": 0}
        run(front, worker, 8)
        clock.now += SIGNATURES_EVERY_S
        worker.tell_signatures_now(idle=False)
        assert told[-1] == {"new": 5, "distinct": 5, "short": 0} and len(told) == 3


def test_the_thread_pools_are_what_the_backend_says_once():
    class Stated(Echo):
        threads = {"runtime": "onnxruntime", "intra_op": 4, "inter_op": 1}

    class Asked(Echo):
        calls = 0

        def threads(self):
            Asked.calls += 1
            return {"runtime": "torch", "intra_op": 8, "inter_op": 2}

    class Odd(Echo):
        threads = 7

    assert BackendAdapter(Stated()).threads() == {"runtime": "onnxruntime", "intra_op": 4, "inter_op": 1}
    asked = BackendAdapter(Asked())
    assert asked.threads()["intra_op"] == 8 and Asked.calls == 1
    assert BackendAdapter(Echo()).threads() == {} and BackendAdapter(Odd()).threads() == {}
