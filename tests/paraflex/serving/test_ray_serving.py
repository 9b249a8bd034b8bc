"""Serving on Ray: engine actors running a multi-engine pipeline (tokens equal to the
in-process runtime), KV freed on every engine on finish / abort / disconnect, and the
engine-kill fault (errors within 10 s, other models keep serving, restart and rejoin)."""

from __future__ import annotations

import asyncio
import csv
import time

import pytest
import ray

from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.errors import UserError
from paraflex.serving.backend import Unavailable
from paraflex.serving.in_process import LLMCluster
from paraflex.serving.ray_startup import start_cluster
from ray_cluster import MODELS, make_config, make_placement

pytestmark = pytest.mark.slow

PROMPTS = [[1, 2, 3, 4, 5], [72, 101, 108, 108, 111], [9] * 17]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def backend(ray_session):
    lines: list[str] = []
    b = start_cluster(make_config(), make_placement(), progress=lines.append, max_restarts=1)
    b.progress_lines = lines
    yield b
    b.shutdown()


@pytest.fixture(scope="module")
def reference():
    cluster = LLMCluster(make_config(), make_placement())
    return {m: [r.token_ids for r in cluster.generate(m, PROMPTS, GREEDY)] for m in MODELS}


async def _collect(b, model, prompt, params, rid):
    tokens, last = [], None
    async for out in b.stream(model, prompt, params, rid):
        tokens += out.token_ids
        last = out
    return tokens, last


def _run_all(b, jobs):
    async def go():
        return await asyncio.gather(*[_collect(b, *job) for job in jobs])
    return asyncio.run(go())


def _engines_idle(b, timeout=10.0) -> list[dict]:
    """Poll every engine until none holds a request or a KV block; returns the statuses."""
    deadline = time.monotonic() + timeout
    while True:
        sts = ray.get([a.status.remote() for a in b.engines.actors.values()], timeout=10)
        if all(not st.get("live") and st.get("kv_usage") == 0.0 for st in sts) or time.monotonic() > deadline:
            return sts
        time.sleep(0.1)


def test_startup_progress_is_reported(backend):
    text = "\n".join(backend.progress_lines)
    for e in range(3):
        assert f"engine {e}: ready" in text
    assert "engine 1: loading tiny-4l stage 1 (layers 1-2)" in text
    assert "process group(s) built (gloo)" in text


def test_engines_share_the_one_node_and_health_says_which(backend):
    """One Ray node: the three engines are one placement group, reported at start-up and in /health."""
    node = ray.get_runtime_context().get_node_id()
    assert backend.health()["nodes"] == {str(e): {"node_id": node, "ip": backend.health()["nodes"]["0"]["ip"]}
                                         for e in range(3)}
    assert f"engines on nodes: 0-2 on node {node[:8]}" in "\n".join(backend.progress_lines)
    assert len(backend.engines.nodes.pgs) == 1


def test_engine_threads_run_with_the_actors_share_and_openmp_sleeping_between_regions(backend, ray_session):
    """The engine thread (not only the actor's constructor) has torch's threads of the actor's CPU
    share, and the actor process got the OpenMP wait policy (paraflex.engine.kernels.omp_policy)."""
    from paraflex.engine.kernels import omp_policy

    share = max(1, int(ray.cluster_resources()["CPU"] / len(backend.engines.actors)))
    for st in ray.get([a.status.remote() for a in backend.engines.actors.values()], timeout=10):
        assert st["torch_threads"] == share
        assert st["omp_wait_policy"] == omp_policy.engine_wait_policy()


def test_greedy_tokens_equal_in_process_runtime(backend, reference):
    jobs = [(m, p, GREEDY, f"eq-{m}-{i}") for m in MODELS for i, p in enumerate(PROMPTS)]
    results = _run_all(backend, jobs)
    for (m, _, _, rid), (tokens, last) in zip(jobs, results):
        i = int(rid.rsplit("-", 1)[1])
        assert last.error is None and last.finish_reason == "length"
        assert tokens == reference[m][i], (m, i, tokens, reference[m][i])


def test_kv_freed_on_every_engine_after_finish(backend):
    _run_all(backend, [(m, PROMPTS[0], GREEDY, f"fin-{m}") for m in MODELS])
    sts = _engines_idle(backend)
    assert [st["kv_usage"] for st in sts] == [0.0, 0.0, 0.0]
    assert all(not st["live"] for st in sts)


