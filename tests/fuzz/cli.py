"""Run the command line in-process and check the contract every input must meet."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence

from parallel_state_ng.__main__ import main


def run_cli(argv: Sequence[str], codes: Sequence[int]) -> tuple[int, str, str]:
    """``main(argv)``: no exception escapes, the exit code is one of ``codes``, exit 2 prints one line."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    message = err.getvalue()
    assert code in codes, (argv, code, message[-500:])
    assert "Traceback" not in message, message[-2000:]
    if code == 2:
        assert message.startswith("parallel-state-ng") or message.startswith("usage:"), message[:300]
        if not message.startswith("usage:"):  # argparse's own errors print the usage first
            assert message.count("\n") == 1, message[:2000]
        assert len(message) < 4000, f"{len(message)} characters of error"
    return code, out.getvalue(), message
