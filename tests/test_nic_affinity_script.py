"""The nic-affinity step's script (glm_infra/roles/nixl/templates/nic-affinity.sh.j2) run with the real
hostcheck.py against a simulated B300's nvidia-smi and ibdev2netdev (testbed/hardware.py), and what the
step puts in the plan: ucx.env without a global UCX_NET_DEVICES, the units reading the pairs and checking
them before they start, validate's refusal where ibdev2netdev is not installed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import host_program, stack_file

from glm_infra import hostplan
from glm_infra.agent import hostcheck
from glm_infra.plan import validate
from glm_infra.plan.topology import plan
from glm_infra.render import render_template
from glm_infra.roles import nixl, vllm
from glm_infra.spec import paths
from glm_infra.stack import load_file
from testbed.hardware import HW_LIB, TOOLS, Sim

NICS = [f"mlx5_{i}" for i in range(8)]


@pytest.fixture
def host(tmp_path):
    """(run the script with an action, the env file, the Sim) on one simulated host."""
    sim = Sim(tmp_path / "hw")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("nvidia-smi", "ibdev2netdev", "lspci", "setpci"):
        (bin_dir / tool).symlink_to(TOOLS[tool])
    env_file = tmp_path / "etc" / "glm-infra" / "nic-affinity.env"
    script = tmp_path / "glm-nic-affinity"
    script.write_text(render_template("nic-affinity.sh.j2", host="sim-1", nics=NICS, max_distance="PXB", gpus=8,
                                      env_file=str(env_file), hostcheck=str(host_program("hostcheck", tmp_path)), disable_acs=False,
                                      acs_unit="glm-test-acs-never-installed.service", script_path=str(script)))
    script.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "GLM_SIM_ROOT": str(sim.root),
           "PYTHONPATH": str(HW_LIB)}

    def run(action: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(script), action], capture_output=True, text=True, env=env, timeout=120)

    return run, env_file, sim


def test_apply_writes_each_gpus_nearest_nic_check_holds_it_remove_deletes_it(host):
    run, env_file, sim = host
    assert run("check").returncode == 1 and not env_file.exists()
    applied = run("apply")
    assert applied.returncode == 0, applied.stderr
    assert applied.stdout.startswith("sim-1: nearest NICs (GPU 0 0000:1a:00.0 -> mlx5_0 0000:18:00.0 (PXB); ")
    pairs = env_file.read_text().splitlines()[-1]
    assert pairs.startswith("VLLM_GPU_NIC_PCIE_MAPPING=0000:1a:00.0=0000:18:00.0,") and pairs.count(",") == 7
    assert run("apply").returncode == 0 and run("check").returncode == 0
    sim.fault(NIC_DISTANCE="6:SYS")
    failed = run("check")
    assert failed.returncode == 1 and failed.stderr.startswith("sim-1: affinity: GPU 6 (0000:df:00.0): its nearest "
                                                               "compute NIC mlx5_")
    assert " is at NODE, farther than PXB (nixl.maxNicDistance)" in failed.stderr
    assert run("apply").returncode == 1 and env_file.read_text().splitlines()[-1] == pairs, "left as it was"
    # ACS on between GPU 3 and its NIC (rdma.disableAcs false here): named, and the file kept as it was.
    sim.fault(PCIE_ACS_ON="3")
    failed = run("apply")
    assert failed.returncode == 1 and failed.stderr.count("sim-1: acs: 0000:70:0") == 2, failed.stderr
    assert env_file.read_text().splitlines()[-1] == pairs
    assert run("remove").returncode == 0 and not env_file.exists()
    assert run("remove").returncode == 0, "idempotent"
    assert run("reset").returncode == 2


def test_the_plan_gives_ranks_their_nic_through_the_step_and_the_units():
    stack = load_file(stack_file("prod-b300")).config
    p = plan(stack)
    for h in p.hosts:
        steps = list(hostplan.host_steps(stack, p, h, stack_name="prod-b300").steps)
        assert steps.index("rdma") < steps.index("nic-affinity") < steps.index("ucx-env") < steps.index("vllm-placement")
        ucx = nixl.ucx_env(stack, h.name)
        assert "\nUCX_NET_DEVICES=" not in ucx and "VLLM_NIC_SELECTION_VARS=UCX_NET_DEVICES:1\n" in ucx
        assert "CUDA_DEVICE_ORDER=PCI_BUS_ID\n" in ucx
        for inst in h.instances:
            unit = vllm.vllm_unit(stack, inst)
            assert f"EnvironmentFile={paths.NIC_AFFINITY_ENV}\n" in unit
            assert f"ExecStartPre=+{paths.script(nixl.NIC_AFFINITY)} check\n" in unit
    # Turned off: every rank has every compute NIC, as before, and no step writes or checks pairs.
    off = stack.model_copy(update={"nixl": stack.nixl.model_copy(update={"nic_per_rank": False})})
    h = p.hosts[0]
    assert "nic-affinity" not in hostplan.host_steps(off, p, h, stack_name="prod-b300").steps
    assert f"UCX_NET_DEVICES={','.join(n + ':1' for n in off.host(h.name).compute_nics)}\n" in nixl.ucx_env(off, h.name)
    assert paths.NIC_AFFINITY_ENV not in vllm.vllm_unit(off, h.instances[0])


def test_the_inbox_rdma_stack_cannot_give_nics_their_pci_addresses():
    stack = load_file(stack_file("prod-b300")).config
    inbox = stack.model_copy(update={"rdma": stack.rdma.model_copy(update={"stack": "inbox"})})
    problems = [p for p in validate.check(inbox, capacity=False) if p.path == "glm-infra:nixl.nicPerRank"]
    assert len(problems) == 1 and "needs rdma.stack doca-ofed: ibdev2netdev -v" in problems[0].message
    off = inbox.model_copy(update={"nixl": inbox.nixl.model_copy(update={"nic_per_rank": False})})
    assert not [p for p in validate.check(off, capacity=False) if p.path == "glm-infra:nixl.nicPerRank"]


def test_the_stack_key_takes_only_topology_levels(tmp_path):
    from glm_infra.spec.platform import NixlConfig
    assert NixlConfig().max_nic_distance == "PXB" and NixlConfig().nic_per_rank is True
    with pytest.raises(ValueError, match="PIX"):
        NixlConfig.model_validate({"maxNicDistance": "NEAR"})


def test_the_script_is_the_one_the_step_installs():
    stack = load_file(stack_file("sim")).config
    script = nixl.nic_affinity_script(stack, "sim-1")
    assert f"--env-file \"$env_file\"" in script and paths.NIC_AFFINITY_ENV in script and paths.HOSTCHECK in script
    assert "\nnics=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7\n" in script
    assert Path(paths.NIC_AFFINITY_ENV).parent == Path(paths.ETC)


def test_with_disable_acs_the_step_turns_it_off_at_every_boot_and_the_units_wait_for_it():
    stack = load_file(stack_file("prod-b300")).config
    on = stack.model_copy(update={"rdma": stack.rdma.model_copy(update={"disable_acs": True})})
    h = plan(on).hosts[0]
    script = nixl.nic_affinity_script(on, h.name)
    assert "--acs disable)" in script and "systemctl enable --quiet" in script
    assert f"ExecStart={paths.script(nixl.NIC_AFFINITY)} boot\n" in script
    assert "--acs check)" in nixl.nic_affinity_script(stack, h.name)
    assert "\nExecStart=" not in nixl.nic_affinity_script(stack, h.name), "off: no boot unit"
    unit = vllm.vllm_unit(on, h.instances[0])
    assert f"Wants={nixl.ACS_UNIT}\nAfter={nixl.ACS_UNIT}\n" in unit
    assert nixl.ACS_UNIT not in vllm.vllm_unit(stack, h.instances[0])
