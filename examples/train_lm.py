"""Train a small character-level transformer LM in float32, bf16, MXFP8 and MXFP4 (CPU).

Run: ``python examples/train_lm.py`` (needs ``pip install -e '.[training]'``; the PNG also
needs matplotlib). Writes ``loss_curves.png``, ``final_losses.md`` and ``final_losses.json``
into ``--out`` (default ``out/train_lm/``). The full run takes a few minutes on a laptop CPU;
``--steps`` and the model-size flags make it shorter or longer.

Text: the English reference documentation that ships inside CPython (``pydoc_data.topics``,
what ``help("FOR")`` prints), about 465k characters; no download. The last 10% is held out.

Model: a decoder-only transformer written in plain Flax linen (``nn.Dense`` layers, causal
self-attention, pre-LayerNorm, GELU MLP), knowing nothing of lowprec. Every configuration
trains it from the same initialization on the same batches; only the recipe differs, applied
in one call with :func:`lowprec.flax.quantize_model`:

* ``fp32``: float32 matmuls;
* ``bf16``: every linear-layer matmul with bf16 operands and bf16 gradients (float32
  accumulation), the usual mixed-precision baseline;
* ``mxfp8_rceil``: :data:`lowprec.NVIDIA_MXFP8` (E4M3 everywhere, rceil scales);
* ``mxfp8_floor``: the same with the OCP ``floor`` scale rule;
* ``mxfp4_fwd``: MXFP4 forward operands, MXFP8 E4M3 backward (operands and gradients), rceil;
* not run by default (``--configs``): ``ocp_mxfp8``, ``fp8_hybrid``, ``nvfp4``
  (:data:`lowprec.NVIDIA_NVFP4`, LM head in fp32) and ``mxfp4`` (MXFP4 forward and
  backward).

A layer a recipe leaves in high precision (``high_precision``) runs as the model is written:
float32 here, so the printed description says "fp32".

``--seeds 3`` trains each configuration from three seeds (initialization and batches) and
reports mean ± sample standard deviation; curves and the CSV are the first seed's. Every
seed's final and held-out losses are printed, and the outputs rewritten, as that seed
finishes, so a long run's finished seeds are on disk before it ends.

Outputs also include ``losses.csv`` (per step: config, train loss, and the held-out loss at
every ``--eval-every`` steps), drawn as dashed held-out curves in the figure.

Recipes quantize the weight matmuls of the ``nn.Dense`` layers (attention projections, MLP,
LM head) in the forward and both backward dots; the attention score/value products and the
embedding stay float32, as in the published recipes. Parameters and Adam state are float32
(master weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import pathlib
import sys
import tempfile
import time
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import lowprec
import lowprec.flax

CONFIGS = {
    "fp32": None,
    "bf16": lowprec.Recipe(forward="bf16", grad="bf16", name="bf16"),
    "mxfp8_rceil": dataclasses.replace(lowprec.NVIDIA_MXFP8, name="mxfp8_rceil"),
    "mxfp8_floor": dataclasses.replace(lowprec.NVIDIA_MXFP8, scale_options={"scale_rule": "floor"},
                                       name="mxfp8_floor"),
    "mxfp4_fwd": lowprec.Recipe(
        forward="mxfp4", backward_operands="mxfp8_e4m3", grad="mxfp8_e4m3",
        scale_options={"scale_rule": "rceil"}, name="mxfp4_fwd",
    ),
    # Not in the default set; pass --configs to add them.
    "ocp_mxfp8": lowprec.OCP_MXFP8,
    "fp8_hybrid": lowprec.FP8_HYBRID,
    # NVIDIA's NVFP4 recipe (TE NVFP4BlockScaling), the LM head kept in high precision as the
    # paper keeps its last layers in BF16.
    "nvfp4": dataclasses.replace(lowprec.NVIDIA_NVFP4, high_precision=("lm_head",), name="nvfp4"),
    # MXFP4 everywhere: forward operands, backward operands and gradients (rceil scales).
    "mxfp4": lowprec.Recipe(forward="mxfp4", grad="mxfp4", scale_options={"scale_rule": "rceil"},
                            name="mxfp4"),
}
DEFAULT_CONFIGS = ("fp32", "bf16", "mxfp8_rceil", "mxfp8_floor", "mxfp4_fwd")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Model and run size. The defaults are the README's full run."""

    steps: int = 400
    batch: int = 32
    seq: int = 64
    d_model: int = 128
    heads: int = 4
    layers: int = 2
    lr: float = 3e-3
    eval_batches: int = 16
    seed: int = 0
    seeds: int = 1  # runs per config, seeds seed, seed + 1, ...: the table gives mean ± sd
    window: int = 50  # final train loss = mean of the last `window` steps
    eval_every: int = 50  # held-out loss every this many steps (and at the end)


