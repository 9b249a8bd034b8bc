"""Cost model: predicted time of one stage execution (prefill or decode) on one engine.

Place in the data flow: the planner (stage counts from `model_time`), the simulator (stage
and hop times) and the benchmarks all call `CostModel`; nothing else guesses times.

Per transformer layer, on one GPU of a TP group of degree ``tp`` (weights sharded):

* linear ops (QKV, O, MLP up/gate, down) and elementwise ops (norms, RoPE, activation,
  residual adds), each a roofline ``max(FLOPs / (peak * eff_gemm(n)), bytes / (bw * mem_eff))
  + kernel_overhead``, or the measured Vidur table for this model shape / device / TP when a
  ``profile_dir`` has one (linear interpolation over num_tokens);
* attention: a roofline over attention FLOPs and the bytes of Q/K/V read (prefill, causal,
  flash-style) or the KV cache read (decode: the batch's total context);
* TP > 1: two all-reduces of the layer's activations (after O and after down-projection),
  a ring all-reduce over the device's intra-group link (NVLink).

First stage adds the embedding gather; last stage adds the final norm and the LM head for
one row per sequence. PP hops cost `Interconnect.transfer_time(hidden_bytes(...))` (paraflex/costs/interconnect.py). All times
in seconds. Formulas and calibration: docs/costmodel.md.
"""

from __future__ import annotations

from paraflex.costs.devices import DeviceSpec, get_device
from paraflex.errors import UserError

# Reference workload of `model_time` (see its docstring and docs/costmodel.md).
REF_PREFILL_TOKENS = 512
REF_DECODE_BATCH = 32
REF_DECODE_CONTEXT = 512


