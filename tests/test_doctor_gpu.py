"""`shmserve doctor`'s GPU checks without a GPU: nvidia-smi's CSV parsed from captured text, a fake
`nvidia-smi` program (refusing a field as an older driver does, hanging as one on a lost GPU),
sysfs trees for the PCIe link, and TensorRT engines with and without a build record.  Each check
over facts that trigger it and facts that do not."""

from __future__ import annotations

import json

import pytest

from shmserve.doctor import gpu as gpuinfo
from shmserve.doctor.findings import CRITICAL, INFO, WARNING
from shmserve.doctor.gpu import GpuFacts, parse_csv, query

from helpers.fake_host import BANNER, GOOD_ROW, FakeHost, fake_nvidia_smi, service
from test_doctor_host import check, context

FIELDS = [name for name, _ in gpuinfo.FIELDS]
# Captured from an H200 (driver 580) with `--query-gpu=<FIELDS> --format=csv,noheader,nounits`, reordered
# to FIELDS' order.
H200_CSV = ("0, NVIDIA H200, 00000000:00:06.0, 580.65.06, 9.0, Enabled, 0, 31, 76.51, 700.00, 345, 1980, 3201, "
            "3201, 0x0000000000000001, 1, 5, 16, 16, Enabled, 0, 0, No, No, 143771, 1\n")


def row(**changes) -> dict:
    out = dict(GOOD_ROW)
    out.update({k.replace("__", "."): str(v) for k, v in changes.items()})
    return out


def facts(*rows: dict, **extra) -> GpuFacts:
    return GpuFacts("nvidia-smi", rows=parse_csv("".join(", ".join(r[f] for f in FIELDS) + "\n" for r in rows),
                                                 FIELDS), cuda_version=extra.pop("cuda", "13.0"), **extra)


def gpu_check(check_id, tmp_path, *rows, svc=None, **over):
    host = FakeHost(tmp_path / "root").gpu("0000:1b:00.0")
    return check(check_id, context(host.root, svc, gpus=facts(*rows), **over))


# -- parsing -------------------------------------------------------------------------------

def test_captured_csv_parses_into_typed_values():
    (r,) = parse_csv(H200_CSV, FIELDS)
    assert r["name"] == "NVIDIA H200" and r["pci.bus_id"] == "00000000:00:06.0" and r["compute_cap"] == 9.0
    assert r["clocks_event_reasons.active"] == 1 and gpuinfo.throttle_reasons(1) == ["gpu_idle"]
    assert (r["pcie.link.gen.current"], r["pcie.link.gen.max"], r["memory.total"]) == (1, 5, 143771)
    assert r["power.draw"] == 76.51 and r["remapped_rows.pending"] == "No"


def test_missing_values_are_none_and_a_short_row_is_skipped():
    text = "0, [N/A], [Not Supported]\n1, only two\n"
    assert parse_csv(text, ["index", "a", "b"]) == [{"index": 0, "a": None, "b": None}]


def test_the_cuda_version_comes_from_the_banner():
    assert gpuinfo.parse_cuda_version(BANNER) == "13.0"
    assert gpuinfo.parse_cuda_version("no banner") is None


# -- the fake nvidia-smi: asked as the real one is ------------------------------------------

