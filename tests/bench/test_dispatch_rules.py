"""bench/dispatch_rules.py: the 3-model CPU mix under each dispatch rule, simulated."""

from __future__ import annotations

from repo_paths import load_bench


def test_each_rule_gets_its_config_and_the_same_requests(tmp_path):
    dr = load_bench("dispatch_rules")
    dirs = dr.shape_dirs(str(tmp_path))
    shares = {n: 1.0 for n in dr.NAMES}
    home = dr.mix_config(dirs, shares, "home-first:64", 100000)
    assert home.scheduler.dispatch == "home-first" and home.scheduler.home_margin == 64
    assert dr.mix_config(dirs, shares, "least-load", "auto").scheduler.dispatch == "least-load"
    assert dr.poisson_requests(shares, 20.0, 3) == dr.poisson_requests(shares, 20.0, 3)
    reqs = dr.poisson_requests({"a": 2.0}, 50.0, 0)
    assert 60 < len(reqs) < 140 and all(0 <= r.arrival < 50.0 for r in reqs)  # Poisson: 100 expected


def test_the_table_has_a_row_per_popularity_and_rate(capsys):
    dr = load_bench("dispatch_rules")
    assert dr.main(["--rates", "2", "--seeds", "0", "--duration", "10", "--rules", "least-load,home-first"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("zipf", "balanced"))]
    assert len(rows) == 2 and all("(1.00x)" in row and row.count(" / ") == 2 for row in rows)
