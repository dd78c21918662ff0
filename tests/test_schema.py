"""The stack file schema (schemas/stack.schema.json): current with the model, wired into every stack
file for editors, and checked with check-jsonschema: the committed stacks pass, and what the loader
refuses in a file (an unknown key, a wrong type, a plaintext secret) the schema refuses too."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from conftest import ROOT, STACKS, stack_file

from glm_infra.spec.config import NAMESPACE, SECRET_PATHS, STACK_KEYS, SecretValue, StackConfig, snake
from glm_infra.stack import StackError, load_file
from glm_infra.tools import schema as sch
from glm_infra.tools.cli import main

SCHEMA = ROOT / sch.SCHEMA_FILE
ns = NAMESPACE + ":"


def modeline(path: Path) -> str:
    return f"# yaml-language-server: $schema={os.path.relpath(SCHEMA, path.parent)}"


def check_jsonschema(*files: Path) -> subprocess.CompletedProcess:
    """check-jsonschema over stack files against the committed schema."""
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--schemafile", str(SCHEMA), *map(str, files)],
                          capture_output=True, text=True, timeout=120)


def stack_doc(name: str = "prod-b300") -> dict:
    """A committed stack file, the whole document."""
    return yaml.safe_load(stack_file(name).read_text())


def write(tmp_path: Path, doc: dict, name: str = "Pulumi.t.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


# --- the checked-in file is what the code makes ------------------------------------------------


def test_checked_in_schema_is_current():
    want = sch.dumps(sch.stack_file_schema())
    have = SCHEMA.read_text() if SCHEMA.exists() else ""
    assert have == want, f"{sch.SCHEMA_FILE} is stale (or missing); regenerate it with: {sch.REGENERATE}"


def test_the_cli_prints_the_file_schema_and_on_request_the_model(capsys):
    assert main(["schema"]) == 0
    assert capsys.readouterr().out == SCHEMA.read_text()
    assert main(["schema", "--model"]) == 0
    assert capsys.readouterr().out == sch.dumps(StackConfig.model_json_schema(by_alias=True))


def test_the_schema_is_draft_2020_12_and_valid_under_its_metaschema():
    s = sch.stack_file_schema()
    assert s["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert jsonschema.validators.validator_for(s) is jsonschema.Draft202012Validator
    jsonschema.Draft202012Validator.check_schema(s)
    r = subprocess.run([sys.executable, "-m", "check_jsonschema", "--check-metaschema", str(SCHEMA)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


# --- derived from config.py, nothing listed twice -----------------------------------------------


def test_config_keys_are_the_models_by_alias_with_their_descriptions():
    s = sch.stack_file_schema()
    config = s["properties"]["config"]
    assert set(config["properties"]) == {ns + k for k in STACK_KEYS}
    for k in STACK_KEYS:
        field = StackConfig.model_fields[snake(k)]
        assert config["properties"][ns + k]["description"] == field.description
    assert set(config["required"]) == {ns + k for k, f in ((k, StackConfig.model_fields[snake(k)]) for k in STACK_KEYS)
                                       if f.is_required()} == {ns + "hosts", ns + "ssh", ns + "model"}
    # Refs resolve under the file schema's own $defs, and nested descriptions are the fields' (what editors show).
    host = s["$defs"]["HostConfig"]["properties"]
    assert host["computeNics"]["description"].startswith("RDMA devices carrying KV traffic")
    assert config["properties"][ns + "hosts"]["items"] == {"$ref": "#/$defs/HostConfig"}
    for where, ref in sch._ref_paths(s, ""):
        assert ref.startswith("#/$defs/") and ref.split("/")[-1] in s["$defs"], where


def test_every_secret_field_takes_ciphertext_only():
    s = sch.stack_file_schema()
    assert SecretValue.__name__ not in s["$defs"]
    assert s["$defs"][sch.SECRET_DEF]["required"] == ["secure"]
    for top, sub in SECRET_PATHS:
        refs = sch._refs(s["properties"]["config"]["properties"][ns + top])
        (defn,) = {r.split("/")[-1] for r in refs}
        field = s["$defs"][defn]["properties"][sub]
        assert field["anyOf"] == [{"$ref": f"#/$defs/{sch.SECRET_DEF}"}, {"type": "null"}], (top, sub)
        assert "Pulumi secret" in field["description"]


def test_a_secret_field_missing_from_SECRETS_fails_the_generation(monkeypatch):
    monkeypatch.setattr(sch, "SECRET_PATHS", tuple(p for p in SECRET_PATHS if p != ("router", "apiKey")))
    with pytest.raises(RuntimeError, match="a Secret field is not in config.SECRETS: .*RouterConfig/properties/apiKey"):
        sch.stack_file_schema()
    monkeypatch.setattr(sch, "SECRET_PATHS", SECRET_PATHS + (("router", "host"),))
    with pytest.raises(RuntimeError, match="names router.host, which is not a Secret field"):
        sch.stack_file_schema()
    monkeypatch.setattr(sch, "STACK_KEYS", STACK_KEYS[:-1])
    with pytest.raises(RuntimeError, match="STACK_KEYS .* disagree"):
        sch.stack_file_schema()


# --- every stack file points its editor at the schema ------------------------------------------


def glm_infra_stack_files() -> list[Path]:
    """The stack files that hold glm-infra keys: stacks/ and any example's."""
    out = []
    for p in sorted([*(ROOT / "stacks").glob("Pulumi.*.yaml"), *(ROOT / "examples").glob("*/Pulumi.*.yaml")]):
        cfg = (yaml.safe_load(p.read_text()) or {}).get("config") or {}
        if any(str(k).startswith(ns) for k in cfg):
            out.append(p)
    return out


