"""clmha.numpy: attention as a function on NumPy arrays (and pyopencl arrays).

    import numpy as np, clmha.numpy
    q = np.random.randn(2, 8, 10, 64).astype(np.float32)          # (N, H, L, D)
    k = v = np.random.randn(2, 2, 12, 64).astype(np.float32)      # (N, H_kv, S, D)
    out = clmha.numpy.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

``scaled_dot_product_attention`` has the arguments and semantics of PyTorch's
``torch.nn.functional.scaled_dot_product_attention`` (torch 2.5) and computes on clmha's OpenCL
device (``clmha_attention_forward_host``); ``scaled_dot_product_attention_backward`` gives the
gradients (``clmha_attention_backward_host``). With ``kv_cache=clmha.KVCache.for_attention(...)``
it decodes incrementally (key and value are the new tokens, appended to the cache).
Given ``pyopencl.array.Array`` inputs and ``context=clmha.Context.from_pyopencl(ctx, queue)``,
the same two functions run on the arrays' buffers (``clmha_attention_forward`` /
``clmha_attention_backward``: no host copy, the arrays' events as the wait list) and return
pyopencl arrays carrying the call's event.
``clmha.Layer`` is the whole ``nn.MultiheadAttention`` layer on NumPy arrays.
"""

from typing import Optional, Sequence, Tuple, Union

import numpy as np

