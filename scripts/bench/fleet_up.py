"""First `pulumi up` of a 16-host simulated fleet against a 1-host one (medians over --runs), and
what bounds it on this machine: CPU time of the Pulumi engine, the language host (with the
program), the command provider, the hosts themselves and the machine's package/model servers,
per-step durations from the engine's event log, boot time and memory per idle and deployed host.

    venv/bin/python scripts/bench/fleet_up.py [--hosts 1,16] [--subnet 10.89.0.0/24] [--runs 3]
                                              [--variant cluster,hosts]

Variants differ in data only, never in product code paths:
  cluster  the project's program on `scripts/sim fleet N`'s stack: every host preflight → driver
           install + reboot → health gate → RDMA → NIXL → runtime → weights → one colocated DP8
           instance, the router and monitoring on the first host
  hosts    examples/hosts-only (glm_infra.Hosts: the provisioning alone, no runtime, no vLLM) on
           the same hosts
The fleet's hosts are booted fresh for every run and always brought down again (also on failure).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import _repo  # noqa: F401  (the repository on sys.path)
import yaml

from testbed.bench.common import ROOT, Project, median, parallel_for, sim, sim_config
from testbed.bench.fleet import by_step, events, hosts_only_config, step_durations
from testbed.cluster import DEFAULT_NET, FLEET_NET, SimError, fleet_addresses, host_cgroup, network_home

CG = Path("/sys/fs/cgroup/unified")
TICK = os.sysconf("SC_CLK_TCK")


# --- measuring ------------------------------------------------------------------------------------


def cg_usage(path: Path) -> float:
    """CPU seconds of a cgroup v2 (children included, also those gone)."""
    try:
        for line in (path / "cpu.stat").read_text().splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e6
    except OSError:
        pass
    return 0.0


def cg_procs(path: Path) -> list[int]:
    out: list[int] = []
    for d, _, _ in os.walk(path):
        try:
            out += [int(x) for x in Path(d, "cgroup.procs").read_text().split()]
        except OSError:
            pass
    return out


def proc_cpu(pid: int) -> float:
    """utime + stime of a live process, seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def machine_busy() -> float:
    """CPU seconds the whole machine spent busy (every user of it)."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / TICK


def mem_available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable")


def smaps(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("Rss", "Pss"):
                out[k] = int(v.split()[0])
    except OSError:
        pass
    return out


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def host_memory(cg: Path) -> dict[str, float]:
    """RSS and PSS (MiB) of every process of a simulated host (its cgroup), and of its llm-d-inference-sim ones."""
    out = defaultdict(float)
    for pid in cg_procs(cg):
        m, c = smaps(pid), comm(pid)
        out["rss"] += m.get("Rss", 0) / 1024
        out["pss"] += m.get("Pss", 0) / 1024
        out["procs"] += 1
        if c.startswith("llm-d-inference"):
            out["sim_rss"] += m.get("Rss", 0) / 1024
            out["sim_procs"] += 1
    return dict(out)


def host_cpu_by_unit(cg: Path) -> dict[str, float]:
    """CPU seconds of a simulated host by what ran it, since its last boot: each system service, the
    SSH sessions (the steps' scripts), systemd itself; the rest of the host's total ran before its
    last reboot (preflight, the driver install) or in nspawn and the launcher."""
    root = cg
    out: dict[str, float] = defaultdict(float)
    for d, subdirs, _ in os.walk(root):
        base = os.path.basename(d)
        if base == "system.slice":
            for unit in subdirs:
                out[unit] += cg_usage(Path(d) / unit)
            subdirs.clear()
        elif base in ("user.slice", "init.scope"):
            out["SSH sessions (steps)" if base == "user.slice" else "systemd (init.scope)"] += cg_usage(Path(d))
            subdirs.clear()
    out["before the last boot, nspawn, launcher"] = cg_usage(root) - sum(out.values())
    return dict(out)


def role(c: str) -> str:
    if c == "pulumi":
        return "engine (pulumi)"
    if c.startswith("pulumi-resource"):
        return "provider (command)"
    if c.startswith("pulumi-language") or c.startswith("python"):
        return "language host + program"
    return "other"


class PulumiCpu:
    """CPU of one pulumi command and its plugins: a cgroup of its own (the total, exited processes
    included) and a sampler of its processes (the split by role; a process's last half second may
    be missed: what the split lacks of the total is reported as unattributed)."""

    def __init__(self, tag: str) -> None:
        self.cg = CG / f"glm-bench-{tag}-{os.getpid()}"
        self.cg.mkdir()
        self.seen: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def prefix(self) -> str:
        """Shell words that move the command's shell into the cgroup first."""
        return f"echo $$ > {self.cg}/cgroup.procs; "

    def _sample(self) -> None:
        while not self._stop.wait(0.5):
            for pid in cg_procs(self.cg):
                t = proc_cpu(pid)
                if t:
                    self.seen[pid] = (role(comm(pid)), t)

    def __enter__(self) -> PulumiCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def split(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for r, t in self.seen.values():
            out[r] += t
        total = cg_usage(self.cg)
        out["unattributed"] = max(0.0, total - sum(out.values()))
        out["total"] = total
        return dict(out)

    def remove(self) -> None:
        for pid in cg_procs(self.cg):  # nothing should be left; a stray plugin goes back to the root
            (CG / "cgroup.procs").write_text(str(pid))
        self.cg.rmdir()


# --- the stacks -----------------------------------------------------------------------------------


def project_for(variant: str) -> Project:
    project = Project()
    if variant == "hosts":  # the example's program in place of the project's; its own Pulumi.yaml
        meta = yaml.safe_load((ROOT / "examples/hosts-only/Pulumi.yaml").read_text())
        meta["runtime"]["options"]["virtualenv"] = "venv"
        meta["stackConfigDir"] = "stacks"
        (project.dir / "Pulumi.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
        (project.dir / "__main__.py").write_text((ROOT / "examples/hosts-only/__main__.py").read_text())
    return project


def fleet_stack_file(project: Project, n: int, net: ipaddress.IPv4Network) -> Path:
    """A stack file `sim` boots the hosts from (the cluster stack's hosts are the hosts of both variants)."""
    path = project.dir / f"fleet-{n}h.hosts.yaml"
    path.write_text(yaml.safe_dump({"config": sim_config(n, str(net), "fleet")}, sort_keys=False))
    return path


# --- one run --------------------------------------------------------------------------------------


def one_up(variant: str, n: int, net: ipaddress.IPv4Network, run: int, parallel: int | None = None) -> dict:
    project = project_for(variant)
    hosts = [f"fleet-{i + 1}" for i in range(n)]
    cgs = {h: host_cgroup(CG, network_home(net)[0], h) for h in hosts}  # where the launcher puts each host
    stack = f"fleet-{n}h"
    boot_file = fleet_stack_file(project, n, net)
    result: dict = {"variant": variant, "hosts": n, "run": run, "parallel": parallel}
    cpu = None
    try:
        cfg = sim_config(n, str(net), "fleet") if variant == "cluster" else hosts_only_config(n, net)
        project.write_stack(stack, cfg)
        sim("down", boot_file)  # fresh hosts: overlays are thrown away
        mem0 = mem_available_mib()
        t0 = time.monotonic()
        sim("up", boot_file)
        result["boot_s"] = time.monotonic() - t0
        missing = [str(cg) for cg in cgs.values() if not cg.is_dir()]
        if missing:  # else every figure of the hosts would read as zero
            raise SimError(f"no cgroup for a booted host: {', '.join(missing)} (testbed/cluster.py, LAUNCHER)")
        time.sleep(3)
        result["idle_mem_available_mib_per_host"] = (mem0 - mem_available_mib()) / n
        idle = [host_memory(cgs[h]) for h in hosts]
        result["idle_pss_mib"] = statistics.median(m["pss"] for m in idle)
        result["idle_rss_mib"] = statistics.median(m["rss"] for m in idle)
        project.init(stack)

        run_dir = network_home(net)[0]
        servers = [int((run_dir / f"{s}.pid").read_text()) for s in ("http", "models")]
        hosts_cpu0 = sum(cg_usage(cgs[h]) for h in hosts)
        servers_cpu0 = sum(proc_cpu(p) for p in servers)
        busy0 = machine_busy()
        mem1 = mem_available_mib()
        cpu = PulumiCpu(f"{variant}-{n}-{run}")
        with cpu:
            # What `up` needs (it refuses less); Hosts serves no pool, and each of its hosts may stage the weights.
            result["parallel"] = parallel or (parallel_for(cfg) if variant == "cluster"
                                              else max(n + 1, 4 * (os.cpu_count() or 1)))
            flags = f" --parallel {result['parallel']}" if result["parallel"] else ""
            t_up, p = project.pulumi(f"up -s {stack} --yes --skip-preview --non-interactive --json{flags}",
                                     check=False, pre=cpu.prefix())
        result["up_s"] = t_up
        evs = events(p.stdout)
        if p.returncode != 0:
            diags = [e["diagnosticEvent"]["message"] for e in evs if "diagnosticEvent" in e][-20:]
            raise RuntimeError(f"{variant}, {n} hosts: pulumi up exited {p.returncode}:\n{''.join(diags)[-4000:]}\n"
                               f"{p.stderr[-2000:]}")
        summary = next((e["summaryEvent"] for e in evs if "summaryEvent" in e), {})
        result["resources"] = summary.get("resourceChanges", {}).get("create", 0)
        split = cpu.split()
        hosts_cpu = sum(cg_usage(cgs[h]) for h in hosts) - hosts_cpu0
        servers_cpu = sum(proc_cpu(p) for p in servers) - servers_cpu0
        busy = machine_busy() - busy0
        units: dict[str, float] = defaultdict(float)
        for h in hosts:
            for k, v in host_cpu_by_unit(cgs[h]).items():
                units[k] += v
        result["hosts_cpu_by_unit"] = dict(units)
        result["cpu_s"] = {**split, "hosts": hosts_cpu, "servers (apt, wheels, model mirror)": servers_cpu,
                           "machine busy (everyone)": busy,
                           "others on the machine": max(0.0, busy - split["total"] - hosts_cpu - servers_cpu)}
        result["cpu_of_2_cores"] = busy / (2 * t_up)
        t_idle, c_idle = time.monotonic(), sum(cg_usage(cgs[h]) for h in hosts)
        time.sleep(10)  # deployed and idle: the instance, exporters, Prometheus scraping every 5 s
        result["deployed_idle_cpu_pct_per_host"] = 100 * (sum(cg_usage(cgs[h]) for h in hosts) - c_idle) \
            / (time.monotonic() - t_idle) / n
        deployed = [host_memory(cgs[h]) for h in hosts]
        result["deployed_mem_available_mib_per_host"] = (mem1 - mem_available_mib()) / n + \
            result["idle_mem_available_mib_per_host"]
        result["deployed_first_host"] = deployed[0]
        rest = deployed[1:] or deployed
        result["deployed_pss_mib"] = statistics.median(m["pss"] for m in rest)
        result["deployed_rss_mib"] = statistics.median(m["rss"] for m in rest)
        result["inference_sim_rss_mib"] = statistics.median(m.get("sim_rss", 0) for m in rest)
        result["inference_sim_procs"] = statistics.median(m.get("sim_procs", 0) for m in rest)
        steps = by_step(step_durations(evs), hosts)
        result["steps"] = {k: (statistics.median(v), max(v), len(v)) for k, v in steps.items()}
        print(f"  {variant}, {n} host(s), run {run + 1}: boot {result['boot_s']:.1f}s, first up {t_up:.1f}s "
              f"({result['resources']} created), machine busy {result['cpu_of_2_cores']:.0%} of 2 cores", flush=True)
        return result
    finally:
        if cpu is not None:
            cpu.remove()
        sim("down", boot_file)
        project.cleanup()


# --- report ---------------------------------------------------------------------------------------


def report(results: list[dict], sizes: list[int], variants: list[str], runs: int) -> None:
    print(f"\nmedians over {runs} run(s); a shared 2-core machine: noisy figures; pulumi --parallel "
          f"{results[0]['parallel'] or 'default (4 per CPU)'}"
          + ("; PULUMI_SKIP_CHECKPOINTS=true" if os.environ.get("PULUMI_SKIP_CHECKPOINTS") == "true" else ""))
    print("| variant | hosts | boot | first `pulumi up` | ratio to 1 host | created | machine busy |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for v in variants:
        base = None
        for n in sizes:
            rs = [r for r in results if r["variant"] == v and r["hosts"] == n]
            if not rs:
                continue
            up = median([r["up_s"] for r in rs])
            base = base or up
            print(f"| {v} | {n} | {median([r['boot_s'] for r in rs]):.1f} s | {up:.1f} s | {up / base:.2f} | "
                  f"{rs[0]['resources']} | {median([r['cpu_of_2_cores'] for r in rs]):.0%} of 2 cores |")
    print("\nCPU seconds during the first up (median run)")
    keys = ["engine (pulumi)", "language host + program", "provider (command)", "other", "unattributed", "total",
            "hosts", "servers (apt, wheels, model mirror)", "others on the machine", "machine busy (everyone)"]
    cols = [(v, n) for v in variants for n in sizes if any(r["variant"] == v and r["hosts"] == n for r in results)]
    print("| CPU s | " + " | ".join(f"{v} {n}h" for v, n in cols) + " |")
    print("| --- |" + " --- |" * len(cols))
    for k in keys:
        vals = [median([r["cpu_s"].get(k, 0.0) for r in results if r["variant"] == v and r["hosts"] == n])
                for v, n in cols]
        print(f"| {k} | " + " | ".join(f"{x:.1f}" for x in vals) + " |")
    floors = [median([(r["cpu_s"]["total"] + r["cpu_s"]["hosts"] + r["cpu_s"]["servers (apt, wheels, model mirror)"]) / 2
                      for r in results if r["variant"] == v and r["hosts"] == n]) for v, n in cols]
    print("| CPU floor: (total + hosts + servers) / 2 cores, s | " + " | ".join(f"{x:.1f}" for x in floors) + " |")
    print("\nmemory per host, MiB (median host; deployed: the hosts without the router)")
    print("| | " + " | ".join(f"{v} {n}h" for v, n in cols) + " |")
    print("| --- |" + " --- |" * len(cols))
    for k in ("idle_mem_available_mib_per_host", "idle_pss_mib", "idle_rss_mib", "deployed_mem_available_mib_per_host",
              "deployed_pss_mib", "deployed_rss_mib", "inference_sim_rss_mib", "inference_sim_procs",
              "deployed_idle_cpu_pct_per_host"):
        vals = [median([r[k] for r in results if r["variant"] == v and r["hosts"] == n]) for v, n in cols]
        print(f"| {k} | " + " | ".join(f"{x:.1f}" for x in vals) + " |")
    for v, n in cols:
        r = next(r for r in results if r["variant"] == v and r["hosts"] == n)
        first = r["deployed_first_host"]
        print(f"\n{v} {n}h: fleet-1 (router, monitoring) RSS {first.get('rss', 0):.0f} MiB, PSS {first.get('pss', 0):.0f} MiB;"
              " slowest steps (median / max seconds over hosts, count):")
        for k, (med, mx, cnt) in sorted(r["steps"].items(), key=lambda kv: -kv[1][1])[:12]:
            print(f"  {k:40} {med:6.0f} {mx:6.0f}  ×{cnt}")
        print("  the hosts' CPU seconds by unit, all hosts together (top 10):")
        for k, v in sorted(r["hosts_cpu_by_unit"].items(), key=lambda kv: -kv[1])[:10]:
            print(f"  {k:40} {v:7.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--hosts", default="1,16", help="fleet sizes, comma-separated (the first is the baseline)")
    ap.add_argument("--subnet", default=str(FLEET_NET), help=f"a private /24 of the fleet's own (not {DEFAULT_NET})")
    ap.add_argument("--variant", default="cluster,hosts", help="cluster, hosts or both (comma-separated)")
    ap.add_argument("--parallel", type=int, help="pulumi up --parallel (default: pulumi's, 4 per CPU; for the cluster "
                    "variant at least what the stack needs, testbed.bench.common.parallel_for)")
    ap.add_argument("--json", metavar="FILE", help="also write every run's figures here")
    args = ap.parse_args()
    net = ipaddress.ip_network(args.subnet)
    sizes = [int(x) for x in args.hosts.split(",")]
    variants = args.variant.split(",")
    for n in sizes:
        try:
            fleet_addresses(n, net)  # refuses a size or subnet that cannot hold it, before anything boots
        except SimError as e:
            ap.error(str(e))
    if net == DEFAULT_NET:
        ap.error(f"{DEFAULT_NET} is the sim stack's and the end-to-end suite's: give the fleet a /24 of its own")
    results = []
    for v in variants:
        for n in sizes:
            for run in range(args.runs):
                results.append(one_up(v, n, net, run, args.parallel))
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=1))
    report(results, sizes, variants, args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
