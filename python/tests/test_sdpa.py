"""Attention as a function: clmha.torch.scaled_dot_product_attention and
clmha.numpy.scaled_dot_product_attention(_backward) against a float64 reference written out with
PyTorch 1.13 (softmax(q kᵀ·scale + mask)·v; bool masks by masked_fill, is_causal by
torch.ones(L, S).tril(), GQA by repeat_interleave) and its autograd; against PyTorch's own
F.scaled_dot_product_attention where the installed torch has it (2.x; skipped on 1.13) and
1.13's prototype F._scaled_dot_product_attention where it has that."""

import inspect
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import clmha  # noqa: E402
import clmha._sdpa  # noqa: E402
import clmha.numpy as cn  # noqa: E402
import clmha.torch as ct  # noqa: E402
from helpers import record, sdpa_ref as ref, sdpa_ref_np as np_ref  # noqa: E402

TOL = 1e-5  # max abs error of float32 results on unit-scale inputs, forward and gradients
N, H, L, S, D = 2, 4, 5, 7, 8


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(2024)


def rand(*shape, grad=False):
    t = torch.randn(shape)
    return t.requires_grad_() if grad else t


def bool_mask(*shape):
    m = torch.rand(*shape) < 0.6
    m[..., 0] = True  # every query row keeps a key (a fully masked row is tested on its own)
    return m


def err(a, b):
    return (a.detach().double() - b.detach().double()).abs().max().item()


def check_grads(name, out, inputs, g=None, nonzero=True, **ref_kw):
    """Backward of clmha's ``out`` and of the float64 reference on copies of ``inputs`` (a dict
    of the ref()'s tensor arguments): every gradient within TOL (times its largest value where
    that is above 1); returns the largest error.
    ``nonzero``: the reference's gradients of query, key, value and of a mask that varies along
    the keys are not all zero (so that the comparison can fail)."""
    g = torch.randn(out.shape, dtype=torch.float64) if g is None else g
    d = {n: t if t.dtype == torch.bool else t.detach().double().requires_grad_(t.requires_grad)
         for n, t in inputs.items()}
    r = ref(d["q"], d["k"], d["v"], d.get("attn_mask"), **ref_kw)
    assert record(f"sdpa {name} forward", err(out, r)) <= TOL
    out.backward(g.to(out.dtype))
    r.backward(g)
    worst = 0.0
    for n, t in inputs.items():
        if t.requires_grad:
            assert t.grad is not None, n
            assert t.grad.shape == t.shape and t.grad.dtype == t.dtype, n
            if nonzero and not (n == "attn_mask" and (t.dim() == 0 or t.size(-1) == 1)):
                # the check can fail (a mask constant along each row has a zero gradient)
                assert d[n].grad.abs().max() > 0, n
            e = record(f"sdpa {name} grad {n}", err(t.grad, d[n].grad))
            # TOL on unit-scale gradients; relative to the largest where they are larger (a
            # scale of 2 makes them 16)
            assert e <= TOL * max(1.0, d[n].grad.abs().max().item()), (n, e)
            worst = max(worst, e)
    return worst


# ---- forward -----------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["auto", "fused", "unfused"])
@pytest.mark.parametrize("lengths", [(L, S), (S, L), (6, 6)])
def test_forward_4d(ctx, impl, lengths):
    l_len, s_len = lengths
    q, k, v = rand(N, H, l_len, D), rand(N, H, s_len, D), rand(N, H, s_len, D)
    out = ct.scaled_dot_product_attention(q, k, v, impl=impl, context=ctx)
    assert out.shape == (N, H, l_len, D) and out.dtype == torch.float32
    assert not out.requires_grad
    r = ref(q.double(), k.double(), v.double())
    assert record("sdpa forward 4-D", err(out, r)) <= TOL
    # the reference differs from a wrong answer: another scale moves it by far more than TOL
    assert err(ref(q.double(), k.double(), v.double(), scale=0.5), r) > 100 * TOL


def test_forward_3d_and_2d(ctx):
    q, k, v = rand(H, L, D), rand(H, S, D), rand(H, S, D)
    out = ct.scaled_dot_product_attention(q, k, v, context=ctx)
    assert out.shape == (H, L, D)
    assert record("sdpa forward 3-D", err(out, ref(q.double(), k.double(), v.double()))) <= TOL
    out2 = ct.scaled_dot_product_attention(q[0], k[0], v[0], context=ctx)
    assert out2.shape == (L, D)
    assert err(out2, ref(q[0].double(), k[0].double(), v[0].double())) <= TOL


def test_forward_5d_leading_dims(ctx):
    q, k, v = rand(3, N, H, L, D), rand(3, N, H, S, D), rand(3, N, H, S, D)
    m = rand(3, 1, H, L, S)
    out = ct.scaled_dot_product_attention(q, k, v, m, context=ctx)
    assert out.shape == (3, N, H, L, D)
    r = ref(q.double(), k.double(), v.double(), m.double())
    assert record("sdpa forward 5-D", err(out, r)) <= TOL


