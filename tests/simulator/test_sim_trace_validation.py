"""Trace CSV validation: non-finite or huge values, non-UTF-8 bytes and a BOM give one-line
errors (exit 2) or load cleanly, never a traceback."""

from __future__ import annotations

import pytest

from paraflex.cli import main
from paraflex.errors import UserError
from paraflex.simulator.workload.trace import load_trace

HEADER = "arrived_at,num_prefill_tokens,num_decode_tokens\n"
CONFIG = """
cluster: {num_engines: 1, device: cpu, memory_gb: 1}
models:
  - {name: a, arch: tiny-2l}
"""


@pytest.mark.parametrize("row", ["1,inf,5", "inf,10,5", "1,5,-inf", "1,1e30,5", "0,10,2147483648"])
def test_non_finite_and_huge_values_are_bad_values(tmp_path, row):
    trace = tmp_path / "t.csv"
    trace.write_text(HEADER + "0,10,5\n" + row + "\n")
    with pytest.raises(UserError, match=rf"t.csv:3: bad values '{row}'; need a finite arrived_at >= 0 .*at most 2147483647"):
        load_trace(str(trace))


def test_largest_token_count_loads(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(HEADER + "0,2147483647,5\n")
    assert load_trace(str(trace)).prompt.tolist() == [2**31 - 1]


def test_non_utf8_trace_is_a_user_error(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_bytes(b"\xff\xfe\x00\x01\x02")
    with pytest.raises(UserError, match=r"t.csv': not a UTF-8 text CSV"):
        load_trace(str(trace))


def test_utf8_bom_is_accepted(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_bytes(("\ufeff" + HEADER + "0,10,5\r\n0.5,7,3\r\n").encode())
    t = load_trace(str(trace))
    assert t.prompt.tolist() == [10, 7] and t.output.tolist() == [5, 3]


@pytest.mark.parametrize("data, fix", [
    (HEADER.encode() + b"1,inf,5\n", "bad values '1,inf,5'"),
    (HEADER.encode() + b"1,1e30,5\n", "at most 2147483647"),
    (b"\xff\xfe\x00\x01", "not a UTF-8 text CSV"),
], ids=["inf", "huge", "binary"])
def test_simulate_reports_bad_traces_on_one_line(tmp_path, capsys, data, fix):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG)
    trace = tmp_path / "t.csv"
    trace.write_bytes(data)
    code = main(["simulate", str(cfg), "--rate", "1", "--trace", str(trace), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and fix in err and len(err.splitlines()) == 1
