"""The P/D router: vllm-router on loopback and the nginx front that owns the public port (API keys, TLS:
generated or the stack's own), with their units and secrets."""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass

from glm_infra.agent import canary as canary_agent
from glm_infra.plan.topology import Plan
from glm_infra.render import canary_source, render_template, systemd_quote
from glm_infra.spec import paths
from glm_infra.spec.config import API_KEY_MAX, StackConfig
from glm_infra.spec.paths import FRONT_CONF, FRONT_KEYS, ROUTER_SECRETS
from glm_infra.steps import TRIGGERS_TOKEN, ScriptStep, Step, digest, file_step

from . import ha

CANARY_SCRIPT = "glm-canary"  # the canary step's script, under paths.LIBEXEC
CANARY_SERVICE = "glm-canary.service"
CANARY_TIMER = "glm-canary.timer"
CANARY_ROUTER_TARGET = "router"  # the canary through the router (the P→D path): no gate, alerted on

ROUTER_START_TIMEOUT_S = 300


# A generated front certificate: valid this long (the most browsers accept), issued again by the next up
# that runs the TLS step within TLS_RENEW_DAYS of its end (glm-infra doctor reports it before then).
TLS_VALID_DAYS = 397


TLS_RENEW_DAYS = 30


TLS_CA_DAYS = 3650


@dataclass(frozen=True)
class PublicRoute:
    """A route the public front passes to vllm-router: its exact path, the methods it takes, whether it
    wants the API key, and why clients need it."""

    path: str
    methods: tuple[str, ...]
    api_key: bool
    why: str


# The front's allowlist: the OpenAI-compatible API of the served model, and the probe. vllm-router serves its
# admin API on the same port without a credential and sends any other POST on to the workers (spec/pins.py
# ROUTER_ROUTES, ROUTER_FALLBACK): nginx matches each path exactly (on the URI it normalized: %-decoded, dot
# segments resolved, slashes merged) and sends the router that path, never the client's URI nor its query;
# every other path is 404 before any key check, so the answer tells nothing about the key. What is left out
# and why: docs/DEPLOYING.md, "What the public port serves".
PUBLIC_ROUTES: tuple[PublicRoute, ...] = (
    PublicRoute("/v1/chat/completions", ("POST",), True,
                "the chat API: what clients, the demo and the SLA gate (AIPerf's chat endpoint) send"),
    PublicRoute("/v1/completions", ("POST",), True, "the text completions API of the same model"),
    PublicRoute("/v1/models", ("GET",), True,
                "the served model's name (`model.servedModelName`), which OpenAI clients list"),
    PublicRoute("/health", ("GET",), False,
                "200 while every worker is healthy, else 503: the front step's and load balancers' probe"),
)
_PLAIN_PATH = re.compile(r"/[a-z0-9_][a-z0-9_./-]*")  # nothing nginx would read in a return text or a location


def public_routes_table() -> str:
    """PUBLIC_ROUTES as the Markdown table docs/DEPLOYING.md shows (tests/test_front_door.py compares them)."""
    rows = ["| method | path | API key | what for |", "| --- | --- | --- | --- |"]
    rows += [f"| {', '.join(r.methods)} | `{r.path}` | {'yes' if r.api_key else 'no'} | {r.why} |"
             for r in PUBLIC_ROUTES]
    return "\n".join(rows) + "\n"


def not_served_message() -> str:
    """The 404 body's text: the path is not served, and what is."""
    served = ", ".join(f"{'|'.join(r.methods)} {r.path}" for r in PUBLIC_ROUTES)
    return f"not found: this path is not served here; the front serves {served}"


def router_args(stack: StackConfig, plan: Plan, host: str | None = None) -> list[str]:
    assert plan.router is not None and stack.router is not None
    r = plan.router
    address = r.own_address(host or r.host)
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
    a += ["--prometheus-host", address, "--prometheus-port", str(stack.router.metrics_port)]
    a += ["--health-check-interval-secs", str(stack.router.health_check_interval)]
    return a


def router_unit(stack: StackConfig, plan: Plan, host: str | None = None) -> str:
    assert plan.router is not None
    host = host or plan.router.host
    return render_template(
        "router.service.j2",
        stack=stack,
        exec_start=systemd_quote(router_args(stack, plan, host)),
        environment_files=[ROUTER_SECRETS],
        local_units=[i.unit for i in plan.instances if i.host == host],
    )


