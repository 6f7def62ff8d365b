"""Imports follow the layers: foundations and workers never pull in the client library."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["shmserve.arena", "shmserve.layout", "shmserve.rings", "shmserve.lanes",
                                    "shmserve.protocol", "workers.main"])
def test_a_foundation_module_does_not_import_the_client(module):
    code = (f"import sys, {module}\n"
            "bad = sorted(m for m in ('shmserve.client', 'asyncio', 'uvloop') if m in sys.modules)\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing {module} imported {out}"


def test_the_public_api_is_still_one_import_away():
    import shmserve

    assert shmserve.Client.__module__ == "shmserve.client"
    assert shmserve.ErrorCode.TIMEOUT.wire == "timeout"
    assert {"AsyncClient", "Client", "ConnectionClosed", "ErrorCode", "ShmserveError"} <= set(dir(shmserve))
    with pytest.raises(AttributeError):
        shmserve.NotAThing  # noqa: B018
