"""What the benchmarks under scripts/bench share: a throwaway copy of the project, generated stacks,
the helpers the tests check (tests/test_fleet.py, tests/test_fleet_noop.py) and the stand-in host of
the no-op benchmark (standin-host.sh)."""
