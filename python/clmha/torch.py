"""clmha.torch: a drop-in ``torch.nn.MultiheadAttention`` that runs on an OpenCL device.

    import torch, clmha.torch
    mha = clmha.torch.MultiheadAttention(512, 8, batch_first=True)
    mha.load_state_dict(torch_mha.state_dict())          # same names, both ways
    out, weights = mha(x, x, x, key_padding_mask=pad)    # torch's forward and return values
    out.sum().backward()                                 # gradients from clmha's backward pass

Tensors live on the CPU (clmha copies them to its OpenCL device; contiguous CPU tensors are
read in place). Two differences from PyTorch: a query row whose every key is masked gives
zeros (its output is out_proj.bias) where PyTorch gives NaN, and dropout in train() is drawn from
clmha's Philox stream (seeded from torch's generator, so torch.manual_seed makes it
reproducible), not PyTorch's.
"""

import itertools
from typing import Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from torch.autograd.function import once_differentiable

from . import _sdpa
from ._context import Context
from ._layer import KVCache, Layer, Mask

def _custom_op_module():
    """clmha._torch_op where torch has torch.library.custom_op (2.4 and later), else None."""
    if not hasattr(torch, "library") or not hasattr(torch.library, "custom_op"):
        return None
    from . import _torch_op

    return _torch_op


_torch_op = _custom_op_module()

_TORCH_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
                 torch.bfloat16: "bfloat16"}
_SDPA_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _cpu(t: Tensor, name: str) -> Tensor:
    """``t`` detached, after checking that it is a CPU tensor."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}: clmha.torch takes CPU tensors (it runs on "
                         f"its own OpenCL device)")
    return t.detach()


def _host(t: Tensor, name: str, dtype: str) -> np.ndarray:
    """``t`` as the NumPy array the layer reads: no copy for a contiguous CPU tensor of the
    layer's dtype (float16 stays float16; bfloat16 becomes float32, exactly)."""
    t = _cpu(t, name)
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.contiguous().numpy()


def _mask(t: Optional[Tensor], name: str, dtype: str):
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, not {type(t).__name__}")
    if t.dtype == torch.bool or t.dtype == torch.uint8:
        return _host(t, name, dtype).astype(np.bool_, copy=False)
    if not t.is_floating_point():
        raise TypeError(f"{name} must be bool or floating point, not {t.dtype}")
    return _host(t.to(torch.float64 if dtype == "float64" else torch.float32), name, dtype)


