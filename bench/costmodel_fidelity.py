"""Cost-model fidelity: the roofline's per-layer linear+elementwise time vs measured tables.

For every Vidur ``mlp.csv`` under ``<data>/profiles`` (all models, a100/h100, TP 1/2/4/8) and
every measured num_tokens (1..4096), compare the sum of the layer's linear and elementwise ops
(input_layernorm, attn_pre_proj, attn_rope, attn_post_proj, post_attention_layernorm,
mlp_up_proj, mlp_act, mlp_down_proj, add; each once, as measured) with the roofline's
prediction of the same ops (`CostModel.linear_op_times`). Prints the MAPE per table and
overall, and the machine. No measured table is used by the prediction.

    python bench/costmodel_fidelity.py [--data ../shared/data] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys

from paraflex.models.catalog import ModelArch
from paraflex.costs.costmodel import CostModel
from paraflex.costs.devices import DeviceSpec, get_device
from paraflex.errors import UserError
from paraflex.costs.profile_tables import LAYER_OPS, find_tables
from paraflex.cpu_info import machine_line

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE_OF_FOLDER = {"a100": "a100-80g", "h100": "h100-80g"}


def arch_of(table) -> ModelArch:
    s = table.shape
    return ModelArch(name=table.model, num_layers=1, hidden_size=s.n_embd,
                     intermediate_size=s.n_expanded_embd, num_heads=s.n_head,
                     num_kv_heads=s.n_kv_head, head_dim=s.n_embd // s.n_head,
                     vocab_size=table.vocab_size, gated_mlp=s.use_gated_mlp,
                     parallel_block="post_attention_layernorm" not in table.times)


def device_of(table) -> DeviceSpec:
    return get_device(DEVICE_OF_FOLDER.get(table.device_folder, table.device_folder))


def table_errors(table, device: DeviceSpec | None = None) -> list[tuple[int, float, float]]:
    """(num_tokens, measured s, predicted s) for every row of a table."""
    model = CostModel(device or device_of(table), tp=table.tp)
    arch = arch_of(table)
    rows = []
    for i, n in enumerate(table.num_tokens):
        measured = sum(table.times[op][i] for op in LAYER_OPS if op in table.times)
        predicted = sum(model.linear_op_times(arch, n).values())
        rows.append((n, measured, predicted))
    return rows


FIT_PARAMS = ("matmul_eff", "mem_eff", "kernel_overhead", "matmul_half_tokens")


def mape(tables, device: DeviceSpec) -> float:
    apes = [abs(p - m) / m for t in tables for _n, m, p in table_errors(t, device)]
    return sum(apes) / len(apes)


NET_FOLDER = {"a100": "a100_dgx", "h100": "h100_dgx"}
NET_PARAMS = ("intra_latency", "intra_bandwidth")


def read_allreduce(path: str) -> list[tuple[int, int, float]]:
    """(tp, bytes, measured s) for the all-reduces inside one node (one TP group)."""
    with open(path, newline="", encoding="utf-8") as fh:
        return [(int(r["num_workers"]), int(r["size"]), float(r["time_stats.all_reduce.median"]) * 1e-3)
                for r in csv.DictReader(fh) if r["num_workers"] == r["devices_per_node"]]


def allreduce_mape(rows, device: DeviceSpec) -> float:
    apes = [abs(CostModel(device, tp=tp).allreduce_time(size) - m) / m for tp, size, m in rows]
    return sum(apes) / len(apes)


def fit(params, score, device: DeviceSpec) -> DeviceSpec:
    """Coordinate descent in log space on `params` minimising score(device)."""
    best, best_err = device, score(device)
    step = 0.5
    while step > 0.01:
        improved = False
        for name in params:
            for factor in (1 + step, 1 / (1 + step)):
                value = getattr(best, name) * factor
                if name.endswith("_eff") and value > 1.0:
                    continue
                cand = dataclasses.replace(best, **{name: value})
                err = score(cand)
                if err < best_err:
                    best, best_err, improved = cand, err, True
        if not improved:
            step /= 2
    print(f"  fitted {device.name}: " + ", ".join(f"{k}={getattr(best, k):.4g}" for k in params)
          + f" (MAPE {100 * best_err:.1f}%)", flush=True)
    return best


def cross_validate(tables, devices: dict) -> None:
    """Leave one model out per device: fit on the rest, score the held-out model's tables."""
    held_apes = []
    for folder, spec in devices.items():
        group = [t for t in tables if t.device_folder == folder]
        for model in sorted({t.model for t in group}):
            train = [t for t in group if t.model != model]
            test = [t for t in group if t.model == model]
            fitted = fit(FIT_PARAMS, lambda d, g=train: mape(g, d), spec)
            apes = [abs(p - m) / m for t in test for _n, m, p in table_errors(t, fitted)]
            held_apes.extend(apes)
            print(f"{folder:8} held out {model:42} MAPE {100 * sum(apes) / len(apes):5.1f}%")
    print(f"leave-one-model-out MAPE over {len(held_apes)} rows: {100 * sum(held_apes) / len(held_apes):.1f}%")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=os.path.join(REPO, "..", "shared", "data"),
                    help="reference data folder holding profiles/ (default: ../shared/data from the repo root)")
    ap.add_argument("--csv", help="write per-row measured/predicted times to this CSV")
    ap.add_argument("--cross-validate", action="store_true",
                    help="leave-one-model-out: fit the efficiencies on the other models' tables and "
                         "report the MAPE on the held-out model (out-of-sample fidelity)")
    ap.add_argument("--fit", action="store_true",
                    help="re-fit each device's efficiency constants on these tables and print them "
                         "(paste into paraflex/costs/devices.py); the report then uses the fitted values")
    args = ap.parse_args(argv)
    root = os.path.join(args.data, "profiles", "compute")
    if not os.path.isdir(root):
        print(f"costmodel_fidelity: no measured tables at {root}; pass --data pointing at the "
              "folder that holds profiles/compute/<device>/<org>/<model>/mlp.csv", file=sys.stderr)
        return 2
    try:
        tables = find_tables(root)
    except UserError as exc:
        print(f"costmodel_fidelity: {exc}", file=sys.stderr)
        return 2
    print(f"machine: {machine_line()}; {len(tables)} tables under {root}")
    devices = {}
    for folder in sorted({t.device_folder for t in tables}):
        group = [t for t in tables if t.device_folder == folder]
        spec = device_of(group[0])
        if args.fit:
            spec = fit(FIT_PARAMS, lambda d, g=group: mape(g, d), spec)
        devices[folder] = spec
    print(f"{'device':8} {'model':42} {'tp':>3} {'rows':>5} {'MAPE':>7} {'max APE':>8}")
    all_ape, out = [], []
    for table in sorted(tables, key=lambda t: (t.device_folder, t.model, t.tp)):
        rows = table_errors(table, devices[table.device_folder])
        apes = [abs(p - m) / m for _n, m, p in rows]
        all_ape.extend(apes)
        out.extend((table.device_folder, table.model, table.tp, n, m, p) for n, m, p in rows)
        print(f"{table.device_folder:8} {table.model:42} {table.tp:>3} {len(rows):>5} "
              f"{100 * sum(apes) / len(apes):6.1f}% {100 * max(apes):7.1f}%")
    overall = 100 * sum(all_ape) / len(all_ape)
    print(f"overall MAPE over {len(all_ape)} rows: {overall:.1f}% (target <= 15%)")
    if args.cross_validate:
        cross_validate(tables, devices)
    for folder, spec in devices.items():
        path = os.path.join(args.data, "profiles", "network", NET_FOLDER.get(folder, folder), "all_reduce.csv")
        if not os.path.isfile(path):
            continue
        rows = read_allreduce(path)
        if args.fit:
            spec = fit(NET_PARAMS, lambda d, r=rows: allreduce_mape(r, d), spec)
        for tp in sorted({r[0] for r in rows}):
            sub = [r for r in rows if r[0] == tp]
            print(f"{folder:8} TP all-reduce, {tp} GPUs in one node: {len(sub):>4} sizes, "
                  f"MAPE {100 * allreduce_mape(sub, spec):.1f}%")
    if args.csv:
        with open(args.csv, "w", encoding="utf-8") as fh:
            fh.write("device,model,tp,num_tokens,measured_s,predicted_s\n")
            fh.writelines(f"{d},{m},{t},{n},{a:.6e},{b:.6e}\n" for d, m, t, n, a, b in out)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
