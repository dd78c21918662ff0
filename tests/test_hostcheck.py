"""hostcheck.py's parsers and checks on real captures (2 × H200) and on B300-shaped output of the
stand-in tools with faults (fabric In Progress, a GPU missing, a pending row remap, a link down)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glm_infra import hostcheck as hc
from test_standins import Sim

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
    assert (DEVICE / "hostcheck-health.txt").read_text() == "h200x2: healthy (2 × H200, fabric Completed, NVLink up)\nrc=0\n"
    assert "h200x2: gpus: 2 GPUs visible, stack expects 8" in (DEVICE / "hostcheck-health-mismatch.txt").read_text()
    # The raw outputs captured there parse like the shared captures.
    q = hc.parse_smi_q((DEVICE / "nvidia-smi-q.txt").read_text())
    assert len(q["gpus"]) == 2 and {g["fabric_state"] for g in q["gpus"]} == {"Completed"}
    assert len(hc.parse_nvlink_status((DEVICE / "nvlink-s.txt").read_text())) == 2


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


def test_rdma_checks_on_the_stand_in_nics(sim):
    nics = [f"mlx5_{i}" for i in range(8)]
    devinfo, gids = sim.out("ibv_devinfo"), sim.out("show_gids")
    assert hc.rdma_problems(devinfo, gids, nics, "Ethernet", 4096, 3) == []
    # The NVSwitch-management ConnectX is InfiniBand: listing it as a compute NIC is caught.
    assert ("rdma", "mlx5_8 port 1 link layer InfiniBand, expected Ethernet") in hc.rdma_problems(
        devinfo, gids, [*nics, "mlx5_8"], "Ethernet", 4096, 3)
    sim.fault(RDMA_DOWN="mlx5_3")
    assert ("rdma", "mlx5_3 port 1 is PORT_DOWN, expected PORT_ACTIVE") in hc.rdma_problems(
        sim.out("ibv_devinfo"), sim.out("show_gids"), nics, "Ethernet", 4096, 3)
    assert ("rdma", "mlx5_9 not found (devices: mlx5_0, mlx5_1, mlx5_2, mlx5_3, mlx5_4, mlx5_5, mlx5_6, mlx5_7, "
                    "mlx5_8)") in hc.rdma_problems(devinfo, gids, ["mlx5_9"], "Ethernet", 4096, 3)
