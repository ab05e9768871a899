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
