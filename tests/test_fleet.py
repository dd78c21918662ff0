"""`scripts/sim fleet N`: a generated stack of N simulated hosts on a /24 of its own, and the
benchmark's helpers around it (testbed/bench, for scripts/bench/fleet_up.py). Fast: nothing boots."""

from __future__ import annotations

import ipaddress
import subprocess

import pytest
import yaml
from conftest import ROOT

from testbed import cluster
from testbed.bench import common
from testbed.bench import fleet as bench_fleet

SIM = ROOT / "scripts" / "sim"
GLM = ROOT / "venv" / "bin" / "glm-infra"


def fleet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SIM), "fleet", *args], capture_output=True, text=True, timeout=120)


def test_a_generated_fleet_validates_with_n_hosts_on_its_subnet(tmp_path):
    out = tmp_path / "Pulumi.fleet.yaml"
    p = fleet("16", "--subnet", "10.89.0.0/24", "--out", str(out))
    assert p.returncode == 0, p.stderr
    v = subprocess.run([str(GLM), "validate", str(out)], capture_output=True, text=True, timeout=120)
    assert v.returncode == 0, v.stdout + v.stderr
    assert "16 hosts, 16 vLLM instances" in v.stdout
    text = out.read_text()
    cfg = yaml.safe_load(text)["config"]
    hosts = cfg["glm-infra:hosts"]
    assert [h["name"] for h in hosts] == [f"fleet-{i}" for i in range(1, 17)]
    addresses = [h["address"] for h in hosts]
    assert len(set(addresses)) == 16
    net = ipaddress.ip_network("10.89.0.0/24")
    assert all(ipaddress.ip_address(a) in net and a != "10.89.0.1" for a in addresses)
    assert cfg["glm-infra:colocated"]["hosts"] == [h["name"] for h in hosts]
    assert cfg["glm-infra:router"]["host"] == "fleet-1"
    # Everything the hosts fetch from the machine comes from the fleet's own bridge address.
    assert "10.88." not in text
    assert cfg["glm-infra:drivers"]["aptRepository"] == "http://10.89.0.1:8088/apt/"
    assert cfg["glm-infra:runtime"]["findLinks"] == "http://10.89.0.1:8088/wheels/"
    assert cfg["glm-infra:model"]["mirrorUrl"] == "http://10.89.0.1:8089/GLM-5.2-NVFP4"
    assert cfg["glm-infra:router"]["allowedCidrs"] == ["10.89.0.1/32"]
    # The sim stack's secrets stay readable with its passphrase: the same salt.
    assert yaml.safe_load(text)["encryptionsalt"] == yaml.safe_load((ROOT / "stacks/Pulumi.sim.yaml").read_text())[
        "encryptionsalt"]
    # sim reads the file as a cluster of its own (bridge and run folder of the subnet).
    hs, gateway = cluster.hosts_of(str(out))
    assert [h.address for h in hs] == addresses and str(gateway) == "10.89.0.1/24"


@pytest.mark.parametrize("args, message", [
    (["245"], "245 hosts do not fit 10.89.0.0/24: its host addresses .11–.254 hold 1 to 244"),
    (["0"], "0 hosts do not fit"),
    (["4", "--subnet", "8.8.8.0/24"], "8.8.8.0/24 is not a private network"),
    (["4", "--subnet", "10.89.0.0/16"], "10.89.0.0/16: a simulated cluster lives on one /24"),
    (["4", "--subnet", "10.89.0.7/24"], "--subnet 10.89.0.7/24: 10.89.0.7/24 has host bits set"),
])
def test_a_fleet_that_cannot_be_is_refused_with_a_clear_message(tmp_path, args, message):
    out = tmp_path / "f.yaml"
    p = fleet(*args, "--out", str(out))
    assert p.returncode == 1
    assert message in p.stderr, p.stderr
    assert not out.exists()


def test_the_largest_fleet_fills_the_subnet_to_254():
    cfg = cluster.fleet_config(244, ipaddress.ip_network("10.89.0.0/24"))["config"]
    assert cfg["glm-infra:hosts"][-1]["address"] == "10.89.0.254"


