"""The hosts of a stack and how glm-infra reaches them over SSH."""

from __future__ import annotations

import ipaddress
import re

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from .base import HOST_NAME, Secret, StrictModel, is_dns_name


SSH_PUBLIC_KEY = re.compile(r"(ssh-ed25519|ecdsa-sha2-nistp(256|384|521)|ssh-rsa) [A-Za-z0-9+/]{16,}={0,3}( [ -~]*)?")


class HostConfig(StrictModel):
    """One bare-metal server."""

    name: str = Field(description="Short host name, used in resource names and unit paths.")
    address: str = Field(description="Routable address (IPv4, IPv6 or DNS name) used for SSH, NIXL and the router.")
    gpus: int = Field(8, ge=1, le=16, description="GPUs on the host.")
    gpu_model: str = Field("B300", description="GPU model name as nvidia-smi reports it, without 'NVIDIA '.")
    compute_nics: list[str] = Field(
        default_factory=list,
        description="RDMA devices carrying KV traffic (e.g. mlx5_0). Never the NVSwitch-management ConnectX.",
    )
    ssh_port: int = Field(22, ge=1, le=65535, description="SSH port.")
    host_key: str | None = Field(
        None, description="The host's SSH public key, one line as in its /etc/ssh/ssh_host_ed25519_key.pub "
                          "(`ssh-ed25519 AAAA…`), read over a path you trust (its console, your provisioning): glm-infra "
                          "and doctor then connect only to a host that proves it holds it. Unset: whatever answers on "
                          "the address is taken for the host, with a warning.")
    nvlinks: int = Field(18, ge=1, le=72, description="NVLink links per GPU the health gate expects up (18 on HGX B300).")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not HOST_NAME.match(v):
            raise ValueError(f"{v!r} is not a valid host name (lowercase letters, digits and '-', at most 63)")
        return v

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        try:
            ip = ipaddress.ip_address(v)
        except ValueError:
            if is_dns_name(v):
                return v
            raise ValueError(f"{v!r} is not an IP address or DNS name") from None
        if ip.is_unspecified or ip.is_multicast:
            raise ValueError(f"{v!r} cannot address a host")
        return v

    @field_validator("host_key")
    @classmethod
    def _host_key(cls, v: str | None) -> str | None:
        if v is not None and not SSH_PUBLIC_KEY.fullmatch(v.strip()):
            raise ValueError("not an SSH public key line (TYPE BASE64 [COMMENT], TYPE one of ssh-ed25519, "
                             "ecdsa-sha2-nistp256/384/521, ssh-rsa)")
        return v.strip() if v is not None else None

    @field_validator("compute_nics")
    @classmethod
    def _nics(cls, v: list[str]) -> list[str]:
        for nic in v:
            if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*", nic):
                raise ValueError(f"{nic!r} is not an RDMA device name")
        if len(set(v)) != len(v):
            raise ValueError("duplicate NIC")
        return v


class SshConfig(StrictModel):
    """How glm-infra logs in to every host."""

    user: str = Field("root", pattern=r"^[a-z_][a-z0-9_-]*$", description="User glm-infra logs in as (root, or one with sudo-less root).")
    private_key: Secret | None = Field(None, description="Private key, a Pulumi secret.")
    private_key_path: str | None = Field(
        None, description="Path of a private key file on the machine running pulumi (read at run time, kept secret)."
    )
    dial_attempts: int = Field(10, ge=1, le=100, description="Connection attempts to a host before a step fails: a "
                               "host that does not answer fails `up` after about dialAttempts × (dialTimeout + 5) s.")
    dial_timeout: int = Field(10, ge=1, le=300, description="Seconds one connection attempt may take.")

    @model_validator(mode="after")
    def _one_key(self) -> SshConfig:
        if (self.private_key is None) == (self.private_key_path is None):
            raise ValueError("set exactly one of privateKey (a secret) or privateKeyPath")
        return self
