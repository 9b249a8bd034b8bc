"""`paraflex serve` as an operator runs it: a subprocess that prints its URL, answers the
OpenAI client, and stops cleanly on Ctrl-C (SIGINT); bad flags exit 2 with one line."""

from __future__ import annotations

import csv
import os
import signal
import socket
import time

import openai
import pytest
import yaml

from gateway_cluster import config_dict, make_placement
from serve_cli import read_until, served_url, serving
from paraflex.cli import main
from paraflex.errors import UserError


@pytest.fixture
def files(tmp_path):
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(yaml.safe_dump(config_dict()))
    pl = tmp_path / "placement.json"
    make_placement().save(pl)
    return str(cfg), str(pl)


@pytest.mark.slow
def test_serve_prints_url_answers_and_stops_on_ctrl_c(files):
    cfg, pl = files
    with serving([cfg, "--placement", pl, "--in-process", "--port", "0", "--api-key", "k1"]) as (proc, lines):
        start_up = read_until(lines, "/v1", timeout=120)
        url = next(line for line in start_up if "/v1" in line).split()[0]
        assert url.startswith("http://127.0.0.1:")  # loopback unless told otherwise
        # each model warmed up, then the start-up heap frozen, before the socket serves
        assert sorted(line.split()[1] for line in start_up if line.startswith("warm-up: ")) == [
            "tiny-2l", "tiny-4l", "tiny-8l"]
        assert any("objects kept out of garbage collection" in line for line in start_up)
        c = openai.OpenAI(base_url=url, api_key="k1", max_retries=0, timeout=30)
        assert sorted(m.id for m in c.models.list().data) == ["tiny-2l", "tiny-4l", "tiny-8l"]
        done = c.completions.create(model="tiny-4l", prompt="hi", max_tokens=4, extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 4
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        read_until(lines, "garbage collections: generation 0", timeout=5)  # the pauses' totals on the way out
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with socket.socket() as s:  # nothing listens there any more (TIME_WAIT aside)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in os.listdir(f"/proc/{p}/task"):
            try:
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
            except OSError:
                pass
    return out


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads the process tree from /proc (Linux)")
def test_a_local_ray_runs_the_engine_actors_at_the_gateways_priority(files, monkeypatch):
    """Ray starts its workers at nice 15 (batch priority); the engine actors of the Ray instance
    `paraflex serve` starts run at the gateway's (nice 0 here), or a busy machine starves them."""
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    cfg, pl = files
    with serving([cfg, "--placement", pl, "--port", "0"]) as (proc, lines):
        read_until(lines, "/v1", timeout=300)
        engines = []
        for pid in _descendants(proc.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    if b"EngineActor" not in fh.read():
                        continue
                with open(f"/proc/{pid}/stat") as fh:
                    engines.append(int(fh.read().rsplit(")", 1)[1].split()[16]))  # field 19: nice
            except OSError:
                continue
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    assert engines and set(engines) == {os.nice(0)}, engines


@pytest.mark.slow
def test_serve_stops_its_engines_on_sigterm(files):
    """SIGTERM (what a process manager sends) drains and stops the engines like Ctrl-C, and
    exits 143 (uvicorn's re-raised SIGTERM would otherwise kill the process before clean-up)."""
    cfg, pl = files
    with serving([cfg, "--placement", pl, "--in-process", "--port", "0"]) as (proc, lines):
        read_until(lines, "/v1", timeout=120)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
        read_until(lines, "stopping engines", timeout=5)


@pytest.mark.slow
def test_sigterm_answers_503_during_the_drain_window_then_a_second_one_stops(files):
    """What docs/serve.md promises a load balancer: after SIGTERM, /health and new requests get
    503 (Retry-After) from the still-open listener; a second SIGTERM ends the window."""
    import httpx

    cfg, pl = files
    with serving([cfg, "--placement", pl, "--in-process", "--port", "0", "--drain-seconds", "600"]) as (proc, lines):
        url = served_url(lines, timeout=120).removesuffix("/v1")
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health", timeout=10).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)  # the signal is handled between two ticks of the server's loop
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny-2l", "prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "shutting down" in r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
        read_until(lines, "stopping engines", timeout=5)


def test_serve_rejects_a_missing_placement_file(files, tmp_path, capsys):
    cfg, _ = files
    assert main(["serve", cfg, "--placement", str(tmp_path / "nope.json"), "--in-process"]) == 2
    err = capsys.readouterr().err
    assert "--placement" in err and "paraflex plan" in err


def test_serve_rejects_a_taken_port(files, capsys):
    cfg, pl = files
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert main(["serve", cfg, "--placement", pl, "--in-process", "--port", str(port)]) == 2
    assert f"--port: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_serve_rejects_a_bad_outstanding_limit(files, capsys):
    cfg, pl = files
    assert main(["serve", cfg, "--placement", pl, "--in-process", "--max-outstanding", "0"]) == 2
    assert "--max-outstanding" in capsys.readouterr().err


def test_bind_names_the_flag_at_fault():
    from paraflex.gateway.server import bind

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(UserError, match=rf"^--port: cannot listen on 127.0.0.1:{port} \("):
            bind("127.0.0.1", port)
    for host in ("192.0.2.1",):  # TEST-NET-1: on no interface here
        with pytest.raises(UserError, match=rf"^--host: cannot listen on {host}:0 \("):
            bind(host, 0)


def test_an_empty_api_key_is_refused_and_an_empty_env_key_means_none(files, capsys, monkeypatch):
    cfg, pl = files
    assert main(["serve", cfg, "--placement", pl, "--in-process", "--api-key", " "]) == 2
    assert "--api-key: empty; give a key, or leave the flag out" in capsys.readouterr().err
    assert main(["serve", cfg, "--placement", pl, "--in-process", "--api-key", "k3y\n"]) == 2
    assert "--api-key: contains whitespace" in capsys.readouterr().err
    from paraflex.cli import build_parser

    monkeypatch.setenv("PARAFLEX_API_KEY", "")
    assert build_parser().parse_args(["serve"]).api_key is None


@pytest.mark.parametrize("flags, field", [(["--replan-interval", "0"], "--replan-interval"),
                                          (["--replan-interval", "5", "--replan-threshold", "-1"], "--replan-threshold"),
                                          (["--replan-interval", "5", "--replan-hysteresis", "nan"], "--replan-hysteresis")])
def test_serve_rejects_bad_replanning_settings(files, capsys, flags, field):
    cfg, pl = files
    assert main(["serve", cfg, "--placement", pl, "--in-process", *flags]) == 2
    assert field in capsys.readouterr().err


@pytest.mark.slow
def test_serve_with_replanning_meters_requests_and_stops_cleanly(files):
    import httpx

    cfg, pl = files
    with serving([cfg, "--placement", pl, "--in-process", "--port", "0", "--replan-interval", "30"]) as (proc, lines):
        url = served_url(lines, timeout=120)
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=30)
        for _ in range(3):
            c.completions.create(model="tiny-4l", prompt="hi", max_tokens=2)
        text = httpx.get(url.removesuffix("/v1") + "/metrics").text
        assert 'paraflex:arrival_rate{model_name="tiny-4l"} 0.1' in text  # 3 arrivals in its 30 s window
        assert "the rates the live re-planner decides on" in text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130


@pytest.mark.slow
def test_in_process_serve_logs_every_batch_its_engines_run(files, tmp_path):
    cfg, pl = files
    steps = tmp_path / "steps"
    with serving([cfg, "--placement", pl, "--in-process", "--port", "0", "--step-log", str(steps)]) as (proc, lines):
        url = served_url(lines, timeout=120)
        c = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=30)
        for model in ("tiny-2l", "tiny-8l"):
            c.completions.create(model=model, prompt="hi there", max_tokens=3)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    rows = [r for p in steps.glob("engine-*.csv") for r in csv.DictReader(p.open(newline=""))]
    assert {r["model"] for r in rows} == {"tiny-2l", "tiny-8l"}
    assert {r["kind"] for r in rows} >= {"prefill", "decode"}
    assert all(float(r["busy_s"]) >= float(r["run_s"]) > 0 for r in rows)


def test_serve_refuses_a_step_log_folder_it_cannot_make(files, tmp_path, capsys):
    cfg, pl = files
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["serve", cfg, "--placement", pl, "--step-log", str(blocker / "steps")]) == 2
    assert "--step-log" in capsys.readouterr().err
