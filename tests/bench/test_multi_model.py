"""bench/multi_model.py's parts that need no server: Zipf and balanced rates, the open-loop plan,
the ParaFlex config it writes (loaded by the real config loader: every model whole, SLOs set),
the process-tree memory sampler; and bench/ttft_split.py's split of one request's TTFT."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
from repo_paths import load_bench


def test_zipf_rates_fall_with_rank_and_balanced_rates_are_equal():
    mm = load_bench("multi_model")
    names = ["a", "b", "c"]
    zipf = mm.popularity_rates(names, "zipf", 3.0, 1.01)
    assert zipf["a"] > zipf["b"] > zipf["c"]
    assert zipf["a"] / zipf["b"] == pytest.approx(2 ** 1.01)
    assert sum(zipf.values()) == pytest.approx(3.0)
    assert mm.popularity_rates(names, "balanced", 3.0, 1.01) == {"a": 1.0, "b": 1.0, "c": 1.0}


def test_the_plan_is_sorted_inside_the_duration_and_follows_the_rates():
    mm = load_bench("multi_model")
    prompts = [[i] * 4 for i in range(8)]
    plan = mm.plan_for({"a": 8.0, "b": 2.0}, 50.0, prompts, np.random.default_rng(0))
    times = [p[0] for p in plan]
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 50.0
    counts = {m: sum(p[1] == m for p in plan) for m in ("a", "b")}
    assert 300 < counts["a"] < 500 and 60 < counts["b"] < 140  # Poisson: 400 and 100 expected
    assert all(p[2] in prompts for p in plan)


def test_the_paraflex_config_loads_with_every_model_its_source_rate_and_slos(tmp_path):
    from paraflex.config.schema import load_config

    mm = load_bench("multi_model")
    hf = tmp_path / "m"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama", "hidden_size": 960, "intermediate_size": 2560, '
                                    '"num_hidden_layers": 32, "num_attention_heads": 15, "num_key_value_heads": 5, '
                                    '"vocab_size": 49152, "max_position_embeddings": 8192, "tie_word_embeddings": true}')
    names = ["smollm2-135m", "smollm2-360m-shape"]
    path = mm.paraflex_config(names, {"smollm2-360m-shape": str(hf)}, {"smollm2-135m": 2.0, "smollm2-360m-shape": 1.0},
                              engines=1)
    try:
        config = load_config(path)
    finally:
        os.unlink(path)
    assert [m.name for m in config.models] == names
    assert [m.rate for m in config.models] == [2.0, 1.0]
    big = config.model("smollm2-360m-shape")
    assert (big.slo_ttft_ms, big.slo_tbt_ms) == mm.MODELS["smollm2-360m-shape"][1:]
    assert big.arch.num_layers == 32 and config.cluster.num_engines == 1


def test_peak_memory_sums_a_process_tree_children_included():
    mm = load_bench("multi_model")
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                              "p = subprocess.Popen([sys.executable, '-c', 'x = bytearray(200 << 20); import time; time.sleep(30)']); "
                              "time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while len(mm.PeakMemory.tree(child.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        tree = mm.PeakMemory.tree(child.pid)
        assert len(tree) == 2 and tree[0] == child.pid
        time.sleep(1.0)  # the grandchild touches its 200 MiB
        memory = mm.PeakMemory([child.pid]).start()
        time.sleep(1.2)
        assert memory.stop() > 200 << 20
    finally:
        for pid in reversed(mm.PeakMemory.tree(child.pid)):
            os.kill(pid, 9)
        child.wait()


def test_the_ttft_split_attributes_each_interval_to_its_part():
    ts = load_bench("ttft_split")
    ms = 1e-3
    events = [  # (label, start, end, arg): one request sent at 0, first token read at 100 ms
        ("submit", 10 * ms, 11 * ms, None), ("apply", 13 * ms, 14 * ms, None), ("schedule", 14 * ms, 15 * ms, None),
        ("forward", 15 * ms, 85 * ms, None), ("projections", 16 * ms, 56 * ms, None),
        ("attention", 60 * ms, 70 * ms, None), ("sample", 86 * ms, 87 * ms, None), ("output", 90 * ms, 91 * ms, None),
        ("forward", 92 * ms, 120 * ms, None),  # the next (decode) step: not part of this TTFT
    ]
    split = ts.split_one(events, 0.0, 100 * ms, ray=False)
    expected = {"http in": 10, "submit": 1, "ray call": 0, "queue": 2, "apply": 1, "schedule": 1, "projections": 40,
                "attention": 10, "other fwd": 20, "sample": 1, "loop gaps": 4, "output push": 0, "router": 0,
                "http out": 10}
    assert split == pytest.approx(expected)
    assert sum(split.values()) == pytest.approx(100)


def test_the_ttft_split_of_the_ray_backend_adds_the_actor_call_and_the_output_router():
    """Events of the gateway process and of the engine actor (one clock): the remote call, the
    actor's queue, its output sink's push and the router's way back each get their own part."""
    ts = load_bench("ttft_split")
    ms = 1e-3
    events = [
        ("start", 5 * ms, 8 * ms, None), ("ray submit", 6 * ms, 8 * ms, None), ("actor add", 9 * ms, 9.5 * ms, None),
        ("apply", 12 * ms, 13 * ms, None), ("schedule", 13 * ms, 14 * ms, None), ("forward", 14 * ms, 84 * ms, None),
        ("projections", 15 * ms, 55 * ms, None), ("attention", 60 * ms, 70 * ms, None),
        ("sample", 85 * ms, 86 * ms, None), ("sink", 87 * ms, 87.5 * ms, None), ("push", 89 * ms, 89.2 * ms, None),
        ("output", 95 * ms, 96 * ms, None), ("forward", 90 * ms, 110 * ms, None),
    ]
    split = ts.split_one(events, 0.0, 100 * ms, ray=True)
    expected = {"http in": 5, "submit": 3, "ray call": 1, "queue": 3, "apply": 1, "schedule": 1, "projections": 40,
                "attention": 10, "other fwd": 20, "sample": 1, "loop gaps": 2, "output push": 2, "router": 6,
                "http out": 5}
    assert split == pytest.approx(expected)
    assert sum(split.values()) == pytest.approx(100)


def test_decode_steps_split_each_step_into_the_forward_and_the_rest_of_the_loop():
    ts = load_bench("ttft_split")
    ms = 1e-3
    forwards = [("forward", a * ms, b * ms, None) for a, b in ((0, 50), (52, 60), (61, 69), (71, 79))]
    fwd, rest = ts.decode_steps(forwards + [("sample", 60 * ms, 60.5 * ms, None)], 0.0, 80 * ms)
    assert fwd == pytest.approx([8, 8])  # the prefill (first) and the last forward are left out
    assert rest == pytest.approx([1, 2])