def test_transposed_inputs(ctx):
    """(N, L, H, D) tensors transposed to (N, H, L, D) views (not contiguous): copied."""
    q = rand(N, L, H, D).transpose(1, 2)
    k, v = rand(N, S, H, D).transpose(1, 2), rand(N, S, H, D).transpose(1, 2)
    assert not q.is_contiguous()
    out = ct.scaled_dot_product_attention(q, k, v, context=ctx)
    assert err(out, ref(q.double(), k.double(), v.double())) <= TOL


MASK_SHAPES = [(L, S), (N, 1, L, S), (N, H, L, S), (N, 1, 1, S), (1, H, L, S), (H, L, S),
               (S,), (1, S), (H, 1, S), (N, H, 1, S), (1, 1, 1, S), (1, H, 1, S),
               # broadcast along the keys: the C function reads it expanded to S
               (N, 1, L, 1), ()]


@pytest.mark.parametrize("shape,c_shape", [
    ((L, S), (1, 1, L, S)), ((N, 1, L, S), (N, 1, L, S)), ((1, H, L, S), (1, H, L, S)),
    ((H, L, S), (1, H, L, S)), ((N, H, L, S), (N, H, L, S)), ((N, 1, 1, S), (N, 1, 1, S)),
    ((S,), (1, 1, 1, S)), ((1, 1, S), (1, 1, 1, S)), ((N, 1, L, 1), (N, 1, L, S)),
    ((H, 1, S), (1, H, 1, S)), ((N, H, 1, S), (N, H, 1, S)), ((1, H, 1, S), (1, H, 1, S)),
    ((), (1, 1, 1, S))])
def test_mask_forms(ctx, shape, c_shape):
    """What the C call reads: every broadcast along N, H and L as it is (a mask of size 1 along
    any of them), only a size-1 last dimension expanded to S."""
    q, k = np.zeros((N, H, L, D), np.float32), np.zeros((N, H, S, D), np.float32)
    call = clmha._sdpa.Call(q, k, k, np.ones(shape, bool), context=ctx)
    assert call.mask.size == int(np.prod(c_shape))
    t = call.c.attn_mask.tensor
    assert tuple(int(t.shape[i]) for i in range(t.ndim))[-len(c_shape):] == c_shape


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
def test_bool_mask(ctx, shape):
    q, k, v = rand(N, H, L, D), rand(N, H, S, D), rand(N, H, S, D)
    m = bool_mask(*shape) if shape else torch.tensor(True)
    out = ct.scaled_dot_product_attention(q, k, v, m, context=ctx)
    r = ref(q.double(), k.double(), v.double(), m)
    assert record("sdpa bool mask", err(out, r)) <= TOL
    if shape and not m.all():
        # the mask matters: without it the result differs
        assert err(ref(q.double(), k.double(), v.double()), r) > 100 * TOL


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
def test_float_mask_and_its_gradient(ctx, shape):
    q, k, v = rand(N, H, L, D, grad=True), rand(N, H, S, D, grad=True), rand(N, H, S, D,
                                                                              grad=True)
    m = rand(*shape, grad=True)
    out = ct.scaled_dot_product_attention(q, k, v, m, context=ctx)
    assert out.requires_grad
    check_grads("float mask", out, {"q": q, "k": k, "v": v, "attn_mask": m})


@pytest.mark.parametrize("shape", [(N, H, 1, S), (1, 1, 1, S)], ids=["NxHx1xS", "1x1x1xS"])
def test_size_one_l_masks(ctx, shape):
    """A mask with a size-1 L (one row of keys per batch item and head, or one for every query
    row of every batch item) is read by the C function in its own shape, not expanded; the
    output and the gradients of the query and of the mask (summed over what it is broadcast
    along) against the float64 formula, and through clmha.numpy's backward too."""
    q, k, v = rand(N, H, L, D, grad=True), rand(N, H, S, D), rand(N, H, S, D)
    m = rand(*shape, grad=True)
    call = clmha._sdpa.Call(q.detach().numpy(), k.numpy(), v.numpy(), m.detach().numpy(),
                            context=ctx)
    assert call.mask.shape == shape  # the C call reads the mask as it is
    out = ct.scaled_dot_product_attention(q, k, v, m, context=ctx)
    g = torch.randn(N, H, L, D, dtype=torch.float64)
    check_grads(f"mask {shape}", out, {"q": q, "k": k, "v": v, "attn_mask": m}, g=g)
    # The mask's gradient varies along its own dimensions (it is not one sum copied around).
    assert m.grad.std() > 0
    # clmha.numpy: the same gradients from the host backward.
    got = cn.scaled_dot_product_attention_backward(
        g.float().numpy(), q.detach().numpy(), k.numpy(), v.numpy(), m.detach().numpy(),
        context=ctx)
    assert err(torch.from_numpy(got[0]), q.grad) <= TOL
    assert err(torch.from_numpy(got[3]), m.grad) <= TOL


def test_float_mask_with_minus_inf(ctx):
    q, k, v = rand(N, H, L, D), rand(N, H, S, D), rand(N, H, S, D)
    m = torch.where(bool_mask(N, 1, L, S), rand(N, 1, L, S), torch.tensor(float("-inf")))
    out = ct.scaled_dot_product_attention(q, k, v, m, context=ctx)
    assert err(out, ref(q.double(), k.double(), v.double(), m.double())) <= TOL


