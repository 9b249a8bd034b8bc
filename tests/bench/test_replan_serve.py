"""bench/replan_serve.py --tiny end to end: two real `paraflex serve --in-process` runs (static,
then --replan-interval) of a popularity shift; every request completes, none is lost, the static
arm makes no placement action and the live one moves replicas. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # bench/ is no package
from serve_client import Result  # noqa: E402


def test_tiny_shift_static_and_live_lose_nothing(tmp_path):
    out = tmp_path / "replan.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "replan_serve.py"), "--tiny", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    arms = json.loads(out.read_text())["arms"]
    for name, arm in arms.items():
        assert arm["requests"] > 0 and arm["lost"] == 0 and arm["completed"] == arm["requests"], (name, arm)
    assert arms["static"]["placement_actions"] == 0
    assert arms["live"]["placement_actions"] >= 1, proc.stdout
    assert "P99 TTFT before" in proc.stdout


def test_a_stream_is_lost_only_without_done_or_an_explicit_error():
    assert not Result("m", done=True).lost
    assert not Result("m", refused=True, error="HTTP 503: busy").lost
    assert Result("m", output_tokens=3).lost  # tokens came, the stream was cut before [DONE]
