"""ldsa through `get_kernel`: the reference against an independent float64 computation, autograd, the
registered ops (opcheck, torch.compile), bad input, the Triton kernels under the interpreter on CPU, the
fused path against float64 on CUDA, and the paper's LDSA block kernelized through the Hub layer."""

import copy
import itertools
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

import testkit
from testkit import HAS_CUDA, INTERPRETED, load, needs_cuda, recorded_launches, rel_err, submodule

WINDOWS = [(0, 0), (14, 0), (7, 7), (3, 11), (0, 5), (31, 31), (64, 0)]
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


@pytest.fixture(scope="module")
def ldsa():
    return load("ldsa")


@pytest.fixture(autouse=True)
def seeded():
    """Every test draws its random inputs from the same seed, whatever ran before it."""
    torch.manual_seed(0)


def ldsa_float64(a_logits, v, left, right):
    """out = einsum over the unfolded window: a different construction from the package's shifted sums."""
    a = torch.softmax(a_logits.double(), dim=2)
    windows = torch.nn.functional.pad(v.double(), (left, right)).unfold(-1, left + right + 1, 1)  # B,H,Dh,T,W
    return torch.einsum("bhkt,bhdtk->bhdt", a, windows)


def make(B, H, Dh, T, left, right, dtype=torch.float32, device="cpu", requires_grad=False):
    a = (2 * torch.randn(B, H, left + right + 1, T, device=device)).to(dtype).requires_grad_(requires_grad)
    v = torch.randn(B, H, Dh, T, device=device).to(dtype).requires_grad_(requires_grad)
    return a, v


def grad_like(v):
    """A random gradient of the output, which has v's shape, dtype and device."""
    return torch.randn(v.shape, device=v.device).to(v.dtype)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("left,right", WINDOWS)
@pytest.mark.parametrize("T", [1, 5, 97])
def test_reference_matches_float64(ldsa, left, right, T):
    a, v = make(2, 3, 8, T, left, right)
    assert rel_err(ldsa.ldsa_forward_reference(a, v, left, right), ldsa_float64(a, v, left, right)) < 1e-6


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("device", DEVICES)
def test_public_op_dtypes(ldsa, dtype, tol, device):
    a, v = make(2, 2, 32, 301, 14, 0, dtype, device)
    out = ldsa.ldsa_local_attention(a, v, 14, 0)
    assert out.dtype == dtype and out.shape == v.shape and out.device == v.device
    assert rel_err(out, ldsa_float64(a, v, 14, 0)) < tol


@pytest.mark.kernels_ci
@pytest.mark.parametrize("left,right", [(14, 0), (7, 7), (2, 9)])
def test_backward_reference_matches_float64_autograd(ldsa, left, right):
    a, v = make(2, 2, 8, 37, left, right)
    go = torch.randn_like(v)
    a64, v64 = a.double().requires_grad_(), v.double().requires_grad_()
    ldsa_float64(a64, v64, left, right).backward(go.double())
    dlogits, dv = ldsa.ldsa_backward_reference(a, v, go, left, right)
    assert rel_err(dlogits, a64.grad) < 1e-5
    assert rel_err(dv, v64.grad) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_autograd_through_public_op(ldsa, device, dtype, tol):
    a, v = make(2, 2, 16, 130, 3, 4, dtype, device, requires_grad=True)
    go = torch.randn_like(v)
    ldsa.ldsa_local_attention(a, v, 3, 4).backward(go)
    a64, v64 = a.detach().double().requires_grad_(), v.detach().double().requires_grad_()
    ldsa_float64(a64, v64, 3, 4).backward(go.double())
    assert a.grad.dtype == dtype and v.grad.dtype == dtype
    assert rel_err(a.grad, a64.grad) < tol
    assert rel_err(v.grad, v64.grad) < tol


@pytest.mark.kernels_ci
def test_opcheck(ldsa):
    a, v = make(2, 2, 8, 23, 2, 3, requires_grad=True)
    torch.library.opcheck(ldsa.op.ldsa_forward_op, (a, v, 2, 3))
    go = torch.randn_like(v)
    torch.library.opcheck(ldsa.op.ldsa_backward_op, (a.detach(), v.detach(), go, 2, 3))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(ldsa, device):
    a, v = make(2, 2, 8, 40, 5, 1, device=device, requires_grad=True)

    def step(a, v):
        return (ldsa.ldsa_local_attention(a, v, 5, 1) ** 2).sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    compiled(a, v).backward()
    ga, gv = a.grad.clone(), v.grad.clone()
    a.grad = v.grad = None
    step(a, v).backward()
    assert rel_err(ga, a.grad) < 1e-6 and rel_err(gv, v.grad) < 1e-6


def test_noncontiguous_inputs_are_copied(ldsa):
    a, v = make(2, 2, 8, 30, 4, 0)
    vt = v.transpose(2, 3).contiguous().transpose(2, 3)
    assert not vt.is_contiguous()
    assert torch.equal(ldsa.ldsa_local_attention(a, vt, 4, 0), ldsa.ldsa_local_attention(a, v, 4, 0))


BAD = [
    (lambda a, v: (a.double(), v, 2, 1), TypeError, "a_logits"),
    (lambda a, v: (a, v.int(), 2, 1), TypeError, "v must be"),
    (lambda a, v: (a[0], v, 2, 1), ValueError, "a_logits must have rank 4"),
    (lambda a, v: (a, v[..., :-1], 2, 1), ValueError, "v must be"),
    (lambda a, v: (a, v[:1], 2, 1), ValueError, "v must be"),
    (lambda a, v: (a, v, 2, 2), ValueError, "W=4 must equal left \\+ right \\+ 1 = 5"),
    (lambda a, v: (a, v, -1, 4), ValueError, "left must be >= 0"),
    (lambda a, v: (a, v, 2, 1.0), TypeError, "right must be an int"),
    (lambda a, v: (a, v, True, 2), TypeError, "left must be an int"),
    (lambda a, v: (a.numpy(), v, 2, 1), TypeError, "a_logits must be a torch.Tensor"),
    (lambda a, v: (a[..., :0], v[..., :0], 2, 1), ValueError, "every size must be >= 1"),
]


@pytest.mark.kernels_ci
@pytest.mark.parametrize("bad,exc,match", BAD)
def test_bad_input_raises(ldsa, bad, exc, match):
    """Also after a good call on the same tensors: the op remembers the call signatures that passed its checks."""
    a, v = make(2, 2, 8, 16, 2, 1)
    ldsa.ldsa_local_attention(a, v, 2, 1)
    with pytest.raises(exc, match=match):
        ldsa.ldsa_local_attention(*bad(a, v))


