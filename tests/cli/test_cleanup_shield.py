"""The cleanup shield of `justllm cluster deploy`: a Ctrl-C while the command undoes what it
started is said, not raised (a second Ctrl-C cut the Ray head's stop short and left it
running); one at any other time interrupts as ever. The real thing, a Ray head stopped under a
second Ctrl-C: tests/cluster/test_cli.py."""

from __future__ import annotations

import signal

import pytest

from justllm.cli.cleanup_shield import CleanupShield


def test_a_ctrl_c_during_the_cleanup_is_said_once_and_the_cleanup_goes_on(python_ctrl_c):
    said: list[str] = []
    with CleanupShield(lambda: said.append("still cleaning up")) as shield:
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        done = []
        with shield.shielded():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            done.append("cleaned up")
        assert done == ["cleaned up"] and said == ["still cleaning up"]
        with pytest.raises(KeyboardInterrupt):  # the cleanup over: Ctrl-C interrupts again
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_ignored_sigint_stays_ignored():
    """A background job (`deploy &`) ignores SIGINT: the shield leaves it so."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with CleanupShield(lambda: None):
            signal.raise_signal(signal.SIGINT)
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
