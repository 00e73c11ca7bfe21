"""Run by tools/python-wheel.sh in a plain venv holding the repaired wheel and clmha[pocl]:
the device must be PyPI's PoCL (the private vendors folder of clmha/_driver.py), and a forward
pass with a mask and averaged weights must match a NumPy float64 reference to 1e-4."""

import os
import sys

import numpy as np

import clmha

devices = clmha.devices()
print("devices:", [str(d) for d in devices], "OCL_ICD_VENDORS:", os.environ.get("OCL_ICD_VENDORS"))
assert "clmha-icd" in os.environ.get("OCL_ICD_VENDORS", ""), "PyPI's PoCL was not registered"
assert len(devices) == 1 and "Portable Computing Language" in devices[0].platform_name

rng = np.random.default_rng(7)
E, H, L, N = 16, 4, 9, 2
D = E // H
layer = clmha.Layer(E, H)
params = {n: rng.normal(0, 0.3, layer[n].shape) for n in layer.parameter_names()}
for n, v in params.items():
    layer[n] = v.astype(np.float32)
x = rng.standard_normal((L, N, E)).astype(np.float32)
pad = np.zeros((N, L), bool)
pad[1, -3:] = True
out, w = layer.forward(x, key_padding_mask=pad, need_weights=True)

# float64 reference of nn.MultiheadAttention's forward
x64 = x.astype(np.float64).transpose(1, 0, 2)          # (N, L, E)
p = {n: v.astype(np.float32).astype(np.float64) for n, v in params.items()}
qkv = x64 @ p["in_proj_weight"].T + p["in_proj_bias"]
q, k, v = (qkv[..., i * E:(i + 1) * E].reshape(N, L, H, D).transpose(0, 2, 1, 3) for i in range(3))
s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D) + np.where(pad, -np.inf, 0)[:, None, None, :]
a = np.exp(s - s.max(-1, keepdims=True))
a /= a.sum(-1, keepdims=True)
o = (a @ v).transpose(0, 2, 1, 3).reshape(N, L, E) @ p["out_proj.weight"].T + p["out_proj.bias"]
err_o = np.abs(out - o.transpose(1, 0, 2)).max()
err_w = np.abs(w - a.mean(1)).max()
print(f"wheel on {devices[0].device_name} (driver {devices[0].driver_version}): max |output - "
      f"reference| {err_o:.3g}, max |weights - reference| {err_w:.3g}")
sys.exit(0 if err_o <= 1e-4 and err_w <= 1e-4 else 1)
