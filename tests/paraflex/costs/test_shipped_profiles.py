"""The Vidur tables shipped in the package (`cluster.profile_dir: vidur`): every table of the
shared data is there, compacted without changing what the cost model reads."""

import os

import pytest

from paraflex.config.schema import load_config
from paraflex.costs.profile_tables import LAYER_OPS, ProfileIndex, write_median_csv
from paraflex.models.catalog import get_arch
from paraflex.shipped import profiles_path
from repo_paths import SHARED

SHARED_PROFILES = SHARED / "data" / "profiles"
needs_shared = pytest.mark.skipif(not SHARED_PROFILES.is_dir(), reason="needs ../shared/data/profiles")


@needs_shared
def test_shipped_tables_give_the_shared_tables_times():
    shipped, full = ProfileIndex(profiles_path()), ProfileIndex(str(SHARED_PROFILES))
    assert len(shipped.tables) == len(full.tables) >= 30
    for device in ("a100-80g", "h100-80g"):
        for name in ("llama-2-7b", "llama-2-70b", "phi-2"):
            for tp in (1, 8):
                a, b = shipped.lookup(device, get_arch(name), tp), full.lookup(device, get_arch(name), tp)
                assert (a is None) == (b is None)
                if a is None:
                    continue
                assert a.num_tokens == b.num_tokens and set(a.times) == set(b.times)
                for n in (1, 37, 512, 4096):
                    assert a.layer_time(n) == pytest.approx(b.layer_time(n), rel=1e-3)  # 4 significant digits


def test_write_median_csv_keeps_what_the_reader_reads(tmp_path):
    src, dst = tmp_path / "full.csv", tmp_path / "out" / "mlp.csv"
    stats = ("min", "max", "mean", "median", "std")
    cols = [f"time_stats.{op}.{s}" for op in ("emb",) + LAYER_OPS for s in stats]
    shape = "n_head,n_kv_head,n_embd,n_expanded_embd,vocab_size,use_gated_mlp,num_tokens,num_tensor_parallel_workers"
    lines = [",".join(cols) + "," + shape]
    for n in (1, 2):
        lines.append(",".join(f"{0.123456789 * n:.9f}" for _ in cols) + f",4,4,64,128,100,True,{n},1")
    src.write_text("\n".join(lines) + "\n")
    assert write_median_csv(str(src), str(dst)) == 2
    header = dst.read_text().splitlines()[0].split(",")
    assert all(c.endswith(".median") for c in header[: len(LAYER_OPS) + 1])
    (table,) = ProfileIndex(str(tmp_path / "out")).tables
    assert table.times["attn_pre_proj"] == pytest.approx([0.1235e-3, 0.2469e-3])


def test_profile_dir_vidur_names_the_shipped_tables(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cluster: {num_engines: 2, device: a100-80g, profile_dir: vidur}\n"
                   "models: [{name: m, arch: llama-2-7b}]\n")
    config = load_config(str(cfg))
    assert config.cluster.profile_dir == profiles_path()
    assert os.path.isfile(os.path.join(profiles_path(), "LICENSE"))
    arch = get_arch("llama-2-7b")
    measured = ProfileIndex(profiles_path()).lookup("a100-80g", arch, 1)
    assert config.cluster.cost_model().linear_time(arch, 512) == pytest.approx(
        measured.layer_time(512) + measured.op_time("add", 512))
