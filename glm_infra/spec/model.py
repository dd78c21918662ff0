"""The model a stack serves: the checkpoint, where it comes from and lands, and the vLLM settings every
instance shares."""

from __future__ import annotations

import posixpath
import re
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from . import pins
from .base import Port, Secret, StrictModel, check_url


class ModelConfig(StrictModel):
    """The checkpoint to serve and where it lives on each host."""

    repo: str = Field(description="Hugging Face repository, e.g. nvidia/GLM-5.2-NVFP4.")
    revision: str = Field(description="Pinned revision (a commit SHA) of the repository.")
    path: str = Field(description="Absolute path of the checkpoint on every host.")
    served_model_name: str = Field("glm-5.2", pattern=r"^[A-Za-z0-9_.][A-Za-z0-9_.:/-]*$", description="--served-model-name: the model name clients ask for.")
    hf_token: Secret | None = Field(None, description="Hugging Face token, a Pulumi secret.")
    weight_format: Literal["nvfp4", "fp8", "bf16"] | None = Field(
        None, description="The checkpoint's weight format, checked against the hosts' GPUs (NVFP4 needs Blackwell). "
                          "Default: what the repository's name says (…-NVFP4, …-FP8); null: not checked.")
    # Model-wide serving flags of the recipe (docs/RECIPE.md); prefill and decode must agree on them.
    trust_remote_code: bool = Field(True, description="--trust-remote-code (the GLM-5 checkpoint ships its own code).")
    chat_template_content_format: str | None = Field(
        "string", pattern=r"^[a-z]+$", json_schema_extra=pins.schema_enum("chatTemplateContentFormat"),
        description="--chat-template-content-format (None: leave vLLM's default).")
    tool_call_parser: str | None = Field("glm47", pattern=r"^[a-z0-9_-]+$", json_schema_extra=pins.schema_enum("toolCallParser"),
                                         description="--tool-call-parser (None: none).")
    enable_auto_tool_choice: bool = Field(True, description="--enable-auto-tool-choice.")
    reasoning_parser: str | None = Field("glm45", pattern=r"^[a-z0-9_]+$", json_schema_extra=pins.schema_enum("reasoningParser"),
                                         description="--reasoning-parser (None: none).")
    enable_prompt_tokens_details: bool = Field(True, description="--enable-prompt-tokens-details.")
    fingerprint_mode: str | None = Field("none", pattern=r"^[a-z0-9_]+$", json_schema_extra=pins.schema_enum("fingerprintMode"),
                                         description="--fingerprint-mode (None: leave it out).")
    kv_cache_dtype: str | None = Field(
        None, pattern=r"^[a-z0-9_]+$", json_schema_extra=pins.schema_enum("kvCacheDtype"),
        description="--kv-cache-dtype of both pools (None: leave it out, vLLM's auto: fp8_ds_mla for a DSA "
                    "model such as GLM-5). Capacity planning counts the KV bytes per token of this layout.")
    max_model_len: int | None = Field(
        None, ge=1, le=16_777_216,
        description="--max-model-len of both pools: the longest request (prompt + output) the stack promises. "
                    "None: leave it out (vLLM and capacity planning use the model's max_position_embeddings).")
    speculative_method: str = Field("mtp", pattern=r"^[a-z0-9_]+$", json_schema_extra=pins.schema_enum("speculativeMethod"),
                                    description="MTP method (P and D must match).")
    # Staging of the weights (ModelWeights).
    source: Literal["huggingface", "mirror", "local"] = Field(
        "huggingface", description="huggingface (repo@revision via the hf CLI), mirror (HTTP(S) with manifest), "
        "local (already at path on every host: verify only)."
    )
    mirror_url: str | None = Field(None, description="Mirror base URL: files and manifest.json under URL/REVISION/.")
    seed_host: str | None = Field(None, description="Host that downloads from the source (default: first serving host).")
    fanout_port: Port = Field(8090, description="Port a host serves its verified files on to the hosts that copy from it (weights relay).")
    relay_stall_seconds: int | None = Field(
        None, ge=5, le=3600,
        description="Seconds without progress before a relay peer leaves the host it copies from, and before a host "
                    "stops waiting for a child that went silent (weights.py --stall). None: weights.py's own, 120.")
    disk_margin_gb: float = Field(20, ge=0, description="Free space required beyond the checkpoint.")
    hf_hub_version: str = Field(pins.HF_HUB, pattern=r"^[0-9][A-Za-z0-9.+_-]*$", description="huggingface_hub pin (hf CLI).")
    verify: str = Field("", description="Change to re-verify (and repair) the checkpoint on every host.")
    remove_on_destroy: bool = Field(False, description="Delete the weights on pulumi destroy (default: keep).")

    @field_validator("repo")
    @classmethod
    def _repo(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", v):
            raise ValueError(f"{v!r} is not an 'owner/name' repository id")
        return v

    @field_validator("revision")
    @classmethod
    def _revision(cls, v: str) -> str:
        # A folder name under PATH.revisions (prune deletes its siblings): no '.', '..' or leading '-'.
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}", v) or set(v) <= {"."}:
            raise ValueError(f"{v!r} is not a revision (a commit SHA, a tag or a branch name)")
        return v

    @field_validator("mirror_url")
    @classmethod
    def _mirror_url(cls, v: str | None) -> str | None:
        return None if v is None else check_url(v)

    @model_validator(mode="before")
    @classmethod
    def _weight_format_of_the_repo(cls, data: Any) -> Any:
        """No weightFormat given: the one the repository's name says (GLM-5.2-NVFP4 → nvfp4)."""
        if isinstance(data, dict) and not ({"weightFormat", "weight_format"} & set(data)):
            name = str(data.get("repo", "")).upper()
            fmt = "nvfp4" if "NVFP4" in name else "fp8" if "FP8" in name else None
            return {**data, "weight_format": fmt}
        return data

    @model_validator(mode="after")
    def _source_settings(self) -> ModelConfig:
        if self.source == "mirror" and not self.mirror_url:
            raise ValueError("source mirror needs mirrorUrl")
        return self

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"{v!r} is relative; the model path must be absolute")
        if posixpath.normpath(v) != v or v == "/":
            raise ValueError(f"{v!r} is not a normalised absolute path")
        if not re.fullmatch(r"[A-Za-z0-9_./+-]+", v):
            raise ValueError(f"{v!r} has characters that cannot appear in a unit file path")
        return v
