"""Several router hosts behind one address (router.standbyHosts, router.virtualAddress).

Each router host runs vllm-router and its front, hot. keepalived (the distribution's package) holds the
virtual address on one of them: VRRP, unicast between the router hosts' own addresses (no multicast on
the fabric), ``nopreempt`` (the address stays where it is when a host comes back: moving it resets every
connection in flight there). Its check (``router-vrrp-check``) fails while the host's front or router does
not answer, so the address moves within seconds of a host, a front or a router dying.

A change to the router restarts one router host at a time (``RouterPlan.roll_order``).
Moving the address would reset the connections in flight, so a restart never moves it: the front of the
host first passes every new request to another router host's front (a drain file it includes, then an nginx
reload), the restart waits until nginx's old workers have finished what they had in flight, and the front
takes its own router back once it is healthy. The check counts a router that is down while its front is
drained as serving, for as long as a restart may take (``DRAIN_MAX_S``): a drain left behind by a killed
step does not hold the address.

The fronts reach each other over TLS on their own addresses, checked against the front's CA; a generated
certificate's CA is made once on router.host and given to the others (``router-ca-export``: a secret)."""

from __future__ import annotations

import shlex

from glm_infra.plan.topology import Plan
from glm_infra.render import render_template
from glm_infra.spec import paths
from glm_infra.spec.config import StackConfig
from glm_infra.steps import ScriptStep, Step

DRAIN_TIMEOUT_S = 300  # the longest a restart waits for the requests in flight on the router it stops
DRAIN_MAX_S = DRAIN_TIMEOUT_S + 300 + 60  # …plus the router's start (ROUTER_START_TIMEOUT_S): then a drain is stale
FRONT_PROBE = "/glm-infra-vrrp-probe"  # a path no front serves: its own 404 says it answers TLS, no router asked
PEER_HEADER = "X-Glm-Infra-Peer"  # a request one front passes to another: never passed on again
VRRP_CHECK = paths.script("router-vrrp-check")
VRRP_NOTIFY = paths.script("router-vrrp-notify")
VRRP_METRICS = f"{paths.NODE_EXPORTER_TEXTFILES}/glm-router-vrrp.prom"
CA_EXPORT = "router-ca-export"  # on router.host: the generated CA, a secret the other router hosts take
CA_GIVEN = "router-front-ca-given"  # on the others: that CA, written before their TLS step
# What the review tree shows as CA_GIVEN's stdin: the CA exists only once router.host's TLS step has made it.
CA_REVIEWED = "# router.host's CA (certificate and key), read by its router-ca-export step when pulumi up runs\n"


def _tls_curl(stack: StackConfig) -> str:
    """How a front is asked: against glm-infra's CA, or (the stack's own certificate, checked by its TLS step,
    may name only what clients use) without a check of the name."""
    assert stack.router is not None
    return f"--cacert {shlex.quote(paths.FRONT_CA)}" if stack.router.tls_certificate is None else "--insecure"


def front_health(stack: StackConfig, address: str) -> str:
    assert stack.router is not None
    return f"https://{paths.url_host(address)}:{stack.router.port}/health"


def drain_block(stack: StackConfig, plan: Plan, host: str) -> str:
    """The bash functions the router's service step runs around a restart (empty: one router host)."""
    assert plan.router is not None and stack.router is not None
    peers = plan.router.peers(host)
    if not peers:
        return ""
    return render_template(
        "_router_drain.sh.j2", drain_file=paths.FRONT_DRAIN, drain_dir=paths.FRONT_DRAIN_DIR,
        front_conf=paths.FRONT_CONF, timeout_s=DRAIN_TIMEOUT_S, tls=_tls_curl(stack), header=PEER_HEADER,
        peer_health=[front_health(stack, p.address) for p in peers],
    )


def vrrp_steps(stack: StackConfig, plan: Plan, host: str) -> list[Step]:
    """keepalived on ``host``, after its front (its check asks the front); nothing without a virtual address."""
    assert plan.router is not None and stack.router is not None
    r = plan.router
    if not r.virtual:
        return []
    me = r.on(host)
    script = render_template(
        "router-vrrp.sh.j2", host=host, own=me.address, vip=r.address, peers=[p.address for p in r.peers(host)],
        priority=me.priority, router_id=stack.router.vrrp_router_id, conf=paths.KEEPALIVED_CONF,
        check=VRRP_CHECK, notify=VRRP_NOTIFY, state=paths.VRRP_STATE,
        metrics=VRRP_METRICS if stack.monitoring.enabled else "",
        own_probe=f"https://{paths.url_host(me.address)}:{stack.router.port}{FRONT_PROBE}",
        vip_health=front_health(stack, r.address), tls=_tls_curl(stack), drain_file=paths.FRONT_DRAIN,
        drain_max_s=DRAIN_MAX_S, router_liveness=f"http://127.0.0.1:{stack.router.internal_port}/liveness",
        textfiles=paths.NODE_EXPORTER_TEXTFILES,
    )
    return [ScriptStep("router-vrrp", script).step("router-vrrp", timeout="10m")]


def ca_export_step() -> Step:
    """On router.host, after its TLS step: the generated CA's certificate and key (stdout, a secret)."""
    files = " ".join(shlex.quote(p) for p in (paths.FRONT_CA, paths.FRONT_CA_KEY))
    return Step(CA_EXPORT, f"cat {files}", secret=True, secret_output=True)


def ca_given_step() -> Step:
    """On the other router hosts: router.host's CA (stdin), which their TLS step signs with."""
    q = shlex.quote(paths.FRONT_CA_GIVEN)
    d = shlex.quote(paths.FRONT_CA_GIVEN.rsplit("/", 1)[0])
    create = (f"set -e; umask 077; mkdir -p {d}; tmp=$(mktemp {q}.XXXXXX); cat > \"$tmp\"; "
              f"if cmp -s \"$tmp\" {q}; then rm -f \"$tmp\"; echo unchanged {q}; else mv -f \"$tmp\" {q}; echo wrote {q}; fi")
    return Step(CA_GIVEN, create, f"rm -f {q}", stdin=CA_REVIEWED, secret=True)