def test_expanded_masks(ctx):
    """Masks made by expand() (stride 0): a bool one is read in its small form; a float one that
    requires grad gets the gradient of every expanded element, summed by expand's backward."""
    q, k, v = rand(N, H, L, D, grad=True), rand(N, H, S, D), rand(N, H, S, D)
    mb = bool_mask(L, S).expand(N, H, L, S)
    out = ct.scaled_dot_product_attention(q, k, v, mb, context=ctx)
    assert err(out, ref(q.double(), k.double(), v.double(), mb)) <= TOL
    base = rand(N, 1, L, S, grad=True)
    out = ct.scaled_dot_product_attention(q, k, v, base.expand(N, H, L, S), context=ctx)
    q64, b64 = (t.detach().double().requires_grad_() for t in (q, base))
    r = ref(q64, k.double(), v.double(), b64.expand(N, H, L, S))
    assert err(out, r) <= TOL
    g = torch.randn(N, H, L, D, dtype=torch.float64)
    out.backward(g.float())
    r.backward(g)
    assert record("sdpa expanded mask grad", err(base.grad, b64.grad)) <= TOL
    assert err(q.grad, q64.grad) <= TOL
    # the base's gradient is the head sum of the expanded mask's, not one head's
    assert err(b64.grad, b64.grad / H) > 100 * TOL


@pytest.mark.parametrize("lengths", [(L, S), (S, L)])
def test_is_causal(ctx, lengths):
    l_len, s_len = lengths
    q, k, v = (rand(N, H, l_len, D, grad=True), rand(N, H, s_len, D, grad=True),
               rand(N, H, s_len, D, grad=True))
    out = ct.scaled_dot_product_attention(q, k, v, is_causal=True, context=ctx)
    check_grads("is_causal", out, {"q": q, "k": k, "v": v}, is_causal=True)
    # top-left: the first query row sees only key 0, so its output is value row 0
    assert err(out[:, :, 0], v[:, :, 0]) <= TOL


@pytest.mark.parametrize("scale", [0.3, -0.7, 2.0, 0.0])
def test_scale(ctx, scale):
    q, k, v = rand(N, H, L, D, grad=True), rand(N, H, S, D, grad=True), rand(N, H, S, D,
                                                                              grad=True)
    out = ct.scaled_dot_product_attention(q, k, v, scale=scale, context=ctx)
    check_grads("scale", out, {"q": q, "k": k, "v": v}, nonzero=scale != 0.0, scale=scale)
    if scale == 0.0:  # every score 0: the mean of the values, and no gradient for q and k
        assert err(out, v.mean(dim=-2, keepdim=True).expand_as(out)) <= TOL
        assert q.grad.abs().max() <= TOL and k.grad.abs().max() <= TOL
        assert v.grad.abs().max() > 0


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_gqa(ctx, kv_heads):
    q = rand(N, H, L, D, grad=True)
    k, v = rand(N, kv_heads, S, D, grad=True), rand(N, kv_heads, S, D, grad=True)
    m = rand(N, 1, L, S, grad=True)
    out = ct.scaled_dot_product_attention(q, k, v, m, enable_gqa=True, context=ctx)
    assert out.shape == (N, H, L, D)
    check_grads("gqa", out, {"q": q, "k": k, "v": v, "attn_mask": m}, enable_gqa=True)


def test_gqa_causal_3d(ctx):
    q, k, v = rand(H, L, D, grad=True), rand(2, S, D, grad=True), rand(2, S, D, grad=True)
    out = ct.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                          context=ctx)
    check_grads("gqa 3-D", out, {"q": q, "k": k, "v": v}, is_causal=True, enable_gqa=True)


# ---- gradients ---------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["auto", "unfused"])
def test_gradients_4d(ctx, impl):
    q, k, v = rand(N, H, L, D, grad=True), rand(N, H, S, D, grad=True), rand(N, H, S, D,
                                                                              grad=True)
    out = ct.scaled_dot_product_attention(q, k, v, impl=impl, context=ctx)
    check_grads("4-D", out, {"q": q, "k": k, "v": v})


@pytest.mark.parametrize("dv", [3, 12])
def test_value_width_differs(ctx, dv):
    """D_v != D (the C library pads to max(D, D_v)): output and gradients."""
    q, k = rand(N, H, L, D, grad=True), rand(N, H, S, D, grad=True)
    v = rand(N, H, S, dv, grad=True)
    out = ct.scaled_dot_product_attention(q, k, v, is_causal=True, context=ctx)
    assert out.shape == (N, H, L, dv)
    check_grads("D_v", out, {"q": q, "k": k, "v": v}, is_causal=True)


def test_gradients_3d_bool_mask_some_inputs(ctx):
    """Only the inputs that require grad get one; a bool mask gets none."""
    q, k, v = rand(H, L, D), rand(H, S, D, grad=True), rand(H, S, D)
    m = bool_mask(H, L, S)
    out = ct.scaled_dot_product_attention(q, k, v, m, context=ctx)
    check_grads("3-D", out, {"q": q, "k": k, "v": v, "attn_mask": m})
    assert q.grad is None and v.grad is None