class CostModel:
    """Stage-time predictor for one engine: a device type with TP degree ``tp``."""

    def __init__(self, device: str | DeviceSpec, tp: int = 1, profile_dir: str | None = None):
        self.device = device if isinstance(device, DeviceSpec) else get_device(device)
        if not isinstance(tp, int) or tp < 1:
            raise UserError(f"tensor-parallel degree must be a positive integer, got {tp!r}")
        self.tp = tp
        self.profiles = None
        self.overheads = None
        self.engine_loop = None
        if profile_dir is not None:
            from paraflex.costs.profile_tables import ProfileIndex
            from paraflex.costs.serving_terms import engine_loop
            from paraflex.costs.step_overheads import StepOverheads

            self.profiles = ProfileIndex(profile_dir)
            self.overheads = StepOverheads.load(profile_dir) or None
            self.engine_loop = engine_loop(profile_dir)
        self._table_cache: dict = {}
        self._layer_cache: dict = {}  # (kind, arch, tokens[, ...]) -> seconds; simulators repeat

    # ---- primitive rooflines --------------------------------------------------------------
    def _gemm(self, m: float, k: float, n: float, dtype: int) -> float:
        """Time of an (m x k) @ (k x n) matmul on one GPU."""
        d = self.device
        flops = 2.0 * m * k * n
        nbytes = (k * n + m * k + m * n) * dtype
        eff = d.matmul_eff * m / (m + d.matmul_half_tokens)
        return max(flops / (d.peak_flops * eff), nbytes / (d.mem_bandwidth * d.mem_eff)) + d.kernel_overhead

    def _stream(self, nbytes: float) -> float:
        """Time of a memory-bound elementwise kernel moving nbytes."""
        d = self.device
        return nbytes / (d.mem_bandwidth * d.mem_eff) + d.kernel_overhead

    # ---- per-layer pieces -----------------------------------------------------------------
    def linear_op_times(self, arch, num_tokens: float) -> dict[str, float]:
        """Roofline time of each linear/elementwise op of one layer (Vidur op names)."""
        t, n, e, h = self.tp, float(num_tokens), arch.dtype_bytes, arch.hidden_size
        q, kv, f = arch.q_size / t, arch.kv_size / t, arch.intermediate_size / t
        up_width = 2 * f if arch.gated_mlp else f
        act_bytes = n * (up_width + f) * e
        ops = {
            "input_layernorm": self._stream(2 * n * h * e),
            "attn_pre_proj": self._gemm(n, h, q + 2 * kv, e),
            "attn_rope": self._stream(2 * n * (q + kv) * e),
            "attn_post_proj": self._gemm(n, q, h, e),
            "post_attention_layernorm": self._stream(2 * n * h * e),
            "mlp_up_proj": self._gemm(n, h, up_width, e),
            "mlp_act": self._stream(act_bytes),
            "mlp_down_proj": self._gemm(n, f, h, e),
            "add": self._stream(3 * n * h * e),
        }
        if arch.parallel_block:
            del ops["post_attention_layernorm"]
        return ops

    def _table(self, arch):
        if self.profiles is None:
            return None
        key = (arch.num_heads, arch.num_kv_heads, arch.hidden_size, arch.intermediate_size, arch.gated_mlp)
        if key not in self._table_cache:
            self._table_cache[key] = self.profiles.lookup(self.device.name, arch, self.tp)
        return self._table_cache[key]

    def linear_time(self, arch, num_tokens: float) -> float:
        """Linear + elementwise ops of one layer (one residual add counted per sub-block)."""
        table = self._table(arch)
        if table is not None:
            return table.layer_time(num_tokens) + table.op_time("add", num_tokens)
        ops = self.linear_op_times(arch, num_tokens)
        return sum(ops.values()) + ops["add"]

    def attention_prefill_time(self, arch, num_tokens: float, num_seqs: int = 1) -> float:
        """Causal self-attention of num_seqs prompts of num_tokens/num_seqs tokens each."""
        d, t, e = self.device, self.tp, arch.dtype_bytes
        per_seq = num_tokens / num_seqs
        heads = arch.num_heads / t
        flops = 4.0 * num_seqs * per_seq * per_seq / 2 * heads * arch.head_dim  # QK^T and PV, causal
        nbytes = num_tokens * (2 * arch.q_size + 2 * arch.kv_size) / t * e  # Q,K,V in, O out
        eff = d.matmul_eff * per_seq / (per_seq + d.matmul_half_tokens)
        return max(flops / (d.peak_flops * eff), nbytes / (d.mem_bandwidth * d.mem_eff)) + d.kernel_overhead

    def attention_decode_time(self, arch, batch_size: int, total_context: float) -> float:
        """One new token for each of batch_size requests whose contexts sum to total_context.
        Decode attention is a batched GEMV: the roofline of its FLOPs and its KV stream."""
        d, t, e = self.device, self.tp, arch.dtype_bytes
        io_bytes = batch_size * (2 * arch.q_size + 2 * arch.kv_size) / t * e
        flops = 4.0 * total_context * arch.num_heads / t * arch.head_dim
        nbytes = total_context * arch.kv_bytes_per_token_per_layer() / t + io_bytes
        return max(flops / (d.peak_flops * d.matmul_eff), nbytes / (d.mem_bandwidth * d.mem_eff)) + d.kernel_overhead

    def attention_decode_fn(self, arch, batch_size: int, plus: float = 0.0, times: int = 1):
        """`plus + times * attention_decode_time(arch, batch_size, ctx)` as a function of ctx
        alone, the same floats with the terms that do not depend on ctx computed once (the
        simulator's decode step is `rest + layers x attention`, evaluated once per replayed
        step). Where the KV stream outlasts the FLOPs at every context (per token it does by
        far more than rounding can move: every GQA model on a GPU), the FLOP term is not
        evaluated: the roofline's max would return the stream's time anyway."""
        d, t, e = self.device, self.tp, arch.dtype_bytes
        kvpt = arch.kv_bytes_per_token_per_layer()
        io_bytes = batch_size * (2 * arch.q_size + 2 * arch.kv_size) / t * e
        heads, head_dim = arch.num_heads, arch.head_dim
        flop_rate = d.peak_flops * d.matmul_eff
        byte_rate = d.mem_bandwidth * d.mem_eff
        overhead = d.kernel_overhead

        if kvpt * flop_rate > 4.0 * heads * head_dim * byte_rate * (1 + 1e-9):
            def attention(total_context):
                return plus + times * ((total_context * kvpt / t + io_bytes) / byte_rate + overhead)
        else:
            def attention(total_context):
                a = 4.0 * total_context * heads / t * head_dim / flop_rate
                b = (total_context * kvpt / t + io_bytes) / byte_rate
                return plus + times * ((b if b > a else a) + overhead)

        return attention

    def allreduce_time(self, nbytes: float) -> float:
        """Ring all-reduce of nbytes over the TP group (0 when tp == 1)."""
        t = self.tp
        if t == 1:
            return 0.0
        d = self.device
        return 2 * (t - 1) * d.intra_latency + 2 * (t - 1) / t * nbytes / d.intra_bandwidth

    def tp_comm_time(self, arch, num_tokens: float) -> float:
        """The two all-reduces of one layer's hidden activations."""
        return 2 * self.allreduce_time(num_tokens * arch.hidden_size * arch.dtype_bytes)

    def embedding_time(self, arch, num_tokens: float) -> float:
        table = self._table(arch)
        if table is not None:
            return table.op_time("emb", num_tokens)
        return self._stream(2 * num_tokens * arch.hidden_size * arch.dtype_bytes)

    def head_time(self, arch, num_rows: float) -> float:
        """Final norm + LM head (vocab sharded over TP, then gathered) for num_rows tokens."""
        e = arch.dtype_bytes
        norm = self._stream(2 * num_rows * arch.hidden_size * e)
        head = self._gemm(num_rows, arch.hidden_size, arch.vocab_size / self.tp, e)
        gather = self.allreduce_time(num_rows * arch.vocab_size * e / 2)  # all-gather ~ half an all-reduce
        return norm + head + gather

    # ---- stage times ----------------------------------------------------------------------
    def prefill_time(self, arch, num_layers: int, num_tokens: int, first: bool = False,
                     last: bool = False, num_seqs: int = 1) -> float:
        """A prefill of num_tokens prompt tokens (num_seqs prompts) through num_layers layers."""
        _check_counts(num_layers=num_layers, num_tokens=num_tokens, num_seqs=num_seqs)
        key = ("prefill", arch, num_tokens, num_seqs)
        per_layer = self._layer_cache.get(key)
        if per_layer is None:
            per_layer = self._layer_cache[key] = (
                self.linear_time(arch, num_tokens)
                + self.attention_prefill_time(arch, num_tokens, num_seqs)
                + self.tp_comm_time(arch, num_tokens))
        total = num_layers * per_layer
        if first:
            total += self.embedding_time(arch, num_tokens)
        if last:
            total += self.head_time(arch, num_seqs)
        return self._with_residual(total, arch, num_layers, prefill=True, size=num_tokens, num_seqs=num_seqs)

    def decode_time(self, arch, num_layers: int, batch_size: int, total_context: int,
                    first: bool = False, last: bool = False) -> float:
        """One decode step of batch_size requests whose contexts sum to total_context tokens."""
        _check_counts(num_layers=num_layers, batch_size=batch_size)
        if total_context < batch_size:
            raise UserError(f"total_context={total_context} is below batch_size={batch_size}: each request has >= 1 token")
        key = ("decode", arch, batch_size)
        fixed = self._layer_cache.get(key)
        if fixed is None:
            fixed = self._layer_cache[key] = self.linear_time(arch, batch_size) + self.tp_comm_time(arch, batch_size)
        per_layer = fixed + self.attention_decode_time(arch, batch_size, total_context)
        total = num_layers * per_layer
        if first:
            total += self.embedding_time(arch, batch_size)
        if last:
            total += self.head_time(arch, batch_size)
        return self._with_residual(total, arch, num_layers, prefill=False, size=batch_size, context=total_context)

    def _with_residual(self, total: float, arch, num_layers: int, prefill: bool, size: int, num_seqs: int = 1,
                       context: int = 0) -> float:
        """`total` plus the measured per-step residual of a served engine (step_overheads.py)
        and what its engine loop adds per stage step (serving_terms.py, `engine_loop`); a loop
        line fitted from a step log may be negative (the served steps were faster than the
        residual says), but the two never take time off the ops."""
        residual = (self.overheads.stage_residual(arch, num_layers, prefill, size, num_seqs, context)
                    if self.overheads is not None else 0.0)
        if self.engine_loop is not None:  # fitted against the stage time with the residual: may correct it down
            residual = max(0.0, residual + self.engine_loop.stage_step_s(arch, prefill, size))
        return total + residual

    def model_time(self, arch) -> float:
        """Reference time of one whole-model iteration, used to shard models by time.

        The reference workload is the mean of a prefill of REF_PREFILL_TOKENS tokens and a
        decode step of REF_DECODE_BATCH requests with REF_DECODE_CONTEXT tokens of context
        each, over all layers with embedding and head. Stage counts depend only on ratios
        between models, which both halves keep close to the weight-size ratio."""
        prefill = self.prefill_time(arch, arch.num_layers, REF_PREFILL_TOKENS, first=True, last=True)
        decode = self.decode_time(arch, arch.num_layers, REF_DECODE_BATCH,
                                  REF_DECODE_BATCH * REF_DECODE_CONTEXT, first=True, last=True)
        return (prefill + decode) / 2

    def layer_time(self, arch) -> float:
        """Reference time of one layer (same workload as `model_time`, no embedding/head)."""
        prefill = self.prefill_time(arch, 1, REF_PREFILL_TOKENS)
        decode = self.decode_time(arch, 1, REF_DECODE_BATCH, REF_DECODE_BATCH * REF_DECODE_CONTEXT)
        return (prefill + decode) / 2

    @staticmethod
    def hidden_bytes(arch, num_tokens: int) -> int:
        """Bytes sent per pipeline hop: hidden state and residual of num_tokens tokens."""
        return 2 * num_tokens * arch.hidden_size * arch.dtype_bytes


def _check_counts(**counts) -> None:
    for name, value in counts.items():
        if value < 1:
            raise UserError(f"{name} must be >= 1, got {value}")
