"""Rendering of everything that lands on a host: systemd units, environment files, host scripts.

Pure and deterministic: the same stack gives byte-identical files. Secret values are never part of
what this module renders for review; secret files are rendered from a ``secrets`` mapping that the
offline CLI fills with placeholders and the Pulumi program fills inside ``Output.apply``.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from collections.abc import Mapping
from pathlib import Path

import jinja2

from .agent import hostcheck
from .plan.topology import KV_ROLE, Instance, Plan, pool_of
from .spec import paths
from .spec.config import API_KEY_MAX, SECRETS, StackConfig, dump_json, snake
from .spec.paths import (  # noqa: F401  (re-exported: where things land, for callers of render)
    FRONT_CONF,
    FRONT_KEYS,
    HF_SECRETS,
    HOSTCHECK,
    ROUTER_SECRETS,
    SECRETS_DIR,
    UCX_ENV,
    UNIT_DIR,
    VLLM_SECRETS,
    WEIGHTS,
)
from .steps import RenderedFile, ScriptStep, Step, digest

TEMPLATES = Path(__file__).parent / "templates"
HOST_PROGRAMS = Path(__file__).resolve().parent / "agent"
# How long a (re)started instance may take to answer /health: loading ~465 GB and compiling graphs.
SERVICE_START_TIMEOUT_S = 3600
ROUTER_START_TIMEOUT_S = 300
# A generated front certificate: valid this long (the most browsers accept), issued again by the next up
# that runs the TLS step within TLS_RENEW_DAYS of its end (glm-infra doctor reports it before then).
TLS_VALID_DAYS = 397
TLS_RENEW_DAYS = 30
TLS_CA_DAYS = 3650


def configured_secrets(stack: StackConfig) -> dict[str, str]:
    """The secrets this stack sets that reach hosts (all but the SSH key), by template name, mapped
    to their stack key."""
    out = {}
    for name, (top, sub) in SECRETS.items():
        block = getattr(stack, top)
        if name != "private_key" and block is not None and getattr(block, snake(sub)) is not None:
            out[name] = f"glm-infra:{top}.{sub}"
    return out


def placeholders(stack: StackConfig) -> dict[str, str]:
    """What offline rendering writes in place of each secret."""
    return {name: f"<secret {key}>" for name, key in configured_secrets(stack).items()}


def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
        # Bash uses "{#" (${#array[@]}); templates have no Jinja comments.
        comment_start_string="<%#",
        comment_end_string="#%>",
    )
    env.filters["q"] = lambda v: shlex.quote(str(v))  # shell-quote a value for host scripts
    env.globals["paths"] = paths
    return env


_ENV = _env()


def render_template(name: str, **context: object) -> str:
    return _ENV.get_template(name).render(**context)


_SAFE_WORD = re.compile(r"^[A-Za-z0-9_./:=,@+\[\]-]+$")


def systemd_quote(args: list[str]) -> str:
    """Join arguments into an ``ExecStart=`` line that systemd splits back into the same words.

    systemd only honours quotes that wrap a whole word, so ``--flag='{...}'`` must be written as two
    words. Arguments were validated not to hold single quotes, backslashes, '%' or '$'.
    """
    out = []
    for a in args:
        if any(c in a for c in "'\\%$\n"):
            raise ValueError(f"argument cannot be written to a unit: {a!r}")
        out.append(a if _SAFE_WORD.match(a) else f"'{a}'")
    return " ".join(out)


def _fmt_float(v: float) -> str:
    return f"{v:.2f}" if round(v, 2) == v else repr(v)


def vllm_args(stack: StackConfig, inst: Instance) -> list[str]:
    """The complete ``vllm serve`` command of one instance, in the BRIEF recipe's order."""
    m = stack.model
    pool = pool_of(stack, inst.role)
    a = [f"{stack.runtime.venv}/bin/vllm", "serve", m.path]
    if m.trust_remote_code:
        a.append("--trust-remote-code")
    if inst.role in KV_ROLE:
        a += ["--kv-transfer-config", dump_json({"kv_connector": "NixlConnector", "kv_role": KV_ROLE[inst.role]})]
    if m.chat_template_content_format:
        a.append(f"--chat-template-content-format={m.chat_template_content_format}")
    if pool.cudagraph_mode:
        a += ["--compilation-config", dump_json({"cudagraph_mode": pool.cudagraph_mode})]
    if pool.max_num_batched_tokens:
        a += ["--max-num-batched-tokens", str(pool.max_num_batched_tokens)]
    if pool.ep:
        a.append("-ep")
    a += ["-tp", str(pool.tp), "-dp", str(pool.dp)]
    if m.tool_call_parser:
        a += ["--tool-call-parser", m.tool_call_parser]
    if m.enable_auto_tool_choice:
        a.append("--enable-auto-tool-choice")
    if m.reasoning_parser:
        a += ["--reasoning-parser", m.reasoning_parser]
    a += ["--gpu-memory-utilization", _fmt_float(pool.gpu_memory_utilization)]
    if m.kv_cache_dtype:
        a += ["--kv-cache-dtype", m.kv_cache_dtype]
    if m.max_model_len:
        a += ["--max-model-len", str(m.max_model_len)]
    if m.enable_prompt_tokens_details:
        a.append("--enable-prompt-tokens-details")
    if pool.all2all_backend:
        a.append(f"--all2all-backend={pool.all2all_backend}")
    if pool.speculative_tokens > 0:
        spec = {"method": m.speculative_method, "num_speculative_tokens": pool.speculative_tokens}
        a += ["--speculative-config", dump_json(spec)]
    a += ["--shutdown-timeout", str(pool.shutdown_timeout)]
    if m.fingerprint_mode:
        a.append(f"--fingerprint-mode={m.fingerprint_mode}")
    # What a multi-host, multi-instance deployment adds to the recipe.
    a += ["--served-model-name", m.served_model_name]
    a += ["--host", inst.address, "--port", str(inst.http_port)]
    a += ["--data-parallel-rpc-port", str(inst.dp_rpc_port)]
    a += list(pool.extra_args)
    return a