def test_request_log_records_the_ray_backends_finished_requests(backend, tmp_path):
    """`paraflex serve --request-log` over Ray: one row per finished request, in the simulator's
    columns, with the times ordered (a 2-stage replica's tokens cross engines)."""
    from paraflex.serving.request_log import RequestLog

    log = RequestLog(str(tmp_path / "log.csv"), make_config().models)
    backend.frontend.request_log = log
    try:
        _run_all(backend, [(m, PROMPTS[0], GREEDY, f"log-{m}") for m in MODELS])
    finally:
        backend.frontend.request_log = None
        log.close()
    with open(tmp_path / "log.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert sorted(r["id"] for r in rows) == sorted(f"log-{m}" for m in MODELS)
    for r in rows:
        assert float(r["arrival_s"]) < float(r["first_token_s"]) <= float(r["finish_s"]) and r["output_tokens"] == "6"


def test_abort_and_disconnect_free_kv_on_every_engine(backend):
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def go():
        agen = backend.stream("tiny-4l", PROMPTS[2], long, "abort-me")
        first = await agen.__anext__()
        assert first.token_ids and not first.final
        await backend.abort("abort-me")
        rest = [out async for out in agen]
        gone = backend.stream("tiny-8l", PROMPTS[1], long, "walk-away")
        await gone.__anext__()
        await gone.aclose()  # the client went away mid-stream
        return rest

    rest = asyncio.run(go())
    assert rest[-1].finish_reason == "abort"
    sts = _engines_idle(backend)
    assert [st["kv_usage"] for st in sts] == [0.0, 0.0, 0.0]
    assert backend.metrics().running == {m: 0 for m in MODELS}


def test_metrics_carry_every_engines_swap_counters(backend):
    """Each engine's status() carries its swap totals to RayBackend.metrics() (no swapping in
    this pool: all zero, nothing swapped now)."""
    _engines_idle(backend)
    deadline = time.monotonic() + 10.0
    while set(backend.metrics().swaps) != {0, 1, 2} and time.monotonic() < deadline:
        time.sleep(0.1)  # the monitor polls status() every MONITOR_EVERY_S
    m = backend.metrics()
    zero = {"swap_outs": 0, "swap_ins": 0, "swap_out_bytes": 0, "swap_in_bytes": 0}
    assert m.swaps == {0: zero, 1: zero, 2: zero}
    assert m.swapped == {}


def test_bad_requests_are_user_errors(backend):
    async def first(model, prompt, params):
        return await backend.stream(model, prompt, params, "bad").__anext__()

    with pytest.raises(UserError, match="model"):
        asyncio.run(first("nope", [1], GREEDY))
    with pytest.raises(UserError, match="vocabulary"):
        asyncio.run(first("tiny-2l", [10**6], GREEDY))
    with pytest.raises(UserError, match="max_tokens"):
        asyncio.run(first("tiny-2l", [1], SamplingParams(max_tokens=10**6)))


def test_openai_client_through_the_gateway_and_64_concurrent_streams(backend, reference):
    """The gateway over the Ray backend: the official client gets the runtime's greedy tokens,
    and 64 concurrent streams over three models all end with tokens or an explicit error."""
    openai = pytest.importorskip("openai")
    from paraflex.gateway.app import build_app
    from paraflex.gateway.server import ServerThread

    server = ServerThread(build_app(backend, max_outstanding=128)).start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        tok = backend.models()[0].tokenizer
        prompt = tok.decode(PROMPTS[1])
        plain = client.completions.create(model="tiny-4l", prompt=prompt, max_tokens=6, temperature=0)
        assert plain.choices[0].text == tok.decode(reference["tiny-4l"][1])
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny-8l", prompt=prompt, max_tokens=6, temperature=0, stream=True) if c.choices)
        assert streamed == tok.decode(reference["tiny-8l"][1])

        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)

        async def one(i):
            chunks, finish = 0, None
            stream = await aclient.completions.create(
                model=MODELS[i % 3], prompt=prompt, max_tokens=4 + i % 5, temperature=0, stream=True)
            async for c in stream:
                if c.choices:
                    chunks += 1
                    finish = c.choices[0].finish_reason or finish
            return chunks, finish

        async def run_all():
            try:
                return await asyncio.gather(*[one(i) for i in range(64)], return_exceptions=True)
            finally:
                await aclient.close()

        results = asyncio.run(run_all())
        assert not [r for r in results if isinstance(r, BaseException)]
        assert all(chunks > 0 and finish == "length" for chunks, finish in results)
    finally:
        server.stop()
    assert [st["kv_usage"] for st in _engines_idle(backend)] == [0.0, 0.0, 0.0]


