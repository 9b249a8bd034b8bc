"""Request traces: `arrived_at,num_prefill_tokens,num_decode_tokens` CSVs (Vidur/Splitwise).

Loaded once per path (UTF-8, a leading BOM allowed) and validated row by row (a malformed row
is a `UserError` naming the file, line and fix). arrivals.py replays a trace per model from a
random offset, time-scaled to the model's rate; lengths.py can draw token counts from it.
"""

from __future__ import annotations

import csv
import functools
import io
import math
from dataclasses import dataclass

import numpy as np

from paraflex.errors import UserError

COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")
MAX_TOKENS = 2**31 - 1  # a token count must fit int32; a larger one is a unit mistake


@dataclass(frozen=True)
class Trace:
    path: str
    arrived_at: np.ndarray  # seconds from trace start, non-decreasing
    prompt: np.ndarray  # int64 tokens
    output: np.ndarray  # int64 tokens

    def __len__(self) -> int:
        return len(self.arrived_at)

    @property
    def interarrivals(self) -> np.ndarray:
        """Gaps between consecutive rows, plus one mean gap that closes the loop."""
        gaps = np.diff(self.arrived_at)
        mean = gaps.mean() if len(gaps) else 1.0
        return np.append(gaps, mean if mean > 0 else 1.0)

    @property
    def rate(self) -> float:
        """Native request rate (req/s): rows per second of the looped trace."""
        return len(self) / float(self.interarrivals.sum())


def read_csv_table(path: str, what: str, columns: tuple[str, ...]) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """(stripped header, [(line number, row)] without blank rows) of a UTF-8 CSV (a leading
    BOM allowed) whose header names every one of `columns`; a `UserError` naming `what` (the
    kind of file, e.g. "trace") and the path otherwise. Shared by the trace and requests readers."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as fh:
            text = fh.read()
    except OSError as exc:
        raise UserError(f"{what} {path!r}: cannot open ({exc.strerror}); pass an existing CSV") from None
    except UnicodeDecodeError:
        raise UserError(f"{what} {path!r}: not a UTF-8 text CSV; pass a CSV with columns {','.join(columns)}") from None
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, None)
    if header is None:
        raise UserError(f"{what} {path!r}: empty file; expected a header {','.join(columns)}")
    header = [h.strip() for h in header]
    missing = [c for c in columns if c not in header]
    if missing:
        raise UserError(f"{what} {path!r}: header lacks {', '.join(missing)}; expected columns {','.join(columns)}")
    rows = [(line, row) for line, row in enumerate(reader, start=2) if row and any(c.strip() for c in row)]
    return header, rows


@functools.lru_cache(maxsize=8)
def load_trace(path: str) -> Trace:
    header, rows = read_csv_table(path, "trace", COLUMNS)
    idx = [header.index(c) for c in COLUMNS]
    t, p, o = [], [], []
    for line, row in rows:
        try:
            at, pre, dec = (float(row[i]) for i in idx)
        except (ValueError, IndexError):
            raise UserError(f"trace {path}:{line}: malformed row {','.join(row)!r}; expected numbers for {','.join(COLUMNS)}") from None
        if not (math.isfinite(at) and at >= 0 and 1 <= pre <= MAX_TOKENS and 1 <= dec <= MAX_TOKENS) or pre != int(pre) or dec != int(dec):
            raise UserError(
                f"trace {path}:{line}: bad values {','.join(row)!r}; need a finite arrived_at >= 0 "
                f"and integer token counts >= 1 (at most {MAX_TOKENS})"
            )
        if t and at < t[-1]:
            raise UserError(f"trace {path}:{line}: arrived_at {at} is earlier than the row before; sort the trace by arrived_at")
        t.append(at)
        p.append(int(pre))
        o.append(int(dec))
    if not t:
        raise UserError(f"trace {path!r}: no rows; expected at least one request")
    return Trace(path, np.asarray(t, dtype=float), np.asarray(p, dtype=np.int64), np.asarray(o, dtype=np.int64))
