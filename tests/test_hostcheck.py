"""hostcheck.py's parsers and checks on real captures (2 × H200) and on B300-shaped output of the
stand-in tools with faults (fabric In Progress or failed, a GPU missing, a pending row remap, a link
down); the health gate (health-gate.sh.j2) around it, with tools that hang."""

from __future__ import annotations

import difflib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import host_program
from stubs import Result, StubPath

from glm_infra.agent import hostcheck as hc
from glm_infra.roles import health_gate as gate_role
from glm_infra.roles import rdma as rdma_role
from testbed.hardware import HW_LIB, TOOLS, Sim

FIX = Path(__file__).parent / "fixtures"
H200 = FIX / "h200x2-nvidia-smi"
DEVICE = FIX / "h200x2-hostcheck"


def misc_section(name: str) -> str:
    text = (H200 / "misc.txt").read_text()
    return text.split(f"== {name}\n", 1)[1].split("\n== ", 1)[0]


def test_real_nvidia_smi_q():
    q = hc.parse_smi_q((H200 / "nvidia-smi-q.txt").read_text())
    assert (q["driver_version"], q["cuda_version"], q["attached_gpus"]) == ("580.159.04", "13.0", "2")
    assert [g["bus_id"] for g in q["gpus"]] == ["00000000:00:06.0", "00000000:00:07.0"]
    for g in q["gpus"]:
        assert (g["name"], g["fabric_state"], g["fabric_status"]) == ("NVIDIA H200", "Completed", "Success")
        assert (g["remapped_pending"], g["remapped_failure"], g["memory_total"]) == ("No", "No", "143771 MiB")


def test_real_query_csv_and_nvlink():
    rows = hc.parse_query_csv((H200 / "query-gpu.csv").read_text())
    assert [(r["index"], r["name"], r["memory.total"], r["compute_cap"]) for r in rows] == [
        ("0", "NVIDIA H200", "143771 MiB", "9.0"), ("1", "NVIDIA H200", "143771 MiB", "9.0")]
    links = hc.parse_nvlink_status(misc_section("nvlink -s"))
    assert sorted(links) == [0, 1] and all(len(v) == 18 and None not in v.values() for v in links.values())
    remapped = hc.parse_query_csv(misc_section("remapped"))
    assert [r["remapped_rows.pending"] for r in remapped] == ["No", "No"]


def test_real_capture_is_healthy_as_what_it_is_and_not_as_b300():
    args = ((H200 / "query-gpu.csv").read_text(), (H200 / "nvidia-smi-q.txt").read_text(), misc_section("nvlink -s"))
    assert hc.gpu_problems(*args, gpus=2, model="H200", driver="580.159.04", fabric=True) == []
    problems = hc.gpu_problems(*args, gpus=8, model="B300", driver="580.172.08", fabric=True)
    assert ("gpus", "2 GPUs visible, stack expects 8") in problems
    assert ("gpus", "GPU 0 is 'NVIDIA H200', stack expects B300") in problems
    assert ("driver", "GPU 1 runs driver 580.159.04, stack pins 580.172.08") in problems


def test_hostcheck_as_it_ran_on_real_hardware():
    """hostcheck.py itself, run on a 2 × H200 machine (tests/fixtures/h200x2-hostcheck/README.md)."""
    facts = json.loads((DEVICE / "hostcheck-facts.json").read_text())
    assert facts["gpus"] == {"compute_cap": ["9.0"], "count": 2, "driver_version": "580.159.04", "models": ["NVIDIA H200"]}
    assert facts["os"] == "ubuntu 24.04" and facts["effective_memlock"] == "unlimited"
    assert (DEVICE / "hostcheck-health.txt").read_text() == (
        "h200x2: healthy (2 × NVIDIA H200, driver 580.159.04; fabric Completed on 2 GPUs; NVLink 18 of 18 links up "
        "on each of 2 GPUs; 0 pending row remaps on 2 GPUs)\nrc=0\n")
    mismatch = (DEVICE / "hostcheck-health-mismatch.txt").read_text()
    assert "h200x2: gpus: 2 GPUs visible, stack expects 8" in mismatch and mismatch.endswith("rc=1\n")
    assert "h200x2: nvlink: nvidia-smi nvlink -s lists 2 GPUs, stack expects 8" in mismatch
    assert "h200x2: driver: GPU 1 runs driver 580.159.04, stack pins 580.172.08" in mismatch
    # What the gate reads there, read again here, says the same.
    args = [(DEVICE / n).read_text() for n in ("query-gpu.csv", "nvidia-smi-q.txt", "nvlink-s.txt")]
    assert hc.gpu_problems(*args, gpus=2, model="H200", driver="580.159.04", fabric=True) == []
    # The raw outputs captured there parse like the shared captures.
    q = hc.parse_smi_q((DEVICE / "nvidia-smi-q.txt").read_text())
    assert len(q["gpus"]) == 2 and {g["fabric_state"] for g in q["gpus"]} == {"Completed"}
    assert len(hc.parse_nvlink_status((DEVICE / "nvlink-s.txt").read_text())) == 2


SINGLE = FIX / "h200x1-hostcheck"


def test_hostcheck_on_a_real_single_gpu_fails_the_fabric_check_closed():
    """One H200 without NVLink peers: `nvidia-smi nvlink -s` printed nothing with exit 0, which the
    gate with --fabric must not take for "NVLink up" (tests/fixtures/h200x1-hostcheck/README.md)."""
    assert (SINGLE / "hostcheck-health.txt").read_text() == (
        "h200x1: healthy (1 × NVIDIA H200, driver 580.159.04; 0 pending row remaps on 1 GPUs)\nrc=0\n")
    assert (SINGLE / "hostcheck-health-fabric.txt").read_text() == (
        "h200x1: nvlink: nvidia-smi nvlink -s printed nothing\nrc=1\n")
    assert "== nvlink -s\nrc=0\n" in (SINGLE / "raw.txt").read_text()
    preflight = (SINGLE / "hostcheck-preflight-b300.txt").read_text().splitlines()
    assert json.loads(preflight[0])["gpus"]["count"] == 1
    assert preflight[1:] == [
        "h200x1: gpus: 1 GPUs visible, stack expects 8",
        "h200x1: gpus: GPU model NVIDIA H200, stack expects B300",
        "h200x1: disk: 69 GB free or staged at /tmp, stack needs 485 GB (preflight.minFreeDiskGb)",
        "rc=1",
    ]
    facts = json.loads((SINGLE / "hostcheck-facts.json").read_text())
    assert hc.preflight_problems(facts, ["ubuntu 24.04"], "5.12", 1, "H200", True, 40) == []


def b300_problems(sim: Sim) -> list[tuple[str, str]]:
    query = sim.run("nvidia-smi", f"--query-gpu={hc.QUERY_FIELDS}", "--format=csv").stdout
    return hc.gpu_problems(query, sim.out("nvidia-smi", "-q"), sim.out("nvidia-smi", "nvlink", "-s"),
                           gpus=8, model="B300", driver="580.159.04", fabric=True)


@pytest.fixture
def sim(tmp_path):
    return Sim(tmp_path)


def test_b300_shape_is_healthy(sim):
    assert b300_problems(sim) == []
    q = hc.parse_smi_q(sim.out("nvidia-smi", "-q"))
    assert len(q["gpus"]) == 8 and q["gpus"][0]["name"] == "NVIDIA B300 SXM6 AC"


@pytest.mark.parametrize(
    "fault, expected",
    [
        ({"FABRIC_STATE": "In Progress"},
         ("fabric", "GPU 0 (00000000:1A:00.0) fabric state is 'In Progress' (fabric manager or NVLSM not ready)")),
        ({"GPU_COUNT": "7"}, ("gpus", "7 GPUs visible, stack expects 8")),
        ({"REMAPPED_PENDING": "2"},
         ("remapped-rows", "GPU 2 (00000000:62:00.0) has a pending row remap (reset the GPU before serving)")),
        ({"NVLINK_DOWN": "3:5 3:7"}, ("nvlink", "GPU 3 NVLink links down: 5, 7")),
    ],
    ids=["fabric-in-progress", "gpu-missing", "pending-remap", "link-down"],
)
def test_b300_faults_are_named(sim, fault, expected):
    sim.fault(**fault)
    assert expected in b300_problems(sim)


def test_fabric_manager_not_running_is_in_progress(sim):
    (sim.root / "run/glm-sim/fabricmanager-active").unlink()
    assert any(check == "fabric" and "'In Progress'" in msg for check, msg in b300_problems(sim))


def stand_in_rdma(sim: Sim) -> tuple[str, dict]:
    devinfo = sim.out("ibv_devinfo", "-v")
    return devinfo, hc.gid_table(devinfo, sim.out("show_gids"))


def test_rdma_checks_on_the_stand_in_nics(sim):
    nics = [f"mlx5_{i}" for i in range(8)]
    devinfo, gids = stand_in_rdma(sim)
    assert hc.rdma_problems(devinfo, gids, nics, "Ethernet", 4096, 3) == []
    # Without show_gids (inbox rdma-core) the GID table of ibv_devinfo -v says the same.
    compute = {n: gids[n] for n in nics}
    assert {n: t for n, t in hc.gid_table(devinfo, None).items() if n in nics} == compute
    # The NVSwitch-management ConnectX is InfiniBand: listing it as a compute NIC is caught.
    assert ("rdma", "mlx5_8 port 1 link layer InfiniBand, expected Ethernet") in hc.rdma_problems(
        devinfo, gids, [*nics, "mlx5_8"], "Ethernet", 4096, 3)
    sim.fault(RDMA_DOWN="mlx5_3")
    devinfo, gids = stand_in_rdma(sim)
    assert ("rdma", "mlx5_3 port 1 is PORT_DOWN, expected PORT_ACTIVE") in hc.rdma_problems(
        devinfo, gids, nics, "Ethernet", 4096, 3)
    assert ("rdma", "mlx5_9 not found (devices: mlx5_0, mlx5_1, mlx5_2, mlx5_3, mlx5_4, mlx5_5, mlx5_6, mlx5_7, "
                    "mlx5_8)") in hc.rdma_problems(devinfo, gids, ["mlx5_9"], "Ethernet", 4096, 3)
    # GID 1 is the link-local RoCE v2 GID: no IPv4, so not what NIXL's UCX needs.
    assert any(msg.startswith("mlx5_0 GID index 1 is not a RoCE v2 GID with an IPv4 address (fe80::")
               for _, msg in hc.rdma_problems(devinfo, gids, ["mlx5_0"], "Ethernet", 4096, 1))


# --- real captures of the RDMA tools (tests/fixtures/rdma, each with its source) --------------------

RDMA = FIX / "rdma"


def rdma_fixture(name: str) -> str:
    assert (RDMA / f"{name}.source").exists(), f"{name} cites its source"
    return (RDMA / name).read_text()


def test_real_ibv_devinfo_infiniband_and_roce():
    ib = hc.parse_ibv_devinfo(rdma_fixture("ibv_devinfo-1.txt"))
    assert sorted(ib, key=lambda d: int(d.split("_")[1])) == [f"mlx5_{i}" for i in (0, 3, 4, 5, 6, 9, 10, 11)]
    assert {(p["state"], p["active_mtu"], p["link_layer"]) for d in ib.values() for p in d.values()} == {
        ("PORT_ACTIVE", 4096, "InfiniBand")}
    roce = hc.parse_ibv_devinfo(rdma_fixture("ibv_devinfo-2.txt"))  # tabs expanded to spaces
    assert roce == {"mlx5_2": {1: {"state": "PORT_ACTIVE", "active_mtu": 4096, "link_layer": "Ethernet", "gids": {}}}}
    # What the gate says of them: an InfiniBand fabric is not the RoCE the stack asks for.
    assert hc.rdma_problems(rdma_fixture("ibv_devinfo-1.txt"), {}, ["mlx5_0"], "InfiniBand", 4096, 0) == []
    assert ("rdma", "mlx5_0 port 1 link layer InfiniBand, expected Ethernet") in hc.rdma_problems(
        rdma_fixture("ibv_devinfo-1.txt"), {}, ["mlx5_0"], "Ethernet", 4096, 3)


