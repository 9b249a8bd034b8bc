"""Cost model: monotonicity, TP scaling, memory-bound decode, hops, and measured-table lookup."""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paraflex.models.catalog import get_arch
from paraflex.costs.costmodel import CostModel
from paraflex.costs.interconnect import Interconnect
from paraflex.costs.devices import device_names, get_device
from paraflex.errors import UserError
from paraflex.costs.profile_tables import LAYER_OPS, ProfileIndex
from repo_paths import SHARED

ARCHS = ["llama-2-7b", "llama-2-70b", "phi-2", "smollm2-135m", "tiny-4l", "qwen-72b"]
SHARED_PROFILES = str(SHARED / "data" / "profiles")
if not os.path.isdir(SHARED_PROFILES):
    SHARED_PROFILES = "/work/shared/data/profiles"


@settings(max_examples=60, deadline=None)
@given(device=st.sampled_from(device_names()), name=st.sampled_from(ARCHS),
       n=st.integers(1, 8192), extra=st.integers(1, 4096), first=st.booleans(), last=st.booleans())
def test_more_prefill_tokens_is_never_faster(device, name, n, extra, first, last):
    cm, arch = CostModel(device), get_arch(name)
    assert cm.prefill_time(arch, 4, n + extra, first, last) >= cm.prefill_time(arch, 4, n, first, last) > 0


@settings(max_examples=60, deadline=None)
@given(device=st.sampled_from(device_names()), name=st.sampled_from(ARCHS), tp=st.sampled_from([1, 2]),
       b=st.integers(1, 256), db=st.integers(0, 64), ctx=st.integers(1, 4096), dctx=st.integers(0, 4096))
def test_bigger_decode_batch_or_context_is_never_faster(device, name, tp, b, db, ctx, dctx):
    cm, arch = CostModel(device, tp=tp), get_arch(name)
    base = cm.decode_time(arch, 2, b, b * ctx)
    assert cm.decode_time(arch, 2, b + db, (b + db) * ctx) >= base
    assert cm.decode_time(arch, 2, b, b * ctx + dctx) >= base


@pytest.mark.parametrize("device", ["a100-80g", "h100-80g", "h200"])
@pytest.mark.parametrize("name", ["llama-2-70b", "codellama-34b-instruct", "internlm2.5-20b-chat"])
def test_tp_reduces_per_layer_compute(device, name):
    arch = get_arch(name)
    times = []
    for tp in (1, 2, 4, 8):
        cm = CostModel(device, tp=tp)
        compute = cm.linear_time(arch, 2048) + cm.attention_prefill_time(arch, 2048)
        times.append(compute)
    assert times == sorted(times, reverse=True)
    assert times[0] / times[-1] > 4  # a large prefill is compute-bound: close to linear scaling
    # ... but the all-reduces make the whole layer scale worse than the compute alone
    whole = [CostModel(device, tp=tp).prefill_time(arch, 1, 2048) for tp in (1, 8)]
    assert whole[0] / whole[1] < times[0] / times[-1]


@pytest.mark.parametrize("device", ["a100-80g", "h100-80g", "h200", "cpu"])
def test_small_batch_decode_is_memory_bound(device):
    arch = get_arch("llama-2-7b")
    cm, spec = CostModel(device), get_device(device)
    weight_stream = arch.layer_weight_bytes() / (spec.mem_bandwidth * spec.mem_eff)
    one = cm.linear_time(arch, 1)
    launches = (len(cm.linear_op_times(arch, 1)) + 1) * spec.kernel_overhead
    assert weight_stream <= one - launches < 1.1 * weight_stream
    if device != "cpu":  # a GPU's ridge point is far above 8 tokens: batching is nearly free
        assert cm.linear_time(arch, 8) < 1.15 * one
    # ...whereas a large prefill is compute-bound: time grows with the tokens
    assert cm.linear_time(arch, 4096) > 10 * cm.linear_time(arch, 64)


def test_decode_attention_reads_the_kv_cache():
    arch = get_arch("llama-2-7b")
    cm, spec = CostModel("a100-80g"), get_device("a100-80g")
    t = cm.attention_decode_time(arch, 32, 32 * 4096)
    kv = 32 * 4096 * arch.kv_bytes_per_token_per_layer()
    assert t == pytest.approx(kv / (spec.mem_bandwidth * spec.mem_eff), rel=0.05)


def test_first_and_last_stage_extras_and_model_time():
    arch = get_arch("llama-2-7b")
    cm = CostModel("a100-80g")
    mid = cm.prefill_time(arch, 8, 512)
    assert cm.prefill_time(arch, 8, 512, first=True) > mid
    assert cm.prefill_time(arch, 8, 512, last=True) > mid
    assert cm.prefill_time(arch, 16, 512) == pytest.approx(2 * mid)
    small, big = cm.model_time(get_arch("llama-20b")), cm.model_time(get_arch("llama-80b"))
    assert 3.0 < big / small < 4.2  # 240 vs 60 layers of the same width
    assert cm.layer_time(arch) * arch.num_layers < cm.model_time(arch)