from ._context import Context
from ._layer import KVCache
from ._sdpa import Call, alibi_slopes


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 return_lse: bool = False, return_weights: bool = False,
                                 layout: str = "NHLD", seed: int = 0, offset: int = 0,
                                 impl: str = "auto", context: Optional[Context] = None,
                                 kv_cache: Optional[KVCache] = None,
                                 kv_append: Optional[Sequence[int]] = None,
                                 window: Optional[Tuple[int, int]] = None,
                                 softcap: Optional[float] = None, alibi: bool = False,
                                 alibi_slopes=None, sinks=None, score_mod: Optional[str] = None,
                                 mask_mod: Optional[str] = None, mod_params=None,
                                 seq_lens: Optional[Sequence[int]] = None,
                                 kv_seq_lens: Optional[Sequence[int]] = None
                                 ) -> Union[np.ndarray, Tuple[np.ndarray, ...]]:
    """softmax(query · keyᵀ · scale + attn_mask) · value on clmha's OpenCL device, as PyTorch's
    ``F.scaled_dot_product_attention`` computes it.

    :param query: (..., H, L, D): (N, H, L, D), (H, L, D), (L, D), or more leading dimensions.
    :param key: (..., H_kv, S, D), the query's number of dimensions and leading sizes.
    :param value: (..., H_kv, S, D_v) (D_v may differ from D).
    :param attn_mask: None, or an array broadcasting to (..., H, L, S): bool (True = may
        attend) or floating point (added to the scaled scores; -inf forbids).
    :param dropout_p: probability in [0, 1) of dropping an attention weight (kept weights are
        scaled by 1/(1 - dropout_p)), drawn from clmha's Philox stream (``seed``, ``offset``),
        not NumPy's or PyTorch's generator.
    :param is_causal: query i attends to keys j <= i (top-left aligned when L != S); not
        together with attn_mask.
    :param scale: the scores' factor; None: 1/sqrt(D).
    :param enable_gqa: grouped-query attention: H_kv may divide H (query head h reads key/value
        head h // (H / H_kv)); without it H_kv must equal H.
    :param return_lse: also return the log-sum-exp of each score row, shape (..., H, L) in
        either layout (both cores write them; -inf for a fully masked row).
    :param return_weights: also return the attention weights (after dropout), shape
        (..., H, L, S) in either layout; asking for them runs the unfused core.
    :param layout: "NHLD" (PyTorch's order, the default) or "NLHD" (FlashAttention's
        ``flash_attn_func``: query (..., L, H, D), key (..., S, H_kv, D), value
        (..., S, H_kv, D_v), output (..., L, H, D_v)); attn_mask still broadcasts to
        (..., H, L, S).
    :param seed: the dropout's Philox key (same seed and offset: same dropout).
    :param offset: part of the dropout's Philox counter (e.g. one more per call).
    :param impl: the core: "auto" (fused where it runs), "fused" or "unfused" (the backward's
        too: "auto" takes the unfused one for a float mask's gradient).
    :param context: the ``clmha.Context`` to run on; default: ``kv_cache``'s context with a
        cache, else ``clmha.default_context()``.
    :param kv_cache: the KV-cache form (incremental decoding, as FlashAttention's
        ``flash_attn_with_kvcache``): a ``clmha.KVCache.for_attention(N, H_kv, D, capacity)``.
        key and value are then the new tokens (..., H_kv, S_new, D), appended after each
        sequence's cached ones, and the queries attend over everything the cache then holds for
        their sequence; is_causal is bottom-right aligned (new query i of a sequence that held
        ``len`` tokens sees cache positions 0 .. len + i). Such a call takes no attn_mask,
        dropout, return_lse or D_v != D (``clmha.Error``) and has no backward.
    :param kv_append: with kv_cache, N counts (a list; an int when N is 1): how many of each
        sequence's S_new new tokens (the first ones) are real and appended (ragged batches);
        None: all of them.
    :param window: None, or a sliding window (left, right) (FlashAttention's window_size):
        query i attends key j only when i - left <= j <= i + right, -1 leaving a side
        unbounded; with kv_cache, i is the sequence's cached length + the new query's row. It
        combines with attn_mask and is_causal. Bad bounds raise TypeError / ValueError.
    :param softcap: logit soft-capping (Gemma 2's, FlashAttention's softcap): None or 0 is off;
        c > 0 turns every scaled score s into c * tanh(s / c), before ALiBi and attn_mask. A
        negative, NaN or infinite softcap raises ValueError.
    :param alibi: ALiBi (BLOOM's, MPT's): the score of query head h at position i against key j
        gains -slope_h * |i - j| (after soft-capping, before attn_mask); with kv_cache, i is
        the sequence's cached length + the new query's row.
    :param alibi_slopes: with alibi, the H slopes (an array (H,); a float32 pyopencl array in
        the device form); None: the geometric slopes of ``clmha.numpy.alibi_slopes(H)``. Given
        without alibi, or not (H,), it raises ValueError.
    :param sinks: None, or attention sinks (gpt-oss's): an array (H,) (a float32 pyopencl
        array in the device form), one logit per query head added to each row's softmax
        denominator with a zero value: P_ij = exp(s_ij - m) / (exp(sinks_h - m) +
        sum_j exp(s_ij - m)), so a row's weights sum below 1, the lse includes the sink, and a
        fully masked row still gives zeros. Not (H,): ValueError.
    :param score_mod: None, or a user score function (FlexAttention's score_mod), OpenCL C
        source defining ``clmha_real clmha_score_mod(clmha_real s, int b, int h, int q, int k,
        __global const float *p)`` and, for the backward, its derivative in s
        ``clmha_score_mod_grad`` (same arguments): b the batch item, h the query head, q the
        query position (with kv_cache, the cached length + the new query's row), k the key; it
        gives the new score, after soft-capping and ALiBi, before attn_mask and the masks.
        clmha_real is float. Compiled into the kernels (once per context and source); a source
        that does not compile raises ``clmha.Error`` (BUILD_FAILED) with the build log.
    :param mask_mod: None, or a user mask function (FlexAttention's mask_mod), OpenCL C source
        defining ``int clmha_mask_mod(int b, int h, int q, int k, __global const float *p)``,
        non-zero where query q may attend key k; it combines with attn_mask, is_causal and the
        window. score_mod's and mask_mod's sources are joined into one program.
    :param mod_params: None, or p of those functions: a 1-D floating-point array (count,)
        (read as float32; a float32 pyopencl array in the device form). Given without score_mod
        or mask_mod, not floating point or not 1-D: ValueError / TypeError. The functions'
        reads of p are not bounds-checked. Differences from FlexAttention: the functions are
        OpenCL C source strings, not Python callables; their captured tensors are the one float
        array p; the score's derivative is written by hand (without clmha_score_mod_grad the
        backward raises ``clmha.Error`` UNSUPPORTED).
    :param seq_lens: a packed batch (FlashAttention's ``flash_attn_varlen_func``): query
        (T, H, D), key and value (T_kv, H_kv, D / D_v), whatever ``layout``, the sequences one
        after another (T the sum of seq_lens); each attends only within itself; output
        (T, H, D_v); the lse (H * T,) holds each sequence's (H, L_i) block in turn. No
        attn_mask, return_weights or kv_cache with it.
    :param kv_seq_lens: with seq_lens, the key/value lengths; None: seq_lens.
    :returns: the output (..., H, L, D_v) (in the query's layout), or a tuple of it, the lse
        (with ``return_lse``) and the weights (with ``return_weights``), in that order.

    Arrays are float32 or float64, each computed in its dtype (float64 on a device with double
    precision: ``clmha_attention_forward_host_f64``); float16 is computed in float32 and
    returned as float16; other dtypes raise TypeError. Arrays that
    are not C-contiguous are copied. A query row whose every key is masked gives zeros (PyTorch
    gives NaN). Bad shapes and options raise ``clmha.Error`` with the C library's message.

    **Device form.** The function dispatches on the arrays' type: when query, key and value are
    ``pyopencl.array.Array`` (all three: a mix with NumPy arrays raises TypeError) it runs
    ``clmha_attention_forward`` on their buffers (a view's ``offset`` into ``base_data`` is
    honoured), on ``context``, which must be a ``clmha.Context.from_pyopencl(ctx, queue)`` of
    the arrays' OpenCL context (else ValueError). The call waits for the arrays' events
    and enqueues on that context's queue without waiting on the host; the results are new
    float32 pyopencl arrays whose ``events`` hold the call's event (so ``.get()`` or a later
    pyopencl kernel waits for it), and that event is added to the inputs too (they must not
    change before it completes). Arrays are float32 and C-contiguous (float64, float16 or
    non-contiguous arrays raise TypeError/ValueError: nothing is copied). attn_mask: a pyopencl
    array (bool or uint8, non-zero = may attend, or float32) in a shape the C function reads
    ((L, S), (N, 1, L, S), (H, L, S), (N, H, L, S), (N, 1, 1, S), with leading ones allowed),
    or a NumPy array of any broadcasting shape (expanded where needed and uploaded).
    """
    call = Call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                seed=seed, offset=offset, impl=impl, context=context, kv_cache=kv_cache,
                kv_append=kv_append, layout=layout, window=window, softcap=softcap,
                alibi=alibi, alibi_slopes=alibi_slopes, sinks=sinks, score_mod=score_mod,
                mask_mod=mask_mod, mod_params=mod_params, seq_lens=seq_lens,
                kv_seq_lens=kv_seq_lens)
    return call.forward(lse=bool(return_lse), weights=bool(return_weights))


