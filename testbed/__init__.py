"""glm-infra's test bed: what the tests, the benchmarks and scripts/sim stand on, not the product.

- ``cluster``: the simulated cluster (systemd-nspawn hosts on a bridge); ``scripts/sim`` runs it.
- ``standins/``: the stand-in packages the simulated hosts install (debs trees, the vLLM, NIXL and
  FlashInfer stand-ins built into wheels, the model checkpoint and tokenizer makers).
- ``hardware``: the stand-in GPU, RDMA and DCGM tools run against a temporary simulated root.
- ``hub_standin``, ``slow_source``, ``glm5_checkpoint``: a loopback Hugging Face hub, a throttled
  weights source, the synthetic GLM-5 checkpoint headers.
- ``shellscan``: which lines of a shell script are code, and which writes bash would not stop on.
- ``bench/``: what the benchmarks of ``scripts/bench`` share.

Not shipped: the glm-infra wheel packages ``glm_infra`` only (pyproject.toml; tests/test_package.py).
The tests import it through pytest's ``pythonpath`` (pyproject.toml); ``scripts/sim`` runs
``python -m testbed.cluster`` from the repository root; the benchmarks put the root on their path
(scripts/bench/_repo.py).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository
STANDINS = ROOT / "testbed" / "standins"
