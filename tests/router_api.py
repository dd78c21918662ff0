"""What a client may send the router's public front, as the tests drive it (tests/test_front_door.py with the
real vllm-router and nginx on loopback, tests/e2e/test_sim_e2e.py on the simulated cluster): every route the
pinned vllm-router defines (glm_infra.spec.pins.ROUTER_ROUTES) with arguments that do harm if they reach it,
what its fallback passes on to the workers, and URIs that spell a route in other ways."""

from __future__ import annotations

import json
import urllib.parse

from glm_infra.roles.router import PUBLIC_ROUTES
from glm_infra.spec import pins

ALLOWED = {(m, r.path) for r in PUBLIC_ROUTES for m in r.methods}
ALLOWED_PATHS = {r.path for r in PUBLIC_ROUTES}
# A POST to any other path goes through the router to a prefill and a decode worker at that path
# (pins.ROUTER_FALLBACK): vLLM's own admin routes, and one it does not have.
FALLBACK_PATHS = ("/reset_prefix_cache", "/pause", "/sleep", "/scale_elastic_ep", "/v1/load_lora_adapter",
                  "/glm-infra-no-such-route")


def fill(path: str, worker_url: str) -> str:
    """A route's path with its parameters: a registered worker's URL (DELETE takes it out), a response id."""
    return (path.replace("{url}", urllib.parse.quote(worker_url, safe=""))
            .replace("{response_id}", "resp_glm_infra_test"))


def every_route(prefill_url: str, decode_url: str) -> list[tuple[str, str, bytes | None]]:
    """(method, request target, body) for every route of the pinned vllm-router, then a POST to paths only its
    fallback takes. Each admin route is given what makes it act: the URL of a registered worker."""
    query = {"/remove_worker": {"url": prefill_url}, "/add_worker": {"url": decode_url},
             "/finish_session": {"session_id": "s1"}}
    bodies = {"/workers": {"url": decode_url, "worker_type": "decode"}, "/v1/chat/completions": CHAT,
              "/v1/completions": COMPLETION}
    out = []
    for method, path in pins.ROUTER_ROUTES[pins.VLLM_ROUTER]:
        target = fill(path, decode_url)
        if path in query:
            target += "?" + urllib.parse.urlencode(query[path])
        body = json.dumps(bodies.get(path, {"model": MODEL, "prompt": "hi", "input": "hi"})).encode() \
            if method == "POST" else None
        out.append((method, target, body))
    fallback = pins.ROUTER_FALLBACK[pins.VLLM_ROUTER]
    out += [(fallback, p, json.dumps({"model": MODEL}).encode()) for p in FALLBACK_PATHS]
    return out


MODEL = "glm-5.2"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


def path_tricks(prefill_url: str, decode_url: str) -> list[tuple[str, str]]:
    """(method, raw request target): admin routes spelled so that a front matching on the normalized URI but
    passing the client's own may let them through, and allowed routes spelled oddly. The raw targets are sent
    as they are (no client normalizes them)."""
    rm = "remove_worker?" + urllib.parse.urlencode({"url": prefill_url})
    decode = urllib.parse.quote(decode_url, safe="")
    return [
        ("POST", f"/v1/chat/completions/../../{rm}"),
        ("POST", f"/v1/chat/completions/../../../{rm}"),
        ("POST", f"/v1/models/../../{rm}"),
        ("POST", f"/health/../{rm}"),
        ("POST", f"//{rm}"),
        ("POST", f"/./{rm}"),
        ("POST", f"/%72emove_worker?url={urllib.parse.quote(prefill_url, safe='')}"),
        ("POST", f"/%2e%2e/{rm}"),
        ("POST", f"/v1/chat/completions%2F..%2F..%2F..%2F{rm}"),
        ("POST", f"/v1/chat/completions/%2e%2e/%2e%2e/%2e%2e/{rm}"),
        ("POST", f"/REMOVE_WORKER?url={prefill_url}"),
        ("POST", f"/{rm.replace('?', '/?')}"),
        ("POST", f"/v1/chat/completions?/../../{rm}"),
        ("POST", f"/v1/chat/completions%3F/../../{rm}"),
        ("POST", f"/v1/chat/completions#/../../../{rm}"),
        ("POST", f"/v1/chat/completions\\..\\..\\..\\{rm}"),
        ("POST", f"/v1/chat/completions;/../../../{rm}"),
        ("POST", f"http://127.0.0.1/{rm}"),
        ("DELETE", f"/workers/{decode}"),
        ("DELETE", f"//workers/{decode}"),
        ("DELETE", f"/v1/models/../../workers/{decode}"),
        ("DELETE", f"/workers/{decode.replace('%2F', '/')}"),
        ("DELETE", f"/workers%2F{decode}"),
        ("POST", "/v1/chat/completions/../../flush_cache"),
        ("POST", "/v1/chat/completions/../../../flush_cache"),
        ("POST", "/v1/chat/completions/../../../reset_prefix_cache"),
        # Allowed routes, spelled otherwise: served, and the router is sent the route's own path only.
        ("GET", f"/{rm.split('?')[0]}/../v1/models"),
        ("GET", "/remove_worker/../v1/models?url=x"),
        ("GET", "/workers/../v1/models"),
        ("GET", "/v1//models"),
        ("GET", "//v1/models"),
        ("GET", "/./v1/./models"),
        ("GET", "/v1/%6dodels"),
        ("GET", "/v1%2Fmodels"),
        ("GET", "/v1/models?url=http://127.0.0.1:1&x=/../remove_worker"),
        ("POST", "/flush_cache/../v1/chat/completions"),
        ("POST", "/v1/chat/completions?stream=true&/../../remove_worker"),
        # Neither: another case, a trailing slash, a suffix.
        ("GET", "/V1/Models"),
        ("GET", "/v1/models/"),
        ("GET", "/v1/models.json"),
        ("POST", "/v1/chat/completions/"),
        ("GET", "/health/"),
        ("GET", "/healthz"),
    ]
