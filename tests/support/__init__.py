"""What the tests share: model facts, a service process, launcher processes, local ports.

Tests import from here (and fixtures from tests/conftest.py), never from ``benchmarks``;
benchmarks may import from here. One module a concept, as in src/.
"""
