"""Activation statistics for the static schemes: the largest magnitude each Linear's input
takes, read from a file or measured by running the model through transformers.

A static scheme (FP8's ``input_scale``, NVFP4's ``input_global_scale``, ModelOpt's
``input_scale``: :mod:`lowprec.checkpoint._engine_schemes`) stores a scale computed from the
largest magnitude (amax) of the Linear's input over calibration data; lowprec never writes
one without it. Two sources:

- a JSON file ``{"<module>": amax, ...}`` (:func:`read_amax`), e.g. from an earlier run's
  report (``options.activation_amax``) or from another tool;
- calibration data run through the model (:func:`calibrate`, the ``[interop]`` extra: torch
  and transformers): token ids (a ``.json`` list of sequences of ints, or one sequence) or
  text (any other file: one sample per non-empty line, tokenized with the checkpoint folder's
  tokenizer). The model is loaded from the checkpoint folder as transformers loads it (its
  stored dtype), each sample runs alone (batch 1, truncated to ``max_seq_length`` tokens),
  and a forward pre-hook on every Linear keeps the largest |x| of its input. This is what
  llm-compressor's ``QuantizationModifier`` observes (its sequential pipeline calibrates with
  quantization disabled, ``static_minmax`` observers) and ModelOpt's max calibration.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Optional

from ._errors import CheckpointError

_MAX_FILE_BYTES = 256 * 1024 * 1024


def _check_amax(where: str, module: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointError(f"{where}: the amax of {module} is {value!r}, not a number")
    if not (math.isfinite(value) and value > 0):
        raise CheckpointError(
            f"{where}: the amax of {module} is {value!r}; an activation amax must be positive "
            "and finite (0 means the calibration data never reached the module)")
    return float(value)


def read_amax(path) -> dict:
    """``{module: amax}`` from a JSON file (an object of module names to positive numbers).

    Example:
        >>> import json, tempfile
        >>> f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        >>> json.dump({"model.layers.0.mlp.up_proj": 3.5}, f); f.close()
        >>> read_amax(f.name)
        {'model.layers.0.mlp.up_proj': 3.5}
    """
    path = os.fspath(path)
    try:
        if os.path.getsize(path) > _MAX_FILE_BYTES:
            raise CheckpointError(f"{path}: too large for an activation amax file")
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: cannot read it as JSON ({e})") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    if isinstance(data, dict) and isinstance(data.get("options"), dict):
        data = data["options"].get("activation_amax", data)  # a lowprec report
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: an activation amax file is a JSON object "
                              '{"<module name>": amax, ...}')
    return {str(k): _check_amax(path, k, v) for k, v in data.items()}


def _token_samples(path: str) -> Optional[list]:
    """Token id sequences of a ``.json`` calibration file (None for a text file)."""
    if not path.lower().endswith(".json"):
        return None
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: cannot read it as JSON ({e})") from None
    if isinstance(data, list) and data and all(isinstance(t, int) for t in data):
        data = [data]
    ok = isinstance(data, list) and data and all(
        isinstance(s, list) and s and all(isinstance(t, int) and not isinstance(t, bool)
                                          and t >= 0 for t in s) for s in data)
    if not ok:
        raise CheckpointError(f"{path}: a token calibration file is a JSON list of token id "
                              "sequences ([[1, 2, ...], ...]) or one sequence of ids")
    return data


def calibrate(folder: str, path, modules, *, max_seq_length: int = 2048,
              progress: bool = False) -> dict:
    """``{module: amax}`` of the inputs of the Linear ``modules`` over the calibration file
    ``path``, running the model in ``folder`` with transformers (see the module docstring).

    Raises:
      CheckpointError: no transformers/torch, a file that is neither, a module the model does
        not have or that no sample reached, a token id beyond the vocabulary.
    """
    try:
        import torch
        import transformers
    except ImportError:
        raise CheckpointError(
            "calibration runs the model through transformers: pip install 'lowprec[interop]' "
            "(and a CPU torch), or give the activation amax values with --activation-amax"
        ) from None
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such calibration file")
    if max_seq_length < 1:
        raise CheckpointError(f"max_seq_length must be at least 1, got {max_seq_length}")
    samples = _token_samples(path)
    if samples is None:
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"{folder}: no tokenizer to read the text calibration file {path} ({e}); give "
                "token ids as a .json list of sequences instead") from None
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
        samples = [tokenizer(line, add_special_tokens=True)["input_ids"] for line in lines if line]
        if not samples:
            raise CheckpointError(f"{path}: no text to calibrate on (every line is empty)")
    try:
        # safetensors only, as every lowprec reader: never a pickled checkpoint beside it
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype="auto", use_safetensors=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder}: transformers cannot load the model to calibrate "
                              f"it ({e})") from None
    model.eval()
    vocab = model.get_input_embeddings().num_embeddings
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = sorted(set(modules) - set(linears))
    if missing:
        raise CheckpointError(
            f"{folder}: the model transformers builds has no Linear {missing[0]}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + "; give its activation amax with --activation-amax")
    seen = {}

    def hook(name):
        def observe(module, args):
            x = args[0] if isinstance(args, tuple) else args
            a = float(x.detach().abs().float().max()) if x.numel() else 0.0
            seen[name] = max(seen.get(name, 0.0), a)
        return observe

    handles = [linears[m].register_forward_pre_hook(hook(m)) for m in modules]
    try:
        with torch.no_grad():
            for i, ids in enumerate(samples):
                ids = ids[:max_seq_length]
                if max(ids) >= vocab:
                    raise CheckpointError(f"{path}: sample {i} has token id {max(ids)}, beyond "
                                          f"the vocabulary ({vocab} ids)")
                model(torch.tensor([ids]))
                if progress:
                    print(f"\rcalibrating: {i + 1}/{len(samples)} samples", end="",
                          flush=True, file=sys.stderr)
    finally:
        for h in handles:
            h.remove()
        if progress:
            print(file=sys.stderr)
    unseen = sorted(m for m in modules if seen.get(m, 0.0) <= 0 or not math.isfinite(seen[m]))
    if unseen:
        raise CheckpointError(
            f"{path}: calibration gave {unseen[0]} the amax {seen.get(unseen[0], 0.0)!r} "
            "(no sample reached it, or its input is zero or not finite); calibrate on other "
            "data or give its amax with --activation-amax")
    return {m: seen[m] for m in sorted(modules)}
