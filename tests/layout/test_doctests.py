"""The examples in the engine's docstrings are true."""

import doctest

import parallel_state_ng.layout.named_layout


def test_layout_docstring_examples():
    failures, tried = doctest.testmod(parallel_state_ng.layout.named_layout, raise_on_error=False)
    assert tried > 0 and failures == 0