@pytest.mark.kernels_ci
def test_remembered_signature_does_not_admit_a_bool_side(ldsa):
    """True == 1 and hash(True) == hash(1): a remembered (1, 2) window must not let (True, 2) through."""
    a, v = make(2, 2, 8, 16, 1, 2)
    ldsa.ldsa_local_attention(a, v, 1, 2)
    with pytest.raises(TypeError, match="left must be an int"):
        ldsa.ldsa_local_attention(a, v, True, 2)


@needs_cuda
def test_inputs_on_different_devices_raise(ldsa):
    a, v = make(1, 1, 8, 16, 2, 1)
    with pytest.raises(ValueError, match="one device"):
        ldsa.ldsa_local_attention(a.cuda(), v, 2, 1)


@pytest.mark.parametrize("device", DEVICES)
def test_registered_backward_refuses_a_bad_grad_out(ldsa, device):
    a, v = make(1, 2, 16, 64, 2, 1, device=device)
    with pytest.raises(ValueError, match="grad_out must have the shape"):
        ldsa.op.ldsa_backward_op(a, v, v[..., :-1], 2, 1)
    with pytest.raises(TypeError, match="grad_out must be"):
        ldsa.op.ldsa_backward_op(a, v, v.double(), 2, 1)
    if device == "cuda":
        with pytest.raises(ValueError, match="grad_out must be on"):
            ldsa.op.ldsa_backward_op(a, v, v.cpu(), 2, 1)


