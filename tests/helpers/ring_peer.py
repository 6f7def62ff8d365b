"""A real second process for ring tests: echo entries from worker 0's submission ring to its
completion ring, adding 1, until it receives 0.

usage: ring_peer.py INSTANCE futex|eventfd [EVENTFD] [SPIN_SECONDS]
"""

import sys

from shmserve.arena import Arena
from shmserve.rings import EventfdDoorbell, FutexDoorbell, Ring

instance, kind = sys.argv[1], sys.argv[2]
arena = Arena.attach(instance)
submissions = Ring.of_worker(arena, 0, completion=False)
completions = Ring.of_worker(arena, 0, completion=True)
inbox = FutexDoorbell(submissions)
spin = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
outbox = EventfdDoorbell(completions, int(sys.argv[3])) if kind == "eventfd" else FutexDoorbell(completions)
while True:
    if not inbox.wait(timeout=30, spin=spin):
        sys.exit("peer: no submission for 30 s")
    value = submissions.pop()
    if value == 0:
        break
    while not completions.push(value + 1):
        pass
    outbox.notify()
del submissions, completions, inbox, outbox
arena.close()
