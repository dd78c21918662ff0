"""glm-infra's component package (provider/: PulumiPlugin.yaml and Pulumi's component provider host)
through the real engine: its schema (`pulumi package get-schema`) against the Args, walked from
glm_infra.args — every field of every TypedDict with its type, its docstring as description, required
as the models say, Inputs (the secrets among them) not plain — and the outputs against what the
components register; then examples/typescript-cluster, a TypeScript program on the Node.js language
host, `pulumi package add` and `pulumi preview`: it declares the same resources as the Python program
for stacks/Pulumi.sim.yaml. Needs the toolchain (scripts/toolchain, the Node.js host included) and
Node.js with npm (scripts/lib/host-deps.sh): without them these tests fail, saying so."""

from __future__ import annotations

import ast
import collections.abc
import json
import os
import shutil
import subprocess
import typing
from pathlib import Path

import pulumi
import pytest
import yaml
from conftest import ROOT, stack_file
from e2e.harness import sh
from pulumi_harness import run_callable, run_program

import glm_infra
from glm_infra import Cluster, Hosts
from glm_infra import args as glm_args
from glm_infra.spec.config import SECRETS

PROVIDER = ROOT / "provider"
EXAMPLE = ROOT / "examples" / "typescript-cluster"
PACKAGE = "glm-infra"
COMPONENTS = {"ClusterArgs": Cluster, "HostsArgs": Hosts}  # the Args TypedDict of each component
KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nnot-a-real-key\n-----END OPENSSH PRIVATE KEY-----\n"


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.title() for w in rest)


@pytest.fixture(scope="module")
def toolchain():
    p = subprocess.run([str(ROOT / "scripts/toolchain")], capture_output=True, text=True)
    assert p.returncode == 0, f"scripts/toolchain failed (exit {p.returncode}):\n{p.stderr[-3000:]}"


@pytest.fixture(scope="module")
def schema(toolchain) -> dict:
    p = sh(f"pulumi package get-schema {PROVIDER}", timeout=300)
    return json.loads(p.stdout)


# --- the schema against the Args --------------------------------------------------------------------


def typed_dicts() -> dict[str, type]:
    return {n: c for n, c in vars(glm_args).items() if typing.is_typeddict(c) and c.__module__ == glm_args.__name__}


def docstrings() -> dict[str, dict[str, str]]:
    """Each TypedDict's field docstrings, read from the source of glm_infra/args.py."""
    out: dict[str, dict[str, str]] = {}
    for node in ast.parse(Path(glm_args.__file__).read_text()).body:
        if isinstance(node, ast.ClassDef):
            body, docs = node.body, {}
            for stmt, nxt in zip(body, body[1:]):
                if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                    docs[stmt.target.id] = nxt.value.value
            out[node.name] = docs
    return out


def expected(tp) -> tuple[dict, bool]:
    """The schema of a field's annotation (without description) and whether it takes an Input."""
    origin, params = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Required:
        return expected(params[0])
    if origin is typing.Union and any(typing.get_origin(p) is collections.abc.Awaitable for p in params):
        return expected(params[0])[0], True  # pulumi.Input[T]: T | Awaitable[T] | Output[T]
    if origin is collections.abc.Sequence:
        return {"type": "array", "items": expected(params[0])[0]}, False
    if origin is collections.abc.Mapping:
        assert params[0] is str
        return {"type": "object", "additionalProperties": expected(params[1])[0]}, False
    if typing.is_typeddict(tp):
        return {"$ref": f"#/types/{PACKAGE}:index:{tp.__name__}"}, False
    return {"type": {str: "string", int: "integer", float: "number", bool: "boolean"}[tp]}, False


def shape(prop: dict) -> dict:
    """A schema property without its descriptions and plain markers (compared on their own)."""
    out = {k: v for k, v in prop.items() if k not in ("description", "plain")}
    for k in ("items", "additionalProperties"):
        if k in out:
            out[k] = shape(out[k])
    return out


def where(schema: dict, name: str) -> tuple[dict, set[str]]:
    """The properties and the required names the schema gives the TypedDict ``name``."""
    if name in COMPONENTS:
        res = schema["resources"][f"{PACKAGE}:index:{COMPONENTS[name].__name__}"]
        return res["inputProperties"], set(res.get("requiredInputs", []))
    t = schema["types"][f"{PACKAGE}:index:{name}"]
    return t["properties"], set(t.get("required", []))


