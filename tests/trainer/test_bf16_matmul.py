"""The bf16 GEMM of trainer/model/bf16_matmul.py (fp32 GEMM of the bf16 operands, output rounded to bf16)
against references computed other ways, its use by the model, and the choice of path.

Tolerances against an exact (float64) product: bf16 rounding of an fp32 sum s of K products moves it by at
most 2^-8 |s| (half a bf16 ulp, 8 significand bits), and the fp32 sum itself is within
e = gamma_K * (|a| @ |b|), gamma_K = K u / (1 - K u), u = 2^-24, of the exact sum (Higham, Accuracy and
Stability of Numerical Algorithms, 3.5). So |ours - exact| <= 2^-8 |exact| + (1 + 2^-8) e, and two such
roundings (ours and torch's own bf16 kernel, which also sums in fp32) are within twice that of each other.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import trainer.model.bf16_matmul as bm
from infra.config.model import ModelConfig, MoEConfig
from trainer.loss import HeadLoss
from trainer.model import Transformer
from trainer.model.bf16_matmul import bf16_gemm, emulates_bf16_gemm, linear
from trainer.parallel.activation_checkpoint import apply_activation_checkpointing
from trainer.precision import cast_parameters

BF16 = torch.bfloat16
GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
         torch.ops.eightfold.bf16_gemm.default}


@pytest.fixture
def emulated(monkeypatch):
    """The emulated path whatever this machine's CPU has (it is correct everywhere)."""
    monkeypatch.setattr(bm, "emulates_bf16_gemm", lambda device: torch.device(device).type == "cpu")


@pytest.fixture
def native(monkeypatch):
    """torch's own bf16 GEMM, as on a CPU with bf16 units."""
    monkeypatch.setattr(bm, "emulates_bf16_gemm", lambda device: False)


def _operands(seed=0, M=(4, 33), K=96, N=80):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*M, K, generator=g) * 2).to(BF16)
    w = (torch.randn(N, K, generator=g) * 0.1).to(BF16)
    grad = torch.randn(*M, N, generator=g).to(BF16)
    return x, w, grad