def vllm_environment(stack: StackConfig, inst: Instance) -> list[tuple[str, str]]:
    """Non-secret environment of one instance, as ``Environment=`` lines."""
    pool = pool_of(stack, inst.role)
    env: list[tuple[str, str]] = []
    if pool.model_runner_v2:
        env.append(("VLLM_USE_V2_MODEL_RUNNER", "1"))
    env.append(("CUDA_VISIBLE_DEVICES", inst.cuda_visible_devices))
    if inst.role in KV_ROLE:
        env.append(("VLLM_NIXL_SIDE_CHANNEL_HOST", inst.nixl_host))
        env.append(("VLLM_NIXL_SIDE_CHANNEL_PORT", str(inst.nixl_port_base)))
    env.append(("HOME", f"{stack.runtime.state_dir}/home"))
    env.append(("HF_HUB_OFFLINE", "1"))  # weights are staged by glm-infra; never download at start
    env += sorted(pool.env.items())
    return env


def vllm_unit(stack: StackConfig, inst: Instance) -> str:
    pool = pool_of(stack, inst.role)
    requires = []
    if stack.drivers.fabric_manager:
        requires.append("nvidia-fabricmanager.service")
    requires.append("nvidia-persistenced.service")
    return render_template(
        "vllm.service.j2",
        inst=inst,
        pool=pool,
        stack=stack,
        exec_start=systemd_quote(vllm_args(stack, inst)),
        environment=vllm_environment(stack, inst),
        environment_files=[UCX_ENV, VLLM_SECRETS],
        requires=requires,
        timeout_stop=pool.shutdown_timeout + 30,
        gate=paths.script("health-gate"),
    )


def router_args(stack: StackConfig, plan: Plan) -> list[str]:
    assert plan.router is not None and stack.router is not None
    r = plan.router
    a = [f"{stack.runtime.venv}/bin/vllm-router"]
    if plan.disaggregated:
        a.append("--vllm-pd-disaggregation")
        for url in r.prefill_urls:
            a += ["--prefill", url]
        for url in r.decode_urls:
            a += ["--decode", url]
    else:
        a += ["--worker-urls", *r.worker_urls]
    a += ["--policy", stack.router.policy]
    # Loopback only: the nginx front owns the public port.
    a += ["--host", "127.0.0.1", "--port", str(stack.router.internal_port)]
    a += ["--prometheus-host", r.address, "--prometheus-port", str(stack.router.metrics_port)]
    a += ["--health-check-interval-secs", str(stack.router.health_check_interval)]
    return a


def router_unit(stack: StackConfig, plan: Plan) -> str:
    return render_template(
        "router.service.j2",
        stack=stack,
        exec_start=systemd_quote(router_args(stack, plan)),
        environment_files=[ROUTER_SECRETS],
        local_units=[i.unit for i in plan.instances if i.host == plan.router.host],
    )


def ucx_env(stack: StackConfig, host_name: str) -> str:
    host = stack.host(host_name)
    return render_template("ucx.env.j2", host=host, rdma=stack.rdma, nixl=stack.nixl)