def test_every_stack_file_carries_the_modeline():
    files = glm_infra_stack_files()
    assert {p.name for p in files} >= {f"Pulumi.{s}.yaml" for s in STACKS} and len(STACKS) >= 5
    for p in files:
        first = p.read_text().splitlines()[0]
        assert first == modeline(p), f"{p.relative_to(ROOT)}: the first line must be {modeline(p)!r}"
        target = (p.parent / first.split("$schema=", 1)[1]).resolve()
        assert target == SCHEMA.resolve()


def test_examples_stack_files_are_not_glm_infra_stack_files():
    """The examples are projects of their own (glm-example:*, handed to components in snake_case); the
    file schema is not theirs. Should one grow glm-infra: keys, the test above asks for the modeline."""
    examples = sorted((ROOT / "examples").glob("*/Pulumi.*.yaml"))
    assert examples
    for p in examples:
        cfg = yaml.safe_load(p.read_text())["config"]
        assert all(str(k).startswith("glm-example:") for k in cfg), p


# --- check-jsonschema: the committed stacks pass, mistakes fail naming the key ------------------


def test_every_committed_stack_passes_check_jsonschema():
    files = glm_infra_stack_files()
    r = check_jsonschema(*files)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok -- validation done" in r.stdout
    for p in files:  # ... and the loader reads them, the modeline being a comment
        assert load_file(p).config.hosts


def _set(doc: dict, key: str, path: list, value) -> dict:
    node = doc["config"].setdefault(ns + key, {}) if path else doc["config"]
    for p in path[:-1]:
        node = node[p]
    node[path[-1] if path else ns + key] = value
    return doc