def _bound(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact a @ b, |ours - exact| allowed) for 2-D a [M, K], b [K, N] (module docstring)."""
    K = a.shape[1]
    gamma = K * 2.0**-24 / (1 - K * 2.0**-24)
    exact = a.double() @ b.double()
    e = gamma * (a.double().abs() @ b.double().abs())
    return exact, 2.0**-8 * exact.abs() + (1 + 2.0**-8) * e


def _linear_and_grads(fn, x, w, grad):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = fn(x, w)
    y.backward(grad)
    return y.detach(), x.grad, w.grad


def test_linear_is_the_fp32_gemm_of_the_bf16_operands_rounded(emulated):
    x, w, grad = _operands()
    y, gx, gw = _linear_and_grads(linear, x, w, grad)
    x2, g2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
    # the definition, written out: upcast (exact), fp32 GEMM, round once to bf16
    assert torch.equal(y, (x2.float() @ w.float().t()).to(BF16).view_as(y))
    assert torch.equal(gx, (g2.float() @ w.float()).to(BF16).view_as(gx))
    assert torch.equal(gw, (x2.float().t() @ g2.float()).to(BF16).t())
    assert y.dtype == gx.dtype == gw.dtype == BF16
    # and against the exact product, within one rounding of an fp32 sum
    for got, a, b in ((y, x2, w.t()), (gx, g2, w), (gw.t(), x2.t(), g2)):
        exact, tol = _bound(a, b)
        assert ((got.reshape(exact.shape).double() - exact).abs() <= tol).all()


def test_linear_is_within_bf16_rounding_of_torchs_bf16_matmul(emulated):
    x, w, grad = _operands(seed=1, K=700)
    ours = _linear_and_grads(linear, x, w, grad)
    torchs = _linear_and_grads(F.linear, x, w, grad)  # torch's own bf16 kernel (oneDNN or its fallback)
    x2, g2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
    for got, ref, (a, b) in zip(ours, torchs, ((x2, w.t()), (g2, w), (g2.t(), x2))):
        exact, tol = _bound(a, b)
        diff = (got.double() - ref.double()).reshape(exact.shape).abs()
        assert (diff <= 2 * tol).all(), float((diff / tol).max())


def test_fp32_operands_under_autocast_get_autocasts_casts(emulated):
    """Post-training's fp32 weights under bf16 autocast: both operands rounded to bf16 as autocast does,
    the gradients rounded to bf16 by the GEMM and handed back in fp32 (autocast's cast backward)."""
    x, w, grad = _operands(seed=2)
    xf = (x.float() + 1e-3).requires_grad_()  # not bf16-representable: the cast matters
    wf = (w.float() * 1.001).requires_grad_()
    with torch.autocast("cpu", dtype=BF16):
        y = linear(xf, wf)
    y.backward(grad)
    ref_y, ref_gx, ref_gw = _linear_and_grads(linear, xf.detach().to(BF16), wf.detach().to(BF16), grad)
    assert y.dtype == BF16 and torch.equal(y, ref_y)
    assert xf.grad.dtype == wf.grad.dtype == torch.float32
    assert torch.equal(xf.grad, ref_gx.float()) and torch.equal(wf.grad, ref_gw.float())


def test_native_bf16_takes_torchs_path(native):
    x, w, _ = _operands(seed=3)
    assert _recorded_gemms(lambda: linear(x, w)) == [(torch.ops.aten.mm.default, BF16)]


def test_fp32_compute_is_untouched(emulated):
    x, w, _ = _operands(seed=3)
    y = linear(x.float(), w.float())
    assert torch.equal(y, F.linear(x.float(), w.float()))
    assert _recorded_gemms(lambda: linear(x.float(), w.float())) == [(torch.ops.aten.mm.default, torch.float32)]


def test_the_choice_of_path():
    # torch's own criterion (Matmul.cpp use_mkldnn_bf16_matmul): oneDNN on and a oneDNN bf16 path here
    assert emulates_bf16_gemm("cpu") == (not (torch.backends.mkldnn.enabled and bm._cpu_has_bf16_gemm()))
    with torch.backends.mkldnn.flags(enabled=False):  # torch would take its generic kernel: emulated
        assert emulates_bf16_gemm("cpu")
    assert not emulates_bf16_gemm("cuda") and not emulates_bf16_gemm(torch.device("cuda", 0))
    with pytest.raises(ValueError, match="bf16 operands"):
        bf16_gemm(torch.ones(2, 2), torch.ones(2, 2))


class _GemmRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in GEMMS:
            self.calls.append((func, args[0].dtype))
        return func(*args, **(kwargs or {}))


def _recorded_gemms(fn) -> list:
    with _GemmRecorder() as rec:
        fn()
    return rec.calls


def _tiny(moe: bool = False) -> Transformer:
    cfg = ModelConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16,
                      z_loss=1e-4, moe=MoEConfig(num_experts=4, top_k=2, every=2, shared_expert=True) if moe else None)
    torch.manual_seed(0)
    return cast_parameters(Transformer(cfg), BF16)


def _step(model, tokens, targets, fused=True):
    with torch.autocast("cpu", dtype=BF16):
        loss = model(tokens, head=HeadLoss(targets, model.cfg.z_loss)) if fused else \
            F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten(), reduction="sum")
    total = loss.total if fused else loss
    total.backward()
    return total.detach()


@pytest.mark.parametrize("moe", [False, True])
def test_every_bf16_gemm_of_the_model_is_the_emulated_one(emulated, moe):
    """Attention projections, MLP or MoE (router, experts, shared expert), fused LM head: forward and
    backward; the only fp32 GEMMs left are none (CPU attention runs in sdpa, not a GEMM op)."""
    model = _tiny(moe)
    tokens, targets = torch.randint(0, 96, (2, 16)), torch.randint(0, 96, (2, 16))
    calls = _recorded_gemms(lambda: _step(model, tokens, targets))
    assert calls and {c for c in calls} == {(torch.ops.eightfold.bf16_gemm.default, BF16)}
    linears = sum(1 for m in model.modules() if isinstance(m, bm.Linear)) - 1  # the head is fused: 3 GEMMs, 0 saved
    assert len(calls) == 3 * linears + 3


