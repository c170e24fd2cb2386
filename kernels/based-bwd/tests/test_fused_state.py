"""based-bwd's fused path with a state and packed sequences: the portable Triton kernels (`dispatch`'s
portable_state_forward and portable_state_backward) from an initial state, with the final state, over equal-length
batches and ragged packs (an empty sequence included), against independent float64 computations (the quadratic
form, the step-by-step recurrence, and float64 autograd of both); the registered ops (opcheck); and on CUDA the
public function at the issue's sizes (16 packed sequences summing to 65536) against the fp32 reference.

Under TRITON_INTERPRET=1 the kernels run on tiny CPU tensors: fp32 inputs take IEEE fp32 matmuls, so they check
the kernels' algebra to fp32 accuracy."""

import random

import pytest
import torch

from testkit import INTERPRETED, needs_cuda, needs_triton, rel_err, submodule
from test_based_state import grads64, lengths_to_cu, make, prefix_state, recurrence, state_float64

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXACT_TOL = 1e-5  # fp32 inputs: IEEE fp32 matmuls in the interpreter
BF16_TOL = 2e-2  # bf16 operands and chunk states against float64
H, V = 1, 8
RAGGED = [65, 0, 1, 63, 130]  # past a chunk, an empty sequence, a single step, under a chunk, three chunks


def fused_loss_grads(dispatch, q, k, v, state, cu, weights, scale, configs=(None, None)):
    """(o, S, z) of the fused forward, and the fused backward's (dq, dk, dv, dS0, dz0) of sum(w * (o, S, z)),
    its initial state zero where state is None; configs: the forward's and the backward's launch plans (None:
    the defaults)."""
    if state is None:
        N = q.shape[0] if cu is None else cu.numel() - 1
        P = 1 + q.shape[-1] + q.shape[-1] ** 2
        state = (torch.zeros(N, q.shape[2], P, v.shape[-1], device=q.device),
                 torch.zeros(N, q.shape[2], P, device=q.device))
    o, (S, z) = dispatch.portable_state_forward(q, k, v, scale, state, cu, config=configs[0])
    w_o, w_S, w_z = weights
    *grads, d_initial = dispatch.portable_state_backward(q, k, v, w_o.to(q.dtype), (w_S, w_z), scale, state, cu,
                                                         configs[1])
    return (o, S, z), (*grads, *d_initial)


def float64_grads(q, k, v, state, cu, weights, scale):
    """float64 autograd of `state_float64` (the quadratic form and the final state) for the same loss."""

    def fn(q, k, v, S0, z0):
        return state_float64(q, k, v, (S0, z0), cu, scale)

    return grads64(fn, (q, k, v, *state), weights)


def weights_for(v, state, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(x.shape, generator=gen).to(x.device) for x in (v, *state))


def check_against_float64(dispatch, q, k, v, state, cu, scale, tol, configs=(None, None)):
    cpu = [x.cpu() for x in (q, k, v)]
    cu_cpu = None if cu is None else cu.cpu()
    zero = state is None
    if zero:
        N = q.shape[0] if cu is None else cu.numel() - 1
        P = 1 + q.shape[-1] + q.shape[-1] ** 2
        state_cpu = (torch.zeros(N, q.shape[2], P, v.shape[-1]), torch.zeros(N, q.shape[2], P))
    else:
        state_cpu = tuple(x.cpu() for x in state)
    weights = weights_for(cpu[2], state_cpu)
    (o, S, z), grads = fused_loss_grads(dispatch, q, k, v, state, cu, tuple(w.to(q.device) for w in weights), scale,
                                        configs)
    o_want, S_want, z_want = state_float64(*cpu, state_cpu, cu_cpu, scale)
    assert o.dtype == q.dtype and o.shape == v.shape
    assert S.dtype == z.dtype == torch.float32 and S.shape == state_cpu[0].shape and z.shape == state_cpu[1].shape
    assert rel_err(o.cpu(), o_want) < tol, "o"
    assert rel_err(S.cpu(), S_want) < tol and rel_err(z.cpu(), z_want) < tol, "final state"
    want = float64_grads(*cpu, state_cpu, cu_cpu, weights, scale)
    for name, g, ref in zip(["dq", "dk", "dv", "dS0", "dz0"], grads, want):
        assert g.dtype == (q.dtype if name in ("dq", "dk", "dv") else torch.float32), name
        assert rel_err(g.cpu(), ref) < tol, name


@pytest.mark.skipif(not INTERPRETED, reason="IEEE fp32 matmuls check the kernels' algebra in the interpreter")
@pytest.mark.parametrize("K", [8, 16])
@pytest.mark.parametrize("T", [1, 63, 65, 130])
def test_fused_state_matches_float64(dispatch, K, T):
    """An equal-length batch of two from a realistic initial state: o, the final state and every gradient
    (the loss weighs o and the final state)."""
    q, k, v = make(2, T, H, K, V)
    check_against_float64(dispatch, q, k, v, prefix_state(2, H, K, V), None, 0.3, EXACT_TOL)


