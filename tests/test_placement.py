"""CPU and device placement, pure: the cpulist form, a GPU's local CPUs from a fake /proc and /sys,
the placement decision, the worker table's CPU mask, and the configuration's checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shmserve import layout, placement
from shmserve.config import ConfigError, parse
from shmserve.placement import Placement, format_cpulist, parse_cpulist

# -- the cpulist form ---------------------------------------------------------------------------


@given(st.frozensets(st.integers(0, 300), max_size=80))
def test_a_cpulist_round_trips(cpus):
    text = format_cpulist(cpus)
    assert parse_cpulist(text) == cpus
    assert format_cpulist(parse_cpulist(text)) == text  # canonical: formatting what it parsed changes nothing


@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 20)), min_size=1, max_size=12))
def test_any_list_of_ranges_parses_to_their_union_and_formats_canonically(ranges):
    text = ",".join(f"{lo}-{lo + n}" if n else str(lo) for lo, n in ranges)
    expected = frozenset(c for lo, n in ranges for c in range(lo, lo + n + 1))
    assert parse_cpulist(text) == expected
    assert parse_cpulist(format_cpulist(expected)) == expected


@pytest.mark.parametrize("text, cpus", [("0-3", {0, 1, 2, 3}), ("0,2,4-7", {0, 2, 4, 5, 6, 7}), ("5", {5}),
                                        ("0-1\n", {0, 1}), (" 3 , 1 ", {1, 3}), ("", set()), ("\n", set())])
def test_cpulists_as_the_kernel_writes_them(text, cpus):
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize("text, words", [("3-1", "ends before"), ("a", "not a CPU"), ("0-7:2", "not a CPU"),
                                         ("1,,2", "not a CPU"), ("-1", "not a CPU"), ("0-99999", "out of range"),
                                         ("0x3", "not a CPU")])
def test_a_malformed_cpulist_says_what_is_wrong(text, words):
    with pytest.raises(ValueError, match=words):
        parse_cpulist(text)


def test_formatting_joins_runs():
    assert format_cpulist([7, 0, 1, 2, 5, 8]) == "0-2,5,7-8"
    assert format_cpulist([]) == ""


# -- a fake machine: /proc/driver/nvidia and /sys -------------------------------------------------

def fake_machine(root: Path, gpus: list[tuple[str, str, str, str]], *, proc: bool = True, online: str = "0-63"):
    """GPUs as (bus id as the driver writes it, model, uuid, local_cpulist); ``proc``: the driver's
    /proc tree, else only its /sys driver links."""
    (root / "sys/devices/system/cpu").mkdir(parents=True)
    (root / "sys/devices/system/cpu/online").write_text(online + "\n")
    for bus, model, uuid, local in gpus:
        sys_id = placement.normalize_bus_id(bus)
        dev = root / "sys/bus/pci/devices" / sys_id
        dev.mkdir(parents=True)
        (dev / "local_cpulist").write_text(local + "\n")
        (dev / "device").write_text("0x2335\n" if "H200" in model else "0x2330\n")
        if proc:
            info = root / "proc/driver/nvidia/gpus" / sys_id
            info.mkdir(parents=True)
            (info / "information").write_text(
                f"Model: \t\t NVIDIA {model}\nIRQ:   \t\t 42\nGPU UUID: \t {uuid}\nVideo BIOS: \t ??.??\n"
                f"Bus Type: \t PCIe\nDMA Size: \t 52 bits\nBus Location: \t {bus}\nDevice Minor: \t 0\n")
        else:
            driver = root / "sys/bus/pci/drivers/nvidia"
            driver.mkdir(parents=True, exist_ok=True)
            (driver / sys_id).symlink_to(dev)
    return root


TWO_H200 = [("0000:b3:00.0", "H200", "GPU-bbbb1111-0000", "32-63"),
            ("0000:1b:00.0", "H200", "GPU-aaaa2222-0000", "0-31")]


def test_cuda_ordinals_follow_the_pci_bus_order_of_identical_gpus(tmp_path):
    root = fake_machine(tmp_path, TWO_H200)
    assert [g.bus_id for g in placement.nvidia_gpus(root)] == ["0000:1b:00.0", "0000:b3:00.0"]
    assert placement.gpu_local_cpus("cuda:0", root, {}) == (frozenset(range(32)), "local to cuda:0 (PCI 0000:1b:00.0)")
    assert placement.gpu_local_cpus("cuda:1", root, {})[0] == frozenset(range(32, 64))
    cpus, why = placement.gpu_local_cpus("cuda:2", root, {})
    assert cpus is None and "not among the 2 GPU(s)" in why


def test_without_the_drivers_proc_the_sysfs_driver_links_are_enough(tmp_path):
    root = fake_machine(tmp_path, TWO_H200, proc=False)
    gpus = placement.nvidia_gpus(root)
    assert [g.bus_id for g in gpus] == ["0000:1b:00.0", "0000:b3:00.0"] and gpus[0].model == "0x2335"
    assert placement.gpu_local_cpus("cuda:1", root, {})[0] == frozenset(range(32, 64))


def test_a_bus_id_with_an_eight_digit_domain_is_the_same_device():
    assert placement.normalize_bus_id("00000000:B3:00.0") == "0000:b3:00.0"
    assert placement.normalize_bus_id("nonsense") is None


@pytest.mark.parametrize("visible, ordinal, bus", [
    ("1", 0, "0000:b3:00.0"), ("1,0", 1, "0000:1b:00.0"), ("GPU-bbbb", 0, "0000:b3:00.0"),
    ("GPU-aaaa2222-0000", 0, "0000:1b:00.0"), (" 0 , 1 ", 1, "0000:b3:00.0")])
def test_cuda_visible_devices_renumbers_them(tmp_path, visible, ordinal, bus):
    root = fake_machine(tmp_path, TWO_H200)
    gpu, why = placement.cuda_gpu(ordinal, placement.nvidia_gpus(root), {"CUDA_VISIBLE_DEVICES": visible})
    assert gpu is not None and gpu.bus_id == bus, why


@pytest.mark.parametrize("visible, ordinal, words", [
    ("", 0, "not among the 0"), ("0,7,1", 1, "not among the 1"),  # CUDA stops at an invalid entry
    ("GPU-", 0, "not among the 0"),  # a prefix of both: ambiguous, and so invalid
    ("MIG-1234", 0, "MIG"), ("0,0", 0, "twice")])
def test_cuda_visible_devices_that_cannot_be_followed_are_unknown(tmp_path, visible, ordinal, words):
    root = fake_machine(tmp_path, TWO_H200)
    gpu, why = placement.cuda_gpu(ordinal, placement.nvidia_gpus(root), {"CUDA_VISIBLE_DEVICES": visible})
    assert gpu is None and words in why


def test_gpus_of_different_models_are_unknown_unless_cuda_orders_them_by_bus(tmp_path):
    root = fake_machine(tmp_path, [("0000:1b:00.0", "A100", "GPU-1", "0-31"), ("0000:b3:00.0", "H200", "GPU-2", "32-63")])
    cpus, why = placement.gpu_local_cpus("cuda:0", root, {})
    assert cpus is None and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in why
    assert placement.gpu_local_cpus("cuda:1", root, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})[0] == frozenset(range(32, 64))


def test_no_driver_no_gpu_and_a_missing_local_cpulist_are_unknown(tmp_path):
    assert "no NVIDIA GPU" in placement.gpu_local_cpus("cuda:0", tmp_path, {})[1]
    root = fake_machine(tmp_path / "m", TWO_H200)
    (root / "sys/bus/pci/devices/0000:1b:00.0/local_cpulist").unlink()
    cpus, why = placement.gpu_local_cpus("cuda:0", root, {})
    assert cpus is None and "no local_cpulist" in why


def test_online_cpus_come_from_sysfs(tmp_path):
    assert placement.online_cpus(fake_machine(tmp_path, [], online="0-5,8")) == frozenset({0, 1, 2, 3, 4, 5, 8})
    assert placement.online_cpus(tmp_path / "nothing") == frozenset(range(os.cpu_count()))


# -- the decision ------------------------------------------------------------------------------

def local_of(table):
    return lambda device: (table[device], f"local to {device}") if device in table else (None, "unknown here")


ALL = frozenset(range(64))
LOCAL = local_of({"cuda:0": frozenset(range(32)), "cuda:1": frozenset(range(32, 64))})


def place_n(n, devices, cpus=placement.AUTO, per_worker=0, local=LOCAL, allowed=ALL):
    made: list[Placement] = []
    for _ in range(n):
        made.append(placement.place(devices, cpus, per_worker, made, local, allowed))
    return made


def test_instances_go_round_robin_over_the_devices_each_on_its_gpus_local_cpus():
    made = place_n(4, ("cuda:0", "cuda:1"))
    assert [p.device for p in made] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert [p.cpus for p in made] == [frozenset(range(32)), frozenset(range(32, 64))] * 2
    assert made[0].source == "local to cuda:0"


def test_a_new_worker_fills_the_emptiest_device():
    left = [Placement("cuda:1", None, ""), Placement("cuda:1", None, "")]  # cuda:0's workers were retired
    assert placement.place(("cuda:0", "cuda:1"), placement.AUTO, 0, left, LOCAL, ALL).device == "cuda:0"


def test_a_cpu_model_is_not_pinned_by_default_and_inherit_pins_nothing_anywhere():
    assert place_n(1, ("cpu",))[0] == Placement("cpu", None, "inherited")
    assert place_n(1, ("cuda:0",), cpus=placement.INHERIT)[0].cpus is None


def test_configured_cpus_win_over_the_gpus_local_ones():
    p = place_n(1, ("cuda:1",), cpus="0-3")[0]
    assert p.cpus == frozenset(range(4)) and p.source == "cpus = 0-3"


def test_local_cpus_are_narrowed_to_what_the_server_may_use_and_unknown_ones_pin_nothing():
    assert place_n(1, ("cuda:0",), allowed=frozenset({2, 3, 40}))[0].cpus == frozenset({2, 3})
    p = place_n(1, ("cuda:0",), allowed=frozenset({40}))[0]
    assert p.cpus is None and "none of cuda:0's local CPUs (0-31)" in p.source
    p = place_n(1, ("cuda:5",))[0]
    assert p.cpus is None and p.source == "inherited: unknown here"


def test_cpus_per_worker_gives_each_worker_its_own_chunk_then_shares_them_in_turn():
    made = place_n(5, ("cpu",), cpus="0-5", per_worker=2)
    assert [format_cpulist(p.cpus) for p in made] == ["0-1", "2-3", "4-5", "0-1", "2-3"]
    made = place_n(4, ("cuda:0", "cuda:1"), per_worker=16)  # chunks per device
    assert [format_cpulist(p.cpus) for p in made] == ["0-15", "32-47", "16-31", "48-63"]
    made = place_n(2, ("cpu",), cpus="0-4", per_worker=2)  # the odd one joins the last chunk
    assert [format_cpulist(p.cpus) for p in made] == ["0-1", "2-4"]
    assert place_n(1, ("cpu",), per_worker=1, allowed=frozenset({0, 1}))[0].cpus == frozenset({0})


def test_a_dead_siblings_chunk_is_taken_again_first():
    held = [Placement("cpu", frozenset({0}), "", 0), Placement("cpu", frozenset({2}), "", 2)]
    assert placement.place(("cpu",), "0-2", 1, held, LOCAL, ALL).cpus == frozenset({1})


# -- the worker table ------------------------------------------------------------------------

@given(st.frozensets(st.integers(0, 2000), max_size=60))
def test_the_worker_tables_cpu_mask_round_trips_below_1024_and_counts_the_rest(cpus):
    count, mask = layout.encode_cpu_mask(cpus)
    decoded, more = layout.decode_cpu_mask(count, mask)
    if not cpus:
        assert decoded is None
        return
    assert decoded == {c for c in cpus if c < 1024} and more == len([c for c in cpus if c >= 1024])


def test_an_unpinned_worker_has_no_cpus_in_the_table():
    assert layout.decode_cpu_mask(*layout.encode_cpu_mask(None)) == (None, 0)


# -- the configuration -----------------------------------------------------------------------

def model(**extra) -> dict:
    return {"models": [{"name": "m", "backend": "python", "path": "shmserve.models:identity", **extra}]}


def test_cpus_and_devices_in_the_config():
    m = parse(model(cpus="0")).models[0]
    assert m.cpus == "0" and m.devices == () and m.placement_devices == ("cpu",)
    m = parse(model(device=["cuda:0", "cuda:1"], instances=4, cpus="inherit")).models[0]
    assert m.device == "cuda:0" and m.placement_devices == ("cuda:0", "cuda:1") and m.cpus == placement.INHERIT
    assert parse(model(cpus="auto")).models[0].cpus == placement.AUTO
    assert parse(model(device=["cuda:3"])).models[0].placement_devices == ("cuda:3",)
    everything = format_cpulist(placement.allowed_cpus())
    assert parse(model(cpus=everything, cpus_per_worker=1)).models[0].cpus_per_worker == 1
    from shmserve.config import ModelConfig

    m = parse(model(device=["cuda:0", "cuda:1"], cpus="0", cpus_per_worker=1)).models[0]
    assert ModelConfig.from_dict(m.to_dict()) == m


@pytest.mark.parametrize("extra, words", [
    ({"cpus": "0-"}, r"models\[0\]\.cpus: '0-' is not a CPU number.*expected a Linux cpulist"),
    ({"cpus": 3}, r"models\[0\]\.cpus: expected a Linux cpulist"),
    ({"cpus": ""}, r"models\[0\]\.cpus: names no CPU"),
    ({"cpus": "4000"}, r"models\[0\]\.cpus: CPU 4000 not on this machine \(online: .*\); name CPUs it has"),
    ({"cpus": "inherit", "cpus_per_worker": 1}, r"cpus_per_worker: needs a CPU set"),
    ({"cpus": "0", "cpus_per_worker": 2}, r"cpus_per_worker: 2 is more than the 1 CPU"),
    ({"device": ["cuda:0", "cuda:0"]}, r"models\[0\]\.device: a device is listed twice"),
    ({"device": ["cpu", "cuda:0"]}, r"models\[0\]\.device: a list names GPUs only"),
    ({"device": []}, r"models\[0\]\.device: expected 'cpu' or 'cuda:N', or a list"),
    ({"device": ["cuda:0", "gpu1"]}, r"models\[0\]\.device\[1\]: expected"),
])
def test_a_bad_placement_names_the_key_and_the_fix(extra, words):
    with pytest.raises(ConfigError, match=words):
        parse(model(**extra))


def test_cpus_outside_the_servers_affinity_are_refused_naming_it(monkeypatch):
    monkeypatch.setattr(placement, "allowed_cpus", lambda: frozenset({0}))
    monkeypatch.setattr(placement, "online_cpus", lambda root=None: frozenset({0, 1}))
    with pytest.raises(ConfigError, match=r"models\[0\]\.cpus: CPU 1 not among the CPUs this server may use "
                                          r"\(0: its affinity.*taskset.*name CPUs within it"):
        parse(model(cpus="0-1"))


def test_the_worker_finds_its_cpus_before_argparse():
    assert placement.cpus_argument(["-m", "x", "--model", '{"cpus": "--cpus"}', "--cpus", "0-3"]) == "0-3"
    assert placement.cpus_argument(["--cpus=1"]) == "1"
    assert placement.cpus_argument(["--index", "0"]) is None


# -- the supervisor's use of it ----------------------------------------------------------------

def test_the_supervisor_places_new_workers_beside_their_live_siblings(instance_name):
    import asyncio
    from dataclasses import replace

    from shmserve.arena import Arena
    from shmserve.config import ModelConfig, ServerConfig
    from shmserve.rings import new_eventfd
    from shmserve.supervisor import Supervisor

    model = ModelConfig("m", "fake", "fake", device="cuda:0", devices=("cuda:0", "cuda:1"), instances=3)
    other = ModelConfig("n", "fake", "fake", device="cuda:0", devices=("cuda:0", "cuda:1"))
    allowed = placement.allowed_cpus()
    local = {"cuda:0": frozenset({min(allowed)}), "cuda:1": frozenset({max(allowed)})}

    async def main(arena, efd):
        sup = Supervisor(arena, ServerConfig(models=(model, other)), efd, lambda w: None, lambda w, how: None)
        sup.local_cpus = lambda device: (local[device], f"local to {device}")
        first = [sup.new_handle(model) for _ in range(3)]
        assert [w.device for w in first] == ["cuda:0", "cuda:1", "cuda:0"]
        assert [w.placement.cpus for w in first] == [local["cuda:0"], local["cuda:1"], local["cuda:0"]]
        assert sup.new_handle(other).device == "cuda:0"  # another model's workers are not its siblings
        first[1].retiring = True  # scaled down: cuda:1 is empty again
        scaled = replace(model, instances=4)  # what a scale leaves in the version's config
        assert sup.new_handle(scaled).device == "cuda:1"
        assert sup.new_handle(replace(model, cpus="inherit")).device == "cuda:0"  # new settings: a fresh start

    arena = Arena.create(instance_name("place"), slot_count=4, max_workers=8, size_classes=[(4096, 2)], prefault=False)
    efd = new_eventfd()
    try:
        asyncio.run(main(arena, efd))
    finally:
        os.close(efd)
        arena.unlink()
        arena.close()
