"""Preflight: hostcheck.py installed on the host and its preflight run before anything changes (facts on
stdout, what rules the host out on stderr); the host's facts after provisioning."""

from __future__ import annotations

from glm_infra import render
from glm_infra.plan.topology import HostPlan
from glm_infra.spec import paths
from glm_infra.spec.config import StackConfig
from glm_infra.steps import RenderedFile, Step, command, digest


def preflight_step(stack: StackConfig, h: HostPlan) -> Step:
    """Install hostcheck.py and run its preflight: facts on stdout, what rules the host out on stderr."""
    hc = stack.host(h.name)
    source = render.hostcheck_source()
    argv = [paths.HOSTCHECK, "preflight", "--host", h.name, "--min-kernel", stack.preflight.min_kernel,
            "--gpus", str(hc.gpus), "--gpu-model", hc.gpu_model]
    for os_id in stack.preflight.allowed_os:
        argv += ["--allowed-os", os_id]
    if stack.drivers.mode == "verify":
        argv.append("--require-driver")
    if h.provisioned:
        argv += ["--model-path", stack.model.path]
        if stack.preflight.min_free_disk_gb is not None:
            argv += ["--min-free-gb", f"{stack.preflight.min_free_disk_gb:g}"]
    create = f"install -D -m 0755 /dev/stdin {paths.HOSTCHECK} && {command(*argv)}"
    return Step("preflight", create, f"rm -f {paths.HOSTCHECK}", source, (digest(source),),
                files=(RenderedFile(paths.HOSTCHECK, source, 0o755),), check=f"{command(*argv)} >/dev/null")


def facts_step(stack: StackConfig, h: HostPlan) -> Step:
    argv = [paths.HOSTCHECK, "facts"] + (["--model-path", stack.model.path] if h.provisioned else [])
    return Step("facts", command(*argv))
