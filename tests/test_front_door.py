"""The router's public front passes only its allowlist (issue 38, part 2). vllm-router 0.1.17 serves its admin
API on its own port without a credential (POST /remove_worker, DELETE /workers/…: a worker out until the
router restarts) and sends a POST to any other path on to the workers; the front used to pass every path to
it. Here the real nginx (Debian's) runs the rendered configuration, TLS and API key included, on loopback in
front of the real vllm-router 0.1.17 in P/D mode with a stub prefill and a stub decode worker; every route the
router defines is driven through it with a valid key. Between the front and the router a recorder passes each
request on and keeps its request line: what the router was sent, exactly."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import proctree
import pytest
import yaml
from conftest import free_port, stack_file, wait_port
from router_api import ALLOWED, ALLOWED_PATHS, CHAT, COMPLETION, MODEL, every_route, path_tricks

from glm_infra.plan.topology import plan
from glm_infra.roles import router
from glm_infra.spec import paths, pins
from glm_infra.stack import load_dict, unprefixed

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "sk-glm-infra-front-door-test-0123456789"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"  # scripts/lib/host-deps.sh installs it for the suite


# --- the rendered configuration --------------------------------------------------------------------------


def _stack(**router_keys):
    raw = unprefixed(yaml.safe_load(stack_file("sim").read_text())["config"])
    raw["router"] = {**raw["router"], "apiKey": {"secure": "v1:x"}, **router_keys}
    cfg = load_dict(raw, "t").config
    return cfg, plan(cfg)


def test_the_public_routes_are_routes_of_the_pinned_router_and_the_docs_list_them():
    routes = set(pins.ROUTER_ROUTES[pins.VLLM_ROUTER])
    assert ALLOWED <= routes, ALLOWED - routes
    assert ALLOWED == {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
                       ("GET", "/health")}
    assert [r.path for r in router.PUBLIC_ROUTES if not r.api_key] == ["/health"], "only the probe without the key"
    assert router.public_routes_table() in (ROOT / "docs" / "DEPLOYING.md").read_text()


def test_the_front_has_a_location_per_public_route_and_a_404_for_the_rest():
    conf = router.router_front_conf(*_stack())
    locations = [line.strip() for line in conf.splitlines() if line.strip().startswith("location")]
    assert locations == [f"location = {r.path} {{" for r in router.PUBLIC_ROUTES] + ["location / {"]
    blocks = conf.split("    location ")[1:]
    for route, block in zip(router.PUBLIC_ROUTES, blocks):
        body = block[: block.index("\n    }\n")]
        # The key, then the methods, then the route's own path without the query, and only then the router.
        order = [body.find(s) for s in ("$glm_infra_authorized = 0", "$request_method !~", "rewrite ", "proxy_pass ")]
        assert order[1:] == sorted(order[1:]) and order[1] > 0, body
        assert (order[0] >= 0) == route.api_key and order[0] < order[1], body
        assert f"rewrite ^ {route.path}? break;" in body and f"^({'|'.join(route.methods)})$" in body
    catch_all = blocks[-1]
    assert "proxy_pass" not in catch_all and "glm_infra_authorized" not in catch_all, "404 with or without a key"
    assert catch_all.count("return 404 ") == 1 and router.not_served_message() in catch_all
    assert conf.count("proxy_pass ") == len(router.PUBLIC_ROUTES)


def test_the_routers_own_port_stays_on_loopback():
    """The admin API's port: vllm-router binds loopback, and the firewall opens it to nobody (it used to open
    it to every stack host: anything that made the router listen wider would have served its admin API)."""
    from glm_infra.plan import ports
    from glm_infra.roles import firewall

    cfg, p = _stack()
    args = router.router_args(cfg, p)
    bind = (args[args.index("--host") + 1], args[args.index("--port") + 1])
    assert bind == ("127.0.0.1", str(cfg.router.internal_port))
    (own,) = [li for li in ports.listeners(cfg) if li.port == cfg.router.internal_port]
    assert (own.host, own.owner, own.audience) == (cfg.router.host, "router internal", ports.LOOPBACK)
    rules = firewall.ruleset(cfg, p, cfg.router.host)
    assert not re.search(rf"\b{cfg.router.internal_port}\b", rules) and "router internal" not in rules, rules


# --- the real nginx, in front of the real vllm-router ----------------------------------------------------


class StubWorker(ThreadingHTTPServer):
    """A prefill or decode worker on loopback: healthy, one model, an answer to every POST; it keeps what it
    was sent (method, path)."""

    daemon_threads = True

    def __init__(self, role: str) -> None:
        self.role, self.seen = role, []
        super().__init__(("127.0.0.1", 0), _Worker)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _Worker(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: StubWorker

    def _answer(self, code: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.server.seen.append(("GET", self.path))
        if self.path == "/health":
            self._answer(200, {})
        elif self.path == "/v1/models":
            self._answer(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        else:
            self._answer(404, {"error": "no such route"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.server.seen.append(("POST", self.path))
        self._answer(200, {"id": "cmpl-1", "object": "chat.completion", "model": MODEL, "served_by": self.server.role,
                           "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "text": "hi",
                                        "finish_reason": "stop"}],
                           "kv_transfer_params": {"remote_engine_id": "e", "remote_host": "127.0.0.1",
                                                  "remote_port": 1}})

    def log_message(self, *args) -> None:
        pass


class Recorder(ThreadingHTTPServer):
    """Stands on the port the front sends to: keeps the request line of everything the front passes and
    passes it on, unchanged, to the router."""

    daemon_threads = True

    def __init__(self, router_port: int) -> None:
        self.router_port, self.seen = router_port, []
        super().__init__(("127.0.0.1", 0), _Pass)
        self.port = self.server_address[1]


class _Pass(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Recorder
    HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer", "upgrade"}

    def __getattr__(self, name: str):
        if name.startswith("do_"):  # every method, whichever the front sends
            return self._pass
        raise AttributeError(name)

    def _pass(self) -> None:
        self.server.seen.append((self.command, self.path))
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        conn = http.client.HTTPConnection("127.0.0.1", self.server.router_port, timeout=30)
        try:
            conn.request(self.command, self.path, body=body or None,
                         headers={k: v for k, v in self.headers.items() if k.lower() not in self.HOP})
            r = conn.getresponse()
            data = r.read()
        finally:
            conn.close()
        self.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() not in self.HOP:
                self.send_header(k, v)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@dataclass
class Front:
    port: int
    router_port: int
    context: ssl.SSLContext
    recorder: Recorder
    prefill: StubWorker
    decode: StubWorker
    log: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    def send(self, method: str, target: str, body: bytes | None = None, key: str | None = API_KEY):
        """(status, headers, body) of one raw request to the front, over TLS; ``target`` is sent as it is."""
        conn = http.client.HTTPSConnection("127.0.0.1", self.port, context=self.context, timeout=30)
        headers = {"content-type": "application/json"} if body is not None else {}
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        try:
            conn.request(method, target, body=body, headers=headers)
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def workers(self) -> dict[str, str]:
        """The router's own view, asked on its loopback port (not through the front): URL → role."""
        conn = http.client.HTTPConnection("127.0.0.1", self.router_port, timeout=10)
        try:
            conn.request("GET", "/workers")
            return {w["url"]: w["worker_type"] for w in json.loads(conn.getresponse().read())["workers"]}
        finally:
            conn.close()

    def both_workers(self) -> dict[str, str]:
        return {self.prefill.url: "prefill", self.decode.url: "decode"}

    def reached_router(self) -> set[tuple[str, str]]:
        return set(self.recorder.seen)

    def reached_workers(self) -> set[tuple[str, str]]:
        """What the workers were sent, less the router's own probes."""
        return {s for w in (self.prefill, self.decode) for s in w.seen if s[1] not in ("/health", "/metrics")}


