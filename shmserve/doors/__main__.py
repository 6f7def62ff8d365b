"""``python -P -m shmserve.doors``: one door process (started by the main process, never by people)."""

import sys

from shmserve.doors.process import main

sys.exit(main())
