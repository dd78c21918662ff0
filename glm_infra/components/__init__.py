"""Pulumi components of glm-infra, one per file, each with its flat typed Args beside it."""

from .cluster import Cluster, ClusterArgs
from .drivers import Drivers, DriversArgs
from .fabric import Fabric, FabricArgs
from .host import Host, HostArgs
from .nixl import Nixl, NixlArgs
from .rdma import Rdma, RdmaArgs
from .router import Router, RouterArgs
from .runtime import Runtime, RuntimeArgs
from .vllm_service import VllmService, VllmServiceArgs
from .weights import ModelWeights, ModelWeightsArgs, WeightsHost

__all__ = [
    "Cluster", "ClusterArgs", "Drivers", "DriversArgs", "Fabric", "FabricArgs", "Host", "HostArgs",
    "ModelWeights", "ModelWeightsArgs", "Nixl", "NixlArgs", "Rdma", "RdmaArgs", "Router", "RouterArgs",
    "Runtime", "RuntimeArgs", "VllmService", "VllmServiceArgs", "WeightsHost",
]
