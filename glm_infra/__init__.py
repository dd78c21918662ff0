"""glm-infra: GLM-5.2-NVFP4 on vLLM with P/D disaggregation on NVIDIA B300 servers, as Pulumi components.

    from . import Cluster
    cluster = Cluster("glm", {"hosts": [...], "ssh": {...}, "model": {...}})

``Cluster`` is the whole deployment; ``Hosts`` provisions servers without serving; both monitor what
they deploy (``Monitoring``); the lower components (``Host``, ``Drivers``, ``HostStep``,
``ModelWeights``, ``VllmService``, ``Router``, ``Monitoring``) take
the steps of the per-host plan (``glm_infra.hostplan``). ``ClusterArgs`` and its parts
(``HostInput``, ``ModelInput``, … in ``glm_infra.args``) are the stack file's keys in snake_case;
``glm_infra.stack.load_file`` reads a stack file.
"""

from .args import (
    ClusterArgs,
    ColocatedInput,
    DecodeInput,
    DriversInput,
    HostInput,
    HostsArgs,
    ModelInput,
    MonitoringInput,
    NixlInput,
    PrefillInput,
    PreflightInput,
    RdmaInput,
    RouterInput,
    RuntimeInput,
    SlaInput,
    SshInput,
)
from .components import (
    Cluster,
    Drivers,
    DriversArgs,
    Host,
    HostArgs,
    Hosts,
    HostStep,
    HostStepArgs,
    InvalidArgsError,
    ModelWeights,
    ModelWeightsArgs,
    MonitoredHost,
    Monitoring,
    MonitoringArgs,
    Router,
    RouterArgs,
    VllmService,
    VllmServiceArgs,
    WeightsHost,
)

__version__ = "0.2.0"

__all__ = [
    "Cluster", "ClusterArgs", "ColocatedInput", "DecodeInput", "Drivers", "DriversArgs", "DriversInput", "Host",
    "HostArgs", "HostInput", "HostStep", "HostStepArgs", "Hosts", "HostsArgs", "InvalidArgsError", "ModelInput", "ModelWeights",
    "ModelWeightsArgs", "MonitoredHost", "Monitoring", "MonitoringArgs", "MonitoringInput", "NixlInput", "PrefillInput", "PreflightInput", "RdmaInput", "Router", "RouterArgs",
    "RouterInput", "RuntimeInput", "SlaInput", "SshInput", "VllmService", "VllmServiceArgs", "WeightsHost",
]
