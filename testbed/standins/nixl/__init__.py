"""Stand-in for NIXL on glm-infra's simulated cluster: importable and versioned, nothing more.
The stand-in vllm models the NIXL side channel itself."""

from importlib.metadata import version

__version__ = version("nixl")
