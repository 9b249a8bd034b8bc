"""Sampler and stop rules: greedy, temperature, top-k, top-p, seeds, logprobs, stops."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paraflex.engine.core.sampling_params import SamplingParams, StopChecker
from paraflex.engine.worker.sampling import Sampler
from paraflex.engine.worker.tokenizer import ByteTokenizer
from paraflex.errors import UserError


def _logits(rows=4, vocab=50, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("temperature", -1.0), ("temperature", float("nan")), ("top_p", 0.0),
    ("top_p", 1.5), ("top_k", -3), ("temperature", 10**400), ("seed", "x"), ("seed", 2**64), ("seed", -(2**63) - 1), ("stop", [""]),
    ("stop", [f"s{i}" for i in range(65)]), ("stop_token_ids", [-1]), ("stop_token_ids", [2**64]), ("logprobs", 21),
])
def test_validate_names_the_bad_field(field, value):
    with pytest.raises(UserError, match=f"^{field}:"):
        SamplingParams(**{field: value}).validate()


def test_every_accepted_extreme_travels_to_an_engine_actor():
    """What validate accepts, msgpack (the Ray backend's wire format) can carry: a top_k beyond
    any vocabulary means the whole vocabulary, seeds at both ends of their range."""
    import msgpack

    for extreme in (dict(top_k=2**64, seed=2**64 - 1, stop_token_ids=[2**63 - 1]), dict(top_k=10**30, seed=-(2**63)),
                    dict(temperature=10**30)):
        params = SamplingParams(**extreme).validate()
        assert SamplingParams.from_dict(msgpack.unpackb(msgpack.packb(params.to_dict()))) == params
    assert SamplingParams(top_k=2**64).validate().top_k == -1


def test_stop_string_is_normalised_to_a_list():
    assert SamplingParams(stop="\n").validate().stop == ["\n"]


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = _logits()
    ids = [f"r{i}" for i in range(4)]
    s = Sampler(0)
    best = logits.argmax(-1).tolist()
    assert s.sample(logits, ids, [SamplingParams(temperature=0)] * 4).token_ids == best
    assert s.sample(logits, ids, [SamplingParams(top_k=1)] * 4).token_ids == best
    assert s.sample(logits, ids, [SamplingParams(top_p=1e-6)] * 4).token_ids == best


def test_extreme_but_valid_values_sample_instead_of_failing():
    """A client may send any valid number: a temperature so small that logits / T overflow
    float32, a top_k beyond the vocabulary (and beyond int64), the widest seeds."""
    logits = _logits(rows=3)
    best = logits.argmax(-1).tolist()
    s = Sampler(0)
    tiny = s.sample(logits, ["a", "b", "c"], [SamplingParams(temperature=t) for t in (1e-45, 1e-300, 1e-6)])
    assert tiny.token_ids == best
    huge_k = [SamplingParams(top_k=10**30, top_p=0.9), SamplingParams(top_k=2**63, seed=2**64 - 1),
              SamplingParams(top_k=51, seed=-(2**63))]
    for p in huge_k:
        p.validate()
    assert all(0 <= t < 50 for t in s.sample(logits, ["a", "b", "c"], huge_k).token_ids)


@given(st.integers(1, 10), st.floats(0.05, 1.0), st.integers(0, 1000))
@settings(max_examples=40, deadline=None)
def test_samples_stay_inside_top_k_and_top_p(k, p, seed):
    logits = _logits(rows=1, vocab=30, seed=seed)
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    allowed = {int(t) for i, t in enumerate(order) if i < k and (i == 0 or mass_before[i] < p)}
    s = Sampler(seed)
    for _ in range(20):
        tok = s.sample(logits, ["r"], [SamplingParams(top_k=k, top_p=p)]).token_ids[0]
        assert tok in allowed


def test_seeded_request_is_reproducible_whatever_the_batch():
    logits = _logits(rows=3, vocab=200)
    p_seeded = SamplingParams(seed=42, temperature=1.5)
    alone = Sampler(1).sample(logits[1:2], ["a"], [p_seeded]).token_ids[0]
    s = Sampler(99)
    in_batch = s.sample(logits, ["x", "a", "y"], [SamplingParams(), p_seeded, SamplingParams()]).token_ids[1]
    assert in_batch == alone
    # the per-request generator advances: the next draw continues the same stream
    s2 = Sampler(5)
    seq = [s2.sample(logits[1:2], ["a"], [p_seeded]).token_ids[0] for _ in range(8)]
    s3 = Sampler(6)
    assert seq == [s3.sample(logits[1:2], ["a"], [p_seeded]).token_ids[0] for _ in range(8)]


def test_temperature_spreads_the_distribution():
    logits = _logits(rows=1, vocab=20)
    s = Sampler(0)
    cold = {s.sample(logits, ["r"], [SamplingParams(temperature=0.05)]).token_ids[0] for _ in range(50)}
    hot = {s.sample(logits, ["r"], [SamplingParams(temperature=5.0)]).token_ids[0] for _ in range(50)}
    assert len(cold) == 1 and len(hot) > 5


def test_logprobs_are_log_softmax_of_the_logits():
    logits = _logits(rows=2)
    res = Sampler(0).sample(logits, ["a", "b"], [SamplingParams(temperature=0, logprobs=3), SamplingParams()])
    lp = torch.log_softmax(logits[0], -1)
    entry = res.logprobs[0]
    assert entry["token"] == res.token_ids[0]
    assert entry["logprob"] == pytest.approx(lp.max().item(), abs=1e-5)
    assert list(entry["top"]) == lp.topk(3).indices.tolist()
    assert res.logprobs[1] is None


def test_stop_rules():
    tok = ByteTokenizer()
    eos = tok.eos_token_ids
    assert StopChecker(SamplingParams(max_tokens=3), eos).check([1, 2]) is None
    assert StopChecker(SamplingParams(max_tokens=3), eos).check([1, 2, 3]) == "length"
    assert StopChecker(SamplingParams(), eos).check([1, 257]) == "stop"
    assert StopChecker(SamplingParams(ignore_eos=True), eos).check([1, 257]) is None
    assert StopChecker(SamplingParams(stop_token_ids=[7]), eos).check([7]) == "stop"
    chk = StopChecker(SamplingParams(stop=["lo w"]), eos, tok.decode)
    text = list(b"hello world")
    ends = [chk.check(text[: i + 1]) for i in range(len(text))]
    assert ends.index("stop") == len("hello w") - 1


def test_a_restarted_request_finds_a_stop_string_across_the_restart():
    """Restarted by recompute after "hello " (paraflex/serving/recompute.py): "lo w" ends at its first
    new token, and max_tokens counts the new tokens only."""
    tok = ByteTokenizer()
    params = SamplingParams(stop=["lo w"], max_tokens=5, resumed=list(b"hello "))
    chk = StopChecker(params, tok.eos_token_ids, tok.decode)
    assert chk.check(list(b"w")) == "stop"
    assert chk.check(list(b"x")) is None
    assert StopChecker(SamplingParams(max_tokens=2, resumed=[1, 2, 3]), []).check([4, 5]) == "length"


def test_a_restarted_seeded_request_draws_what_it_would_have_drawn():
    """A seeded request restarted after k tokens skips the k draws its first run made: its next
    tokens are those of a run never stopped, given the same logits."""
    torch.manual_seed(3)
    logits = torch.randn(6, 50)
    seeded = SamplingParams(seed=11, temperature=1.0)
    whole = Sampler(0)
    straight = [whole.sample(logits[i:i + 1], ["a"], [seeded]).token_ids[0] for i in range(6)]
    resumed = SamplingParams(seed=11, temperature=1.0, resumed=straight[:4])
    again = Sampler(0)
    assert [again.sample(logits[i:i + 1], ["a#recompute1"], [resumed]).token_ids[0] for i in (4, 5)] == straight[4:]
    fresh = Sampler(0)
    assert [fresh.sample(logits[i:i + 1], ["b"], [seeded]).token_ids[0] for i in (4, 5)] != straight[4:]
