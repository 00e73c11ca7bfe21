#!/usr/bin/env python3
"""Train a tiny transformer block whose attention is clmha's, with torch.optim, on the CPU.

    pip install .                                   # from the repository root: the clmha package
    python3 examples/python_train.py                # 300 steps, ~10 s on 2 CPU cores
    python3 examples/python_train.py --compare      # also torch.nn.MultiheadAttention, same start

The task is copying: each sequence is K random symbols, a separator, then the same K symbols
again, and the model predicts every next token of the second half (after the separator, the
token K + 1 places back). One causal self-attention layer with learned positions can do it by
attending a fixed distance back; nothing else in the block can, so the task is learnt only if
clmha's forward and its backward pass (the gradients autograd gets from
clmha.torch.MultiheadAttention) are right.

The model: token and position embeddings, clmha.torch.MultiheadAttention (batch_first, causal
mask, need_weights=False: clmha's fused core), a residual feed-forward block, an output Linear;
Adam. The script prints the loss every --log-every steps and the accuracy on a fresh batch, and
exits 0 when the accuracy is at least --threshold (0.95 by default), else 1. With --compare the
same model with torch.nn.MultiheadAttention in its place starts from the same weights (a
state_dict copy: clmha's module is a subclass with PyTorch's parameter names), sees the same
batches, and both losses are printed side by side (the two modules' float32 rounding differs, so
they may part in the last digits; the largest difference is printed); the exit status is still
clmha's.

clmha runs on $CLMHA_DEVICE, else the first GPU, else the first OpenCL device (PoCL on a CPU).
"""

import argparse
import sys
import time
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

import clmha.torch


class Block(nn.Module):
    """Embeddings, one causal self-attention layer and a feed-forward layer (both residual),
    and the output projection to the vocabulary."""

    def __init__(self, vocab: int, length: int, dim: int, heads: int, attention: type):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(length, dim)
        self.attn = attention(dim, heads, batch_first=True)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.ReLU(), nn.Linear(4 * dim, dim))
        self.out = nn.Linear(dim, vocab)
        # True above the diagonal: a position may not look at later ones (PyTorch's polarity).
        self.register_buffer("causal", torch.triu(torch.ones(length, length, dtype=torch.bool),
                                                  diagonal=1))

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        h = self.tokens(x) + self.positions(torch.arange(t))
        a = self.norm1(h)
        h = h + self.attn(a, a, a, attn_mask=self.causal[:t, :t], need_weights=False)[0]
        h = h + self.ff(self.norm2(h))
        return self.out(h)


def batch(gen: torch.Generator, size: int, k: int, symbols: int) -> Tuple[Tensor, Tensor]:
    """Inputs (size, 2K) = [a_1..a_K, SEP, a_1..a_(K-1)] and the targets of the second half's
    positions (size, K) = a_1..a_K. SEP is the symbol `symbols`."""
    a = torch.randint(0, symbols, (size, k), generator=gen)
    sep = torch.full((size, 1), symbols, dtype=torch.long)
    return torch.cat([a, sep, a[:, :-1]], dim=1), a


def loss_and_accuracy(model: nn.Module, x: Tensor, y: Tensor, k: int) -> Tuple[Tensor, float]:
    logits = model(x)[:, k:, :]  # the predictions made from the separator onwards
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    accuracy = (logits.argmax(-1) == y).float().mean().item()
    return loss, accuracy


def train(models: List[nn.Module], args: argparse.Namespace) -> Tuple[List[float], float]:
    """Trains every model of @p models side by side for args.steps steps, each with its own Adam,
    on the same batches (from args.seed), printing their losses every args.log_every steps;
    returns each model's accuracy on 1024 held-out sequences and the largest difference between
    the models' losses at one step (0 for one model)."""
    gen = torch.Generator().manual_seed(args.seed)
    optimizers = [torch.optim.Adam(m.parameters(), lr=args.lr) for m in models]
    largest = 0.0
    for step in range(1, args.steps + 1):
        x, y = batch(gen, args.batch, args.k, args.symbols)
        losses = []
        for model, opt in zip(models, optimizers):
            loss, _ = loss_and_accuracy(model, x, y, args.k)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        largest = max(largest, max(losses) - min(losses))
        if step % args.log_every == 0 or step == 1:
            print(f"{step:>6}" + "".join(f"  {v:>10.4f}" for v in losses), flush=True)
    x, y = batch(torch.Generator().manual_seed(args.seed + 1), 1024, args.k, args.symbols)
    accuracies = []
    for model in models:
        model.eval()
        with torch.no_grad():
            accuracies.append(loss_and_accuracy(model, x, y, args.k)[1])
    return accuracies, largest


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Train a tiny copy-task transformer block whose "
                                 "attention is clmha.torch.MultiheadAttention.")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--k", type=int, default=16, help="symbols to copy (sequence length 2K)")
    ap.add_argument("--symbols", type=int, default=20, help="alphabet size")
    ap.add_argument("--dim", type=int, default=64, help="embed_dim")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--threshold", type=float, default=0.95,
                    help="accuracy on a held-out batch needed to exit 0 (default 0.95)")
    ap.add_argument("--compare", action="store_true",
                    help="also train torch.nn.MultiheadAttention from the same weights")
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    vocab, length = args.symbols + 1, 2 * args.k
    model = Block(vocab, length, args.dim, args.heads, clmha.torch.MultiheadAttention)
    reference = None
    if args.compare:
        reference = Block(vocab, length, args.dim, args.heads, nn.MultiheadAttention)
        reference.load_state_dict(model.state_dict())  # the same names: the same start

    print(f"copy task: {args.k} symbols of {args.symbols}, {args.steps} steps of batch "
          f"{args.batch}, embed_dim {args.dim}, {args.heads} heads, Adam lr {args.lr}")
    models = [model] + ([reference] if reference is not None else [])
    names = ["clmha"] + (["torch"] if reference is not None else [])
    print(f"{'step':>6}" + "".join(f"  {n + ' loss':>10}" for n in names))
    t0 = time.perf_counter()
    accuracies, largest = train(models, args)
    seconds = time.perf_counter() - t0
    for name, acc in zip(names, accuracies):
        print(f"{name}: accuracy {acc:.3f} on 1024 held-out sequences")
    if len(models) > 1:
        print(f"largest |clmha loss - torch loss| at one step: {largest:.2e}")
    print(f"{seconds:.1f} s for {len(models)} model{'s' if len(models) > 1 else ''}")
    accuracy = accuracies[0]
    learnt = accuracy >= args.threshold
    print(f"{'learnt' if learnt else 'NOT learnt'}: accuracy {accuracy:.3f} "
          f"{'>=' if learnt else '<'} {args.threshold}")
    return 0 if learnt else 1


if __name__ == "__main__":
    sys.exit(main())
