"""Same bytes before and after a change to the checkpoint pipeline: runs ``lowprec quantize``,
``dequantize`` and ``convert`` on a handful of small checkpoints in every layout (lowprec,
gpt-oss, compressed-tensors, ModelOpt, GGUF) with this tree's lowprec and with another
version's, and compares the SHA-256 of every output file (reports compared as JSON without
their timing field).

The other version is a source tree holding ``lowprec/`` with its native library built in
place, e.g.::

    git archive REV | tar -x -C /tmp/base && (cd /tmp/base && python setup.py build_ext --inplace)
    python scripts/checkpoint_same_bytes.py /tmp/base

Exit status 0 when every output is identical (and every command that succeeded on one side
succeeded on the other, with the same error where both refused); 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_inputs(folder: str) -> dict:
    """Small checkpoints: a bf16 file and a float32 file (odd row counts, a 3-D tensor,
    non-finite values, kept norms), and a two-shard folder with a config."""
    import ml_dtypes

    sys.path.insert(0, ROOT)
    from lowprec.checkpoint import SafetensorsWriter

    rng = np.random.default_rng(7)

    def tensors(dtype):
        t = {
            "model.layers.0.mlp.up_proj.weight": rng.standard_normal((96, 256)) * 0.02,
            "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((64, 128)),
            "model.layers.0.mlp.experts.weight": rng.standard_normal((2, 32, 64)) * 3,
            "model.layers.0.input_layernorm.weight": np.ones(256),
            "model.embed_tokens.weight": rng.standard_normal((50, 64)),
        }
        t["model.layers.0.self_attn.q_proj.weight"][3, 5] = np.inf
        t["model.layers.0.self_attn.q_proj.weight"][7, 9] = np.nan
        t["model.layers.0.self_attn.q_proj.weight"][9, :] *= 1e30
        return {k: v.astype(dtype) for k, v in t.items()}

    paths = {}
    for name, dtype, st in (("bf16", ml_dtypes.bfloat16, "BF16"), ("f32", np.float32, "F32")):
        path = os.path.join(folder, f"{name}.safetensors")
        t = tensors(dtype)
        with SafetensorsWriter(path, [(k, st, v.shape) for k, v in t.items()]) as w:
            for k, v in t.items():
                w.write(k, v)
        paths[name] = path
    shard_dir = os.path.join(folder, "sharded")
    os.makedirs(shard_dir)
    t = tensors(ml_dtypes.bfloat16)
    names = sorted(t)
    weight_map = {}
    for i, part in enumerate((names[:2], names[2:])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        with SafetensorsWriter(os.path.join(shard_dir, shard),
                               [(k, "BF16", t[k].shape) for k in part]) as w:
            for k in part:
                w.write(k, t[k])
        weight_map.update(dict.fromkeys(part, shard))
    with open(os.path.join(shard_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(shard_dir, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16"}, f)
    paths["sharded"] = shard_dir
    import gguf  # llama.cpp's own writer: a tiny llama-shaped GGUF of float32 tensors

    path = os.path.join(folder, "tiny.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_string("test.name", "tiny")
    for name, shape in (("token_embd.weight", (32, 64)), ("output_norm.weight", (64,)),
                        ("blk.0.attn_q.weight", (64, 64)), ("blk.0.ffn_up.weight", (128, 64)),
                        ("blk.0.ffn_down.weight", (64, 128))):
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    paths["gguf"] = path
    return paths


def commands(inp: dict) -> list:
    """(label, argv after ``lowprec``, output path key): each step reads inputs or earlier
    outputs (``@name`` = the output of step ``name``)."""
    out = []
    for src in ("bf16", "f32", "sharded"):
        ext = "" if src == "sharded" else ".safetensors"
        for fmt in ("mxfp4", "mxfp8_e4m3", "mxfp6_e2m3", "mxint8", "nvfp4", "e4m3", "bf16"):
            q = f"q-{src}-{fmt}"
            extra = ["--include", "weight"] if fmt.startswith("mx") and src != "sharded" else []
            out.append((q, ["quantize", inp[src], q + ext, "-f", fmt, *extra]))
            out.append((f"d-{src}-{fmt}", ["dequantize", "@" + q, f"d-{src}-{fmt}{ext}"]))
        out.append((f"q-{src}-mxfp4-rceil", ["quantize", inp[src], f"q-{src}-mxfp4-rceil{ext}",
                                            "-f", "mxfp4", "--scale-rule", "rceil"]))
        out.append((f"q-{src}-mxfp8-axis0", ["quantize", inp[src], f"q-{src}-mxfp8-axis0{ext}",
                                            "-f", "mxfp8", "--axis", "0"]))
        out.append((f"d-{src}-mxfp8-axis0-f32", ["dequantize", f"@q-{src}-mxfp8-axis0",
                                                 f"d-{src}-mxfp8-axis0-f32{ext}",
                                                 "--dtype", "float32"]))
        out.append((f"q-{src}-gpt-oss", ["quantize", inp[src], f"q-{src}-gpt-oss{ext}", "-f",
                                         "mxfp4", "--layout", "gpt-oss"]))
        out.append((f"d-{src}-gpt-oss", ["dequantize", f"@q-{src}-gpt-oss", f"d-{src}-gpt-oss{ext}"]))
    for scheme in ("NVFP4A16", "MXFP4A16", "MXFP8A16", "FP8_DYNAMIC", "FP8A16_CHANNEL"):
        q = f"q-ct-{scheme}"
        out.append((q, ["quantize", inp["sharded"], q, "-f", scheme, "--layout",
                        "compressed-tensors"]))
        out.append((f"d-ct-{scheme}", ["dequantize", "@" + q, f"d-ct-{scheme}"]))
    for scheme in ("NVFP4A16", "FP8_DYNAMIC"):
        q = f"q-mo-{scheme}"
        out.append((q, ["quantize", inp["sharded"], q, "-f", scheme, "--layout", "modelopt"]))
        out.append((f"d-mo-{scheme}", ["dequantize", "@" + q, f"d-mo-{scheme}"]))
    out.append(("c-ct-to-mo", ["convert", "@q-ct-NVFP4A16", "c-ct-to-mo", "--layout", "modelopt",
                               "--requantize"]))
    out.append(("c-mo-to-ct", ["convert", "@q-mo-NVFP4A16", "c-mo-to-ct", "--layout",
                               "compressed-tensors", "--requantize"]))
    out.append(("c-ct-to-lowprec", ["convert", "@q-ct-MXFP4A16", "c-ct-to-lowprec", "--layout",
                                    "lowprec"]))
    out.append(("c-lp-to-nvfp4", ["convert", "@q-bf16-mxfp4", "c-lp-to-nvfp4.safetensors",
                                  "--layout", "lowprec", "--to", "nvfp4"]))
    for fmt, extra in (("mxfp4", []), ("nvfp4", []),
                       ("mxfp4-ggml", ["--scale-rule", "floor_log2f"])):
        q = f"q-gguf-{fmt}"
        out.append((q, ["quantize", inp["gguf"], q + ".gguf", "-f", fmt.split("-")[0], *extra]))
        out.append((f"d-gguf-{fmt}", ["dequantize", "@" + q, f"d-gguf-{fmt}.safetensors"]))
    out.append(("c-gguf-to-ct", ["convert", "@q-gguf-mxfp4", "c-gguf-to-ct.safetensors",
                                 "--layout", "compressed-tensors"]))
    out.append(("c-ct-to-gguf", ["convert", "@q-ct-MXFP4A16", "c-ct-to-gguf.gguf",
                                 "--template", inp["gguf"]]))
    return out


def run_all(python: str, pythonpath, steps, work: str) -> dict:
    """Runs the steps in ``work``, all in one process of ``python`` with ``pythonpath``
    first on its path (one import, not one per step); returns {step: (status, {file:
    digest} or error text)}."""
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    with open(os.path.join(work, "steps.json"), "w") as f:
        json.dump(steps, f)
    subprocess.run([python, os.path.abspath(__file__), "--worker", work], env=env, cwd=work,
                   check=True)
    with open(os.path.join(work, "results.json")) as f:
        return {k: tuple(v) for k, v in json.load(f).items()}


def worker(work: str) -> None:
    """The steps of ``work``/steps.json by ``lowprec.cli.main``, results to results.json."""
    import contextlib
    import io

    from lowprec.cli import main as cli

    with open(os.path.join(work, "steps.json")) as f:
        steps = json.load(f)
    done, results = {}, {}
    for label, argv in steps:
        argv = [os.path.join(work, done[a[1:]]) if a.startswith("@") and a[1:] in done
                else a for a in argv]
        if any(a.startswith("@") for a in argv):
            results[label] = ("skipped", "an input step failed")
            continue
        out = os.path.join(work, argv[2])
        report = out.rstrip("/") + ".report.json"
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                status = cli([*argv[:2], out, *argv[3:], "-q", "--force", "--report", report])
            except SystemExit as e:
                status = e.code
            except Exception as e:  # noqa: BLE001 - an uncaught error is a result too
                results[label] = ("exception", f"{type(e).__name__}: {e}".replace(work, "WORK"))
                continue
        if status:
            lines = err.getvalue().replace(work, "WORK").strip().splitlines()
            results[label] = ("error", lines[-1] if lines else f"exit status {status}")
            continue
        done[label] = argv[2]
        results[label] = ("ok", digests(out, report))
    with open(os.path.join(work, "results.json"), "w") as f:
        json.dump(results, f)


def digests(out: str, report: str) -> dict:
    files = ([os.path.join(out, f) for f in sorted(os.listdir(out))] if os.path.isdir(out)
             else [out])
    got = {}
    for path in files:
        with open(path, "rb") as f:
            got[os.path.basename(path)] = hashlib.sha256(f.read()).hexdigest()
    with open(report) as f:
        rep = json.load(f)
    rep["totals"].pop("seconds", None)
    for key in ("source", "destination"):
        rep.pop(key, None)
    got["report"] = hashlib.sha256(json.dumps(rep, sort_keys=True).encode()).hexdigest()
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("baseline", nargs="?",
                    help="source tree of the other version (lowprec/ built in place)")
    ap.add_argument("--dir", default=None, help="work folder (default: a new one in /tmp)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    if args.baseline is None:
        ap.error("give the baseline's source tree")
    work = args.dir or tempfile.mkdtemp(prefix="lowprec-same-bytes-")
    os.makedirs(os.path.join(work, "in"))
    inputs = make_inputs(os.path.join(work, "in"))
    steps = commands(inputs)
    ours = run_all(sys.executable, None, steps, os.path.join(work, "ours"))
    theirs = run_all(sys.executable, os.path.abspath(args.baseline), steps,
                     os.path.join(work, "base"))
    bad = 0
    files = 0
    for label, _ in steps:
        a, b = ours[label], theirs[label]
        same = a == b
        if a[0] == "ok":
            files += len(a[1])
        print(f"{'same' if same else 'DIFFERENT'}  {label}: {a[0]}"
              + ("" if a[0] == "ok" else f" ({a[1][:100]})"))
        if not same:
            bad += 1
            print(f"    this tree: {a}\n    baseline:  {b}")
    print(f"{len(steps)} steps, {files} output files and reports compared, "
          f"{bad} step(s) differ; work folder {work}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
