"""Dense projections of a stage (y = x @ W^T), stored in the layout that multiplies fastest on
the stage's device.

Place in the data flow: `DecoderLayer` and `Stage` wrap every projection weight (Q|K|V, O,
gate|up, down, LM head) in a `Linear` at load time and call it on the packed tokens of a batch.

Layouts (`LAYOUTS`), in order of preference; where a weight has more than one, the fastest on
this machine is measured once per shape and cached (engine/worker/model/layout_chooser.py: by
default only where the panels are not a candidate; `PARAFLEX_LINEAR_CHOOSER=1` / `0` forces it):
* "panels": CPU, float32, the compiled kernel loads (csrc/linear_f32.c, through
  engine/kernels/native_build.py): the weight is packed once into column panels of 16
  ([N/16][K][16]) and multiplied by the kernel (6 x 16 register tiles, 8 x 32 on AVX-512, x
  broadcast from memory, the kernels' thread pool). SmolLM2's projections on the 2-core AVX2
  VM, one thread, all 30 layers with cold caches: 1.3x oneDNN's packed kernel at 1 row
  (memory-bound: 19 vs 15 GB/s of weights) and 1.25x at 32 rows; level to 1.2x at 512-4096
  rows. A tied embedding reads its rows from the packed head (`rows`), so the table is held
  once. `PARAFLEX_NATIVE_LINEAR=0` turns it off.
* "onednn": CPU, float32, or bfloat16 where the CPU has native bf16 (avx512_bf16 / AMX):
  oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the packing PyTorch's
  own CPU compiler uses for frozen linears), multiplied with `_linear_pointwise` (on AMX CPUs
  the bf16 kernel runs on the tile units): float32 1.4-2.2x the MKL `torch.mm` of the same
  weights at 4-32 rows on the AVX2 VM. Opaque tensors: a tied embedding table stays beside
  such a head.
* "mm": everywhere: the weight transposed to [in, out] and multiplied with `torch.mm` (on CUDA
  this is the same cuBLAS call as `F.linear`).
"""

from __future__ import annotations

import ctypes

import torch

from paraflex.engine.kernels.native_build import THREAD_POOL, NativeLibrary, native_bf16
from paraflex.engine.worker.model import layout_chooser
from paraflex.engine.worker.model.layout_choice import Verdict

PACK_ROWS_HINT = 32  # oneDNN picks its blocking for this many rows; measured best from 4 to 256
PANEL = 16  # columns per panel of the compiled kernel's layout
LAYOUTS = ("panels", "onednn", "mm")


def _declare(lib: ctypes.CDLL) -> None:
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.pf_pack_weight.argtypes = [ptr, i64, i64, ptr]
    lib.pf_pack_weight.restype = None
    lib.pf_linear.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i32]
    lib.pf_linear.restype = None


LIBRARY = NativeLibrary("linear_f32.c", "PARAFLEX_NATIVE_LINEAR", "compiled CPU projections", _declare,
                        extra_flags=("-ffp-contract=fast",), depends=(THREAD_POOL,))


def native_available(device: torch.device, dtype: torch.dtype) -> bool:
    return LIBRARY.serves(device, dtype)


def onednn_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and (dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16())))


def candidate_layouts(device: torch.device, dtype: torch.dtype) -> list[str]:
    """The layouts that can hold a weight of `dtype` on `device`, in order of preference."""
    return ([name for name, usable in (("panels", native_available(device, dtype)),
                                       ("onednn", onednn_packing_available(device, dtype))) if usable] + ["mm"])


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, prefill: bool = True,
                 layout: str | None = None) -> None:
        """weight [out, in] (checkpoint layout), bias [out] or None. `prefill`: whether prefill-sized
        batches reach this projection (not the LM head), for the chooser; `layout`: one of
        `LAYOUTS` to take (default: the candidates' first, or the chooser's verdict)."""
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.panels = self.packed = self.weight_t = None
        self.verdict: Verdict | None = None  # the chooser's, where it chose
        if layout is None:
            layouts = candidate_layouts(weight.device, weight.dtype)
            layout = layouts[0]
            if len(layouts) > 1 and layout_chooser.enabled(layouts):
                self.verdict = layout_chooser.CHOOSER.choose(
                    layouts, lambda name, w: Linear(w, layout=name), weight, prefill, LIBRARY.path)
                layout = self.verdict.layout
        self.layout = layout
        if layout == "panels":
            self.panels = self._pack_panels(weight.contiguous())
            if bias is not None:  # padded to whole panels, as the kernel reads it
                self.bias = torch.zeros(self.panels.shape[0] * PANEL, dtype=bias.dtype)
                self.bias[: self.out_features] = bias
        elif layout == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)
        elif layout == "mm":
            self.weight_t = weight.t().contiguous()
        else:
            raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")

    def _pack_panels(self, weight: torch.Tensor) -> torch.Tensor:
        n, k = weight.shape
        panels = torch.empty(-(-n // PANEL), k, PANEL, dtype=weight.dtype)
        LIBRARY.lib.pf_pack_weight(weight.data_ptr(), n, k, panels.data_ptr())
        return panels

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            x = x.contiguous()
            out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
            LIBRARY.lib.pf_linear(x.data_ptr(), x.shape[0], self.in_features, self.panels.data_ptr(),
                                  None if self.bias is None else self.bias.data_ptr(), self.out_features,
                                  out.data_ptr(), torch.get_num_threads())
            return out
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    @property
    def holds_rows(self) -> bool:
        """Whether `rows` can read rows of the weight (all layouts but oneDNN's opaque one)."""
        return self.packed is None

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight [out, in] (a tied embedding lookup from the LM head)."""
        if self.panels is not None:
            return self.panels[ids // PANEL, :, ids % PANEL]
        return self.weight_t.t()[ids]

    @property
    def nbytes(self) -> int:
        w = next(t for t in (self.panels, self.packed, self.weight_t) if t is not None)
        b = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return w.numel() * w.element_size() + b
