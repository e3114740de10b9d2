"""How a benchmark's page ends: its targets as a table, the page printed and written where asked, and an
exit status of 1 when a target is missed; and how a target is judged from noisy rounds."""

from __future__ import annotations

import statistics
from pathlib import Path

# The target, whether it is met (None: undecided, the rounds straddle it), what was measured.
Check = tuple[str, bool | None, str]


def verdict(ratios: list[float], target: float) -> str:
    """A target of `ratios >= target`, judged from each round's paired ratio: "met" or "missed" when every
    round agrees, else "undecided" (the rounds straddle the target: the median would decide by noise)."""
    if all(r >= target for r in ratios):
        return "met"
    if all(r < target for r in ratios):
        return "missed"
    return f"undecided (rounds {min(ratios):.2f}-{max(ratios):.2f} straddle {target}x)"


def rounds(ratios: list[float]) -> str:
    """The median of `ratios` with every round's: "0.95x (rounds 0.94, 0.88, 0.97)"."""
    return f"{statistics.median(ratios):.2f}x (rounds {', '.join(f'{r:.2f}' for r in ratios)})"


def met(ratios: list[float], target: float) -> bool | None:
    """Whether every round's ratio is at least `target`: True or False when the rounds agree, None (the
    "met" column says undecided) when they straddle it."""
    return {"met": True, "missed": False}.get(verdict(ratios, target))


def targets(checks: list[Check]) -> list[str]:
    """The table of `checks`, with a blank line before it."""
    said = {True: "yes", False: "no", None: "undecided"}
    rows = [f"| {name} | {said[ok]} | {value} |" for name, ok, value in checks]
    return ["", "| target | met | measured |", "| --- | --- | --- |", *rows]


def finish(lines: list[str], checks: list[Check], out: str | Path | None) -> int:
    """Prints the page of `lines`, writes it to `out` when given; 0 when no check is missed (met or
    undecided), else 1."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        Path(out).write_text(text)
    return 0 if all(ok is not False for _, ok, _ in checks) else 1