def _tls(tmp: Path) -> tuple[Path, Path]:
    crt, key = tmp / "front.crt", tmp / "front.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(crt)], check=True, capture_output=True)
    return crt, key


def _nginx_conf(tmp: Path, front_port: int, upstream_port: int, crt: Path, key: Path) -> Path:
    """The front's rendered configuration with what places it on a host (its address, its files) moved to
    loopback and ``tmp``, in a main configuration as Debian's nginx.conf wraps conf.d."""
    cfg, p = _stack(port=front_port, internalPort=upstream_port)
    conf = router.router_front_conf(cfg, p)
    listen = f"listen {paths.url_host(p.router.address)}:{front_port} ssl;"
    for old, new in ((listen, f"listen 127.0.0.1:{front_port} ssl;"),
                     (f"ssl_certificate {paths.FRONT_CERT};", f"ssl_certificate {crt};"),
                     (f"ssl_certificate_key {paths.FRONT_KEY};", f"ssl_certificate_key {key};"),
                     (f"include {paths.FRONT_KEYS};", f"include {tmp / 'keys.conf'};")):
        assert conf.count(old) == 1, old
        conf = conf.replace(old, new)
    assert conf.count(f"server 127.0.0.1:{upstream_port} max_fails=0;") == cfg.router.retries
    (tmp / "keys.conf").write_text(router.router_front_keys({"router_api_key": API_KEY}))
    (tmp / "front.conf").write_text(conf)
    temp = "".join(f"    {kind}_temp_path {tmp / kind};\n"
                   for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    main = (f"daemon off;\nuser root root;\nworker_processes 1;\npid {tmp / 'nginx.pid'};\n"
            f"error_log {tmp / 'error.log'} notice;\nevents {{ worker_connections 64; }}\n"
            f"http {{\n    include /etc/nginx/mime.types;\n    default_type application/octet-stream;\n"
            f"    access_log {tmp / 'access.log'};\n{temp}    include {tmp / 'front.conf'};\n}}\n")
    (tmp / "nginx.conf").write_text(main)
    return tmp / "nginx.conf"


def _started(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=open(log, "a"), stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    if not Path(NGINX).exists():
        pytest.fail("nginx is not installed: scripts/lib/host-deps.sh installs it (apt-get install nginx)")
    tmp = tmp_path_factory.mktemp("front")
    prefill, decode = StubWorker("prefill"), StubWorker("decode")
    servers = [prefill, decode]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    router_port, metrics_port, front_port = free_port(), free_port(), free_port()
    recorder = Recorder(router_port)
    servers.append(recorder)
    threading.Thread(target=recorder.serve_forever, daemon=True).start()
    crt, key = _tls(tmp)
    f = Front(front_port, router_port, ssl.create_default_context(cafile=str(crt)), recorder, prefill, decode,
              tmp / "processes.log")
    try:
        # As the router unit starts it (roles/router router_args), on loopback ports of the test's own.
        f.procs.append(_started([str(Path(sys.executable).parent / "vllm-router"), "--vllm-pd-disaggregation",
                                 "--prefill", prefill.url, "--decode", decode.url, "--policy", "round_robin",
                                 "--host", "127.0.0.1", "--port", str(router_port), "--prometheus-host", "127.0.0.1",
                                 "--prometheus-port", str(metrics_port), "--health-check-interval-secs", "60",
                                 "--worker-startup-check-interval", "1"], f.log))
        conf = _nginx_conf(tmp, front_port, recorder.port, crt, key)
        f.procs.append(_started([NGINX, "-p", str(tmp), "-e", str(tmp / "error.log"), "-c", str(conf)], f.log))
        wait_port(front_port)
        deadline = time.monotonic() + 20
        while True:
            try:
                if f.workers() == f.both_workers():
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"the router never listed both workers:\n{f.log.read_text()[-3000:]}"
            time.sleep(0.1)
        yield f
    finally:
        for p in f.procs:
            proctree.kill_tree(p.pid)
            p.wait(timeout=10)
        for s in servers:
            s.shutdown()
            s.server_close()


def _not_served(status: int, body: bytes) -> bool:
    """The front's own 404: its JSON naming the path as not served (not the router's or a worker's 404)."""
    try:
        return status == 404 and json.loads(body) == {"error": router.not_served_message()}
    except ValueError:
        return False


def test_no_admin_route_of_the_router_passes_the_front(front):
    """Every route vllm-router 0.1.17 defines, with a valid key: only the allowlist is served; the rest is the
    front's own 404, and the router still has both workers (asked on its loopback port)."""
    driven = every_route(front.prefill.url, front.decode.url)
    assert {(m, p) for m, p in pins.ROUTER_ROUTES[pins.VLLM_ROUTER]} <= {
        (m, urllib.parse.urlsplit(t).path.replace(urllib.parse.quote(front.decode.url, safe=""), "{url}")
         .replace("resp_glm_infra_test", "{response_id}")) for m, t, _ in driven}
    wrong = []  # (method, target, status, body) the front did not answer as it should
    for method, target, body in driven:
        status, _, data = front.send(method, target, body)
        allowed = (method, urllib.parse.urlsplit(target).path) in ALLOWED
        if (status == 200) if allowed else _not_served(status, data):
            continue
        wrong.append((method, target, status, data[:120]))
    # Both together: on a front that passes everything, what reached the router and what it did.
    assert (wrong, front.workers()) == ([], front.both_workers())
    assert front.reached_router() <= ALLOWED, "the router was sent nothing but the allowed routes"
    assert front.reached_workers() <= {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                                       ("GET", "/v1/models")}, "nothing the fallback passes on"


def test_every_route_in_the_list_is_one_the_router_serves(front):
    """The list the test drives is the router's own: on its loopback port each path answers a method none of
    its routes takes with axum's bare 405, where a path it does not know goes to its fallback (405 with the
    transparent proxy's text)."""
    answers = {}
    for path in ["/glm-infra-no-such-route", *dict.fromkeys(p for _, p in pins.ROUTER_ROUTES[pins.VLLM_ROUTER])]:
        conn = http.client.HTTPConnection("127.0.0.1", front.router_port, timeout=10)
        try:
            conn.request("PATCH", path.replace("{url}", "http%3A%2F%2F127.0.0.1%3A9").replace("{response_id}", "r1"))
            r = conn.getresponse()
            answers[path] = (r.status, r.read())
        finally:
            conn.close()
    assert answers.pop("/glm-infra-no-such-route") == (405, b"Only POST requests are supported for transparent proxy")
    assert all(a == (405, b"") for a in answers.values()), answers
    assert front.workers() == front.both_workers()


def test_an_unknown_path_is_the_same_404_with_a_key_without_or_with_a_wrong_one(front):
    for method, target in (("POST", "/remove_worker"), ("GET", "/workers"), ("GET", "/no/such/path"),
                           ("DELETE", "/v1/responses/r1"), ("POST", "/reset_prefix_cache")):
        answers = {front.send(method, target, b"{}" if method == "POST" else None, key=k)[::2]
                   for k in (API_KEY, None, "wrong-key-0123456789")}
        assert len(answers) == 1, (target, answers)
        assert _not_served(*answers.pop())
    status, headers, data = front.send("GET", "/list_workers")
    assert headers["content-type"] == "application/json" and b"not served" in data


def test_the_allowed_routes_work_and_want_the_key_and_their_methods(front):
    status, _, data = front.send("POST", "/v1/chat/completions", json.dumps(CHAT).encode())
    assert status == 200 and json.loads(data)["served_by"] == "decode", data
    status, _, data = front.send("POST", "/v1/completions", json.dumps(COMPLETION).encode())
    assert status == 200 and json.loads(data)["choices"][0]["text"] == "hi", data
    status, _, data = front.send("GET", "/v1/models")
    assert status == 200 and json.loads(data)["data"][0]["id"] == MODEL, data
    assert front.send("GET", "/health", key=None)[0] == 200, "the probe wants no key"
    for key in (None, "wrong-key-0123456789"):
        for target in ("/v1/chat/completions", "/v1/completions", "/v1/models"):
            status, _, data = front.send("POST" if "models" not in target else "GET", target, b"{}", key=key)
            assert (status, json.loads(data)) == (401, {"error": "missing or invalid API key"}), (target, key)
    for method, target, allow in (("GET", "/v1/chat/completions", "POST"), ("DELETE", "/v1/models", "GET"),
                                  ("POST", "/health", "GET"), ("PUT", "/v1/completions", "POST"),
                                  ("HEAD", "/v1/models", "GET")):
        status, headers, _ = front.send(method, target, b"{}" if method in ("POST", "PUT") else None)
        assert (status, headers.get("allow")) == (405, allow), (method, target)
    assert front.reached_router() <= ALLOWED and front.workers() == front.both_workers()


def test_a_path_spelled_otherwise_reaches_the_router_only_as_an_allowed_path(front):
    """``..``, ``//``, %XX (%2F too), case, a trailing slash, a query, a fragment, an absolute URI: an admin
    route never reaches the router; an allowed route reaches it as its own path, without the query."""
    outcomes = {}
    for method, target in path_tricks(front.prefill.url, front.decode.url):
        before = len(front.recorder.seen)
        status, _, data = front.send(method, target, json.dumps(CHAT).encode() if method == "POST" else None)
        sent = front.recorder.seen[before:]
        outcomes[(method, target)] = (status, sent)
        assert status in (200, 400, 404), (method, target, status, data)
        if status == 200:  # the front took it for an allowed route: the router was sent exactly that
            assert sent and all(s[0] == method and s[1] in ALLOWED_PATHS for s in sent), (target, sent)
        else:
            assert sent == [], (target, status, sent)
    assert outcomes[("GET", "/remove_worker/../v1/models")][0] == 200
    assert outcomes[("GET", "/remove_worker/../v1/models")][1] == [("GET", "/v1/models")]
    assert outcomes[("GET", "/v1/models?url=http://127.0.0.1:1&x=/../remove_worker")][1] == [("GET", "/v1/models")]
    assert front.reached_router() <= ALLOWED
    assert front.workers() == front.both_workers(), outcomes
