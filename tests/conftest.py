from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STACKS = sorted(p.name[len("Pulumi.") : -len(".yaml")] for p in (ROOT / "stacks").glob("Pulumi.*.yaml"))
PROD_STACKS = [s for s in STACKS if s != "sim"]


def stack_file(name: str) -> Path:
    return ROOT / "stacks" / f"Pulumi.{name}.yaml"


def stack_config(name: str) -> dict:
    """The ``config:`` mapping of a committed stack, as a fresh dict."""
    return copy.deepcopy(yaml.safe_load(stack_file(name).read_text())["config"])


@pytest.fixture
def prod_config() -> dict:
    return stack_config("prod-b300")


@pytest.fixture
def write_stack(tmp_path):
    """Write a ``config:`` mapping (or raw text) as a stack file and return its path."""

    def write(config: dict | str, name: str = "Pulumi.test.yaml") -> Path:
        p = tmp_path / name
        p.write_text(config if isinstance(config, str) else yaml.safe_dump({"config": config}, sort_keys=False))
        return p

    return write
