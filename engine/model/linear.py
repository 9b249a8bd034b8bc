"""Dense projections of a stage (y = x @ W^T), stored in the layout that multiplies fastest on
the stage's device.

Place in the data flow: `DecoderLayer` and `Stage` wrap every projection weight (Q|K|V, O,
gate|up, down, LM head) in a `Linear` at load time and call it on the packed tokens of a batch.

Layouts:
* CPU, float32, oneDNN present: the weight is reordered ONCE into oneDNN's blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`, the packing PyTorch's own CPU compiler uses for
  frozen linears) and multiplied with `_linear_pointwise`. For SmolLM2's shapes on a 2-core
  AVX2 machine, with cold caches as in a real step, that is 1.4-2.2x the MKL `torch.mm` of the
  same weights at 4-32 rows, and 2.5x on the 49,152-wide LM head at 32 rows (MKL's small-M
  kernel does not split N well), equal at 256+ rows.
* Everywhere else: the weight transposed to [in, out] and multiplied with `torch.mm` (on
  CUDA this is the same cuBLAS call as `F.linear`).
Packed weights are opaque oneDNN tensors: only `Linear` reads them. A tied embedding table
therefore stays beside a packed LM head (see `Stage`).
"""

from __future__ import annotations

import torch

PACK_ROWS_HINT = 32  # oneDNN picks its blocking for this many rows; measured best from 4 to 256


def onednn_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """weight [out, in] (checkpoint layout), bias [out] or None."""
        self.bias = bias
        self.packed = None
        self.weight_t = None
        if onednn_packing_available(weight.device, weight.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)
        else:
            self.weight_t = weight.t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    @property
    def nbytes(self) -> int:
        w = self.packed if self.packed is not None else self.weight_t
        b = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return w.numel() * w.element_size() + b
