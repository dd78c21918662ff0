# shellcheck shell=bash
# Pinned versions of everything the toolchain and the simulated cluster build. One place to bump.

# Pulumi CLI (module github.com/pulumi/pulumi/pkg/v3, main package cmd/pulumi).
PULUMI_VERSION=3.274.1
# Python language host. Since v3.80 it lives in its own module
# (github.com/pulumi/pulumi/sdk/python/cmd/pulumi-language-python/v3), which the Go module proxy
# reachable here does not serve at any version; v3.79.0 is the last release where it is part of
# github.com/pulumi/pulumi/sdk/v3, which is served. It runs the exec shim of PULUMI_VERSION.
PULUMI_LANGHOST_VERSION=3.79.0
# pulumi-resource-command, matching the pulumi-command Python SDK pinned in pyproject.toml.
PULUMI_COMMAND_VERSION=1.2.1
# llm-d-inference-sim, the vLLM stand-in of the simulated cluster.
LLM_D_SIM_VERSION=0.10.2
# Debian release of the simulated hosts' root file system.
SIM_DEBIAN_SUITE=bookworm
