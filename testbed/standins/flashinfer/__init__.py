"""Stand-in for FlashInfer (flashinfer-python) on glm-infra's simulated cluster: importable and
versioned, so `vllm download-kernels` has a version to match its kernels to."""

from importlib.metadata import version

__version__ = version("flashinfer-python")
