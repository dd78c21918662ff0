"""The P/D router: vllm-router on loopback and the nginx front that owns the public port (API keys, TLS:
generated or the stack's own), with their units and secrets."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping

from glm_infra.plan.topology import Plan
from glm_infra.render import render_template, systemd_quote
from glm_infra.spec import paths
from glm_infra.spec.config import API_KEY_MAX, StackConfig
from glm_infra.spec.paths import FRONT_CONF, FRONT_KEYS, ROUTER_SECRETS
from glm_infra.steps import TRIGGERS_TOKEN, ScriptStep, Step, digest, file_step

ROUTER_START_TIMEOUT_S = 300


# A generated front certificate: valid this long (the most browsers accept), issued again by the next up
# that runs the TLS step within TLS_RENEW_DAYS of its end (glm-infra doctor reports it before then).
TLS_VALID_DAYS = 397


TLS_RENEW_DAYS = 30


TLS_CA_DAYS = 3650


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


def router_secrets_env(secrets: Mapping[str, str]) -> str:
    return render_template("router-secrets.env.j2", secrets=secrets)


def router_service_script(stack: StackConfig, plan: Plan) -> str:
    assert plan.router is not None and stack.router is not None
    r = plan.router
    return render_template(
        "service.sh.j2", host=r.host, unit=r.unit, health_url=f"http://127.0.0.1:{stack.router.internal_port}/health",
        timeout_s=ROUTER_START_TIMEOUT_S, drain_s=0,
    )


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


def router_steps(stack: StackConfig, plan: Plan, secrets: Mapping[str, str]) -> list[Step]:
    assert plan.router is not None and stack.router is not None
    r, rt = plan.router, stack.runtime
    unit = router_unit(stack, plan)
    front_conf = router_front_conf(stack, plan)
    stem = r.unit.removesuffix(".service")
    service = ScriptStep(stem, router_service_script(stack, plan), action=f"rollout {TRIGGERS_TOKEN}").step(
        "router-service")
    # vllm-router is its own wheel in the shared venv: a new vllm pin leaves its files alone.
    service = Step(**{**service.__dict__, "triggers": (digest(unit), digest(rt.router_version, rt.venv))})
    tls = ScriptStep("router-front-tls", router_front_tls_script(stack, plan)).step("router-front-tls")
    front = ScriptStep("router-front", router_front_script(stack, plan)).step("router-front")
    # nginx reads the certificate when it (re)loads: a new one (other names, the stack's own) reloads it.
    front = Step(**{**front.__dict__, "triggers": (digest(front_conf), digest(tls.stdin or ""))})
    given = [file_step("router-front-tls-given", paths.FRONT_TLS_GIVEN, router_front_tls_given(secrets),
                       0o600, True, router_front_tls_given)] if not tls_generated(stack) else []
    return [
        file_step("router-secrets", paths.ROUTER_SECRETS, router_secrets_env(secrets), 0o600, True,
                  router_secrets_env),
        file_step("router-unit", paths.unit(r.unit), unit),
        service,
        file_step("router-front-conf", paths.FRONT_CONF, front_conf),
        file_step("router-front-keys", paths.FRONT_KEYS, router_front_keys(secrets), 0o600, True,
                  router_front_keys),
        *given,
        tls,
        front,
    ]
