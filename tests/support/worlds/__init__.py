"""Worlds for the failure and split-path tests (simulated ranks and persistent gloo worlds are
:mod:`parallel_state_ng.testing.worlds`).
"""