def vllm_secrets_env(secrets: Mapping[str, str]) -> str:
    return render_template("vllm-secrets.env.j2", secrets=secrets)


def router_secrets_env(secrets: Mapping[str, str]) -> str:
    return render_template("router-secrets.env.j2", secrets=secrets)


def hf_secrets_env(secrets: Mapping[str, str]) -> str:
    return render_template("hf-secrets.env.j2", secrets=secrets)


def alertmanager_webhook(secrets: Mapping[str, str]) -> str:
    """The file Alertmanager's webhook URL is read from (its whole content is the URL)."""
    return secrets["webhook_url"]


# --- host scripts: one function each, used by the components and by offline render --------------


def hostcheck_source() -> str:
    return (HOST_PROGRAMS / "hostcheck.py").read_text()


def weights_source() -> str:
    return (HOST_PROGRAMS / "weights.py").read_text()


def drivers_script(stack: StackConfig, host: str) -> str:
    m = stack.monitoring  # the DCGM exporter's unit wants DCGM's host engine (monitoring.dcgm_hosts)
    exporter = m.enabled and m.dcgm_exporter_package is not None and stack.drivers.mode == "install"
    return render_template("drivers.sh.j2", host=host, d=stack.drivers, p=stack.drivers.package_set(exporter))


def reboot_script(host: str) -> str:
    return render_template("reboot.sh.j2", host=host)


def back_script(host: str) -> str:
    return render_template("back.sh.j2", host=host)


def waitboot_script(stack: StackConfig, host: str) -> str:
    h = stack.host(host)
    # Going down takes as long as the slowest unit's stop: a draining instance's TimeoutStopSec, and some.
    drain = max((pool.shutdown_timeout + 30 for _, pool in stack.pools()), default=0)
    return render_template(
        "waitboot.sh.j2", host=host, address=h.address, port=h.ssh_port, timeout_s=stack.drivers.reboot_timeout,
        down_timeout_s=drain + 120,
    )


def health_script(stack: StackConfig, host: str) -> str:
    h = stack.host(host)
    return render_template(
        "fabric.sh.j2",
        host=host,
        hostcheck=HOSTCHECK,
        gpus=h.gpus,
        gpu_model=h.gpu_model,
        driver=stack.drivers.version,
        fabric=stack.drivers.fabric_manager,
        nvlinks=h.nvlinks,
        dcgm_level=stack.drivers.dcgm_diag_level,
        timeout_s=stack.drivers.fabric_timeout,
        limits=hostcheck.gate_limits(stack.drivers.fabric_manager, stack.drivers.dcgm_diag_level),
    )


def rdma_script(stack: StackConfig, host: str) -> str:
    return render_template(
        "rdma.sh.j2", host=host, r=stack.rdma, nics=stack.host(host).compute_nics, hostcheck=HOSTCHECK
    )


def runtime_script(stack: StackConfig, host: str) -> str:
    return render_template("runtime.sh.j2", host=host, rt=stack.runtime)


def vllm_service_script(stack: StackConfig, inst: Instance) -> str:
    return render_template(
        "service.sh.j2",
        host=inst.host,
        unit=inst.unit,
        health_url=f"{inst.url}/health",
        timeout_s=SERVICE_START_TIMEOUT_S,
        drain_s=pool_of(stack, inst.role).shutdown_timeout,
    )


def router_service_script(stack: StackConfig, plan: Plan) -> str:
    assert plan.router is not None and stack.router is not None
    r = plan.router
    return render_template(
        "service.sh.j2", host=r.host, unit=r.unit, health_url=f"http://127.0.0.1:{stack.router.internal_port}/health",
        timeout_s=ROUTER_START_TIMEOUT_S, drain_s=0,
    )


def roll_script(stack: StackConfig, plan: Plan, host: str, pools: list[tuple[str, int]], bounds: Mapping[str, int]) -> str:
    """roll.sh of ``host``: drain and return its instances around a disruptive change (hostplan.roll_steps)."""
    mine = [i for i in plan.instances if i.host == host]
    roles = {p for p, _ in pools}
    others = [(i.role, i.host, i.url) for i in plan.instances if i.host != host and i.role in roles]
    metrics = ""
    if plan.router is not None and stack.router is not None:
        metrics = f"http://{paths.url_host(plan.router.address)}:{stack.router.metrics_port}/metrics"
    return render_template("roll.sh.j2", host=host, instances=mine, metrics_url=metrics, pools=pools, others=others,
                           **bounds)


