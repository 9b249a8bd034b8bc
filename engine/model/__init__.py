"""paraflex.engine.model: the Llama-family decoder in plain PyTorch, cut into pipeline stages.

A `Stage` is what one engine runs for one model: [embeddings if first] + blocks [a, b) +
[final norm and LM head if last]. Weights come from `paraflex.engine.weights`; attention reads
and writes the shared paged KV pool through `paraflex.engine.attention`.
"""

from paraflex.engine.model.stage import Stage

__all__ = ["Stage"]
