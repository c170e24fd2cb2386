"""fla's Comba ops on this package: `chunk_comba` and `fused_recurrent_comba` with flash-linear-attention 0.6.0's
signatures, defaults and return conventions, and `use_in_fla()`, which makes fla's `Comba` layers (and so a whole
`CombaForCausalLM`, training and `generate()`) call them:

    with comba.fla.use_in_fla():          # or comba.fla.use_in_fla() alone: for the rest of the process
        loss = model(input_ids, labels=labels).loss

fla's semantics, mapped onto `comba_attention` / `comba_decode`: the state is read before the step's decay
(read_order="fla"), `use_qk_l2norm_in_kernel` L2-normalises q, k and p, v, g and beta carry HV value heads (a
multiple of q's H), the state is (N, HV, K, V) float32, `scale` defaults to K ** -0.5, `p` defaults to k, `beta` to
ones, and o comes back in q's dtype, with the final state or None. Inputs fla accepts and `comba_attention` does
not are converted: g and initial_state to float32 (autograd carries the cast). fla itself is imported only by
`use_in_fla`.
"""

import importlib

import torch

from .op import comba_attention, comba_decode
from .recurrent import DECODE_MAX_TOKENS


def _fla_inputs(q, k, p, g, beta, initial_state):
    if beta is not None and beta.dim() == 4:
        raise ValueError("beta must be (B, T, HV): a beta per value channel (B, T, HV, V) is not supported")
    p = k if p is None else p
    beta = torch.ones_like(g, dtype=q.dtype) if beta is None else beta
    g = g.float() if isinstance(g, torch.Tensor) else g
    if isinstance(initial_state, torch.Tensor):
        initial_state = initial_state.float()
    return p, g, beta, initial_state


def chunk_comba(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor = None,
    scale: float = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
):
    """fla 0.6.0's `chunk_comba`: (o (B, T, HV, V) in q's dtype, final state (N, HV, K, V) float32 or None),
    differentiable in every tensor. `cu_seqlens_cpu`, fla's host copy of the offsets, is accepted and not needed."""
    p, g, beta, initial_state = _fla_inputs(q, k, p, g, beta, initial_state)
    out = comba_attention(q, k, v, p, beta, g, scale, initial_state=initial_state,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                          use_qk_l2norm=use_qk_l2norm_in_kernel, read_order="fla")
    o, final_state = out if output_final_state else (out, None)
    return o.to(q.dtype), final_state


def fused_recurrent_comba(
    q: torch.Tensor,
    k: torch.Tensor,
    p: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor = None,
    scale: float = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
):
    """fla 0.6.0's `fused_recurrent_comba` (note its argument order: p before v): (o (B, T, HV, V) in q's dtype,
    final state (N, HV, K, V) float32 or None, a new tensor; initial_state is only read). Up to DECODE_MAX_TOKENS
    packed tokens run `comba_decode` (on CUDA without autograd, as in fla's `generate()`, the fused decode kernel),
    longer inputs `comba_attention` (the same function)."""
    p, g, beta, initial_state = _fla_inputs(q, k, p, g, beta, initial_state)
    if q.shape[1] <= DECODE_MAX_TOKENS:
        o, final_state = comba_decode(q, k, v, p, beta, g, initial_state, scale, cu_seqlens=cu_seqlens,
                                      use_qk_l2norm=use_qk_l2norm_in_kernel, read_order="fla")
    else:
        o, final_state = comba_attention(q, k, v, p, beta, g, scale, initial_state=initial_state,
                                         output_final_state=True, cu_seqlens=cu_seqlens,
                                         use_qk_l2norm=use_qk_l2norm_in_kernel, read_order="fla")
    return o.to(q.dtype), (final_state if output_final_state else None)


class use_in_fla:
    """Make fla's Comba layers (`fla.layers.comba`, the layer of `CombaForCausalLM`) call this module's `chunk_comba`
    and `fused_recurrent_comba`. Called alone the swap lasts for the process (`.restore()` undoes it); as a context
    manager it lasts for the `with` block."""

    def __init__(self):
        # The top-level fla package, not this module (an `import fla...` statement reads as one of this package).
        layer = importlib.import_module("fla.layers.comba")
        self._layer = layer
        self._saved = (layer.chunk_comba, layer.fused_recurrent_comba)
        layer.chunk_comba, layer.fused_recurrent_comba = chunk_comba, fused_recurrent_comba

    def restore(self) -> None:
        """Give fla's layers back fla's own ops."""
        self._layer.chunk_comba, self._layer.fused_recurrent_comba = self._saved

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
