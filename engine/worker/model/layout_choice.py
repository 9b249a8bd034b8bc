"""Which weight layout a projection should use, decided from measured times (pure: no torch).

Place in the data flow: `layout_chooser.LayoutChooser` times each candidate layout of a
projection shape (engine/worker/model/linear.py: the compiled panels, oneDNN's packed layout,
plain `torch.mm`) at decode-sized and prefill-sized row counts and hands the times here;
`choose_layout` returns the one layout the `Linear` keeps.

Rule: each layout's cost at a row count is its time over the fastest layout's time there
(1.0 = fastest); a layout's score is the geometric mean of those slowdowns over all the row
counts measured (decode and prefill alike, so neither regime's absolute times drown the other).
The least score wins; a candidate listed earlier (the preferred one) keeps the place unless
another beats it by more than `MARGIN` (timing noise on a shared machine). One layout only:
where the decode rows and the prefill rows have different winners the verdict says so
(`split`) with the gain a second packed copy would have bought in the regime that lost, which
the docs weigh against that copy's memory (docs/runtime.md, "Projection layouts").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECODE_ROWS = (1, 8, 32)  # rows of a decode step: one per running request
PREFILL_ROWS = (128, 512)  # rows of a prefill step: the tokens of the prompts it packs
MARGIN = 0.03  # a later candidate must score this share better than an earlier one to win


@dataclass(frozen=True)
class Verdict:
    layout: str
    scores: dict[str, float]  # layout -> geometric-mean slowdown over the fastest (1.0 = fastest everywhere)
    split: str | None  # the regime the chosen layout loses and by how much, when decode and prefill disagree

    def describe(self) -> str:
        others = ", ".join(f"{name} {score:.2f}x" for name, score in self.scores.items() if name != self.layout)
        text = f"{self.layout}" + (f" (others: {others})" if others else "")
        return text + (f"; {self.split}" if self.split else "")


def slowdowns(times: dict[str, dict[int, float]], rows: tuple[int, ...]) -> dict[str, list[float]]:
    """layout -> its time over the fastest layout's, at each of `rows`."""
    best = {r: min(t[r] for t in times.values()) for r in rows}
    return {name: [t[r] / best[r] for r in rows] for name, t in times.items()}


def geometric_mean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def winner(scores: dict[str, float]) -> str:
    """The least score, an earlier layout kept unless a later one is MARGIN better."""
    names = list(scores)
    chosen = names[0]
    for name in names[1:]:
        if scores[name] < scores[chosen] * (1 - MARGIN):
            chosen = name
    return chosen


def choose_layout(times: dict[str, dict[int, float]], decode_rows: tuple[int, ...] = DECODE_ROWS,
                  prefill_rows: tuple[int, ...] = PREFILL_ROWS) -> Verdict:
    """`times`: layout (in order of preference) -> rows -> seconds, measured at every row count
    of `decode_rows` and `prefill_rows` (either may be empty: the LM head sees decode rows only)."""
    if not times:
        raise ValueError("no layout to choose from")
    rows = tuple(decode_rows) + tuple(prefill_rows)
    missing = [f"{name}@{r}" for name, t in times.items() for r in rows if r not in t]
    if missing:
        raise ValueError(f"no time measured for {', '.join(missing)}")
    all_rows = slowdowns(times, rows)
    scores = {name: geometric_mean(s) for name, s in all_rows.items()}
    chosen = winner(scores)
    split = None
    if decode_rows and prefill_rows and len(times) > 1:
        per_regime = {}
        for regime, regime_rows in (("decode", decode_rows), ("prefill", prefill_rows)):
            regime_scores = {name: geometric_mean(s) for name, s in slowdowns(times, tuple(regime_rows)).items()}
            per_regime[regime] = (winner(regime_scores), regime_scores)
        if per_regime["decode"][0] != per_regime["prefill"][0]:
            lost = next(regime for regime, (best, _) in per_regime.items() if best != chosen)
            best, regime_scores = per_regime[lost]
            gain = regime_scores[chosen] / regime_scores[best]
            if gain > 1:  # else `best` only kept its place by MARGIN there: the choice loses nothing
                split = f"{best} would be {gain:.2f}x faster at {lost} rows"
    return Verdict(chosen, scores, split)