@needs_cuda
@pytest.mark.parametrize("config", ["band", "band-prefetch", "band-tma", "band-gluon"])
def test_cuda_every_path_runs_on_its_inputs_device(ldsa, config):
    """Each path launches on its inputs' GPU whatever device is current: the device guard, and the caches keyed by
    device (plans, compiled launches, SM counts; TMA descriptors built per call). With two GPUs the inputs are on
    cuda:1 while cuda:0 is current; with one, on cuda:0 inside torch.cuda.device(0). A path this GPU or Triton does
    not run runs as the one the dispatcher gives in its place."""
    kernels = submodule(ldsa, "dispatch")
    device = torch.device("cuda", 1 if torch.cuda.device_count() >= 2 else 0)
    a, v = make(2, 8, 64, 1024, 14, 0, torch.bfloat16)
    go = grad_like(v)
    ga, gv = ldsa_float64_grads(a, v, go, 14, 0)
    backward = config if config in kernels.BACKWARD_CONFIGS else kernels.BAND
    with torch.cuda.device(0):
        ad, vd, god = a.to(device), v.to(device), go.to(device)
        out = kernels.ldsa_forward_cuda(ad, vd, 14, 0, config=config)
        dlogits, dv = kernels.ldsa_backward_cuda(ad, vd, god, 14, 0, config=backward)
        public = ldsa.ldsa_local_attention(ad.requires_grad_(), vd, 14, 0)
        public.backward(god)
    assert out.device == dlogits.device == dv.device == public.device == device
    expected = ldsa_float64(a, v, 14, 0)
    assert rel_err(out, expected) < FWD_TOL[torch.bfloat16]
    assert rel_err(dlogits, ga) < TOL[torch.bfloat16] and rel_err(dv, gv) < TOL[torch.bfloat16]
    assert rel_err(public, expected) < FWD_TOL[torch.bfloat16]
    assert rel_err(ad.grad, ga) < TOL[torch.bfloat16]


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_two_gpus_at_once_from_two_threads(ldsa):
    """The large-call paths (band-gluon, band-tma where those run) on cuda:0 and cuda:1 at once, one thread each."""
    a, v = make(4, 64, 64, 1024, 14, 0, torch.bfloat16)  # 2^18 frames: the fast paths' default
    expected = ldsa.ldsa_forward_reference(a, v, 14, 0)
    results = {}

    def run(index):
        with torch.no_grad():
            results[index] = ldsa.ldsa_local_attention(a.to(f"cuda:{index}"), v.to(f"cuda:{index}"), 14, 0).cpu()

    threads = [threading.Thread(target=run, args=(index,)) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index in (0, 1):
        assert rel_err(results[index], expected) < FWD_TOL[torch.bfloat16], index


# ---- The Triton kernels under the interpreter (CPU tensors, launchers called directly) ----

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# The launchers take windows of 2 to 113 taps (the public op runs the reference for the others).
INTERP_WINDOWS = [(1, 0), (14, 0), (7, 7), (0, 9), (31, 31), (64, 0), (40, 56)]
# Every window at every ragged T; Dh and dtype rotate so that each pairing of T, Dh and dtype occurs.
INTERP_CASES = [
    (left, right, T, (8, 24, 64)[i % 3], (torch.float32, torch.bfloat16, torch.float16)[(i + i // 3) % 3])
    for i, ((left, right), T) in enumerate(itertools.product(INTERP_WINDOWS, (1, 97, 136)))
]
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="Triton interpreter tests run where there is no GPU")


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Outputs the launchers allocate start as NaN, so an element the kernel never writes fails the test."""
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda x, **kw: empty_like(x, **kw).fill_(float("nan")))


def ldsa_float64_grads(a, v, go, left, right):
    a64, v64 = a.detach().double().requires_grad_(), v.detach().double().requires_grad_()
    ldsa_float64(a64, v64, left, right).backward(go.double())
    return a64.grad, v64.grad


def assert_backward_repeats_and_matches_float64(kernels, a, v, go, left, right, config):
    """The launcher's backward in `config`: a second call (the cached launch) gives the same bits, and both
    gradients match float64 autograd."""
    dlogits, dv = kernels.ldsa_backward_cuda(a, v, go, left, right, config=config)
    again = kernels.ldsa_backward_cuda(a, v, go, left, right, config=config)
    assert torch.equal(again[0], dlogits) and torch.equal(again[1], dv)
    ga, gv = ldsa_float64_grads(a, v, go, left, right)
    assert rel_err(dlogits, ga) < TOL[v.dtype] and rel_err(dv, gv) < TOL[v.dtype]


@needs_interpreter
@pytest.mark.parametrize("left,right,T,Dh,dtype", INTERP_CASES)
def test_triton_interpreted_matches_float64(ldsa, poisoned_outputs, left, right, T, Dh, dtype):
    kernels = submodule(ldsa, "dispatch")
    a, v = make(2, 2, Dh, T, left, right, dtype)
    go = grad_like(v)
    out = kernels.ldsa_forward_cuda(a, v, left, right)
    assert out.dtype == dtype and rel_err(out, ldsa_float64(a, v, left, right)) < TOL[dtype]
    dlogits, dv = kernels.ldsa_backward_cuda(a, v, go, left, right)
    ga, gv = ldsa_float64_grads(a, v, go, left, right)
    assert dlogits.dtype == dtype and dv.dtype == dtype
    assert rel_err(dlogits, ga) < TOL[dtype] and rel_err(dv, gv) < TOL[dtype]


@needs_interpreter
@pytest.mark.parametrize("case", range(0, len(INTERP_CASES), 2))
def test_triton_interpreted_every_config(ldsa, poisoned_outputs, case):
    """Every launch configuration rotates over the interpreter cases."""
    left, right, T, Dh, dtype = INTERP_CASES[case]
    kernels = submodule(ldsa, "dispatch")
    forward = kernels.FORWARD_CONFIGS[case // 2 % len(kernels.FORWARD_CONFIGS)]
    backward = kernels.BACKWARD_CONFIGS[(case // 2 + 1) % len(kernels.BACKWARD_CONFIGS)]
    a, v = make(1, 2, Dh, T, left, right, dtype)
    go = grad_like(v)
    out = kernels.ldsa_forward_cuda(a, v, left, right, config=forward)
    assert out.dtype == dtype and rel_err(out, ldsa_float64(a, v, left, right)) < TOL[dtype]
    dlogits, dv = kernels.ldsa_backward_cuda(a, v, go, left, right, config=backward)
    ga, gv = ldsa_float64_grads(a, v, go, left, right)
    assert rel_err(dlogits, ga) < TOL[dtype] and rel_err(dv, gv) < TOL[dtype]


@needs_interpreter
@pytest.mark.parametrize("config", ["band", "band-prefetch"])
def test_band_design_refuses_windows_it_does_not_take(ldsa, config):
    """A one-tap window runs the reference (supports_window); asked for the band design by name, it raises."""
    kernels = submodule(ldsa, "dispatch")
    a, v = make(1, 2, 16, 40, 0, 0, torch.float32)
    assert torch.equal(kernels.ldsa_forward_cuda(a, v, 0, 0), ldsa.ldsa_forward_reference(a, v, 0, 0))
    go = torch.randn_like(v)
    for got, expected in zip(kernels.ldsa_backward_cuda(a, v, go, 0, 0), ldsa.ldsa_backward_reference(a, v, go, 0, 0)):
        assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="1-tap window"):
        kernels.ldsa_forward_cuda(a, v, 0, 0, config=config)
    if config == kernels.BAND:
        with pytest.raises(ValueError, match="1-tap window"):
            kernels.ldsa_backward_cuda(a, v, torch.ones_like(v), 0, 0, config=config)


@pytest.mark.kernels_ci
def test_kept_direct_calls_follow_the_tunables(ldsa, monkeypatch):
    """The public function keeps its direct call by call signature (`dispatch.DIRECT_FORWARDS`) with the launch that
    `plan` gives; `clear_plans`, which tests and benchmarks call after changing a tunable, forgets it, so the next
    call takes the changed default (CUDA's path, taken on CPU tensors under `tools.host_time`'s stubs)."""
    kernels = submodule(ldsa, "dispatch")
    a, v = make(1, 2, 16, 40, 3, 2, torch.bfloat16, device="cpu")
    assert kernels.plan("forward", (a, v), 3, 2).config == kernels.BAND_PREFETCH

    def calls():
        ldsa.ldsa_local_attention(a, v, 3, 2)  # planned, then kept
        ldsa.ldsa_local_attention(a, v, 3, 2)  # the kept direct call
        monkeypatch.setitem(kernels.DEFAULT_CONFIG, ("forward", True, False), kernels.BAND)
        kernels.clear_plans()
        assert not kernels.DIRECT_FORWARDS
        ldsa.ldsa_local_attention(a, v, 3, 2)

    try:
        with torch.no_grad():
            (launches,) = recorded_launches(ldsa, calls, calls=1)
        planned, kept, changed = launches
        assert kept == planned and changed != planned
        assert kernels.plan("forward", (a, v), 3, 2).config == kernels.BAND
    finally:
        monkeypatch.undo()
        kernels.clear_plans()


@needs_interpreter
@pytest.mark.parametrize("left,right,T,dtype", [(14, 0, 75, torch.bfloat16), (7, 7, 200, torch.float32)])
def test_triton_interpreted_several_chunks_per_program(ldsa, poisoned_outputs, monkeypatch, left, right, T, dtype):
    """Small shapes get one chunk a program (MIN_PROGRAMS); with that floor lifted a program walks several
    chunks (T = 75: five, the last ragged; T = 200: two programs of eight and five), which is the loop the
    large shapes run, the prefetching forward's carried loads included."""
    kernels, band = submodule(ldsa, "dispatch"), submodule(ldsa, "portable.band")
    monkeypatch.setattr(band, "MIN_PROGRAMS", 1)
    kernels.clear_plans()
    try:
        assert band.plan(left + right + 1, left, 24, T, 2, dtype.itemsize)[2]["CHUNKS"] > 1
        a, v = make(1, 2, 24, T, left, right, dtype)
        go = grad_like(v)
        expected = ldsa_float64(a, v, left, right)
        for config in (kernels.BAND, kernels.BAND_PREFETCH):
            assert rel_err(kernels.ldsa_forward_cuda(a, v, left, right, config=config), expected) < TOL[dtype], config
        dlogits, dv = kernels.ldsa_backward_cuda(a, v, go, left, right, config=kernels.BAND)
        ga, gv = ldsa_float64_grads(a, v, go, left, right)
        assert rel_err(dlogits, ga) < TOL[dtype] and rel_err(dv, gv) < TOL[dtype]
    finally:
        kernels.clear_plans()


@needs_interpreter
def test_triton_interpreted_two_channel_tiles_and_mixed_dtypes(ldsa, poisoned_outputs):
    """Dh > 128 walks two channel tiles; bf16 logits with fp32 values, and a float32 grad_out for bf16 v."""
    kernels = submodule(ldsa, "dispatch")
    a, v = make(1, 1, 136, 40, 3, 2, torch.float32)
    a = a.bfloat16()
    assert rel_err(kernels.ldsa_forward_cuda(a, v, 3, 2), ldsa_float64(a, v, 3, 2)) < 1e-5
    go = torch.randn_like(v)
    dlogits, dv = kernels.ldsa_backward_cuda(a, v.bfloat16(), go, 3, 2)
    ga, gv = ldsa_float64_grads(a, v.bfloat16(), go, 3, 2)
    assert dlogits.dtype == torch.bfloat16 and dv.dtype == torch.bfloat16
    assert rel_err(dlogits, ga) < 1e-2 and rel_err(dv, gv) < 1e-2


# The TMA kernels: chunks of 32 frames with K = 64 (windows up to 33 taps) and of 64 with K = 128 (up to 65), T
# a multiple of 8 (shorter than a chunk too), Dh 16 to 128, all three dtypes. The CPU counts as one SM, so
# the persistent grid's 3 programs walk several chunks and heads each.
INTERP_TMA_CASES = [
    (14, 0, 96, 64, torch.bfloat16, 3),
    (7, 7, 40, 16, torch.float32, 3),
    (30, 0, 8, 32, torch.float16, 6),
    (1, 0, 136, 128, torch.bfloat16, 2),
    (31, 31, 136, 64, torch.float32, 2),
    (0, 64, 64, 32, torch.bfloat16, 5),
]


def backward_takes_tma(ldsa, left, right, Dh, T, BH, dtype):
    """The backward's TMA rule, stated again: `band_tma.tiles`' K = 64 tiles, Dh <= 64 (larger ones passed the
    H200's shared memory) and 16-bit values."""
    tiles = submodule(ldsa, "hopper.band_tma").tiles(
        "forward", left + right + 1, left, Dh, T, BH, torch.bfloat16)  # the geometry
    return tiles is not None and tiles[1] == 64 and Dh <= 64 and dtype != torch.float32


@needs_interpreter
@pytest.mark.parametrize("left,right,T,Dh,dtype,BH", INTERP_TMA_CASES)
def test_triton_interpreted_tma_kernels(ldsa, poisoned_outputs, left, right, T, Dh, dtype, BH):
    kernels = submodule(ldsa, "dispatch")
    a, v = make(1, BH, Dh, T, left, right, dtype)
    go = grad_like(v)
    launches = [kernels.plan("forward", (a, v), left, right, kernels.BAND_TMA)]
    if backward_takes_tma(ldsa, left, right, Dh, T, BH, dtype):
        launches.append(kernels.plan("backward", (a, v, v), left, right, kernels.BAND_TMA))
    for launch in launches:
        assert launch.config == kernels.BAND_TMA and launch.programs < launch.ints[-1]  # programs < chunks
    out = kernels.ldsa_forward_cuda(a, v, left, right, config=kernels.BAND_TMA)
    assert out.dtype == dtype and rel_err(out, ldsa_float64(a, v, left, right)) < TOL[dtype]
    dlogits, dv = kernels.ldsa_backward_cuda(a, v, go, left, right, config=kernels.BAND_TMA)
    ga, gv = ldsa_float64_grads(a, v, go, left, right)
    assert rel_err(dlogits, ga) < TOL[dtype] and rel_err(dv, gv) < TOL[dtype]


@needs_interpreter
def test_a_fast_path_that_fails_to_compile_falls_back_once(ldsa, monkeypatch):
    """A fast path whose first launch raises is switched off with one warning, and the call (and later ones) run the
    portable kernels: band-tma's forward kernel replaced by one that fails, under the interpreter."""
    kernels = submodule(ldsa, "dispatch")
    fast_paths = submodule(ldsa, "common.fast_paths")

    class Failing:
        def __getitem__(self, grid):
            raise RuntimeError("error encountered during parsing")

    monkeypatch.setattr(submodule(ldsa, "hopper.band_tma"), "_band_forward_tma_kernel", Failing())
    monkeypatch.setattr(kernels.FAST_PATHS, "switched_off", {})
    kernels.clear_plans()
    a, v = make(1, 4, 16, 64, 14, 0)
    try:
        assert kernels.plan("forward", (a, v), 14, 0, kernels.BAND_TMA).config == kernels.BAND_TMA
        with pytest.warns(fast_paths.FastPathFallback, match="band-tma forward.*error encountered during parsing"):
            out = kernels.ldsa_forward_cuda(a, v, 14, 0, config=kernels.BAND_TMA)
        assert rel_err(out, ldsa_float64(a, v, 14, 0)) < TOL[torch.float32]
        assert kernels.plan("forward", (a, v), 14, 0, kernels.BAND_TMA).config == kernels.BAND_PREFETCH
        assert list(kernels.FAST_PATHS.switched_off) == ["band-tma forward"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert torch.equal(kernels.ldsa_forward_cuda(a, v, 14, 0, config=kernels.BAND_TMA), out)
    finally:
        kernels.clear_plans()


@needs_interpreter
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_tma_kernels_take_only_what_tma_can_address(ldsa, direction):
    """band-tma runs as band-prefetch (forward) or band (backward) where TMA cannot take the call, and the
    default takes it only for large calls it can take (float32 forwards only with small value tiles)."""
    kernels = submodule(ldsa, "dispatch")
    fallback = kernels.BAND_PREFETCH if direction == "forward" else kernels.BAND

    def config(T=3000, Dh=64, W=15, left=14, BH=512, dtype=torch.bfloat16, aligned=True, asked=kernels.BAND_TMA):
        return kernels._plan(direction, asked, W, left, Dh, T, BH, dtype, aligned, -1).config

    assert config() == kernels.BAND_TMA and config(dtype=torch.float16) == kernels.BAND_TMA
    assert config(dtype=torch.float32) == (kernels.BAND_TMA if direction == "forward" else fallback)
    assert config(W=2, left=1) == kernels.BAND_TMA and config(W=33, left=32) == kernels.BAND_TMA
    # K = 128 tiles (W = 63, 65) and Dh = 128: the forward only.
    wide = (dict(W=65, left=64), dict(W=63, left=62), dict(Dh=128), dict(W=65, left=64, Dh=128))
    for case in wide:
        assert config(**case) == (kernels.BAND_TMA if direction == "forward" else fallback), case
    assert config(W=65, left=64, Dh=128, dtype=torch.float32) == fallback  # 64 KB value tiles
    for refused in (dict(T=3001), dict(T=3004), dict(Dh=80), dict(Dh=256), dict(Dh=8), dict(aligned=False),
                    dict(W=66, left=65), dict(W=63, left=61)):  # W = 63, left = 61: 64 + 62 + 7 > 128 span
        assert config(**refused) == fallback, refused
    assert config(asked=None) == kernels.BAND_TMA
    assert config(asked=None, dtype=torch.float16) == kernels.BAND_TMA
    # float32: the forward's K = 64 tiles at Dh <= 64; the backward takes no float32 call
    assert config(asked=None, dtype=torch.float32) == (
        kernels.BAND_TMA if direction == "forward" else kernels.default_config(direction, 15, torch.float32))
    for untaken in (dict(Dh=128), dict(W=63, left=62)):  # value tiles of 32 KB
        assert config(asked=None, dtype=torch.float32, **untaken) == kernels.default_config(
            direction, untaken.get("W", 15), torch.float32), untaken
    small = kernels.TMA_MIN_FRAMES // 3000
    assert config(asked=None, BH=small) == kernels.default_config(direction, 15, torch.bfloat16) != kernels.BAND_TMA
    assert config(asked=None, T=3001) == kernels.default_config(direction, 15, torch.bfloat16)


@needs_interpreter
def test_tma_forward_chunk_parts(ldsa):
    """The TMA forward's chunks are two 32-frame parts exactly where its two-part code path applies (K = 64
    tiles, Dh <= 64, 16-bit values; a float32 call there would fail its static assert), and its logits
    tiles keep a zero-weight row past the window, which the band's out-of-band positions read."""
    kernels = submodule(ldsa, "dispatch")

    def meta(W=15, left=14, Dh=64, dtype=torch.bfloat16):
        return kernels._plan("forward", kernels.BAND_TMA, W, left, Dh, 3000 - 3000 % 8, 512, dtype, True, -1).meta

    assert meta()["PARTS"] == 2 and meta(dtype=torch.float16)["PARTS"] == 2 and meta(Dh=16)["PARTS"] == 2
    for one_part in (dict(dtype=torch.float32), dict(Dh=128), dict(W=63, left=62), dict(W=65, left=0)):
        assert meta(**one_part)["PARTS"] == 1, one_part
    for W in (2, 7, 8, 15, 16, 31, 32, 63, 64):
        assert meta(W=W, left=W - 1)["BLOCK_W"] > W, W


def test_small_windows_compile_for_sm90(ldsa):
    """Windows of 2 to 8 taps, every configuration this Triton compiles (the table of fast paths), compiled for
    sm_90a without a GPU (tools.compile_offline on the benchmark's "taps" cases): their 2- and 4-row logits tiles
    fail Triton 3.6's thread-locality pass unless padded, which the interpreter cannot see."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "tools.compile_offline", "ldsa", "--match", "taps"], env=env,
                         cwd=Path(testkit.__file__).parent, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    kernels = {line.split("|")[2].strip() for line in out.stdout.splitlines() if "taps" in line}
    gluon_backward = submodule(ldsa, "dispatch").FAST_PATHS.compiles("band-gluon backward")
    assert kernels == {"_band_forward_kernel", "_band_backward_kernel", "_band_forward_tma_kernel",
                       "_band_backward_tma_kernel", "_band_forward_gluon_kernel"} | (
                          {"_band_backward_gluon_kernel"} if gluon_backward else set())


def test_gluon_forward_takes_the_windows_its_blocks_reach(ldsa):
    """band-gluon's rule: 16-bit or float32 values, 2 to 15 taps whose reach from a block's span start (W - 1 plus
    left's rounding up to 8) stays within 16 positions past the block, T a multiple of 8, Dh 16 to 64. What it does
    not take, and every call off Hopper or under the interpreter (device -1), runs as band-tma."""
    kernels, gluon_forward = submodule(ldsa, "dispatch"), submodule(ldsa, "hopper.band_forward")

    def rule(W=15, left=14, Dh=64, T=3000, BH=512, dtype=torch.bfloat16):
        return gluon_forward.takes(W, left, Dh, T, BH, dtype)

    assert [gluon_forward._lead(left) for left in (14, 7, 0, 8, 1, 3)] == [16, 8, 0, 8, 8, 8]
    assert rule() and rule(left=7) and rule(left=0) and rule(left=8)  # causal, centered
    assert rule(dtype=torch.float16) and rule(dtype=torch.float32)
    assert rule(Dh=16) and rule(Dh=32) and rule(T=8)
    assert rule(W=2, left=1) and rule(W=10, left=3)  # reach 1 + 7 and 9 + 5
    for refused in (dict(left=13), dict(left=1), dict(W=16, left=15), dict(W=1, left=0), dict(dtype=torch.float64),
                    dict(T=3001), dict(Dh=128), dict(Dh=80), dict(BH=2**26)):
        assert not rule(**refused), refused

    def config(asked=kernels.BAND_GLUON, **call):
        shape = dict(W=15, left=14, Dh=64, T=3000, BH=512, dtype=torch.bfloat16, aligned=True, device=-1) | call
        return kernels._plan("forward", asked, *shape.values()).config

    assert config() == kernels.BAND_TMA and config(asked=None) == kernels.BAND_TMA
    assert config(W=65, left=64, Dh=128, dtype=torch.float32) == kernels.BAND_PREFETCH  # where band-tma cannot


def test_gluon_backward_takes_the_windows_its_blocks_reach(ldsa):
    """The Gluon backward's rule: 16-bit or float32 values, 2 to 15 taps whose value spans (right + left rounded
    up to 8) and reading frames (left + right rounded up to 8) reach at most 16 positions past a block, T a
    multiple of 8, Dh 16 to 64. What it does not take, and every call off Hopper or under the interpreter
    (device -1), runs as band-tma or band."""
    kernels = submodule(ldsa, "dispatch")
    takes = submodule(ldsa, "hopper.band_backward").takes

    def rule(W=15, left=14, Dh=64, T=3000, BH=512, dtype=torch.bfloat16):
        return takes(W, left, Dh, T, BH, dtype)

    assert rule() and rule(left=7) and rule(left=0) and rule(W=2, left=1) and rule(W=2, left=0)
    assert rule(W=15, left=8) and rule(W=15, left=6) and rule(dtype=torch.float16) and rule(dtype=torch.float32)
    assert rule(Dh=16) and rule(T=8)
    for refused in (dict(left=13), dict(left=1), dict(W=16, left=15), dict(W=1, left=0), dict(W=15, left=9),
                    dict(W=15, left=5), dict(T=3001), dict(Dh=128), dict(BH=2**26)):
        assert not rule(**refused), refused

    def config(asked=kernels.BAND_GLUON, **call):
        shape = dict(W=15, left=14, Dh=64, T=3000, BH=512, dtype=torch.bfloat16, aligned=True, device=-1) | call
        return kernels._plan("backward", asked, *shape.values()).config

    assert config() == kernels.BAND_TMA and config(asked=None) == kernels.BAND_TMA
    assert config(dtype=torch.float32) == kernels.BAND  # where band-tma cannot


def _bank_conflicts(register_layout, shared_layout, shape) -> int:
    """Triton's count of excess shared-memory accesses a wavefront when float32 data of `shape` in
    `register_layout` is read from `shared_layout` (gl.bank_conflicts, outside a kernel)."""
    from triton._C.libtriton import gluon_ir, ir
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import distributed_type, shared_memory_descriptor_type
    from triton.experimental.gluon.language._semantic import GluonSemantic

    context = ir.context()
    ir.load_dialects(context)
    semantic = GluonSemantic(gluon_ir.GluonOpBuilder(context))
    return semantic.bank_conflicts(distributed_type(gl.float32, shape, register_layout),
                                   shared_memory_descriptor_type(gl.float32, shape, shared_layout, shape))


@pytest.mark.parametrize("Dh", [16, 32, 64])
def test_gluon_backward_float32_operand_reads_are_conflict_free(ldsa, monkeypatch, Dh):
    """The float32 P product reads its grad_out and value operands from the TMA boxes an element at a time.
    Through the boxes' own swizzled layouts (128 bytes a row, 64 for the halo) two lanes of a load share a bank;
    through `p_operand_views`, which take Dh in K_ORDER, none do, for either operand. With K_ORDER the
    identity the views reproduce the swizzles' own conflicts, as a check that they model those layouts."""
    from triton.experimental.gluon import language as gl

    release = submodule(ldsa, "common.fast_paths").TRITON_RELEASE
    if release not in ("3.6", "3.7"):  # the count reads Triton's layout internals, which crash from 3.8 on
        pytest.skip(f"gl.bank_conflicts outside a kernel is not usable under Triton {release}")
    g = submodule(ldsa, "hopper.band_backward")
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[2, 2], instr_shape=[16, 8])
    a_operand, b_operand = (gl.DotOperandLayout(operand_index=i, parent=mma, k_width=1) for i in (0, 1))

    def transposed(view):
        return gl.SharedLinearLayout([basis[::-1] for basis in view.offset_bases])

    _, _, box, halo = g.layouts(torch.float32, Dh)
    box_view, halo_view = g.p_operand_views(torch.float32, Dh)
    for layout, view, frames in ((box, box_view, 32), (halo, halo_view, 16)):
        assert _bank_conflicts(b_operand, layout, [Dh, frames]) == 1
        assert _bank_conflicts(b_operand, view, [Dh, frames]) == 0
        assert _bank_conflicts(a_operand, transposed(view), [frames, Dh]) == 0
        monkeypatch.setattr(g, "K_ORDER", tuple(range(8)))
        identity = g._k_ordered_view([Dh, frames], layout, 4)
        monkeypatch.undo()
        assert _bank_conflicts(b_operand, identity, [Dh, frames]) == 1
        assert _bank_conflicts(a_operand, transposed(identity), [frames, Dh]) == 1
    assert g.p_operand_views(torch.bfloat16, Dh) == g.layouts(torch.bfloat16, Dh)[2:]


# ---- The fused path on CUDA (the lead's GPU run) ----

# Every band configuration `band.plan` picks: N = 16, 32, 64 frames per chunk; K = 16 to 128; 4 and 8 warps;
# (1, 0), (1, 1) and (3, 4) the smallest logits tile (BLOCK_W = 8); (100, 12) is the widest fused window
# (113 taps), (100, 28) runs the reference.
CUDA_WINDOWS = [(0, 0), (1, 0), (1, 1), (3, 4), (14, 0), (7, 7), (0, 9), (3, 11), (20, 0), (31, 31), (64, 0), (48, 48),
                (100, 12), (100, 28)]


@needs_cuda
def test_cuda_takes_the_triton_path(ldsa):
    assert ldsa.kernel_path(torch.empty(1, device="cuda")) == "triton"
    assert ldsa.kernel_path(torch.empty(1)) == "reference"
    band = submodule(ldsa, "portable.band")
    assert band.supports_window(113) and not band.supports_window(114)
    assert band.supports_window(2) and not band.supports_window(1)


# Every window in every dtype; the channel count and T rotate so each pairing occurs. T = 3008 and 136 are
# multiples of 8, where the band design aligns its value spans (`band.span_leads`); 3001, 97 and 1 are not.
FWD_TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}
CUDA_FWD_CASES = [
    (left, right, dtype, (32, 64, 128, 80)[i % 4], (3001, 3008)[i % 2])
    for i, ((left, right), dtype) in enumerate(itertools.product(CUDA_WINDOWS, FWD_TOL))
]
CUDA_BWD_CASES = [
    (left, right, dtype, *((64, 3001), (80, 97), (256, 136), (32, 1))[i % 4])
    for i, ((left, right), dtype) in enumerate(itertools.product(CUDA_WINDOWS, TOL))
]


@needs_cuda
@pytest.mark.parametrize("left,right,dtype,Dh,T", CUDA_FWD_CASES)
def test_cuda_forward_matches_float64(ldsa, left, right, dtype, Dh, T):
    a, v = make(2, 3, Dh, T, left, right, dtype, "cuda")
    out = ldsa.ldsa_local_attention(a, v, left, right)
    assert out.dtype == dtype and rel_err(out, ldsa_float64(a, v, left, right)) < FWD_TOL[dtype]


@needs_cuda
@pytest.mark.parametrize("left,right,dtype,Dh,T", CUDA_BWD_CASES)
def test_cuda_backward_matches_float64_autograd(ldsa, left, right, dtype, Dh, T):
    tol = TOL[dtype]
    a, v = make(2, 2, Dh, T, left, right, dtype, "cuda", requires_grad=True)
    go = grad_like(v)
    ldsa.ldsa_local_attention(a, v, left, right).backward(go)
    ga, gv = ldsa_float64_grads(a, v, go, left, right)
    assert a.grad.dtype == dtype and v.grad.dtype == dtype
    assert rel_err(a.grad, ga) < tol and rel_err(v.grad, gv) < tol


# Every forward configuration over the windows the launchers take (2 to 113 taps), called directly: case i has
# window i // 3 and dtype i % 3, and configuration (window + dtype) % 3, so that every window meets every
# configuration and so does every dtype.
FUSED_CASES = [i for i, (left, right, *_) in enumerate(CUDA_FWD_CASES) if 2 <= left + right + 1 <= 113]


@needs_cuda
@pytest.mark.parametrize("case", FUSED_CASES)
def test_cuda_every_config_matches_float64(ldsa, case):
    kernels = submodule(ldsa, "dispatch")
    left, right, dtype, Dh, T = CUDA_FWD_CASES[case]
    forward = kernels.FORWARD_CONFIGS[(case // len(FWD_TOL) + case) % len(kernels.FORWARD_CONFIGS)]
    _, _, _, Dh_b, T_b = CUDA_BWD_CASES[case]
    backward = kernels.BACKWARD_CONFIGS[case % len(kernels.BACKWARD_CONFIGS)]
    a, v = make(2, 3, Dh, T, left, right, dtype, "cuda")
    out = kernels.ldsa_forward_cuda(a, v, left, right, config=forward)
    assert out.dtype == dtype and rel_err(out, ldsa_float64(a, v, left, right)) < FWD_TOL[dtype], forward
    a, v = make(2, 2, Dh_b, T_b, left, right, dtype, "cuda")
    go = grad_like(v)
    dlogits, dv = kernels.ldsa_backward_cuda(a, v, go, left, right, config=backward)
    ga, gv = ldsa_float64_grads(a, v, go, left, right)
    assert rel_err(dlogits, ga) < TOL[dtype] and rel_err(dv, gv) < TOL[dtype], backward


# band-gluon over windows its rule takes, with lead - left from 0 to 7 (4 aside), and two it does not (they run
# as band-tma); every dtype, each meeting Dh 16 to 64, T from one TMA box to past the card's lengths, and B * H
# large enough that the persistent programs walk several chunks each.
CUDA_GLUON_CASES = [
    (left, right, dtype, (16, 32, 64)[(i + i // 3) % 3], (8, 136, 3000, 1000)[i % 4], (1, 64, 2, 32)[i % 4])
    for i, ((left, right), dtype) in enumerate(
        itertools.product([(14, 0), (7, 7), (0, 14), (1, 0), (0, 1), (5, 3), (8, 6), (3, 3), (6, 8), (2, 1), (13, 1),
                           (15, 0)], (torch.bfloat16, torch.float16, torch.float32))
    )
]


@needs_cuda
@pytest.mark.parametrize("left,right,dtype,Dh,T,B", CUDA_GLUON_CASES)
def test_cuda_gluon_forward_matches_float64(ldsa, left, right, dtype, Dh, T, B):
    kernels = submodule(ldsa, "dispatch")
    a, v = make(B, 8, Dh, T, left, right, dtype, "cuda")
    takes = submodule(ldsa, "hopper.band_forward").takes(left + right + 1, left, Dh, T, B * 8, dtype)
    assert takes == ((left, right) not in [(13, 1), (15, 0)])
    gluon_here = kernels.FAST_PATHS.runs("band-gluon forward", a.device)
    elsewhere = kernels.BAND_TMA if kernels.FAST_PATHS.runs("band-tma forward", a.device) else kernels.BAND_PREFETCH
    assert kernels.plan("forward", (a, v), left, right, kernels.BAND_GLUON).config == (
        kernels.BAND_GLUON if takes and gluon_here else elsewhere)
    out = kernels.ldsa_forward_cuda(a, v, left, right, config=kernels.BAND_GLUON)
    again = kernels.ldsa_forward_cuda(a, v, left, right, config=kernels.BAND_GLUON)  # the cached launch
    assert torch.equal(again, out)
    assert rel_err(out, ldsa_float64(a, v, left, right)) < FWD_TOL[dtype]


@needs_cuda
def test_cuda_large_calls_take_band_gluon(ldsa):
    """The defaults for the calls band-gluon takes, forward and backward, from TMA_MIN_FRAMES frames up, where
    the table of fast paths runs it (else band-tma where that runs), in every dtype."""
    kernels = submodule(ldsa, "dispatch")
    device = torch.cuda.current_device()

    def config(direction, **call):
        shape = dict(W=15, left=14, Dh=64, T=3000, BH=512, dtype=torch.bfloat16, aligned=True, device=device) | call
        return kernels._plan(direction, None, *shape.values()).config

    for direction in ("forward", "backward"):
        tma = kernels.FAST_PATHS.runs(f"band-tma {direction}", torch.device("cuda", device))
        gluon = (kernels.BAND_GLUON if kernels.FAST_PATHS.runs(f"band-gluon {direction}", torch.device("cuda", device))
                 else kernels.BAND_TMA if tma else kernels.default_config(direction, 15, torch.bfloat16))
        assert config(direction) == config(direction, left=7) == gluon
        assert config(direction, dtype=torch.float16) == gluon
        if gluon == kernels.BAND_GLUON:
            assert config(direction, dtype=torch.float32) == gluon
        assert config(direction, BH=8) != kernels.BAND_GLUON
        assert config(direction, W=31, left=30) == (kernels.BAND_TMA if tma else kernels.default_config(direction, 31,
                                                                                                   torch.bfloat16))


# The Gluon backward over windows its rule takes and three it does not (they run as band-tma, or band in float32),
# every dtype, each meeting Dh 16 to 64, T from one TMA box to past the card's lengths, and B * H large enough
# that the persistent programs walk several chunks each.
CUDA_GLUON_BWD_CASES = [
    (left, right, dtype, (16, 32, 64)[(i + i // 2) % 3], (8, 136, 3000, 1000)[i % 4], (1, 64, 2, 32)[i % 4])
    for i, ((left, right), dtype) in enumerate(
        itertools.product([(14, 0), (7, 7), (0, 14), (1, 0), (0, 1), (5, 3), (8, 6), (3, 3), (6, 8), (2, 1), (13, 1),
                           (1, 13), (15, 0)], (torch.bfloat16, torch.float16, torch.float32))
    )
]


@needs_cuda
@pytest.mark.parametrize("left,right,dtype,Dh,T,B", CUDA_GLUON_BWD_CASES)
def test_cuda_gluon_backward_matches_float64_autograd(ldsa, left, right, dtype, Dh, T, B):
    kernels = submodule(ldsa, "dispatch")
    a, v = make(B, 8, Dh, T, left, right, dtype, "cuda")
    go = grad_like(v)
    takes = submodule(ldsa, "hopper.band_backward").takes(left + right + 1, left, Dh, T, B * 8, dtype)
    assert takes == ((left, right) not in [(13, 1), (1, 13), (15, 0)])
    gluon_here = kernels.FAST_PATHS.runs("band-gluon backward", a.device)
    tma = backward_takes_tma(ldsa, left, right, Dh, T, B * 8, dtype) and kernels.FAST_PATHS.runs(
        "band-tma backward", a.device)
    elsewhere = kernels.BAND_TMA if tma else kernels.BAND
    assert kernels.plan("backward", (a, v, go), left, right, kernels.BAND_GLUON).config == (
        kernels.BAND_GLUON if takes and gluon_here else elsewhere)
    assert_backward_repeats_and_matches_float64(kernels, a, v, go, left, right, kernels.BAND_GLUON)


# The TMA kernels over their tile rule's windows (2 to 65 taps), each dtype and Dh, T short of one chunk to
# past the card's lengths, and B * H large enough that the persistent grid's programs walk several chunks
# each (B = 2 at T = 3008 keeps the float64 reference's unfold within memory).
CUDA_TMA_CASES = [
    (left, right, dtype, (16, 32, 64, 128)[i % 4], (8, 136, 3008)[i % 3], (1, 64, 2)[i % 3])
    for i, ((left, right), dtype) in enumerate(
        itertools.product([(1, 0), (14, 0), (7, 7), (0, 9), (3, 11), (20, 0), (31, 31), (64, 0)], FWD_TOL)
    )
]


@needs_cuda
@pytest.mark.parametrize("left,right,dtype,Dh,T,B", CUDA_TMA_CASES)
def test_cuda_tma_kernels_match_float64(ldsa, left, right, dtype, Dh, T, B):
    kernels = submodule(ldsa, "dispatch")
    a, v = make(B, 8, Dh, T, left, right, dtype, "cuda")
    go = grad_like(v)
    if not kernels.FAST_PATHS.runs("band-tma forward", a.device):
        pytest.skip(f"band-tma is not verified under Triton {submodule(ldsa, 'common.fast_paths').TRITON_RELEASE} here")
    assert kernels.plan("forward", (a, v), left, right, kernels.BAND_TMA).config == kernels.BAND_TMA
    takes = backward_takes_tma(ldsa, left, right, Dh, T, B * 8, dtype)
    assert kernels.plan("backward", (a, v, go), left, right, kernels.BAND_TMA).config == (
        kernels.BAND_TMA if takes else kernels.BAND)
    out = kernels.ldsa_forward_cuda(a, v, left, right, config=kernels.BAND_TMA)
    assert torch.equal(kernels.ldsa_forward_cuda(a, v, left, right, config=kernels.BAND_TMA), out)  # the cached launch
    assert rel_err(out, ldsa_float64(a, v, left, right)) < FWD_TOL[dtype]
    assert_backward_repeats_and_matches_float64(kernels, a, v, go, left, right, kernels.BAND_TMA)


@needs_cuda
@pytest.mark.parametrize("T", [3000, 1024])
@pytest.mark.parametrize("left,right", [(14, 0), (7, 7)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_sweep_configs_match_reference(ldsa, T, left, right, dtype):
    """Every configuration the benchmark sweeps, at its specializations (H=8, Dh=64, T = 3000 or 1024)."""
    kernels = submodule(ldsa, "dispatch")
    a, v = make(2, 8, 64, T, left, right, dtype, "cuda")
    go = torch.randn_like(v)
    ref = ldsa.ldsa_forward_reference(a, v, left, right)
    ref_dl, ref_dv = ldsa.ldsa_backward_reference(a, v, go, left, right)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for config in kernels.FORWARD_CONFIGS:
        assert rel_err(kernels.ldsa_forward_cuda(a, v, left, right, config=config), ref) < tol, config
    for config in kernels.BACKWARD_CONFIGS:
        dl, dv = kernels.ldsa_backward_cuda(a, v, go, left, right, config=config)
        assert rel_err(dl, ref_dl) < tol and rel_err(dv, ref_dv) < tol, config


@needs_cuda
def test_cuda_cached_launch_separates_specializations(ldsa):
    """The launch cache keys on what Triton specializes: a 2-byte-misaligned copy of the inputs (a new
    specialization) and repeated calls (the cached path) give the results of the JIT launch."""
    kernels = submodule(ldsa, "dispatch")
    a, v = make(2, 8, 64, 3000, 14, 0, torch.bfloat16, "cuda")
    ref = ldsa_float64(a, v, 14, 0)
    for config in kernels.FORWARD_CONFIGS:
        first = kernels.ldsa_forward_cuda(a, v, 14, 0, config=config)
        assert torch.equal(kernels.ldsa_forward_cuda(a, v, 14, 0, config=config), first), config
        shifted = torch.empty(v.numel() + 1, dtype=v.dtype, device="cuda")[1:].view(v.shape).copy_(v)
        assert shifted.data_ptr() % 16 != 0
        assert rel_err(kernels.ldsa_forward_cuda(a, shifted, 14, 0, config=config), ref) < 1e-2, config
    assert submodule(ldsa, "common.launch")._compiled


@needs_cuda
@pytest.mark.parametrize("B,T", [(16, 256), (16, 512), (32, 1024), (16, 2048), (32, 3000), (64, 3000)])
@pytest.mark.parametrize("left,right", [(14, 0), (7, 7)])
def test_cuda_card_shapes_match_reference(ldsa, B, T, left, right):
    """The benchmark's shapes (H=8, Dh=64, bf16), forward and backward against the float32 reference."""
    a, v = make(B, 8, 64, T, left, right, torch.bfloat16, "cuda")
    assert rel_err(ldsa.ldsa_local_attention(a, v, left, right), ldsa.ldsa_forward_reference(a, v, left, right)) < 1e-2
    go = torch.randn_like(v)
    dlogits, dv = ldsa.op.ldsa_backward_op(a, v, go, left, right)
    rdlogits, rdv = ldsa.ldsa_backward_reference(a, v, go, left, right)
    assert rel_err(dlogits, rdlogits) < 1e-2 and rel_err(dv, rdv) < 1e-2


@needs_cuda
def test_cuda_offsets_past_2_pow_31(ldsa):
    """B*H*Dh*T > 2^31 elements: the last (b, h) slices must land where the first ones do."""
    B, H, Dh, T, left, right = 33000, 2, 32, 1024, 14, 0
    assert B * H * Dh * T > 2**31
    a, v = make(B, H, Dh, T, left, right, torch.bfloat16, "cuda")
    out = ldsa.ldsa_local_attention(a, v, left, right)
    for b in (0, B // 2, B - 1):
        ref = ldsa_float64(a[b : b + 1], v[b : b + 1], left, right)
        assert rel_err(out[b : b + 1], ref) < 1e-2
    del a, v, out
    torch.cuda.empty_cache()


@needs_cuda
def test_cuda_large_batch_heads(ldsa):
    a, v = make(256, 16, 64, 97, 7, 7, torch.bfloat16, "cuda")
    assert rel_err(ldsa.ldsa_local_attention(a, v, 7, 7), ldsa_float64(a, v, 7, 7)) < 1e-2


@needs_cuda
def test_cuda_direct_launch_equals_the_registered_op(ldsa):
    """The no-grad fast path and the custom op call one launcher: bitwise-equal results."""
    a, v = make(4, 8, 64, 500, 14, 0, torch.bfloat16, "cuda")
    with torch.no_grad():
        fast = ldsa.ldsa_local_attention(a, v, 14, 0)
    assert torch.equal(fast, ldsa.op.ldsa_forward_op(a, v, 14, 0))
    a.requires_grad_()
    assert torch.equal(fast, ldsa.ldsa_local_attention(a, v, 14, 0).detach())


# ---- The paper's block, kernelized through the Hub layer ----


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode_name", ["TRAINING", "INFERENCE"])
def test_kernelized_ldsa_block_matches_host_module(ldsa, device, mode_name):
    from kernels import LayerRepository, Mode, kernelize, use_kernel_mapping
    from ldsa_block import LDSABlock, LDSAWindow

    torch.manual_seed(0)
    host = LDSABlock(d_model=64, n_head=4, left=7, right=7).to(device)
    model = copy.deepcopy(host)
    mapping = {
        "LDSAWindow": {
            device: LayerRepository("tessera/ldsa", layer_name="LDSAWindow", version=1, trust_remote_code=True)
        }
    }
    with use_kernel_mapping(mapping, inherit_mapping=False):
        kernelize(model, mode=getattr(Mode, mode_name), device=device, use_fallback=False)
    replaced = model.window.forward.__func__
    assert replaced is not LDSAWindow.forward and replaced.__module__.endswith(".layers")

    x = torch.randn(2, 50, 64, device=device)
    out, ref = model(x), host(x)
    assert rel_err(out, ref) < 1e-5
    go = torch.randn_like(out)
    out.backward(go)
    ref.backward(go)
    for (name, p), q in zip(model.named_parameters(), host.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-5, name
