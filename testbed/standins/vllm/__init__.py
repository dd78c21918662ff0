"""Stand-in for vLLM on glm-infra's simulated cluster (no GPUs): ``vllm serve`` validates what a real
vLLM validates, then serves llm-d-inference-sim behind a proxy that models vLLM's lifecycle."""

from importlib.metadata import version

# The wheel's metadata is the single source of the version (build-wheels sets it).
__version__ = version("vllm")
