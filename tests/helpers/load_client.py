"""One load-test client: N identity requests with random sizes (1 B .. 64 MiB, log-uniform),
alternating inline and zero-copy; every answer must equal its request.

As a script: ``load_client.py SOCKET SEED N``; exits non-zero on the first wrong answer.
"""

from __future__ import annotations

import sys

import numpy as np

from shmserve import Client

MAX_BYTES = 64 * 1024 * 1024


def sizes(rng, n: int) -> list[int]:
    out = [1, MAX_BYTES] if n >= 2 else [1]
    out += [int(2 ** rng.uniform(0, 26)) for _ in range(n - len(out))]
    rng.shuffle(out)
    return out


def run_client(path: str, seed: int, n: int) -> None:
    rng = np.random.default_rng(seed)
    with Client(path, timeout=120) as c:
        for i, size in enumerate(sizes(rng, 2 * n)):
            x = rng.integers(0, 256, size, dtype=np.uint8)
            if i % 2 == 0:
                y = c.infer("identity", {"x": x})["y"]
                if not np.array_equal(x, y):
                    raise AssertionError(f"seed {seed}: inline answer {i} ({size} bytes) differs")
            else:
                with c.zero_copy("identity", {"x": ((size,), np.uint8)}) as call:
                    call.inputs["x"][...] = x
                    y = call.run()["y"]
                    if not np.array_equal(x, y):
                        raise AssertionError(f"seed {seed}: zero-copy answer {i} ({size} bytes) differs")


if __name__ == "__main__":
    run_client(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    print("ok")
