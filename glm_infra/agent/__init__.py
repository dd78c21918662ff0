"""The programs glm-infra runs on the hosts themselves, each one stdlib-only file that is copied to
the host as it is: ``hostcheck.py`` (facts, preflight, health) and ``weights.py`` (staging, the relay between hosts)."""