# (id, edit, what the check-jsonschema output must name, the loader refuses it too)
BAD = [
    ("unknown-glm-infra-key", lambda d: _set(d, "prefil", [], {"hosts": ["b300-1"]}), "'glm-infra:prefil'", True),
    ("snake-case-key", lambda d: _set(d, "instances_per_host", [], 2), "'glm-infra:instances_per_host'", True),
    ("misspelt-nested-key", lambda d: _set(d, "prefill", ["instancePerHost"], 2), "'instancePerHost' was unexpected",
     True),
    ("wrong-type-tp", lambda d: _set(d, "prefill", ["tp"], "one"), "$.config['glm-infra:prefill'].tp: 'one' is not of "
     "type 'integer'", True),
    ("plaintext-secret", lambda d: _set(d, "router", ["apiKey"], "hunter2"), "$.config['glm-infra:router'].apiKey: "
     "'hunter2' is not of type 'object'", True),
    ("secret-with-extra-keys", lambda d: _set(d, "ssh", ["privateKey"], {"secure": "v1:x", "plain": "k"}),
     "$.config['glm-infra:ssh'].privateKey", True),
    # Pulumi ignores an unknown top-level key, a misspelt encryptionsalt too.
    ("unknown-top-level-key", lambda d: {**d, "encryptionSalt": "v1:x"}, "('encryptionSalt' was unexpected)", False),
    ("snake-case-nested-key", lambda d: _set(d, "prefill", ["instances_per_host"], 2),
     "'instances_per_host' was unexpected", True),  # a file spells keys camelCase (components may use snake_case)
    # Pulumi reads a key without a namespace as the project's (glm-infra:hosts); the loader skips it: refused here.
    ("key-without-namespace", lambda d: {**d, "config": {**d["config"], "hosts": []}}, "'hosts' does not match", False),
    ("missing-model", lambda d: {**d, "config": {k: v for k, v in d["config"].items() if k != ns + "model"}},
     "'glm-infra:model' is a required property", True),
    ("environment-not-a-list", lambda d: {**d, "environment": "prod"}, "$.environment", False),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_check_jsonschema_refuses_naming_the_key(case, tmp_path):
    name, edit, named, loader_refuses = case
    p = write(tmp_path, edit(stack_doc()))
    r = check_jsonschema(p)
    assert r.returncode == 1, r.stdout + r.stderr
    assert named in r.stdout, r.stdout
    # The loader's verdict on the same file: it reads only config:, so a mistake outside it is the schema's alone.
    if loader_refuses:
        with pytest.raises(StackError):
            load_file(p)
    else:
        load_file(p)


def _variations() -> dict[str, dict]:
    """Valid stack files unlike the committed ones."""
    prod = stack_doc()
    minimal = {"config": {k: v for k, v in prod["config"].items() if k in (ns + "hosts", ns + "ssh", ns + "model",
                                                                           ns + "firewall")}}
    out = {
        # pools from the BRIEF layout; the router where the layout puts it, with its clients
        "minimal-brief-layout": {"config": {**minimal["config"], ns + "router": {"host": "b300-3",
                                                                                "allowedCidrs": ["10.30.0.0/16"]}}},
        "one-host": {"config": {**minimal["config"], ns + "hosts": prod["config"][ns + "hosts"][:1]}},
        "null-parsers": _set(copy.deepcopy(prod), "model", ["toolCallParser"], None),
        "encrypted-secrets": _set(_set(copy.deepcopy(prod), "router", ["apiKey"], {"secure": "v1:abc"}),
                                  "model", ["hfToken"], {"secure": "v1:def"}),
        "other-namespaces": {**prod, "config": {**prod["config"], "pulumi:tags": {"team": "llm"},
                                                 "command:config:timeout": 5, "glm-example:anything": [1, {"a": None}]}},
        "stack-settings": {**prod, "secretsprovider": "passphrase", "encryptionsalt": "v1:abc",
                           "encryptedkey": "", "environment": ["team/llm"]},
        "environment-definition": {**prod, "environment": {"imports": ["team/llm"]}},
    }
    _set(out["null-parsers"], "model", ["reasoningParser"], None)
    return out


def test_schema_and_loader_accept_the_same_valid_variations(tmp_path):
    files = []
    for name, doc in _variations().items():
        p = write(tmp_path, doc, f"Pulumi.{name}.yaml")
        load_file(p)  # the loader accepts it (raises otherwise)
        files.append(p)
    r = check_jsonschema(*files)
    assert r.returncode == 0, r.stdout + r.stderr
