"""The runtime's API around the pipeline: streaming, aborts, stops, seeds, errors, the
background thread, the demo models, and the `paraflex generate` command."""

import threading
import time

import pytest
import torch
from oracle_models import make_placement

from paraflex.cli import main
from paraflex.config.schema import Config
from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.errors import ParaflexError, UserError
from paraflex.engine.core.messages import FreeMessage
from paraflex.engine.transport.base import Envelope
from paraflex.serving.recompute import MAX_RECOMPUTES
from paraflex.serving.in_process import LLMCluster

torch.set_num_threads(1)


def _demo_config(num_engines=2, block_bytes=4096):
    return Config.from_dict({
        "cluster": {"num_engines": num_engines, "device": "cpu", "memory_gb": 1},
        "models": [{"name": "tiny-4l", "arch": "tiny-4l"}, {"name": "tiny-2l", "arch": "tiny-2l"}],
        "scheduler": {"block_bytes": block_bytes, "max_batch_size": 4},
    })


@pytest.fixture(scope="module")
def cluster():
    pl = make_placement({"tiny-4l": (4, [(0, 1), (1, 4)], [[0, 1]]), "tiny-2l": (2, [(0, 2)], [[1]])}, 2)
    return LLMCluster(_demo_config(), pl, kv_bytes=1 << 20)


class Sink:
    def __init__(self):
        self.calls = []

    def on_output(self, rid, token_ids, finish_reason, error, **extra):
        self.calls.append((list(token_ids), finish_reason, error, extra))

    @property
    def tokens(self):
        return [t for c in self.calls for t in c[0]]


def test_demo_weights_do_not_depend_on_the_stage_cut(cluster):
    """Random demo weights are seeded per (model, tensor): one stage or two, same function."""
    one = LLMCluster(_demo_config(1), make_placement({"tiny-4l": (4, [(0, 4)], [[0]])}, 1), kv_bytes=1 << 20)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = ["hello", "paged attention"]
    assert [r.token_ids for r in one.generate("tiny-4l", prompts, params)] == \
        [r.token_ids for r in cluster.generate("tiny-4l", prompts, params)]


def test_streaming_one_token_per_call_then_finish(cluster):
    sink = Sink()
    cluster.submit("tiny-4l", [256, 104, 105], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), sink=sink)
    cluster.run_until_idle()
    assert [len(c[0]) for c in sink.calls] == [1] * 5
    assert [c[1] for c in sink.calls] == [None] * 4 + ["length"]


def test_abort_mid_stream_frees_kv_everywhere(cluster):
    sink = Sink()
    rid = cluster.submit("tiny-4l", [256, 1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True), sink=sink)
    for _ in range(12):
        cluster.step()
    assert 0 < len(sink.tokens) < 200
    cluster.abort(rid)
    cluster.run_until_idle()
    assert sink.calls[-1][1] == "abort" and sink.calls[-1][2] is None
    for _ in range(5):  # let the free messages land
        cluster.step()
    for engine in cluster.engines:
        assert engine.scheduler.pool.num_used == 0
        assert engine.scheduler.num_live == 0


def test_stop_string_and_stop_token_end_the_request(cluster):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    free_run = cluster.generate("tiny-2l", "abc", params)[0]
    target = free_run.token_ids[4]
    by_id = cluster.generate("tiny-2l", "abc", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                              stop_token_ids=[target]))[0]
    first = free_run.token_ids.index(target)
    assert by_id.finish_reason == "stop" and by_id.token_ids == free_run.token_ids[: first + 1]
    tok = cluster.tokenizer("tiny-2l")
    stop = tok.decode(free_run.token_ids)[-3:]  # text the free run ends with
    cut = next(i for i in range(12) if stop in tok.decode(free_run.token_ids[: i + 1]))
    by_text = cluster.generate("tiny-2l", "abc", SamplingParams(max_tokens=12, temperature=0,
                                                                ignore_eos=True, stop=[stop]))[0]
    assert by_text.token_ids == free_run.token_ids[: cut + 1]
    assert by_text.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_logprobs_flow(cluster):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True, logprobs=2)
    a = cluster.generate("tiny-4l", ["x", "yy"], params)
    b = cluster.generate("tiny-4l", ["yy", "x"], params)
    assert a[0].token_ids == b[1].token_ids and a[1].token_ids == b[0].token_ids
    assert len(a[0].logprobs) == 6 and all(lp["logprob"] <= 0 for lp in a[0].logprobs)
    assert [lp["token"] for lp in a[0].logprobs] == a[0].token_ids


