"""Request lists: one CSV of exact requests that the simulator and a load client both replay.

Place in the data flow: `paraflex simulate --requests FILE` reads it here instead of drawing a
workload (generator.py), and bench/sim_fidelity.py writes one (`write_requests`) and replays the
same rows against a running `paraflex serve`. Columns: `model, arrived_at, num_prefill_tokens,
num_decode_tokens` and an optional `request_id` (a unique integer >= 0; default: the row's
position). Replayed exactly: no resampling, no per-model offsets, no scaling.

Rules (each a one-line `UserError` naming the file, line and field): the model must be one the
config serves; `arrived_at` a finite number >= 0 (seconds from the start of the run); token
counts integers >= 1 whose sum fits the model's context. Rows out of arrival order are SORTED
(stable, ties keep file order) and the caller is told how many moved (`RequestList.reordered`),
so a list merged from several per-model files needs no pre-processing.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass

from paraflex.errors import UserError
from paraflex.simulator.workload.generator import SimRequest
from paraflex.simulator.workload.trace import MAX_TOKENS, read_csv_table

COLUMNS = ("model", "arrived_at", "num_prefill_tokens", "num_decode_tokens")
ID_COLUMN = "request_id"


@dataclass(frozen=True)
class RequestList:
    requests: list[SimRequest]  # sorted by arrival (ties: file order)
    reordered: int  # rows that were not in arrival order in the file


def load_requests(path: str, max_context: dict[str, int]) -> RequestList:
    """Read and check a requests CSV against the served models (`max_context`: model name ->
    its context window in tokens)."""
    header, rows = read_csv_table(path, "requests file", COLUMNS)
    col = {c: header.index(c) for c in COLUMNS + ((ID_COLUMN,) if ID_COLUMN in header else ())}
    out: list[SimRequest] = []
    seen_ids: dict[int, int] = {}
    for k, (line, row) in enumerate(rows):
        def field(name: str) -> str:
            i = col[name]
            if i >= len(row) or not row[i].strip():
                raise UserError(f"requests file {path}:{line}: {name} is missing; every row needs {', '.join(COLUMNS)}")
            return row[i].strip()

        def bad(name: str, need: str):
            return UserError(f"requests file {path}:{line}: {name} {field(name)!r} {need}")

        model = field("model")
        if model not in max_context:
            raise bad("model", f"is not a model of the config; choose from {', '.join(sorted(max_context))}")
        try:
            at = float(field("arrived_at"))
        except ValueError:
            raise bad("arrived_at", "is not a number; give seconds from the start of the run") from None
        if not (math.isfinite(at) and at >= 0):
            raise bad("arrived_at", "must be a finite number of seconds >= 0")
        tokens = [_count(field, bad, name) for name in ("num_prefill_tokens", "num_decode_tokens")]
        if sum(tokens) > max_context[model]:
            raise UserError(f"requests file {path}:{line}: num_prefill_tokens + num_decode_tokens = {sum(tokens)} "
                            f"exceeds {model}'s context of {max_context[model]} tokens; shorten the request")
        rid = k
        if ID_COLUMN in col:
            rid = _count(field, bad, ID_COLUMN, low=0)
            if rid in seen_ids:
                raise bad(ID_COLUMN, f"repeats the request_id of line {seen_ids[rid]}; give each row its own")
            seen_ids[rid] = line
        out.append(SimRequest(rid, model, at, tokens[0], tokens[1]))
    if not out:
        raise UserError(f"requests file {path!r}: no rows; expected at least one request")
    ordered = sorted(out, key=lambda r: r.arrival)  # stable: ties keep file order
    reordered = sum(1 for a, b in zip(out, ordered) if a is not b)
    return RequestList(ordered, reordered)


def _count(field, bad, name: str, low: int = 1) -> int:
    try:
        v = float(field(name))
    except ValueError:
        raise bad(name, "is not a number") from None
    if not (low <= v <= MAX_TOKENS and v == int(v)):
        raise bad(name, f"must be an integer >= {low} (at most {MAX_TOKENS})")
    return int(v)


def write_requests(path: str, requests: list[SimRequest]) -> None:
    """Write `requests` in the format `load_requests` reads (request ids included)."""
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow((ID_COLUMN,) + COLUMNS)
        for r in requests:
            w.writerow((r.id, r.model, f"{r.arrival:.6f}", r.prompt_len, r.output_len))
