"""`python -m loadtests.experiment`: its help shows every default, and a run ends with the
stock-against-tuned verdicts before the detail."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.experiment import PRESETS, parse

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("profile", list(PRESETS))
def test_help_shows_every_default_of_the_chosen_profile(
    profile: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each option's help line ends with its default, the preset's own where it sets one."""
    with pytest.raises(SystemExit):
        parse(["--profile", profile, "--help"])
    out = capsys.readouterr().out
    options = re.findall(r"^  --[a-z-]+", out, re.M)
    text = " ".join(out.split())
    assert len(options) >= 14 and text.count("(default: ") == len(options)
    for value in PRESETS[profile].values():
        assert f"(default: {value})" in text
    assert "(default: ['stock', 'tuned'])" in text


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_short_run_prints_the_verdicts_first(tmp_path: Path) -> None:
    """One 5-request burst per sshd profile: the output and comparison.md open with the
    verdicts (p99, throughput and failure rate per burst size), the table comes after."""
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.experiment", "--pool-modes", "channels",
         "--burst-sizes", "5", "--repeats", "1", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=55,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    (run,) = tmp_path.glob("*-experiment")
    text = (run / "comparison.md").read_text()
    assert text.startswith("## Verdicts: tuned against stock")
    assert text.index("| asyncssh/channels/burst | burst 5 | 1, 1 |") < text.index(
        "# Experiment comparison"
    )
    assert "failure rate" in text.splitlines()[4]
    printed = output[output.index("## Verdicts") :]
    assert printed.index("burst 5") < printed.index("# Experiment comparison")