# -- data -------------------------------------------------------------------------------------


def load_text() -> str:
    """CPython's pydoc topic texts (``pydoc_data.topics``), in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def encode_text(text: str):
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return np.array([index[c] for c in text], np.int32), vocab


def batch_at(data: np.ndarray, key, batch: int, seq: int):
    """``batch`` random windows of ``seq + 1`` characters (inputs, next-character targets)."""
    starts = jax.random.randint(key, (batch,), 0, len(data) - seq - 1)
    idx = starts[:, None] + jnp.arange(seq + 1)[None, :]
    windows = jnp.asarray(data)[idx]
    return windows[:, :-1], windows[:, 1:]


# -- model ------------------------------------------------------------------------------------


class Block(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x):
        t, d = x.shape[-2], x.shape[-1]
        h = nn.LayerNorm(name="ln_attn")(x)
        qkv = nn.Dense(3 * d, name="qkv")(h)
        q, k, v = jnp.split(qkv.reshape(*qkv.shape[:-1], 3 * self.heads, d // self.heads), 3, axis=-2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.heads)
        causal = jnp.tril(jnp.ones((t, t), bool))
        att = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(x.shape)
        x = x + nn.Dense(d, name="proj")(y)
        h = nn.LayerNorm(name="ln_mlp")(x)
        h = nn.Dense(4 * d, name="up")(h)
        return x + nn.Dense(d, name="down")(nn.gelu(h))


class CharLM(nn.Module):
    vocab: int
    seq: int
    d_model: int
    heads: int
    layers: int

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.d_model, name="embed")(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (self.seq, self.d_model))
        x = x + pos[: tokens.shape[-1]]
        for i in range(self.layers):
            x = Block(self.heads, name=f"block_{i}")(x)
        return nn.Dense(self.vocab, name="lm_head")(nn.LayerNorm(name="ln_f")(x))


def cross_entropy(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


# -- training ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _programs(recipe: Optional[lowprec.Recipe], s: Settings, vocab_size: int):
    """The float model, the optimizer and the jitted training step and held-out loss of one
    configuration: built once and shared by its seeds (``s`` has seed 0). The keys and the
    text are arguments, not constants baked into the programs, so a second seed compiles
    nothing and the compiler is not handed the 400k-character text as a literal. (The init
    stays eager: under jit, XLA fuses the normal initializers' scaling into other bits.)"""
    model = CharLM(vocab_size, s.seq, s.d_model, s.heads, s.layers)
    runner = model if recipe is None else lowprec.flax.quantize_model(model, recipe)
    schedule = optax.warmup_cosine_decay_schedule(0.0, s.lr, max(s.steps // 20, 1), s.steps, s.lr / 10)
    opt = optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=0.01)

    def loss_fn(p, x, y):
        return cross_entropy(runner.apply(p, x), y)

    @jax.jit
    def step(p, o, i, data, data_key):
        x, y = batch_at(data, jax.random.fold_in(data_key, i), s.batch, s.seq)
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        updates, o = opt.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss

    @jax.jit
    def eval_loss(p, data):
        def one(i):
            x, y = batch_at(data, jax.random.fold_in(jax.random.key(1234), i), s.batch, s.seq)
            return loss_fn(p, x, y)

        return jnp.mean(jax.lax.map(one, jnp.arange(s.eval_batches)))

    return model, opt, step, eval_loss


def train(recipe: Optional[lowprec.Recipe], s: Settings, data, vocab_size: int, progress=None):
    """Trains one configuration; returns (per-step train losses, held-out loss, seconds,
    {step: held-out loss} every ``s.eval_every`` steps and at the end)."""
    train_data, val_data = (jnp.asarray(d) for d in data)
    model, opt, step, eval_loss = _programs(recipe, dataclasses.replace(s, seed=0), vocab_size)
    init_key, data_key = jax.random.split(jax.random.key(s.seed))
    params = model.init(init_key, jnp.zeros((1, s.seq), jnp.int32))  # same init for all
    opt_state = opt.init(params)

    t0 = time.perf_counter()
    losses, curve = [], {}
    for i in range(s.steps):
        params, opt_state, loss = step(params, opt_state, i, train_data, data_key)
        losses.append(loss)
        if progress and (i + 1) % max(s.steps // 10, 1) == 0:
            progress(i + 1, float(loss))
        if (i + 1) % max(s.eval_every, 1) == 0 or i + 1 == s.steps:
            curve[i + 1] = eval_loss(params, val_data)
    losses = np.asarray(jax.device_get(losses), np.float64)
    curve = {k: float(v) for k, v in curve.items()}
    return losses, curve[s.steps], time.perf_counter() - t0, curve


def describe(recipe: Optional[lowprec.Recipe]) -> str:
    """The recipe's one-line description, naming what its high-precision layers run in here:
    float32 (the model's own dtype), hence "fp32"."""
    if recipe is None:
        return "float32 matmuls"
    text = recipe.describe()
    if recipe.high_precision:
        text = text.replace("high precision: ", "fp32: ")
    return text


def run(configs=DEFAULT_CONFIGS, settings: Settings = Settings(), verbose: bool = True,
        out: Optional[pathlib.Path] = None) -> dict:
    """Trains every configuration; returns ``{name: {"losses", "final", "val", "seconds",
    "finals", "vals", ...}}`` (``finals``/``vals``: every seed's). As each seed finishes, its
    numbers are printed (``verbose``) and, with ``out``, every output is rewritten with all
    the seeds finished so far."""
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configs {unknown}; choose from {sorted(CONFIGS)}")
    ids, vocab = encode_text(load_text())
    split = int(0.9 * len(ids))
    data = (ids[:split], ids[split:])
    results = {}
    for name in configs:
        recipe = CONFIGS[name]
        if verbose:
            print(f"[{name}] {describe(recipe)}", flush=True)
        progress = (lambda i, l, n=name: print(f"  step {i:5d}  loss {l:.4f}", flush=True)) if verbose else None
        finals, vals = [], []
        for k in range(max(settings.seeds, 1)):  # the first seed's curves are kept
            seed = settings.seed + k
            run_settings = dataclasses.replace(settings, seed=seed)
            losses_k, val_k, secs_k, curve_k = train(recipe, run_settings, data, len(vocab),
                                                     progress if k == 0 else None)
            if k == 0:
                losses, val, secs, curve = losses_k, val_k, secs_k, curve_k
            finals.append(float(losses_k[-settings.window:].mean()))
            vals.append(val_k)
            results[name] = {"losses": losses, "final": finals[0], "val": val, "seconds": secs,
                             "val_curve": curve, "finals": list(finals), "vals": list(vals)}
            if verbose:
                print(f"  seed {seed}: final train loss {finals[-1]:.4f}, held-out loss "
                      f"{val_k:.4f} ({secs_k:.0f} s)", flush=True)
            if out is not None:
                write_outputs(results, settings, out)
    return results


# -- output -----------------------------------------------------------------------------------


def _write_atomic(path: pathlib.Path, write) -> None:
    """Writes through a temporary file in the same directory, then renames it into place."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def table(results: dict, settings: Settings) -> str:
    ref = results.get("bf16", results.get("fp32"))
    ref_name = "bf16" if "bf16" in results else "fp32"
    lines = [
        f"| config | final train loss (mean of last {settings.window} steps) | held-out loss "
        f"| vs {ref_name} (held-out) | time |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if len(r.get("vals", ())) > 1:  # mean ± sample sd over seeds
            f, v = np.asarray(r["finals"]), np.asarray(r["vals"])
            rv = np.asarray(ref["vals"]) if ref else np.full_like(v, np.nan)
            lines.append(
                f"| {name} | {f.mean():.4f} ± {f.std(ddof=1):.4f} | {v.mean():.4f} ± "
                f"{v.std(ddof=1):.4f} | {v.mean() - rv.mean():+.4f} | {r['seconds']:.0f} s/seed |"
            )
            continue
        delta = r["val"] - ref["val"] if ref else float("nan")
        lines.append(
            f"| {name} | {r['final']:.4f} | {r['val']:.4f} | {delta:+.4f} | {r['seconds']:.0f} s |"
        )
    return "\n".join(lines) + "\n"


def write_outputs(results: dict, settings: Settings, out: pathlib.Path) -> list:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    md = table(results, settings)
    _write_atomic(out / "final_losses.md", lambda f: f.write(md.encode()))
    summary = {
        "settings": dataclasses.asdict(settings),
        "jax": jax.__version__,
        "results": {n: {k: v for k, v in r.items() if k not in ("losses", "val_curve")}
                    for n, r in results.items()},
    }
    _write_atomic(out / "final_losses.json", lambda f: f.write(json.dumps(summary, indent=2).encode()))
    rows = ["step,config,train_loss,heldout_loss"]
    for name, r in results.items():
        curve = r.get("val_curve", {})
        for i, loss in enumerate(r["losses"], 1):
            held = f"{curve[i]:.6f}" if i in curve else ""
            rows.append(f"{i},{name},{loss:.6f},{held}")
    csv = "\n".join(rows) + "\n"
    _write_atomic(out / "losses.csv", lambda f: f.write(csv.encode()))
    written += [out / "final_losses.md", out / "final_losses.json", out / "losses.csv"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss_curves.png (pip install matplotlib)")
        return written
    fig, ax = plt.subplots(figsize=(7, 4.2))
    w = max(settings.window // 5, 1)
    for name, r in results.items():
        smooth = np.convolve(r["losses"], np.ones(w) / w, mode="valid")
        line, = ax.plot(np.arange(len(smooth)) + w, smooth,
                        label=f"{name} (held-out {r['val']:.3f})", lw=1.2)
        curve = r.get("val_curve", {})
        if curve:
            ax.plot(list(curve), list(curve.values()), ls="--", marker=".", lw=1.0,
                    color=line.get_color())
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss: train (moving mean of {w}), held-out (dashed)")
    ax.set_title("char-level transformer on pydoc_data.topics")
    ax.set_ylim(top=min(ax.get_ylim()[1], 3.5))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    _write_atomic(out / "loss_curves.png", lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)
    return written + [out / "loss_curves.png"]


def main(argv=None) -> None:
    d = Settings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("out/train_lm"),
                        help="output directory (default out/train_lm)")
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS),
                        choices=sorted(CONFIGS), metavar="CONFIG",
                        help=f"from {sorted(CONFIGS)} (default: {' '.join(DEFAULT_CONFIGS)})")
    for field in dataclasses.fields(Settings):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(getattr(d, field.name)),
                            default=getattr(d, field.name))
    args = parser.parse_args(argv)
    settings = Settings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Settings)})
    if settings.d_model % settings.heads or settings.window > settings.steps:
        parser.error("d_model must be a multiple of heads, and window at most steps")
    print(f"jax {jax.__version__} on {jax.default_backend()}; {settings}", flush=True)
    results = run(args.configs, settings, out=args.out)  # written as each seed finishes
    print("\n" + table(results, settings))
    for path in write_outputs(results, settings, args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