@pytest.mark.skipif(not INTERPRETED, reason="IEEE fp32 matmuls check the kernels' algebra in the interpreter")
@pytest.mark.parametrize("K", [8, 16])
def test_fused_packed_state_matches_float64(dispatch, K):
    """Ragged packed sequences (one empty), each from its own initial state."""
    cu = lengths_to_cu(RAGGED)
    q, k, v = make(1, sum(RAGGED), H, K, V)
    check_against_float64(dispatch, q, k, v, prefix_state(len(RAGGED), H, K, V), cu, K**-0.5, EXACT_TOL)


@pytest.mark.skipif(not INTERPRETED, reason="IEEE fp32 matmuls check the kernels' algebra in the interpreter")
def test_fused_packed_without_initial_state(dispatch):
    """Packed sequences from a zero state given explicitly, and from none: the same o and final state (no
    initial state: no gradient of it), and the loss on o alone (no final state): the same dq, dk, dv as with one
    whose gradient is zero."""
    cu = lengths_to_cu([3, 70, 0]).long()
    q, k, v = make(1, 73, 2, 8, V)
    check_against_float64(dispatch, q, k, v, None, cu, 0.35, EXACT_TOL)
    o, (S, z) = dispatch.portable_state_forward(q, k, v, 0.35, None, cu)
    o_only, none = dispatch.portable_state_forward(q, k, v, 0.35, None, cu, output_final_state=False)
    assert none is None and torch.equal(o, o_only)
    zero = (torch.zeros_like(S), torch.zeros_like(z))
    o_zero, (S_zero, z_zero) = dispatch.portable_state_forward(q, k, v, 0.35, zero, cu)
    assert torch.equal(o, o_zero) and torch.equal(S, S_zero) and torch.equal(z, z_zero)
    do = torch.randn(v.shape, generator=torch.Generator().manual_seed(2))
    *got, d_initial = dispatch.portable_state_backward(q, k, v, do, None, 0.35, None, cu)
    *want, _ = dispatch.portable_state_backward(q, k, v, do, zero, 0.35, zero, cu)
    assert d_initial is None
    for g, ref in zip(got, want):
        assert torch.equal(g, ref)


@pytest.mark.skipif(not INTERPRETED, reason="IEEE fp32 matmuls check the kernels' algebra in the interpreter")
def test_fused_state_final_equals_recurrence(dispatch):
    """The final state of the fused forward is the float64 recurrence's, step by step over the feature map."""
    q, k, v = make(2, 100, H, 8, V)
    state = prefix_state(2, H, 8, V)
    o, (S, z) = dispatch.portable_state_forward(q, k, v, 8**-0.5, state)
    o_rec, (S_rec, z_rec) = recurrence(q, k, v, state=state)
    assert rel_err(o, o_rec) < EXACT_TOL and rel_err(S, S_rec) < EXACT_TOL and rel_err(z, z_rec) < EXACT_TOL


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_packed_state_16bit(dispatch, dtype):
    """16-bit inputs (fp16 through the bf16 kernels): outputs in the inputs' dtype, the state in fp32."""
    lengths = [100, 0, 29]
    cu = lengths_to_cu(lengths).to(TRITON_DEVICE)
    q, k, v = make(1, sum(lengths), 2, 16, 16, dtype, TRITON_DEVICE)
    state = prefix_state(len(lengths), 2, 16, 16, device=TRITON_DEVICE)
    check_against_float64(dispatch, q, k, v, state, cu, 0.25, BF16_TOL)


@pytest.mark.kernels_ci
def test_state_ops_opcheck(based):
    """The registered stateful ops (their CPU kernels are the reference) pass torch.library.opcheck: schema,
    fake impls, autograd registration."""
    cu = lengths_to_cu([5, 0, 11])
    q, k, v = (x.requires_grad_(True) for x in make(1, 16, 2, 4, 3))
    S0, z0 = (x.requires_grad_(True) for x in prefix_state(3, 2, 4, 3))
    for args in [(q, k, v, S0, z0, cu, 0.5, True), (q, k, v, None, None, None, 0.5, True),
                 (q, k, v, S0, z0, cu, 0.5, False)]:
        torch.library.opcheck(based.op.based_state_forward_op, args)
    plain = [x.detach() for x in (q, k, v, S0, z0)]
    do, dS, dz = (torch.randn(x.shape) for x in (v, S0, z0))
    empty = torch.empty(0)
    for args in [(*plain[:3], do, dS, dz, *plain[3:], cu, 0.5), (*plain[:3], do, empty, empty, None, None, None, 0.5)]:
        torch.library.opcheck(based.op.based_state_backward_op, args)


