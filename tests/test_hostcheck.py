"""hostcheck.py's parsers and checks on real captures (2 × H200) and on B300-shaped output of the
stand-in tools with faults (fabric In Progress, a GPU missing, a pending row remap, a link down)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from glm_infra.host import hostcheck as hc
from standins.test_hardware import Sim

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
    monkeypatch.setattr(hc, "_run", lambda cmd: answers[tuple(cmd)])
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
    monkeypatch.setattr(hc, "facts", lambda model_path: real_facts(kernel="5.4.0-216-generic"))
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
    monkeypatch.setattr(hc, "facts", lambda model_path: seen.setdefault("path", model_path) and real_facts())
    base = ["preflight", "--host", "h1", "--allowed-os", "ubuntu 24.04", "--min-kernel", "5.12", "--gpus", "2",
            "--gpu-model", "H200", "--model-path", "/mnt/model"]
    assert hc.main(base) == 0 and seen["path"] == "/mnt/model"
    out = capsys.readouterr()
    assert out.err == "" and json.loads(out.out) == real_facts() and out.out.index('"container"') < out.out.index('"os"')
    assert hc.main([*base, "--min-free-gb", "900"]) == 1
    assert "h1: disk: 600 GB free or staged at /mnt, stack needs 900 GB" in capsys.readouterr().err
    monkeypatch.setattr(hc, "facts", lambda model_path: real_facts(gpus={"error": "nvidia-smi: not installed", "exit": 127}))
    assert hc.main(base) == 0, "the driver comes later (drivers.mode install)"
    assert hc.main([*base, "--require-driver"]) == 1
    assert "h1: driver: drivers.mode is verify but the driver does not answer" in capsys.readouterr().err


def test_commands_run_for_their_output_or_their_error():
    assert hc._run(["sh", "-c", "echo out; echo note >&2"]) == (0, "out")
    assert hc._run(["sh", "-c", "echo out; echo err >&2; exit 3"]) == (3, "out\nerr")
    assert hc._run(["no-such-tool-glm", "-q"]) == (127, "no-such-tool-glm: not installed")


def test_facts_gather_what_preflight_reads(monkeypatch, tmp_path):
    """The keys preflight_problems reads are the keys facts() writes."""
    monkeypatch.setattr(hc, "_run", lambda cmd: (127, f"{cmd[0]}: not installed"))
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

    monkeypatch.setattr(hc, "_run", run)
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


def test_facts_put_it_together(monkeypatch, tmp_path):
    osr = tmp_path / "os-release"
    osr.write_text('PRETTY_NAME="Ubuntu 24.04.3 LTS"\nID=ubuntu\nVERSION_ID="24.04"\n')
    real = hc.os_release
    monkeypatch.setattr(hc, "os_release", lambda path="/etc/os-release": real(str(osr)))
    fake_tools(monkeypatch, {QUERY: (0, (H200 / "query-gpu.csv").read_text())})
    monkeypatch.setattr(hc.platform, "release", lambda: "6.8.0-49-generic")
    f = hc.facts(None)
    assert (f["os"], f["os_pretty"], f["kernel"]) == ("ubuntu 24.04", "Ubuntu 24.04.3 LTS", "6.8.0-49-generic")
    assert f["gpus"]["count"] == 2 and f["rdma"] == {"error": "ibv_devinfo: not installed"} and "disk" not in f


def test_os_release_reads_quoted_and_bare_values(tmp_path):
    osr = tmp_path / "os-release"
    osr.write_text('ID=debian\nVERSION_ID="12"\nPRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\n\n')
    assert hc.os_release(str(osr)) == {"ID": "debian", "VERSION_ID": "12", "PRETTY_NAME": "Debian GNU/Linux 12 (bookworm)",
                                       "": ""}
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


@pytest.mark.parametrize("argv, message", [
    (["health", "--host", "h"], "health needs --gpus and --gpu-model (or --rdma-only)"),
    (["health", "--host", "h", "--gpus", "8"], "health needs --gpus and --gpu-model (or --rdma-only)"),
    (["health", "--host", "h", "--rdma-only"], "--rdma-only needs --nics"),
    (["health", "--host", "h", "--rdma-only", "--nics", "mlx5_0"], "--nics needs --link-layer, --mtu and --gid-index"),
    (["health", "--host", "h", "--rdma-only", "--nics", "mlx5_0", "--link-layer", "RoCE", "--mtu", "1", "--gid-index", "3"],
     "invalid choice: 'RoCE'"),
    (["preflight", "--host", "h", "--allowed-os", "ubuntu 24.04", "--min-kernel", "5.12", "--gpus", "8"],
     "the following arguments are required: --gpu-model"),
])
def test_the_command_line_refuses_what_a_check_cannot_do_without(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        hc.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_scripts_command_lines_parse_as_meant(monkeypatch):
    """What the rendered health gate and RDMA step run reaches the checks with the stack's values."""
    from glm_infra import render
    from glm_infra.stack import load_file

    from conftest import stack_file

    seen = []
    monkeypatch.setattr(hc, "health", lambda args: seen.append(vars(args)) or 0)
    cfg = load_file(stack_file("prod-b300")).config
    for script in (render.health_script(cfg, "b300-1"), render.rdma_script(cfg, "b300-1")):
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
    ca = hc.parse_ibstat("CA 'mlx5_0'\n\tCA type: MT4129\n\tFirmware version: 28.39.1002\n\tPort 1:\n\t\tRate: 400\n"
                         "\t\tBase lid: 12\n\t\tState: Active\nnoise: x\n")
    assert ca == {"mlx5_0": {"type": "MT4129", "firmware": "28.39.1002",
                             "ports": {1: {"rate": 400, "base_lid": "12", "state": "Active"}}}}
    assert hc.parse_ibstat("Port 1:\n\t\tRate: 400\n") == {}, "nothing before the first CA"
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
    from glm_infra import hostplan
    from glm_infra.stack import load_file
    from glm_infra.topology import plan as make_plan

    from conftest import stack_file

    cfg = load_file(stack_file("prod-b300")).config
    steps = hostplan.host_steps(cfg, make_plan(cfg), make_plan(cfg).host("b300-1"), stack_name="prod-b300").steps
    seen = []
    monkeypatch.setattr(hc, "preflight", lambda args: seen.append(vars(args)) or 0)
    words = shlex.split(steps["preflight"].create.split(" && ", 1)[1])
    assert hc.main(words[1:]) == 0
    assert seen == [{"cmd": "preflight", "host": "b300-1", "allowed_os": ["ubuntu 24.04"], "min_kernel": "5.12",
                     "model_path": "/mnt/model/glm/GLM-5.2-NVFP4", "gpus": 8, "gpu_model": "B300",
                     "require_driver": False, "min_free_gb": 485.0}]
    monkeypatch.setattr(hc, "facts", lambda model_path: {"model_path": model_path})
    assert hc.main(shlex.split(steps["facts"].create)[1:]) == 0
    assert json.loads(capsys.readouterr().out) == {"model_path": "/mnt/model/glm/GLM-5.2-NVFP4"}
    with pytest.raises(SystemExit):
        hc.main([])
