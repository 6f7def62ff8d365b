"""The documentation against the code it describes: every configuration key in docs/config.md with
its type and default, the README's rules (no link out of the repository, the commands a user needs)
and its Python example run against a real server.  Adding a key to shmserve/config.py means adding
its line to docs/config.md; this file says which line is missing."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shmserve import config
from shmserve.config import ConfigError, ModelConfig, ServerConfig

from helpers.server import TESTS_DIR, ServerProcess

ROOT = TESTS_DIR.parent
CONFIG_DOC = ROOT / "docs" / "config.md"
README = ROOT / "README.md"

# Which sections of docs/config.md document which table of the file.
SECTIONS = {"server": ("`[server]`: the service", "What one client can make the server hold"),
            "arena": ("`[arena]`",), "models": ("`[[models]]`",)}
# A key whose dataclass field has another name.
FIELD_OF = {("arena", "slots"): "arena_slots"}
# Defaults the code holds as a placeholder (None, empty) and the doc describes in words.
IN_WORDS = {("server", "spin_us"): "automatic", ("arena", "size_classes"): "derived from",
            ("models", "inputs"): "from the model", ("models", "outputs"): "from the model",
            ("server", "memory_budget"): "no budget", ("models", "version_policy"): "{latest = 1}"}
TYPE_WORDS = {int: "integer", float: "number", str: "string", tuple: "list", dict: "table"}


def allowed_keys(raw: dict) -> set[str]:
    """The keys parse() accepts where ``raw`` has an unknown one, from its error message."""
    with pytest.raises(ConfigError) as err:
        config.parse(raw)
    m = re.search(r"unknown key \(allowed: (.*)\)$", str(err.value))
    assert m, str(err.value)
    return set(m.group(1).split(", "))


def parsed_keys() -> dict[str, set[str]]:
    return {"server": allowed_keys({"server": {"zz_not_a_key": 1}}),
            "arena": allowed_keys({"arena": {"zz_not_a_key": 1}}),
            "models": allowed_keys({"models": [{"zz_not_a_key": 1}]})}


def documented_keys() -> dict[str, dict[str, tuple[str, str]]]:
    """{table: {key: (type, default)}} from the reference tables and the **`key`** — type, default
    paragraphs of each table's sections."""
    sections: dict[str, str] = {}
    for chunk in CONFIG_DOC.read_text().split("\n## ")[1:]:
        heading, _, body = chunk.partition("\n")
        sections[heading.strip()] = body
    found: dict[str, dict[str, tuple[str, str]]] = {}
    for table, headings in SECTIONS.items():
        keys: dict[str, tuple[str, str]] = {}
        for heading in headings:
            assert heading in sections, f"docs/config.md has no section '## {heading}'"
            body = sections[heading]
            for row in re.finditer(r"^\| ((?:`\w+`(?:, )?)+) \| ([^|]*) \| ([^|]*) \|", body, re.M):
                for key in re.findall(r"`(\w+)`", row.group(1)):
                    keys[key] = (row.group(2).strip(), row.group(3).strip())
            for para in re.split(r"\n\s*\n", body):
                para = " ".join(para.split())
                m = re.match(r"\*\*`(\w+)`\*\* — ([\w ]+?), default (`[^`]+`|\w+)", para)
                if m:
                    keys[m.group(1)] = (m.group(2), m.group(3))
        found[table] = keys
    return found


def code_default(table: str, key: str):
    """(has_default, default, annotation's type) of the dataclass field behind ``key``."""
    cls = ModelConfig if table == "models" else ServerConfig
    fields = {f.name: f for f in dataclasses.fields(cls)}
    f = fields.get(FIELD_OF.get((table, key), key))
    if f is None:
        return None
    if f.default is not dataclasses.MISSING:
        return True, f.default
    if f.default_factory is not dataclasses.MISSING:
        return True, f.default_factory()
    return False, None