def test_bad_requests_are_user_errors(cluster):
    with pytest.raises(UserError, match="model"):
        cluster.submit("nope", [1], SamplingParams())
    with pytest.raises(UserError, match="prompt"):
        cluster.submit("tiny-2l", [], SamplingParams())
    with pytest.raises(UserError, match="vocabulary"):
        cluster.submit("tiny-2l", [999], SamplingParams())
    with pytest.raises(UserError, match="max_tokens"):
        cluster.submit("tiny-2l", [1], SamplingParams(max_tokens=10_000))
    with pytest.raises(UserError, match="top_p"):
        cluster.submit("tiny-2l", [1], SamplingParams(top_p=0))


def test_a_request_outgrowing_an_engine_kv_pool_is_refused_and_a_reused_id_ends_alone():
    """Inside the context (2,048) but not inside the 48-block pool: refused at submit, naming
    max_tokens. An id used before (the engines remember it): that request ends with the engine's
    refusal, and the background loop goes on serving."""
    pl = make_placement({"tiny-2l": (2, [(0, 2)], [[0]])}, 2)
    c = LLMCluster(_demo_config(), pl, kv_bytes=200_000, host_kv_bytes=0, models=["tiny-2l"])
    with pytest.raises(UserError, match=r"max_tokens: prompt \(3\) \+ max_tokens \(400\) of tiny-2l need KV for 402 "
                                        r"tokens on engine 0, whose pool holds 384 per request"):
        c.submit("tiny-2l", [256, 5, 6], SamplingParams(max_tokens=400))
    # a prompt the first stage would never admit above its 1-block watermark (it waited for ever)
    with pytest.raises(UserError, match=r"prompt: 377 tokens of tiny-2l do not fit the KV pool of engine 0, which "
                                        r"admits prompts of up to 368 tokens"):
        c.submit("tiny-2l", [256] * 377, SamplingParams(max_tokens=1))
    assert c.generate("tiny-2l", [[256] * 368], SamplingParams(max_tokens=1), timeout_s=30)[0].token_ids
    assert c.max_model_len("tiny-2l") == 385  # not the model's 2,048: what /v1/models reports
    c.start()
    try:
        sinks = [Sink(), Sink(), Sink()]
        for rid, sink in zip(["a", "a", "b"], sinks):
            c.submit("tiny-2l", [256, 5], SamplingParams(max_tokens=3), request_id=rid, sink=sink)
            deadline = time.monotonic() + 30
            while not (sink.calls and sink.calls[-1][1]) and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        c.shutdown()
    assert [s.calls[-1][1] for s in sinks] == ["length", "abort", "length"]
    assert sinks[1].calls[-1][2].startswith("engine 0 refused the request: request id 'a' already used on engine 0")
    assert c.loop_error is None


def test_background_thread_serves_concurrent_clients():
    pl = make_placement({"tiny-2l": (2, [(0, 1), (1, 2)], [[0, 1]])}, 2)
    c = LLMCluster(_demo_config(), pl, kv_bytes=1 << 20, models=["tiny-2l"])
    c.start()
    try:
        out = {}

        def client(i):
            out[i] = c.generate("tiny-2l", f"client {i}", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                                timeout_s=60)[0]

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        c.shutdown()
    assert all(len(out[i].token_ids) == 6 and out[i].finish_reason == "length" for i in range(4))


def test_background_thread_frees_every_stage_after_the_last_request_ends():
    """The last request's free travels from its last stage (engine 1) back to its first stage
    (engine 0) after the request left the live set: the thread must deliver it, not go idle."""
    pl = make_placement({"tiny-4l": (4, [(0, 1), (1, 4)], [[0, 1]])}, 2)
    c = LLMCluster(_demo_config(), pl, kv_bytes=1 << 20, models=["tiny-4l"])
    c.start()
    try:
        out = c.generate("tiny-4l", "last one", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                         timeout_s=60)[0]
        assert out.finish_reason == "length"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(e.scheduler.pool.num_used for e in c.engines):
            time.sleep(0.01)
        assert [e.scheduler.pool.num_used for e in c.engines] == [0, 0]
    finally:
        c.shutdown()