def test_real_ibv_devinfo_verbose_with_gid_tables():
    ib = hc.parse_ibv_devinfo(rdma_fixture("ibv_devinfo-v-1.txt"))
    assert ib["mlx5_0"][1]["state"] == "PORT_ACTIVE" and ib["mlx5_1"][1]["state"] == "PORT_DOWN"
    assert ib["mlx5_0"][1]["gids"] == {0: {"gid": "fe80:0000:0000:0000:88e9:a4ff:ff25:a462", "ver": "", "ipv4": ""}}
    assert ("rdma", "mlx5_1 port 1 is PORT_DOWN, expected PORT_ACTIVE") in hc.rdma_problems(
        rdma_fixture("ibv_devinfo-v-1.txt"), {}, ["mlx5_0", "mlx5_1"], "InfiniBand", 4096, 0)
    text = rdma_fixture("ibv_devinfo-v-2.txt")
    gids = hc.gid_table(text, None)["rocep0s6"]
    # RoCE v1 GIDs in eight groups, v2 through inet_ntop: both IPv4-mapped forms read alike.
    assert (gids[4]["ipv4"], gids[4]["ver"], gids[5]["ipv4"], gids[5]["ver"]) == ("10.0.3.1", "v1", "10.0.3.1", "v2")
    assert gids[4]["gid"] == gids[5]["gid"] == hc._canonical_gid("::ffff:10.0.3.1")
    assert hc.rdma_problems(text, {"rocep0s6": gids}, ["rocep0s6"], "Ethernet", 1024, 5) == []
    problems = hc.rdma_problems(text, {"rocep0s6": gids}, ["rocep0s6"], "Ethernet", 4096, 3)
    assert ("rdma", "rocep0s6 port 1 active_mtu 1024, expected 4096") in problems
    assert ("rdma", "rocep0s6 GID index 3 is not a RoCE v2 GID with an IPv4 address "
                    "(fe80::5ee4:835c:fc12:336, RoCE v2)") in problems


@pytest.mark.parametrize("name, dev, ipv4", [("show_gids-1.txt", "mlx5_0", "192.168.211.242"),
                                             ("show_gids-2.txt", "mlx5_3", "192.168.10.2"),
                                             ("show_gids-3.txt", "mlx5_0", "172.19.0.60")])
def test_real_show_gids(name, dev, ipv4):
    rows = hc.parse_show_gids(rdma_fixture(name))
    assert {r["dev"] for r in rows} == {dev} and [r["index"] for r in rows] == [str(i) for i in range(len(rows))]
    v2 = [r for r in rows if r["ver"] == "v2" and r["ipv4"]]
    assert len(v2) == 1 and v2[0]["ipv4"] == ipv4 and hc.gid_ipv4(v2[0]["gid"]) == ipv4
    assert len({r["netdev"] for r in rows}) == 1 and rows[0]["netdev"], "each row names its netdev"
    table = hc.gid_table("", rdma_fixture(name))
    assert table[dev][int(v2[0]["index"])] == {"gid": hc._canonical_gid(f"::ffff:{ipv4}"), "ver": "v2", "ipv4": ipv4}


def test_real_ibstat():
    eth = hc.parse_ibstat(rdma_fixture("ibstat-1.txt"))
    assert len(eth) == 12 and eth["mlx5_0"]["type"] == "MT4129"
    assert {(p["state"], p["link_layer"]) for ca in eth.values() for p in ca["ports"].values()} == {("Active", "Ethernet")}
    assert sorted({p["rate"] for ca in eth.values() for p in ca["ports"].values()}) == [100, 400]
    mixed = hc.parse_ibstat(rdma_fixture("ibstat-2.txt"))
    down = [ca for ca, v in mixed.items() if v["ports"][1]["state"] == "Down"]
    assert len(down) == 3 and all(mixed[ca]["ports"][1]["physical_state"] == "Disabled" for ca in down)
    bond = hc.parse_ibstat(rdma_fixture("ibstat-3.txt"))  # tabs expanded, a bonded BlueField-3
    assert bond["mlx5_bond_0"]["type"] == "MT41692" and bond["mlx5_bond_0"]["ports"][1]["link_layer"] == "Ethernet"


# --- fail closed: a tool that fails, prints nothing or says too little is a problem ----------------


def b300_outputs(sim: Sim) -> dict[str, str]:
    return {"query": sim.run("nvidia-smi", f"--query-gpu={hc.QUERY_FIELDS}", "--format=csv").stdout,
            "q": sim.out("nvidia-smi", "-q"), "nvlink": sim.out("nvidia-smi", "nvlink", "-s")}


def test_empty_nvidia_smi_q_or_nvlink_is_a_problem_not_a_pass(sim):
    out = b300_outputs(sim)
    assert ("gpus", "nvidia-smi -q describes 0 GPUs, stack expects 8") in hc.gpu_problems(
        out["query"], "", out["nvlink"], 8, "B300", None, True)
    assert ("nvlink", "nvidia-smi nvlink -s lists 0 GPUs, stack expects 8") in hc.gpu_problems(
        out["query"], out["q"], "", 8, "B300", None, True)
    # Fewer GPU sections or links than there are GPUs.
    first_six = "\nGPU ".join(out["q"].split("\nGPU ")[:7])
    assert ("gpus", "nvidia-smi -q describes 6 GPUs, stack expects 8") in hc.gpu_problems(
        out["query"], first_six, out["nvlink"], 8, "B300", None, True)
    short = "\n".join(l for l in out["nvlink"].splitlines() if "Link 17:" not in l)
    assert ("nvlink", "GPU 0 lists 17 NVLink links, expected 18") in hc.gpu_problems(
        out["query"], out["q"], short, 8, "B300", None, True)
    # A GPU section without its Remapped Rows is not "no pending remap".
    cut = re.sub(r"\n    Remapped Rows\n(        .*\n)+", "\n", out["q"], count=1)
    assert ("remapped-rows", "GPU 0 (00000000:1A:00.0): nvidia-smi -q shows no Remapped Rows section") in \
        hc.gpu_problems(out["query"], cut, out["nvlink"], 8, "B300", None, True)


def test_malformed_query_csv_is_a_problem():
    assert hc.gpu_problems("index, name\n0\n", "", "", 8, "B300", None, False)[0][0] == "gpus"


@pytest.fixture
def tools(monkeypatch, sim):
    """hostcheck's view of the tools: the stand-in's output, with what a test overrides."""
    real = b300_outputs(sim)
    answers = {
        ("nvidia-smi", f"--query-gpu={hc.QUERY_FIELDS}", "--format=csv"): (0, real["query"]),
        ("nvidia-smi", "-q"): (0, real["q"]),
        ("nvidia-smi", "nvlink", "-s"): (0, real["nvlink"]),
        ("ibv_devinfo", "-v"): (0, sim.out("ibv_devinfo", "-v")),
        ("show_gids",): (0, sim.out("show_gids")),
    }
    monkeypatch.setattr(hc.gather, "_run", lambda cmd: answers[tuple(cmd)])
    monkeypatch.setattr(hc.shutil, "which", lambda name: f"/usr/bin/{name}")
    return answers


