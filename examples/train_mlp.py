"""Train a 2-layer MLP with MXFP8 forward and backward matmuls; compare with float32.

Run: ``python examples/train_mlp.py`` (CPU, 15-30 s; ``--steps`` to change).

The task is synthetic: 64-dimensional Gaussian inputs labelled (16 classes) by a fixed random
teacher MLP, a fresh batch every step. The student, 64 → 256 → 16 with ReLU, is trained
with Adam (cosine learning-rate decay) on the cross-entropy, three ways, from the same
initialization and on the same batches:

* ``fp32``: float32 matmuls (``lowprec.matmul`` with no formats = a float32 dot);
* ``mxfp8``: every matmul MXFP8 E4M3 (scale rule ``rceil``, as NVIDIA's MXFP8 recipe), in
  the forward pass and in both backward matmuls (``backward="quantized"``): the cotangent
  and the re-quantized operands are blocked along each backward dot's own reduction axis
  (grad_input over output features, grad_weight over tokens);
* ``mxfp4 fwd``: MXFP4 operands in the forward pass, MXFP8 in the backward pass — a much
  coarser format, to show what a visible gap looks like.

``pad=True`` because the last layer has 16 outputs: grad_input of that layer reduces over
them, fewer than one 32-element block (zero padding adds nothing to the sums).
Weights and optimizer state stay in float32 (master weights), as in MX training recipes.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from lowprec import matmul

D_IN, HIDDEN, CLASSES, BATCH = 64, 256, 16, 128

CONFIGS = {
    "fp32": {},
    "mxfp8": dict(
        lhs_format="mxfp8_e4m3", rhs_format="mxfp8_e4m3", scale_rule="rceil",
        backward="quantized", grad_format="mxfp8_e4m3", pad=True,
    ),
    "mxfp4 fwd": dict(
        lhs_format="mxfp4", rhs_format="mxfp4", scale_rule="rceil",
        backward="quantized", grad_format="mxfp8_e4m3", pad=True,
    ),
}


def init(key):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (D_IN, HIDDEN)) * (2 / D_IN) ** 0.5,
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, CLASSES)) * (1 / HIDDEN) ** 0.5,
        "b2": jnp.zeros(CLASSES),
    }


def forward(params, x, mm):
    h = jax.nn.relu(mm(x, params["w1"]) + params["b1"])
    return mm(h, params["w2"]) + params["b2"]


def loss_fn(params, x, y, mm):
    logits = forward(params, x, mm)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def make_teacher(key):
    """A fixed random teacher MLP (64 → 32 → 16, tanh) that labels Gaussian inputs."""
    k1, k2 = jax.random.split(key)
    return jax.random.normal(k1, (D_IN, 32)) / D_IN**0.5, jax.random.normal(k2, (32, CLASSES)) / 32**0.5


def make_batch(teacher, key, n=BATCH):
    x = jax.random.normal(key, (n, D_IN))
    t1, t2 = teacher
    return x, jnp.argmax(jnp.tanh(x @ t1) @ t2, axis=1)


def adam_update(params, grads, state, step, lr, b1=0.9, b2=0.999, eps=1e-8):
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
    t = step + 1
    upd = jax.tree.map(lambda m, v: lr * (m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps), m, v)
    return jax.tree.map(lambda p, u: p - u, params, upd), {"m": m, "v": v}


def train(config: dict, steps: int, teacher, seed: int = 0):
    """Returns (per-step losses, final params). Every step draws a fresh batch (step-keyed,
    so all configurations see the same batches): no data is reused, nothing overfits."""
    mm = functools.partial(matmul, **config)

    @jax.jit
    def step_fn(params, state, step):
        xb, yb = make_batch(teacher, jax.random.fold_in(jax.random.key(1), step))
        loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb, mm)
        lr = 3e-3 * 0.5 * (1 + jnp.cos(jnp.pi * step / steps))  # cosine decay to 0
        params, state = adam_update(params, grads, state, step, lr)
        return params, state, loss

    params = init(jax.random.key(seed))
    state = {"m": jax.tree.map(jnp.zeros_like, params), "v": jax.tree.map(jnp.zeros_like, params)}
    losses = []
    for s in range(steps):
        params, state, loss = step_fn(params, state, s)
        losses.append(float(loss))
    return np.array(losses), params


def accuracy(params, x, y, config) -> float:
    logits = forward(params, x, functools.partial(matmul, **config))
    return float(jnp.mean(jnp.argmax(logits, axis=1) == y))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()

    teacher = make_teacher(jax.random.key(42))
    x_test, y_test = make_batch(teacher, jax.random.key(7), 8192)  # held out

    print(f"jax {jax.__version__} on {jax.default_backend()}; {args.steps} steps of batch {BATCH}\n")
    curves, finals = {}, {}
    for name, config in CONFIGS.items():
        t0 = time.perf_counter()
        losses, params = train(config, args.steps, teacher)
        curves[name] = losses
        finals[name] = (accuracy(params, x_test, y_test, config), time.perf_counter() - t0)

    window = 20  # mean over the last `window` steps smooths batch-to-batch noise
    names = list(CONFIGS)
    print("train loss (mean of the previous %d steps)" % window)
    print(f"  {'step':>5} " + " ".join(f"{n:>10}" for n in names))
    every = max(args.steps // 10, window)
    for s in range(every, args.steps + 1, every):
        row = " ".join(f"{curves[n][s - window:s].mean():10.4f}" for n in names)
        print(f"  {s:>5} {row}")
    ref = curves["fp32"][-window:].mean()
    print("\nfinal (mean of last %d)    loss   vs fp32   test acc   time" % window)
    for n in names:
        final = curves[n][-window:].mean()
        acc, secs = finals[n]
        print(f"  {n:>10}   {final:10.4f}   {final - ref:+8.4f}   {acc:8.3f}   {secs:5.1f}s")


if __name__ == "__main__":
    main()
