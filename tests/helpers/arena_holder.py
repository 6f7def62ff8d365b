"""A real owner process for lifecycle tests: create an arena, say so, hold it (at most 120 s).

usage: arena_holder.py INSTANCE
"""

import sys
import time

from shmserve.arena import Arena

arena = Arena.create(sys.argv[1], slot_count=4, max_workers=1, size_classes=[(4096, 2)])
print("ready", flush=True)
time.sleep(120)
