"""Request lists (simulator/workload/requests_file.py) and `paraflex simulate --requests FILE`:
exact replay, sorting of out-of-order rows, and one-line errors naming the line and field."""

from __future__ import annotations

import csv

import pytest

from cli_errors import error_line
from paraflex.cli import main
from paraflex.errors import UserError
from paraflex.simulator.workload import SimRequest
from paraflex.simulator.workload.requests_file import load_requests, write_requests
from sim_cases import TWO_TINY_MODELS_YAML

CONTEXT = {"a": 256, "b": 512}
HEADER = "model,arrived_at,num_prefill_tokens,num_decode_tokens\n"
CONFIG = TWO_TINY_MODELS_YAML


def _file(tmp_path, body: str, header: str = HEADER):
    p = tmp_path / "requests.csv"
    p.write_text(header + body)
    return str(p)


def test_round_trip_keeps_ids_times_and_lengths(tmp_path):
    reqs = [SimRequest(7, "a", 0.25, 10, 3), SimRequest(3, "b", 1.5, 20, 4)]
    path = str(tmp_path / "r.csv")
    write_requests(path, reqs)
    got = load_requests(path, CONTEXT)
    assert got.reordered == 0
    assert [(r.id, r.model, r.arrival, r.prompt_len, r.output_len) for r in got.requests] == \
        [(7, "a", 0.25, 10, 3), (3, "b", 1.5, 20, 4)]


def test_unsorted_rows_are_sorted_stably_and_counted(tmp_path):
    got = load_requests(_file(tmp_path, "a,2,1,1\nb,1,1,1\na,1,2,2\n"), CONTEXT)
    assert [(r.id, r.arrival) for r in got.requests] == [(1, 1.0), (2, 1.0), (0, 2.0)]
    assert got.reordered == 3


@pytest.mark.parametrize("body, words", [
    ("c,0,1,1\n", [".csv:2: ", "model 'c'", "choose from a, b"]),
    ("a,-1,1,1\n", [".csv:2: ", "arrived_at '-1'", ">= 0"]),
    ("a,0,1,1\na,inf,1,1\n", [".csv:3: ", "arrived_at 'inf'", "finite"]),
    ("a,x,1,1\n", ["arrived_at 'x'", "not a number"]),
    ("a,0,0,1\n", ["num_prefill_tokens '0'", "integer >= 1"]),
    ("a,0,1,2.5\n", ["num_decode_tokens '2.5'", "integer"]),
    ("a,0,200,57\n", [".csv:2: ", "257", "a's context of 256"]),
    ("a,0,1\n", ["num_decode_tokens is missing"]),
])
def test_bad_rows_name_the_line_and_field(tmp_path, body, words):
    with pytest.raises(UserError) as err:
        load_requests(_file(tmp_path, body), CONTEXT)
    msg = str(err.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_request_ids_must_be_unique_integers(tmp_path):
    header = "request_id," + HEADER
    with pytest.raises(UserError, match=r":3: request_id '1' repeats the request_id of line 2"):
        load_requests(_file(tmp_path, "1,a,0,1,1\n1,a,1,1,1\n", header), CONTEXT)
    with pytest.raises(UserError, match="request_id 'x' is not a number"):
        load_requests(_file(tmp_path, "x,a,0,1,1\n", header), CONTEXT)


def test_empty_and_headerless_files_are_refused(tmp_path):
    with pytest.raises(UserError, match="no rows"):
        load_requests(_file(tmp_path, ""), CONTEXT)
    with pytest.raises(UserError, match="header lacks model"):
        load_requests(_file(tmp_path, "0,1,1\n", "arrived_at,num_prefill_tokens,num_decode_tokens\n"), CONTEXT)


def test_simulate_replays_the_file_exactly(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG)
    path = _file(tmp_path, "b,0.5,12,3\na,0.0,8,5\na,0.7,30,2\n")
    out = tmp_path / "out"
    assert main(["simulate", str(cfg), "--requests", path, "-o", str(out)]) == 0
    assert "2 row(s)" in capsys.readouterr().out
    with open(out / "requests.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    got = sorted((r["id"], r["model"], float(r["arrival_s"]), r["prompt_tokens"], r["output_tokens"]) for r in rows)
    assert got == [("0", "b", 0.5, "12", "3"), ("1", "a", 0.0, "8", "5"), ("2", "a", 0.7, "30", "2")]
    assert all(float(r["finish_s"]) > float(r["first_token_s"]) >= float(r["arrival_s"]) for r in rows)


@pytest.mark.parametrize("extra, flag", [(["--rate", "3"], "--rate"), (["--sweep"], "--sweep"),
                                         (["--num-requests", "5"], "--num-requests")])
def test_simulate_refuses_workload_flags_with_requests(tmp_path, capsys, extra, flag):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG)
    assert main(["simulate", str(cfg), "--requests", _file(tmp_path, "a,0,1,1\n"), *extra]) == 2
    assert error_line(capsys, "simulate").startswith(f"{flag} does not apply with --requests")


def test_simulate_bad_file_is_one_line(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG)
    assert main(["simulate", str(cfg), "--requests", _file(tmp_path, "a,0,1,1\nzz,1,1,1\n")]) == 2
    assert "requests.csv:3: model 'zz'" in error_line(capsys, "simulate")
