"""The test suite, one package per layer (see conftest.py for markers and fixtures)."""
