"""`paraflex generate CONFIG --model NAME --prompt TEXT`: run one prompt through the pipeline.

Place in the data flow: loads the config, plans it (or reads `--placement`), builds the
engines that hold stages of the chosen model in this process (`paraflex.serving.in_process.LLMCluster`),
and streams the completion to stdout; loading progress goes to stderr.
"""

from __future__ import annotations

import sys

NAME = "generate"
HELP = "generate text for one prompt with a model of a config, all engines in this process"


def add_arguments(p) -> None:
    p.add_argument("config", help="cluster/model config (YAML or JSON)")
    p.add_argument("--model", required=True, help="model name from the config")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the model's chat template")
    p.add_argument("--system", help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=64, help="most new tokens (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, help="seed of this request's sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument("--placement", help="placement file from `paraflex plan` (default: plan now)")
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:1 ...")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def run(args) -> int:
    from paraflex.engine.kernels import omp_policy

    omp_policy.apply_here()  # before torch loads: the engines' OpenMP threads wait as `paraflex serve`'s do
    from paraflex.config.schema import load_config
    from paraflex.engine.core.sampling_params import SamplingParams
    from paraflex.placement import Placement
    from paraflex.planner.validate import require_valid_layout
    from paraflex.serving.in_process import LLMCluster

    config = load_config(args.config)
    config.model(args.model)  # unknown model -> UserError naming the choices
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=list(args.stop), ignore_eos=args.ignore_eos,
    ).validate()
    placement = Placement.load_for(args.placement, config) if args.placement else None
    if placement is not None:
        require_valid_layout(placement, config, source=args.placement, required=[args.model])

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"paraflex generate: {line}", file=sys.stderr, flush=True)

    cluster = LLMCluster(config, placement, device=args.device, dtype=args.dtype, progress=progress,
                         models=[args.model])
    tok = cluster.tokenizer(args.model)
    text = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        text = tok.apply_chat_template(messages + [{"role": "user", "content": text}])
    stages = cluster.placement.models[args.model].stages
    progress(f"{args.model}: {len(stages)} stage(s) {stages}; generating up to {params.max_tokens} tokens")
    printer = _StreamPrinter(tok)
    cluster.submit(args.model, tok.encode(text), params, sink=printer)
    cluster.run_until_idle()
    printer.flush()
    progress(f"finish_reason={printer.reason} tokens={len(printer.ids)}")
    if printer.error:
        print(f"paraflex generate: error: {printer.error}", file=sys.stderr)
        return 1
    return 0


class _StreamPrinter:
    """Prints text as tokens arrive (decoding the whole sequence so multi-byte chars stay whole)."""

    def __init__(self, tok) -> None:
        self.tok, self.ids, self.printed = tok, [], ""
        self.reason = self.error = None

    def on_output(self, rid, token_ids, finish_reason, error, **extra) -> None:
        self.ids += token_ids
        text = self.tok.decode(self.ids)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(self.printed):])
            sys.stdout.flush()
            self.printed = text
        if finish_reason is not None:
            self.reason, self.error = finish_reason, error

    def flush(self) -> None:
        text = self.tok.decode(self.ids)
        sys.stdout.write(text[len(self.printed):] + "\n")
        sys.stdout.flush()
