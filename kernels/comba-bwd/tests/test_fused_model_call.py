"""The fused path of a model's call: a carried state in and out and grouped value heads through the Triton kernels
(`dispatch.comba_state_forward_cuda` / `comba_state_backward_cuda`, on CPU tensors under the interpreter), and the
registered model ops (`comba_state_forward_op` / `comba_state_backward_op`): outputs, final states and the gradients
of every input and of the initial state against the independent float64 token recurrence (`recurrence64`). On CUDA,
`comba_attention` at fla's layer shapes against the eager reference."""

import pytest
import torch

from testkit import HAS_CUDA, needs_cuda, needs_triton, rel_err, submodule
from test_model_interface import model_inputs, recurrence64

NAMES = ("dq", "dk", "dv", "dp", "dbeta", "dg", "d_initial_state")
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(scope="module")
def dispatch(comba):
    pytest.importorskip("triton")
    return submodule(comba, "dispatch")


def kernel_inputs(B, T, H, HV, K, V, seed, with_state=True, device=TRITON_DEVICE):
    """bf16 q, k, v, p, beta, fp32 g and state (`model_inputs`), a gradient of o and of the final state, on `device`;
    the state scaled to the size a few hundred steps of unit keys leave."""
    x, state = model_inputs(B, T, H, HV, K, V, seed=seed)
    x = [t.to(device=device, dtype=torch.bfloat16) if i < 5 else t.to(device) for i, t in enumerate(x)]
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(B, T, HV, V, generator=gen).to(device=device, dtype=torch.bfloat16)
    d_final = torch.randn(B, HV, K, V, generator=gen).to(device)
    return x, (0.3 * state).to(device) if with_state else None, do, d_final


def float64_model_grads(x, state, do, d_final, scale):
    """The gradients of <o, do> + <final state, d_final> with respect to q, k, v, p, beta, g and the initial state, by
    float64 autograd through `recurrence64` (the initial state's gradient None without a state)."""
    leaves = [t.detach().double().cpu().requires_grad_() for t in x]
    s64 = None if state is None else state.detach().double().cpu().requires_grad_()
    o, final = recurrence64(*leaves, scale, s64)
    wrt = leaves if s64 is None else [*leaves, s64]
    grads = torch.autograd.grad((o * do.double().cpu()).sum() + (final * d_final.double().cpu()).sum(), wrt)
    return (*grads, None) if s64 is None else grads


SHAPES = [  # B, T, H, HV, K, V: T = 1, 63, 65, 130 with HV = 2H; B = 2 cut in two pieces; K = 128 cuts V in two;
    # V = 256 and 512: more V blocks in the scans (4 and 8 at K = 128) and in the output (2 and 4)
    (2, 1, 1, 2, 64, 64),
    (2, 63, 1, 2, 64, 64),
    (1, 65, 2, 4, 64, 128),
    (2, 130, 1, 2, 64, 64),
    (1, 64, 1, 2, 128, 128),
    (1, 70, 1, 2, 64, 256),
    (1, 66, 1, 1, 128, 512),
]


@needs_triton
@pytest.mark.kernels_ci
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_state_and_grouped_heads_match_float64(dispatch, shape):
    """The forward (o, final state) and the backward (all six gradients and the initial state's) of the Triton
    kernels from a carried state with value heads grouped two to a key head."""
    x, state, do, d_final = kernel_inputs(*shape, seed=shape[1])
    scale = 0.9 * shape[4] ** -0.5
    o, final = dispatch.comba_state_forward_cuda(*x, state, scale, True)
    o64, final64 = recurrence64(*(t.cpu() for t in x), scale, state.cpu())
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32 and final.shape == state.shape
    assert rel_err(o, o64) < 1e-2 and rel_err(final, final64) < 1e-2
    grads = dispatch.comba_state_backward_cuda(*x, state, do, d_final, scale)
    assert [gr.shape for gr in grads] == [t.shape for t in (*x, state)]
    assert [gr.dtype for gr in grads] == [torch.bfloat16] * 5 + [torch.float32] * 2
    errs = {n: rel_err(a, b) for n, a, b in zip(NAMES, grads, float64_model_grads(x, state, do, d_final, scale))}
    assert all(e < 1e-2 for e in errs.values()), errs


@needs_triton
@pytest.mark.kernels_ci
def test_fused_grouped_heads_without_state_match_float64(dispatch):
    """Grouped value heads from a zero state, no final state asked: an empty state out and in the gradients; the
    backward with no final state's gradient is the gradient of <o, do> alone."""
    x, _, do, d_final = kernel_inputs(1, 70, 1, 3, 64, 64, seed=5, with_state=False)
    o, final = dispatch.comba_state_forward_cuda(*x, None, 0.125, False)
    assert final.numel() == 0
    assert rel_err(o, recurrence64(*(t.cpu() for t in x), 0.125)[0]) < 1e-2
    grads = dispatch.comba_state_backward_cuda(*x, None, do, None, 0.125)
    assert grads[6].numel() == 0
    ref = float64_model_grads(x, None, do, torch.zeros_like(d_final), 0.125)
    errs = {n: rel_err(a, b) for n, a, b in zip(NAMES[:6], grads, ref)}
    assert all(e < 1e-2 for e in errs.values()), errs