def scaled_dot_product_attention_backward(grad_output, query, key, value, attn_mask=None,
                                          dropout_p=0.0, is_causal=False, scale=None,
                                          enable_gqa=False, *, layout: str = "NHLD",
                                          seed: int = 0, offset: int = 0, impl: str = "auto",
                                          context: Optional[Context] = None, output=None,
                                          lse=None, window: Optional[Tuple[int, int]] = None,
                                          softcap: Optional[float] = None, alibi: bool = False,
                                          alibi_slopes=None, sinks=None,
                                          score_mod: Optional[str] = None,
                                          mask_mod: Optional[str] = None, mod_params=None,
                                          seq_lens: Optional[Sequence[int]] = None,
                                          kv_seq_lens: Optional[Sequence[int]] = None):
    """The gradients of ``scaled_dot_product_attention`` (the same arguments, after
    ``grad_output``, the output's gradient (..., H, L, D_v)): ``(grad_query, grad_key,
    grad_value, grad_attn_mask)``, each in its input's shape; ``grad_attn_mask`` is None unless
    attn_mask is floating point (then its gradient summed over the dimensions it is broadcast
    along). The forward pass runs again (the dropout replayed from ``seed`` and ``offset``);
    with enable_gqa a key/value head's gradient sums its query heads'. A fully masked query
    row gives zero gradients. ``window``, ``softcap``, ``alibi`` and ``alibi_slopes``: the
    forward's, as there (the slopes get no gradient). ``sinks``: the forward's; given, the
    result has a fifth entry, ``grad_sinks`` (H,) (clmha_attention_backward_host has no sinks
    output: the host form runs the host forward once more for its output and lse and computes
    -sum over each head's rows of exp(sinks_h - lse) * (grad_output . output) in float64, what
    the device backward's grad_sinks computes). ``score_mod``, ``mask_mod`` and
    ``mod_params``: the forward's; p gets no gradient, and a score_mod without
    clmha_score_mod_grad raises ``clmha.Error`` (UNSUPPORTED).

    **Device form** (pyopencl query, key, value and grad_output, as the forward's device form):
    ``clmha_attention_backward`` on the arrays' buffers; the gradients are new float32 pyopencl
    arrays carrying the call's event (a float mask's gradient too; for a NumPy mask that had to
    be expanded it is summed back on the host, which waits for the call, and uploaded).
    ``output`` (and ``lse``): the forward's results of this same call (pyopencl arrays), which
    spare the forward's second run; with ``lse`` the fused core's backward runs (impl "auto"),
    without it the unfused one. With sinks the device form's ``grad_sinks`` is
    ``clmha_attention_backward``'s (a new pyopencl array), which needs the lse: ``output``
    without ``lse`` is then a ValueError. Without ``output`` the forward runs again first, with its lse
    unless impl is "unfused" or a float mask's gradient is wanted (as the host form does).
    NumPy arrays take no ``output``/``lse`` (ValueError). ``seq_lens``, ``kv_seq_lens``: a
    packed batch, as the forward's."""
    call = Call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                seed=seed, offset=offset, impl=impl, context=context, layout=layout,
                window=window, softcap=softcap, alibi=alibi, alibi_slopes=alibi_slopes,
                sinks=sinks, score_mod=score_mod, mask_mod=mask_mod, mod_params=mod_params,
                seq_lens=seq_lens, kv_seq_lens=kv_seq_lens)
    return call.backward(grad_output, output=output, lse=lse)


__all__ = ["alibi_slopes", "scaled_dot_product_attention",
           "scaled_dot_product_attention_backward"]
