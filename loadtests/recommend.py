"""The experiment's last word: for each setting of sshd_config.tuned, apply it or leave sshd at
stock, with the figure that decides. Pure logic over the verdicts (loadtests.verdict) and the
comparison rows (loadtests.experiment.compare) of one run.

A setting is judged on the cell where it acts on the API's load (`ACTS_ON`): the handshake
limit (MaxStartups) and the penalties' exemption on the per-request cell, where every request
opens a connection; the channels per connection (MaxSessions) on the channels cell, where 16
commands share one connection. The experiment compares the whole tuned file against stock, so
in such a cell the other settings run too; those act on no load the experiment makes (they
reap dead sessions, bound a stalled login, drop a per-login file), which is why the cell's
difference is taken as this setting's. For them (`KEPT_FOR`) the experiment can show a cost
only: they are applied for their stated reason unless some cell shows tuned worse.

- a cell where tuned is worse on any measure (p99, throughput, failure rate: the verdict's 95%
  interval entirely on the bad side) -> "leave at stock", with that figure;
- else a cell where tuned is better on any measure -> "apply", with that figure;
- else (indistinguishable) -> the setting's reason decides (`EVEN`): headroom the single API of
  the experiment cannot need is "apply" (no cost measured), a limit that buys nothing here is
  "leave at stock";
- no cell of its pool mode in the run, or no valid repeat on a side -> "not measured".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loadtests.verdict import Interval

APPLY = "apply"
STOCK = "leave at stock"
UNMEASURED = "not measured"

# keyword (lower case) -> the pool mode whose cell exercises it.
ACTS_ON: dict[str, str] = {
    "maxstartups": "per-request",
    "persourcemaxstartups": "per-request",
    "persourcepenaltyexemptlist": "per-request",
    "persourcepenalties": "per-request",
    "maxsessions": "channels",
}
# keyword (lower case) -> what it is for, where no load of the experiment exercises it.
KEPT_FOR: dict[str, str] = {
    "logingracetime": "a stalled handshake holds a MaxStartups slot 30 s, not 120 s",
    "clientaliveinterval": "sessions of a crashed replica or cut network reaped in ~2 min",
    "clientalivecountmax": "sessions of a crashed replica or cut network reaped in ~2 min",
    "tcpkeepalive": "the default, stated",
    "usedns": "the default, stated: no reverse DNS per handshake",
    "permituserrc": "one writer of ~/.ssh/rc would run code as every API user of the account",
}
# keyword (lower case) -> the recommendation when its cell shows no difference.
EVEN: dict[str, str] = {
    "maxstartups": APPLY,  # headroom for several replicas reconnecting at once
    "maxsessions": APPLY,  # room above the pool's 8 channels for kill channels
    "persourcepenaltyexemptlist": APPLY,  # a certificate host's researchers share one source
    "persourcemaxstartups": STOCK,  # a cap on the API's own source buys nothing
    "persourcepenalties": STOCK,
}


def _share(i: Interval) -> str:
    return f"{i.point:+.1%} [{i.low:+.1%}, {i.high:+.1%}]"


def _rate(i: Interval) -> str:
    return f"{i.point:+.1f}/s [{i.low:+.1f}, {i.high:+.1f}]"


def _ms(i: Interval) -> str:
    return f"{i.point:+.1f} ms [{i.low:+.1f}, {i.high:+.1f}]"


# (verdict row key, name, format of its interval), in the order a finding is reported.
MEASURES: tuple[tuple[str, str, Callable[[Interval], str]], ...] = (
    ("failure_rate", "failure rate", _share),
    ("throughput", "throughput", _rate),
    ("p99", "p99", _ms),
)


@dataclass(frozen=True, slots=True)
class Recommendation:
    keyword: str
    value: str
    advice: str  # APPLY, STOCK or UNMEASURED
    figure: str  # the row that decides, or why there is none


def _pool_mode(cells: str) -> str:
    return cells.split("/")[1]  # "backend/pool_mode/profile"


def _findings(row: dict[str, Any], word: str) -> list[str]:
    """The measures of a verdict row whose verdict says tuned `word` ("worse", "better")."""
    found = []
    for key, name, fmt in MEASURES:
        if row[f"{key}_verdict"].endswith(f" {word}"):
            interval: Interval = row[f"{key}_diff_ms" if key == "p99" else f"{key}_diff"]
            found.append(f"{row['cells']} {row['load']}: {name} {fmt(interval)}")
    return found


def _log_lines(rows: list[dict[str, Any]], mode: str) -> str:
    """sshd's log lines of limits refusing the API in the cells of `mode`: stock, tuned."""
    counts: dict[str, dict[str, int]] = {}
    for r in rows:
        if r["pool_mode"] == mode:
            for kind, n in r["sshd_refusals"].items():
                counts.setdefault(kind, {}).setdefault(r["sshd"], 0)
                counts[kind][r["sshd"]] += n
    shown = [
        f"{kind} lines stock {c.get('stock', 0)}, tuned {c.get('tuned', 0)}"
        for kind, c in sorted(counts.items())
        if any(c.values())
    ]
    return f" (sshd log: {'; '.join(shown)})" if shown else ""


