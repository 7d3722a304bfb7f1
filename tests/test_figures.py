"""`python -m pipeline_lib.viz.figures DIR` regenerates images/ deterministically."""
import matplotlib

matplotlib.use("Agg")

import errno  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from pipeline_lib import bubble_theory  # noqa: E402
from pipeline_lib.viz.figures import (  # noqa: E402
    MICROBATCHES,
    RANKS,
    VIRTUAL_STAGES,
    main,
    schedule_timelines,
)

EXPECTED = ["naive", "gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "schedules",
            "bubble_vs_microbatches"]


def test_writes_every_figure_as_png_and_the_same_bytes_twice(tmp_path, capsys):
    main([str(tmp_path / "first")])
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / "first" / f"{name}.png") for name in EXPECTED]
    main([str(tmp_path / "second")])
    for name in EXPECTED:
        first = (tmp_path / "first" / f"{name}.png").read_bytes()
        assert first.startswith(b"\x89PNG\r\n\x1a\n"), name
        assert first == (tmp_path / "second" / f"{name}.png").read_bytes(), name


def test_the_drawn_timelines_have_the_bubbles_the_text_quotes():
    p, m, v = RANKS, MICROBATCHES, VIRTUAL_STAGES
    timelines = schedule_timelines()
    assert timelines["naive"].bubble_fraction() == pytest.approx(1 - 1 / p)
    for name in ("gpipe", "1f1b"):
        assert timelines[name].bubble_fraction() == pytest.approx(bubble_theory(p, m))
    assert timelines["interleaved_1f1b"].bubble_fraction() == \
        pytest.approx(bubble_theory(p, m, v))
    # ZB-H1 with F = I = W: each rank idles (p - 1)·F instead of 1F1B's (p - 1)·3F
    assert timelines["zb_h1"].bubble_fraction() == pytest.approx((p - 1) / (3 * m + p - 1))


def test_a_failed_write_keeps_the_last_good_png(tmp_path, monkeypatch):
    """A full disk mid-write must not replace a good PNG with a truncated one."""
    main([str(tmp_path)])
    good = {path.name: path.read_bytes() for path in tmp_path.iterdir()}

    def disk_full(self: Figure, fname: str | Path, **kwargs: object) -> None:
        Path(fname).write_bytes(b"\x89PNG\r\n")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", disk_full)
    with pytest.raises(OSError, match="No space left"):
        main([str(tmp_path)])
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == good