@pytest.mark.filterwarnings("ignore:Input #.* is not a double precision")
def test_gradients_against_finite_differences(ctx):
    """torch.autograd.gradcheck's own comparison, in float32 with a coarse step: clmha's
    backward against finite differences of clmha's forward."""
    q, k, v = (rand(1, 2, 3, 4, grad=True), rand(1, 2, 5, 4, grad=True),
               rand(1, 2, 5, 4, grad=True))
    m = rand(1, 1, 3, 5, grad=True)
    assert torch.autograd.gradcheck(
        lambda *t: ct.scaled_dot_product_attention(*t, context=ctx), (q, k, v, m),
        eps=1e-2, atol=2e-3, rtol=2e-2)


def test_fully_masked_row(ctx):
    """A query row whose every key is masked: zeros and zero gradients (PyTorch gives NaN)."""
    q, k, v = rand(N, H, L, D, grad=True), rand(N, H, S, D, grad=True), rand(N, H, S, D)
    m = bool_mask(N, 1, L, S)
    m[1, 0, 2] = False
    out = ct.scaled_dot_product_attention(q, k, v, m, context=ctx)
    assert torch.equal(out[1, :, 2], torch.zeros(H, D))
    other = torch.ones(N, H, L, dtype=torch.bool)
    other[1, :, 2] = False
    assert err(out[other], ref(q.double(), k.double(), v.double(), m)[other]) <= TOL
    out.sum().backward()
    assert torch.equal(q.grad[1, :, 2], torch.zeros(H, D))
    assert torch.isfinite(k.grad).all()


def test_no_grad_saves_nothing(ctx, monkeypatch):
    saves = []
    real = ct._sdpa_save
    monkeypatch.setattr(ct, "_sdpa_save", lambda c, *t: saves.append(1) or real(c, *t))
    q, k, v = rand(N, H, L, D, grad=True), rand(N, H, S, D), rand(N, H, S, D)
    with torch.no_grad():
        out = ct.scaled_dot_product_attention(q, k, v, context=ctx)
    assert saves == [] and out.grad_fn is None and not out.requires_grad
    out = ct.scaled_dot_product_attention(q.detach(), k, v, context=ctx)  # nothing needs grad
    assert saves == [] and out.grad_fn is None
    out = ct.scaled_dot_product_attention(q, k, v, context=ctx)
    assert saves == [1] and out.grad_fn is not None
    out.sum().backward()
    assert q.grad is not None and q.grad.abs().max() > 0


def test_inplace_change_after_forward_is_caught(ctx):
    """The saved inputs are version-checked: changing one in place before backward raises."""
    q, k, v = rand(N, H, L, D, grad=True), rand(N, H, S, D), rand(N, H, S, D)
    out = ct.scaled_dot_product_attention(q, k, v, context=ctx)
    k.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


# ---- dtypes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_inputs(ctx, dtype):
    q, k, v = (rand(N, H, L, D).to(dtype).requires_grad_(), rand(N, H, S, D).to(dtype),
               rand(N, H, S, D).to(dtype))
    m = rand(N, 1, L, S).to(dtype)
    out = ct.scaled_dot_product_attention(q, k, v, m, context=ctx)
    assert out.dtype == dtype
    r = ref(q.double(), k.double(), v.double(), m.double())
    tol = 4e-3 if dtype == torch.float16 else 3e-2  # one rounding of the result
    assert record(f"sdpa {dtype} forward", err(out, r)) <= tol
    out.float().sum().backward()
    assert q.grad.dtype == dtype and q.grad.abs().max() > 0


# ---- dropout -----------------------------------------------------------------------------------

def _dropped_weights(ctx, q, k, p, seed, **kw):
    """The weights after dropout of a call: with value = identity (S × S, so D must be S) the
    output is the weights. ``seed``: torch's, from which the call draws its Philox seed."""
    eye = torch.eye(k.size(-2)).expand(*k.shape[:-1], k.size(-2))
    torch.manual_seed(seed)
    return ct.scaled_dot_product_attention(q, k, eye, dropout_p=p, context=ctx, **kw)


def test_dropout(ctx):
    p, n, h, l_len, s_len = 0.3, 2, 2, 6, 8
    q, k = rand(n, h, l_len, s_len, grad=True), rand(n, h, s_len, s_len, grad=True)
    v = rand(n, h, s_len, s_len, grad=True)
    w = _dropped_weights(ctx, q.detach(), k.detach(), p, 11)
    keep = w != 0
    probs = torch.softmax(q.double() @ k.double().transpose(-2, -1) / math.sqrt(s_len), -1)
    # kept weights are the probabilities scaled by 1/(1 - p); about p of them are dropped
    assert err(w[keep], (probs / (1 - p))[keep]) <= TOL
    assert 0.15 < 1 - keep.double().mean().item() < 0.45
    # the same torch seed gives the same dropout, another seed another one
    assert torch.equal(w, _dropped_weights(ctx, q.detach(), k.detach(), p, 11))
    assert not torch.equal(keep, _dropped_weights(ctx, q.detach(), k.detach(), p, 12) != 0)
    # forward and backward with those kept weights, against the formula with them
    torch.manual_seed(11)
    out = ct.scaled_dot_product_attention(q, k, v, dropout_p=p, context=ctx)
    check_grads("dropout", out, {"q": q, "k": k, "v": v}, keep=keep, dropout_p=p)