def recommend(
    settings: list[tuple[str, str]],
    verdicts: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    skipped: list[str] | None = None,
) -> list[Recommendation]:
    """One recommendation per setting of the tuned sshd (`settings`: keyword, value as it ran),
    then one per keyword its sshd was too old for (`skipped`)."""
    out = []
    worse_anywhere = [f for v in verdicts for f in _findings(v, "worse")]
    for keyword, value in settings:
        key = keyword.lower()
        if key in KEPT_FOR:
            if worse_anywhere:
                figure = (
                    f"{KEPT_FOR[key]}; no load here exercises it (tuned worse only in "
                    f"{worse_anywhere[0].split(':')[0]}, that cell's own setting's doing)"
                )
            elif verdicts:
                figure = f"{KEPT_FOR[key]}; no cost: tuned worse in none of {len(verdicts)} rows"
            else:
                out.append(Recommendation(keyword, value, UNMEASURED, "no verdict rows"))
                continue
            out.append(Recommendation(keyword, value, APPLY, figure))
            continue
        mode = ACTS_ON.get(key)
        if mode is None:
            out.append(
                Recommendation(keyword, value, UNMEASURED, "not in loadtests.recommend's tables")
            )
            continue
        mine = [v for v in verdicts if _pool_mode(v["cells"]) == mode]
        judged = [v for v in mine if v["p99_diff_ms"] is not None]
        logs = _log_lines(rows, mode)
        if not judged:
            why = f"no {mode} cell in this run" if not mine else f"no valid {mode} repeats"
            out.append(Recommendation(keyword, value, UNMEASURED, why))
        elif worse := [f for v in judged for f in _findings(v, "worse")]:
            out.append(Recommendation(keyword, value, STOCK, f"tuned worse: {worse[0]}{logs}"))
        elif better := [f for v in judged for f in _findings(v, "better")]:
            out.append(Recommendation(keyword, value, APPLY, f"tuned better: {better[0]}{logs}"))
        else:
            cells = ", ".join(f"{v['cells']} {v['load']}" for v in judged)
            advice = EVEN.get(key, STOCK)
            reason = "no cost measured" if advice == APPLY else "no gain measured"
            out.append(
                Recommendation(
                    keyword, value, advice, f"{reason}: indistinguishable in {cells}{logs}"
                )
            )
    for keyword in skipped or []:
        out.append(Recommendation(keyword, "-", UNMEASURED, "this sshd is too old for it"))
    return out


def render(recommendations: list[Recommendation], sshd: str) -> str:
    lines = [
        f"## Recommendation per setting of sshd_config.tuned ({sshd})",
        "",
        "| setting | tuned value | advice | the figure |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r.keyword} | {r.value} | **{r.advice}** | {r.figure} |" for r in recommendations]
    return "\n".join(lines)