def test_hops_and_interconnect():
    arch = get_arch("llama-2-70b")
    assert CostModel.hidden_bytes(arch, 10) == 2 * 10 * 8192 * 2
    link = Interconnect(bandwidth_Bps=25e9, latency_s=5e-6)
    assert link.transfer_time(0) == 0.0
    assert link.transfer_time(25_000_000) == pytest.approx(5e-6 + 1e-3)
    assert CostModel("a100-80g", tp=1).allreduce_time(1 << 20) == 0.0
    assert CostModel("a100-80g", tp=8).allreduce_time(1 << 20) > CostModel("a100-80g", tp=2).allreduce_time(1 << 20)


def test_bad_arguments():
    with pytest.raises(UserError, match="device"):
        CostModel("tpu")
    with pytest.raises(UserError, match="tensor-parallel"):
        CostModel("cpu", tp=0)
    cm, arch = CostModel("cpu"), get_arch("tiny-2l")
    with pytest.raises(UserError, match="num_tokens"):
        cm.prefill_time(arch, 1, 0)
    with pytest.raises(UserError, match="total_context"):
        cm.decode_time(arch, 1, 4, 2)


def _write_table(folder, n_embd=64, n_head=4, n_kv=2, ffn=192, tp=1, scale=1.0, drop=()):
    folder.mkdir(parents=True, exist_ok=True)
    ops = ["emb", *LAYER_OPS]
    cols = [f"time_stats.{op}.median" for op in ops if op not in drop]
    header = cols + ["n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size",
                     "use_gated_mlp", "num_tokens", "num_tensor_parallel_workers"]
    lines = [",".join(header)]
    for n in (1, 10, 100):  # every op takes n * scale microseconds ... in ms
        lines.append(",".join([str(n * scale * 1e-3)] * len(cols)
                              + [str(n_head), str(n_kv), str(n_embd), str(ffn), "259", "True", str(n), str(tp)]))
    (folder / "mlp.csv").write_text("\n".join(lines) + "\n")


def test_measured_table_is_interpolated_and_matched_by_shape(tmp_path):
    _write_table(tmp_path / "compute" / "cpu" / "demo" / "tiny")
    cm = CostModel("cpu", profile_dir=str(tmp_path))
    tiny2, tiny4 = get_arch("tiny-2l"), get_arch("tiny-4l")  # tiny-2l has the table's shape
    per_op = {n: n * 1e-6 for n in (1, 10, 100)}
    assert cm.linear_time(tiny2, 10) == pytest.approx(10 * per_op[10])  # 9 ops + 2nd add
    assert cm.linear_time(tiny2, 55) == pytest.approx(10 * 55e-6)  # linear between 10 and 100
    assert cm.linear_time(tiny2, 400) == pytest.approx(10 * 400e-6)  # proportional beyond
    assert cm.linear_time(tiny2, 0.5) == pytest.approx(10 * 1e-6)  # clamped below
    assert cm.embedding_time(tiny2, 10) == pytest.approx(10e-6)
    roofline = CostModel("cpu")
    assert cm.linear_time(tiny4, 10) == roofline.linear_time(tiny4, 10)  # no table: roofline
    assert CostModel("cpu", tp=2, profile_dir=str(tmp_path)).linear_time(tiny2, 10) == \
        CostModel("cpu", tp=2).linear_time(tiny2, 10)  # no TP-2 table
    assert CostModel("a100-80g", profile_dir=str(tmp_path)).linear_time(tiny2, 10) == \
        CostModel("a100-80g").linear_time(tiny2, 10)  # other device


def test_profile_dir_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        ProfileIndex(str(tmp_path / "none"))
    with pytest.raises(UserError, match="no mlp.csv"):
        ProfileIndex(str(tmp_path))
    _write_table(tmp_path / "cpu" / "o" / "m", drop=("mlp_act",))
    with pytest.raises(UserError, match="mlp_act"):
        ProfileIndex(str(tmp_path))


@pytest.mark.skipif(not os.path.isdir(SHARED_PROFILES), reason="shared reference profiles absent")
def test_reference_tables_drive_the_model_and_agree_with_the_roofline():
    arch = get_arch("llama-20b")  # Llama-2-7B shape: the Llama-2-7b table applies
    measured = CostModel("a100-80g", tp=2, profile_dir=SHARED_PROFILES)
    table = measured._table(arch)
    assert table is not None and table.tp == 2 and "Llama-2-7b" in table.model
    assert measured.linear_time(arch, 512) == pytest.approx(table.layer_time(512) + table.op_time("add", 512))
    roofline = CostModel("a100-80g", tp=2)
    for n in (1, 64, 512, 4096):
        assert roofline.linear_time(arch, n) == pytest.approx(measured.linear_time(arch, n), rel=0.3)