def test_the_schema_is_the_package_of_both_components(schema):
    assert schema["name"] == PACKAGE and schema["version"] == glm_infra.__version__
    assert set(schema["resources"]) == {f"{PACKAGE}:index:Cluster", f"{PACKAGE}:index:Hosts"}
    assert all(r["isComponent"] for r in schema["resources"].values())
    assert schema["resources"][f"{PACKAGE}:index:Cluster"]["description"].startswith(Cluster.__doc__.strip()[:60])
    # Every Args part is a type of the schema and the schema has no other.
    parts = {n for n in typed_dicts() if n not in COMPONENTS}
    assert {t.split(":")[-1] for t in schema["types"]} == parts
    for name in parts:
        assert schema["types"][f"{PACKAGE}:index:{name}"]["description"] == " ".join(typed_dicts()[name].__doc__.split())


def test_every_args_field_is_in_the_schema_with_its_type_description_and_requiredness(schema):
    docs = docstrings()
    checked = 0
    for name, td in typed_dicts().items():
        props, required = where(schema, name)
        hints = td.__annotations__  # as evaluated, Required[...] kept (get_type_hints would resolve Output[T])
        assert set(props) == {camel(f) for f in hints}, name
        for field, tp in hints.items():
            prop, key, where_ = props[camel(field)], camel(field), f"{name}.{field}"
            want, is_input = expected(tp)
            assert shape(prop) == want, where_
            assert prop["description"] == docs[name][field], where_
            says_required = docs[name][field].endswith("Required.")
            assert (field in td.__required_keys__) == says_required == (key in required), where_
            # Inputs take Outputs of other resources (addresses, secrets, the mirror URL); the rest is plain.
            assert prop.get("plain") is (None if is_input else True), where_
            checked += 1
    assert checked > 150, "walked every field"


def test_the_secrets_are_inputs_of_the_schema(schema):
    for top, key in SECRETS.values():
        props, _ = where(schema, "ClusterArgs")
        ref = props[top]["$ref"].rsplit(":", 1)[-1]
        prop = schema["types"][f"{PACKAGE}:index:{ref}"]["properties"][key]
        assert prop["type"] == "string" and "plain" not in prop, f"{top}.{key}"
        assert "secret" in prop["description"].lower(), f"{top}.{key}"


def test_the_outputs_are_what_the_components_register(schema, tmp_path, monkeypatch):
    registered: dict[str, set[str]] = {}
    original = pulumi.ComponentResource.register_outputs

    def record(self, outputs):
        registered[type(self).__name__] = set(outputs)
        return original(self, outputs)

    monkeypatch.setattr(pulumi.ComponentResource, "register_outputs", record)
    key = tmp_path / "key"
    key.write_text(KEY)
    run_program(stack_file("sim"), key, stack="sim")
    run_callable(lambda: Hosts("fleet", {
        "hosts": [{"name": "h1", "address": "10.0.0.1", "compute_nics": ["mlx5_0"]}], "ssh": {"private_key": KEY},
        "model": {"repo": "nvidia/GLM-5.2-NVFP4", "revision": "0" * 40, "path": "/mnt/model/glm", "source": "local"},
        "firewall": {"admin_cidrs": ["10.20.0.0/24"]}}))
    for component in (Cluster, Hosts):
        res = schema["resources"][f"{PACKAGE}:index:{component.__name__}"]
        assert set(res["properties"]) == registered[component.__name__], component.__name__
        assert set(res["required"]) == set(res["properties"])
        annotations = {a for a in vars(component).get("__annotations__", {}) if not a.startswith("_")}
        assert set(res["properties"]) == {camel(a) for a in annotations}, "the class annotations are the outputs"
    props = schema["resources"][f"{PACKAGE}:index:Cluster"]["properties"]
    assert props["routerUrl"]["type"] == "string"
    assert shape(props["instances"]) == {"type": "object", "additionalProperties": {
        "type": "object", "additionalProperties": {"type": "string"}}}


# --- the TypeScript example through the engine --------------------------------------------------------