def router_secrets_env(secrets: Mapping[str, str]) -> str:
    return render_template("router-secrets.env.j2", secrets=secrets)


def router_service_script(stack: StackConfig, plan: Plan, host: str | None = None) -> str:
    """Restart the router, gated on its health; with other router hosts, its front passes every request to
    theirs first, and the restart waits until nothing is in flight here (ha.drain_block)."""
    assert plan.router is not None and stack.router is not None
    r = plan.router
    host = host or r.host
    return render_template(
        "service.sh.j2", host=host, unit=r.unit, health_url=f"http://127.0.0.1:{stack.router.internal_port}/health",
        timeout_s=ROUTER_START_TIMEOUT_S, drain_s=0, drain_block=ha.drain_block(stack, plan, host),
    )


def router_front_conf(stack: StackConfig, plan: Plan, host: str | None = None) -> str:
    assert plan.router is not None and stack.router is not None
    host = host or plan.router.host
    listen = list(dict.fromkeys([plan.router.own_address(host), plan.router.address]))
    for route in PUBLIC_ROUTES:  # each goes into a location and a return text as it is
        assert _PLAIN_PATH.fullmatch(route.path) and "/." not in route.path, route.path
        assert route.methods and all(m.isalpha() and m.isupper() for m in route.methods), route.methods
    return render_template(
        "router-front.conf.j2", host=host, r=stack.router, keys_path=FRONT_KEYS,
        routes=PUBLIC_ROUTES, not_served=not_served_message(),
        api_key=stack.router.api_key is not None, listen=[paths.url_host(a) for a in listen], api_key_max=API_KEY_MAX,
        peers=[f"{paths.url_host(p.address)}:{stack.router.port}" for p in plan.router.peers(host)],
        peer_name=tls_names(stack, plan)[0], peer_ca=paths.FRONT_CA if tls_generated(stack) else "",
        drain_dir=paths.FRONT_DRAIN_DIR,
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
    """The names a generated certificate carries: the address clients use first (router.virtualAddress, else
    the router host's), every router host's own address (the fronts reach each other by it), then
    router.tlsNames."""
    assert plan.router is not None and stack.router is not None
    return list(dict.fromkeys([plan.router.address, *(h.address for h in plan.router.hosts), *stack.router.tls_names]))


def subject_alt_names(names: list[str]) -> str:
    """``names`` as an X.509 subjectAltName value (IP:… for addresses, DNS:… for names)."""
    out = []
    for n in names:
        try:
            out.append(f"IP:{ipaddress.ip_address(n)}")
        except ValueError:
            out.append(f"DNS:{n}")
    return ",".join(out)


def router_front_tls_script(stack: StackConfig, plan: Plan, host: str | None = None) -> str:
    assert plan.router is not None
    names = tls_names(stack, plan)
    host = host or plan.router.host
    takes_ca = tls_generated(stack) and host != plan.router.host  # router.host's CA (ha.ca_given_step)
    return render_template(
        "router-front-tls.sh.j2", host=host, ca_given=paths.FRONT_CA_GIVEN if takes_ca else "",
        generated=tls_generated(stack), given=paths.FRONT_TLS_GIVEN,
        san=subject_alt_names(names), common_name=names[0][:64], renew_days=TLS_RENEW_DAYS,
        valid_days=TLS_VALID_DAYS, ca_days=TLS_CA_DAYS,
    )


def router_front_script(stack: StackConfig, plan: Plan, host: str | None = None) -> str:
    """The front on ``host``, checked on that host's own address (the virtual one may be elsewhere)."""
    assert plan.router is not None and stack.router is not None
    host = host or plan.router.host
    return render_template(
        "router-front.sh.j2", host=host,
        public_url=f"https://{paths.url_host(plan.router.own_address(host))}:{stack.router.port}",
        conf_path=FRONT_CONF, keys_path=FRONT_KEYS, generated=tls_generated(stack), gates_conf=paths.GATES_CONF,
        nonlocal_bind=paths.NONLOCAL_BIND_SYSCTL, virtual=plan.router.virtual,
    )


# --- the gates: how the router reaches each instance, and how a failing canary takes it out ----------


def router_gates_conf(stack: StackConfig, plan: Plan, host: str | None = None) -> str:
    assert plan.router is not None
    return render_template("router-gates.conf.j2", host=host or plan.router.host, gates=plan.router.gates,
                           flags=paths.CANARY_FLAGS)


def router_gates_script(stack: StackConfig, plan: Plan, host: str | None = None) -> str:
    assert plan.router is not None
    return render_template("router-gates.sh.j2", host=host or plan.router.host, gates=plan.router.gates,
                           conf_path=paths.GATES_CONF, front_conf=FRONT_CONF)


# --- the canaries -----------------------------------------------------------------------------------


def canary_identity(stack: StackConfig) -> str:
    """What the canaries' answers depend on: the model at its revision and vLLM; a change records every
    reference again. Not the serving flags: the prompt (a count) is answered the same by any setting
    that serves the model correctly, and a flag change that breaks it is what a canary is for."""
    return f"{stack.model.repo}@{stack.model.revision} vllm {stack.runtime.vllm_version}"


CANARY_TRANSITION = "canary-transition"  # the step on the router's host before any instance restarts


def canary_transition_step(stack: StackConfig, plan: Plan, host: str | None = None) -> Step:
    """Before the instances restart onto another identity (a model revision, a vLLM): the canaries' state says
    a change to it is rolling out (canary.py's transition marker), so that an instance already restarted that
    answers otherwise than the old reference is reported but not taken out of rotation; the canary step, after
    every instance has rolled, records the new reference once they agree and the marker goes. Nothing when the
    reference is already of this identity (a step run again)."""
    assert plan.router is not None
    identity = canary_identity(stack)
    state, host = paths.CANARY_STATE, host or plan.router.host
    marker = f"{state}/{canary_agent.TRANSITION}"
    is_current = ("python3 -c 'import json, sys; sys.exit(json.load(open(sys.argv[1])).get(\"identity\") != sys.argv[2])' "
                  f"{shlex.quote(f'{state}/{canary_agent.REFERENCE}')} {shlex.quote(identity)} 2>/dev/null")
    doc = shlex.quote(f'{{"to": {json.dumps(identity)}, "since": ')
    create = (f"install -d -m 0755 {shlex.quote(state)} && if {is_current}; then "
              f"echo {shlex.quote(f'{host}: canary: the reference is already of {identity}')}; else "
              f"printf '%s%s}}\\n' {doc} \"$(date +%s)\" > {shlex.quote(marker + '.tmp')} && "
              f"mv -f {shlex.quote(marker + '.tmp')} {shlex.quote(marker)} && "
              f"echo {shlex.quote(f'{host}: canary: a change to {identity} rolls out: what differs is reported, not taken out of rotation, until every instance has rolled')}; fi")
    return Step(CANARY_TRANSITION, create, f"rm -f {shlex.quote(marker)}", triggers=(identity,))


def canary_targets(stack: StackConfig, plan: Plan) -> str:
    """canary.py's targets file: every instance on its own URL (through no gate), then the router."""
    assert plan.router is not None and stack.router is not None
    spec: dict = {"identity": canary_identity(stack), "model": stack.model.served_model_name}
    if stack.router.api_key is not None:  # the workers' key: vllm-router sends it as OPENAI_API_KEY
        spec.update(api_key_file=ROUTER_SECRETS, api_key_name="OPENAI_API_KEY")
    spec["targets"] = [{"name": g.instance, "role": g.role, "url": g.upstream, "requests": g.requests, "per_rank": True,
                        "gate": True} for g in plan.router.gates]
    spec["targets"].append({"name": CANARY_ROUTER_TARGET, "role": "router",
                            "url": f"http://127.0.0.1:{stack.router.internal_port}",
                            "requests": max(1, len(plan.router.prefill_urls), len(plan.router.decode_urls))})
    return json.dumps(spec, indent=2) + "\n"


def canary_args(stack: StackConfig) -> list[str]:
    assert stack.router is not None
    a = ["/usr/bin/python3", paths.CANARY, "run", "--targets", paths.CANARY_TARGETS, "--state", paths.CANARY_STATE,
         "--flags", paths.CANARY_FLAGS, "--timeout", str(stack.router.canary_timeout)]
    if stack.monitoring.enabled:
        a += ["--metrics", paths.CANARY_METRICS]
    return a


def canary_script(stack: StackConfig, plan: Plan, host: str | None = None) -> str:
    assert plan.router is not None and stack.router is not None
    r = stack.router
    service = render_template("canary.service.j2", timer=CANARY_TIMER, interval=r.canary_interval,
                              model=stack.model.served_model_name, router_unit=plan.router.unit,
                              exec_start=systemd_quote(canary_args(stack)),
                              runtime_directory=paths.CANARY_FLAGS.removeprefix("/run/"), timeout=r.canary_timeout)
    timer = render_template("canary.timer.j2", interval=r.canary_interval)
    return render_template(
        "canary.sh.j2", host=host or plan.router.host, interval=r.canary_interval, timeout=r.canary_timeout,
        service=CANARY_SERVICE, timer=CANARY_TIMER, program=paths.CANARY, targets_path=paths.CANARY_TARGETS,
        state=paths.CANARY_STATE, flags=paths.CANARY_FLAGS, metrics=paths.CANARY_METRICS if stack.monitoring.enabled
        else "", program_source=canary_source(), targets_json=canary_targets(stack, plan), service_unit=service,
        timer_unit=timer,
    )


def router_steps(stack: StackConfig, plan: Plan, secrets: Mapping[str, str], host: str | None = None) -> list[Step]:
    """The router's steps on ``host`` (router.host by default; each router host runs them all)."""
    assert plan.router is not None and stack.router is not None
    r, rt = plan.router, stack.runtime
    host = host or r.host
    unit = router_unit(stack, plan, host)
    front_conf = router_front_conf(stack, plan, host)
    stem = r.unit.removesuffix(".service")
    service = ScriptStep(stem, router_service_script(stack, plan, host), action=f"rollout {TRIGGERS_TOKEN}").step(
        "router-service")
    # vllm-router is its own wheel in the shared venv: a new vllm pin leaves its files alone.
    service = Step(**{**service.__dict__, "triggers": (digest(unit), digest(rt.router_version, rt.venv))})
    tls = ScriptStep("router-front-tls", router_front_tls_script(stack, plan, host)).step("router-front-tls")
    front = ScriptStep("router-front", router_front_script(stack, plan, host)).step("router-front")
    # nginx reads the certificate when it (re)loads: a new one (other names, the stack's own) reloads it.
    front = Step(**{**front.__dict__, "triggers": (digest(front_conf), digest(tls.stdin or ""))})
    gates_conf = router_gates_conf(stack, plan, host)
    gates = ScriptStep("router-gates", router_gates_script(stack, plan, host)).step("router-gates")
    gates = Step(**{**gates.__dict__, "triggers": (digest(gates_conf),)})  # nginx reloads a changed gate
    given = [file_step("router-front-tls-given", paths.FRONT_TLS_GIVEN, router_front_tls_given(secrets),
                       0o600, True, router_front_tls_given)] if not tls_generated(stack) else []
    # Several router hosts with a generated certificate: router.host makes the CA, the others sign with it.
    shared_ca = tls_generated(stack) and len(r.host_names) > 1
    ca = [ha.ca_given_step()] if shared_ca and host != r.host else []
    export = [ha.ca_export_step()] if shared_ca and host == r.host else []
    return [
        file_step("router-secrets", paths.ROUTER_SECRETS, router_secrets_env(secrets), 0o600, True,
                  router_secrets_env),
        file_step("router-gates-conf", paths.GATES_CONF, gates_conf),
        gates,
        file_step("router-unit", paths.unit(r.unit), unit),
        service,
        ScriptStep(CANARY_SCRIPT, canary_script(stack, plan, host)).step("router-canary", timeout="10m"),
        file_step("router-front-conf", paths.FRONT_CONF, front_conf),
        file_step("router-front-keys", paths.FRONT_KEYS, router_front_keys(secrets), 0o600, True,
                  router_front_keys),
        *given,
        *ca,
        tls,
        *export,
        front,
        *ha.vrrp_steps(stack, plan, host),
    ]