def test_query_asks_every_field_and_reads_the_banner(tmp_path):
    program = fake_nvidia_smi(tmp_path / "bin", [GOOD_ROW, row(index=1, pci__bus_id="00000000:B3:00.0")])
    got = query(str(program))
    assert got.error is None and len(got.rows) == 2 and got.cuda_version == "13.0"
    assert got.rows[1]["pci.bus_id"] == "00000000:B3:00.0" and set(got.by_bus()) == {"0000:1b:00.0", "0000:b3:00.0"}
    calls = [json.loads(line) for line in (tmp_path / "bin/calls.jsonl").read_text().splitlines()]
    assert calls[0] == [f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits"] and calls[1] == []


def test_an_older_driver_gets_the_older_field_name_and_loses_unknown_ones(tmp_path):
    old = {k: v for k, v in GOOD_ROW.items() if k not in ("clocks_event_reasons.active", "remapped_rows.pending")}
    old["clocks_throttle_reasons.active"] = "0x0000000000000008"
    program = fake_nvidia_smi(tmp_path / "bin", [old], refuse=("clocks_event_reasons.active",
                                                                "remapped_rows.pending"))
    got = query(str(program))
    assert got.error is None and got.dropped == ["remapped_rows.pending"]
    assert got.rows[0]["clocks_throttle_reasons.active"] == 8 and "remapped_rows.pending" not in got.rows[0]
    found, _ = check("gpu.clocks", context(tmp_path, gpus=got))
    assert [f.severity for f in found] == [WARNING] and "hw_slowdown" in found[0].measured


def test_a_hung_nvidia_smi_is_critical_and_a_missing_one_skips(tmp_path):
    host = FakeHost(tmp_path / "root").gpu("0000:1b:00.0")
    hung = query(str(fake_nvidia_smi(tmp_path / "bin", [GOOD_ROW], hang=True)), timeout=0.5)
    assert hung.hung and "did not answer within 0.5 s" in hung.error
    (f,) = check("gpu.nvidia_smi", context(host.root, gpus=hung))[0]
    assert f.severity == CRITICAL and "xid" in f.fix.lower()
    assert "did not answer" in check("gpu.clocks", context(host.root, gpus=hung))[1]
    missing = query(None)
    (f,) = check("gpu.nvidia_smi", context(host.root, gpus=missing))[0]  # the driver shows a GPU
    assert f.severity == WARNING and "nvidia-utils" in f.fix
    found, skipped = check("gpu.nvidia_smi", context(tmp_path / "empty", gpus=missing))
    assert found == [] and "no NVIDIA GPU" in skipped
    assert check("gpu.nvidia_smi", context(host.root, gpus=facts(GOOD_ROW)))[0] == []


def test_nvidia_smi_on_the_path_is_found(tmp_path):
    fake_nvidia_smi(tmp_path / "bin", [GOOD_ROW])
    assert gpuinfo.find_nvidia_smi(str(tmp_path / "bin")) == str(tmp_path / "bin/nvidia-smi")
    assert gpuinfo.find_nvidia_smi(str(tmp_path / "nothing")) is None


# -- each check ----------------------------------------------------------------------------

def test_persistence_mode_off_is_a_warning(tmp_path):
    (f,) = gpu_check("gpu.persistence", tmp_path, row(persistence_mode="Disabled"))[0]
    assert f.severity == WARNING and "nvidia-persistenced" in f.fix and "GPU 0 NVIDIA H200" in f.subject
    assert gpu_check("gpu.persistence", tmp_path, GOOD_ROW)[0] == []


@pytest.mark.parametrize("mask, severity", [("0x0000000000000040", WARNING), ("0x0000000000000020", WARNING),
                                            ("0x0000000000000080", WARNING), ("0x0000000000000004", INFO),
                                            ("0x0000000000000001", None), ("0x0000000000000000", None)])
def test_throttle_reasons(tmp_path, mask, severity):
    found = gpu_check("gpu.clocks", tmp_path, row(clocks_event_reasons__active=mask))[0]
    assert [f.severity for f in found] == ([severity] if severity else [])


def test_a_narrow_pcie_link_is_a_warning_and_a_slow_one_only_when_busy(tmp_path):
    (f,) = gpu_check("gpu.pcie", tmp_path, row(pcie__link__width__current=8))[0]
    assert f.severity == WARNING and f.title == "the PCIe link trained at x8 of x16"
    assert "sys/bus/pci/devices/0000:1b:00.0" in f.measured  # the sysfs link beside nvidia-smi's
    (f,) = gpu_check("gpu.pcie", tmp_path, row(pcie__link__gen__current=3, utilization__gpu=80))[0]
    assert f.severity == WARNING and "generation 3 of 5" in f.title
    (f,) = gpu_check("gpu.pcie", tmp_path, row(pcie__link__gen__current=1, utilization__gpu=0))[0]
    assert f.severity == INFO and "idle" in f.title and f.fix == ""
    assert gpu_check("gpu.pcie", tmp_path, GOOD_ROW)[0] == []


def test_the_pcie_width_comes_from_sysfs_where_nvidia_smi_has_none(tmp_path):
    host = FakeHost(tmp_path / "root").gpu("0000:1b:00.0", link=("16.0 GT/s PCIe", "32.0 GT/s PCIe", 4, 16))
    gpus = facts(row(pcie__link__width__current="[N/A]", pcie__link__width__max="[N/A]"))
    (f,) = check("gpu.pcie", context(host.root, gpus=gpus))[0]
    assert f.title == "the PCIe link trained at x4 of x16" and "16.0 GT/s PCIe x4" in f.measured


def test_uncorrected_ecc_errors_and_pending_remaps_are_critical(tmp_path):
    (f,) = gpu_check("gpu.ecc", tmp_path, row(ecc__errors__uncorrected__volatile__total=2))[0]
    assert f.severity == CRITICAL and "nvidia-smi -r" in f.fix
    (f,) = gpu_check("gpu.ecc", tmp_path, row(remapped_rows__pending="Yes"))[0]
    assert f.severity == CRITICAL
    (f,) = gpu_check("gpu.ecc", tmp_path, row(remapped_rows__failure="Yes"))[0]
    assert "could not remap" in f.title and "replace the GPU" in f.fix
    assert gpu_check("gpu.ecc", tmp_path, row(ecc__errors__corrected__volatile__total=5))[0] == []


def test_memory_budget_beyond_the_gpu_and_a_full_gpu_are_warnings(tmp_path):
    (f,) = gpu_check("gpu.memory", tmp_path, GOOD_ROW, memory_budget={"cuda:0": 200 << 30})[0]
    assert "memory_budget cuda:0 = 200 GiB" in f.measured and '"cuda:0" = "126GiB"' in f.fix
    assert gpu_check("gpu.memory", tmp_path, GOOD_ROW, memory_budget={"cuda:0": 100 << 30})[0] == []
    (f,) = gpu_check("gpu.memory", tmp_path, row(memory__used=140000))[0]
    assert f.title == "the GPU's memory is nearly full" and "97%" in f.measured


# -- TensorRT engines ------------------------------------------------------------------------

def trt_model(path):
    from shmserve.doctor.context import ModelFacts

    return ModelFacts("det", "tensorrt", str(path), ("cuda:0",), 1)


def engines(tmp_path, path, tensorrt=("tensorrt_cu13", "10.13.0.35"), rows=(GOOD_ROW,), cuda="13.0", svc=None):
    host = FakeHost(tmp_path / "root")
    gpus = facts(*rows, cuda=cuda, tensorrt=tensorrt)
    return check("gpu.engines", context(host.root, svc, gpus=gpus, models=[trt_model(path)]))


def plan_with_version(path, major, minor, patch):
    head = bytearray(64)
    head[24:27] = bytes([major, minor, patch])
    path.write_bytes(bytes(head) + b"engine bytes")
    return path


def record(path, **fields):
    (path.parent / (path.name + ".build.json")).write_text(json.dumps(fields))


def test_an_engine_recorded_for_another_tensorrt_or_gpu_must_be_rebuilt(tmp_path):
    plan = plan_with_version(tmp_path / "det.plan", 10, 13, 0)
    record(plan, tensorrt="10.3.0", cuda="12.6", driver="550.54", gpu="NVIDIA A100-SXM4-80GB", compute_capability="8.0")
    (f,) = engines(tmp_path, plan)[0]
    assert f.severity == CRITICAL and f.title == "a TensorRT engine must be rebuilt"
    for words in ("built by TensorRT 10.3.0", "built against CUDA 12.6", "built on a NVIDIA A100-SXM4-80GB",
                  "compute capability 8.0", "built under driver 550.54", ".build.json record"):
        assert words in f.measured, words
    assert "trtexec" in f.fix and str(plan) in f.fix
    record(plan, tensorrt="10.13.0", cuda="13.0", driver="580.65.06", gpu="NVIDIA H200", compute_capability="9.0")
    assert engines(tmp_path, plan)[0] == []


def test_an_engine_built_under_an_older_driver_only_is_a_warning(tmp_path):
    plan = plan_with_version(tmp_path / "det.plan", 10, 13, 0)
    record(plan, tensorrt="10.13.0", driver="550.54", gpu="NVIDIA H200")
    (f,) = engines(tmp_path, plan)[0]
    assert f.severity == WARNING and "built under driver 550.54, running 580.65.06" in f.measured


def test_without_a_record_the_header_version_is_a_warning_and_no_version_is_info(tmp_path):
    plan = plan_with_version(tmp_path / "det.plan", 10, 3, 0)
    (f,) = engines(tmp_path, plan)[0]
    assert f.severity == WARNING and "header's version bytes" in f.measured and "10.3.0" in f.measured
    assert engines(tmp_path, plan_with_version(tmp_path / "det.plan", 10, 13, 1))[0] == []
    (tmp_path / "det.plan").write_bytes(b"\0" * 64)
    (f,) = engines(tmp_path, tmp_path / "det.plan")[0]
    assert f.severity == INFO and ".build.json" in f.expected


def test_tensorrt_for_a_newer_cuda_than_the_driver_is_critical(tmp_path):
    plan = plan_with_version(tmp_path / "det.plan", 10, 13, 0)
    found = engines(tmp_path, plan, cuda="12.8")[0]
    assert [f.title for f in found] == ["TensorRT for CUDA 13 on a driver that supports CUDA 12.8"]
    assert engines(tmp_path, plan, cuda="13.0")[0] == []


def test_an_engine_the_worker_refused_is_critical(tmp_path):
    reason = ("cannot load model 'det' (tensorrt, /m/det.plan): ValueError: /m/det.plan is not a TensorRT engine "
              "that TensorRT 11.4.0.106 can run on this GPU (engines are tied to ...; rebuild it here)")
    repo = {"models": [{"name": "det", "version": 1, "state": "unavailable", "reason": reason, "path": "/m/det.plan"}],
            "canaries": {}, "events": []}
    host = FakeHost(tmp_path / "root")
    svc = service([], repository=repo)
    (f,) = check("gpu.engines", context(host.root, svc, gpus=facts(GOOD_ROW)))[0]
    assert f.severity == CRITICAL and "must be rebuilt" in f.title and "/m/det.plan" in f.fix
    found, skipped = check("gpu.engines", context(host.root, service([]), gpus=facts(GOOD_ROW)))
    assert found == [] and skipped == "no TensorRT model"


def test_the_tensorrt_installed_is_read_from_package_metadata(tmp_path):
    """No import: the distributions' metadata, the bindings' version preferred."""
    def dist(name, version):
        where = tmp_path / f"{name}-{version}.dist-info"
        where.mkdir()
        (where / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")

    assert gpuinfo.installed_tensorrt([str(tmp_path)]) is None
    dist("numpy", "2.0.0")
    dist("tensorrt_lean_cu13_libs", "11.4.0.106")
    dist("tensorrt_lean_cu13_bindings", "11.4.0.106")
    assert gpuinfo.installed_tensorrt([str(tmp_path)]) == ("tensorrt_lean_cu13_bindings", "11.4.0.106")
    assert gpuinfo.cuda_major_of("tensorrt_lean_cu13_bindings") == 13 and gpuinfo.cuda_major_of("tensorrt") is None
