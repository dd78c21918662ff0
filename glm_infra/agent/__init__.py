"""The programs glm-infra runs on the hosts themselves, each one stdlib-only file that is copied to
the host as it is: ``hostcheck/`` (facts, preflight, health), ``canary/`` and ``weights/`` (staging, the relay
between hosts), packages that ``bundle.py`` makes one file each for the host, and ``unit_memory.py``."""