def test_dropout_zero_draws_nothing(ctx):
    """dropout_p 0 draws nothing from torch's generator and drops nothing; dropout_p > 0 draws
    the call's seed from it."""
    q, k, v = rand(N, H, L, D), rand(N, H, S, D), rand(N, H, S, D)
    torch.manual_seed(3)
    expected = torch.rand(1).item()
    torch.manual_seed(3)
    out = ct.scaled_dot_product_attention(q, k, v, dropout_p=0.0, context=ctx)
    assert torch.rand(1).item() == expected
    assert err(out, ref(q.double(), k.double(), v.double())) <= TOL
    torch.manual_seed(3)
    ct.scaled_dot_product_attention(q, k, v, dropout_p=0.1, context=ctx)
    assert torch.rand(1).item() != expected


# ---- errors ------------------------------------------------------------------------------------

def test_errors(ctx):
    q, k, v = rand(N, H, L, D), rand(N, H, S, D), rand(N, H, S, D)
    f = ct.scaled_dot_product_attention
    with pytest.raises(clmha.Error, match=r"D \(4\) must equal") as e:
        f(q, rand(N, H, S, 4), rand(N, H, S, 4), context=ctx)
    assert e.value.status_name == "SHAPE_MISMATCH"
    with pytest.raises(clmha.Error, match="attn_mask and is_causal are both set") as e:
        f(q, k, v, bool_mask(L, S), is_causal=True, context=ctx)
    assert e.value.status_name == "INVALID_ARGUMENT"
    with pytest.raises(clmha.Error, match="set enable_gqa"):
        f(q, k[:, :2], v[:, :2], context=ctx)
    with pytest.raises(clmha.Error, match="must divide"):
        f(q, k[:, :3], v[:, :3], enable_gqa=True, context=ctx)
    with pytest.raises(clmha.Error, match=r"dropout_p \(1\) must be in \[0, 1\)"):
        f(q, k, v, dropout_p=1.0, context=ctx)
    with pytest.raises(clmha.Error, match="scale is inf"):
        f(q, k, v, scale=float("inf"), context=ctx)
    with pytest.raises(clmha.Error, match="every size must be positive"):
        f(q[:, :, :0], k, v, context=ctx)
    with pytest.raises(clmha.Error, match="N, H_kv and S"):
        f(q, k, rand(N, H, S + 1, D), context=ctx)
    with pytest.raises(ValueError, match="does not broadcast"):
        f(q, k, v, bool_mask(L + 1, S), context=ctx)
    with pytest.raises(ValueError, match="does not broadcast"):
        f(q, k, v, bool_mask(3, N, H, L, S), context=ctx)
    with pytest.raises(ValueError, match="same number of dimensions"):
        f(q, k[0], v[0], context=ctx)
    with pytest.raises(ValueError, match="leading dimensions"):
        f(rand(2, 3, H, L, D), rand(3, 2, H, S, D), rand(3, 2, H, S, D), context=ctx)
    with pytest.raises(ValueError, match="impl"):
        f(q, k, v, impl="flash", context=ctx)


def test_dtype_errors(ctx):
    q, k, v = rand(N, H, L, D), rand(N, H, S, D), rand(N, H, S, D)
    f = ct.scaled_dot_product_attention
    with pytest.raises(TypeError, match="torch.int32"):
        f(q.int(), k.int(), v.int(), context=ctx)
    with pytest.raises(TypeError, match="one dtype"):
        f(q, k.half(), v, context=ctx)
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        f(q, k, v, torch.ones(L, S, dtype=torch.int64), context=ctx)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        f(q.numpy(), k, v, context=ctx)
    with pytest.raises(TypeError, match="dropout_p must be a number"):
        f(q, k, v, dropout_p="0.1", context=ctx)
    with pytest.raises(TypeError, match="context must be a clmha.Context"):
        f(q, k, v, context="cpu")
    with pytest.raises(TypeError):
        f(q, k, v, None, 0.0, False, None, False, ctx)  # the extras are keyword-only


def test_signature_is_torchs():
    names = list(inspect.signature(ct.scaled_dot_product_attention).parameters)
    assert names == ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                     "enable_gqa", "impl", "context", "kv_cache", "kv_append", "window",
                     "softcap", "alibi", "alibi_slopes", "sinks", "score_mod", "mask_mod",
                     "mod_params", "seq_lens", "kv_seq_lens"]
    params = inspect.signature(ct.scaled_dot_product_attention).parameters
    assert [params[n].default for n in names[3:8]] == [None, 0.0, False, None, False]
    for n in names[8:]:
        assert params[n].kind == inspect.Parameter.KEYWORD_ONLY
    torch_sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
    if torch_sdpa is not None:
        try:
            theirs = list(inspect.signature(torch_sdpa).parameters)
        except (TypeError, ValueError):  # a builtin without a signature
            return
        assert names[:len(theirs)] == theirs


def test_default_context(has_device):
    q, k, v = rand(N, H, L, D), rand(N, H, S, D), rand(N, H, S, D)
    out = ct.scaled_dot_product_attention(q, k, v)
    assert err(out, ref(q.double(), k.double(), v.double())) <= TOL


# ---- PyTorch's own function (torch 2.x) ----------------------------------------------------------

def _torch_sdpa():
    f = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
    if f is None:
        pytest.skip(f"torch {torch.__version__} has no F.scaled_dot_product_attention")
    return f


