"""docs/STACK.md is generated from the stack models (glm_infra/tools/stack_doc.py, scripts/gen-stack-doc): it is
current, it names every key with its type and default, and it follows the models when they change."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import Field

from glm_infra.spec import config
from glm_infra.tools import stack_doc

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / stack_doc.DOC_FILE


def row(text: str, key: str) -> list[str]:
    """The cells of a key's row: key, type, default, description."""
    lines = [line for line in text.splitlines() if line.startswith(f"| `{key}` |")]
    assert len(lines) == 1, f"{key}: {len(lines)} rows"
    return [c.strip() for c in lines[0].strip("|").split(" | ")]


def test_the_page_is_what_the_models_give():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-stack-doc"), "--check"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr


def test_a_stale_page_is_caught_and_rewritten_with_its_header(tmp_path):
    """The script on a copy of the project whose page has a wrong default: --check fails, a run fixes it."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "scripts" / "gen-stack-doc", tmp_path / "scripts")
    (tmp_path / "glm_infra").symlink_to(ROOT / "glm_infra")
    good = PAGE.read_text()
    stale = good.replace("| `sla.ttftSeconds` | number (> 0) | `2.5` |", "| `sla.ttftSeconds` | number (> 0) | `3` |")
    assert stale != good
    page = tmp_path / "docs" / "STACK.md"
    page.write_text(stale)
    script = [sys.executable, str(tmp_path / "scripts" / "gen-stack-doc")]
    r = subprocess.run([*script, "--check"], capture_output=True, text=True)
    assert r.returncode == 1 and "docs/STACK.md is out of date" in r.stderr, r.stderr
    subprocess.run(script, check=True, capture_output=True)
    assert page.read_text() == good
    page.write_text("# a header without the marker\n")
    r = subprocess.run([*script, "--check"], capture_output=True, text=True)
    assert r.returncode != 0 and "no generated part" in r.stderr


def test_every_key_of_the_models_has_a_row():
    text = PAGE.read_text()
    keys = stack_doc.keys()
    assert len(keys) > 150
    for key in keys:
        row(text, key)
    # camelCase as in the stack file, nested paths, the list of hosts, an explicit alias
    assert {"prefill.instancesPerHost", "hosts[].computeNics", "decode.all2allBackend",
            "monitoring.webhookUrl"} <= set(keys)


def test_known_keys_with_their_type_and_default():
    text = PAGE.read_text()
    assert row(text, "prefill.instancesPerHost")[1:3] == ["integer (1–16)", "`2`"]
    assert row(text, "decode.instancesPerHost")[1:3] == ["integer (1–16)", "`1`"]
    assert row(text, "router.port")[1:3] == ["port", "`8000`"]
    assert row(text, "router.apiKey")[1:3] == ["secret", "unset"]
    assert row(text, "model.repo")[1:3] == ["string", "required"]
    assert row(text, "router.plainHttp")[1:3] == ["one of `refuse`, `redirect`", "`refuse`"]
    assert row(text, "sla.contexts")[2] == "`[16384, 65536, 131072, 262144]`"
    assert row(text, "sla.window")[1].startswith("duration")
    assert row(text, "firewall.adminCidrs")[1] == "list of address or CIDR (at least 1)"
    assert row(text, "runtime.vllmVersion")[2] == f"`{config.RuntimeConfig().vllm_version}`"
    assert row(text, "hosts[].nvlinks")[3] == config.HostConfig.model_fields["nvlinks"].description
    assert "## `prefill`" in text and "Prefill instances (KV producers)." in text


def test_the_hand_written_header_is_kept():
    text = stack_doc.page("# A header\n\nkept as is\n\n")
    assert text.startswith("# A header\n\nkept as is\n\n" + stack_doc.MARKER)
    with pytest.raises(ValueError, match="no generated part"):
        stack_doc.header_of("# only a header\n")


def test_a_changed_description_changes_the_page(monkeypatch):
    before = stack_doc.generated()
    field = config.RouterConfig.model_fields["retries"]
    monkeypatch.setattr(field, "description", "Attempts | per request.")
    after = stack_doc.generated()
    assert after != before
    assert row(after, "router.retries")[3] == "Attempts \\| per request."


def test_a_field_without_description_is_named(monkeypatch):
    monkeypatch.setattr(config.NixlConfig.model_fields["ucx_tls"], "description", None)
    assert "Fields without a description in the models: NixlConfig.ucx_tls." in stack_doc.generated()


def test_types_of_a_new_field():
    f = Field(7, ge=1, le=9, description="x")
    assert stack_doc.type_name(int, f.metadata) == "integer (1–9)"
    assert stack_doc.type_name(float, Field(1.0, gt=0, le=1).metadata) == "number (> 0, ≤ 1)"
    assert stack_doc.type_name(config.Port) == "port"
    assert stack_doc.type_name(list[config.Cidr] | None) == "list of address or CIDR"
    with pytest.raises(TypeError, match="no stack-file name"):
        stack_doc.type_name(bytes)
