"""clmha's attention as a PyTorch custom operator (torch >= 2.4), for torch.compile.

``torch.compile`` cannot trace into clmha's C calls; through ``torch.library.custom_op`` the
forward and backward passes are two opaque operators with fake (meta) kernels, so a compiled
graph keeps them instead of breaking. ``clmha.torch.MultiheadAttention.forward`` takes this path
while compiling and the autograd.Function path in eager mode; both run the same code.

The operators name the module by a number (a registry of live modules) and the forward pass's
saved state by a token tensor: a forward call whose backward pass never runs keeps its saved
state until the module is released.
"""

import itertools
import weakref
from typing import List, Optional, Tuple

import torch
from torch import Tensor

_modules: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_saved = {}
_tokens = itertools.count(1)
_ids = itertools.count(1)


def register(module) -> int:
    """A number that names ``module`` in the operators' calls."""
    handle = next(_ids)
    _modules[handle] = module
    return handle


def _call(handle, flags, self_attention, key_is_value, attn_mask_wrap):
    from .torch import _Call

    module = _modules[handle]
    need_weights, average, is_causal, training, seed, offset = flags
    kwargs = dict(is_causal=bool(is_causal), average_attn_weights=bool(average),
                  training=bool(training), seed=int(seed), offset=int(offset))
    if attn_mask_wrap:
        kwargs["attn_mask_wrap"] = {"attend": bool(attn_mask_wrap & 1),
                                    "per_batch": bool(attn_mask_wrap & 2)}
    return _Call(module, module._layer(), kwargs, bool(self_attention), bool(key_is_value),
                 bool(need_weights))


@torch.library.custom_op("clmha::attention", mutates_args=())
def attention(handle: int, query: Tensor, key: Tensor, value: Tensor,
              key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor],
              params: List[Tensor], flags: List[int], self_attention: int, key_is_value: int,
              attn_mask_wrap: int, want_saved: int) -> Tuple[Tensor, Tensor, Tensor]:
    from .torch import _forward

    call = _call(handle, flags, self_attention, key_is_value, attn_mask_wrap)
    out, weights = _forward(call, query, key, value, key_padding_mask, attn_mask,
                            bool(want_saved))
    token = 0
    if call.saved is not None:
        token = next(_tokens)
        _saved[token] = call
    return out, weights, torch.tensor(token, dtype=torch.int64)


@attention.register_fake
def _(handle, query, key, value, key_padding_mask, attn_mask, params, flags, self_attention,
      key_is_value, attn_mask_wrap, want_saved):
    module = _modules[handle]
    out = query.new_empty(tuple(query.shape[:-1]) + (module.embed_dim,))
    need_weights, average = flags[0], flags[1]
    if not need_weights:
        weights = query.new_empty(0)
    else:
        batched = query.dim() == 3
        bf = module.batch_first and batched
        n = (query.shape[0] if bf else query.shape[1]) if batched else None
        l_ = query.shape[1] if bf else query.shape[0]
        s = (key.shape[1] if bf else key.shape[0]) + int(module.bias_k is not None) + \
            int(module.add_zero_attn)
        shape = ((n,) if batched else ()) + (() if average else (module.num_heads,)) + (l_, s)
        weights = query.new_empty(shape)
    return out, weights, query.new_empty((), dtype=torch.int64)


@torch.library.custom_op("clmha::attention_backward", mutates_args=())
def attention_backward(token: Tensor, grad_output: Tensor, grad_weights: Optional[Tensor],
                       query: Tensor, key: Tensor, value: Tensor,
                       key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor],
                       params: List[Tensor], need: List[int]) -> List[Tensor]:
    from .torch import _backward

    call = _saved.pop(int(token))
    grads = _backward(call, grad_output, grad_weights, [bool(x) for x in need])
    inputs = [query, key, value, key_padding_mask, attn_mask] + list(params)
    # The fake kernel's shapes: a needed gradient clmha leaves out (key and value in
    # self-attention, whose gradient is all in query's) is zeros.
    return [(g if g is not None else torch.zeros_like(x)) if (x is not None and n)
            else query.new_empty(0) for g, x, n in zip(grads, inputs, need)]


@attention_backward.register_fake
def _(token, grad_output, grad_weights, query, key, value, key_padding_mask, attn_mask, params,
      need):
    inputs = [query, key, value, key_padding_mask, attn_mask] + list(params)
    return [torch.empty_like(x) if (x is not None and n) else query.new_empty(0)
            for x, n in zip(inputs, need)]


def _setup_context(ctx, inputs, output):
    (handle, query, key, value, key_padding_mask, attn_mask, params, flags, self_attention,
     key_is_value, attn_mask_wrap, want_saved) = inputs
    ctx.save_for_backward(output[2], query, key, value,
                          *(t if t is not None else query.new_empty(0)
                            for t in (key_padding_mask, attn_mask)), *params)
    ctx.has_masks = (key_padding_mask is not None, attn_mask is not None)
    ctx.n_params = len(params)


def _backward_formula(ctx, grad_output, grad_weights, grad_token):
    token, query, key, value, kpm, am, *params = ctx.saved_tensors
    kpm = kpm if ctx.has_masks[0] else None
    am = am if ctx.has_masks[1] else None
    need = [1, 1, 1, int(kpm is not None and kpm.is_floating_point()),
            int(am is not None and am.is_floating_point())] + [1] * ctx.n_params
    grads = attention_backward(token, grad_output, grad_weights, query, key, value, kpm, am,
                               params, need)
    g = [x if x.numel() else None for x in grads]
    return (None, g[0], g[1], g[2], g[3], g[4], g[5:], None, None, None, None, None)


attention.register_autograd(_backward_formula, setup_context=_setup_context)
