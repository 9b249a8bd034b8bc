"""paraflex.engine.worker.model: the Llama-family decoder in plain PyTorch, cut into pipeline stages.

A `Stage` is what one engine runs for one model: [embeddings if first] + blocks [a, b) +
[final norm and LM head if last]. Weights come from `paraflex.engine.worker.weights`; attention reads
and writes the shared paged KV pool through `paraflex.engine.worker.attention`.
"""

from paraflex.engine.worker.model.stage import Stage

__all__ = ["Stage"]
