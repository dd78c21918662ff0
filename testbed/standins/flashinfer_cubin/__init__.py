"""Stand-in for flashinfer-cubin, FlashInfer's precompiled kernels: what `vllm download-kernels`
installs. On a real host it holds the cubins; here only its version matters."""

from importlib.metadata import version

__version__ = version("flashinfer-cubin")
