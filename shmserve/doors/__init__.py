"""Door processes: the native Unix socket served by N processes beside the main one (docs/doors.md).

Owns: nothing itself; its modules are the door process (``process``), its view
of the models (``directory``), its lanes (``lanepool``), its own inference
through them (``dispatcher``) and its link to main (``link``).  Main's side
is ``shmserve.frontend.doorhouse`` and ``shmserve.frontend.relay``.

Must not: be imported by the main process except for ``link`` (the format
both ends speak).
"""