def rendered(key: str, value) -> str:
    """A default as docs/config.md writes it (TOML)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return oct(value) if key.endswith("_mode") else str(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(rendered(key, v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else repr(value)
    raise AssertionError(f"{key}: no rendering for {value!r}")


def test_every_config_key_is_documented_with_its_type_and_default():
    parsed, documented = parsed_keys(), documented_keys()
    problems = []
    for table, keys in parsed.items():
        for key in sorted(keys):
            where = f"{table}.{key}"
            if key not in documented[table]:
                problems.append(f"{where}: not in docs/config.md (a table row or a **`{key}`** paragraph)")
                continue
            doc_type, doc_default = documented[table][key]
            code = code_default(table, key)
            if code is None:  # parsed into another field (allow_groups into allow_gids): a default in words
                if not doc_default:
                    problems.append(f"{where}: docs/config.md gives no default")
                continue
            has_default, value = code
            if not has_default:
                if doc_default != "required":
                    problems.append(f"{where}: required, docs/config.md says default {doc_default!r}")
                continue
            if (table, key) in IN_WORDS:
                if IN_WORDS[table, key] not in doc_default:
                    problems.append(f"{where}: docs/config.md default {doc_default!r}, "
                                    f"expected {IN_WORDS[table, key]!r}")
                continue
            if value is None:
                if doc_default != "none":
                    problems.append(f"{where}: default None, docs/config.md says {doc_default!r}")
                continue
            if f"`{rendered(key, value)}`" not in doc_default:
                problems.append(f"{where}: default {rendered(key, value)}, docs/config.md says {doc_default}")
            kind = TYPE_WORDS.get(type(value))
            if kind and kind not in doc_type and not (kind == "list" and "list" in doc_type):
                problems.append(f"{where}: a {kind}, docs/config.md says {doc_type!r}")
    for table, keys in documented.items():
        for key in sorted(set(keys) - parsed[table]):
            problems.append(f"{table}.{key}: in docs/config.md but not a key parse() accepts")
    assert not problems, "\n".join(problems)


def test_config_doc_states_the_units():
    text = " ".join(CONFIG_DOC.read_text().split())
    assert "`*_s`" in text and "seconds" in text
    assert "`*_us`" in text and "microseconds" in text
    assert "`*_bytes`" in text and "`*_bytes_per_*`" in text


# -- README ----------------------------------------------------------------------------------

def test_readme_links_stay_in_the_repository_and_show_what_a_user_needs():
    text = README.read_text()
    assert text.startswith("# shmserve\n\n```sh\n"
                           "make serve   # install into .venv and run the service on its embedded demo model (CPU)\n"
                           "make test    # install into .venv with the test extras and run the whole test suite\n"
                           "```\n")
    assert not re.search(r"https?://(?!localhost)", text), "a link outside the repository"
    for target in re.findall(r"\]\(([^)]+)\)", text):
        path = target.split("#")[0]
        assert not path.startswith(("..", "/")), target
        assert (ROOT / path).exists(), f"README links to {target}, which is not in the repository"
    for needed in ("make serve SERVE_ARGS=", "max_batch_size", "max_queue_delay_us", "'.[onnx]'"):
        assert needed in text, needed


def readme_python() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks
    return "\n".join(blocks)


README_HTTP = "127.0.0.1:8000"  # the README's v2 address; the test's server listens on a free port instead


def test_readme_python_examples_run_against_the_demo_model(tmp_path):
    """Every ```python block of the README, as written (but for the v2 port), against a server on
    the demo model: the native client's examples and Triton's client on the v2 HTTP door."""
    demo = config.demo_config().models[0].path
    srv = ServerProcess(tmp_path, f'[[models]]\nname = "demo"\nbackend = "onnxruntime"\npath = "{demo}"\n',
                        server_section='http = "127.0.0.1:0"\n').start()
    try:
        script = tmp_path / "readme_example.py"
        code = readme_python()
        assert README_HTTP in code
        script.write_text(code.replace(README_HTTP, srv.info()["v2"]["http"]))
        env = dict(os.environ, SHMSERVE_SOCKET=srv.socket)
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env,
                           cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        assert srv.stop() == 0, srv.log()


def test_an_install_carries_every_module_and_the_demo_model(tmp_path):
    """docs/systemd.md installs with `pip install .` (not -e): the built tree must hold every module
    of the source tree (a subpackage missing from setup.py breaks only such installs) and the demo model."""
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for package in ("shmserve", "workers"):
        for source in (ROOT / package).rglob("*.py"):
            assert (tmp_path / source.relative_to(ROOT)).is_file(), f"{source.relative_to(ROOT)} is not installed"
    assert (tmp_path / "shmserve" / "models" / "demo.onnx").is_file()


def test_readme_config_example_is_a_valid_config(tmp_path):
    """The README's models.toml parses as written (its model file stands in as an empty file)."""
    blocks = re.findall(r"```toml\n(.*?)```", README.read_text(), re.S)
    assert blocks
    for block in blocks:
        for path in re.findall(r'^path = "([^"]+)"', block, re.M):
            (tmp_path / path).touch()
        (tmp_path / "models.toml").write_text(block)
        cfg = config.load(tmp_path / "models.toml")
        assert any(m.max_batch_size > 1 and m.max_queue_delay_us > 0 for m in cfg.models)


# -- docs/models.md's worked example, run as written ----------------------------------------------

MODELS_DOC = ROOT / "docs" / "models.md"
BOX = str.maketrans({c: " " for c in "│┃┆┊║─━┄┈═┏┓┗┛┌┐└┘┡┩┢┪╇╈╋┳┻┣┫┠┨┯┷┿╂╔╗╚╝╠╣╦╩╬╭╮╯╰"})
# What varies between runs, made one token: decimals (times, ratios, metric values), and a count or a
# size before its unit or noun, a uid.
VARYING = re.compile(r"\d+\.\d+(?:e[+-]?\d+)?|\d+(?= ?(?:MiB|ms|s\b|%|bytes|requests|compared|mismatched))"
                     r"|(?<=uid )\d+|\d+(?= of \d+ compared)")


def skeleton(line: str) -> str:
    """``line`` as the worked example is compared: without a table's boxes, with what varies made ``#``,
    whitespace collapsed."""
    return " ".join(VARYING.sub("#", line.translate(BOX)).split())


def worked_example() -> list[tuple[str, str, list[str]]]:
    """The steps of docs/models.md's worked example, in order: ("file", path, lines) for a fenced block
    headed by its path ("`PATH`:" or "`PATH` (...):"), ("run", command, the output lines shown) for each
    ``$`` line of a ```console block."""
    text = MODELS_DOC.read_text().split("\n## Worked example\n", 1)[1]
    steps, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        head = re.match(r"^`([^`]+)`(?: \(.*)?:?$", lines[i])
        if head and not lines[i].startswith("``"):
            j = i + 1
            while not lines[j].startswith("```"):  # the heading may run on over a few lines
                j += 1
            end = lines.index("```", j + 1)
            steps.append(("file", head.group(1), lines[j + 1:end]))
            i = end + 1
            continue
        if lines[i] == "```console":
            end = lines.index("```", i + 1)
            for line in lines[i + 1:end]:
                if line.startswith("$ "):
                    steps.append(("run", line[2:], []))
                else:
                    steps[-1][2].append(line)
            i = end + 1
            continue
        i += 1
    return steps


def test_the_models_worked_example_is_complete():
    """Every model file the example's repository needs is shown, and every command it runs is a ``$``
    line of a console block (issue 24 item 7: the python config lacked inputs and outputs, and the
    model file was not shown)."""
    steps = worked_example()
    files = {path for kind, path, _ in steps if kind == "file"}
    assert {"DIR/echo/config.toml", "DIR/echo/1/vmodel.py", "DIR/broken/config.toml", "DIR/broken/1/vmodel.py",
            "send.py", "residency.toml", "repo/a/config.toml", "repo/a/1/vmodel.py"} <= files, files
    assert 'inputs = [{name = "x"' in "\n".join(next(b for k, p, b in steps if p == "DIR/echo/config.toml"))
    commands = [c for kind, c, _ in steps if kind == "run"]
    assert sum(c.startswith("shmserve serve") for c in commands) == 2 and "kill %2" in commands


def test_the_models_worked_example_runs_as_written(tmp_path):
    """docs/models.md's worked example as a reader would run it: its files written, its commands run in
    order by bash (``shmserve`` and ``python3`` this checkout's), each output shown found in what the
    command prints (``skeleton``), the servers' log lines in their logs.  Only the names that must be
    unique here change: the instances, their sockets (in ``tmp_path``), the metrics port."""
    from conftest import new_instance

    work = tmp_path / "work"
    (work / "DIR").mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, argv in (("shmserve", f'"{sys.executable}" -m shmserve.cli'), ("python3", f'"{sys.executable}"')):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {argv} "$@"\n')
        (bin_dir / name).chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    names = {"docslc2": new_instance("doc"), "docslc": new_instance("doc")}
    sockets = {f"/tmp/{name}.sock": str(tmp_path / f"{name}.sock") for name in names}

    def local(text: str) -> str:
        for old, new in (*sockets.items(), *names.items(), ("127.0.0.1:9464", f"127.0.0.1:{port}"),
                         ("DIR", str(work / "DIR"))):
            text = text.replace(old, new)
        return text

    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", COLUMNS="250",
               PYTHONPATH=str(ROOT))
    jobs: list[tuple[subprocess.Popen, object]] = []
    try:
        for kind, what, shown in worked_example():
            if kind == "file":
                path = work / local(what)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("\n".join(shown) + "\n")
                continue
            command = local(what)
            if command.startswith("export "):
                key, _, value = command[len("export "):].partition("=")
                env[key] = value
                continue
            if command.startswith("kill %"):
                proc, log = jobs[int(command[len("kill %"):]) - 1]
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(60) == 0, log.read_text()
                continue
            if command.endswith(" &"):  # a server: started, then waited for
                log = tmp_path / f"job{len(jobs) + 1}.log"
                with open(log, "wb") as out:
                    proc = subprocess.Popen(["bash", "-c", "exec " + command[:-2]], stdout=out,
                                            stderr=subprocess.STDOUT, env=env, cwd=work)
                jobs.append((proc, log))
                deadline = time.monotonic() + 120
                while "ready: listening on" not in log.read_text():
                    assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                    time.sleep(0.1)
                logged = {skeleton(line) for line in log.read_text().splitlines()}
                for line in shown:
                    want = skeleton(local(line.removeprefix("... ")))
                    assert any(want in got for got in logged), f"{command}: log line {line!r} not in\n{logged}"
                continue
            r = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300, env=env,
                               cwd=work)
            printed = [skeleton(line) for line in (r.stdout + r.stderr).splitlines()]
            assert "Traceback" not in r.stdout + r.stderr, f"{command}:\n{r.stdout}{r.stderr}"
            for line in filter(None, shown):
                want = skeleton(local(line))
                assert want in printed, f"{command}: {line!r} not in what it printed:\n{r.stdout}{r.stderr}"
                printed.remove(want)
        assert len(jobs) == 2 and all(proc.returncode == 0 for proc, _ in jobs)  # both servers ran and stopped
    finally:  # a server the example did not stop (it failed first) is stopped as it would be
        for proc, _ in jobs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def test_the_models_doc_config_snippets_are_valid_config(tmp_path):
    """docs/models.md's ```toml blocks before its worked example (which runs its own) parse as
    written: a [server] one as a config file, a model key inside a [[models]] table of its own."""
    text = MODELS_DOC.read_text().split("\n## Worked example\n", 1)[0]
    blocks = re.findall(r"```toml\n(.*?)```", text, re.S)
    assert len(blocks) >= 2
    (tmp_path / "x.npy").write_bytes(b"")  # a warm-up file a snippet names: it must exist (read by the worker)
    (tmp_path / "m.py").write_text("def model(inputs):\n    return inputs\n")
    for i, block in enumerate(blocks):
        model = '[[models]]\nname = "m"\nbackend = "python"\npath = "m:model"\n'
        text = block if block.lstrip().startswith("[server]") else model + block
        if "[[models]]" not in text:
            text += "\n" + model
        (tmp_path / f"snippet{i}.toml").write_text(text)
        config.load(tmp_path / f"snippet{i}.toml")


# -- make serve: never a silent wait ------------------------------------------------------------

PIP_STAND_IN = """#!/bin/sh
# The venv's python for this test: the suite's own, with pip asked for a dry run (it resolves,
# prepares and says so, installs nothing); with PIP_FAILS set, a pip that fails after a line.
if [ "$1 $2 $3" = "-m pip install" ]; then
    shift 3
    if [ -n "$PIP_FAILS" ]; then echo "Collecting no-such-package"; echo "ERROR: no such package" >&2; exit 1; fi
    exec "{python}" -m pip install --dry-run "$@"
fi
exec "{python}" "$@"
"""


def _venv_stand_in(tmp_path) -> str:
    """A VENV for ``make`` whose bin/python and bin/shmserve are this suite's (no new venv is made)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(PIP_STAND_IN.replace("{python}", sys.executable))
    (venv / "bin" / "shmserve").write_text('#!/bin/sh\nif [ -n "$PIP_FAILS" ]; then echo "the service ran"; exit 0; fi\n'
                                           f'exec "{sys.executable}" -m shmserve.cli "$@"\n')
    for name in ("python", "shmserve"):
        (venv / "bin" / name).chmod(0o755)
    return str(venv)


def test_make_serve_says_each_step_before_it_and_shows_pips(tmp_path):
    """Issue 28 item 1: ``make serve`` was silent for about 45 s on a fresh clone (pip --quiet)
    before ``ready``.  Each step is now announced with its expected time, pip's own steps show as
    they happen (not its 'already satisfied' chatter), then the server's start-up; Ctrl-C stops it."""
    from conftest import new_instance

    venv = _venv_stand_in(tmp_path)
    args = f"--instance {new_instance('make')} --socket {tmp_path / 'make.sock'}"
    proc = subprocess.Popen(["make", "--no-print-directory", "-C", str(ROOT), "serve", f"VENV={venv}",
                             f"SERVE_ARGS={args}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not any("ready: listening on" in line for line in lines):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        rest, _ = proc.communicate(timeout=60)
        lines += rest.splitlines(keepends=True)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = "".join(lines)

    def first(words: str) -> int:
        return next((i for i, line in enumerate(lines) if words in line), len(lines))

    install, starting, ready = first("make: installing shmserve"), first("make: starting the service"), \
        first("ready: listening on")
    pip = [i for i, line in enumerate(lines) if line.startswith(("Obtaining", "  Installing build dependencies",
                                                                 "  Preparing editable metadata"))]
    assert install < len(lines) and ready < len(lines), text
    assert "about a minute the first time" in lines[install], text
    assert pip and install < min(pip) and max(pip) < starting < ready, text
    assert "Requirement already satisfied" not in text and "Traceback" not in text, text


def test_make_serve_stops_when_pip_fails_whatever_its_filter_says(tmp_path):
    """pip's output goes through a filter (sed), whose status is not pip's: a failed install must
    still stop ``make serve`` before it starts the service (the Makefile's pipefail)."""
    venv = _venv_stand_in(tmp_path)
    r = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "serve", f"VENV={venv}"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, PIP_FAILS="1"))
    assert r.returncode != 0, r
    assert "Collecting no-such-package" in r.stdout and "ERROR: no such package" in r.stderr, r
    assert "make: starting the service" not in r.stdout and "the service ran" not in r.stdout, r


# -- a checkout named shmserve beside the caller ---------------------------------------------

def test_a_checkout_named_shmserve_in_the_current_directory_is_named_and_never_breaks_a_server(tmp_path):
    """Issue 28 item 5: with the clone in ``./shmserve`` and Python run from the directory that holds
    it, ``from shmserve import Client`` failed with "cannot import name 'Client' from 'shmserve'
    (unknown location)": the clone hid the installed package.  Now the checkout's own package is
    used, with a warning that says so and what to do; a checkout whose package cannot be used
    there (its extensions not built) says what it is and what to do.  A server started there (the
    console script) still runs its workers, which start with ``python -P`` (the current directory
    not on their path): neither the checkout nor a package named ``workers`` planted there is
    imported in place of their own."""
    holder = tmp_path / "holder"
    holder.mkdir()
    (holder / "shmserve").symlink_to(ROOT, target_is_directory=True)  # the clone, as named by git clone
    r = subprocess.run([sys.executable, "-c", "from shmserve import Client; print(Client.__name__)"],
                       capture_output=True, text=True, timeout=60, cwd=holder)
    assert r.returncode == 0 and r.stdout.strip() == "Client", r.stderr
    assert f"the checkout at {holder / 'shmserve'} is used, not the installed package" in r.stderr, r.stderr
    assert "Run Python from another directory" in r.stderr and "mv shmserve shmserve-src" in r.stderr, r.stderr

    bare = tmp_path / "bare"  # a clone never built: its package has no compiled extensions
    shutil.copytree(ROOT / "shmserve", bare / "shmserve" / "shmserve", ignore=shutil.ignore_patterns("*.so"))
    shutil.copy(ROOT / "__init__.py", bare / "shmserve" / "__init__.py")
    r = subprocess.run([sys.executable, "-c", "from shmserve import Client"], capture_output=True, text=True,
                       timeout=60, cwd=bare)
    assert r.returncode == 1 and "unknown location" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ImportError: {bare / 'shmserve'} is a shmserve checkout"), last
    assert "Run Python from another directory" in last and "mv shmserve shmserve-src" in last, last

    from conftest import new_instance

    instance = new_instance("beside")
    config = holder / "beside.toml"
    config.write_text(f'[server]\ninstance = "{instance}"\n\n[[models]]\nname = "identity"\nbackend = "python"\n'
                      f'path = "shmserve.models:identity"\n')
    sock = str(tmp_path / "beside.sock")
    planted = tmp_path / "planted-ran"  # a package named as the workers' own, in the server's directory
    (holder / "workers").mkdir()
    (holder / "workers" / "__init__.py").write_text(f"open({str(planted)!r}, 'w').close()\n")
    script = Path(sys.executable).parent / "shmserve"  # what `make serve` runs: the console script
    proc = subprocess.Popen([str(script), "serve", "--config", str(config), "--socket", sock], cwd=holder,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        from shmserve import Client
        from shmserve.errors import ConnectionClosed

        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "late"
            try:
                with Client(sock, timeout=30) as c:
                    if c.health()["status"] == "ok":
                        break
            except ConnectionClosed:
                pass
            time.sleep(0.1)
        with Client(sock, timeout=30) as c:
            import numpy as np

            assert (c.infer("identity", {"x": np.arange(5, dtype=np.uint8)})["y"] == np.arange(5)).all()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in out, out
    assert "is used, not the installed package" not in out, out  # the workers never saw the checkout
    assert not planted.exists()  # nor the package planted beside it
