"""The parameter names of the three attention modules clmha reads, mapped to PyTorch's.

- ``nn.MultiheadAttention``: in_proj_weight (or q/k/v_proj_weight), in_proj_bias,
  out_proj.weight, out_proj.bias, bias_k, bias_v.
- continuiti's ``MultiHeadAttention``: query_project, key_project, value_project, out_project
  (``nn.Linear``, all with or all without bias).
- the classic split-heads module: w_q, w_k, w_v, w_concat (``nn.Linear`` with bias).

An ``alibi_slopes`` entry (the ALiBi slopes of a clmha layer or module) and a ``sinks`` entry
(its attention sinks) go along with any of them under their own names.
"""

from typing import Dict, Tuple

import numpy as np

_SEED_SETS = {
    "continuiti": ("query_project", "key_project", "value_project", "out_project"),
    "classic": ("w_q", "w_k", "w_v", "w_concat"),
}
_TORCH_NAMES = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
                "in_proj_bias", "out_proj.weight", "out_proj.bias", "bias_k", "bias_v")


def _array(value) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        value = value.numpy()
    return np.asarray(value)


def name_set(names) -> str:
    """"torch", "continuiti" or "classic" for a set of parameter names (prefix removed)."""
    found = set()
    for n in names:
        if n in ("alibi_slopes", "sinks"):  # clmha's own, with any of them
            continue
        if n in _TORCH_NAMES:
            found.add("torch")
        for kind, modules in _SEED_SETS.items():
            if n.split(".")[0] in modules and n.endswith((".weight", ".bias")):
                found.add(kind)
    if len(found) != 1:
        raise KeyError(f"the parameters {sorted(names)} are not those of one attention module "
                       f"(nn.MultiheadAttention, continuiti's MultiHeadAttention or the "
                       f"classic w_q/w_k/w_v/w_concat module)" + (
                           f": they mix {sorted(found)}" if found else ""))
    return found.pop()


def translate(state_dict, num_heads: int, prefix: str = "") -> Tuple[dict, Dict[str, np.ndarray]]:
    """The layer configuration (Layer's keyword arguments, batch_first included) and the
    parameters under PyTorch's names, from a ``state_dict()`` of any of the three modules."""
    entries = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if not entries:
        raise KeyError(f"no parameter name starts with the prefix {prefix!r}")
    kind = name_set(entries.keys())
    params = {}
    for own in ("alibi_slopes", "sinks"):
        if own in entries:
            params[own] = _array(entries.pop(own))
    if kind == "torch":
        for k, v in entries.items():
            if k in _TORCH_NAMES:
                params[k] = _array(v)
            elif not prefix:
                raise KeyError(f"unexpected parameter {k!r} in an nn.MultiheadAttention "
                               f"state_dict")
        if "out_proj.weight" not in params:
            raise KeyError("out_proj.weight is missing")
        embed_dim = params["out_proj.weight"].shape[0]
        if "in_proj_weight" in params:
            kdim = vdim = embed_dim
            kv = embed_dim
        else:
            kdim = params["k_proj_weight"].shape[1]
            vdim = params["v_proj_weight"].shape[1]
            kv = params["k_proj_weight"].shape[0]
        head_dim = embed_dim // num_heads if num_heads else 0
        config = dict(embed_dim=embed_dim, kdim=kdim, vdim=vdim,
                      bias="in_proj_bias" in params, add_bias_kv="bias_k" in params,
                      num_kv_heads=(kv // head_dim) if head_dim and kv != embed_dim else None,
                      batch_first=False)
        return config, params
    q, k, v, o = _SEED_SETS[kind]
    get = lambda n: _array(entries[n])  # noqa: E731
    expected = {f"{m}.weight" for m in (q, k, v, o)}
    has_bias = f"{q}.bias" in entries
    if has_bias:
        expected |= {f"{m}.bias" for m in (q, k, v, o)}
    missing = sorted(expected - set(entries))
    extra = sorted(n for n in entries if n not in expected and
                   n.split(".")[0] in (q, k, v, o))
    if missing or extra:
        raise KeyError(f"{kind} module parameters: missing {missing}, unexpected {extra}")
    w = [get(f"{m}.weight") for m in (q, k, v)]
    embed_dim = w[0].shape[0]
    if all(x.shape == (embed_dim, embed_dim) for x in w):
        params["in_proj_weight"] = np.concatenate(w, 0)
    else:
        params["q_proj_weight"], params["k_proj_weight"], params["v_proj_weight"] = w
    params["out_proj.weight"] = get(f"{o}.weight")
    if has_bias:
        params["in_proj_bias"] = np.concatenate([get(f"{m}.bias") for m in (q, k, v)])
        params["out_proj.bias"] = get(f"{o}.bias")
    config = dict(embed_dim=embed_dim, kdim=w[1].shape[1], vdim=w[2].shape[1], bias=has_bias,
                  add_bias_kv=False, num_kv_heads=None, batch_first=True)
    return config, params