def resource(urn: str) -> tuple[str, str, str]:
    """(parent's type, type, name) of a URN (the mocks qualify a type by its parent's type only, the
    stack's too)."""
    chain, name = urn.split("::")[2:]
    types = [t for t in chain.split("$") if t != "pulumi:pulumi:Stack"] or ["pulumi:pulumi:Stack"]
    return (types[-2] if len(types) > 1 else "", types[-1], name)


@pytest.fixture
def ts_project(toolchain, tmp_path):
    """examples/typescript-cluster in a folder of its own, the package named by its absolute path, a
    HOME of its own with the sim stack's SSH key (a preview reads it and contacts no host)."""
    for tool in ("node", "npm"):
        assert shutil.which(tool), f"{tool} not found: scripts/lib/host-deps.sh installs Debian's nodejs and npm"
    project = tmp_path / "typescript-cluster"
    shutil.copytree(EXAMPLE, project, ignore=shutil.ignore_patterns("node_modules", "sdks", "bin"))
    pulumi_yaml = yaml.safe_load((project / "Pulumi.yaml").read_text())
    assert pulumi_yaml["packages"] == {PACKAGE: "../../provider"}
    pulumi_yaml["packages"][PACKAGE] = str(PROVIDER)
    (project / "Pulumi.yaml").write_text(yaml.safe_dump(pulumi_yaml, sort_keys=False))
    key = tmp_path / "home/.cache/glm-infra/sim/ssh/id_ed25519"
    key.parent.mkdir(parents=True)
    key.write_text(KEY)
    cache = os.environ.get("GLM_INFRA_CACHE", os.path.expanduser("~/.cache/glm-infra"))
    (tmp_path / "state").mkdir()
    env = {"PULUMI_BACKEND_URL": f"file://{tmp_path / 'state'}", "HOME": str(tmp_path / "home"),
           "GLM_INFRA_CACHE": cache, "PULUMI_HOME": f"{cache}/pulumi-home",
           # npm's cache beside the toolchain's, so that a second run downloads nothing.
           "npm_config_cache": f"{cache}/npm", "npm_config_prefer_offline": "true", "npm_config_audit": "false",
           "npm_config_fund": "false", "npm_config_update_notifier": "false"}
    return project, env


def test_the_typescript_example_previews_the_sim_cluster(ts_project, tmp_path):
    project, env = ts_project
    # The SDK (sdks/glm-infra, git-ignored) from the package's schema, and npm install from the lock.
    sh(f"cd {project} && pulumi package add {PROVIDER}", env=env, timeout=600)
    for f in ("package.json", "package-lock.json"):
        assert (project / f).read_text() == (EXAMPLE / f).read_text(), \
            f"pulumi package add changed {f}: commit the new one from {project}"
    assert (project / "sdks/glm-infra/bin/cluster.d.ts").exists()
    sh(f"cd {project} && pulumi stack init sim --secrets-provider passphrase", env=env)
    sh(f"cd {project} && pulumi config set -s sim --secret glm-example:apiKey sk-typescript-preview", env=env)
    out = sh(f"cd {project} && pulumi preview -s sim --json --non-interactive", env=env, timeout=600).stdout
    assert "sk-typescript-preview" not in out, "the API key travels as a secret"
    creates = [resource(s["urn"]) for s in json.loads(out)["steps"] if s["op"] == "create"]
    ts = sorted(r for r in creates if r[1] != "pulumi:pulumi:Stack")
    cluster = f"{PACKAGE}:index:Cluster"
    for want in ((cluster, f"{PACKAGE}:index:Router", "glm-router"),
                 *((cluster, f"{PACKAGE}:index:Host", f"glm-sim-{i}") for i in (1, 2, 3)),
                 *((cluster, f"{PACKAGE}:index:VllmService", f"glm-prefill-{i}") for i in range(4)),
                 (cluster, f"{PACKAGE}:index:VllmService", "glm-decode-0")):
        assert want in ts, want
    assert ("", cluster, "glm") in ts
    # The same resources, with the same parents, as the Python program registers for the sim stack.
    key = tmp_path / "key"
    key.write_text(KEY)
    py = sorted(resource(r.urn) for r in run_program(stack_file("sim"), key, stack="sim").resources)
    assert ts == py, ("only from TypeScript", sorted(set(ts) - set(py))[:10], "only from Python",
                      sorted(set(py) - set(ts))[:10])
