"""Tests of the simulated cluster's stand-ins (hardware tools, vLLM, wheels), apart from the
product's tests: they check that the stand-ins behave like the real things they replace."""
