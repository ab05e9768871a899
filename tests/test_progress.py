"""headlab._util.progress: a stop request ends every tracked loop, bars on or off."""

from __future__ import annotations

import pytest

from headlab._util import progress as _progress


@pytest.mark.parametrize("bars", [False, True])
def test_a_stop_request_interrupts_the_next_item(monkeypatch, bars):
    monkeypatch.setattr(_progress, "_enabled", bars)
    monkeypatch.setattr(_progress, "_stop_requested", False)
    seen = []
    with pytest.raises(KeyboardInterrupt):
        for i in _progress.track(range(10), total=10):
            seen.append(i)
            if i == 2:
                # as if a signal handler's KeyboardInterrupt had been dropped in a finaliser
                _progress.request_stop()
    assert seen == [0, 1, 2]


def _bars_on(monkeypatch):
    """Progress on, drawn on a captured stderr (rich reads sys.stderr when it starts)."""
    import sys

    from rich.console import Console

    monkeypatch.setattr(_progress, "_enabled", True)
    monkeypatch.setattr(_progress, "_stop_requested", False)
    monkeypatch.setattr(_progress, "_console", lambda: Console(
        file=sys.stderr, force_terminal=True, width=120))


def test_a_bar_counts_tokens_not_batches(monkeypatch, capsys):
    import torch

    _bars_on(monkeypatch)
    batches = [{"attention_mask": torch.ones(4, 64)}, {"attention_mask": torch.ones(2, 64)}]
    assert [_progress.tokens_in(b) for b in batches] == [256, 128]
    seen = list(_progress.track(batches, total=384, size=_progress.tokens_in, unit="tokens",
                                description="evaluating"))
    assert seen == batches
    err = capsys.readouterr().err
    assert "384/384" in err and "tokens/s" in err and "2/2" not in err


def test_a_spinner_shows_its_phase_and_quiet_silences_everything(monkeypatch, capsys):
    _bars_on(monkeypatch)
    with _progress.spinner("timing the pruned model"):
        pass
    assert "timing the pruned model" in capsys.readouterr().err
    monkeypatch.setattr(_progress, "_enabled", False)  # what --quiet and --json set
    with _progress.spinner("timing the pruned model"):
        list(_progress.track(range(3), total=3, description="scoring heads"))
    assert capsys.readouterr().err == ""


def test_quiet_turns_progress_off_and_a_terminal_turns_it_on(monkeypatch):
    import sys

    from headlab.cli.common import setup

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    try:
        setup(quiet=False, json_mode=False)
        assert _progress.enabled()
        setup(quiet=True, json_mode=False)
        assert not _progress.enabled()
        setup(quiet=False, json_mode=True)
        assert not _progress.enabled()
    finally:
        _progress.set_enabled(False)

