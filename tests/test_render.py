"""Offline render: the prod-b300 units carry the BRIEF recipe flag for flag, deterministically."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from conftest import ROOT, STACKS, one_router, stack_file

from glm_infra import hostplan, render
from glm_infra.plan.topology import plan
from glm_infra.roles import drivers, router, vllm
from glm_infra.stack import load_file
from glm_infra.tools.cli import main

GOLDEN = Path(__file__).parent / "golden" / "brief-recipe.txt"
ALIASES = {
    "-tp": "--tensor-parallel-size",
    "-dp": "--data-parallel-size",
    "-ep": "--enable-expert-parallel",
}
BOOLEAN = {"--trust-remote-code", "--enable-auto-tool-choice", "--enable-prompt-tokens-details", "--enable-expert-parallel"}
JSON_FLAGS = {"--kv-transfer-config", "--speculative-config", "--compilation-config"}


def recipe(role: str) -> str:
    text = GOLDEN.read_text()
    return re.search(rf"^\[{role}\]\n(.+)$", text, re.M).group(1)


def systemd_split(line: str) -> list[str]:
    """Split an ExecStart= value the way systemd does: quotes count only when they wrap a word."""
    words, i, n = [], 0, len(line)
    while i < n:
        while i < n and line[i] == " ":
            i += 1
        if i >= n:
            break
        if line[i] in "'\"":
            q = line[i]
            j = line.index(q, i + 1)
            assert j + 1 == n or line[j + 1] == " ", f"quote does not end a word at {line[i:j + 2]!r}"
            words.append(line[i + 1 : j])
            i = j + 1
        else:
            j = line.find(" ", i)
            j = n if j < 0 else j
            words.append(line[i:j])
            i = j
    return words


def flags(words: list[str]) -> dict[str, object]:
    """``vllm serve MODEL`` arguments as {canonical flag: value}; JSON values parsed."""
    assert words[1] == "serve"
    out: dict[str, object] = {"model": words[2]}
    rest = words[3:]
    i = 0
    while i < len(rest):
        w = rest[i]
        assert w.startswith("-"), f"stray value {w!r}"
        name, eq, value = w.partition("=")
        name = ALIASES.get(name, name)
        if not eq:
            if name in BOOLEAN:
                value = True
            else:
                i += 1
                value = rest[i]
        if name in JSON_FLAGS:
            value = json.loads(value)
        assert name not in out, f"{name} given twice"
        out[name] = value
        i += 1
    return out


def exec_start(unit: str) -> list[str]:
    (line,) = [l for l in unit.splitlines() if l.startswith("ExecStart=")]
    return systemd_split(line[len("ExecStart=") :])


def environment(unit: str) -> dict[str, str]:
    return dict(l[len("Environment=") :].split("=", 1) for l in unit.splitlines() if l.startswith("Environment="))


@pytest.fixture(scope="module")
def prod():
    cfg = load_file(stack_file("prod-b300")).config
    return cfg, plan(cfg)


def test_golden_recipe_matches_brief():
    brief = ROOT.parent / "shared" / "docs" / "BRIEF.md"
    if not brief.exists():
        pytest.skip("../shared/docs/BRIEF.md not beside this checkout")
    text = brief.read_text()
    for role in ("prefill", "decode"):
        assert recipe(role) in text


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_prod_units_carry_the_recipe_flag_for_flag(prod, role):
    cfg, p = prod
    want = flags(shlex.split(recipe(role)))
    units = [vllm.vllm_unit(cfg, i) for i in p.by_role(role)]
    assert len(units) == {"prefill": 4, "decode": 1}[role]
    for unit in units:
        words = exec_start(unit)
        assert words[0] == "/opt/glm-infra/venv/bin/vllm"
        got = flags(words)
        for name, value in want.items():
            assert name in got, f"{role}: {name} missing"
            if name == "--gpu-memory-utilization":
                assert float(got[name]) == float(value)
            else:
                assert got[name] == value, f"{role}: {name} is {got[name]!r}, recipe says {value!r}"
        # What glm-infra adds is only what a multi-instance, multi-host deployment needs.
        assert set(got) - set(want) == {"--served-model-name", "--host", "--port", "--data-parallel-rpc-port"}
        assert environment(unit)["VLLM_USE_V2_MODEL_RUNNER"] == "1"


def test_prod_instance_specifics(prod):
    cfg, p = prod
    by_name = {i.name: i for i in p.instances}
    unit = vllm.vllm_unit(cfg, by_name["prefill-1"])
    got = flags(exec_start(unit))
    assert (got["--host"], got["--port"], got["--data-parallel-rpc-port"]) == ("10.0.0.11", "8101", "29551")
    env = environment(unit)
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.11"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5604"
    for line in ("User=vllm", "LimitMEMLOCK=infinity", "Restart=on-failure", "TimeoutStopSec=330",
                 "EnvironmentFile=/etc/glm-infra/ucx.env", "EnvironmentFile=/etc/glm-infra/secrets/vllm.env",
                 "Requires=nvidia-fabricmanager.service nvidia-persistenced.service"):
        assert line in unit.splitlines(), line
    assert "PrivateDevices" not in unit.replace("Not PrivateDevices", "")


def test_vllm_starts_only_on_a_healthy_host_with_its_weights_mounted(prod):
    cfg, p = prod
    for inst in p.instances:
        unit = vllm.vllm_unit(cfg, inst)
        assert "\nExecStartPre=+/usr/local/libexec/glm-infra/health-gate.sh before-start\n" in unit
        assert f"\nRequiresMountsFor={cfg.model.path}\n" in unit
        assert "\nStartLimitIntervalSec=0\n" in unit and "\nRestart=on-failure\n" in unit
        assert "\nRequires=nvidia-fabricmanager.service nvidia-persistenced.service\n" in unit


def test_a_reboot_may_take_as_long_as_an_instance_drains(prod):
    cfg, p = prod
    script = drivers.waitboot_script(cfg, "b300-1")
    drain = max(pool.shutdown_timeout for _, pool in cfg.pools())
    assert f">= {drain + 150} ))" in script and f"SSH never went down in {drain + 150}s" in script
    assert f"< {cfg.drivers.reboot_timeout} ))" in script


def test_the_router_starts_after_the_instances_of_its_host(prod):
    cfg, p = prod
    assert "\nAfter=network-online.target glm-vllm-decode-0.service\n" in router.router_unit(cfg, p)


def test_router_unit(one_router_stack):
    cfg = one_router_stack  # (two routers' fronts: tests/test_router_ha.py)
    p = plan(cfg)
    words = exec_start(router.router_unit(cfg, p))
    assert words[0] == "/opt/glm-infra/venv/bin/vllm-router" and "--vllm-pd-disaggregation" in words
    prefills = [words[i + 1] for i, w in enumerate(words) if w == "--prefill"]
    decodes = [words[i + 1] for i, w in enumerate(words) if w == "--decode"]
    assert prefills == list(p.router.prefill_urls) and decodes == list(p.router.decode_urls)
    # The router listens on loopback; the nginx front owns the public port.
    assert (words[words.index("--host") + 1], words[words.index("--port") + 1]) == ("127.0.0.1", "8001")
    front = router.router_front_conf(cfg, p)
    assert "listen 10.0.0.13:8000 ssl;" in front and p.router.url == "https://10.0.0.13:8000"
    assert "ssl_certificate /etc/glm-infra/tls/front.crt;" in front
    assert "ssl_certificate_key /etc/glm-infra/tls/front.key;" in front
    assert front.count("server 127.0.0.1:8001 max_fails=0;") == 3  # one attempt per entry
    assert "proxy_next_upstream error timeout http_500 http_502 http_503 non_idempotent;" in front
    assert "default 1;" in front, "no apiKey in prod-b300: the front lets every client in (validate warns)"
    # Only the allowlist reaches the router (tests/test_front_door.py drives it with the real nginx).
    assert front.count("proxy_pass http://glm_infra_router;") == len(router.PUBLIC_ROUTES)
    assert "    location / {\n        return 404 " in front


def test_front_requires_the_api_key_when_set(write_stack, prod_config):
    prod_config["glm-infra:router"]["apiKey"] = {"secure": "v1:x"}
    cfg = load_file(write_stack(prod_config)).config
    front = router.router_front_conf(cfg, plan(cfg))
    assert "default 0;" in front and "include /etc/glm-infra/secrets/router-front-keys.conf;" in front
    keys = router.router_front_keys({"router_api_key": "sk-1"})
    assert '"Bearer sk-1" 1;' in keys


def test_plain_http_is_refused_or_redirected_as_the_stack_says(write_stack, prod_config):
    refuse = router.router_front_conf(*_loaded(write_stack, prod_config))
    assert "error_page 497" not in refuse  # nginx's own answer to plain HTTP on a TLS port: 400
    prod_config["glm-infra:router"]["plainHttp"] = "redirect"
    redirect = router.router_front_conf(*_loaded(write_stack, prod_config))
    assert "error_page 497 =301 https://$host:$server_port$request_uri;" in redirect


def test_a_generated_certificate_names_the_router_address_then_tls_names(write_stack, prod_config):
    one_router(prod_config)  # (with two routers: the virtual address first, tests/test_host_scripts.py)
    prod_config["glm-infra:router"]["tlsNames"] = ["LLM.example.com", "2001:db8::0:1", "10.0.0.13"]
    cfg, p = _loaded(write_stack, prod_config)
    assert router.tls_names(cfg, p) == ["10.0.0.13", "llm.example.com", "2001:db8::1"]
    assert router.subject_alt_names(router.tls_names(cfg, p)) == "IP:10.0.0.13,DNS:llm.example.com,IP:2001:db8::1"
    steps = hostplan.plan_all(cfg, p, stack_name="prod")["b300-3"].steps
    assert "router-front-tls-given" not in steps
    assert "san=IP:10.0.0.13,DNS:llm.example.com,IP:2001:db8::1" in steps["router-front-tls"].stdin
    assert "--cacert /etc/glm-infra/tls/ca.crt" in steps["router-front"].stdin


def test_a_given_certificate_is_a_secret_file_the_tls_step_installs(write_stack, prod_config):
    prod_config["glm-infra:router"].update(tlsCertificate={"secure": "v1:c"}, tlsKey={"secure": "v1:k"})
    cfg, p = _loaded(write_stack, prod_config)
    steps = hostplan.plan_all(cfg, p, stack_name="prod")["b300-3"].steps
    given = steps["router-front-tls-given"]
    assert given.secret and given.files[0].path == "/etc/glm-infra/secrets/router-tls.pem" and given.files[0].mode == 0o600
    assert given.stdin == "<secret glm-infra:router.tlsCertificate>\n<secret glm-infra:router.tlsKey>\n"
    assert router.router_front_tls_given({"router_tls_certificate": "C\n", "router_tls_key": "\nK"}) == "C\nK\n"
    assert "install_given" in steps["router-front-tls"].stdin and "make_ca" not in steps["router-front-tls"].stdin
    assert "--insecure" in steps["router-front"].stdin
    keys = list(steps)
    assert keys.index("router-front-tls-given") < keys.index("router-front-tls") < keys.index("router-front")


def _loaded(write_stack, config):
    cfg = load_file(write_stack(config)).config
    return cfg, plan(cfg)


def test_quotes_only_wrap_whole_words():
    assert render.systemd_quote(["a", '{"x":1}', "--k=v"]) == "a '{\"x\":1}' --k=v"
    with pytest.raises(ValueError):
        render.systemd_quote(["it's"])


@pytest.mark.parametrize("stack", STACKS)
def test_render_is_deterministic_and_complete(stack, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["render", stack, "--out", str(a)]) == 0
    assert main(["render", stack, "--out", str(b)]) == 0
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert files_a == files_b and files_a
    for rel in files_a:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    cfg = load_file(stack_file(stack)).config
    p = plan(cfg)
    for inst in p.instances:
        unit = a / inst.host / "etc/systemd/system" / inst.unit
        assert unit.is_file(), unit
        assert flags(exec_start(unit.read_text()))["model"] == cfg.model.path
    for h in p.hosts:
        secrets = a / h.name / "etc/glm-infra/secrets/vllm.env"
        assert secrets.exists() == bool(h.instances)
        if secrets.exists():
            assert secrets.stat().st_mode & 0o777 == 0o600


def test_render_replaces_secrets_by_placeholders(write_stack, prod_config, tmp_path):
    prod_config["glm-infra:router"]["apiKey"] = {"secure": "v1:c2VjcmV0"}
    path = write_stack(prod_config)
    out = tmp_path / "out"
    assert main(["render", str(path), "--out", str(out)]) == 0
    router_env = (out / "b300-3/etc/glm-infra/secrets/router.env").read_text()
    assert "OPENAI_API_KEY=<secret glm-infra:router.apiKey>" in router_env
    vllm_env = (out / "b300-1/etc/glm-infra/secrets/vllm.env").read_text()
    assert "VLLM_API_KEY=<secret glm-infra:router.apiKey>" in vllm_env
    everything = "".join(p.read_text() for p in out.rglob("*") if p.is_file())
    assert "c2VjcmV0" not in everything
    # Secrets never go in units: the units only name the root-only EnvironmentFiles.
    for unit in out.rglob("*.service"):
        assert "<secret" not in unit.read_text()


def test_render_refuses_to_clobber(tmp_path, capsys):
    (tmp_path / "keep").write_text("x")
    assert main(["render", "prod-b300", "--out", str(tmp_path)]) == 2
    assert (tmp_path / "keep").exists()


def test_template_errors_are_strict():
    import jinja2

    with pytest.raises(jinja2.UndefinedError, match="'per_rank' is undefined"):
        render.render_template("ucx.env.j2", host={"name": "h", "compute_nics": []})


def test_every_template_name_is_unique_across_the_shared_and_the_roles_folders():
    """One jinja namespace over glm_infra/templates and roles/*/templates: a name in two folders would
    render whichever comes first."""
    names = [f.name for f in render.template_files()]
    assert len(names) > 20 and sorted(names) == sorted(set(names)), [n for n in names if names.count(n) > 1]
    assert all(render.template_file(n).name == n for n in names)
    with pytest.raises(FileNotFoundError, match="no template 'nope.j2'"):
        render.template_file("nope.j2")
