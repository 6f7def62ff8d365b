"""`shmserve bench` runs from the installed command, owns its server, and reports every case."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import os

from shmserve.arena import SHM_DIR


def bench_names(run_id: str) -> set[str]:
    """What one `shmserve bench` run created: its server's arena, its floors' segments (named by the
    run id its JSON reports; another bench running meanwhile has its own)."""
    return {n for n in os.listdir(SHM_DIR) if n in (f"shmserve.bench-{run_id}",) or
            n.startswith(f"shmserve-bench-{run_id}-")}


def test_bench_spawns_its_server_measures_floors_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "shmserve.cli", "bench", "--spawn-server", "--payload", "64,1MiB",
                        "--mode", "both", "--clients", "2", "--requests", "20", "--json-out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    cases = {(c["payload"], c["mode"]) for c in report["results"]}
    assert cases == {(size, mode) for size in (64, 1 << 20) for mode in ("inline", "socket", "zero-copy")}
    for c in report["results"]:
        assert c["n"] == 2 * 20 and 0 < c["p50_us"] <= c["p90_us"] <= c["p99_us"] <= c["max_us"]
        assert c["echo_floor_p50_us"] > 0 and c["rps"] > 0
        assert (c["memcpy_p50_us"] > 0) == (c["payload"] >= 1 << 20)
    assert "| 64 B | 64 B | unix | inline | 2 |" in r.stdout and "p50 / floor" in r.stdout
    assert len(report["run_id"]) == 8 and not bench_names(report["run_id"])  # its server, its floors' segments


def test_bench_on_the_demo_model(tmp_path):
    r = subprocess.run([sys.executable, "-m", "shmserve.cli", "bench", "--spawn-server", "--model", "demo",
                        "--payload", "4KiB", "--mode", "zero-copy", "--requests", "10"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "| 4 KiB | 12 KiB | unix | zero-copy |" in r.stdout  # one 3x32x32 float32 image


def test_bench_sweeps_client_counts_paces_an_open_loop_and_plots(tmp_path):
    """``--clients 1,2`` runs every case at each count; ``--rate`` paces all clients together
    (open loop: no request goes out before it is due, so the rate is never exceeded); ``--plot``
    draws the percentiles of every case into a PNG."""
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    r = subprocess.run([sys.executable, "-m", "shmserve.cli", "bench", "--spawn-server", "--payload", "4KiB",
                        "--mode", "zero-copy", "--clients", "1,2", "--requests", "30", "--rate", "200",
                        "--json-out", str(out), "--plot", str(png)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert [c["clients"] for c in report["results"]] == [1, 2] and report["rate"] == 200
    for c in report["results"]:
        assert c["n"] == 30 * c["clients"] and c["rate"] == 200
        assert c["rps"] <= 200 * 1.05, c  # due times are never run ahead of
    assert "| 4 KiB | 4 KiB | unix | zero-copy | 2 |" in r.stdout and "at 200 req/s in all" in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not bench_names(report["run_id"])


def test_bench_measures_a_running_server_on_a_model_it_lists(tmp_path):
    """Without --spawn-server the defaults work against whatever server runs: identity if it has
    one, else its first one-input model; a model it does not list is a one-line error."""
    from helpers.server import serving

    with serving(tmp_path, """