def test_generate_command_prints_the_completion(tmp_path, capsys):
    cfg = tmp_path / "demo.yaml"
    cfg.write_text(
        "cluster: {num_engines: 2, device: cpu, memory_gb: 0.5}\n"
        "models:\n  - {name: tiny-2l, arch: tiny-2l}\n  - {name: tiny-8l, arch: tiny-8l}\n"
        "planner: {kappa_gb: 0.01}\n"
    )
    code = main(["generate", str(cfg), "--model", "tiny-8l", "--prompt", "hi", "--max-tokens", "5",
                 "--ignore-eos", "--quiet"])
    captured = capsys.readouterr()
    assert code == 0 and captured.out.endswith("\n") and captured.err == ""
    assert main(["generate", str(cfg), "--model", "nope", "--prompt", "hi"]) == 2
    assert "nope" in capsys.readouterr().err


@pytest.mark.parametrize("part, method", [("worker", "run"), ("sampler", "sample")])
def test_a_failing_batch_fails_its_requests_not_the_engine(monkeypatch, part, method):
    """The forward pass or the sampling of the last stage raises: that batch's request ends
    with the error, its KV frees everywhere, the engine serves the next request."""
    pl = make_placement({"tiny-2l": (2, [(0, 1), (1, 2)], [[0, 1]])}, 2)
    c = LLMCluster(_demo_config(), pl, kv_bytes=1 << 20, models=["tiny-2l"])
    target = getattr(c.engines[1], part)
    real = getattr(target, method)
    monkeypatch.setattr(target, method, lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    sink = Sink()
    c.submit("tiny-2l", [256, 1, 2], SamplingParams(max_tokens=4), sink=sink)
    c.run_until_idle()
    assert sink.calls == [([], "abort", "RuntimeError: boom", {})]
    for _ in range(3):
        c.step()
    assert all(e.scheduler.pool.num_used == 0 for e in c.engines)
    monkeypatch.setattr(target, method, real)  # the engine still serves the next request
    ok = c.generate("tiny-2l", "hi", SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert ok.finish_reason == "length" and len(ok.token_ids) == 3


def test_after_the_engine_loop_fails_every_request_ends_and_new_ones_are_refused(monkeypatch, caplog):
    pl = make_placement({"tiny-2l": (2, [(0, 2)], [[0]])}, 2)
    c = LLMCluster(_demo_config(), pl, kv_bytes=1 << 20, models=["tiny-2l"])
    running, second = Sink(), Sink()
    c.submit("tiny-2l", [256, 1, 2], SamplingParams(max_tokens=4), request_id="running", sink=running)
    c.step()  # "running" is admitted and has run its prompt
    c.submit("tiny-2l", [256, 3], SamplingParams(max_tokens=4), request_id="second", sink=second)
    monkeypatch.setattr(c.engines[0], "step", lambda: (_ for _ in ()).throw(RuntimeError("engine bug")))
    c._loop()  # what the background thread runs: returns once it failed
    error = "runtime loop failed: RuntimeError: engine bug"
    assert running.calls[-1] == ([], "abort", error, {}) and second.calls == [([], "abort", error, {})]
    assert "the engine loop failed" in caplog.text and "RuntimeError: engine bug" in caplog.text  # with its traceback
    with pytest.raises(ParaflexError, match="engines stopped after an internal error .*engine bug.*restart"):
        c.submit("tiny-2l", [256], SamplingParams(max_tokens=2), sink=Sink())


def test_a_failure_while_admitting_ends_the_requests_queued_behind_it(monkeypatch):
    pl = make_placement({"tiny-2l": (2, [(0, 2)], [[0]])}, 2)
    c = LLMCluster(_demo_config(), pl, kv_bytes=1 << 20, models=["tiny-2l"])
    monkeypatch.setattr(c.frontend.dispatcher, "pick", lambda model, among=None: (_ for _ in ()).throw(RuntimeError("dispatch bug")))
    sinks = [Sink(), Sink()]
    for i, sink in enumerate(sinks):
        c.submit("tiny-2l", [256, i], SamplingParams(max_tokens=2), sink=sink)
    c._loop()
    assert [s.calls for s in sinks] == [[([], "abort", "runtime loop failed: RuntimeError: dispatch bug", {})]] * 2


@pytest.mark.parametrize("threaded", [False, True])
def test_a_kv_stall_restarts_the_newest_holder_by_recompute_and_every_request_completes(threaded):
    """8 greedy requests whose decodes outgrow a 48-block pool with no swap space: step by step
    no engine could run anything. The runtime stops the newest request holding KV, frees it on
    every stage and restarts it from its prompt and the tokens it has (paraflex/serving/recompute.py)
    once its replica can take it back: every request completes with all its tokens, the same
    tokens as when it runs alone, and the pools end empty."""
    pl = make_placement({"tiny-2l": (2, [(0, 2)], [[0]])}, 2)
    greedy = SamplingParams(max_tokens=120, ignore_eos=True, temperature=0)
    prompts = [[256] + [5 + i] * 60 for i in range(8)]
    alone = LLMCluster(_demo_config(), pl, kv_bytes=2_000_000, host_kv_bytes=0, models=["tiny-2l"])
    expected = [alone.generate("tiny-2l", p, greedy)[0].token_ids for p in prompts]
    c = LLMCluster(_demo_config(), pl, kv_bytes=200_000, host_kv_bytes=0, models=["tiny-2l"])
    assert c.engines[0].scheduler.pool.capacity == 48  # 384 tokens per layer; each request needs 181
    sinks = [Sink() for _ in range(8)]
    for prompt, sink in zip(prompts, sinks):
        c.submit("tiny-2l", prompt, greedy, sink=sink)
    if threaded:
        c.start()
        deadline = time.monotonic() + 120
        while c.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
        c.shutdown()
    else:
        c.run_until_idle(timeout_s=120)
    assert c.frontend.restarts.preemptions["tiny-2l"] >= 1
    assert [s.calls[-1][1:3] for s in sinks] == [("length", None)] * 8
    assert [s.tokens for s in sinks] == expected
    assert all(e.scheduler.pool.num_used == 0 for e in c.engines)


def _stalled(n=6):
    """n requests on a 48-block pool without swap, stepped until nothing moves: (cluster, sinks,
    request ids, indexes of the requests holding KV, oldest first)."""
    pl = make_placement({"tiny-2l": (2, [(0, 2)], [[0]])}, 2)
    c = LLMCluster(_demo_config(), pl, kv_bytes=200_000, host_kv_bytes=0, models=["tiny-2l"])
    sinks = [Sink() for _ in range(n)]
    rids = [c.submit("tiny-2l", [256] + [5 + i] * 60, SamplingParams(max_tokens=120, ignore_eos=True), sink=sink)
            for i, sink in enumerate(sinks)]
    while c.step() or c.hub.pending():
        pass
    holders = [i for i, s in enumerate(sinks) if s.tokens and not s.calls[-1][1]]
    assert len(holders) >= 2
    return c, sinks, rids, holders


def test_the_background_loop_hands_each_replica_to_the_stall_watch():
    """Driven by hand up to the stall (no exact detection involved): two checks of the watch
    5 s apart stop the newest request that has tokens; it is held (its stream open) while the
    others of its replica run, then restarts, and every request completes."""
    c, sinks, _, _ = _stalled()
    used = c.engines[0].scheduler.pool.num_used
    c.watch_stalls(100.0)
    c.watch_stalls(105.0)
    assert c.frontend.restarts.preemptions == {"tiny-2l": 1} and c.held() == {"tiny-2l": 1}
    while c.hub.pending():
        c.step()
    assert c.engines[0].scheduler.pool.num_used < used  # the stopped request's KV is free
    assert not any(s.calls[-1][1] for s in sinks if s.calls)  # nobody ended
    c.run_until_idle(timeout_s=120)
    assert [s.calls[-1][1:3] for s in sinks] == [("length", None)] * 6
    assert all(len(s.tokens) == 120 for s in sinks) and c.held() == {}


def test_a_held_request_can_be_aborted_and_a_restarted_one_is_not_named_before_its_first_token():
    """Two requests stopped by the watch: the client aborts one while it is held (it ends
    "abort", nothing left to free). Aborting a running request releases the other: until its
    new run has a token it holds no KV, so the watch is told 0 tokens for it."""
    c, sinks, rids, holders = _stalled()
    for now in (100.0, 105.0, 110.0, 115.0):  # the first stop changes the replica: 5 s more
        c.watch_stalls(now)
    assert c.held() == {"tiny-2l": 2}
    first, second = holders[-1], holders[-2]  # stopped in this order
    c.abort(rids[first])
    c.step()
    assert sinks[first].calls[-1][1:3] == ("abort", None) and c.held() == {"tiny-2l": 1}
    c.abort(rids[holders[0]])  # a running request ends: the held one goes back
    c.step()
    assert c.held() == {}

    class Capture:
        def check(self, now, runs, replicas):
            self.replicas = replicas
            return []

    c.frontend.stall_watch = Capture()
    c.watch_stalls(200.0)
    fed = {r.rid: r.tokens for r in c.frontend.stall_watch.replicas[("tiny-2l", 0)][1]}
    assert sinks[second].tokens and fed[rids[second]] == 0
    c.run_until_idle(timeout_s=120)
    assert len(sinks[second].tokens) == 120 and sinks[second].calls[-1][1] == "length"


def test_a_request_stopped_once_more_than_the_restart_cap_ends_with_the_stall_error():
    """The newest holder has been restarted MAX_RECOMPUTES times: the watch's next stop ends it
    (finish_reason "abort", the error names the config fields), frees its KV, and the others
    complete."""
    c, sinks, rids, holders = _stalled()
    newest = holders[-1]
    c.frontend.live[rids[newest]].recomputes = MAX_RECOMPUTES
    c.watch_stalls(100.0)
    c.watch_stalls(105.0)
    reason, error = sinks[newest].calls[-1][1:3]
    assert reason == "abort" and error.startswith("stopped to free KV memory: no batch of tiny-2l ran")
    assert f"restarted by recompute {MAX_RECOMPUTES} times" in error and "cluster.memory_gb" in error
    assert c.frontend.restarts.preemptions == {} and c.held() == {}
    c.run_until_idle(timeout_s=120)
    assert all(s.calls[-1][1:3] == ("length", None) for i, s in enumerate(sinks) if i != newest)
    assert all(e.scheduler.pool.num_used == 0 for e in c.engines)


def test_after_a_loop_failure_with_a_request_held_for_a_restart_nothing_is_left(monkeypatch):
    """The loop fails while a request waits for its restart: every request ends with the
    failure, the held one too, and ending them queues no restart (nothing left unfinished)."""
    c, sinks, _, holders = _stalled()
    c.watch_stalls(100.0)
    c.watch_stalls(105.0)
    assert c.held() == {"tiny-2l": 1}
    monkeypatch.setattr(c.engines[0], "step", lambda: (_ for _ in ()).throw(RuntimeError("engine bug")))
    c._loop()
    assert all(s.calls[-1][1:3] == ("abort", "runtime loop failed: RuntimeError: engine bug") for s in sinks)
    assert not c.has_unfinished()


def test_a_batch_a_later_stage_can_never_hold_fails_its_requests_not_the_engine():
    """Stage 0 (1 layer) packs four prompts into one prefill batch that stage 1 (3 layers, the
    same 24 blocks) can never hold: those requests end with the explicit error, the engine goes
    on, a request alone then completes, and no KV is left anywhere."""
    cfg = Config.from_dict({"cluster": {"num_engines": 2, "device": "cpu", "memory_gb": 1},
                            "models": [{"name": "tiny-4l", "arch": "tiny-4l"}],
                            "scheduler": {"block_bytes": 4096, "max_batch_size": 4}})
    pl = make_placement({"tiny-4l": (4, [(0, 1), (1, 4)], [[0, 1]])}, 2)
    c = LLMCluster(cfg, pl, kv_bytes=100_000, host_kv_bytes=0)
    sinks = [Sink() for _ in range(4)]
    for i, sink in enumerate(sinks):
        c.submit("tiny-4l", [256] + [5 + i] * 39, SamplingParams(max_tokens=8), sink=sink)
    c.run_until_idle(timeout_s=60)
    for sink in sinks:
        reason, error = sink.calls[-1][1:3]
        assert reason == "abort" and "needs 36 KV blocks, the pool holds 24" in error and "cluster.memory_gb" in error
    alone = c.generate("tiny-4l", [[256] + [5] * 39], SamplingParams(max_tokens=8, ignore_eos=True), timeout_s=60)[0]
    assert alone.error is None and len(alone.token_ids) == 8
    assert all(e.scheduler.pool.num_used == 0 for e in c.engines)


def test_a_later_stage_given_more_hidden_rows_than_its_batch_has_tokens_fails_the_batch_not_the_process(cluster):
    """The worker checks the rows it received against the batch's tokens before the compiled
    kernels read them (a mismatch read past their buffers and crashed an engine process)."""
    e0, e1 = cluster.engines
    e0.scheduler.add_request("rows", "tiny-4l", 3, 2, 0.0, prompt_token_ids=[256, 7, 8])
    b0 = e0.scheduler.schedule()
    hidden = e0.worker.run(b0, None)
    e0.scheduler.complete(b0)
    e1.scheduler.receive_batch(b0.message)
    b1 = e1.scheduler.schedule()
    with pytest.raises(ParaflexError, match="4 hidden rows received for 3 tokens"):
        e1.worker.run(b1, torch.cat([hidden, hidden[:1]]))
    assert e1.worker.run(b1, hidden).shape[0] == 1  # the right rows run
    e1.scheduler.complete(b1, tokens={"rows": 5})
    for e in (e0, e1):
        e.scheduler.abort("rows")


def test_a_batch_arriving_after_all_its_requests_ended_leaves_no_hidden_states_behind():
    """Over Ray the abort can reach a later stage before the batch does: nothing of the batch
    runs there, and its received tensors are dropped, not parked for ever."""
    pl = make_placement({"tiny-4l": (4, [(0, 1), (1, 4)], [[0, 1]])}, 2)
    c = LLMCluster(_demo_config(), pl, kv_bytes=1 << 20, models=["tiny-4l"])
    e0, e1 = c.engines
    e0.add_request("tiny-4l", "p", [256, 5, 6], SamplingParams(max_tokens=4))
    assert e0.step()  # the prompt ran at stage 0; its batch is on its way to stage 1
    e1.handle(Envelope(1, 1, "tiny-4l", "free", FreeMessage("tiny-4l", ["p"], "aborted").to_dict()))
    assert not e1.step() and not e1._parked


def test_a_hand_placement_that_validation_rejects_is_refused_before_any_engine_loads(caplog):
    """Two stages of one replica on one engine ((4)), and a placement for another engine count:
    `LLMCluster` refuses each in one line naming the violation and the fix, as `paraflex plan
    --validate` would. A route out of consecutive order (P1) runs (the engines follow any
    route) with a warning naming it."""
    doubled = make_placement({"tiny-4l": (4, [(0, 1), (1, 4)], [[0, 0]]), "tiny-2l": (2, [(0, 2)], [[1]])}, 2)
    with pytest.raises(UserError, match=r"placement: invalid placement for <dict>: \(4\): model tiny-4l has two "
                                        r"stages on engine 0 .*paraflex plan --validate"):
        LLMCluster(_demo_config(), doubled, kv_bytes=1 << 20)
    small = make_placement({"tiny-4l": (4, [(0, 4)], [[0]]), "tiny-2l": (2, [(0, 2)], [[0]])}, 1)
    with pytest.raises(UserError, match=r"placement has 1 engines x 1 devices but the config has cluster.num_engines = 2"):
        LLMCluster(_demo_config(), small, kv_bytes=1 << 20)
    wrapped = make_placement({"tiny-4l": (4, [(0, 1), (1, 4)], [[1, 0]]), "tiny-2l": (2, [(0, 2)], [[1]])}, 2)
    with caplog.at_level("WARNING", logger="paraflex.serving.in_process"):
        LLMCluster(_demo_config(), wrapped, kv_bytes=1 << 20)
    assert "P1: model tiny-4l replica 0: stage 1 on engine 0 does not follow stage 0 on engine 1" in caplog.text