@needs_triton
@pytest.mark.kernels_ci
def test_fused_state_call_without_state_equals_the_plain_call(dispatch):
    """The model's plan with no state and equal heads runs the plain call's kernels: the same o and gradients."""
    x, _, do, _ = kernel_inputs(1, 65, 2, 2, 64, 64, seed=6, with_state=False)
    o, _ = dispatch.comba_state_forward_cuda(*x, None, 0.125, False)
    assert torch.equal(o, dispatch.comba_forward_cuda(*x, 0.125))
    grads = dispatch.comba_state_backward_cuda(*x, None, do, None, 0.125)
    assert all(torch.equal(a, b) for a, b in zip(grads, dispatch.comba_backward_cuda(*x, do, 0.125)))


@pytest.mark.kernels_ci
@pytest.mark.parametrize("with_state,final", [(True, True), (False, True), (True, False)])
def test_model_op_opcheck(comba, with_state, final):
    x, state, do, d_final = kernel_inputs(1, 70, 1, 2, 16, 8, seed=7, with_state=with_state, device="cpu")
    torch.library.opcheck(comba.op.comba_state_forward_op, (*x, state, 0.25, final))
    torch.library.opcheck(comba.op.comba_state_backward_op, (*x, state, do, d_final if final else None, 0.25))


@pytest.mark.kernels_ci
def test_model_op_trains_the_state_and_grouped_heads(comba):
    """Autograd through the registered model op (its CPU kernels): every input's gradient and the initial state's,
    through o and the final state, against float64."""
    x, state, do, d_final = kernel_inputs(2, 70, 1, 2, 16, 8, seed=8, device="cpu")
    x = [t.float() for t in x]
    leaves = [t.clone().requires_grad_() for t in (*x, state)]
    o, final = comba.op.comba_state_forward_op(*leaves[:6], leaves[6], 0.25, True)
    got = torch.autograd.grad((o * do.float()).sum() + (final * d_final).sum(), leaves)
    errs = {n: rel_err(a, b) for n, a, b in zip(NAMES, got, float64_model_grads(x, state, do, d_final, 0.25))}
    assert all(e < 1e-4 for e in errs.values()), errs


# ---------------------------------------------------------------- comba_attention on CUDA


def reference_step(comba, x, state, do, d_final, **kwargs):
    """o, final state and the gradients of the eager reference (fp32, autograd) of the same call."""
    leaves = [t.detach().clone().requires_grad_() for t in (*x, state)]
    o, final = comba.reference.comba_forward_reference(*leaves[:6], initial_state=leaves[6], output_final_state=True,
                                                       **kwargs)
    grads = torch.autograd.grad((o.float() * do.float()).sum() + (final * d_final).sum(), leaves)
    return o, final, grads


@needs_cuda
@pytest.mark.parametrize("shape,l2norm", [((4, 4096, 6, 6, 128, 128), False), ((2, 1000, 4, 8, 128, 64), True),
                                          ((2, 577, 2, 4, 64, 128), False), ((2, 1000, 4, 8, 128, 256), True),
                                          ((1, 777, 2, 2, 64, 512), False), ((1, 600, 2, 4, 128, 512), False)])
def test_cuda_model_call_with_state_matches_the_reference(comba, shape, l2norm):
    """comba_attention on CUDA (the fused kernels) at fla's layer shapes with a state, and grouped heads with the q/k/p
    normalisation, against the eager reference: o, the final state and all seven gradients within 2e-2."""
    x, state, do, d_final = kernel_inputs(*shape, seed=9, device="cuda")
    leaves = [t.detach().clone().requires_grad_() for t in (*x, state)]
    o, final = comba.comba_attention(*leaves[:6], initial_state=leaves[6], output_final_state=True,
                                     use_qk_l2norm=l2norm)
    got = torch.autograd.grad((o.float() * do.float()).sum() + (final * d_final).sum(), leaves)
    o_ref, final_ref, ref = reference_step(comba, x, state, do, d_final, use_qk_l2norm=l2norm)
    assert rel_err(o, o_ref) < 2e-2 and rel_err(final, final_ref) < 2e-2
    errs = {n: rel_err(a, b) for n, a, b in zip(NAMES, got, ref)}
    assert all(e < 2e-2 for e in errs.values()), errs
