"""Pulumi components of glm-infra, one per file, each with its Args beside it."""

from .cluster import Cluster, Hosts, InvalidArgsError
from .drivers import Drivers, DriversArgs
from .host import Host, HostArgs
from .host_step import HostStep, HostStepArgs
from .monitoring import MonitoredHost, Monitoring, MonitoringArgs
from .router import Router, RouterArgs
from .vllm_service import VllmService, VllmServiceArgs
from .weights import ModelWeights, ModelWeightsArgs, WeightsHost

__all__ = [
    "Cluster", "Drivers", "DriversArgs", "Host", "HostArgs", "HostStep", "HostStepArgs", "Hosts",
    "InvalidArgsError", "ModelWeights", "ModelWeightsArgs", "MonitoredHost", "Monitoring", "MonitoringArgs", "Router", "RouterArgs", "VllmService",
    "VllmServiceArgs", "WeightsHost",
]