@pytest.mark.parametrize("case", ["plain", "bool", "float", "causal", "scale"])
def test_against_torch_1_13_prototype(ctx, case):
    """torch 1.13's prototype F._scaled_dot_product_attention (PyTorch's own code: default
    scale only, so a given scale goes into q; it returns the weights too), forward and
    gradients in float64; skipped where torch has no such function."""
    f = getattr(torch.nn.functional, "_scaled_dot_product_attention", None)
    if f is None:
        pytest.skip(f"torch {torch.__version__} has no F._scaled_dot_product_attention")
    q, k, v = rand(N, H, L, D, grad=True), rand(N, H, S, D, grad=True), rand(N, H, S, D,
                                                                              grad=True)
    mask = {"bool": bool_mask(N, H, L, S), "float": rand(N, H, L, S, grad=True)}.get(case)
    kw = {"is_causal": True} if case == "causal" else {"scale": 0.3} if case == "scale" else {}
    out = ct.scaled_dot_product_attention(q, k, v, mask, context=ctx, **kw)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    m64 = mask
    if mask is not None and mask.is_floating_point():
        m64 = mask.detach().double().requires_grad_()
    q64 = leaves[0] * (0.3 * math.sqrt(D)) if case == "scale" else leaves[0]
    theirs, _ = f(q64, leaves[1], leaves[2], m64, 0.0, True, case == "causal")
    assert record("sdpa vs torch 1.13 prototype", err(out, theirs)) <= TOL
    g = torch.randn(out.shape, dtype=torch.float64)
    out.backward(g.float())
    theirs.backward(g)
    for t, t64 in zip((q, k, v), leaves):
        assert record("sdpa vs torch 1.13 prototype grad", err(t.grad, t64.grad)) <= TOL
    if case == "float":
        assert err(mask.grad, m64.grad) <= TOL


@pytest.mark.parametrize("case", ["plain", "bool", "float", "causal", "scale", "gqa"])
def test_against_torch_sdpa(ctx, case):
    f = _torch_sdpa()
    kv = 2 if case == "gqa" else H
    q, k, v = rand(N, H, L, D, grad=True), rand(N, kv, S, D, grad=True), rand(N, kv, S, D,
                                                                               grad=True)
    kw = {}
    if case == "bool":
        kw["attn_mask"] = bool_mask(N, 1, L, S)
    elif case == "float":
        kw["attn_mask"] = rand(N, H, L, S, grad=True)
    elif case == "causal":
        kw["is_causal"] = True
    elif case == "scale":
        kw["scale"] = 0.25
    elif case == "gqa":
        kw["enable_gqa"] = True
        try:
            f(q.detach(), k.detach(), v.detach(), enable_gqa=True)
        except TypeError:
            pytest.skip("this torch has no enable_gqa (2.5 and later)")
    d = {"q": q, "k": k, "v": v}
    d64 = {n: t.detach().double().requires_grad_() for n, t in d.items()}
    m64 = kw.get("attn_mask")
    kw64 = dict(kw)
    if m64 is not None and m64.is_floating_point():
        m64 = m64.detach().double().requires_grad_()
        kw64["attn_mask"] = m64
    out = ct.scaled_dot_product_attention(q, k, v, context=ctx, **kw)
    theirs = f(d64["q"], d64["k"], d64["v"], **kw64)
    assert record("sdpa vs torch F.sdpa", err(out, theirs)) <= TOL
    g = torch.randn(out.shape, dtype=torch.float64)
    out.backward(g.float())
    theirs.backward(g)
    for n in d:
        assert err(d[n].grad, d64[n].grad) <= TOL, n
    if case == "float":
        assert err(kw["attn_mask"].grad, m64.grad) <= TOL


# ---- clmha.numpy -------------------------------------------------------------------------------

def np_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.fixture
def arrays():
    g = np.random.default_rng(5)
    r = lambda *s: g.standard_normal(s).astype(np.float32)  # noqa: E731
    return r(N, H, L, D), r(N, H, S, D), r(N, H, S, D), g


@pytest.mark.parametrize("case", ["plain", "causal", "scale", "bool", "float", "gqa", "3-D"])
def test_numpy_forward(ctx, arrays, case):
    q, k, v, g = arrays
    kw, rkw = {}, {}
    if case == "causal":
        kw = rkw = {"is_causal": True}
    elif case == "scale":
        kw = rkw = {"scale": 0.2}
    elif case == "bool":
        kw = rkw = {"attn_mask": bool_mask(N, 1, 1, S).numpy()}
    elif case == "float":
        kw = rkw = {"attn_mask": g.standard_normal((H, L, S))}  # float64 mask: read as float32
    elif case == "gqa":
        k, v = k[:, :1], v[:, :1]
        kw = rkw = {"enable_gqa": True}
    elif case == "3-D":
        q, k, v = q[0], k[0], v[0]
    out = cn.scaled_dot_product_attention(q, k, v, context=ctx, **kw)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    assert out.shape == q.shape
    assert record("sdpa numpy forward", np_err(out, np_ref(q, k, v, **rkw))) <= TOL


