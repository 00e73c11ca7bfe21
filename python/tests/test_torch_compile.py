"""torch.compile keeps clmha's attention in the graph (torch >= 2.4: the custom operators of
clmha/_torch_op.py), forward and backward, with results equal to nn.MultiheadAttention's."""

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "library") or not hasattr(torch.library, "custom_op"):
    pytest.skip(f"torch {torch.__version__} has no torch.library.custom_op (2.4+)",
                allow_module_level=True)
import clmha  # noqa: E402

if not clmha.devices():
    pytest.skip("no OpenCL device", allow_module_level=True)
import clmha.torch as ct  # noqa: E402
from clmha import _torch_op  # noqa: E402


@pytest.mark.parametrize("need_weights", [False, True])
def test_compiled_graph_matches_torch(need_weights):
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(16, 4, batch_first=True, add_bias_kv=True).double()
    m = ct.MultiheadAttention(16, 4, batch_first=True, add_bias_kv=True)
    m.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])

    def loss(mod, x):
        out, w = mod(x, x, x, key_padding_mask=pad, need_weights=need_weights)
        return out.square().sum() + (w.square().sum() if need_weights else 0)

    compiled = torch.compile(lambda x: loss(m, x), backend="aot_eager", fullgraph=True)
    xf = x.float().requires_grad_()
    got = compiled(xf)
    got.backward()
    xd = x.clone().requires_grad_()
    want = loss(ref, xd)
    want.backward()
    scale = 1 + want.abs().item()
    assert abs(got.item() - want.item()) <= 1e-4 * scale
    assert (xf.grad.double() - xd.grad).abs().max().item() <= 1e-4 * (1 + xd.grad.abs().max())
    for name in ("in_proj_weight", "bias_k", "out_proj.weight"):
        g = m.get_parameter(name).grad.double()
        r = ref.get_parameter(name).grad
        assert (g - r).abs().max().item() <= 1e-4 * (1 + r.abs().max().item()), name
    assert not _torch_op._saved, "a saved state outlived its backward pass"


def test_fake_kernel_shapes():
    """The operator's fake kernel gives the shapes of the real one (what the compiler plans with)."""
    m = ct.MultiheadAttention(12, 3, add_zero_attn=True)
    q = torch.randn(4, 2, 12)
    k = torch.randn(6, 2, 12)
    args = (m._op_handle, q, k, k, None, None, [m._param(n) for n in m._param_names()],
            [1, 0, 0, 0, 0, 0], 0, 1, 0, 0)
    real = _torch_op.attention(*args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fargs = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else
                      ([mode.from_tensor(p) for p in a] if isinstance(a, list) and a and
                       isinstance(a[0], torch.Tensor) else a) for a in args)
        fake = _torch_op.attention(*fargs)
    assert [tuple(t.shape) for t in fake[:2]] == [tuple(t.shape) for t in real[:2]]
    assert tuple(real[1].shape) == (2, 3, 4, 7)
