"""Cross-process torture of slot publication: zero torn or stale reads over many hand-offs.

Rounds: SHMSERVE_TORTURE_ROUNDS (CI sets 1,000,000; the default keeps a
local run short).  The seed is printed; SHMSERVE_TORTURE_SEED replays one.
"""

from __future__ import annotations

import os
import random

from shmserve.arena import Arena

from conftest import shm_names
from helpers.torture import run_front

ROUNDS = int(os.environ.get("SHMSERVE_TORTURE_ROUNDS", "20000"))


def test_slot_handoff_torture(instance_name):
    seed = int(os.environ.get("SHMSERVE_TORTURE_SEED", random.SystemRandom().randrange(2**32)))
    print(f"torture: seed={seed} rounds={ROUNDS} (replay with SHMSERVE_TORTURE_SEED={seed})")
    before = shm_names()
    with Arena.create(instance_name("torture"), slot_count=32, max_workers=2,
                      size_classes=[(64 * 1024, 32)]) as arena:
        result = run_front(arena, rounds=ROUNDS, workers=2, seed=seed)
    assert not result.mismatches, f"seed {seed}: {result.mismatches[:3]}"
    assert result.rounds == ROUNDS
    total = 0
    for report in result.worker_reports:
        assert report.startswith("exit 0: ok "), f"seed {seed}: worker said {report!r}"
        total += int(report.split()[-1])
    assert total == ROUNDS  # every round went through a worker process
    assert shm_names() == before
