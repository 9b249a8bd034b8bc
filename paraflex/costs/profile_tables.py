"""Measured per-layer operator tables (Vidur ``mlp.csv`` format), indexed and interpolated.

Place in the data flow: `paraflex.costs.costmodel.CostModel(profile_dir=...)` asks this module for
the measured time of the linear and elementwise ops of one transformer layer at a token
count; when no table matches the model shape, device or TP degree, the cost model falls back
to its roofline. ``bench/costmodel_fidelity.py`` reads the same tables to score the roofline;
`paraflex profile` writes them for the device at hand (`write_mlp_csv`).

Layout (as in ``shared/data/profiles``)::

    <root>/[compute/]<device>/<org>/<model>/mlp.csv

Columns ``time_stats.<op>.median`` (milliseconds) for the ops in `LAYER_OPS` plus the shape
columns ``n_head, n_kv_head, n_embd, n_expanded_embd, vocab_size, use_gated_mlp, num_tokens,
num_tensor_parallel_workers``. Tables are matched to a model by SHAPE, not by name, so a
Llama-2-7B table also serves the depth-scaled llama-20b/40b/80b.
"""

from __future__ import annotations

import bisect
import csv
import os
from dataclasses import dataclass

from paraflex.errors import UserError

# Linear and elementwise ops of one layer, in Vidur's names (embedding `emb` is per model).
LAYER_OPS = (
    "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
    "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add",
)
ALL_OPS = ("emb",) + LAYER_OPS
OPTIONAL_OPS = ("post_attention_layernorm",)
DEVICE_FOLDERS = {"a100-80g": ("a100-80g", "a100"), "h100-80g": ("h100-80g", "h100"),
                  "h200": ("h200",), "cpu": ("cpu",)}


@dataclass(frozen=True)
class Shape:
    """The model-shape key of a table (what the op times depend on)."""

    n_head: int
    n_kv_head: int
    n_embd: int
    n_expanded_embd: int
    use_gated_mlp: bool


@dataclass
class OpTable:
    """Op times (seconds) of one model shape at one TP degree, by ascending num_tokens."""

    path: str
    device_folder: str
    model: str  # <org>/<model> folder
    shape: Shape
    vocab_size: int
    tp: int
    num_tokens: list[int]
    times: dict[str, list[float]]  # op -> seconds per num_tokens entry (absent ops missing)

    def op_time(self, op: str, num_tokens: float) -> float:
        """Linear interpolation over num_tokens; beyond the last row, scaled proportionally
        (the large-token regime is compute-bound); below the first row, the first value."""
        xs, ys = self.num_tokens, self.times[op]
        if num_tokens <= xs[0]:
            return ys[0]
        if num_tokens >= xs[-1]:
            return ys[-1] * num_tokens / xs[-1]
        i = bisect.bisect_right(xs, num_tokens)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0)

    def layer_time(self, num_tokens: float) -> float:
        return sum(self.op_time(op, num_tokens) for op in LAYER_OPS if op in self.times)


STATS = ("min", "max", "mean", "median", "std")
SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp",
                 "num_tokens", "num_tensor_parallel_workers")


def table_path(root: str, device_folder: str, model: str) -> str:
    """Where the table of `model` ("<org>/<name>") measured on `device_folder` lives under root."""
    return os.path.join(root, "compute", device_folder, *model.split("/"), "mlp.csv")