def test_engine_kill_fails_its_replicas_others_serve_then_rejoins(backend, reference):
    long = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)

    async def go():
        victims = [asyncio.ensure_future(_collect(backend, "tiny-4l", PROMPTS[0], long, f"v{i}"))
                   for i in range(2)]
        await asyncio.sleep(1.0)  # they are decoding through engines 0 -> 1 -> 2
        killed_at = time.monotonic()
        ray.kill(backend.engines.actors[1], no_restart=False)  # the process dies; Ray may restart it
        ended = await asyncio.wait_for(asyncio.gather(*victims), timeout=10.0)
        took = time.monotonic() - killed_at
        health = backend.health()
        # tiny-8l lives on engines 2 -> 0; tiny-2l still has its replica on engine 2.
        others = await asyncio.gather(_collect(backend, "tiny-8l", PROMPTS[0], GREEDY, "o1"),
                                      _collect(backend, "tiny-2l", PROMPTS[0], GREEDY, "o2"))
        return ended, took, health, others

    ended, took, health, others = asyncio.run(go())
    assert took < 10.0
    for tokens, last in ended:
        assert last.error and "engine 1" in last.error
    assert health["ok"] is False and health["engines"]["1"] == "dead"
    assert health["models"]["tiny-4l"]["live_replicas"] == 0
    assert health["models"]["tiny-2l"]["live_replicas"] == 1
    assert others[0][1].finish_reason == "length" and others[1][1].finish_reason == "length"
    assert others[0][0] == reference["tiny-8l"][0], (others[0][0], reference["tiny-8l"][0])
    assert others[1][0] == reference["tiny-2l"][0], (others[1][0], reference["tiny-2l"][0])

    deadline = time.monotonic() + 90
    while not backend.health()["ok"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert backend.health()["ok"], backend.health()
    (tokens, last), = _run_all(backend, [("tiny-4l", PROMPTS[0], GREEDY, "after-rejoin")])
    assert last.error is None and tokens == reference["tiny-4l"][0]
    assert [st["kv_usage"] for st in _engines_idle(backend)] == [0.0, 0.0, 0.0]


def test_engine_gone_for_good_is_an_error_not_a_hang(backend):
    ray.kill(backend.engines.actors[0], no_restart=True)
    deadline = time.monotonic() + 10
    while backend.health()["engines"]["0"] != "dead" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert backend.health()["engines"]["0"] == "dead"
    with pytest.raises(Unavailable, match="model 'tiny-8l' has no live replica: engine 0 dead.*retry later"):
        asyncio.run(backend.stream("tiny-8l", PROMPTS[0], GREEDY, "no-replica").__anext__())
    (tokens, last), = _run_all(backend, [("tiny-2l", PROMPTS[0], GREEDY, "still-fine")])
    assert last.finish_reason == "length" and len(tokens) == GREEDY.max_tokens


def test_output_records_keep_their_order_through_the_router(ray_session):
    """A request's final record must never overtake its earlier tokens (the gateway drops
    records of a finished stream)."""
    from paraflex.engine.ray_output import BatchingSink, OutputRouter, unpack_records

    router = OutputRouter.remote()
    sink = BatchingSink(router)
    try:
        for i in range(3000):
            sink.on_output(f"r{i % 7}", [i], None, None)
            if i % 50 == 0:
                time.sleep(0.001)  # let pushes go out in many small payloads
        got: list[int] = []
        deadline = time.monotonic() + 30
        while len(got) < 3000 and time.monotonic() < deadline:
            for payload in ray.get(router.take.remote(0.2)):
                got += [rec[1][0] for rec in unpack_records(payload)]
        assert got == list(range(3000))
    finally:
        sink.close()
        ray.kill(router)