def lease_script(host: str, folder: str, pools: list[tuple[str, int]], wait_s: int) -> str:
    """lease.sh of ``host``: its turn in its pools' roll, on the machine running pulumi."""
    return render_template("lease.sh.j2", host=host, folder=folder, pools=pools, wait_s=wait_s)


def router_front_conf(stack: StackConfig, plan: Plan) -> str:
    assert plan.router is not None and stack.router is not None
    address = plan.router.address
    return render_template(
        "router-front.conf.j2", host=plan.router.host, r=stack.router, keys_path=FRONT_KEYS,
        api_key=stack.router.api_key is not None, listen=paths.url_host(address), api_key_max=API_KEY_MAX,
        map_bucket=1 << (len("Bearer ") + API_KEY_MAX + 16).bit_length(),
        cert=paths.FRONT_CERT, key=paths.FRONT_KEY,
    )


def router_front_keys(secrets: Mapping[str, str]) -> str:
    return render_template("router-front-keys.conf.j2", secrets=secrets)


def router_front_tls_given(secrets: Mapping[str, str]) -> str:
    """The certificate (chain) and key the stack gives, as one PEM file (the TLS step splits it)."""
    return f"{secrets['router_tls_certificate'].strip()}\n{secrets['router_tls_key'].strip()}\n"


def tls_generated(stack: StackConfig) -> bool:
    """Whether glm-infra makes the front's certificate (the stack gives none)."""
    return stack.router is not None and stack.router.tls_certificate is None


def tls_names(stack: StackConfig, plan: Plan) -> list[str]:
    """The names a generated certificate carries: the router host's address first, then router.tlsNames."""
    assert plan.router is not None and stack.router is not None
    return list(dict.fromkeys([plan.router.address, *stack.router.tls_names]))


def subject_alt_names(names: list[str]) -> str:
    """``names`` as an X.509 subjectAltName value (IP:… for addresses, DNS:… for names)."""
    out = []
    for n in names:
        try:
            out.append(f"IP:{ipaddress.ip_address(n)}")
        except ValueError:
            out.append(f"DNS:{n}")
    return ",".join(out)


def router_front_tls_script(stack: StackConfig, plan: Plan) -> str:
    assert plan.router is not None
    names = tls_names(stack, plan)
    return render_template(
        "router-front-tls.sh.j2", host=plan.router.host, generated=tls_generated(stack), given=paths.FRONT_TLS_GIVEN,
        san=subject_alt_names(names), common_name=names[0][:64], renew_days=TLS_RENEW_DAYS,
        valid_days=TLS_VALID_DAYS, ca_days=TLS_CA_DAYS,
    )


def router_front_script(stack: StackConfig, plan: Plan) -> str:
    assert plan.router is not None
    return render_template(
        "router-front.sh.j2", host=plan.router.host, public_url=plan.router.url, conf_path=FRONT_CONF,
        keys_path=FRONT_KEYS, generated=tls_generated(stack),
    )


# --- a service of a package, on glm-infra's files (the monitoring, the firewall) ---------------------

PACKAGE_SERVICE_WAIT_S = 60
_SYSTEM_DIRS = {"/etc", "/etc/default", paths.UNIT_DIR}  # never removed, even if empty


def package_service_step(key: str, what: str, host: str, packages: list[str], units: list[str], urls: list[str],
                         files: list[RenderedFile], config_check: str = "", runtime_digest: tuple[str, ...] = (),
                         live_check: str = "", reload: bool = False) -> Step:
    """A step that installs ``packages`` if missing, writes ``files`` (embedded in its script, so its
    check sees a hand edit), (re)starts ``units`` when they changed and waits for ``urls``;
    ``live_check``: a command that must also succeed once they run (failing before, it (re)starts
    them too); ``reload``: reload active units instead of restarting them (units others require)."""
    for f in files:
        assert f.content.endswith("\n") and "GLM_INFRA_FILE_END" not in f.content, f.path
    script = render_template(
        "package-service.sh.j2", step_name=key, what=what, host=host, packages=packages,
        services=[u.removesuffix(".service") for u in units], urls=urls, files=files,
        config_check=config_check, wait_seconds=PACKAGE_SERVICE_WAIT_S, runtime_digest=runtime_digest,
        live_check=live_check, restart="reload-or-restart" if reload else "restart",
        config_digest=digest(*packages, *(f"{f.path}\0{f.mode:o}\0{f.content}" for f in files)),
        dirs=sorted({f.path.rsplit("/", 1)[0] for f in files} - _SYSTEM_DIRS, key=lambda d: (-d.count("/"), d)),
    )
    step = ScriptStep(key, script).step(key, timeout="20m")
    return Step(**{**step.__dict__, "files": (*step.files, *files)})