def test_model_saves_what_torchs_bf16_path_saves(monkeypatch):
    """Nothing new held for backward, in bytes per dtype: the emulated path keeps its bf16 operands, as
    torch's bf16 linear does (its fp32 operands are transient)."""
    model = _tiny()
    tokens, targets = torch.randint(0, 96, (2, 16)), torch.randint(0, 96, (2, 16))

    def saved_bytes(emulate: bool) -> dict:
        monkeypatch.setattr(bm, "emulates_bf16_gemm", lambda device: emulate)
        held: dict = {}

        def pack(t):
            held[t.dtype] = held.get(t.dtype, 0) + t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=BF16):
                model(tokens, head=HeadLoss(targets, model.cfg.z_loss)).total.backward()
        model.zero_grad(set_to_none=True)
        return held

    assert saved_bytes(True) == saved_bytes(False)


def test_model_loss_and_grads_track_torchs_bf16_path(monkeypatch):
    """The same model step on both paths: each GEMM is within bf16 rounding of the other's (tests above),
    so the two bf16 steps are closer to each other than to the step in fp32 (bf16's own distance)."""
    model = _tiny()
    fp32 = cast_parameters(_tiny(), torch.float32)
    fp32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    tokens, targets = torch.randint(0, 96, (2, 16)), torch.randint(0, 96, (2, 16))

    def run(net, emulate):
        monkeypatch.setattr(bm, "emulates_bf16_gemm", lambda device: emulate)
        loss = _step(net, tokens, targets, fused=False)
        return loss, {n: p.grad.float() for n, p in net.named_parameters()}

    l_emu, g_emu = run(model, True)
    model.zero_grad(set_to_none=True)
    l_torch, g_torch = run(model, False)
    with torch.autocast("cpu", enabled=False):
        l_fp32, g_fp32 = run(fp32, False)
    assert abs(float(l_emu - l_torch)) <= max(abs(float(l_torch - l_fp32)), 2.0**-8 * abs(float(l_torch)))
    for name, g in g_torch.items():
        assert (g_emu[name] - g).norm() <= max((g - g_fp32[name]).norm(), 2.0**-8 * g.norm()), name


@pytest.mark.parametrize("kept", [True, False])
def test_selective_checkpointing_keeps_the_emulated_gemms_output(emulated, monkeypatch, kept):
    """Selective AC saves GEMM outputs: the emulated GEMM is one op, so its bf16 output is what is kept,
    and backward recomputes no GEMM (only the 2 gradient GEMMs per linear run), with the same gradients.
    Control: left out of the saved ops, each block GEMM is recomputed (3 per linear)."""
    import trainer.parallel.activation_checkpoint as ac

    if not kept:
        monkeypatch.setattr(ac, "_SAVE", ac._SAVE - {torch.ops.eightfold.bf16_gemm.default})
    tokens, targets = torch.randint(0, 96, (2, 16)), torch.randint(0, 96, (2, 16))
    plain = _tiny()
    _step(plain, tokens, targets)
    checkpointed = _tiny()
    apply_activation_checkpointing(checkpointed, "selective")
    with torch.autocast("cpu", dtype=BF16):
        loss = checkpointed(tokens, head=HeadLoss(targets, checkpointed.cfg.z_loss)).total
    calls = _recorded_gemms(loss.backward)
    block_linears = sum(1 for n, m in checkpointed.named_modules() if isinstance(m, bm.Linear) and n.startswith("layers"))
    assert len(calls) == (2 if kept else 3) * block_linears
    for (name, p), q in zip(checkpointed.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_compiled_blocks_run_the_emulated_gemm(emulated):
    """torch.compile per block (trainer/parallel/compile.py) traces the op like any other: the same loss
    as eager within bf16 noise (closer than the step in fp32 is)."""
    from trainer.parallel.compile import apply_compile

    tokens, targets = torch.randint(0, 96, (2, 16)), torch.randint(0, 96, (2, 16))
    eager, compiled = _tiny(), _tiny()
    apply_compile(compiled)
    fp32 = cast_parameters(_tiny(), torch.float32)
    l_eager, l_compiled = _step(eager, tokens, targets), _step(compiled, tokens, targets)
    l_fp32 = fp32(tokens, head=HeadLoss(targets, fp32.cfg.z_loss)).total.detach()
    assert abs(float(l_compiled - l_eager)) <= max(abs(float(l_eager - l_fp32)), 2.0**-8 * abs(float(l_eager)))
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        assert p.grad is not None and p.grad.dtype == BF16, name
