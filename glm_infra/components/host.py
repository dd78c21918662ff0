"""One server reached over SSH: its connection, the host checker and the preflight facts."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
import pulumi
import pulumi_command.remote as remote

from ..render import HOSTCHECK, hostcheck_source
from ..steps import Step, digest, file_step
from .remote_step import run_step


@dataclass
class HostArgs:
    name: str
    """Host name from the stack (b300-1)."""
    address: str
    """Address glm-infra connects to over SSH."""
    user: str
    """SSH user."""
    private_key: pulumi.Input[str]
    """SSH private key (a secret Output)."""
    ssh_port: int = 22
    """SSH port."""
    allowed_os: list[str] = field(default_factory=lambda: ["ubuntu 24.04"])
    """'ID VERSION_ID' values the host may run."""
    min_kernel: str = "5.12"
    """Oldest kernel accepted."""
    gpus: int = 8
    """GPUs the host must show once the driver answers."""
    gpu_model: str = "B300"
    """GPU model the host must show."""
    require_driver: bool = False
    """The driver must already answer (drivers.mode verify)."""
    model_path: str | None = None
    """Where the weights go (free disk there is a fact)."""
    min_free_gb: float | None = None
    """Free (or already staged) space needed at model_path; None: not checked."""
    files: dict[str, tuple[pulumi.Input[str], int, bool]] = field(default_factory=dict)
    """Host-wide files: absolute path → (content, mode, secret)."""


def preflight_step(args: HostArgs) -> Step:
    """Install hostcheck.py and run its preflight: facts on stdout, what rules the host out on stderr."""
    source = hostcheck_source()
    cmd = [HOSTCHECK, "preflight", "--host", args.name, "--min-kernel", args.min_kernel,
           "--gpus", str(args.gpus), "--gpu-model", args.gpu_model]
    for os_id in args.allowed_os:
        cmd += ["--allowed-os", os_id]
    if args.require_driver:
        cmd.append("--require-driver")
    if args.model_path:
        cmd += ["--model-path", args.model_path]
        if args.min_free_gb is not None:
            cmd += ["--min-free-gb", f"{args.min_free_gb:g}"]
    create = f"install -D -m 0755 /dev/stdin {HOSTCHECK} && " + " ".join(shlex.quote(c) for c in cmd)
    return Step("preflight", create, f"rm -f {HOSTCHECK}", source, (digest(source),))


class Host(pulumi.ComponentResource):
    connection: remote.ConnectionArgs
    preflight: remote.Command
    facts: pulumi.Output[dict]
    files: list[remote.Command]

    def __init__(self, name: str, args: HostArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:Host", name, None, opts)
        self._name = name
        self.connection = remote.ConnectionArgs(
            host=args.address,
            port=args.ssh_port,
            user=args.user,
            private_key=args.private_key,
            dial_error_limit=30,
            per_dial_timeout=10,
        )
        self.preflight = run_step(f"{name}-preflight", preflight_step(args), self.connection, self)
        self.facts = self.preflight.stdout.apply(_last_json)
        self.files = []
        for path, (content, mode, secret) in sorted(args.files.items()):
            slug = path.strip("/").replace("/", "-").replace(".", "-")
            step = file_step(slug, path, "", mode=mode, secret=secret)
            self.files.append(
                run_step(f"{name}-{slug}", step, self.connection, self, stdin=content, depends_on=[self.preflight])
            )
        self.address = pulumi.Output.from_input(args.address)
        self._model_path = args.model_path
        self.register_outputs({"address": self.address, "facts": self.facts})

    def read_facts(self, triggers: list[pulumi.Input[str]], depends_on: list[pulumi.Resource]) -> pulumi.Output[dict]:
        """The host's facts read again once ``depends_on`` ran (preflight's are from before the
        driver was installed); re-read whenever a ``triggers`` value changes."""
        cmd = [HOSTCHECK, "facts"] + (["--model-path", self._model_path] if self._model_path else [])
        step = Step("facts", " ".join(shlex.quote(c) for c in cmd))
        read = run_step(f"{self._name}-facts", step, self.connection, self, triggers=triggers, depends_on=depends_on)
        return read.stdout.apply(_last_json)


def _last_json(stdout: str | None) -> dict:
    for line in reversed((stdout or "").splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {}
