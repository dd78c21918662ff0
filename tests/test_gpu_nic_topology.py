"""``nvidia-smi topo -m`` read by the host agent (glm_infra/agent/hostcheck.py): each GPU's distance to
each NIC, and its nearest NIC, on real captures (tests/fixtures/nvidia-smi-topo/, sources in
tests/fixtures/CAPTURES-SOURCES.md; tests/fixtures/h200x2-nvidia-smi/ from the device)."""

from __future__ import annotations

from pathlib import Path

import pytest

from glm_infra.agent import hostcheck

FIXTURES = Path(__file__).parent / "fixtures"
TOPO = FIXTURES / "nvidia-smi-topo"
B300 = TOPO / "sglang-issue-26039-b300-8gpu-9nic-bond-tabs-ansi-remnants.txt"
A100 = TOPO / "oyanghd-gpu-compress-decompress-a100sxm40g-8gpu-10nic-tabs.txt"
H800 = TOPO / "sglang-issue-28424-h800-8gpu-9nic-bond-spaces.txt"
H100 = TOPO / "sglang-issue-30401-h100-8gpu-8nic-spaces.txt"


@pytest.mark.parametrize("capture, nics", [
    (B300, {f"mlx5_{i}" for i in range(10, 18)} | {"mlx5_bond_0"}),
    (A100, {f"mlx5_{i}" for i in range(10)}),
    (H800, {"mlx5_0", *(f"mlx5_{i}" for i in range(3, 10)), "mlx5_bond_0"}),
    (H100, {f"mlx5_{i}" for i in range(8)}),
])
def test_every_gpu_row_names_every_nic_by_its_legend(capture, nics):
    topo = hostcheck.parse_topo_m(capture.read_text())
    assert sorted(topo) == list(range(8))
    assert all(set(row) == nics for row in topo.values())
    assert all(v in hostcheck.TOPO_LEVELS for row in topo.values() for v in row.values())


def test_b300_each_gpu_reaches_its_own_nic_through_pcie_switches():
    """NIC0 is mlx5_10 (the legend, not the column, names the device); the bond is never nearest."""
    topo = hostcheck.parse_topo_m(B300.read_text())
    assert hostcheck.nearest_nics(topo) == {g: (f"mlx5_{10 + g}", "PXB") for g in range(8)}
    # The bond hangs off the second socket: across a host bridge from GPUs 4-7, across the sockets from 0-3.
    assert [topo[g]["mlx5_bond_0"] for g in range(8)] == ["SYS"] * 4 + ["NODE"] * 4
    assert topo[0]["mlx5_14"] == "SYS"
    assert hostcheck.nearest_nics(topo, ["mlx5_bond_0"]) == {g: ("mlx5_bond_0", "SYS" if g < 4 else "NODE")
                                                              for g in range(8)}


def test_two_gpus_behind_one_switch_with_two_nics_get_one_each():
    topo = hostcheck.parse_topo_m(A100.read_text())
    assert topo[0]["mlx5_0"] == topo[0]["mlx5_1"] == topo[1]["mlx5_0"] == "PXB"
    assert hostcheck.nearest_nics(topo) == {g: (f"mlx5_{g}", "PXB") for g in range(8)}
    # mlx5_8 and mlx5_9 sit on no GPU's switch: a GPU restricted to them is across the sockets.
    assert {v for row in topo.values() for n, v in row.items() if n in ("mlx5_8", "mlx5_9")} == {"SYS"}
    assert hostcheck.nearest_nics(topo, ["mlx5_8", "mlx5_9"])[0] == ("mlx5_8", "SYS")


def test_nic_names_need_not_follow_their_columns():
    nearest = hostcheck.nearest_nics(hostcheck.parse_topo_m(H800.read_text()))
    assert nearest[1] == ("mlx5_3", "PIX") and nearest[7] == ("mlx5_9", "PIX")


def test_tabs_and_the_spaces_a_paste_makes_of_them_read_the_same():
    text = B300.read_text()
    assert hostcheck.parse_topo_m(text.expandtabs(8)) == hostcheck.parse_topo_m(text)
    with_escape = text.replace("[4m", "\x1b[4m").replace("[0m", "\x1b[0m")  # as nvidia-smi prints it
    assert hostcheck.parse_topo_m(with_escape) == hostcheck.parse_topo_m(text)


def test_a_host_without_rdma_nics_has_gpus_and_no_nic():
    """The H200 device (tests/fixtures/h200x2-nvidia-smi): two GPUs over NVLink, no NIC column."""
    text = (FIXTURES / "h200x2-nvidia-smi" / "misc.txt").read_text().split("== nvlink -s")[0]
    topo = hostcheck.parse_topo_m(text)
    assert topo == {0: {}, 1: {}} and hostcheck.nearest_nics(topo) == {}


def test_unreadable_output_is_an_error_naming_what_is_wrong():
    with pytest.raises(ValueError, match="no header row"):
        hostcheck.parse_topo_m("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    cut = "\n".join(line if not line.startswith("GPU3") else line.rsplit("\t", 14)[0]
                    for line in B300.read_text().splitlines())
    with pytest.raises(ValueError, match="GPU3: .* cells for 17 columns"):
        hostcheck.parse_topo_m(cut)


