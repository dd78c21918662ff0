"""Pulumi components of glm-infra, one per file, each with its flat typed Args beside it."""

from .cluster import Cluster, ClusterArgs
from .host import Host, HostArgs
from .router import Router, RouterArgs
from .vllm_service import VllmService, VllmServiceArgs

__all__ = [
    "Cluster",
    "ClusterArgs",
    "Host",
    "HostArgs",
    "Router",
    "RouterArgs",
    "VllmService",
    "VllmServiceArgs",
]