[[models]]
name = "echo"
backend = "python"
path = "shmserve.models:identity"
""") as srv:
        r = subprocess.run([sys.executable, "-m", "shmserve.cli", "bench", "--socket", srv.socket, "--payload", "64",
                            "--mode", "inline", "--requests", "10"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert "model echo" in r.stdout and "| 64 B | 64 B | unix | inline | 1 |" in r.stdout
        bad = subprocess.run([sys.executable, "-m", "shmserve.cli", "bench", "--socket", srv.socket, "--model", "nope",
                              "--payload", "64", "--requests", "10"], capture_output=True, text=True, timeout=300)
        assert bad.returncode != 0 and "no one-input model 'nope'" in bad.stderr and "echo" in bad.stderr
        assert "Traceback" not in bad.stderr
        no_door = subprocess.run([sys.executable, "-m", "shmserve.cli", "bench", "--socket", srv.socket, "--protocol",
                                  "unix,http", "--payload", "64", "--requests", "10"], capture_output=True, text=True,
                                 timeout=300)
        assert no_door.returncode == 1 and "does not serve http" in no_door.stderr and "--http" in no_door.stderr
        assert "Traceback" not in no_door.stderr


def test_bench_json_on_stdout():
    r = subprocess.run([sys.executable, "-m", "shmserve.cli", "bench", "--spawn-server", "--payload", "64",
                        "--mode", "inline", "--requests", "10", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (case,) = json.loads(r.stdout)["results"]  # the whole of stdout: one JSON document, no table
    assert case["payload"] == 64 and case["mode"] == "inline" and case["n"] == 10


def test_bench_shows_a_progress_bar_on_a_terminal_and_step_lines_elsewhere(tmp_path):
    """On a terminal (a real pseudo-terminal here) the run shows a progress bar with the case in
    hand; piped, one '[step/total] case' line per case, so logs stay readable."""
    import pty
    import select

    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "shmserve.cli", "bench", "--spawn-server", "--payload", "64", "--mode", "inline",
            "--clients", "1,2", "--requests", "10", "--json-out", str(out)]
    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=follower)
    os.close(follower)
    seen = bytearray()
    try:
        while True:
            ready, _, _ = select.select([leader], [], [], 120)
            assert ready, "bench printed nothing for 120 s"
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's other end is closed, the run is over
                break
            if not chunk:
                break
            seen += chunk
    finally:
        proc.stdout.read()
        assert proc.wait(120) == 0
        os.close(leader)
    text = seen.decode(errors="replace")
    assert "inline 64 B x 2 clients" in text and "━" in text and "[2/3]" not in text
    assert "starting a server of its own" in text  # the wait for its models (issue 28: 13 s silent here)
    piped = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0 and "[1/3] unix floor for 64 B" in piped.stderr
    assert piped.stderr.startswith("[1/1] starting a server of its own (its workers load and warm up"), piped.stderr
    assert "[3/3] unix inline 64 B x 2 clients" in piped.stderr


def test_bench_during_swap_measures_steady_state_and_swaps_in_one_run(tmp_path):
    """``--during-swap 3``: the same two clients measure the steady state, then the same while the
    spawned repository's model moves between versions 1 and 2 three times; nothing fails and
    every answer is one version's."""
    out = tmp_path / "swap.json"
    r = subprocess.run([sys.executable, "-m", "shmserve.cli", "bench", "--spawn-server", "--during-swap", "3",
                        "--duration", "0.5", "--clients", "2", "--json-out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    swap = report["during_swap"]
    assert report["model"] == "swap" and swap["versions"] == [1, 2] and swap["swaps"] == 3
    assert swap["clients"] == 2 and swap["mode"] == "inline" and swap["payload"] == swap["tensor_bytes"] == 4096
    assert swap["failed"] == 0 and swap["swap_error"] is None and len(swap["swap_seconds"]) == 3
    assert 0 < swap["swap_median_s"] <= swap["swap_max_s"]
    for phase in ("steady", "during"):
        ph = swap[phase]
        assert ph["n"] > 0 and ph["failed"] == 0 and ph["errors"] == {} and ph["first_error"] is None
        assert 0 < ph["p50_us"] <= ph["p99_us"] <= ph["max_us"] and ph["rps"] > 0 and ph["seconds"] > 0
    # each version answers x + version: the default (2) alone before, no answer from neither
    assert swap["steady"]["answers"] == {"2": swap["steady"]["n"]} and swap["wrong"] == 0
    during = swap["during"]
    assert set(during["answers"]) <= {"1", "2"} and sum(during["answers"].values()) == during["n"]
    assert set(swap["ratio"]) == {"p50_us", "p99_us", "max_us", "rps"} and all(swap["ratio"].values())
    assert "| steady state |" in r.stdout and "| during 3 swaps |" in r.stdout and "| during / steady |" in r.stdout
    assert "swaps: 3, median" in r.stdout and "(wrong: 0)" in r.stdout and "FAILED" not in r.stderr
    assert not bench_names(report["run_id"])


def test_bench_during_canary_prints_both_p50s_and_their_ratio_and_the_split(tmp_path):
    """``--during-canary 30`` (issue 24): steady state, then the same client while the spawned
    model's version 1 is a held split canary taking 30 % (aborted after); both p50s and their ratio
    on stdout and in --json-out, the split in the answers, nothing failed; usage errors exit 2."""
    out = tmp_path / "canary.json"
    r = subprocess.run([sys.executable, "-m", "shmserve.cli", "bench", "--spawn-server", "--during-canary", "30",
                        "--duration", "1", "--json-out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    run = report["during_canary"]
    assert run["canary_percent"] == 30 and run["versions"] == [1, 2] and run["failed"] == 0 and run["wrong"] == 0
    assert run["swap_error"] is None and run["steady"]["answers"] == {"2": run["steady"]["n"]}
    during = run["during"]
    assert set(during["answers"]) == {"1", "2"} and sum(during["answers"].values()) == during["n"]
    assert run["ratio"]["p50_us"] == round(during["p50_us"] / run["steady"]["p50_us"], 2)
    assert "| during a 30 % canary |" in r.stdout and "| during / steady |" in r.stdout
    assert f"p50 steady {run['steady']['p50_us']} µs, during the canary {during['p50_us']} µs: " \
           f"x{run['ratio']['p50_us']}" in r.stdout
    assert not bench_names(report["run_id"])
    for args, said in ((["--during-canary", "0"], "percent must be in (0, 100]"),
                       (["--during-canary", "--during-swap"], "not both"),
                       (["--during-canary", "--clients", "1,2"], "--during-canary takes")):
        bad = subprocess.run([sys.executable, "-m", "shmserve.cli", "bench", *args], capture_output=True, text=True,
                             timeout=60)
        assert bad.returncode == 2 and said in bad.stderr and "Traceback" not in bad.stderr, (args, bad.stderr)


def test_bench_during_swap_needs_two_versions_and_one_case(tmp_path):
    """Against a running server the model must have two versions: a one-line error, exit 1;
    a sweep of payloads or client counts is a usage error."""
    from helpers.server import serving

    with serving(tmp_path, """
[[models]]
name = "echo"
backend = "python"
path = "shmserve.models:identity"
""") as srv:
        r = subprocess.run([sys.executable, "-m", "shmserve.cli", "bench", "--socket", srv.socket, "--during-swap"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 1 and "needs a model with at least two versions; 'echo' has 1" in r.stderr
        assert "Traceback" not in r.stderr
    for extra in (["--payload", "64,4KiB"], ["--clients", "1,2"], ["--mode", "both"]):
        bad = subprocess.run([sys.executable, "-m", "shmserve.cli", "bench", "--during-swap", "3", *extra],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "--during-swap takes" in bad.stderr, extra


def test_bench_mix_runs_several_kinds_of_client_at_once_and_reports_each_ones_share(tmp_path):
    out = tmp_path / "mix.json"
    r = subprocess.run([sys.executable, "-m", "shmserve.cli", "bench", "--spawn-server", "--payload", "4KiB",
                        "--mix", "inline:2,socket:1,zero-copy:1", "--duration", "1", "--json-out", str(out)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    mix = json.loads(out.read_text())["mix"]
    assert [(m["mode"], m["clients"]) for m in mix["modes"]] == [("inline", 2), ("socket", 1), ("zero-copy", 1)]
    assert all(0 < m["client_rps_min"] <= m["client_rps_max"] for m in mix["modes"])
    assert mix["fairness"] >= 1.0 and "fairness: the busiest client got" in r.stdout
    assert 0 < mix["client_rps_min"] <= mix["client_rps_max"] and "req/s the least served" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "shmserve.cli", "bench", "--mix", "inline:0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "bad mix" in bad.stderr and "Traceback" not in bad.stderr


def test_bench_mix_takes_the_v2_doors_and_a_slow_model(tmp_path):
    """Issue 29's fairness target mixes lane, socket and HTTP clients on a model they saturate:
    ``--mix`` takes ``http`` (and ``grpc``) clients beside the unix modes, and ``--model-us``
    has the spawned server serve the sleeping model instead of identity."""
    out = tmp_path / "mix.json"
    r = subprocess.run([sys.executable, "-m", "shmserve.cli", "bench", "--spawn-server", "--model-us", "500",
                        "--mix", "inline:1,socket:1,http:1", "--duration", "1", "--json-out", str(out)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["model"] == "sleepy", result.get("model")
    assert [(m["mode"], m["clients"]) for m in result["mix"]["modes"]] == [("inline", 1), ("socket", 1), ("http", 1)]
    assert all(m["rps"] > 0 for m in result["mix"]["modes"])
    bad = subprocess.run([sys.executable, "-m", "shmserve.cli", "bench", "--mix", "inline:1", "--model-us", "5"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--model-us is for" in bad.stderr and "Traceback" not in bad.stderr


def test_the_handoff_tool_says_each_case_before_it():
    """tools/bench_handoff.py (docs/performance.md) said a case only once it was measured: 13-76 s
    of nothing per case on a busy host in the issue 28 run-through.  Each case's line now comes
    before it, in order, then the table."""
    tool = Path(__file__).resolve().parent.parent / "tools" / "bench_handoff.py"
    r = subprocess.run([sys.executable, str(tool), "--rounds", "200"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert [line.split("] measuring ")[0].strip() for line in lines] == [f"[{i}/5" for i in range(1, 6)], lines
    assert lines[0].endswith("measuring unix-socket echo (floor) (200 round trips)"), lines
    assert "| slot hand-off, futex, spin |" in r.stdout, r.stdout


def test_the_backend_io_tool_without_torch_says_what_it_needs_in_one_line():
    """tools/bench_backend_io.py (docs/performance.md) in make serve's environment ended in
    ModuleNotFoundError's traceback (issue 28 run-through): it says what it needs, exit 2 (torch
    hidden from the real script)."""
    tool = Path(__file__).resolve().parent.parent / "tools" / "bench_backend_io.py"
    r = subprocess.run([sys.executable, "-c", "import runpy, sys; sys.modules['torch'] = None; "
                        f"sys.argv = ['bench_backend_io.py']; runpy.run_path({str(tool)!r}, run_name='__main__')"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "it needs torch and onnx" in r.stderr, r.stderr


def test_interleaved_runs_each_case_on_its_cpu_and_puts_the_affinity_back():
    """``interleaved(..., cpus=)``: a case named there runs pinned to its CPU, one not named on the
    process's own CPUs; the affinity is what it was afterwards (tools/bench_glue.py --pin)."""
    from shmserve.bench import interleaved

    mine = os.sched_getaffinity(0)
    cpu = max(mine)
    seen: dict[str, set] = {"pinned": set(), "free": set()}
    got = interleaved({"pinned": lambda: seen["pinned"].add(frozenset(os.sched_getaffinity(0))),
                       "free": lambda: seen["free"].add(frozenset(os.sched_getaffinity(0)))},
                      rounds=3, per_round=2, seed=1, warm=1, cpus={"pinned": cpu})
    assert seen == {"pinned": {frozenset({cpu})}, "free": {frozenset(mine)}}
    assert [len(v) for v in got.values()] == [6, 6]
    assert os.sched_getaffinity(0) == mine
