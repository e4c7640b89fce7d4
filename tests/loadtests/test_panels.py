"""loadtests.panels draws the pool dashboard's panels from a real Prometheus scraping an API
under a burst: the PNG is written and each panel drew the series Prometheus answered."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loadtests import panels

pytestmark = pytest.mark.skipif(
    not os.access(panels.PROMETHEUS, os.X_OK),
    reason="prometheus missing: `make prometheus` installs it",
)


def test_panels_draws_the_pool_dashboard_during_a_burst(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn: dict[str, list[tuple[str, list[tuple[float, float]]]]] = {}
    draw = panels.draw

    def keep(series: dict[str, list[tuple[str, list[tuple[float, float]]]]], out: Path) -> Path:
        drawn.update(series)
        return draw(series, out)

    monkeypatch.setattr(panels, "draw", keep)
    # 48 jobs of 1.5 s, 24 at once: about 3 s of used connections, three 1-s scrapes at least
    # (0.2-s jobs were over between two scrapes once, on an idle box).
    args = ["--out", str(tmp_path), "--jobs", "48", "--in-flight", "24", "--seconds", "1.5"]
    assert panels.main(args) == 0
    png = tmp_path / "pool-panels.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(drawn) == set(panels.PANELS)
    legends = {legend for lines in drawn.values() for legend, _ in lines}
    assert {"local used", "local idle", "local max", "p99 local"} <= legends, legends
    # The burst showed: at some moment a connection was in use.
    used = next(
        points for legend, points in drawn["Connections by state"] if legend == "local used"
    )
    assert max(v for _, v in used) >= 1