# --- each GPU's NIC, for vLLM's VLLM_GPU_NIC_PCIE_MAPPING ----------------------------------------------

RDMA = FIXTURES / "rdma"


def test_pci_addresses_are_written_as_vllm_and_sysfs_write_them():
    assert hostcheck.normalize_bdf("00000000:1A:00.0") == "0000:1a:00.0"  # nvidia-smi's 8-digit domain
    assert hostcheck.normalize_bdf("1a:00.0") == "0000:1a:00.0"  # lspci without -D
    assert hostcheck.normalize_bdf("0001:C4:00.1") == "0001:c4:00.1"
    for bad in ("1a:00", "0000:1a:00.8", "GPU0", ""):
        with pytest.raises(ValueError, match="not a PCI address"):
            hostcheck.normalize_bdf(bad)


def test_ibdev2netdev_gives_each_rdma_device_its_pci_address():
    assert hostcheck.parse_ibdev2netdev((RDMA / "ibdev2netdev-v-1.txt").read_text()) == {
        "mlx5_0": "0000:01:00.0", "mlx5_1": "0000:41:00.0", "mlx5_2": "0000:8f:00.0", "mlx5_3": "0000:c4:00.0"}
    vfs = hostcheck.parse_ibdev2netdev((RDMA / "ibdev2netdev-v-2.txt").read_text())
    assert vfs["mlx5_1"] == "0000:81:00.0" and vfs["mlx5_4"] == "0000:02:00.3" and len(vfs) == 5
    assert hostcheck.parse_ibdev2netdev("mlx5_0 port 1 ==> ib0 (Up)\n") == {}, "the short form has no address"


def b300_inputs():
    topo = hostcheck.parse_topo_m(B300.read_text())
    gpus = {g: f"0000:{bus:02x}:00.0" for g, bus in enumerate((0x1A, 0x3C, 0x62, 0x73, 0x9A, 0xBC, 0xDF, 0xF0))}
    nics = {f"mlx5_{10 + g}": f"0000:{bus - 2:02x}:00.0" for g, bus in enumerate((0x1A, 0x3C, 0x62, 0x73, 0x9A, 0xBC,
                                                                                0xDF, 0xF0))}
    return topo, gpus, nics, [f"mlx5_{i}" for i in range(10, 18)]


def test_each_b300_gpu_gets_its_own_nic_in_vllms_pairs():
    topo, gpus, nics, compute = b300_inputs()
    nearest, problems = hostcheck.nic_affinity(topo, gpus, nics, compute, "PXB")
    assert problems == [] and nearest == {g: (f"mlx5_{10 + g}", "PXB") for g in range(8)}
    env = hostcheck.nic_affinity_env(nearest, gpus, nics, "b300-1")
    assert env.splitlines()[-1] == ("VLLM_GPU_NIC_PCIE_MAPPING=0000:1a:00.0=0000:18:00.0,0000:3c:00.0=0000:3a:00.0,"
                                    "0000:62:00.0=0000:60:00.0,0000:73:00.0=0000:71:00.0,0000:9a:00.0=0000:98:00.0,"
                                    "0000:bc:00.0=0000:ba:00.0,0000:df:00.0=0000:dd:00.0,0000:f0:00.0=0000:ee:00.0")
    assert "#   GPU 3 0000:73:00.0 -> mlx5_13 0000:71:00.0 (PXB)" in env
    # Only PIX is asked for: every GPU fails, each named with its address and the key.
    _, problems = hostcheck.nic_affinity(topo, gpus, nics, compute, "PIX")
    assert len(problems) == 8 and problems[3] == (
        "affinity", "GPU 3 (0000:73:00.0): its nearest compute NIC mlx5_13 is at PXB, farther than PIX "
                    "(nixl.maxNicDistance): its rank's KV traffic would cross the host bridge")


def test_a_gpu_without_a_near_compute_nic_fails_and_what_is_missing_is_named():
    topo, gpus, nics, compute = b300_inputs()
    # Only the bond (a management link here): every GPU is a host bridge or a socket away from it.
    _, problems = hostcheck.nic_affinity(topo, gpus, {"mlx5_bond_0": "0000:aa:00.0"}, ["mlx5_bond_0"], "PXB")
    assert [p[1].split("): ")[0] + ")" for p in problems] == [f"GPU {g} ({gpus[g]})" for g in range(8)]
    assert "mlx5_bond_0 is at SYS" in problems[0][1] and "mlx5_bond_0 is at NODE" in problems[7][1]
    _, problems = hostcheck.nic_affinity(topo, gpus, nics, ["mlx5_0"], "PXB")
    assert problems[0] == ("affinity", "GPU 0: none of the compute NICs (mlx5_0) is in nvidia-smi topo -m")
    _, problems = hostcheck.nic_affinity(topo, {g: b for g, b in gpus.items() if g != 5}, {
        n: b for n, b in nics.items() if n != "mlx5_12"}, compute, "PXB")
    assert problems == [("affinity", "mlx5_12: ibdev2netdev -v gives no PCI address"),
                        ("affinity", "GPU 5: nvidia-smi --query-gpu gives no PCI address")]
    _, problems = hostcheck.nic_affinity({g: r for g, r in topo.items() if g != 7}, gpus, nics, compute, "PXB")
    assert problems == [("affinity", "GPU 7 is not in nvidia-smi topo -m")]