def test_clusters_on_different_subnets_never_share_bridge_or_run_folder():
    homes = {cluster.network_home(ipaddress.ip_network(n)) for n in ("10.89.0.0/24", "10.90.0.0/24", "10.89.1.0/24",
                                                                      "192.168.89.0/24")}
    assert len({run for run, _ in homes}) == 4 and len({br for _, br in homes}) == 4
    assert all(len(br) <= 15 for _, br in homes)  # IFNAMSIZ
    assert cluster.network_home(ipaddress.ip_network("10.89.0.0/24")) == (
        cluster.Path("/run/glm-infra-sim-10.89.0"), "br-glmsim0a5900")


def test_the_benchmarks_sim_config_is_the_fleet_generator_on_the_sim_stacks_subnet():
    cfg = common.sim_config(3)
    assert [(h["name"], h["address"]) for h in cfg["glm-infra:hosts"]] == [
        ("sim-1", "10.88.0.11"), ("sim-2", "10.88.0.12"), ("sim-3", "10.88.0.13")]
    assert cfg["glm-infra:colocated"]["hosts"] == ["sim-1", "sim-2", "sim-3"] and "glm-infra:prefill" not in cfg
    assert cfg["glm-infra:router"]["host"] == "sim-1"
    assert cfg["glm-infra:ssh"]["privateKeyPath"].startswith("/")
    big = common.sim_config(16, "10.89.0.0/24", "fleet")
    assert big["glm-infra:hosts"][15] == {**cluster.fleet_config(16)["config"]["glm-infra:hosts"][15]}


def test_the_benchmarks_find_a_host_in_the_cgroup_its_launcher_makes(tmp_path):
    """cluster.host_cgroup names the cgroup as LAUNCHER does (its cg_name line, run here by bash for a host
    folder of a fleet's run folder): a benchmark reading another name reads no process at all."""
    run_folder = cluster.network_home(ipaddress.ip_network("10.89.0.0/24"))[0]
    host_dir = run_folder / "fleet-3"
    line = next(x for x in cluster.LAUNCHER.splitlines() if x.startswith("cg_name="))
    named = subprocess.run(["bash", "-c", f'dir={host_dir}; {line}; echo "$cg_name"'], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert cluster.host_cgroup(tmp_path, run_folder, "fleet-3") == tmp_path / "glm-sim" / named
    assert named == "glm-infra-sim-10.89.0-fleet-3"


def test_fleet_up_groups_step_durations_by_step_across_hosts():
    def ev(kind, name, t, typ="command:remote:Command"):
        return {"timestamp": t, kind: {"metadata": {"urn": f"urn:pulumi:s::p::{typ}::{name}", "type": typ}}}

    evs = [ev("resourcePreEvent", "glm-fleet-1-runtime", 10), ev("resourcePreEvent", "glm-fleet-12-runtime", 11),
           ev("resourcePreEvent", "glm", 0, "glm-infra:index:Cluster"), ev("resOutputsEvent", "glm-fleet-1-runtime", 14),
           ev("resOutputsEvent", "glm-fleet-12-runtime", 30), ev("resOutputsEvent", "glm", 40, "glm-infra:index:Cluster")]
    durations = bench_fleet.step_durations(evs)
    assert durations == {"glm-fleet-1-runtime": 4, "glm-fleet-12-runtime": 19}  # the component is no step
    assert bench_fleet.by_step(durations, ["fleet-1", "fleet-12"]) == {"glm-HOST-runtime": [4, 19]}


def test_the_hosts_only_variant_is_the_examples_stack_on_the_fleet():
    cfg = bench_fleet.hosts_only_config(3, ipaddress.ip_network("10.89.0.0/24"))
    hosts = cfg["glm-example:hosts"]
    assert [(h["name"], h["address"]) for h in hosts["hosts"]] == [
        ("fleet-1", "10.89.0.11"), ("fleet-2", "10.89.0.12"), ("fleet-3", "10.89.0.13")]
    assert "10.88." not in yaml.safe_dump(cfg)
    assert hosts["model"]["mirror_url"] == "http://10.89.0.1:8089/GLM-5.2-NVFP4"