@needs_triton
def test_state_entry_points_return_no_aliases(dispatch):
    """The CUDA entry points of the stateful ops return distinct tensors where a state is absent (a custom op's
    returns may not alias each other): a packed call without an initial or a final state."""
    cu = lengths_to_cu([5, 70])
    q, k, v = make(1, 75, 1, 8, 8, device=TRITON_DEVICE)
    o, S, z = dispatch.based_state_forward_cuda(q, k, v, None, None, cu.to(q.device), 0.5, False)
    assert S.numel() == z.numel() == 0 and S is not z
    empty = [q.new_empty(0, dtype=torch.float32) for _ in range(2)]
    *_, dS0, dz0 = dispatch.based_state_backward_cuda(q, k, v, torch.ones_like(v), *empty, None, None,
                                                      cu.to(q.device), 0.5)
    assert dS0.numel() == dz0.numel() == 0 and dS0 is not dz0


# ---- on CUDA: the public function takes the fused path; the issue's sizes


def issue_lengths(seed: int, total: int = 65536, n: int = 16) -> list[int]:
    """n random lengths >= 1 summing to total."""
    cuts = sorted(random.Random(seed).sample(range(1, total), n - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


@needs_cuda
def test_based_attention_state_takes_the_fused_path(based, dispatch):
    """bf16 CUDA calls with a state or packed sequences are the fused kernels', bit for bit, forward and
    backward (through autograd), and train in fp32 state gradients."""
    lengths = [300, 1, 0, 211]
    cu = lengths_to_cu(lengths).cuda()
    q, k, v = (x.requires_grad_(True) for x in make(1, sum(lengths), 2, 16, 64, torch.bfloat16, "cuda"))
    S0, z0 = (x.requires_grad_(True) for x in prefix_state(len(lengths), 2, 16, 64, device="cuda"))
    o, (S, z) = based.based_attention(q, k, v, initial_state=(S0, z0), output_final_state=True, cu_seqlens=cu)
    with torch.no_grad():
        o_f, (S_f, z_f) = dispatch.portable_state_forward(q, k, v, 0.25, (S0, z0), cu)
    assert torch.equal(o, o_f) and torch.equal(S, S_f) and torch.equal(z, z_f)
    w = weights_for(v, (S0, z0))
    got = torch.autograd.grad((o * w[0]).sum() + (S * w[1]).sum() + (z * w[2]).sum(), (q, k, v, S0, z0))
    *want, d_initial = dispatch.portable_state_backward(q.detach(), k.detach(), v.detach(), w[0].to(torch.bfloat16),
                                                        (w[1], w[2]), 0.25, (S0.detach(), z0.detach()), cu)
    for g, ref in zip(got, (*want, *d_initial)):
        assert torch.equal(g, ref)


@needs_cuda
@pytest.mark.parametrize("Vc", [64, 128])
def test_fused_packed_state_at_issue_sizes_on_cuda(based, Vc):
    """16 random lengths summing to 65536, (H, K, V) = (16, 16, V), bf16, from an initial state: o, the final
    state and every gradient of the public function against the fp32 reference (torch autograd through it,
    one sequence at a time)."""
    reference = submodule(based, "reference")
    lengths = issue_lengths(Vc)
    cu = lengths_to_cu(lengths).cuda()
    q, k, v = make(1, sum(lengths), 16, 16, Vc, torch.bfloat16, "cuda")
    state = prefix_state(len(lengths), 16, 16, Vc, T=4, device="cuda")
    w = weights_for(v, state)
    ins = [x.clone().requires_grad_(True) for x in (q, k, v, *state)]
    o, (S, z) = based.based_attention(*ins[:3], initial_state=tuple(ins[3:]), output_final_state=True, cu_seqlens=cu)
    got = torch.autograd.grad((o.float() * w[0]).sum() + (S * w[1]).sum() + (z * w[2]).sum(), ins)
    # the fp32 reference one sequence at a time (a padded batch of all 16 outgrows the GPU's memory)
    want, o_r, S_r, z_r = [[] for _ in range(5)], [], [], []
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        refs = [x[:, a:b].float().clone().requires_grad_(True) for x in (q, k, v)]
        refs += [x[n : n + 1].clone().requires_grad_(True) for x in state]
        o_n, (S_n, z_n) = reference.based_forward_reference(*refs[:3], 0.25, initial_state=tuple(refs[3:]),
                                                            output_final_state=True)
        loss = (o_n * w[0][:, a:b]).sum() + (S_n * w[1][n : n + 1]).sum() + (z_n * w[2][n : n + 1]).sum()
        for part, g in zip(want, torch.autograd.grad(loss, refs)):
            part.append(g)
        for part, x in zip((o_r, S_r, z_r), (o_n, S_n, z_n)):
            part.append(x.detach())
    assert rel_err(o, torch.cat(o_r, 1)) < 1e-2
    assert rel_err(S, torch.cat(S_r)) < 1e-2 and rel_err(z, torch.cat(z_r)) < 1e-2  # bf16 feature products
    for name, g, ref in zip(["dq", "dk", "dv", "dS0", "dz0"], got, want):
        assert rel_err(g, torch.cat(ref, 1 if name in ("dq", "dk", "dv") else 0)) < BF16_TOL, name