def test_numpy_lse(ctx, arrays):
    q, k, v, _ = arrays
    m = bool_mask(N, 1, L, S).numpy()
    out, lse = cn.scaled_dot_product_attention(q, k, v, m, return_lse=True, context=ctx)
    assert lse.shape == (N, H, L) and lse.dtype == np.float32
    scores = torch.from_numpy(q).double() @ torch.from_numpy(k).double().transpose(-2, -1)
    scores = (scores / math.sqrt(D)).masked_fill(~torch.from_numpy(m), float("-inf"))
    assert record("sdpa numpy lse", np_err(lse, torch.logsumexp(scores, -1).numpy())) <= TOL
    assert np_err(out, np_ref(q, k, v, m)) <= TOL
    # The unfused core writes the same rows.
    out2, lse2 = cn.scaled_dot_product_attention(q, k, v, m, return_lse=True, impl="unfused",
                                                 context=ctx)
    assert record("sdpa numpy lse unfused",
                  np_err(lse2, torch.logsumexp(scores, -1).numpy())) <= TOL
    assert np_err(out2, np_ref(q, k, v, m)) <= TOL


def test_numpy_layout_and_weights(ctx, arrays):
    """layout="NLHD" (FlashAttention's (N, L, H, D)) on NumPy arrays, forward and backward, and
    return_weights: the output, lse and weights in the order asked."""
    q, k, v, g = arrays
    nl = lambda a: np.ascontiguousarray(np.swapaxes(a, -3, -2))  # noqa: E731
    m = bool_mask(N, 1, L, S).numpy()
    out, lse, w = cn.scaled_dot_product_attention(nl(q), nl(k), nl(v), m, layout="NLHD",
                                                  return_lse=True, return_weights=True,
                                                  context=ctx)
    assert out.shape == (N, L, H, D) and lse.shape == (N, H, L) and w.shape == (N, H, L, S)
    assert record("sdpa numpy NLHD", np_err(nl(out), np_ref(q, k, v, m))) <= TOL
    scores = torch.from_numpy(q).double() @ torch.from_numpy(k).double().transpose(-2, -1)
    scores = (scores / math.sqrt(D)).masked_fill(~torch.from_numpy(m), float("-inf"))
    assert np_err(lse, torch.logsumexp(scores, -1).numpy()) <= TOL
    assert record("sdpa numpy weights", np_err(w, torch.softmax(scores, -1).numpy())) <= TOL
    out2, w2 = cn.scaled_dot_product_attention(q, k, v, m, return_weights=True, context=ctx)
    assert np_err(w2, w) <= TOL and np_err(nl(out2), out) <= TOL
    gout = g.standard_normal((N, H, L, D)).astype(np.float32)
    nhld = cn.scaled_dot_product_attention_backward(gout, q, k, v, m, context=ctx)
    nlhd = cn.scaled_dot_product_attention_backward(nl(gout), nl(q), nl(k), nl(v), m,
                                                    layout="nlhd", context=ctx)
    for a, b in zip(nhld[:3], nlhd[:3]):
        assert a.shape == nl(b).shape and np_err(a, nl(b)) <= TOL
    with pytest.raises(ValueError, match="layout"):
        cn.scaled_dot_product_attention(q, k, v, layout="HNLD", context=ctx)


@pytest.mark.parametrize("mask", [None, "float", "bool"])
def test_numpy_backward(ctx, arrays, mask):
    q, k, v, g = arrays
    k, v = k[:, :2], v[:, :2]
    m = {None: None, "float": g.standard_normal((N, 1, 1, S)).astype(np.float32),
         "bool": bool_mask(L, S).numpy()}[mask]
    gout = g.standard_normal((N, H, L, D)).astype(np.float32)
    grads = cn.scaled_dot_product_attention_backward(gout, q, k, v, m, enable_gqa=True,
                                                     context=ctx)
    assert len(grads) == 4
    t = {n: torch.from_numpy(np.asarray(a, np.float64)).requires_grad_()
         for n, a in (("q", q), ("k", k), ("v", v))}
    mt = None
    if m is not None:
        mt = torch.from_numpy(m) if m.dtype == np.bool_ else \
            torch.from_numpy(m.astype(np.float64)).requires_grad_()
    ref(t["q"], t["k"], t["v"], mt, enable_gqa=True).backward(torch.from_numpy(
        gout.astype(np.float64)))
    for a, n in zip(grads[:3], "qkv"):
        assert a.shape == t[n].shape and a.dtype == np.float32
        assert record("sdpa numpy grad", np_err(a, t[n].grad.numpy())) <= TOL, n
    if mask == "float":
        assert grads[3].shape == m.shape
        assert record("sdpa numpy mask grad", np_err(grads[3], mt.grad.numpy())) <= TOL
    else:
        assert grads[3] is None
    with pytest.raises(ValueError, match="grad_output has shape"):
        cn.scaled_dot_product_attention_backward(gout[0], q, k, v, m, enable_gqa=True,
                                                 context=ctx)


def test_numpy_dropout_seed(ctx, arrays):
    q, k, v, _ = arrays
    f = cn.scaled_dot_product_attention
    a = f(q, k, v, dropout_p=0.5, seed=7, context=ctx)
    assert np.array_equal(a, f(q, k, v, dropout_p=0.5, seed=7, context=ctx))
    assert not np.array_equal(a, f(q, k, v, dropout_p=0.5, seed=8, context=ctx))
    assert not np.array_equal(a, f(q, k, v, dropout_p=0.5, seed=7, offset=1, context=ctx))
    assert np_err(f(q, k, v, context=ctx), np_ref(q, k, v)) <= TOL