def _mod_params(t, source: Optional[str]) -> Optional[np.ndarray]:
    """p of the user functions (a tensor, or what ``_sdpa.mod_params_array`` takes) as the
    float32 NumPy array the layer and the function read, checked there."""
    if isinstance(t, Tensor):
        t = _cpu(t, "mod_params")
        t = (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    return _sdpa.mod_params_array(t, source)


class _Call:
    """One forward call's options, handed through autograd.Function."""

    def __init__(self, module, layer, kwargs, self_attention, key_is_value, need_weights):
        self.module = module
        self.layer = layer
        self.kwargs = kwargs
        self.self_attention = self_attention
        self.key_is_value = key_is_value
        self.need_weights = need_weights
        self.grad_enabled = torch.is_grad_enabled()  # when the call is made, outside apply()
        self.saved = None


def _forward(call: _Call, query, key, value, key_padding_mask, attn_mask, want_saved: bool):
    """The forward call on tensors: (output, weights or an empty tensor); with want_saved (and a
    float32 layer) call.saved keeps what _backward() needs."""
    layer = call.layer
    dt = layer.dtype
    q = _host(query, "query", dt)
    k = None if call.self_attention else _host(key, "key", dt)
    v = None if (call.self_attention or call.key_is_value) else _host(value, "value", dt)
    kpm = _mask(key_padding_mask, "key_padding_mask", dt)
    am = _mask(attn_mask, "attn_mask", dt)
    if isinstance(call.kwargs.get("attn_mask_wrap"), dict) and am is not None:
        am = Mask(am, **call.kwargs["attn_mask_wrap"])
    saved = layer.saved() if want_saved else None
    opts = {k2: v2 for k2, v2 in call.kwargs.items() if k2 != "attn_mask_wrap"}
    out, weights = layer.forward(q, k, v, key_padding_mask=kpm, attn_mask=am, save=saved,
                                 need_weights=call.need_weights, **opts)
    call.saved = saved
    tdt = query.dtype
    out_t = torch.from_numpy(out).to(tdt)
    w_t = torch.from_numpy(weights).to(tdt) if weights is not None else query.new_empty(0)
    return out_t, w_t


def _backward(call: _Call, grad_output, grad_weights, need):
    """The gradients of query, key, value, key_padding_mask, attn_mask and the parameters
    (None where not needed or not given) of the forward call that filled call.saved."""
    n_params = len(need) - 5
    if call.saved is None:
        raise RuntimeError("clmha.torch: the forward call saved nothing for a backward pass")
    # The gradients in the module's dtype (a 16-bit module's computed in float32 and rounded
    # once, as its .grad holds them); grad_output's 16-bit values are exact in float32, a
    # float64 module's are passed as doubles.
    tdt = call.module.out_proj.weight.dtype
    wide = torch.float64 if tdt == torch.float64 else torch.float32
    host = "float64" if tdt == torch.float64 else "float32"
    if grad_output is None:
        grad_output = torch.zeros(call.saved._shapes[0], dtype=wide)
    gw = None
    if grad_weights is not None and call.need_weights and grad_weights.numel():
        gw = _host(grad_weights.to(wide), "grad_weights", host)
    grads = call.layer.backward(call.saved, _host(grad_output.to(wide), "grad_output", host),
                                gw,
                                inputs=any(need[0:3]), parameters=any(need[5:]),
                                masks=any(need[3:5]))
    # call.saved stays until the graph goes (a backward with retain_graph, as gradcheck runs,
    # may come again); its device memory goes with it.
    t = lambda name: (torch.from_numpy(grads[name]).to(tdt)  # noqa: E731
                      if name in grads else None)
    gq, gk, gv = t("query"), t("key"), t("value")
    if call.self_attention:
        gk = gv = None
    elif call.key_is_value:
        gv = None
    names = call.module._param_names()
    return ((gq, gk, gv, t("key_padding_mask"), t("attn_mask"))
            + tuple(t(n) for n in names)[:n_params])


class _Attention(torch.autograd.Function):
    """clmha's forward pass, with clmha's backward pass as its gradient."""

    @staticmethod
    def forward(ctx, call: _Call, query, key, value, key_padding_mask, attn_mask, *params):
        # Under torch.no_grad() no graph is recorded, so nothing will ask for a backward pass:
        # the forward then saves nothing (ctx.needs_input_grad still says what requires grad).
        out_t, w_t = _forward(call, query, key, value, key_padding_mask, attn_mask,
                              call.grad_enabled and any(ctx.needs_input_grad))
        ctx.call = call
        ctx.set_materialize_grads(False)
        if not call.need_weights:
            ctx.mark_non_differentiable(w_t)
        return out_t, w_t

    @staticmethod
    def backward(ctx, grad_output, grad_weights):
        return (None,) + _backward(ctx.call, grad_output, grad_weights, ctx.needs_input_grad[1:])


class MultiheadAttention(nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` computed by clmha on an OpenCL device.

    The constructor, the parameters and their ``state_dict()`` names, ``forward`` and its return
    values are PyTorch's (it is a subclass: ``load_state_dict(torch_mha.state_dict())`` works
    both ways). Extra keyword arguments: ``num_kv_heads`` (grouped-query attention: k_proj_weight
    and v_proj_weight get num_kv_heads * head_dim rows), ``window`` (a sliding window
    (left, right): query i attends key j only when i - left <= j <= i + right, -1 leaving a
    side unbounded; the keys of add_bias_kv and add_zero_attn are never windowed; the attribute
    ``window`` may be changed later), ``softcap`` (None or 0: off; c > 0: every scaled score s,
    the appended keys' too, becomes c * tanh(s / c), before ALiBi and the masks; the attribute
    may be changed later), ``alibi`` (ALiBi: query head h at position i against key j gains
    -slope_h * |i - j|, the appended keys none; the slopes are the buffer ``alibi_slopes`` (H),
    in ``state_dict()``, starting as ``clmha.alibi_slopes(H)``: a buffer, as it gets no
    gradient; ``load_state_dict`` of a state_dict without it, PyTorch's module's, keeps it),
    ``sinks`` (attention sinks, gpt-oss's: the parameter ``sinks`` (H), zeros at creation, in
    ``state_dict()`` and with a gradient; one logit per head in each row's softmax denominator
    with a zero value; ``load_state_dict`` without it keeps it), ``score_mod``, ``mask_mod``
    and ``mod_params`` (user score and mask functions, below) and ``context`` (a
    ``clmha.Context``; default: ``$CLMHA_DEVICE`` or the first GPU, else the first OpenCL
    device).

    User functions (FlexAttention's score_mod and mask_mod, as OpenCL C source compiled into
    clmha's kernels): ``score_mod`` defines ``clmha_real clmha_score_mod(clmha_real s, int b,
    int h, int q, int k, __global const float *p)``, the new score of the scaled score s of
    batch item b, query head h, query position q (as the window's) and key k (after
    soft-capping and ALiBi, before the masks; the keys of add_bias_kv and add_zero_attn are
    left alone), and for the backward pass its derivative in s, ``clmha_score_mod_grad`` (same
    arguments; without it the backward raises ``clmha.Error`` UNSUPPORTED when autograd runs
    it); ``mask_mod`` defines ``int clmha_mask_mod(int b, int h, int q, int k,
    __global const float *p)``, non-zero where q may attend k. clmha_real is float (double in
    a float64 module). ``mod_params`` is their p: a 1-D floating-point tensor (count,), kept
    as the attribute ``mod_params`` (the tensor itself when float32, else a float32 copy; a
    plain attribute, not a buffer: not in ``state_dict()``, and ``half()`` or ``to(dtype)``
    leave it float32) with no gradient.
    Change it in place (``mha.mod_params[0] = 2.0``, ``copy_``) or assign a new tensor: the
    next forward call pushes it to the layer (``clmha_layer_set_mod_params``; a new count
    makes a new layer). The attributes ``score_mod`` and ``mask_mod`` may be changed too (a new
    layer, compiled once per source). p is read by the forward and by the backward pass:
    change it after a call's backward has run. A source that does not compile raises
    ``clmha.Error`` (BUILD_FAILED) with the build log; a Python callable, mod_params without a
    source, of an integer dtype or not 1-D raise TypeError / ValueError. Differences from
    FlexAttention: OpenCL C source strings instead of Python callables, one float array p
    instead of captured tensors, the score's derivative supplied by the user; reads of p are
    not bounds-checked.

    Gradients flow to query, key, value, every parameter and a float attn_mask or
    key_padding_mask through clmha's backward pass, in the module's dtype (float16 and
    bfloat16 computed in float32 and rounded once; float64 in float64, so that
    ``torch.autograd.gradcheck`` checks it). Differences from PyTorch:
    a query row whose every key is masked gives zeros instead of NaN, and ``train()`` draws
    dropout from clmha's Philox stream (seeded from torch's generator, so ``torch.manual_seed``
    makes it reproducible). Tensors live on the CPU; under ``torch.compile`` (torch 2.4 and
    later) the module runs as the custom operator ``clmha::attention``.

    Example::

        import torch, clmha.torch
        mha = clmha.torch.MultiheadAttention(64, 8, batch_first=True)
        x = torch.randn(2, 10, 64, requires_grad=True)
        out, weights = mha(x, x, x, need_weights=True)      # (2, 10, 64), (2, 10, 10)
        out.sum().backward()                                # x.grad, mha.in_proj_weight.grad
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False,
                 kdim: Optional[int] = None, vdim: Optional[int] = None,
                 batch_first: bool = False, device=None, dtype=None, *,
                 num_kv_heads: Optional[int] = None, context: Optional[Context] = None,
                 window: Optional[Tuple[int, int]] = None, softcap: Optional[float] = None,
                 alibi: bool = False, sinks: bool = False, score_mod: Optional[str] = None,
                 mask_mod: Optional[str] = None, mod_params=None):
        """Arguments as ``torch.nn.MultiheadAttention``'s (``device`` must be None or "cpu";
        ``dtype`` float32, float64, float16 or bfloat16), plus ``num_kv_heads`` (key/value
        heads for grouped-query attention, dividing num_heads; default num_heads), ``context``
        (the ``clmha.Context`` to run on; default ``clmha.default_context()``), ``window``
        (None, or a sliding window (left, right), -1 leaving a side unbounded), ``softcap``
        (None or 0: off, else c > 0), ``alibi`` (a bool: registers the buffer
        ``alibi_slopes``), ``sinks`` (a bool: registers the parameter ``sinks``, zeros),
        ``score_mod`` and ``mask_mod`` (None, or OpenCL C source of the user functions) and
        ``mod_params`` (None, or their p: a 1-D floating-point tensor, kept as the float32
        attribute ``mod_params``)."""
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"device={device!r}: clmha.torch modules hold CPU tensors (clmha "
                             f"runs them on its OpenCL device: pass context=)")
        if dtype is not None and dtype not in _TORCH_DTYPES:
            raise TypeError(f"dtype must be float32, float64, float16 or bfloat16, not {dtype}")
        window = _sdpa.window_bounds(window)
        softcap = _sdpa.softcap_value(softcap)
        alibi = _sdpa.alibi_flag(alibi)
        sinks = _sdpa.sinks_flag(sinks)
        p = _mod_params(mod_params, _sdpa.mod_source(score_mod, mask_mod))
        if p is not None and not (isinstance(mod_params, Tensor) and
                                  mod_params.dtype == torch.float32):
            mod_params = torch.from_numpy(p.copy())  # a float32 tensor of its own
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias,
                         add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn, kdim=kdim,
                         vdim=vdim, batch_first=batch_first, device=device, dtype=dtype)
        self.num_kv_heads = num_kv_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads "
                             f"({num_heads})")
        if self.num_kv_heads != num_heads:
            self._make_grouped(dtype)
        self.context = context
        self.window = window
        self.softcap = softcap
        self.alibi = alibi
        self.score_mod = score_mod
        self.mask_mod = mask_mod
        # A plain attribute: module.half() / .to(dtype) would round a buffer's values. A
        # float32 tensor is kept itself, as register_buffer keeps it.
        self.mod_params = mod_params
        if alibi:
            self._make_slopes()
        # Like bias_k: the parameter, or None without sinks (then not in state_dict()).
        self.register_parameter("sinks", nn.Parameter(torch.zeros(
            num_heads, dtype=self.out_proj.weight.dtype)) if sinks else None)
        self._clmha = None
        self._clmha_key = None
        self._clmha_versions = {}
        self._clmha_mod_stamp = None
        self._offset = itertools.count()
        self._op_handle = _torch_op.register(self) if _torch_op is not None else None

    def _make_grouped(self, dtype) -> None:
        kv = self.num_kv_heads * self.head_dim
        f = {"dtype": dtype}
        q = self.in_proj_weight[: self.embed_dim] if self._qkv_same_embed_dim else \
            self.q_proj_weight
        self._qkv_same_embed_dim = False
        self.in_proj_weight = None
        self.q_proj_weight = nn.Parameter(q.detach().clone())
        self.k_proj_weight = nn.Parameter(torch.empty(kv, self.kdim, **f))
        self.v_proj_weight = nn.Parameter(torch.empty(kv, self.vdim, **f))
        nn.init.xavier_uniform_(self.k_proj_weight)
        nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            self.in_proj_bias = nn.Parameter(torch.zeros(self.embed_dim + 2 * kv, **f))
        if self.bias_k is not None:
            self.bias_k = nn.Parameter(torch.empty(1, 1, kv, **f))
            self.bias_v = nn.Parameter(torch.empty(1, 1, kv, **f))
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    def _make_slopes(self) -> None:
        """The buffer alibi_slopes: the geometric slopes, in the parameters' dtype."""
        slopes = torch.from_numpy(_sdpa.alibi_slopes(self.num_heads))
        self.register_buffer("alibi_slopes", slopes.to(self.out_proj.weight.dtype))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # A state_dict without alibi_slopes or sinks (nn.MultiheadAttention's) keeps the
        # module's.
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        for key in (prefix + "alibi_slopes", prefix + "sinks"):
            if key in missing_keys and key not in state_dict:
                missing_keys.remove(key)

    def _param_names(self) -> Tuple[str, ...]:
        names = ["in_proj_weight"] if self.in_proj_weight is not None else [
            "q_proj_weight", "k_proj_weight", "v_proj_weight"]
        names += [n for n in ("in_proj_bias", "bias_k", "bias_v", "sinks")
                  if getattr(self, n, None) is not None]
        names.append("out_proj.weight")
        if self.out_proj.bias is not None:
            names.append("out_proj.bias")
        return tuple(names)

    def _param(self, name: str) -> Tensor:
        return self.out_proj.get_parameter(name[len("out_proj."):]) if name.startswith(
            "out_proj.") else getattr(self, name)

    def _layer(self) -> Layer:
        """The clmha layer, made on first use and again when the dtype or options change; the
        parameters are copied to it when they changed since the last call (version counters)."""
        dtype = _TORCH_DTYPES.get(self.out_proj.weight.dtype)
        if dtype is None:
            raise TypeError(f"parameters of dtype {self.out_proj.weight.dtype} are not supported")
        window = _sdpa.window_bounds(self.window)
        softcap = _sdpa.softcap_value(self.softcap)
        alibi = _sdpa.alibi_flag(self.alibi)
        if alibi and getattr(self, "alibi_slopes", None) is None:
            self._make_slopes()  # alibi switched on after construction
        sinks = getattr(self, "sinks", None) is not None
        source = _sdpa.mod_source(getattr(self, "score_mod", None),
                                  getattr(self, "mask_mod", None))
        mod_params = getattr(self, "mod_params", None)
        p = _mod_params(mod_params, source)
        count = None if p is None else p.size
        key = (dtype, float(self.dropout), bool(self.batch_first), bool(self.add_zero_attn),
               id(self.context), window, softcap, alibi, sinks, source, count)
        if self._clmha is None or key != self._clmha_key:
            self._clmha = Layer(self.embed_dim, self.num_heads, dropout=float(self.dropout),
                                bias=self.in_proj_bias is not None,
                                add_bias_kv=self.bias_k is not None,
                                add_zero_attn=self.add_zero_attn, kdim=self.kdim, vdim=self.vdim,
                                batch_first=self.batch_first, num_kv_heads=self.num_kv_heads,
                                dtype=dtype, window=window, softcap=softcap, alibi=alibi,
                                sinks=sinks, score_mod=self.score_mod, mask_mod=self.mask_mod,
                                mod_params=p, context=self.context)
            self._clmha_key = key
            self._clmha_versions = {}
            self._clmha_mod_stamp = None
        layer = self._clmha
        # p pushed when it changed (a tensor: by its version counter; anything else: each call)
        stamp = ((mod_params._version, mod_params.data_ptr(), id(mod_params))
                 if isinstance(mod_params, Tensor) else None)
        if p is not None and (stamp is None or stamp != self._clmha_mod_stamp):
            if self._clmha_mod_stamp is not None or stamp is None:  # the layer has the first
                layer.set_mod_params(p)
            self._clmha_mod_stamp = stamp
        names = self._param_names() + (("alibi_slopes",) if alibi else ())
        for name in names:
            p = self._param(name)
            if p.device.type != "cpu":
                raise ValueError(f"parameter {name} is on {p.device}: clmha.torch modules hold "
                                 f"CPU tensors")
            stamp = (p._version, p.data_ptr(), id(p))
            if self._clmha_versions.get(name) != stamp:
                layer[name] = _host(p, name, dtype) if dtype != "float16" else \
                    p.detach().float().contiguous().numpy()
                self._clmha_versions[name] = stamp
        return layer

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Optional[Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False, *, seq_lens: Optional[Sequence[int]] = None,
                kv_seq_lens: Optional[Sequence[int]] = None) -> Tuple[Tensor, Optional[Tensor]]:
        """PyTorch's ``MultiheadAttention.forward``: returns ``(attn_output, attn_weights)``,
        the weights averaged over heads unless ``average_attn_weights=False``, None without
        ``need_weights``. ``is_causal`` with an attn_mask is PyTorch's hint (the mask is used);
        without one it applies the causal mask itself.

        Packed batches (PyTorch's fast path with NestedTensors): query, key and value may be
        NestedTensors of (L_i, E) and (S_i, kdim/vdim) sequences (``torch.nested``); the output
        is a NestedTensor of (L_i, E). Or, clmha's own keywords, 2-D tensors packed one sequence
        after another, ``seq_lens`` (and ``kv_seq_lens``, default ``seq_lens``) their lengths:
        the output is (T, E). Each sequence attends only within itself, and only its real tokens
        are computed. As PyTorch's fast path, such a call takes no masks and returns no weights
        (``need_weights=False``); ``is_causal`` applies per sequence."""
        if any(getattr(t, "is_nested", False) for t in (query, key, value)):
            return self._run_nested(query, key, value, key_padding_mask, need_weights,
                                    attn_mask, is_causal)
        return self._run(query, key, value, key_padding_mask, need_weights, attn_mask,
                         average_attn_weights, is_causal, None, seq_lens, kv_seq_lens)

    def _run_nested(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                    is_causal):
        """NestedTensor inputs: packed (torch.cat of their sequences, which autograd follows),
        run with their lengths, the output split back into a NestedTensor."""
        if not all(getattr(t, "is_nested", False) for t in (query, key, value)):
            raise TypeError("query, key and value must all be NestedTensors, or none")
        if need_weights or key_padding_mask is not None or attn_mask is not None:
            raise ValueError("NestedTensor inputs take no key_padding_mask or attn_mask and "
                             "return no weights: pass need_weights=False (as PyTorch's fast "
                             "path)")
        qs = query.unbind()
        ks = qs if key is query else key.unbind()
        vs = ks if value is key else value.unbind()
        if len(ks) != len(qs) or len(vs) != len(qs):
            raise ValueError(f"query holds {len(qs)} sequences, key {len(ks)}, value "
                             f"{len(vs)}: they must hold as many")
        lens = [int(q.shape[0]) for q in qs]
        kv_lens = [int(k.shape[0]) for k in ks]
        q = torch.cat(qs)
        k = q if key is query else torch.cat(ks)
        v = k if value is key else torch.cat(vs)
        out, _ = self._run(q, k, v, None, False, None, True, is_causal, None, lens,
                           None if key is query else kv_lens)
        return torch.nested.as_nested_tensor(list(out.split(lens))), None

    def _run(self, query, key, value, key_padding_mask, need_weights, attn_mask,
             average_attn_weights, is_causal, attn_mask_wrap, seq_lens=None, kv_seq_lens=None):
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
            if t.dtype != self.out_proj.weight.dtype:
                raise TypeError(f"{name} is {t.dtype} but the module's parameters are "
                                f"{self.out_proj.weight.dtype}")
            if t.dim() not in (2, 3):
                raise ValueError(f"{name} must be 2-D (unbatched) or 3-D; its shape is "
                                 f"{tuple(t.shape)}")
        self_attention = key is query and value is query and \
            self.kdim == self.embed_dim and self.vdim == self.embed_dim
        key_is_value = key is value and self.kdim == self.vdim
        training = self.training and self.dropout > 0
        params = [self._param(n) for n in self._param_names()]
        if seq_lens is None and kv_seq_lens is not None:
            raise ValueError("kv_seq_lens needs seq_lens (the queries' lengths)")
        if seq_lens is not None and need_weights:
            raise ValueError("a packed batch (seq_lens) returns no weights: pass "
                             "need_weights=False (as PyTorch's fast path)")
        if _torch_op is not None and torch.compiler.is_compiling() and seq_lens is None:
            # torch.compile: the custom operator keeps clmha in the graph (_torch_op.py). The
            # dropout seed is fixed when the graph is traced.
            masks = [m for m in (key_padding_mask, attn_mask) if m is not None]
            want = torch.is_grad_enabled() and any(
                t.requires_grad for t in [query, key, value] + params + masks)
            wrap = 0 if attn_mask_wrap is None else (int(attn_mask_wrap.get("attend", False))
                                                     | 2 * int(attn_mask_wrap.get("per_batch",
                                                                                  False)))
            flags = [int(bool(need_weights)), int(bool(average_attn_weights)),
                     int(bool(is_causal) and attn_mask is None), int(training),
                     next(self._offset) if training else 0, 0]
            out, weights, _ = _torch_op.attention(
                self._op_handle, query, key, value, key_padding_mask, attn_mask, params, flags,
                int(self_attention), int(key_is_value), wrap, int(want))
            return out, (weights if need_weights else None)
        layer = self._layer()
        kwargs = dict(is_causal=bool(is_causal) and attn_mask is None,
                      average_attn_weights=bool(average_attn_weights), training=training,
                      seed=int(torch.randint(0, 2 ** 62, (1,)).item()) if training else 0,
                      offset=0)  # the seed is drawn from torch's generator per call
        if attn_mask_wrap is not None:
            kwargs["attn_mask_wrap"] = attn_mask_wrap
        if seq_lens is not None:
            kwargs["seq_lens"] = [int(x) for x in seq_lens]
            if kv_seq_lens is not None:
                kwargs["kv_seq_lens"] = [int(x) for x in kv_seq_lens]
        call = _Call(self, layer, kwargs, self_attention, key_is_value, bool(need_weights))
        out, weights = _Attention.apply(call, query, key, value, key_padding_mask, attn_mask,
                                        *params)
        return out, (weights if need_weights else None)

    @classmethod
    def from_torch(cls, module: nn.Module, *, context: Optional[Context] = None,
                   num_heads: Optional[int] = None) -> nn.Module:
        """A clmha module computing what ``module`` computes, with a copy of its parameters:
        an ``nn.MultiheadAttention`` gives a ``MultiheadAttention``; continuiti's
        ``MultiHeadAttention`` (query_project, ..., out_project) a ``ContinuitiAttention``;
        the classic split-heads module (w_q, w_k, w_v, w_concat) a ``SplitHeadsAttention``.
        A module's ``window``, ``softcap``, ``alibi``, ``score_mod``, ``mask_mod`` and
        ``mod_params`` attributes (a clmha module's) come along, and its ``alibi_slopes`` and
        ``sinks`` with its ``state_dict()``."""
        if isinstance(module, nn.MultiheadAttention):
            m = cls(module.embed_dim, module.num_heads, dropout=module.dropout,
                    bias=module.in_proj_bias is not None, add_bias_kv=module.bias_k is not None,
                    add_zero_attn=module.add_zero_attn, kdim=module.kdim, vdim=module.vdim,
                    batch_first=module.batch_first, dtype=module.out_proj.weight.dtype,
                    num_kv_heads=getattr(module, "num_kv_heads", None), context=context,
                    window=getattr(module, "window", None),
                    softcap=getattr(module, "softcap", None),
                    alibi=bool(getattr(module, "alibi", False)),
                    sinks=getattr(module, "sinks", None) is not None,
                    score_mod=getattr(module, "score_mod", None),
                    mask_mod=getattr(module, "mask_mod", None),
                    mod_params=getattr(module, "mod_params", None))
            m.load_state_dict(module.state_dict())
            return m.train(module.training)
        heads = num_heads or getattr(module, "n_heads", None) or getattr(module, "n_head", None)
        if heads is None:
            raise TypeError(f"cannot read the head count of {type(module).__name__}: pass "
                            f"num_heads=")
        if hasattr(module, "query_project"):
            return ContinuitiAttention._from(module, int(heads), context)
        if hasattr(module, "w_q"):
            return SplitHeadsAttention._from(module, int(heads), context)
        raise TypeError(f"{type(module).__name__} is not nn.MultiheadAttention, continuiti's "
                        f"MultiHeadAttention or the classic w_q/w_k/w_v/w_concat module")


class _SeedAttention(nn.Module):
    """A seed module's parameters (its own names) computed by a clmha MultiheadAttention."""

    _names = ()

    def __init__(self, hidden_dim: int, n_heads: int, bias: bool = True, dropout_p: float = 0.0,
                 context: Optional[Context] = None):
        super().__init__()
        for n in self._names:
            setattr(self, n, nn.Linear(hidden_dim, hidden_dim, bias=bias))
        self.n_heads = n_heads
        self.hidden_dim = hidden_dim
        # Not a registered submodule: state_dict() and parameters() are the seed module's own.
        object.__setattr__(self, "_mha", MultiheadAttention(
            hidden_dim, n_heads, dropout=dropout_p, bias=bias, batch_first=True,
            context=context))

    @classmethod
    def _from(cls, module, heads, context):
        first = getattr(module, cls._names[0])
        m = cls(first.in_features, heads, bias=first.bias is not None,
                dropout_p=float(getattr(module, "dropout_p", 0.0)), context=context)
        m.load_state_dict(module.state_dict(), strict=False)
        return m.train(module.training)

    def _sync(self) -> MultiheadAttention:
        q, k, v, o = (getattr(self, n) for n in self._names)
        mha = self._mha
        with torch.no_grad():
            mha.in_proj_weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
            mha.out_proj.weight.copy_(o.weight)
            if q.bias is not None:
                mha.in_proj_bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
                mha.out_proj.bias.copy_(o.bias)
        mha.train(self.training)
        return mha

    def _attend(self, query, key, value, attn_mask, wrap):
        mha = self._sync()
        # Gradients reach this module's own Linear parameters through these views.
        q, k, v, o = (getattr(self, n) for n in self._names)
        params = {"in_proj_weight": torch.cat([q.weight, k.weight, v.weight]),
                  "out_proj.weight": o.weight}
        if q.bias is not None:
            params["in_proj_bias"] = torch.cat([q.bias, k.bias, v.bias])
            params["out_proj.bias"] = o.bias
        return _functional(mha, params, query, key, value, attn_mask, wrap)


def _functional(mha: MultiheadAttention, params, query, key, value, attn_mask, wrap):
    layer = mha._layer()
    call = _Call(mha, layer, dict(is_causal=False, average_attn_weights=True,
                                  training=mha.training and mha.dropout > 0,
                                  seed=int(torch.randint(0, 2 ** 62, (1,)).item())
                                  if mha.training and mha.dropout > 0 else 0,
                                  offset=0, attn_mask_wrap=wrap),
                 key is query and value is query, key is value, False)
    out, _ = _Attention.apply(call, query, key, value, None, attn_mask,
                              *[params[n] for n in mha._param_names()])
    return out


class ContinuitiAttention(_SeedAttention):
    """continuiti's ``MultiHeadAttention(hidden_dim, n_heads, dropout_p, bias)`` computed by
    clmha: the same parameters (query_project, key_project, value_project, out_project) and
    ``forward(query, key, value, attn_mask=None)`` on (batch, length, hidden_dim) tensors, with
    its mask (batch, target_len, source_len) whose True means "may attend"."""

    _names = ("query_project", "key_project", "value_project", "out_project")

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                attn_mask: Optional[Tensor] = None) -> Tensor:
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            return self._attend(query, key, value, attn_mask, {"attend": True, "per_batch": True})
        return self._attend(query, key, value, attn_mask,
                            {"per_batch": True} if attn_mask is not None else None)


class SplitHeadsAttention(_SeedAttention):
    """The classic "split heads → scaled dot product → concat → w_concat" module computed by
    clmha: parameters w_q, w_k, w_v, w_concat and ``forward(q, k, v, mask=None)`` on (batch,
    length, d_model) tensors; ``mask`` (batch, target_len, source_len) boolean, True = may
    attend (where that module fills masked scores with -10000, clmha forbids them outright)."""

    _names = ("w_q", "w_k", "w_v", "w_concat")

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        if mask is not None:
            mask = mask.bool()
            if mask.dim() == 4:  # (batch, 1, L, S), as that module's callers pass it
                mask = mask[:, 0]
        return self._attend(q, k, v, mask,
                            {"attend": True, "per_batch": True} if mask is not None else None)


# ---- attention as a function -------------------------------------------------------------------

def _sdpa_host(t: Tensor, name: str, f64: bool = False) -> np.ndarray:
    """``t`` as the float32 NumPy array the C function reads (float64 with ``f64``: a float64
    call; no copy for a contiguous CPU tensor of that dtype); bool stays bool."""
    t = _cpu(t, name)
    wide = torch.float64 if f64 else torch.float32
    if t.dtype != torch.bool and t.dtype != wide:
        t = t.to(wide)
    return t.contiguous().numpy()


def _sdpa_mask(t: Optional[Tensor], f64: bool = False):
    """The mask as NumPy; a mask that does not need a gradient loses the dimensions it was
    expanded along (stride 0, as ``mask.expand(N, H, L, S)`` makes them): the C call then
    reads the small mask it was made from."""
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, not {type(t).__name__}")
    if t.dtype != torch.bool and not t.is_floating_point():
        raise TypeError(f"attn_mask must be bool (True = may attend) or floating point, not "
                        f"{t.dtype}")
    if not t.requires_grad and t.dim():
        t = t[tuple(slice(0, 1) if st == 0 and sz > 1 else slice(None)
                    for st, sz in zip(t.stride(), t.shape))]
    return _sdpa_host(t, "attn_mask", f64)


class _SdpaCall:
    """One scaled_dot_product_attention call's options, handed through autograd.Function."""

    def __init__(self, dropout_p, is_causal, scale, enable_gqa, seed, impl, context,
                 kv_cache=None, kv_append=None, window=None, softcap=None, alibi=False,
                 alibi_slopes=None, score_mod=None, mask_mod=None, mod_params=None,
                 seq_lens=None, kv_seq_lens=None):
        self.options = dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                            enable_gqa=enable_gqa)
        self.extra = dict(seed=seed, offset=0, impl=impl, context=context, kv_cache=kv_cache,
                          kv_append=kv_append, window=window, softcap=softcap, alibi=alibi,
                          alibi_slopes=alibi_slopes, score_mod=score_mod, mask_mod=mask_mod,
                          mod_params=mod_params, seq_lens=seq_lens, kv_seq_lens=kv_seq_lens)
        self.grad_enabled = torch.is_grad_enabled()  # when the call is made, outside apply()

    def c_call(self, query, key, value, attn_mask, sinks=None) -> _sdpa.Call:
        f64 = query.dtype == torch.float64  # a float64 call, computed in float64
        return _sdpa.Call(_sdpa_host(query, "query", f64), _sdpa_host(key, "key", f64),
                          _sdpa_host(value, "value", f64), _sdpa_mask(attn_mask, f64),
                          **self.options, **self.extra,
                          sinks=None if sinks is None else _sdpa_host(sinks, "sinks", f64))


def _sdpa_save(ctx, *tensors) -> None:
    """What the backward pass reads again: the inputs (their version counters checked)."""
    ctx.save_for_backward(*tensors)


class _SdpaFunction(torch.autograd.Function):
    """clmha_attention_forward_host, with clmha_attention_backward_host as its gradient."""

    @staticmethod
    def forward(ctx, call: _SdpaCall, query, key, value, attn_mask, sinks=None):
        out = call.c_call(query, key, value, attn_mask, sinks).forward()
        ctx.call = call
        if call.grad_enabled:  # under torch.no_grad() no graph is recorded: save nothing
            _sdpa_save(ctx, query, key, value, attn_mask, sinks)
        return torch.from_numpy(out).to(query.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        query, key, value, attn_mask, sinks = ctx.saved_tensors
        need = ctx.needs_input_grad[1:]
        want = (need[0], need[1], need[2],
                need[3] and attn_mask is not None and attn_mask.is_floating_point(),
                need[4] and sinks is not None)
        grads = ctx.call.c_call(query, key, value, attn_mask, sinks).backward(
            _sdpa_host(grad_output, "grad_output", query.dtype == torch.float64), want)
        grads = tuple(grads) + (None,) * (5 - len(grads))
        return (None,) + tuple(
            torch.from_numpy(g).to(t.dtype) if g is not None else None
            for g, t in zip(grads, (query, key, value, attn_mask, sinks)))


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False, *, impl: str = "auto",
                                 context: Optional[Context] = None,
                                 kv_cache: Optional[KVCache] = None,
                                 kv_append: Optional[Sequence[int]] = None,
                                 window: Optional[Tuple[int, int]] = None,
                                 softcap: Optional[float] = None, alibi: bool = False,
                                 alibi_slopes: Optional[Tensor] = None,
                                 sinks: Optional[Tensor] = None,
                                 score_mod: Optional[str] = None,
                                 mask_mod: Optional[str] = None,
                                 mod_params: Optional[Tensor] = None,
                                 seq_lens: Optional[Sequence[int]] = None,
                                 kv_seq_lens: Optional[Sequence[int]] = None) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` (torch 2.5's signature and
    semantics) computed by clmha on its OpenCL device, with clmha's backward pass as its
    gradient.

    query (..., H, L, D), key (..., H_kv, S, D), value (..., H_kv, S, D_v): (N, H, L, D),
    (N, L, D), (L, D) or more leading dimensions, the same leading sizes in all three (they are
    not broadcast; D_v may differ from D). attn_mask broadcasts to (..., H, L, S): bool
    (True = may attend) or floating point (added to the scaled scores). is_causal: query i
    attends to keys j <= i (top-left aligned, torch.ones(L, S).tril()); not with attn_mask.
    scale: None is 1/sqrt(D). enable_gqa: H_kv may divide H (query head h reads key/value head
    h // (H / H_kv)). Keyword-only extras: ``impl`` ("auto", "fused", "unfused": the attention
    core of the forward and of the backward, whose "auto" takes the unfused one for a float
    mask's gradient), ``context`` (a ``clmha.Context``; default ``kv_cache``'s context with a
    cache, else ``clmha.default_context()``), the KV-cache form's ``kv_cache`` and
    ``kv_append``, and ``window``: None or a sliding window (left, right) (FlashAttention's
    window_size): query i attends key j only when i - left <= j <= i + right, -1 leaving a side
    unbounded (with a KV cache i is the sequence's cached length + the new query's row); it
    combines with attn_mask and is_causal; ``softcap`` (None or 0: off; c > 0: every scaled
    score s becomes c * tanh(s / c), before ALiBi and attn_mask; negative, NaN or infinite:
    ValueError), ``alibi`` (ALiBi: query head h at position i, as the window's, against key j
    gains -slope_h * |i - j|) and ``alibi_slopes`` (with alibi: a tensor (H,) of slopes,
    which gets no gradient; None: ``clmha.alibi_slopes(H)``, the geometric ones; given
    without alibi or not (H,): ValueError) and ``sinks`` (None, or attention sinks, gpt-oss's:
    a tensor (H,), one logit per query head in each row's softmax denominator with a zero
    value, so a row's weights sum below 1 and a fully masked row still gives zeros; autograd
    gives it a gradient when it requires grad; not (H,): ValueError).

    User score and mask functions (FlexAttention's ``score_mod`` and ``mask_mod``):
    ``score_mod`` is OpenCL C source defining ``clmha_real clmha_score_mod(clmha_real s, int b,
    int h, int q, int k, __global const float *p)``, the new score of the scaled score s of
    batch item b (the folded leading dimensions' index), query head h, query position q (as
    the window's) and key k, applied after soft-capping and ALiBi, before attn_mask and the
    masks; for the backward pass it also defines ``clmha_score_mod_grad`` (same arguments: the
    derivative in s), else backward() raises ``clmha.Error`` (UNSUPPORTED). ``mask_mod`` is
    OpenCL C source defining ``int clmha_mask_mod(int b, int h, int q, int k,
    __global const float *p)``, non-zero where q may attend k (combined with attn_mask,
    is_causal and the window). clmha_real is float. ``mod_params`` is their p: a 1-D
    floating-point tensor (count,), read as float32, without a gradient (None: empty). The
    sources are joined and compiled into the kernels (once per context and source): one that
    does not compile raises ``clmha.Error`` (BUILD_FAILED) with the build log; a Python
    callable, a source without its function, mod_params without a source, of an integer dtype
    or not 1-D raise TypeError / ValueError. Differences from FlexAttention: OpenCL C source
    strings instead of Python callables, one float array p instead of captured tensors, and
    the score's derivative written by the user; the reads of p are not bounds-checked.

    Packed batches (FlashAttention's ``flash_attn_varlen_func``): with ``seq_lens`` (and
    ``kv_seq_lens``, default ``seq_lens``) query is (T, H, D), key and value (T_kv, H_kv, D /
    D_v), the sequences one after another, each attending only within itself; the output is
    (T, H, D_v). No attn_mask with it. Gradients as for the padded call.

    KV cache (incremental decoding, as FlashAttention's ``flash_attn_with_kvcache``): with
    ``kv_cache=clmha.KVCache.for_attention(N, H_kv, D, capacity)``, key and value are the new
    tokens (..., H_kv, S_new, D), appended after each sequence's cached ones (``kv_append``: N
    counts of the new tokens that are real, for ragged batches; None: all), and the queries
    attend over everything the cache then holds for their sequence. is_causal is bottom-right
    aligned there (new query i of a sequence that held ``len`` tokens sees cache positions
    0 .. len + i). Such a call has no backward (an input that requires grad under grad mode
    raises RuntimeError: detach it or use ``torch.no_grad()``) and takes no attn_mask, dropout
    or D_v != D (``clmha.Error``).

    Gradients flow to query, key, value and a float attn_mask (summed over the dimensions it is
    broadcast along) through ``clmha_attention_backward_host``, which runs the forward pass
    again; under ``torch.no_grad()``, or when nothing requires grad, nothing is saved.
    Tensors live on the CPU. float32 and float64 are computed as they are (float64 in float64,
    on a device with double precision: ``torch.autograd.gradcheck`` passes); float16 and
    bfloat16 are computed in float32 and the results returned in their dtype; other dtypes raise
    TypeError. Differences from PyTorch: a query row whose
    every key is masked gives zeros (PyTorch: NaN), and dropout (applied whenever dropout_p > 0,
    as PyTorch's function does) is drawn from clmha's Philox stream, seeded from torch's
    generator (``torch.manual_seed`` makes it reproducible), not PyTorch's.

    Example::

        import torch, clmha.torch
        q = torch.randn(2, 8, 10, 64, requires_grad=True)
        k = v = torch.randn(2, 2, 12, 64)
        out = clmha.torch.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                       enable_gqa=True)   # (2, 8, 10, 64)
        out.sum().backward()                                              # q.grad
    """
    tensors = (("query", query), ("key", key), ("value", value))
    for name, t in tensors:
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
        if t.dtype not in _SDPA_DTYPES:
            raise TypeError(f"{name} is {t.dtype}: clmha's attention function takes float32, "
                            f"float64, float16 or bfloat16 tensors")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must have one dtype, not {query.dtype}, "
                        f"{key.dtype} and {value.dtype}")
    if attn_mask is not None and not isinstance(attn_mask, Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, not "
                        f"{type(attn_mask).__name__}")
    dropout_p = _sdpa._number("dropout_p", dropout_p)
    window = _sdpa.window_bounds(window)
    softcap = _sdpa.softcap_value(softcap)
    alibi = _sdpa.alibi_flag(alibi)
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, Tensor):
            raise TypeError(f"alibi_slopes must be a torch.Tensor or None, not "
                            f"{type(alibi_slopes).__name__}")
        alibi_slopes = _sdpa_host(alibi_slopes, "alibi_slopes", query.dtype == torch.float64)
    if sinks is not None:
        if not isinstance(sinks, Tensor):
            raise TypeError(f"sinks must be a torch.Tensor or None, not {type(sinks).__name__}")
        if not sinks.is_floating_point():
            raise TypeError(f"sinks must be floating point, not {sinks.dtype}")
    mod_params = _mod_params(mod_params, _sdpa.mod_source(score_mod, mask_mod))
    # the dropout's Philox seed, drawn from torch's generator per call (as the module's)
    seed = int(torch.randint(0, 2 ** 62, (1,)).item()) if dropout_p > 0 else 0
    call = _SdpaCall(dropout_p, bool(is_causal), scale, bool(enable_gqa), seed, impl, context,
                     kv_cache, kv_append, window, softcap, alibi, alibi_slopes, score_mod,
                     mask_mod, mod_params, seq_lens, kv_seq_lens)
    grad = call.grad_enabled and any(
        t is not None and t.requires_grad for t in (query, key, value, attn_mask, sinks))
    if grad and kv_cache is not None:
        raise RuntimeError("scaled_dot_product_attention with kv_cache has no backward pass, "
                           "but an input requires grad: detach the inputs or call it under "
                           "torch.no_grad()")
    if not grad:
        out = call.c_call(query, key, value, attn_mask, sinks).forward()
        return torch.from_numpy(out).to(query.dtype)
    return _SdpaFunction.apply(call, query, key, value, attn_mask, sinks)


def export(module: nn.Module, path, *, num_heads: Optional[int] = None) -> None:
    """Writes ``module`` (``nn.MultiheadAttention``, continuiti's or the classic module, or a
    clmha.torch module) as a clmha layer file (``.safetensors``), readable by
    ``clmha run --layer``, ``clmha_layer_load()`` and ``clmha.Layer.load()``; a clmha module's
    ``window``, ``softcap`` and ``alibi`` go into the file's metadata, its ``alibi_slopes``
    (and ``sinks``, where the layer file format carries them) into the file as tensors."""
    heads = num_heads or getattr(module, "num_heads", None) or getattr(module, "n_heads", None) \
        or getattr(module, "n_head", None)
    if heads is None:
        raise TypeError(f"cannot read the head count of {type(module).__name__}: pass num_heads=")
    sd = module.state_dict()
    dtype = _TORCH_DTYPES.get(next(iter(sd.values())).dtype, "float32") if sd else None
    layer = Layer.from_state_dict(sd, int(heads),
                                  batch_first=getattr(module, "batch_first", None),
                                  dropout=float(getattr(module, "dropout",
                                                        getattr(module, "dropout_p", 0.0))),
                                  add_zero_attn=bool(getattr(module, "add_zero_attn", False)),
                                  dtype=dtype, window=getattr(module, "window", None),
                                  softcap=getattr(module, "softcap", None),
                                  alibi=bool(getattr(module, "alibi", False)) or None)
    layer.save(path)


__all__ = ["MultiheadAttention", "ContinuitiAttention", "SplitHeadsAttention", "export",
           "scaled_dot_product_attention"]
