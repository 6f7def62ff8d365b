#!/usr/bin/env python3
"""Run tests/test_hotpath.py against an AddressSanitizer + UBSan build of shmserve/_hotpath.c.

The equivalence tests feed the C module hostile slots, descriptors and arguments; built with
the sanitizers (and the test lanes on the heap, where ASan puts redzones around them), any read
or write outside a buffer, or undefined behaviour, aborts the run.  The build goes to
build/asan/ (the installed module is not touched); the interpreter needs the sanitizer runtimes
preloaded, which this script arranges by re-executing itself.

usage: python tools/hotpath_asan.py [pytest arguments]      (or: make test-hotpath-asan)
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "asan"
MODULE = BUILD / "_hotpath.so"
CC = os.environ.get("CC", "gcc")


def runtime(name: str) -> str:
    return subprocess.run([CC, f"-print-file-name={name}"], capture_output=True, text=True, check=True).stdout.strip()


def build() -> None:
    BUILD.mkdir(parents=True, exist_ok=True)
    subprocess.run([CC, "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                    "-fno-sanitize-recover=undefined", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror",
                    "-fPIC", "-shared", f"-I{sysconfig.get_paths()['include']}", str(ROOT / "shmserve" / "_hotpath.c"),
                    "-o", str(MODULE)], check=True)


def main() -> int:
    if os.environ.get("_HOTPATH_ASAN") != "1":
        build()
        env = dict(os.environ, _HOTPATH_ASAN="1", ASAN_OPTIONS="detect_leaks=0",
                   LD_PRELOAD=f"{runtime('libasan.so')}:{runtime('libubsan.so')}")
        return subprocess.run([sys.executable, __file__, *sys.argv[1:]], env=env, cwd=ROOT).returncode
    spec = importlib.util.spec_from_file_location("shmserve._hotpath", MODULE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["shmserve._hotpath"] = module  # before shmserve.hotpath imports (and configures) it
    spec.loader.exec_module(module)
    import shmserve.hotpath
    assert shmserve.hotpath._hotpath is module, "the sanitized build is not the one under test"
    import pytest
    # the implementation-choice test starts fresh interpreters, which import the installed build
    return pytest.main(["-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_hotpath.py"),
                        "-k", "not chosen_once", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