def test_numpy_dtypes_and_errors(ctx, arrays):
    q, k, v, _ = arrays
    f = cn.scaled_dot_product_attention
    out16 = f(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), context=ctx)
    assert out16.dtype == np.float16
    assert np_err(out16, np_ref(q.astype(np.float16), k.astype(np.float16),
                                v.astype(np.float16))) <= 4e-3
    with pytest.raises(TypeError, match="one dtype"):
        f(q.astype(np.float64), k, v, context=ctx)
    with pytest.raises(TypeError, match="int32"):
        f(q.astype(np.int32), k.astype(np.int32), v.astype(np.int32), context=ctx)
    with pytest.raises(TypeError, match="numpy.ndarray"):
        f(torch.from_numpy(q), k, v, context=ctx)
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        f(q, k, v, np.ones((L, S), np.int32), context=ctx)
    with pytest.raises(clmha.Error, match="attn_mask and is_causal"):
        f(q, k, v, np.ones((L, S), bool), is_causal=True, context=ctx)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        f(q[0, 0, 0], k[0, 0, 0], v[0, 0, 0], context=ctx)
    # Fortran-order arrays are copied
    assert np_err(f(np.asfortranarray(q), k, v, context=ctx), np_ref(q, k, v)) <= TOL


def test_numpy_default_context_and_module(has_device, arrays):
    q, k, v, _ = arrays
    assert clmha.numpy is cn
    assert np_err(clmha.numpy.scaled_dot_product_attention(q, k, v), np_ref(q, k, v)) <= TOL


# ---- float64 -------------------------------------------------------------------------------------

F64_TOL = 1e-12  # float64 calls: max error relative to the largest expected value


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-300)).item()


@pytest.mark.parametrize("case", ["plain", "gqa_causal", "float_mask", "bool_mask", "sinks"])
def test_float64_against_the_float64_formula(ctx, case):
    """float64 tensors are computed in float64 (clmha_attention_*_host_f64): the output and
    every gradient within 1e-12 (relative) of the reference formula in float64."""
    h_kv = 2 if case == "gqa_causal" else H
    q = torch.randn(N, H, L, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(N, h_kv, S, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(N, h_kv, S, D, dtype=torch.float64, requires_grad=True)
    mask, kw, extra = None, {}, {}
    if case == "gqa_causal":
        kw = dict(is_causal=True, enable_gqa=True)
    elif case == "float_mask":
        mask = torch.randn(H, L, S, dtype=torch.float64, requires_grad=True)
    elif case == "bool_mask":
        mask = bool_mask(N, 1, L, S)
    elif case == "sinks":
        extra = dict(sinks=torch.randn(H, dtype=torch.float64, requires_grad=True))
    try:
        out = ct.scaled_dot_product_attention(q, k, v, mask, context=ctx, **kw, **extra)
    except clmha.Error as e:
        if "double precision" in str(e):
            pytest.skip(str(e))
        raise
    assert out.dtype == torch.float64
    inputs = [q, k, v] + ([mask] if mask is not None and mask.requires_grad else [])
    inputs += [extra["sinks"]] if extra else []
    d = [t.detach().clone().requires_grad_() for t in inputs]
    r = ref(d[0], d[1], d[2], d[3] if mask is not None and mask.requires_grad else mask,
            **kw, **({"sinks": d[-1]} if extra else {}))
    assert record(f"sdpa float64 {case} forward", rel_err(out, r)) <= F64_TOL
    g = torch.randn(out.shape, dtype=torch.float64)
    grads = torch.autograd.grad(out, inputs, g)
    want = torch.autograd.grad(r, d, g)
    for got, w in zip(grads, want):
        assert got.dtype == torch.float64
        assert record(f"sdpa float64 {case} gradient", rel_err(got, w)) <= F64_TOL


def test_float64_gradcheck(ctx):
    """torch.autograd.gradcheck on the function in float64: query, key, value and a float
    mask."""
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    m = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    try:
        ct.scaled_dot_product_attention(q, k, v, m, context=ctx)
    except clmha.Error as e:
        if "double precision" in str(e):
            pytest.skip(str(e))
        raise
    assert torch.autograd.gradcheck(
        lambda *t: ct.scaled_dot_product_attention(*t, context=ctx), (q, k, v, m))


def test_numpy_float64(ctx, arrays):
    """clmha.numpy in float64: float64 results (output, lse, weights) within 1e-12 of the
    float64 formula; the backward's gradients are float64."""
    q, k, v = (a.astype(np.float64) for a in arrays[:3])
    f = cn.scaled_dot_product_attention
    try:
        out, lse, w = f(q, k, v, context=ctx, return_lse=True, return_weights=True)
    except clmha.Error as e:
        if "double precision" in str(e):
            pytest.skip(str(e))
        raise
    assert out.dtype == lse.dtype == w.dtype == np.float64
    want = np_ref(q, k, v)
    assert np_err(out, want) / np.abs(want).max() <= F64_TOL
    grads = cn.scaled_dot_product_attention_backward(np.ones_like(out), q, k, v, context=ctx)
    assert all(g.dtype == np.float64 for g in grads[:3])