def health(capsys, *extra: str) -> tuple[int, str, str]:
    rc = hc.main(["health", "--host", "b300-1", *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


GPU_ARGS = ("--gpus", "8", "--gpu-model", "B300", "--driver", "580.159.04", "--fabric")
RDMA_ARGS = ("--rdma-only", "--nics", ",".join(f"mlx5_{i}" for i in range(8)), "--link-layer", "Ethernet", "--mtu", "4096",
             "--gid-index", "3")


def test_the_healthy_line_says_what_was_read(tools, capsys):
    rc, out, err = health(capsys, *GPU_ARGS)
    assert rc == 0 and err == ""
    assert out == ("b300-1: healthy (8 × NVIDIA B300 SXM6 AC, driver 580.159.04; fabric Completed on 8 GPUs; "
                   "NVLink 18 of 18 links up on each of 8 GPUs; 0 pending row remaps on 8 GPUs)\n")
    rc, out, _ = health(capsys, *RDMA_ARGS)
    assert rc == 0 and out == ("b300-1: healthy (RDMA mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7: 8 ports "
                               "PORT_ACTIVE Ethernet active_mtu 4096, GID 3 RoCE v2 IPv4 on 8 NICs)\n")


@pytest.mark.parametrize(
    "cmd, answer, expected",
    [
        (("nvidia-smi", "-q"), (0, ""), "b300-1: gpus: nvidia-smi -q printed nothing"),
        (("nvidia-smi", "-q"), (3, "Unable to determine the device handle"),
         "b300-1: gpus: nvidia-smi -q failed (exit 3): Unable to determine the device handle"),
        (("nvidia-smi", "nvlink", "-s"), (0, ""), "b300-1: nvlink: nvidia-smi nvlink -s printed nothing"),
        (("nvidia-smi", "nvlink", "-s"), (255, ""), "b300-1: nvlink: nvidia-smi nvlink -s failed (exit 255): no output"),
        ((("nvidia-smi", f"--query-gpu={hc.QUERY_FIELDS}", "--format=csv")), (0, ""),
         "b300-1: gpus: nvidia-smi --query-gpu printed nothing"),
        ((("nvidia-smi", f"--query-gpu={hc.QUERY_FIELDS}", "--format=csv")), (9, "NVIDIA-SMI has failed"),
         "b300-1: driver: nvidia-smi failed (exit 9): NVIDIA-SMI has failed"),
    ],
    ids=["q-empty", "q-fails", "nvlink-empty", "nvlink-fails", "query-empty", "driver-down"],
)
def test_gpu_tools_that_fail_or_print_nothing_fail_the_gate(tools, capsys, cmd, answer, expected):
    tools[cmd] = answer
    rc, out, err = health(capsys, *GPU_ARGS)
    assert rc == 1 and out == "" and expected in err.splitlines()


@pytest.mark.parametrize(
    "cmd, answer, expected",
    [
        (("ibv_devinfo", "-v"), (0, ""), "b300-1: rdma: ibv_devinfo -v printed nothing"),
        (("ibv_devinfo", "-v"), (255, "No IB devices found"), "b300-1: rdma: ibv_devinfo -v failed (exit 255): No IB devices found"),
        (("show_gids",), (1, ""), "b300-1: rdma: show_gids failed (exit 1): no output"),
        (("show_gids",), (0, "DEV\tPORT\tINDEX\tGID\nn_gids_found=0\n"), "b300-1: rdma: mlx5_0 has no GID at index 3"),
    ],
    ids=["devinfo-empty", "devinfo-fails", "show-gids-fails", "no-gids"],
)
def test_rdma_tools_that_fail_or_print_nothing_fail_the_check(tools, capsys, cmd, answer, expected):
    tools[cmd] = answer
    rc, out, err = health(capsys, *RDMA_ARGS)
    assert rc == 1 and out == "" and expected in err.splitlines()


def test_a_nic_without_ports_is_a_problem():
    text = "hca_id:\tmlx5_0\n\ttransport:\t\t\tInfiniBand (0)\n\tphys_port_cnt:\t\t\t1\n"
    assert ("rdma", "mlx5_0: ibv_devinfo lists no port") in hc.rdma_problems(text, {}, ["mlx5_0"], "Ethernet", 4096, 3)


# --- preflight: each refusal, on facts of the real format (hostcheck facts on a real 2 × H200) -----


def real_facts(**changes) -> dict:
    facts = json.loads((DEVICE / "hostcheck-facts.json").read_text())
    facts["disk"] = {"path": "/mnt", "free_bytes": 600 * 10**9, "staged_bytes": 0}  # room for the checkpoint
    for key, value in changes.items():
        facts[key] = value
    return facts


def refusals(facts: dict, **kw) -> list[tuple[str, str]]:
    args = dict(allowed_os=["ubuntu 24.04"], min_kernel="5.12", gpus=2, gpu_model="H200", require_driver=False,
                min_free_gb=485)
    args.update(kw)
    return hc.preflight_problems(facts, **args)


def test_preflight_passes_the_real_host():
    assert refusals(real_facts()) == []


@pytest.mark.parametrize(
    "facts, kw, expected",
    [
        ({"os": "ubuntu 22.04", "os_pretty": "Ubuntu 22.04.5 LTS"}, {},
         ("os", "Ubuntu 22.04.5 LTS is not supported here (allowed: ubuntu 24.04)")),
        ({"os": "unknown", "os_pretty": ""}, {}, ("os", "cannot tell the OS: /etc/os-release is missing or has no ID")),
        ({"kernel": "5.4.0-216-generic"}, {}, ("kernel", "kernel 5.4.0-216-generic is older than 5.12 (DMA-BUF GPUDirect)")),
        ({"kernel": "custom"}, {}, ("kernel", "cannot read the kernel version 'custom'")),
        ({"gpus": {"error": "nvidia-smi: not installed", "exit": 127}}, {"require_driver": True},
         ("driver", "drivers.mode is verify but the driver does not answer: nvidia-smi: not installed")),
        ({}, {"gpu_model": "B300"}, ("gpus", "GPU model NVIDIA H200, stack expects B300")),
        ({}, {"gpus": 8}, ("gpus", "2 GPUs visible, stack expects 8")),
        ({"gpus": {"count": 0, "models": [], "driver_version": None, "compute_cap": []}}, {},
         ("gpus", "0 GPUs visible, stack expects 2")),
        ({"disk": {"path": "/mnt", "free_bytes": 400 * 10**9, "staged_bytes": 0}}, {},
         ("disk", "400 GB free or staged at /mnt, stack needs 485 GB (preflight.minFreeDiskGb)")),
        ({"disk": None}, {}, ("disk", "no disk facts (the model path was not given)")),
    ],
    ids=["os", "os-unreadable", "kernel", "kernel-unreadable", "driver-required", "gpu-model", "gpu-count",
         "no-gpu-listed", "disk", "disk-unknown"],
)
def test_preflight_refusals(facts, kw, expected):
    assert expected in refusals(real_facts(**facts), **kw)


def test_preflight_counts_a_staged_checkpoint_as_room_and_skips_gpus_before_the_driver():
    staged = real_facts(disk={"path": "/mnt/model", "free_bytes": 30 * 10**9, "staged_bytes": 470 * 10**9})
    assert refusals(staged) == [], "a host that already holds the weights passes again"
    before_driver = real_facts(gpus={"error": "nvidia-smi: not installed", "exit": 127})
    assert refusals(before_driver) == [], "drivers.mode install: the driver comes later"


def test_preflight_limits_are_inclusive():
    """A kernel at exactly minKernel and exactly minFreeDiskGb of room pass; a byte less does not."""
    assert refusals(real_facts(kernel="5.12.0-1-generic")) == []
    exact = real_facts(disk={"path": "/mnt", "free_bytes": 485 * 10**9 - 5, "staged_bytes": 5})
    assert refusals(exact) == []
    short = real_facts(disk={"path": "/mnt", "free_bytes": 485 * 10**9 - 1, "staged_bytes": 0})
    assert refusals(short) == [("disk", "485 GB free or staged at /mnt, stack needs 485 GB (preflight.minFreeDiskGb)")]
    assert ("kernel", "kernel 5.11.22 is older than 5.12 (DMA-BUF GPUDirect)") in refusals(real_facts(kernel="5.11.22"))


def test_preflight_command_prints_facts_and_one_line_per_refusal(monkeypatch, capsys):
    monkeypatch.setattr(hc.gather, "facts", lambda model_path: real_facts(kernel="5.4.0-216-generic"))
    rc = hc.main(["preflight", "--host", "h1", "--allowed-os", "debian 12", "--min-kernel", "5.12", "--gpus", "8", "--gpu-model", "H200",
                  "--model-path", "/mnt/model", "--min-free-gb", "485"])
    out = capsys.readouterr()
    assert rc == 1 and json.loads(out.out)["kernel"] == "5.4.0-216-generic"
    assert out.err.splitlines() == [
        "h1: os: Ubuntu 24.04.3 LTS is not supported here (allowed: debian 12)",
        "h1: kernel: kernel 5.4.0-216-generic is older than 5.12 (DMA-BUF GPUDirect)",
        "h1: gpus: 2 GPUs visible, stack expects 8",
    ]


def test_preflight_command_passes_a_good_host_and_hands_on_every_limit(monkeypatch, capsys):
    seen = {}
    # Facts in another order than they print: one JSON line, keys sorted.
    monkeypatch.setattr(hc.gather, "facts", lambda model_path: seen.setdefault("path", model_path) and dict(
        reversed(real_facts().items())))
    base = ["preflight", "--host", "h1", "--allowed-os", "ubuntu 24.04", "--min-kernel", "5.12", "--gpus", "2",
            "--gpu-model", "H200", "--model-path", "/mnt/model"]
    assert hc.main(base) == 0 and seen["path"] == "/mnt/model"
    out = capsys.readouterr()
    assert out.err == "" and out.out == json.dumps(real_facts(), sort_keys=True) + "\n"
    assert hc.main([*base, "--min-free-gb", "900"]) == 1
    assert "h1: disk: 600 GB free or staged at /mnt, stack needs 900 GB" in capsys.readouterr().err
    monkeypatch.setattr(hc.gather, "facts", lambda model_path: real_facts(gpus={"error": "nvidia-smi: not installed", "exit": 127}))
    assert hc.main(base) == 0, "the driver comes later (drivers.mode install)"
    assert hc.main([*base, "--require-driver"]) == 1
    assert "h1: driver: drivers.mode is verify but the driver does not answer" in capsys.readouterr().err


def test_commands_run_for_their_output_or_their_error():
    assert hc._run(["sh", "-c", "echo out; echo note >&2"], timeout=10) == (0, "out")
    assert hc._run(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=10) == (3, "out\nerr")
    assert hc._run(["no-such-tool-glm", "-q"]) == (127, "no-such-tool-glm: not installed")
    # Bytes that are not UTF-8 are read, not a crash.
    assert hc._run(["sh", "-c", "printf 'a\\377b'"], timeout=10) == (0, "a\ufffdb")


def test_a_tool_that_reads_its_input_gets_none():
    """hostcheck's own stdin may be an open pipe (SSH, a unit): a tool waiting on it would hang."""
    read, write = os.pipe()  # open for writing all along: a reader of it would wait
    saved = os.dup(0)
    os.dup2(read, 0)
    try:
        assert hc._run(["sh", "-c", "cat; echo read"], timeout=3) == (0, "read")
    finally:
        os.dup2(saved, 0)
        for fd in (saved, read, write):
            os.close(fd)


def test_facts_gather_what_preflight_reads(monkeypatch, tmp_path):
    """The keys preflight_problems reads are the keys facts() writes."""
    monkeypatch.setattr(hc.gather, "_run", lambda cmd: (127, f"{cmd[0]}: not installed"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "a.safetensors").write_bytes(b"x" * 1000)
    f = hc.facts(str(model))
    assert {"os", "os_pretty", "kernel", "gpus", "disk", "rdma", "container", "effective_memlock"} <= set(f)
    assert f["disk"]["staged_bytes"] == 1000 and f["disk"]["free_bytes"] > 0
    assert f["gpus"]["error"] == "nvidia-smi: not installed"
    assert hc.preflight_problems(f, [f["os"]], "1.0", 8, "B300", require_driver=True, min_free_gb=0) == [
        ("driver", "drivers.mode is verify but the driver does not answer: nvidia-smi: not installed")]


# --- the facts, gathered from each tool's output -------------------------------------------------


def fake_tools(monkeypatch, answers: dict[tuple[str, ...], tuple[int, str]]) -> list[tuple[str, ...]]:
    calls: list[tuple[str, ...]] = []

    def run(cmd):
        calls.append(tuple(cmd))
        return answers.get(tuple(cmd), (127, f"{cmd[0]}: not installed"))

    monkeypatch.setattr(hc.gather, "_run", run)
    return calls


QUERY = ("nvidia-smi", f"--query-gpu={hc.QUERY_FIELDS}", "--format=csv")


def test_gpu_facts_from_the_real_query(monkeypatch):
    fake_tools(monkeypatch, {QUERY: (0, (H200 / "query-gpu.csv").read_text())})
    assert hc.gpu_facts() == {"count": 2, "models": ["NVIDIA H200"], "driver_version": "580.159.04",
                              "compute_cap": ["9.0"], "memory_total_mib": 143771}
    fake_tools(monkeypatch, {QUERY: (9, "NVIDIA-SMI has failed because it couldn't communicate\nmore")})
    assert hc.gpu_facts() == {"error": "NVIDIA-SMI has failed because it couldn't communicate", "exit": 9}
    fake_tools(monkeypatch, {QUERY: (4, "")})
    assert hc.gpu_facts() == {"error": "nvidia-smi exited 4", "exit": 4}
    fake_tools(monkeypatch, {QUERY: (0, "index, name\n0\n")})
    assert hc.gpu_facts()["error"].startswith("cannot read nvidia-smi --query-gpu: malformed nvidia-smi csv row")
    fake_tools(monkeypatch, {QUERY: (0, "")})
    assert hc.gpu_facts() == {"count": 0, "models": [], "driver_version": None, "compute_cap": [],
                              "memory_total_mib": None}


def test_rdma_facts_from_the_stand_in_tools(monkeypatch, sim):
    sim.fault(RDMA_DOWN="mlx5_2")
    fake_tools(monkeypatch, {("ibv_devinfo", "-v"): (0, sim.out("ibv_devinfo", "-v")), ("ibstat",): (0, sim.out("ibstat"))})
    f = hc.rdma_facts()
    assert sorted(f) == [f"mlx5_{i}" for i in range(9)]
    assert f["mlx5_0"] == {"1": {"state": "PORT_ACTIVE", "active_mtu": 4096, "link_layer": "Ethernet",
                                 "roce_v2_ipv4_gids": [3], "rate_gbps": 800}}
    assert f["mlx5_2"]["1"]["state"] == "PORT_DOWN"
    assert f["mlx5_8"]["1"] == {"state": "PORT_ACTIVE", "active_mtu": 4096, "link_layer": "InfiniBand",
                                "roce_v2_ipv4_gids": [], "rate_gbps": 400}
    # Without ibstat the rates are left out; without ibv_devinfo the reason is the fact.
    fake_tools(monkeypatch, {("ibv_devinfo", "-v"): (0, sim.out("ibv_devinfo", "-v"))})
    assert "rate_gbps" not in hc.rdma_facts()["mlx5_0"]["1"]
    fake_tools(monkeypatch, {})
    assert hc.rdma_facts() == {"error": "ibv_devinfo: not installed"}
    fake_tools(monkeypatch, {("ibv_devinfo", "-v"): (0, "  \n")})
    assert hc.rdma_facts() == {"error": "ibv_devinfo -v exited 0 and printed nothing"}


def test_memlock_and_container(monkeypatch):
    import resource

    fake_tools(monkeypatch, {("systemd-detect-virt", "--container"): (0, "systemd-nspawn")})
    monkeypatch.setattr(resource, "getrlimit", lambda what: (8 * 1024 * 1024, 8 * 1024 * 1024))
    assert hc.memlock() == {"container": "systemd-nspawn", "effective_memlock": "8388608"}
    fake_tools(monkeypatch, {("systemd-detect-virt", "--container"): (1, "none")})
    monkeypatch.setattr(resource, "getrlimit", lambda what: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert hc.memlock() == {"container": "none", "effective_memlock": "unlimited"}
    # A detection that failed or did not answer reads as no container (what the gate assumes anyway).
    fake_tools(monkeypatch, {("systemd-detect-virt", "--container"): (124, "systemd-detect-virt timed out after 10s")})

    def unreadable(what):
        raise ValueError("not a limit this platform knows")

    monkeypatch.setattr(resource, "getrlimit", unreadable)
    assert hc.memlock() == {"container": "none", "effective_memlock": "unknown"}


def test_facts_put_it_together(monkeypatch, tmp_path):
    osr = tmp_path / "os-release"
    osr.write_text('PRETTY_NAME="Ubuntu 24.04.3 LTS"\nID=ubuntu\nVERSION_ID="24.04"\n')
    real = hc.os_release
    monkeypatch.setattr(hc.gather, "os_release", lambda path="/etc/os-release": real(str(osr)))
    fake_tools(monkeypatch, {QUERY: (0, (H200 / "query-gpu.csv").read_text())})
    monkeypatch.setattr(hc.gather.platform, "release", lambda: "6.8.0-49-generic")
    f = hc.facts(None)
    assert (f["os"], f["os_pretty"], f["kernel"]) == ("ubuntu 24.04", "Ubuntu 24.04.3 LTS", "6.8.0-49-generic")
    assert f["gpus"]["count"] == 2 and f["rdma"] == {"error": "ibv_devinfo: not installed"} and "disk" not in f


def test_os_release_reads_quoted_and_bare_values(tmp_path):
    osr = tmp_path / "os-release"
    osr.write_text('ID=debian\nVERSION_ID="12"\nPRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\n\n'
                   'NAME="Xubuntu"\nHOME_URL="https://example.org/?a=b"\n')
    assert hc.os_release(str(osr)) == {"ID": "debian", "VERSION_ID": "12", "PRETTY_NAME": "Debian GNU/Linux 12 (bookworm)",
                                       "": "", "NAME": "Xubuntu", "HOME_URL": "https://example.org/?a=b"}
    assert hc.os_release(str(tmp_path / "none")) == {}


def test_free_and_staged_bytes(tmp_path):
    where, free = hc.free_bytes(str(tmp_path / "not" / "yet"))
    assert where == str(tmp_path) and free > 0
    revs = tmp_path / "model.revisions" / "r1"
    revs.mkdir(parents=True)
    (revs / "a").write_bytes(b"x" * 300)
    (revs / "sub").mkdir()
    (revs / "sub" / "b").write_bytes(b"y" * 20)
    (tmp_path / "model").symlink_to(revs)
    assert hc.staged_bytes(str(tmp_path / "model")) == 320
    assert hc.staged_bytes(str(tmp_path / "absent")) == 0
    assert hc.staged_bytes(str(revs / "a")) == 0, "a file is no checkpoint folder"
    # The free bytes as the file system reports them (others write there too: within a GB).
    assert abs(hc.free_bytes(str(tmp_path))[1] - shutil.disk_usage(tmp_path).free) < 10**9


@pytest.mark.parametrize("argv, message", [
    (["health", "--host", "h"], "health needs --gpus and --gpu-model (or --rdma-only)"),
    (["health", "--gpus", "8", "--gpu-model", "B300"], "the following arguments are required: --host"),
    (["health", "--host", "h", "--gpus", "8"], "health needs --gpus and --gpu-model (or --rdma-only)"),
    (["health", "--host", "h", "--rdma-only"], "--rdma-only needs --nics"),
    (["health", "--host", "h", "--rdma-only", "--nics", "mlx5_0"], "--nics needs --link-layer, --mtu and --gid-index"),
    (["health", "--host", "h", "--rdma-only", "--nics", "mlx5_0", "--link-layer", "RoCE", "--mtu", "1", "--gid-index", "3"],
     "argument --link-layer: invalid choice: 'RoCE'"),
    (["preflight", "--host", "h", "--allowed-os", "ubuntu 24.04", "--min-kernel", "5.12", "--gpus", "8"],
     "the following arguments are required: --gpu-model"),
])
def test_the_command_line_refuses_what_a_check_cannot_do_without(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        hc.main(argv)
    assert e.value.code == 2 and f"error: {message}" in capsys.readouterr().err.splitlines()[-1]


def test_the_scripts_command_lines_parse_as_meant(monkeypatch):
    """What the rendered health gate and RDMA step run reaches the checks with the stack's values."""
    from conftest import stack_file

    from glm_infra.stack import load_file

    seen = []
    monkeypatch.setattr(hc.cli, "health", lambda args: seen.append(vars(args)) or 0)
    cfg = load_file(stack_file("prod-b300")).config
    for script in (gate_role.health_script(cfg, "b300-1"), rdma_role.rdma_script(cfg, "b300-1")):
        line = next(l for l in script.splitlines() if l.startswith("hostcheck=(python3"))
        words = shlex.split(line[len("hostcheck=("):-1].replace('"$host"', "b300-1"))
        assert hc.main(words[2:]) == 0  # after python3 and the path
    gate, rdma = seen
    assert (gate["gpus"], gate["gpu_model"], gate["driver"], gate["fabric"], gate["nvlinks"], gate["rdma_only"]) == (
        8, "B300", "580.159.04", True, 18, False)
    assert (rdma["rdma_only"], rdma["nics"], rdma["link_layer"], rdma["mtu"], rdma["gid_index"]) == (
        True, ",".join(f"mlx5_{i}" for i in range(8)), "Ethernet", 4096, 3)


# --- edges of the checks, each with the exact message a user reads -------------------------------


def test_a_row_remapping_failure_and_a_gpu_of_another_model(sim):
    out = b300_outputs(sim)
    q = re.sub(r"(Remapping Failure Occurred\s+: )No", r"\1Yes", out["q"], count=1)
    assert q != out["q"]
    query = out["query"].replace("NVIDIA B300 SXM6 AC", "NVIDIA B200", 1)
    problems = hc.gpu_problems(query, q, out["nvlink"], 8, "B300", "580.159.04", True)
    assert problems == [("gpus", "GPU 0 is 'NVIDIA B200', stack expects B300"),
                        ("remapped-rows", "GPU 0 (00000000:1A:00.0) had a row remapping failure")]
    assert hc.gpu_summary(query, q, out["nvlink"], True).startswith(
        "8 × NVIDIA B200, NVIDIA B300 SXM6 AC, driver 580.159.04; fabric Completed on 8 GPUs")
    no_fabric = hc.gpu_summary(out["query"], out["q"], "", False)
    assert no_fabric == "8 × NVIDIA B300 SXM6 AC, driver 580.159.04; 0 pending row remaps on 8 GPUs"
    assert hc.gpu_problems(out["query"], out["q"], "", 8, "B300", None, False) == [], "no NVLink check without --fabric"


def test_a_gpu_without_a_fabric_section_and_mixed_link_counts(sim):
    out = b300_outputs(sim)
    q = re.sub(r"\n    Fabric\n(        .*\n)+", "\n", out["q"], count=1)
    assert ("fabric", "GPU 0 (00000000:1A:00.0) fabric state is 'missing' (fabric manager or NVLSM not ready)") in \
        hc.gpu_problems(out["query"], q, out["nvlink"], 8, "B300", None, True)
    assert "fabric Completed/missing on 8 GPUs" in hc.gpu_summary(out["query"], q, out["nvlink"], True)
    sim.fault(NVLINK_DOWN="3:5")
    down = sim.out("nvidia-smi", "nvlink", "-s")
    assert "NVLink 17/18 of 18 links up on each of 8 GPUs" in hc.gpu_summary(out["query"], out["q"], down, True)
    short = "\n".join(l for l in out["nvlink"].splitlines() if "Link 17:" not in l)
    assert "NVLink 17 of 17 links up" in hc.gpu_summary(out["query"], out["q"], short, True)
    one_short = re.sub(r"(GPU 2: .*\n(?:.*\n){17})\t Link 17: .*\n", r"\1", out["nvlink"], count=1)
    assert "NVLink 17/18 of 17/18 links up" in hc.gpu_summary(out["query"], out["q"], one_short, True)
    pending = re.sub(r"(    Remapped Rows\n(?:        .*\n)*?        Pending\s+: )No", r"\1Yes", out["q"], count=1)
    assert hc.gpu_summary(out["query"], pending, out["nvlink"], True).endswith("; 1 pending row remaps on 8 GPUs")


def test_the_gate_and_rdma_together_and_a_driver_pin(tools, capsys):
    rc, out, err = health(capsys, *GPU_ARGS, "--nics", "mlx5_0", "--link-layer", "Ethernet",
                          "--mtu", "4096", "--gid-index", "3")
    assert rc == 0 and err == ""
    assert out == ("b300-1: healthy (8 × NVIDIA B300 SXM6 AC, driver 580.159.04; fabric Completed on 8 GPUs; NVLink 18 "
                   "of 18 links up on each of 8 GPUs; 0 pending row remaps on 8 GPUs; RDMA mlx5_0: 1 ports PORT_ACTIVE "
                   "Ethernet active_mtu 4096, GID 3 RoCE v2 IPv4 on 1 NICs)\n")
    rc, out, err = health(capsys, "--gpus", "8", "--gpu-model", "B300", "--driver", "580.172.08", "--fabric",
                          "--nics", "mlx5_9", "--link-layer", "Ethernet", "--mtu", "4096", "--gid-index", "3")
    assert rc == 1 and out == ""
    assert err.splitlines()[0] == "b300-1: driver: GPU 0 runs driver 580.159.04, stack pins 580.172.08"
    assert err.splitlines()[-1].startswith("b300-1: rdma: mlx5_9 not found (devices: mlx5_0, mlx5_1,")
    assert len(err.splitlines()) == 9, "8 GPUs on another driver, and the NIC"
    rc, out, _ = health(capsys, "--gpus", "8", "--gpu-model", "B300", "--nvlinks", "20", "--fabric")
    assert rc == 1


def test_rdma_without_show_gids_reads_the_gid_table_of_ibv_devinfo(tools, capsys, monkeypatch):
    monkeypatch.setattr(hc.shutil, "which", lambda name: None if name == "show_gids" else f"/usr/bin/{name}")
    tools[("show_gids",)] = (1, "must not run")
    rc, out, _ = health(capsys, *RDMA_ARGS)
    assert rc == 0 and out.endswith("GID 3 RoCE v2 IPv4 on 8 NICs)\n")
    # InfiniBand needs no GID check at all.
    rc, out, _ = health(capsys, "--rdma-only", "--nics", "mlx5_8", "--link-layer", "InfiniBand", "--mtu", "4096",
                        "--gid-index", "0")
    assert rc == 0 and out == "b300-1: healthy (RDMA mlx5_8: 1 ports PORT_ACTIVE InfiniBand active_mtu 4096)\n"


def test_rdma_problems_of_unreadable_ports():
    text = "hca_id:\tmlx5_0\n\t\tport:\t1\n\t\t\tlink_layer:\t\tEthernet\n"
    assert hc.rdma_problems(text, {"mlx5_0": {3: {"gid": "fe80::1", "ver": "", "ipv4": ""}}}, ["mlx5_0"], "Ethernet",
                            4096, 3) == [
        ("rdma", "mlx5_0 port 1 is of unknown state, expected PORT_ACTIVE"),
        ("rdma", "mlx5_0 port 1 active_mtu unknown, expected 4096"),
        ("rdma", "mlx5_0 GID index 3 is not a RoCE v2 GID with an IPv4 address (fe80::1, no RoCE version)"),
    ]
    assert hc.rdma_problems("hca_id:\tmlx5_0\n\t\tport:\t1\n", {}, ["mlx5_0"], "InfiniBand", 4096, 0)[1] == (
        "rdma", "mlx5_0 port 1 link layer unknown, expected InfiniBand")
    assert hc.rdma_problems("", {}, ["mlx5_0", "mlx5_1"], "InfiniBand", 4096, 0) == [
        ("rdma", "mlx5_0 not found (devices: none)"), ("rdma", "mlx5_1 not found (devices: none)")]
    assert hc.rdma_summary("", {}, ["mlx5_0"], "Ethernet", 3) == \
        "RDMA mlx5_0: 0 ports  Ethernet active_mtu , GID 3 RoCE  IPv4 on 0 NICs"


def test_show_gids_rows_without_ipv4_or_netdev_and_ibstat_firmware():
    rows = hc.parse_show_gids("DEV\tPORT\tINDEX\tGID\n---\t----\nmlx5_8\t1\t0\tfe80:0000:0000:0000:a088:c203:004f:bd0a\t\t\tv1\t\n"
                              "short line\nmlx5_0\tx\t0\tg\tv2\n")
    assert rows == [{"dev": "mlx5_8", "port": "1", "index": "0", "gid": "fe80:0000:0000:0000:a088:c203:004f:bd0a",
                     "ipv4": "", "ver": "v1", "netdev": ""}]
    assert hc.gid_table("", "mlx5_0\t2\t3\tfe80::1\t\tv2\tens1\n") == {}, "port 2 is not the port checked"
    assert hc.gid_table("hca_id:\tmlx5_0\nhca_id:\tmlx5_1\n\t\tport:\t2\n", None) == {"mlx5_0": {}, "mlx5_1": {}}
    # A row with its IPv4 address but nothing after it.
    assert hc.parse_show_gids("mlx5_0\t1\t3\t::ffff:10.0.0.1\t10.0.0.1\n") == [
        {"dev": "mlx5_0", "port": "1", "index": "3", "gid": "::ffff:10.0.0.1", "ipv4": "10.0.0.1", "ver": "",
         "netdev": ""}]
    ca = hc.parse_ibstat("CA 'mlx5_0'\n\tCA type: MT4129\n\tFirmware version: 28.39.1002\n\tPort 1:\n\t\tRate: 400\n"
                         "\t\tBase lid: 12\n\t\tState: Active\nnoise: x\n")
    assert ca == {"mlx5_0": {"type": "MT4129", "firmware": "28.39.1002",
                             "ports": {1: {"rate": 400, "base_lid": "12", "state": "Active"}}}}
    assert hc.parse_ibstat("Port 1:\n\t\tRate: 400\nCA 'x'\n\tCA type: MT4129\n") == {
        "x": {"type": "MT4129", "ports": {}}}, "nothing before the first CA"
    assert hc.parse_ibstat("CA 'x'\n\tPort 1:\n\t\tRate: n/a\n")["x"]["ports"][1]["rate"] == "n/a"


def test_ibv_devinfo_ports_without_values_and_nvlink_lines_outside_a_gpu():
    d = hc.parse_ibv_devinfo("hca_id:\tmlx5_0\n\t\tport:\t1\n\t\t\tstate:\n\t\t\tactive_mtu:\t\tunknown\n")
    assert d == {"mlx5_0": {1: {"gids": {}, "state": ""}}}
    assert hc.parse_nvlink_status("\t Link 0: 53.125 GB/s\nGPU 0: X (UUID: y)\n\t Link 1: <inactive>\n") == {0: {1: None}}
    assert hc.parse_smi_q("GPU 00000000:1A:00.0\n    Product Name : NVIDIA B300\n") == {
        "gpus": [{"bus_id": "00000000:1A:00.0", "name": "NVIDIA B300"}]}
    assert hc.parse_smi_q("GPU 0000000a:1a:00.0\n")["gpus"][0]["bus_id"] == "0000000a:1a:00.0"


@pytest.mark.parametrize("missing", ["--host", "--allowed-os", "--min-kernel", "--gpus", "--gpu-model"])
def test_preflight_needs_each_of_its_arguments(missing, capsys):
    argv = {"--host": "h", "--allowed-os": "ubuntu 24.04", "--min-kernel": "5.12", "--gpus": "8", "--gpu-model": "B300"}
    words = ["preflight"] + [w for k, v in argv.items() if k != missing for w in (k, v)]
    with pytest.raises(SystemExit) as e:
        hc.main(words)
    assert e.value.code == 2 and f"the following arguments are required: {missing}" in capsys.readouterr().err


def test_the_command_lines_the_steps_run(monkeypatch, capsys, tmp_path):
    """What hostplan's preflight and facts steps run reaches hostcheck with the stack's values."""
    from conftest import stack_file

    from glm_infra import hostplan
    from glm_infra.plan.topology import plan as make_plan
    from glm_infra.stack import load_file

    cfg = load_file(stack_file("prod-b300")).config
    steps = hostplan.host_steps(cfg, make_plan(cfg), make_plan(cfg).host("b300-1"), stack_name="prod-b300").steps
    seen = []
    monkeypatch.setattr(hc.cli, "preflight", lambda args: seen.append(vars(args)) or 0)
    words = shlex.split(steps["preflight"].create.split(" && ", 1)[1])
    assert hc.main(words[1:]) == 0
    assert seen == [{"cmd": "preflight", "host": "b300-1", "allowed_os": ["ubuntu 24.04"], "min_kernel": "5.12",
                     "model_path": "/mnt/model/glm/GLM-5.2-NVFP4", "gpus": 8, "gpu_model": "B300",
                     "require_driver": False, "min_free_gb": 485.0}]
    monkeypatch.setattr(hc.gather, "facts", lambda model_path: {"model_path": model_path, "arch": "x86_64"})
    assert hc.main(shlex.split(steps["facts"].create)[1:]) == 0
    # One JSON line, keys sorted: the same facts print the same line.
    assert capsys.readouterr().out == '{"arch": "x86_64", "model_path": "/mnt/model/glm/GLM-5.2-NVFP4"}\n'
    with pytest.raises(SystemExit):
        hc.main([])


# --- issue 25, defect 1: the fabric's Status, not only its State -----------------------------------

FABRIC = FIX / "h200x2-fabric-status"  # the real capture with one Fabric line edited (README.md)
FAILED = "its fabric registration failed (see the nvidia-fabricmanager log)"


def h200_problems(smi_q: str, fabric: bool = True) -> list[tuple[str, str]]:
    return hc.gpu_problems((H200 / "query-gpu.csv").read_text(), smi_q, misc_section("nvlink -s"),
                           gpus=2, model="H200", driver="580.159.04", fabric=fabric)


def test_the_fabric_status_fixtures_are_the_real_capture_with_one_line_edited():
    original = (H200 / "nvidia-smi-q.txt").read_text().splitlines()
    status = "        Status                                         : "

    def edits(name: str) -> list[tuple[str, int, list[str], list[str]]]:
        edited = (FABRIC / name).read_text().splitlines()
        ops = difflib.SequenceMatcher(None, original, edited, autojunk=False).get_opcodes()
        return [(tag, i1 + 1, original[i1:i2], edited[j1:j2]) for tag, i1, i2, j1, j2 in ops if tag != "equal"]

    assert edits("nvidia-smi-q-failure.txt") == [("replace", 492, [status + "Success"], [status + "Failure"])]
    assert edits("nvidia-smi-q-nvml-error.txt") == [
        ("replace", 243, [status + "Success"], [status + "Insufficient Resources"])]
    assert edits("nvidia-smi-q-no-status.txt") == [("delete", 492, [status + "Success"], [])]
    assert h200_problems("\n".join(original)) == [], "the capture as it was passes"


@pytest.mark.parametrize("name, expected", [
    ("nvidia-smi-q-failure.txt",
     f"GPU 1 (00000000:00:07.0) fabric state is 'Completed' with status 'Failure': {FAILED}"),
    ("nvidia-smi-q-nvml-error.txt",
     f"GPU 0 (00000000:00:06.0) fabric state is 'Completed' with status 'Insufficient Resources': {FAILED}"),
    ("nvidia-smi-q-no-status.txt",
     f"GPU 1 (00000000:00:07.0) fabric state is 'Completed' with status 'missing': {FAILED}"),
], ids=["failure", "nvml-error", "no-status"])
def test_a_failed_fabric_registration_fails_the_gate_naming_gpu_state_and_status(name, expected):
    assert h200_problems((FABRIC / name).read_text()) == [("fabric-status", expected)]


def test_the_gate_command_says_the_failed_registration_not_healthy(monkeypatch, capsys):
    """The issue's demonstration: this capture read `healthy … fabric Completed`."""
    fake_tools(monkeypatch, {QUERY: (0, (H200 / "query-gpu.csv").read_text()),
                             ("nvidia-smi", "-q"): (0, (FABRIC / "nvidia-smi-q-failure.txt").read_text()),
                             ("nvidia-smi", "nvlink", "-s"): (0, misc_section("nvlink -s"))})
    rc = hc.main(["health", "--host", "h200x2", "--gpus", "2", "--gpu-model", "H200", "--fabric"])
    out = capsys.readouterr()
    assert (rc, out.out) == (1, "")
    assert out.err == f"h200x2: fabric-status: GPU 1 (00000000:00:07.0) fabric state is 'Completed' with status " \
                      f"'Failure': {FAILED}\n"


@pytest.mark.parametrize("state, status, expected", [
    ("Completed", "Success", []),
    ("In Progress", "N/A", [("fabric", "G fabric state is 'In Progress' (fabric manager or NVLSM not ready)")]),
    ("Not Started", None, [("fabric", "G fabric state is 'Not Started' (fabric manager or NVLSM not ready)")]),
    (None, None, [("fabric", "G fabric state is 'missing' (fabric manager or NVLSM not ready)")]),
    ("", "Success", [("fabric", "G fabric state is 'missing' (fabric manager or NVLSM not ready)")]),
    ("N/A", "N/A", [("fabric", "G fabric state is 'N/A' (fabric manager or NVLSM not ready)")]),
    ("Completed", "", [("fabric-status", f"G fabric state is 'Completed' with status 'missing': {FAILED}")]),
    ("Completed", "success", [("fabric-status", f"G fabric state is 'Completed' with status 'success': {FAILED}")]),
    ("Completed", "Unknown Error",
     [("fabric-status", f"G fabric state is 'Completed' with status 'Unknown Error': {FAILED}")]),
])
def test_fabric_state_and_status_of_one_gpu(state, status, expected):
    assert hc.fabric_problems("G", state, status) == expected


def test_where_the_fabric_does_not_apply_neither_field_is_judged():
    """Without --fabric (a stack without fabric manager) the Fabric section is not read; a single H200
    without NVLink peers reads State N/A and Status N/A, a problem only when the stack asks for a fabric."""
    assert h200_problems((FABRIC / "nvidia-smi-q-failure.txt").read_text(), fabric=False) == []
    single = hc.parse_smi_q((SINGLE / "nvidia-smi-q.txt").read_text())["gpus"]
    assert [(g["fabric_state"], g["fabric_status"]) for g in single] == [("N/A", "N/A")]
    fields = (single[0].get("remapped_pending"), single[0].get("remapped_failure"))
    assert hc.remap_problems("G", *fields) == []


def test_the_stand_in_reports_a_failed_registration_and_the_gate_names_every_gpu(sim):
    sim.fault(FABRIC_STATUS="Failure")
    problems = b300_problems(sim)
    assert [p for p in problems if p[0] != "fabric-status"] == []
    assert problems[0] == ("fabric-status", f"GPU 0 (00000000:1A:00.0) fabric state is 'Completed' with status "
                                            f"'Failure': {FAILED}")
    assert len(problems) == 8
    # Until the fabric completes, NVML has no status: the state is what the gate names.
    (sim.root / "run/glm-sim/fabricmanager-active").unlink()
    assert {p[0] for p in b300_problems(sim)} == {"fabric"}


# --- the class around it: gate inputs that are partial or unreadable fail --------------------------


def test_remapped_rows_fields_that_are_missing_or_unreadable(sim):
    out = b300_outputs(sim)
    no_failure_line = re.sub(r"\n        Remapping Failure Occurred +: No", "", out["q"], count=1)
    assert hc.gpu_problems(out["query"], no_failure_line, out["nvlink"], 8, "B300", None, True) == [
        ("remapped-rows", "GPU 0 (00000000:1A:00.0): Remapped Rows Remapping Failure Occurred reads 'nothing', "
                          "expected No")]
    assert hc.remap_problems("G", "N/A", "No") == [("remapped-rows", "G: Remapped Rows Pending reads 'N/A', expected No")]
    assert hc.remap_problems("G", None, "No") == [("remapped-rows", "G: Remapped Rows Pending reads 'nothing', expected No")]
    assert hc.remap_problems("G", "Yes", "Yes") == [
        ("remapped-rows", "G has a pending row remap (reset the GPU before serving)"),
        ("remapped-rows", "G had a row remapping failure")]
    assert hc.remap_problems("G", "No", "No") == []


@pytest.mark.parametrize("speed", ["N/A", "0 GB/s", "0.000 GB/s", "<inactive>", "Unknown", "26.562"])
def test_an_nvlink_link_without_a_speed_is_down(sim, speed):
    out = b300_outputs(sim)
    nvlink = re.sub(r"(GPU 4: .*\n(?:.*\n){3}\t Link 3: ).*", rf"\g<1>{speed}", out["nvlink"], count=1)
    assert nvlink != out["nvlink"]
    assert hc.gpu_problems(out["query"], out["q"], nvlink, 8, "B300", None, True) == [
        ("nvlink", "GPU 4 NVLink links down: 3")]


def test_any_speed_is_a_link_up(sim):
    out = b300_outputs(sim)
    slow = re.sub(r"(GPU 4: .*\n(?:.*\n){3}\t Link 3: ).*", r"\g<1>0.5 GB/s", out["nvlink"], count=1)
    assert hc.parse_nvlink_status(slow)[4][3] == "0.5 GB/s"


def test_parsers_on_lines_out_of_place():
    assert hc.parse_ibv_devinfo("\t\tport:\t1\n\t\t\tstate:\t\tPORT_ACTIVE (4)\n") == {}, "no device yet"
    # A device's own fields before its first port are no port's.
    assert hc.parse_ibv_devinfo("hca_id:\tmlx5_0\n\tstate:\tPORT_ACTIVE (4)\n\tGID[0]:\t\tfe80::1\n") == {"mlx5_0": {}}
    assert hc.gid_ipv4("not a gid") == "" and hc.gid_ipv4("fe80::1") == ""
    query = "index, driver_version\n0, 580.159.04\n"
    assert hc.gpu_problems(query, "", "", 1, "B300", None, False)[0] == ("gpus", "GPU 0 is None, stack expects B300")


def test_unreadable_tool_output_is_a_named_problem_not_a_crash(tools, capsys):
    tools[QUERY] = (0, tools[QUERY][1] + "Unable to determine the device handle for GPU0000:F0:00.0: Unknown Error\n")
    rc, out, err = health(capsys, *GPU_ARGS)
    assert rc == 1 and out == ""
    assert err == ("b300-1: gpus: cannot read nvidia-smi --query-gpu: malformed nvidia-smi csv row: 'Unable to "
                   "determine the device handle for GPU0000:F0:00.0: Unknown Error'\n")
    # A show_gids row that is not a GID row is skipped: the GID it should have given is missing.
    gids = tools[("show_gids",)][1]
    tools[("show_gids",)] = (0, re.sub(r"^(mlx5_0\s+1\s+)3\b", r"\1x", gids, flags=re.M))
    rc, out, err = health(capsys, *RDMA_ARGS)
    assert (rc, out, err) == (1, "", "b300-1: rdma: mlx5_0 has no GID at index 3\n")


def test_a_driver_that_fails_without_a_word_is_named(tools, capsys):
    tools[QUERY] = (9, "")
    assert health(capsys, *GPU_ARGS) == (1, "", "b300-1: driver: nvidia-smi failed (exit 9): no output\n")


# --- issue 25, defect 9: every tool under a limit --------------------------------------------------


def gone(pid: int) -> bool:
    """The process is no more (or a zombie waiting to be reaped), within a few seconds."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


def hanging_tool(path: Path, pids: Path, hang_on: str = "*", answers: dict[str, str] | None = None) -> None:
    """A tool (a script, as show_gids is) that hangs when its arguments match the case pattern
    ``hang_on``: it prints a line and waits on a child that sleeps for good, both ignoring TERM, each
    pid in ``pids``. Other arguments get the text of the first pattern of ``answers`` they match."""
    others = "".join(f"  {pattern}) printf '%s' {shlex.quote(text)} ;;\n" for pattern, text in (answers or {}).items())
    path.write_text(f"""#!/bin/bash
case "$*" in
  {hang_on})
    trap '' TERM
    echo "$$" >> {pids}
    echo partial
    sleep 1000 &
    echo "$!" >> {pids}
    wait ;;
{others}esac
""")
    path.chmod(0o755)


def all_gone(pids: Path) -> bool:
    numbers = [int(p) for p in pids.read_text().split()] if pids.exists() else []
    return bool(numbers) and all(gone(p) for p in numbers)


def test_a_tool_that_hangs_is_stopped_with_what_it_started_and_named(tmp_path, monkeypatch):
    pids = tmp_path / "pids"
    hanging_tool(tmp_path / "show_gids", pids)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setitem(hc.TOOL_TIMEOUT_S, "show_gids", 0.5)
    start = time.monotonic()
    assert hc._run(["show_gids"]) == (hc.TIMED_OUT, "show_gids timed out after 0.5s")
    assert time.monotonic() - start < 0.5 + hc.REAP_S
    assert all_gone(pids), "the tool and its child are gone"
    assert hc._run(["show_gids"], timeout=0.2) == (124, "show_gids timed out after 0.2s")


def run_hostcheck(tmp_path: Path, argv: list[str], limits: dict[str, float]) -> subprocess.CompletedProcess:
    """hostcheck.py as the gate runs it (its own process, PATH with the tools of tmp_path/bin), with
    shorter tool limits; a run that hangs is stopped here and fails the test."""
    # Imported as the stdlib-only package it is (its folder on PYTHONPATH), not as glm_infra's module.
    code = ("import json, sys; import hostcheck as hc; "
            "vars(hc).setdefault('TOOL_TIMEOUT_S', {}).update(json.loads(sys.argv[1])); sys.exit(hc.main(sys.argv[2:]))")
    cmd = [sys.executable, "-c", code, json.dumps(limits), *argv]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env={**os.environ, "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin",
                              "PYTHONPATH": str(Path(hc.__file__).parents[1])})
    try:
        out, err = p.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        pytest.fail(f"hostcheck.py {' '.join(argv)} still running after 20 s: a hung tool hangs it")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


@pytest.mark.parametrize("hang_on, expected", [
    ("--query-gpu=*", "h200x2: driver: nvidia-smi failed (exit 124): nvidia-smi timed out after 0.5s"),
    ("-q", "h200x2: gpus: nvidia-smi -q failed (exit 124): nvidia-smi timed out after 0.5s"),
    ("'nvlink -s'", "h200x2: nvlink: nvidia-smi nvlink -s failed (exit 124): nvidia-smi timed out after 0.5s"),
], ids=["query", "q", "nvlink"])
def test_a_hanging_nvidia_smi_fails_the_gate_naming_it(tmp_path, hang_on, expected):
    """nvidia-smi answering as it did on the real 2 × H200, but for the one call that hangs."""
    (tmp_path / "bin").mkdir()
    pids = tmp_path / "pids"
    answers = {"--query-gpu=*": (H200 / "query-gpu.csv").read_text(), "-q": (H200 / "nvidia-smi-q.txt").read_text(),
               "'nvlink -s'": misc_section("nvlink -s")}
    hanging_tool(tmp_path / "bin" / "nvidia-smi", pids, hang_on, answers)
    start = time.monotonic()
    r = run_hostcheck(tmp_path, ["health", "--host", "h200x2", "--gpus", "2", "--gpu-model", "H200", "--fabric"],
                      {"nvidia-smi": 0.5})
    assert (r.returncode, r.stdout, r.stderr.splitlines()) == (1, "", [expected])
    assert time.monotonic() - start < 15
    assert all_gone(pids)


def test_a_hanging_rdma_tool_fails_the_check_naming_it(tmp_path):
    (tmp_path / "bin").mkdir()
    pids = tmp_path / "pids"
    hanging_tool(tmp_path / "bin" / "ibv_devinfo", pids)
    r = run_hostcheck(tmp_path, ["health", "--host", "b300-1", *RDMA_ARGS], {"ibv_devinfo": 0.5})
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == "b300-1: rdma: ibv_devinfo -v failed (exit 124): ibv_devinfo timed out after 0.5s\n"
    assert all_gone(pids)


def test_a_hanging_tool_is_a_fact_not_a_hang(monkeypatch):
    fake_tools(monkeypatch, {QUERY: (124, "nvidia-smi timed out after 60s")})
    assert hc.gpu_facts() == {"error": "nvidia-smi timed out after 60s", "exit": 124}


def test_a_look_of_the_gate_outlasts_hostcheck_with_every_tool_at_its_limit(monkeypatch, capsys):
    """The longest look: --query-gpu answers at its very limit (a timeout there ends the look), each
    later nvidia-smi call hangs and is slow to die once killed. What hostcheck waits in all stays below
    the limit the gate gives one look (hostcheck_timeout_s of the rendered script), by no more than 20 s
    (Python's start, and the kill of --query-gpu counted though it cannot come with the rest)."""
    waited: list[float] = []

    class Pipe:
        def close(self) -> None:
            pass

    class Late:
        pid = 0
        stdout = stderr = Pipe()
        returncode = 0

        def __init__(self, cmd, **kw):
            assert kw["start_new_session"] is True, "a group of its own, to kill what it started"
            self.answers = cmd[1].startswith("--query-gpu")

        def communicate(self, timeout):
            waited.append(timeout)
            if self.answers:
                return (H200 / "query-gpu.csv").read_text(), ""
            raise subprocess.TimeoutExpired("x", timeout)

        def wait(self, timeout):
            waited.append(timeout)
            raise subprocess.TimeoutExpired("x", timeout)

    killed = []
    monkeypatch.setattr(hc.gather.subprocess, "Popen", Late)
    monkeypatch.setattr(hc.gather.os, "killpg", lambda pid, sig: killed.append(sig))
    monkeypatch.setattr(hc.shutil, "which", lambda name: f"/usr/bin/{name}")
    for fabric, calls in ((True, 3), (False, 2)):
        waited.clear()
        rc, out, err = health(capsys, "--gpus", "2", "--gpu-model", "H200", *(["--fabric"] if fabric else []))
        assert rc == 1 and len(err.splitlines()) == calls - 1 and "nvidia-smi timed out after 60s" in err
        look = int(re.search(r"^hostcheck_timeout_s=(\d+)$", gate_script(fabric=fabric), re.M)[1])
        assert len(waited) == 2 * calls - 1 and sum(waited) < look <= sum(waited) + 20
    assert set(killed) == {signal.SIGKILL}


# --- the gate script (health-gate.sh.j2) ----------------------------------------------------------------


def prod_b300(dcgm_level: int = 0, fabric: bool = True):
    """prod-b300's stack with another diagnostic level or without the fabric manager."""
    from conftest import stack_file

    from glm_infra.stack import load_file

    cfg = load_file(stack_file("prod-b300")).config
    drivers = cfg.drivers.model_copy(update={"dcgm_diag_level": dcgm_level, "fabric_manager": fabric})
    return cfg.model_copy(update={"drivers": drivers})


def gate_script(dcgm_level: int = 0, fabric: bool = True, **limits: int) -> str:
    """The rendered health gate of b300-1, with its limits (``NAME=N`` lines) replaced."""

    script = gate_role.health_script(prod_b300(dcgm_level, fabric), "b300-1")
    for name, value in limits.items():
        script = re.sub(rf"^{name}=\d+$", f"{name}={value}", script, flags=re.M)
    return script


def run_gate(s: StubPath, script: str, *args: str, limit: float = 20) -> Result:
    """StubPath.run, but a gate still running after ``limit`` seconds is killed with everything it
    started, and fails the test."""
    s.log.write_text("")
    env = {"PATH": f"{s.bin}:/usr/bin:/bin", "STUB_LOG": str(s.log), "STATE": str(s.state), "LC_ALL": "C"}
    p = subprocess.Popen(["bash", "-s", "--", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = p.communicate(script, timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        pytest.fail(f"the gate is still running after {limit} s: a hung tool hangs it")
    return Result(p.returncode, out, err, [l for l in s.log.read_text().splitlines() if l])


def hang(s: StubPath, name: str) -> None:
    """A stub that hangs (a child that sleeps for good, both ignoring TERM), pids in $STATE/pids."""
    s.add(name, """trap '' TERM; echo "$$" >> "$STATE/pids"; sleep 1000 & echo "$!" >> "$STATE/pids"; wait""")


HEALTHY = 'echo "b300-1: healthy (8 × NVIDIA B300 SXM6 AC, driver 580.159.04)"'


def test_the_gate_stops_a_hanging_hostcheck_and_names_it(tmp_path):
    s = StubPath(tmp_path / "stubs")
    hang(s, "python3")
    start = time.monotonic()
    r = run_gate(s, gate_script(hostcheck_timeout_s=1, kill_after_s=1), "apply")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines() == ["b300-1: health: hostcheck.py health timed out after 1s"]
    assert time.monotonic() - start < 10, "once: a hung look is not waited for again"
    assert sum(c.startswith("python3") for c in r.calls) == 1
    assert all_gone(s.state / "pids")


@pytest.mark.parametrize("mode", ["apply", "check"])
def test_the_gate_stops_a_hanging_dcgmi_and_names_it(tmp_path, mode):
    s = StubPath(tmp_path / "stubs")
    s.add("python3", HEALTHY)
    hang(s, "dcgmi")
    r = run_gate(s, gate_script(dcgm_level=2, dcgm_timeout_s=1, kill_after_s=1), mode)
    assert r.returncode == 1 and "healthy" in r.stdout
    assert r.stderr.splitlines() == ["b300-1: health: dcgmi diag -r 2 timed out after 1s"]
    assert all_gone(s.state / "pids")


DCGM_PASS = r"""Successfully ran diagnostic for group.
+---------------------------+------------------------------------------------+
| Diagnostic                | Result                                         |
+===========================+================================================+
|-----  Deployment  --------+------------------------------------------------|
| software                  | Pass                                           |
|                           | GPU0: Pass                                     |
+---------------------------+------------------------------------------------+"""


@pytest.mark.parametrize("dcgmi, expected", [
    (f"printf '%s\\n' {shlex.quote(DCGM_PASS)}", None),
    ("exit 0", "b300-1: health: dcgmi diag -r 1 printed nothing"),
    (f"printf '%s\\n' {shlex.quote(DCGM_PASS.replace('GPU0: Pass', 'GPU0: Fail'))}",
     "b300-1: health: dcgmi diag -r 1 reports a failed test"),
    (f"printf '%s\\n' {shlex.quote(DCGM_PASS.replace('| Pass', '| Fail', 1))}",
     "b300-1: health: dcgmi diag -r 1 reports a failed test"),
    ("echo 'Error: Unable to start an embedded host engine.'; exit 249",
     "b300-1: health: dcgmi diag -r 1 failed (exit 249)"),
], ids=["pass", "empty", "gpu-fails", "test-fails", "no-host-engine"])
def test_the_diagnostic_passes_only_on_a_table_without_a_failure(tmp_path, dcgmi, expected):
    s = StubPath(tmp_path / "stubs")
    s.add("python3", HEALTHY)
    s.add("dcgmi", dcgmi)
    r = run_gate(s, gate_script(dcgm_level=1), "apply")
    if expected is None:
        assert (r.returncode, r.stderr) == (0, "")
        assert r.stdout.splitlines()[-1] == "b300-1: health: dcgmi diag -r 1 passed"
    else:
        assert r.returncode == 1 and r.stderr.splitlines()[-1] == expected


def test_the_gate_passes_only_on_the_healthy_line(tmp_path):
    s = StubPath(tmp_path / "stubs")
    s.add("python3", "exit 0")
    r = run_gate(s, gate_script(), "check")
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == "b300-1: health: hostcheck.py health exited 0 without its healthy line\n"
    s.add("python3", "exit 3")
    r = run_gate(s, gate_script(), "apply")
    assert (r.returncode, r.stderr) == (1, "b300-1: health: hostcheck.py health failed (exit 3) and printed nothing\n")
    s.add("python3", 'echo "b300-2: healthy (another host)"')
    assert run_gate(s, gate_script(), "check").returncode == 1
    s.add("python3", HEALTHY)
    r = run_gate(s, gate_script(), "check")
    assert (r.returncode, r.stdout, r.stderr) == (0, "b300-1: healthy (8 × NVIDIA B300 SXM6 AC, driver 580.159.04)\n", "")


def test_the_gate_does_not_wait_on_a_failed_fabric_registration(tmp_path):
    s = StubPath(tmp_path / "stubs")
    line = f"b300-1: fabric-status: GPU 3 (00000000:73:00.0) fabric state is 'Completed' with status 'Failure': {FAILED}"
    s.add("python3", f"echo {shlex.quote(line)} >&2; exit 1")
    s.add("sleep", "exit 0")
    r = run_gate(s, gate_script(), "apply")
    assert (r.returncode, r.stderr) == (1, line + "\n")
    assert sum(c.startswith("python3") for c in r.calls) == 1
    # A fabric still in progress is waited for: here it completes at the second look.
    s.add("python3", f"""if [ -e "$STATE/looked" ]; then {HEALTHY}; exit 0; fi
touch "$STATE/looked"; echo "b300-1: fabric: GPU 0 (00000000:1A:00.0) fabric state is 'In Progress'" >&2; exit 1""")
    r = run_gate(s, gate_script(), "apply")
    assert (r.returncode, r.stdout) == (0, "b300-1: healthy (8 × NVIDIA B300 SXM6 AC, driver 580.159.04)\n")
    assert r.called("sleep 5") and sum(c.startswith("python3") for c in r.calls) == 2


def test_the_gate_with_the_stand_in_nvidia_smi_and_the_real_hostcheck(tmp_path, sim):
    """health-gate.sh check with hostcheck.py itself and the stand-in nvidia-smi: healthy, then the simulated
    failed registration named on each GPU."""
    s = StubPath(tmp_path / "stubs")
    s.add("nvidia-smi", f'GLM_SIM_ROOT={shlex.quote(str(sim.root))} PYTHONPATH={shlex.quote(str(HW_LIB))} '
                        f'exec {shlex.quote(sys.executable)} {shlex.quote(str(TOOLS["nvidia-smi"]))} "$@"')
    s.add("python3", f'exec {shlex.quote(sys.executable)} "$@"')
    script = gate_script().replace("/usr/local/libexec/glm-infra/hostcheck.py", str(host_program("hostcheck", tmp_path)))
    r = run_gate(s, script, "check")
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout.startswith("b300-1: healthy (8 × NVIDIA B300 SXM6 AC, driver 580.159.04; fabric Completed on 8 GPUs")
    sim.fault(FABRIC_STATUS="Failure")
    r = run_gate(s, script, "check")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines()[0] == (f"b300-1: fabric-status: GPU 0 (00000000:1A:00.0) fabric state is 'Completed' "
                                        f"with status 'Failure': {FAILED}")
    assert len(r.stderr.splitlines()) == 8


@pytest.mark.parametrize("level", [0, 1, 2, 3])
@pytest.mark.parametrize("fabric", [True, False])
def test_the_gate_step_outlasts_the_wait_a_last_look_and_the_diagnostic(level, fabric):
    """From the rendered script's own numbers: the wait for the fabric, a pause, one more look at its
    limit (and timeout's grace to KILL), then dcgmi diag at its limit: all within the step's timeout."""
    from glm_infra.plan.topology import plan
    from glm_infra.steps import seconds

    cfg = prod_b300(level, fabric)
    step = gate_role.health_gate_step(cfg, plan(cfg).host("b300-1"))
    script = step.stdin

    def value(name: str) -> int:
        return int(re.search(rf"^{name}=(\d+)$", script, re.M)[1])

    pause = int(re.search(r"^    sleep (\d+)$", script, re.M)[1])
    grace = value("kill_after_s")
    longest = value("timeout_s") + pause + value("hostcheck_timeout_s") + grace
    if level:
        assert value("dcgm_timeout_s") >= {1: 60, 2: 4 * 120, 3: 2 * 900}[level], "DCGM's documented run times, and room"
        longest += value("dcgm_timeout_s") + grace
    else:
        assert value("dcgm_level") == 0
    assert seconds(step.timeout, 0) == longest + 60, "and a minute for SSH and bash"


# --- facts and preflight on partial facts: what is missing is named, never taken for a pass --------


def test_facts_of_a_host_whose_os_release_says_little(monkeypatch, tmp_path):
    osr = tmp_path / "os-release"
    osr.write_text("NAME=Custom\n")
    real = hc.os_release
    monkeypatch.setattr(hc.gather, "os_release", lambda path="/etc/os-release": real(str(osr)))
    fake_tools(monkeypatch, {})
    monkeypatch.setattr(hc.gather.platform, "machine", lambda: "aarch64")
    model = tmp_path / "model"
    f = hc.facts(str(model))
    assert (f["os"], f["os_pretty"], f["arch"]) == ("unknown", "", "aarch64")
    assert f["disk"]["path"] == str(tmp_path) and f["disk"]["staged_bytes"] == 0
    assert hc.preflight_problems(f, ["ubuntu 24.04"], "1.0", 0, "B300", False)[0] == (
        "os", "cannot tell the OS: /etc/os-release is missing or has no ID")


def test_preflight_on_facts_that_lost_their_keys():
    """A facts line with keys missing (an older hostcheck, a truncated line) is refused for each."""
    assert hc.preflight_problems({}, ["ubuntu 24.04"], "5.12", 8, "B300", False, 485) == [
        ("os", "cannot tell the OS: /etc/os-release is missing or has no ID"),
        ("kernel", "cannot read the kernel version ''"),
        ("gpus", "0 GPUs visible, stack expects 8"),
        ("disk", "no disk facts (the model path was not given)"),
    ]
    partial = {"os": "ubuntu 24.04", "kernel": "6.8.0", "gpus": {"models": []}, "disk": {"path": "/mnt"}}
    assert hc.preflight_problems(partial, ["ubuntu 24.04"], "5.12", 8, "B300", False, 1e-9) == [
        ("gpus", "0 GPUs visible, stack expects 8"),
        ("disk", "0 GB free or staged at /mnt, stack needs 1e-09 GB (preflight.minFreeDiskGb)")]
    staged_only = {**partial, "gpus": {"count": 8}, "disk": {"path": "/mnt", "staged_bytes": 1}}
    assert hc.preflight_problems(staged_only, ["ubuntu 24.04"], "5.12", 8, "B300", False, 1e-9) == []
    free_only = {**staged_only, "disk": {"path": "/mnt", "free_bytes": 1}}
    assert hc.preflight_problems(free_only, ["ubuntu 24.04"], "5.12", 8, "B300", False, 1e-9) == []


def test_preflight_lists_what_it_allows_and_what_it_found():
    facts = real_facts(gpus={"count": 2, "models": ["NVIDIA H100", "NVIDIA H200"]},
                       disk={"path": "/mnt", "free_bytes": 1_500_000_000, "staged_bytes": 0})
    assert hc.preflight_problems(facts, ["debian 12", "rocky 9"], "5.12", 2, "B300", False, 485) == [
        ("os", "Ubuntu 24.04.3 LTS is not supported here (allowed: debian 12, rocky 9)"),
        ("gpus", "GPU model NVIDIA H100, NVIDIA H200, stack expects B300"),
        ("disk", "2 GB free or staged at /mnt, stack needs 485 GB (preflight.minFreeDiskGb)"),
    ]


def test_gpu_facts_of_odd_query_output(monkeypatch):
    header = "index, name, driver_version, memory.total [MiB]\n"
    fake_tools(monkeypatch, {QUERY: (0, header + "0, NVIDIA B300, 580.159.04, [N/A]\n")})
    assert hc.gpu_facts() == {"count": 1, "models": ["NVIDIA B300"], "driver_version": "580.159.04",
                              "compute_cap": [""], "memory_total_mib": None}
    fake_tools(monkeypatch, {QUERY: (0, "index, name, driver_version\n0, NVIDIA B300, 580.159.04\n")})
    assert hc.gpu_facts()["memory_total_mib"] is None
    # Output without the columns asked for is unreadable, not a crash.
    fake_tools(monkeypatch, {QUERY: (0, "index, name\n0, NVIDIA B300\n")})
    assert hc.gpu_facts() == {"error": "cannot read nvidia-smi --query-gpu: no driver_version column", "exit": 0}
    fake_tools(monkeypatch, {QUERY: (0, "index\n0\n")})
    assert hc.gpu_facts()["error"] == "cannot read nvidia-smi --query-gpu: no name or driver_version column"
    fake_tools(monkeypatch, {QUERY: (0, "index, name\n0\n")})
    assert hc.gpu_facts() == {"error": "cannot read nvidia-smi --query-gpu: malformed nvidia-smi csv row: '0'", "exit": 0}


def test_the_rdma_summary_says_what_it_read_even_of_odd_ports():
    text = ("hca_id:\tmlx5_0\n\t\tport:\t1\n\t\t\tstate:\t\t\tPORT_ACTIVE (4)\n\t\t\tactive_mtu:\t\t4096 (5)\n"
            "hca_id:\tmlx5_1\n\t\tport:\t1\n")
    gids = {"mlx5_0": {3: {"gid": "::ffff:10.0.0.1", "ver": "v2", "ipv4": "10.0.0.1"}},
            "mlx5_1": {3: {"gid": "::ffff:10.0.0.2", "ver": "v1", "ipv4": "10.0.0.2"}}}
    assert hc.rdma_summary(text, gids, ["mlx5_0", "mlx5_1"], "Ethernet", 3) == (
        "RDMA mlx5_0,mlx5_1: 2 ports ?/PORT_ACTIVE Ethernet active_mtu 4096/?, GID 3 RoCE v1/v2 IPv4 on 2 NICs")


def test_the_gpu_summary_says_what_it_read_even_of_odd_rows():
    query = "index, name, driver_version\n0, NVIDIA B300, 580.159.04\n1, NVIDIA B300, 580.172.08\n"
    assert hc.gpu_summary(query, "", "", False) == "2 × NVIDIA B300, driver 580.159.04, 580.172.08; 0 pending row remaps on 0 GPUs"
    assert hc.gpu_summary("index\n0\n", "", "", False) == "1 × ?, driver ?; 0 pending row remaps on 0 GPUs"


# --- nic-affinity: each GPU's nearest compute NIC into vLLM's EnvironmentFile ------------------------


def affinity(monkeypatch, sim, capsys, env_file, *extra, fail: dict | None = None) -> tuple[int, str, str]:
    """hostcheck.py nic-affinity on the stand-in tools (``fail``: a tool's (rc, output) instead)."""

    def run(cmd: list[str]) -> tuple[int, str]:
        if tuple(cmd) in (fail or {}):
            return fail[tuple(cmd)]
        r = sim.run(cmd[0], *cmd[1:])
        return r.returncode, (r.stdout if r.returncode == 0 else r.stdout + r.stderr).strip()

    monkeypatch.setattr(hc.gather, "_run", run)
    rc = hc.main(["nic-affinity", "--host", "sim-1", "--gpus", "8", "--nics", ",".join(f"mlx5_{i}" for i in range(8)),
                  "--max-distance", "PXB", "--env-file", str(env_file), *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_nic_affinity_writes_each_gpus_own_nic_once_and_checks_it(monkeypatch, sim, capsys, tmp_path):
    env = tmp_path / "nic-affinity.env"
    rc, out, err = affinity(monkeypatch, sim, capsys, env, "--check")
    assert rc == 1 and f"sim-1: affinity: {env}: No such file or directory" in err and not env.exists()
    rc, out, err = affinity(monkeypatch, sim, capsys, env)
    assert rc == 0 and err == "" and out.startswith("sim-1: nearest NICs (GPU 0 0000:1a:00.0 -> mlx5_0 0000:18:00.0 (PXB);")
    assert out.endswith("(PXB)); ACS off on the 16 switch ports between them\n")
    text = env.read_text()
    assert text.splitlines()[-1].startswith("VLLM_GPU_NIC_PCIE_MAPPING=0000:1a:00.0=0000:18:00.0,0000:3c:00.0=")
    assert len(text.splitlines()[-1].split(",")) == 8 and oct(env.stat().st_mode & 0o777) == "0o644"
    written = env.stat().st_mtime_ns
    assert affinity(monkeypatch, sim, capsys, env)[0] == 0 and env.stat().st_mtime_ns == written, "unchanged: untouched"
    assert affinity(monkeypatch, sim, capsys, env, "--check")[0] == 0
    # A NIC moved to the other socket: the check says the file is stale, apply refuses and keeps it.
    sim.fault(NIC_DISTANCE="3:SYS")
    rc, out, err = affinity(monkeypatch, sim, capsys, env)
    assert rc == 1 and out == "" and env.read_text() == text
    assert err == ("sim-1: affinity: GPU 3 (0000:73:00.0): its nearest compute NIC mlx5_0 is at NODE, farther than PXB "
                   "(nixl.maxNicDistance): its rank's KV traffic would cross the host bridge\n")
    sim.fault(NIC_DISTANCE="3:PIX")
    rc, out, err = affinity(monkeypatch, sim, capsys, env, "--check")
    assert rc == 1 and "no longer matches the GPUs' nearest NICs" in err


@pytest.mark.parametrize("tool, answer, says", [
    (("ibdev2netdev", "-v"), (127, "ibdev2netdev: not installed"),
     "ibdev2netdev -v failed (exit 127): ibdev2netdev: not installed"),
    (("nvidia-smi", "topo", "-m"), (0, ""), "nvidia-smi topo -m printed nothing"),
    (("nvidia-smi", "topo", "-m"), (0, "No devices were found\n"), "cannot read nvidia-smi: no header row"),
])
def test_nic_affinity_fails_closed_on_a_tool_it_cannot_read(monkeypatch, sim, capsys, tmp_path, tool, answer, says):
    env = tmp_path / "nic-affinity.env"
    rc, out, err = affinity(monkeypatch, sim, capsys, env, fail={tool: answer})
    assert rc == 1 and says in err and not env.exists()


def test_acs_on_between_a_gpu_and_its_nic_fails_unless_turned_off(monkeypatch, sim, capsys, tmp_path):
    env = tmp_path / "nic-affinity.env"
    sim.fault(PCIE_ACS_ON="1 6")
    rc, out, err = affinity(monkeypatch, sim, capsys, env)
    assert rc == 1 and not env.exists() and err.count("sim-1: acs: ") == 4
    assert "sim-1: acs: 0000:39:01.0 (PCI bridge: " in err and "between GPU 1 (0000:3c:00.0) and mlx5_1" in err
    rc, out, err = affinity(monkeypatch, sim, capsys, env, "--acs", "disable", "--check")
    assert rc == 1 and err.count("sim-1: acs: ") == 4 and not (sim.root / "run/glm-sim/acs-off").exists(), \
        "check changes nothing"
    rc, out, err = affinity(monkeypatch, sim, capsys, env, "--acs", "disable")
    assert rc == 0 and err == "" and out.endswith("; ACS turned off on 4 of the 16 switch ports between them\n")
    assert sorted((sim.root / "run/glm-sim/acs-off").read_text().split()) == [
        "0000:39:00.0", "0000:39:01.0", "0000:dc:00.0", "0000:dc:01.0"]
    rc, out, err = affinity(monkeypatch, sim, capsys, env, "--check")
    assert rc == 0 and out.endswith("; ACS off on the 16 switch ports between them\n")
    # setpci refused (not root, say): named, and nothing written.
    env.unlink()
    (sim.root / "run/glm-sim/acs-off").unlink()
    rc, out, err = affinity(monkeypatch, sim, capsys, env, "--acs", "disable", fail={
        ("setpci", "-s", "0000:39:00.0", "ECAP_ACS+0x6.w=0000"): (1, "setpci: Unable to write: Permission denied")})
    assert rc == 1 and not env.exists()
    assert err == ("sim-1: acs: setpci -s 0000:39:00.0 ECAP_ACS+0x6.w=0000 failed (exit 1): setpci: Unable to write: "
                   "Permission denied\n")


def test_a_gpu_off_the_bus_writes_no_pairs_and_boot_leaves_the_file_alone(monkeypatch, sim, capsys, tmp_path):
    env = tmp_path / "nic-affinity.env"
    assert affinity(monkeypatch, sim, capsys, env)[0] == 0
    pairs = env.read_text()
    sim.fault(GPU_COUNT="7")
    for extra in ((), ("--acs-only",), ("--check",)):
        rc, out, err = affinity(monkeypatch, sim, capsys, env, *extra)
        assert rc == 1 and err == "sim-1: affinity: 7 GPUs visible, stack expects 8\n" and env.read_text() == pairs
    # At boot (--acs-only) ACS is turned off and the file neither written nor compared.
    sim.fault(PCIE_ACS_ON="4", NIC_DISTANCE="")
    env.write_text("stale\n")
    rc, out, err = affinity(monkeypatch, sim, capsys, env, "--acs", "disable", "--acs-only")
    assert rc == 0 and "ACS turned off on 2 of the 16" in out and env.read_text() == "stale\n"