def write_mlp_csv(path: str, rows: list[dict]) -> None:
    """Rows of ``time_stats.<op>.<stat>`` (ms) and shape columns, in Vidur's column order."""
    columns = [f"time_stats.{op}.{stat}" for op in ALL_OPS for stat in STATS] + list(SHAPE_COLUMNS)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def write_median_csv(src: str, dst: str, digits: int = 4) -> int:
    """Copy a Vidur mlp.csv keeping only what `read_mlp_csv` reads (the median columns, rounded
    to `digits` significant digits, and the shape columns): how the tables shipped in
    paraflex/data/profiles were made from the full ones. Returns the rows written."""
    with open(src, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    columns = [c for c in (f"time_stats.{op}.median" for op in ALL_OPS) if rows and c in rows[0]] + list(SHAPE_COLUMNS)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with open(dst, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(columns)
        for r in rows:
            writer.writerow([f"{float(r[c]):.{digits}g}" if c.startswith("time_stats.") else r[c] for c in columns])
    return len(rows)


def _bool(text: str) -> bool:
    return text.strip().lower() in ("true", "1", "yes")


def read_mlp_csv(path: str, device_folder: str = "", model: str = "") -> list[OpTable]:
    """One `OpTable` per TP degree found in a Vidur mlp.csv."""
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))
    except OSError as exc:
        raise UserError(f"cannot read profile table {path}: {exc.strerror}") from None
    if not rows:
        raise UserError(f"profile table {path} is empty")
    # Parallel-block models (Phi-2) have no post_attention_layernorm column: that op is absent.
    ops = [op for op in ALL_OPS if f"time_stats.{op}.median" in rows[0]]
    missing = [op for op in ALL_OPS if op not in ops and op not in OPTIONAL_OPS]
    if missing:
        raise UserError(f"profile table {path} lacks column time_stats.{missing[0]}.median; expected Vidur mlp.csv format")
    by_tp: dict[int, list[dict]] = {}
    for row in rows:
        by_tp.setdefault(int(row["num_tensor_parallel_workers"]), []).append(row)
    tables = []
    for tp, group in sorted(by_tp.items()):
        merged: dict[int, list[dict]] = {}  # repeated num_tokens rows are averaged
        for r in group:
            merged.setdefault(int(r["num_tokens"]), []).append(r)
        counts = sorted(merged)
        r0 = group[0]
        shape = Shape(int(r0["n_head"]), int(r0["n_kv_head"]), int(r0["n_embd"]),
                      int(r0["n_expanded_embd"]), _bool(r0["use_gated_mlp"]))
        tables.append(OpTable(
            path=path, device_folder=device_folder, model=model, shape=shape,
            vocab_size=int(r0["vocab_size"]), tp=tp,
            num_tokens=counts,
            times={op: [sum(float(r[f"time_stats.{op}.median"]) for r in merged[n]) * 1e-3 / len(merged[n])
                        for n in counts] for op in ops},
        ))
    return tables


def find_tables(root: str) -> list[OpTable]:
    """Every mlp.csv under root (``<root>/[compute/]<device>/<org>/<model>/mlp.csv``)."""
    if not os.path.isdir(root):
        raise UserError(f"profile directory {root} does not exist")
    tables = []
    for folder, _dirs, files in sorted(os.walk(root)):
        if "mlp.csv" not in files:
            continue
        rel = os.path.relpath(folder, root).split(os.sep)
        if rel[0] == "compute":
            rel = rel[1:]
        device_folder = rel[0] if len(rel) >= 3 else ""
        model = "/".join(rel[-2:])
        tables.extend(read_mlp_csv(os.path.join(folder, "mlp.csv"), device_folder, model))
    return tables


def shape_of(arch) -> Shape:
    return Shape(arch.num_heads, arch.num_kv_heads, arch.hidden_size, arch.intermediate_size,
                 arch.gated_mlp)


class ProfileIndex:
    """Tables under a profile directory, looked up by (device, model shape, TP)."""

    def __init__(self, root: str):
        self.root = root
        self.tables = find_tables(root)
        if not self.tables:
            raise UserError(f"no mlp.csv tables under profile directory {root}")

    def lookup(self, device: str, arch, tp: int) -> OpTable | None:
        folders = DEVICE_FOLDERS.get(device, (device,))
        # A directory that is already one device's folder has no device level.
        for t in self.tables:
            if t.tp == tp and t.shape == shape_of(arch) and (
                t.device_folder in folders or os.path.basename(self.root.rstrip(os.sep)) in folders
            ):
                return t
        return None
