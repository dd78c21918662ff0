"""The JSON Schema of a whole stack file (``stacks/Pulumi.<stack>.yaml``), for editors and
``check-jsonschema``, made from the model in ``config.py`` and nothing else.

The file is what Pulumi reads: its stack settings keys (``config``, ``encryptionsalt``, …) at the top,
and under ``config`` one ``glm-infra:<key>`` per top-level key of ``StackConfig`` (camelCase, as in
the file), each with the model's schema of that key, descriptions included. Keys of other namespaces
(``pulumi:``, ``command:``) may hold anything; an unknown ``glm-infra:`` key is an error, as in the
loader. The secret fields (``config.SECRETS``) are ``{secure: <ciphertext>}`` in a file: plaintext is
refused, as ``stack._secret_problems`` does.

``schemas/stack.schema.json`` is this schema as ``glm-infra schema`` prints it; a test fails when it
is stale.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from glm_infra.spec.config import NAMESPACE, SECRET_PATHS, STACK_KEYS, SecretValue, StackConfig

DRAFT = "https://json-schema.org/draft/2020-12/schema"
SCHEMA_FILE = "schemas/stack.schema.json"  # relative to the project folder
REGENERATE = f"venv/bin/glm-infra schema > {SCHEMA_FILE}"
SECRET_DEF = "PulumiSecret"

# Pulumi's stack settings file (sdk/go/common/workspace/project.go, ProjectStack): the keys besides
# ``config``; anything else at the top of the file is refused.
_SETTINGS = {
    "secretsprovider": {
        "type": "string",
        "description": "The secrets provider that encrypts the stack's secrets (default: the backend's; passphrase, "
                       "awskms://…, azurekeyvault://…, gcpkms://…, hashivault://…).",
    },
    "encryptedkey": {
        "type": "string",
        "description": "The KMS-encrypted data key the secrets are encrypted with (cloud secrets providers only).",
    },
    "encryptionsalt": {
        "type": "string",
        "description": "The stack's base64 encoded encryption salt (the passphrase secrets provider only).",
    },
    "environment": {
        "anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "object"}],
        "description": "Pulumi ESC: the environments to import, or an environment definition. glm-infra reads "
                       "its keys from config: in this file; `glm-infra validate` does not read an environment.",
    },
}

# A key of another namespace: Pulumi takes ``<namespace>:<name>`` (and the old ``<namespace>:config:<name>``).
_OTHER_NAMESPACE = rf"^(?!{NAMESPACE}:)[^:]+:(config:)?[^:]+$"


def model_schema() -> dict[str, Any]:
    """The schema of ``StackConfig`` by alias: the ``glm-infra:*`` keys without their prefix."""
    return StackConfig.model_json_schema(by_alias=True)


def stack_file_schema() -> dict[str, Any]:
    """The schema of a whole stack file (draft 2020-12)."""
    inner = copy.deepcopy(model_schema())
    defs: dict[str, Any] = inner.pop("$defs", {})
    props: dict[str, Any] = inner["properties"]
    if set(props) != set(STACK_KEYS):
        raise RuntimeError(f"config.STACK_KEYS {sorted(STACK_KEYS)} and the fields of StackConfig {sorted(props)} "
                           "disagree")
    _secrets_as_ciphertext(props, defs)
    _enum_into_branches(inner)
    _enum_into_branches(defs)
    config = {
        "type": "object",
        "description": f"The stack's configuration: the {NAMESPACE}:* keys of glm-infra (an unknown one is an "
                       "error) and keys of other namespaces (pulumi:, command:, …), not checked here.",
        "properties": {f"{NAMESPACE}:{k}": props[k] for k in STACK_KEYS},
        "required": [f"{NAMESPACE}:{k}" for k in inner.get("required", ())],
        "patternProperties": {_OTHER_NAMESPACE: {}},
        "additionalProperties": False,
    }
    return {
        "$schema": DRAFT,
        "title": f"{NAMESPACE} stack file (stacks/Pulumi.<stack>.yaml)",
        "description": f"A Pulumi stack settings file of the {NAMESPACE} project. Generated from "
                       f"glm_infra.spec.config.StackConfig: {REGENERATE}",
        "type": "object",
        "properties": {"config": config, **_SETTINGS},
        "required": ["config"],
        "additionalProperties": False,
        "$defs": dict(sorted(defs.items())),
    }


def dumps(schema: dict[str, Any]) -> str:
    """The text of ``schemas/stack.schema.json``."""
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def _secrets_as_ciphertext(props: dict[str, Any], defs: dict[str, Any]) -> None:
    """Every secret field takes ``{secure: "<ciphertext>"}`` (or null): what ``pulumi config set
    --secret`` writes. The model's own ``SecretValue`` (a decrypted value, in a Pulumi run) goes."""
    plain = f"#/$defs/{SecretValue.__name__}"
    secret = f"#/$defs/{SECRET_DEF}"
    for top, sub in SECRET_PATHS:
        names = {ref.rsplit("/", 1)[1] for ref in _refs(props[top])}
        fields = [defs[n]["properties"][sub] for n in names if sub in defs[n].get("properties", {})]
        if len(fields) != 1 or plain not in _refs(fields[0]):
            raise RuntimeError(f"config.SECRETS names {top}.{sub}, which is not a Secret field of StackConfig")
        _replace_refs(fields[0], plain, secret)
    left = [path for path in _ref_paths(defs, "$defs") if path[1] == plain]
    if left:
        raise RuntimeError(f"a Secret field is not in config.SECRETS: {left[0][0]}")
    defs.pop(SecretValue.__name__, None)
    defs[SECRET_DEF] = {
        "type": "object",
        "title": "Pulumi secret",
        "description": "A Pulumi secret: the ciphertext `pulumi config set --secret --path "
                       f"'{NAMESPACE}:<key>.<field>' < FILE` writes. Plaintext is refused in a stack file.",
        "properties": {"secure": {"type": "string", "description": "Ciphertext of the stack's secrets provider."}},
        "required": ["secure"],
        "additionalProperties": False,
    }


def _enum_into_branches(node: Any) -> None:
    """pydantic puts a field's ``json_schema_extra`` enum beside ``anyOf: [string, null]``, where it
    refuses null too (``toolCallParser: null`` is allowed); it belongs to the non-null branches."""
    if isinstance(node, dict):
        branches = node.get("anyOf")
        if "enum" in node and isinstance(branches, list) and {"type": "null"} in branches:
            enum = node.pop("enum")
            for b in branches:
                if b != {"type": "null"}:
                    b["enum"] = enum
        for v in node.values():
            _enum_into_branches(v)
    elif isinstance(node, list):
        for v in node:
            _enum_into_branches(v)


def _refs(node: Any) -> set[str]:
    return {ref for _, ref in _ref_paths(node, "")}


def _ref_paths(node: Any, path: str) -> list[tuple[str, str]]:
    """(where, target) of every ``$ref`` below ``node``."""
    out: list[tuple[str, str]] = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                out.append((path, v))
            else:
                out += _ref_paths(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _ref_paths(v, f"{path}/{i}")
    return out


def _replace_refs(node: Any, old: str, new: str) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref" and v == old:
                node[k] = new
            else:
                _replace_refs(v, old, new)
    elif isinstance(node, list):
        for v in node:
            _replace_refs(v, old, new)
