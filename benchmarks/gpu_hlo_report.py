"""How many kernels (passes over memory) each lowprec entry point compiles to, and what that
predicts for a GPU's throughput — with or without the GPU.

Run: ``python benchmarks/gpu_hlo_report.py`` compiles for the default backend (a GPU if JAX
sees one). ``--target h100`` (or ``h200``, ``b200``) compiles for that GPU on any machine,
a CPU-only one included, through XLA's ahead-of-time path: install the CUDA plugin
(``pip install -e '.[gpu-compile]'``, or ``pip install --target DIR`` it and put DIR on
``PYTHONPATH``), keep JAX on the CPU (``JAX_PLATFORMS=cpu``) and the script asks the plugin
for a compile-only device described by a ``GpuTargetConfigProto`` (:data:`TARGETS`;
``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...,
topology="1x1x1")``). ``jit(f, in_shardings=that device).lower(...).compile()`` then runs
XLA's whole GPU pipeline (fusion, Triton for Pallas kernels, PTX for sm_90a/sm_100a).
``--dump DIR`` keeps every optimized HLO module (and, with a target, its PTX), ``--shape``
sets the array, ``--only`` filters entry points, ``--json`` writes the rows.

For each entry point (``quantize_mx`` per MX format and scale rule, along the last axis,
along axis 0 and with ``pad=True``; ``dequantize`` to float32 and bfloat16;
``fake_quantize_mx``; ``shared_exponents``; ``encode``; the Pallas kernels; the dot
products; ``weight_only_matmul`` of prepared MXFP4/NVFP4 weights) the script takes XLA's optimized module and lists the top-level instructions of
its entry computation that launch work: fusions (with their kind: kLoop = elementwise,
kInput = a reduction, kCustom = Triton/cuBLAS), custom calls, copies and transposes that
move data, reduces, dots, conditionals and loops. Bitcasts, tuples, parameters and constants
are free.

Columns: ``kernels`` (that count), ``passes`` (kernels that stream the data: more than
1/8 of the ideal bytes; the others touch per-block values such as scales), ``kinds``,
``traffic/ideal``: the bytes every kernel
reads and writes (each operand and result counted once per kernel) over the bytes a
single pass needs (the entry's parameters and result) — 1.0 is one fused pass; 2.0 means
the data went through memory twice. ``pred TB/s`` (with a target): the effective bandwidth
(ideal bytes / time) predicted for a memory-bound program, the device's copy bandwidth
divided by traffic/ideal (:attr:`GpuTarget.copy_tbs` says which copy bandwidth; on the H100
this predicted the measured quantize/dequantize figures within ~10%). It means nothing for
compute-bound rows (the large dots). ``fused ops``: arithmetic instructions inside the
kernels' fused computations, a proxy for the work per element. ``regs/spill`` (with a
target): registers per thread and spilled bytes of each Triton (Pallas) kernel, from
``ptxas -v`` on the dumped PTX. ``notes`` names materialized transposes/copies, separate
reductions and conditionals.

The GEMM view (``gemms`` column; the products: ``dot_general`` per operand format, the
training recipes' forward and backward products, delayed scaling, and peers): a device
autotunes each dot between a Triton GEMM and cuBLAS, which a compile without one cannot do,
so every product is compiled a second time with Triton's GEMM off
(``xla_gpu_enable_triton_gemm=False``). XLA then lowers each dot to the cuBLAS call its GEMM
rewriter forms, and :func:`gemm_view` lists them: the custom-call target
(``__cublas$lt$matmul$f8`` is cuBLASLt's FP8 GEMM; ``__cublas$lt$matmul`` and
``__cublas$gemm`` the others), the dtypes of its two matrix operands (looked up at their
definitions: ``f8e4m3fn x f8e5m2``, ``bf16 x bf16``, ``f32 x f32``) and the dot's precision
(``HIGHEST`` turns the FP8 GEMM's fast accumulation off). The compile-only target names its
CUDA runtime (:attr:`GpuTarget.cuda_version`): XLA forms no FP8 GEMM below CUDA 12.
"""


from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections import Counter

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import environment, render_table  # noqa: E402

import lowprec  # noqa: E402

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
FREE = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "after-all",
        "partition-id", "replica-id", "opt-barrier"}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (an array or a tuple of arrays)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size * _BYTES.get(dtype, 1)
    return total


def _split_shape(rest: str):
    """'(u8[2]{0}, u8[1]{0}) fusion(%a), kind=kLoop' -> (shape, opcode, operands, attrs)."""
    if rest.startswith("("):
        depth = 0
        for i, c in enumerate(rest):
            depth += c == "("
            depth -= c == ")"
            if depth == 0:
                break
        shape, tail = rest[: i + 1], rest[i + 1 :].strip()
    else:
        shape, _, tail = rest.partition(" ")
    m = re.match(r"([\w\-]+)\((.*?)\)(.*)$", tail)
    if not m:
        return shape, tail.split("(")[0], [], ""
    operands = re.findall(r"%([\w.\-]+)", m.group(2))
    return shape, m.group(1), operands, m.group(3)


def entry_kernels(hlo: str, computation: str = None):
    """[(name, opcode, kind, out_bytes, operand_names)] for the entry computation (or the
    named one); and the bytes of its parameters and result."""
    if computation is None:
        lines = hlo[hlo.index("\nENTRY") :].splitlines()[1:]
    else:
        lines = hlo[hlo.index(f"\n%{computation} ") + 1 :].splitlines()[1:]
    instrs, sizes, alias = [], {}, {}
    param_bytes = root_bytes = 0
    for line in lines:
        if line.startswith("}"):
            break
        m = _INSTR.match(line)
        if not m:
            continue
        name, rest = m.groups()
        shape, opcode, operands, attrs = _split_shape(rest.strip())
        nbytes = shape_bytes(shape)
        sizes[name] = nbytes
        if opcode == "parameter":
            param_bytes += nbytes
        if line.lstrip().startswith("ROOT"):
            root_bytes = nbytes
        if opcode in ("bitcast", "get-tuple-element") and operands:
            alias[name] = alias.get(operands[0], operands[0])
            continue
        if opcode in FREE:
            continue
        kind = re.search(r"kind=(\w+)", attrs)
        target = re.search(r'custom_call_target="([^"]+)"', attrs)
        label = kind.group(1) if kind else (target.group(1) if target else "")
        instrs.append((name, opcode, label, nbytes, [alias.get(o, o) for o in operands]))
    return instrs, sizes, param_bytes, root_bytes


# Instructions that cost (next to) nothing per element inside a fusion.
_LAYOUT_ONLY = FREE | {"broadcast", "reshape", "slice", "iota", "transpose", "concatenate"}


def fused_op_counts(hlo: str) -> dict:
    """Computation name -> number of arithmetic instructions in it (a per-element cost proxy)."""
    counts, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^\s*%?([\w.\-]+)\s*\(.*\{\s*$", line)
        if head and not line.lstrip().startswith("ENTRY"):
            name, counts[head.group(1)] = head.group(1), 0
            continue
        if line.startswith("}"):
            name = None
            continue
        m = _INSTR.match(line)
        if name and m:
            _, opcode, _, _ = _split_shape(m.group(2).strip())
            counts[name] += opcode not in _LAYOUT_ONLY
    return counts


def conditional_branches(hlo: str) -> list:
    """Names of the branch computations of the entry's conditionals."""
    entry = hlo[hlo.index("\nENTRY"):]
    names = []
    for m in re.finditer(r"true_computation=%([\w.\-]+), false_computation=%([\w.\-]+)", entry):
        names += [m.group(1), m.group(2)]
    for m in re.finditer(r"branch_computations=\{([^}]*)\}", entry):
        names += re.findall(r"%([\w.\-]+)", m.group(1))
    return names


def branch_note(hlo: str, computation: str) -> str:
    """'branch NAME: its kernels' (Pallas kernels by name) for a conditional's branch."""
    instrs = entry_kernels(hlo, computation)[0]
    body = hlo[hlo.index(f"\n%{computation} "):]
    pallas = re.findall(r'name\s*=\s*\\?"(lowprec_\w+)', body[: body.index("\n}")])
    kinds = Counter(f"{op}:{label}" if label else op for _, op, label, _, _ in instrs)
    text = ", ".join(f"{k}×{v}" if v > 1 else k for k, v in sorted(kinds.items()))
    return f"branch {computation}: {text}" + (f" ({', '.join(sorted(set(pallas)))})" if pallas else "")


_CUBLAS = re.compile(r'custom_call_target="(__cublas[^"]*)"')


def _dims(shape: str) -> list:
    """The dimensions of an HLO array shape (the first array of a tuple shape)."""
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def gemm_view(hlo: str) -> list:
    """Every GEMM of an optimized module (every computation: branches included), as dicts
    ``{"target", "operands": (lhs dtype, rhs dtype), "precision", "flops"}``; a dot XLA left
    as a plain ``dot`` (not a library call) has target ``"dot"``; ``flops`` = 2 x the
    output's elements x the contraction length (0 where the shapes cannot be read). Compile
    with Triton's GEMM off (:func:`compile_gemm_hlo`) to see the cuBLAS choice."""
    shapes = {}
    for line in hlo.splitlines():
        m = _INSTR.match(line)
        if m:
            shapes[m.group(1)] = _split_shape(m.group(2).strip())[0]
    gemms = []
    for line in hlo.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        shape, opcode, operands, attrs = _split_shape(m.group(2).strip())
        target = _CUBLAS.search(attrs)
        if target is None and opcode != "dot":
            continue
        precision = re.search(r'operand_precision"?\s*[:=]\s*\[?"?(\w+)', attrs)
        if precision is None:
            precision = re.search(r"operand_precision=\{(\w+)", attrs)
        contract = re.search(r'lhs_contracting_dimensions"?\s*[:=]\s*[\[{]"?(\d+)', attrs)
        lhs = _dims(shapes.get(operands[0], "")) if operands else []
        out = _dims(shape)
        k = lhs[int(contract.group(1))] if contract and int(contract.group(1)) < len(lhs) else 0
        gemms.append({
            "target": target.group(1) if target else "dot",
            "operands": tuple(shapes.get(o, "?").lstrip("(").split("[")[0] for o in operands[:2]),
            "precision": precision.group(1) if precision else "DEFAULT",
            "flops": 2 * math.prod(out) * k if out and k else 0,
        })
    return gemms


def gemm_label(g: dict) -> str:
    """``f8e4m3fn x f8e5m2 (cublasLt f8, HIGHEST)``-style text of one :func:`gemm_view`
    entry (the precision named when it is not the default)."""
    kind = {"__cublas$lt$matmul$f8": "cublasLt f8", "__cublas$lt$matmul": "cublasLt",
            "__cublas$gemm": "cublas"}.get(g["target"], g["target"])
    if g["precision"].upper() != "DEFAULT":
        kind += f", {g['precision'].upper()}"
    return f"{' x '.join(g['operands'])} ({kind})"


def compile_gemm_hlo(fn, specs, target=None) -> str:
    """:func:`compile_hlo` with Triton's GEMM off, so that each dot lowers to the cuBLAS
    call a device's autotuner would weigh against a Triton GEMM (module docstring)."""
    return compile_hlo(fn, specs, target, options={"xla_gpu_enable_triton_gemm": False})


def summarize(hlo: str) -> dict:
    instrs, sizes, params, root = entry_kernels(hlo)
    ops = fused_op_counts(hlo)
    calls = re.findall(r"calls=%([\w.\-]+)", hlo[hlo.index("\nENTRY"):])
    per_kernel = [out + sum(sizes.get(o, 0) for o in set(ops)) for _, _, _, out, ops in instrs]
    traffic = sum(per_kernel)
    ideal = max(1, params + root)
    kinds = Counter(f"{op}:{label}" if label else op for _, op, label, _, _ in instrs)
    notes = [f"{op} {name}" for name, op, _, _, _ in instrs if op in ("copy", "transpose")]
    notes += [f"reduction {name}" for name, op, label, _, _ in instrs if label == "kInput" or op == "reduce"]
    notes += [f"{op} {name}" for name, op, _, _, _ in instrs if op in ("conditional", "while")]
    notes += [branch_note(hlo, b) for b in conditional_branches(hlo)]
    return {
        "kernels": len(instrs),
        # Kernels that stream the data (more than 1/8 of the ideal bytes); the others touch
        # per-block values only (scales: 1/32 of the elements).
        "passes": sum(b > ideal / 8 for b in per_kernel),
        "kinds": ", ".join(f"{k}×{v}" if v > 1 else k for k, v in sorted(kinds.items())),
        "traffic_over_ideal": traffic / ideal,
        "fused_ops": sum(ops.get(c, 0) for c in calls),
        "notes": "; ".join(notes),
    }




# -- compile-only GPU targets ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """A GPU to compile for without one: the facts XLA's GPU compiler reads (a
    ``stream_executor.GpuTargetConfigProto``) and the copy bandwidth predictions use.

    Attributes:
      name: the device kind JAX reports on that GPU.
      compute_capability: (major, minor); compiled with the arch-specific features (sm_90a).
      sms, l2_bytes, clock_ghz, memory_bytes: datasheet figures (132 SMs and 50 MiB L2 on the
        H100 SXM).
      hbm_bytes_per_s: datasheet memory bandwidth (XLA's cost model reads it).
      copy_tbs: effective copy bandwidth (TB/s, read + write) the predictions divide by
        traffic/ideal; ``copy_note`` says where it comes from.
      cuda_version: the CUDA runtime (major, minor) the compile assumes. XLA's GEMM
        rewriter reads it: below 12.0 it never forms the FP8 cuBLASLt GEMM, and a target
        description without one reads as 0.0 (every FP8 product then compiled to a
        bfloat16 or float32 GEMM). Default: the CUDA of the installed plugin's wheels.
    """

    name: str
    compute_capability: tuple
    sms: int
    l2_bytes: int
    hbm_bytes_per_s: float
    clock_ghz: float
    memory_bytes: int
    copy_tbs: float
    copy_note: str
    cuda_version: tuple = dataclasses.field(default_factory=lambda: _plugin_cuda_version())

    @property
    def arch(self) -> str:
        major, minor = self.compute_capability
        return f"sm_{major}{minor}a"

    def _unit_rates(self) -> str:
        """Per-SM issue rates by XLA PrimitiveType (S32=4, U32=8, F16=10, F32=11, F64=12,
        BF16=16), which XLA's fusion cost model reads: 64 integer/float64 and 128 float32
        lanes per SM (Hopper/Blackwell), packed half precision at two per lane."""
        rates = {4: (64, 1), 8: (64, 1), 10: (128, 2), 11: (128, 1), 12: (64, 1), 16: (128, 2)}
        out = "  scalar_unit_description {\n"
        for key, (units, ops) in rates.items():
            out += (f"    rate_infos {{ key: {key} value {{ clock_rate_ghz: {self.clock_ghz} "
                    f"units_per_core: {units} ops_per_clock: {ops} }} }}\n")
        return out + "  }\n"

    def config_text(self) -> str:
        """The GpuTargetConfigProto (text format) the CUDA plugin takes as ``target_config``."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  core_count: {self.sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  memory_bandwidth: {int(self.hbm_bytes_per_s)}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  cuda_compute_capability {{ major: {major} minor: {minor} feature_extension: ACCELERATED_FEATURES }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
{self._unit_rates()}  device_vendor: "NVIDIA Corporation"
  name: "{self.name}"
}}
runtime_version {{ major: {self.cuda_version[0]} minor: {self.cuda_version[1]} patch: 0 }}
platform_name: "CUDA"
device_description_str: "{self.name}"
"""


def _plugin_cuda_version() -> tuple:
    """(major, minor) of the CUDA runtime wheel installed with the JAX CUDA plugin; (12, 8)
    if none is found (any 12.x forms the FP8 GEMM)."""
    from importlib import metadata

    for dist in ("nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime"):
        try:
            major, minor = metadata.version(dist).split(".")[:2]
            return int(major), int(minor)
        except (metadata.PackageNotFoundError, ValueError):
            continue
    return 12, 8


# The H100's copy bandwidth was measured (jit(-x) on 16384² float32 on an H100 SXM, the run whose
# quantize/dequantize figures these predictions matched within ~10%); no H200 or B200 has
# been measured, so theirs is the datasheet bandwidth times the H100's measured fraction of
# its own datasheet figure (2.53 / 3.35 = 0.755).
_H100_COPY_FRACTION = 2.53 / 3.35
TARGETS = {
    "h100": GpuTarget("NVIDIA H100 80GB HBM3", (9, 0), 132, 50 << 20, 3.35e12, 1.98, 80 << 30,
                      2.53, "measured on an H100 SXM: jit(-x), 16384² float32"),
    "h200": GpuTarget("NVIDIA H200", (9, 0), 132, 50 << 20, 4.8e12, 1.98, 141 * 10**9,
                      round(4.8 * _H100_COPY_FRACTION, 2),
                      "datasheet 4.8 TB/s x the H100's measured copy fraction 0.755"),
    "b200": GpuTarget("NVIDIA B200", (10, 0), 148, 126 << 20, 8.0e12, 1.965, 180 * 10**9,
                      round(8.0 * _H100_COPY_FRACTION, 2),
                      "datasheet 8.0 TB/s x the H100's measured copy fraction 0.755"),
}


def cuda_plugin_available() -> bool:
    """Whether the JAX CUDA plugin (which compiles for a GPU without one) is importable."""
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        try:
            import jax_plugins.xla_cuda13  # noqa: F401
        except ImportError:
            return False
    return True


@functools.lru_cache(maxsize=None)
def compile_only_device(target: str):
    """A compile-only JAX device for ``TARGETS[target]`` (no GPU needed)."""
    from jax.experimental import topologies

    spec = TARGETS[target]
    topo = topologies.get_topology_desc(platform="cuda", target_config=spec.config_text(),
                                        topology="1x1x1")
    return topo.devices[0]


def compile_hlo(fn, specs, target=None, dump_dir=None, options=None) -> str:
    """Optimized HLO text of ``jit(fn)`` for ``specs`` (ShapeDtypeStructs or pytrees of them),
    for the default backend or, with ``target``, for that GPU (compile only). ``dump_dir``:
    XLA writes the module's passes' HLO and, for a GPU, its PTX there; ``options``: more
    XLA compiler options."""
    if target is None:
        jitted = jax.jit(fn)
    else:
        from jax.sharding import SingleDeviceSharding

        where = SingleDeviceSharding(compile_only_device(target))
        jitted = jax.jit(fn, in_shardings=where, out_shardings=where)
    options = dict(options or {})
    if dump_dir:
        options.update({"xla_dump_to": dump_dir, "xla_dump_hlo_as_text": True})
    return jitted.lower(*specs).compile(compiler_options=options or None).as_text()


def find_ptxas():
    """ptxas from the nvidia-cuda-nvcc wheel (the CUDA plugin's), else from PATH."""
    for root in sys.path:
        path = os.path.join(root, "nvidia", "cuda_nvcc", "bin", "ptxas")
        if os.path.isfile(path):
            return path
    return shutil.which("ptxas")


_PTXAS_FUNC = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def ptx_kernel_stats(ptx_paths, arch: str) -> dict:
    """kernel name -> (registers, spill store bytes, spill load bytes), from ``ptxas -v``."""
    ptxas = find_ptxas()
    stats = {}
    if ptxas is None:
        return stats
    for path in ptx_paths:
        out = subprocess.run([ptxas, "-v", f"-arch={arch}", path, "-o", os.devnull],
                             capture_output=True, text=True, check=False)
        name, spill = None, (0, 0)
        for line in (out.stdout + out.stderr).splitlines():
            m = _PTXAS_FUNC.search(line)
            if m:
                name, spill = m.group(1), (0, 0)
                continue
            m = _PTXAS_SPILL.search(line)
            if m:
                spill = (int(m.group(1)), int(m.group(2)))
                continue
            m = _PTXAS_REGS.search(line)
            if m and name:
                stats[name] = (int(m.group(1)), *spill)
    return stats


def triton_kernel_names(hlo: str) -> list:
    """Names XLA gives the Pallas (Triton) kernels of a module (``name`` of the call)."""
    return re.findall(r'custom_call_target="__gpu\$xla\.gpu\.triton".*?name\s*=\s*\\?"([\w.\-]+)', hlo)


def pallas_register_report(hlo: str, ptx_dir: str, arch: str) -> str:
    """'kernel: N regs, S B spilled' for each Triton kernel in the dumped PTX."""
    stats = ptx_kernel_stats(sorted(glob.glob(os.path.join(ptx_dir, "*.ptx"))), arch)
    if "__gpu$xla.gpu.triton" not in hlo and "kCustom" not in hlo:
        return ""
    parts = []
    for name, (regs, st, ld) in sorted(stats.items()):
        if "lowprec" in name or "triton" in name:
            parts.append(f"{name}: {regs} regs, {st + ld} B spilled")
    return "; ".join(parts)


# -- entry points ------------------------------------------------------------------------------

MX_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4", "mxint8")
RULES = ("floor", "ceil", "even", "rceil")


def entry_points(shape, pallas: bool = False, full: bool = True):
    """name -> (function, *argument specs). ``pallas``: include the Pallas kernels (on a
    GPU or a GPU target). ``full``: every MX format and rule (else MXFP8/MXFP4, two rules)."""
    from lowprec._options import MXCast

    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    xt = jax.ShapeDtypeStruct((shape[0], shape[1] - 16), jnp.float32)  # needs pad=True
    cases = {}
    formats = MX_FORMATS if full else ("mxfp8_e4m3", "mxfp4")
    for fmt in formats:
        for rule in RULES if full else ("floor", "rceil"):
            cases[f"quantize_mx {fmt} {rule}"] = (
                lambda v, f=fmt, r=rule: lowprec.quantize_mx(v, f, scale_rule=r), x)
        cases[f"quantize_mx {fmt} axis=0"] = (lambda v, f=fmt: lowprec.quantize_mx(v, f, axis=0), x)
        cases[f"quantize_mx {fmt} pad=True"] = (
            lambda v, f=fmt: lowprec.quantize_mx(v, f, pad=True), xt)
        mx = jax.eval_shape(lambda v, f=fmt: lowprec.quantize_mx(v, f), x)
        cases[f"dequantize {fmt} f32"] = (lambda m: lowprec.dequantize(m), mx)
        cases[f"dequantize {fmt} bf16"] = (lambda m: lowprec.dequantize(m, jnp.bfloat16), mx)
        cases[f"fake_quantize_mx {fmt}"] = (lambda v, f=fmt: lowprec.fake_quantize_mx(v, f), x)
    cases["quantize_mx nvfp4 tensor_scale=1"] = (
        lambda v: lowprec.quantize_mx(v, "nvfp4", tensor_scale=1.0), x)
    nv = jax.eval_shape(lambda v: lowprec.quantize_mx(v, "nvfp4"), x)
    cases["dequantize nvfp4 f32"] = (lambda m: lowprec.dequantize(m), nv)
    if pallas:
        from lowprec.kernels._quantize_pallas import pallas_quantize_applies, quantize_mx_pallas

        for fmt in formats:
            cast = MXCast(lowprec.mx_format(fmt), "rceil", "nearest_even")
            if not pallas_quantize_applies(cast):
                continue
            cases[f"Pallas quantize kernel {fmt} rceil"] = (
                lambda v, c=cast: quantize_mx_pallas(v, c), x)
    cases["shared_exponents mxfp8 floor"] = (lambda v: lowprec.shared_exponents(v, "mxfp8"), x)
    cases["encode e4m3"] = (lambda v: lowprec.encode(v, "e4m3"), x)
    n, k = shape
    dn = (((1,), (1,)), ((), ()))
    a = jax.ShapeDtypeStruct((n, k), jnp.float32)
    q8 = jax.eval_shape(lambda v: lowprec.quantize_mx(v, "mxfp8", axis=1), a)
    cases["dot_general mxfp8 pre-q"] = (lambda p, q: lowprec.dot_general(p, q, dn), q8, q8)
    cases["dot_general mxfp8 +quant"] = (
        lambda p, q: lowprec.dot_general(p, q, dn, lhs_format="mxfp8", rhs_format="mxfp8"), a, a)
    for m in (1, 4, 16):
        w4 = jax.eval_shape(lambda v: lowprec.quantize_mx(v, "mxfp4", axis=1), a)
        t = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
        cases[f"dot_general mxfp4 weight x {m} tokens"] = (
            lambda t, w: lowprec.dot_general(t, w, dn), t, w4)
    cases.update(prepared_weight_entry_points(shape))
    return cases


def prepared_weight_entry_points(shape) -> dict:
    """``weight_only_matmul`` of a prepared MXFP4 / NVFP4 weight [N, K] (the Mosaic GPU
    kernel on Hopper) at 1 and 16 tokens: name -> (function, *argument specs)."""
    from lowprec import _prepared as prep

    n, k = shape
    tn, tk = prep.tile_counts((n, k))
    s = jax.ShapeDtypeStruct
    cases = {}
    for fmt in prep.FORMATS:
        w = prep.PreparedWeight(
            s((tn, tk, prep.THREADS, prep.WORDS_PER_THREAD), jnp.uint32),
            s((tn, tk, 32 * prep.SCALE_BYTES_PER_QUAD[fmt]), jnp.uint8), s((n,), jnp.bool_),
            lowprec.mx_format(fmt), (n, k), 1, True, None,
            s((), jnp.float32) if fmt == "nvfp4" else None)
        for m in (1, 16):
            cases[f"weight_only_matmul prepared {fmt} x {m} tokens"] = (
                lambda t, w: lowprec.weight_only_matmul(t, w), s((m, k), jnp.bfloat16), w)
    return cases


def _with_grads(f):
    """``(x, w, g) -> (f(x, w), grad_x, grad_w)`` for the cotangent ``g`` (an argument, so
    that nothing is constant-folded): a linear layer's three products."""
    def run(x, w, g):
        y, vjp = jax.vjp(f, x, w)
        return (y,) + vjp(g)

    return run


def product_cases(n: int = 4096) -> dict:
    """name -> (function, *argument specs) of every low-precision product, for the GEMM
    view: ``dot_general`` per operand format (n x n x n; activations x [K, N] weight), the
    recipes' and delayed scaling's three products (forward, grad_x, grad_w; the cotangent an
    argument), the Flax layers, and the peers (XLA's own float8 dot, Flax's
    ``Fp8DotGeneralOp``, a bfloat16 dot)."""
    x = jax.ShapeDtypeStruct((n, n), jnp.float32)
    dn = (((1,), (0,)), ((), ()))
    cases = {}
    for lf, rf in (("e4m3", "e4m3"), ("e4m3", "e5m2"), ("mxfp8_e4m3", "mxfp8_e4m3"),
                   ("mxfp8_e5m2", "mxfp8_e4m3"), ("mxfp6_e2m3", "mxfp6_e2m3"), ("mxfp4", "mxfp4"),
                   ("mxint8", "mxint8"), ("nvfp4", "nvfp4")):
        cases[f"dot_general {lf} x {rf}"] = (
            lambda a, b, lf=lf, rf=rf: lowprec.dot_general(a, b, dn, lhs_format=lf, rhs_format=rf),
            x, x)
    q8 = jax.eval_shape(lambda v: lowprec.quantize_mx(v, "mxfp8", axis=1), x)
    q8w = jax.eval_shape(lambda v: lowprec.quantize_mx(v, "mxfp8", axis=0), x)
    cases["dot_general mxfp8 pre-quantized"] = (lambda p, q: lowprec.dot_general(p, q, dn), q8, q8w)
    cases["dot_general e4m3 x e4m3, quantized backward (grad e5m2)"] = (_with_grads(
        lambda a, b: lowprec.dot_general(a, b, dn, lhs_format="e4m3", rhs_format="e4m3",
                                         backward="quantized", grad_format="e5m2")), x, x, x)
    for recipe in (lowprec.FP8_HYBRID, lowprec.NVIDIA_MXFP8, lowprec.OCP_MXFP8,
                   lowprec.NVIDIA_NVFP4):
        cases[f"{recipe.name} fwd + bwd"] = (
            _with_grads(lambda a, b, r=recipe: r.dot_general(a, b, dn)), x, x, x)
    groups = jax.ShapeDtypeStruct((4,), jnp.int32)
    experts = jax.ShapeDtypeStruct((4, n, n), jnp.float32)
    for recipe in (lowprec.NVIDIA_MXFP8, lowprec.FP8_HYBRID):
        cases[f"{recipe.name} ragged_dot (4 experts)"] = (
            lambda a, b, g, r=recipe: r.ragged_dot(a, b, g), x, experts, groups)
    cfg = lowprec.DelayedScaling(amax_history_len=16)
    st = jax.eval_shape(cfg.init)

    def delayed(a, b, s, g):
        y, vjp = jax.vjp(lambda a, b, s: lowprec.delayed_dot_general(a, b, s, dn, cfg), a, b, s)
        return (y,) + vjp(g)

    cases["delayed_dot_general fwd + bwd"] = (delayed, x, x, st, x)
    from flax import linen as nn

    from lowprec import flax as lowprec_flax  # the training extra

    def linen_products(layer):
        def run(v, a, g):
            y, vjp = jax.vjp(lambda v, a: layer.apply(v, a), v, a)
            return (y,) + vjp(g)

        variables = jax.eval_shape(lambda a: layer.init(jax.random.key(0), a), x)
        return run, variables, x, x

    delayed_dense = nn.Dense(n, use_bias=False, dot_general_cls=functools.partial(
        lowprec_flax.DelayedDotGeneral, config=cfg))
    cases["flax linen Dense, DelayedDotGeneral, fwd + bwd"] = linen_products(delayed_dense)
    hybrid = lowprec_flax.quantize_model(nn.Dense(n, use_bias=False), lowprec.FP8_HYBRID)
    cases["flax linen Dense, quantize_model FP8_HYBRID, fwd + bwd"] = linen_products(hybrid)
    from flax import nnx

    linear = nnx.Linear(n, n, use_bias=False, rngs=nnx.Rngs(0),
                        dot_general=lowprec_flax.DelayedDotGeneralNnx(cfg))
    graph, state = nnx.split(linear)

    def nnx_products(st, a, g):
        y, vjp = jax.vjp(lambda st, a: nnx.merge(graph, st)(a), st, a)
        return (y,) + vjp(g)

    cases["flax nnx Linear, DelayedDotGeneralNnx, fwd + bwd"] = (
        nnx_products, jax.eval_shape(lambda: state), x, x)
    from flax.linen import fp8_ops

    peer = nn.Dense(n, use_bias=False, dot_general_cls=fp8_ops.Fp8DotGeneralOp)
    with warnings.catch_warnings():  # Flax deprecates it (for Fp8DirectDotGeneralOp): still a peer
        warnings.simplefilter("ignore", DeprecationWarning)
        cases["peer: flax linen Fp8DotGeneralOp Dense, fwd + bwd"] = linen_products(peer)
    cases["peer: XLA float8 dot (x.astype(float8_e4m3fn))"] = (
        lambda a, b: lax.dot_general(a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn),
                                     dn, preferred_element_type=jnp.float32), x, x)
    cases["peer: bfloat16 dot"] = (
        lambda a, b: lax.dot_general(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), dn,
                                     preferred_element_type=jnp.float32), x, x)
    return cases


def gemm_rows(n: int, target=None, only=None) -> list:
    """One dict per product of :func:`product_cases`: its GEMMs (:func:`gemm_view` of the
    compile with Triton's GEMM off) and, from the default compile, kernels and traffic."""
    rows = []
    for name, (fn, *specs) in product_cases(n).items():
        if only and only not in name:
            continue
        try:
            gemms = gemm_view(compile_gemm_hlo(fn, specs, target))
            s = summarize(compile_hlo(fn, specs, target))
        except Exception as e:  # noqa: BLE001 - report and go on
            rows.append({"product": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        rows.append({"product": name, "gemms": gemms, "kernels": s["kernels"],
                     "traffic_over_ideal": s["traffic_over_ideal"],
                     "conditional": "conditional" in s["notes"]})
    return rows


def report_rows(shape, target=None, only=None, dump=None, full=True):
    """One dict per entry point: the summary columns (see the module docstring)."""
    on_gpu = target is not None or jax.default_backend() == "gpu"
    spec = TARGETS[target] if target else None
    rows = []
    for name, (fn, *specs) in entry_points(shape, pallas=on_gpu, full=full).items():
        if only and only not in name:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            where = tmp if target else None
            try:
                hlo = compile_hlo(fn, specs, target, where)
            except Exception as e:  # noqa: BLE001 - report and go on
                rows.append({"entry point": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                continue
            regs = pallas_register_report(hlo, tmp, spec.arch) if target else ""
            if dump:
                stem = os.path.join(dump, re.sub(r"[^\w.=-]+", "_", name))
                _write_atomic(stem + ".hlo.txt", hlo)
                for i, ptx in enumerate(sorted(glob.glob(os.path.join(tmp, "*.ptx")))):
                    with open(ptx, encoding="utf-8") as f:
                        _write_atomic(f"{stem}.{i}.ptx", f.read())
        s = summarize(hlo)
        row = {"entry point": name, **s, "regs/spill": regs}
        if spec is not None:
            row["pred TB/s"] = spec.copy_tbs / max(s["traffic_over_ideal"], 1e-9)
        rows.append(row)
    return rows


def _write_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", choices=sorted(TARGETS), help="compile for this GPU (no GPU needed)")
    p.add_argument("--shape", type=int, nargs=2, default=None)
    p.add_argument("--dump", metavar="DIR", help="write each optimized HLO module (and PTX) here")
    p.add_argument("--only", metavar="SUBSTRING", help="entry points whose name contains this")
    p.add_argument("--short", action="store_true", help="MXFP8/MXFP4 and two rules only")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    p.add_argument("--gemms", choices=("with", "only", "none"), default="with",
                   help="the GEMM view of the products (on a GPU or a target): after the "
                        "entry points (default), alone, or not at all")
    p.add_argument("--product-n", type=int, default=4096, metavar="N",
                   help="the products' size (n x n x n; default 4096)")
    args = p.parse_args(argv)
    if args.target and not cuda_plugin_available():
        p.error("--target needs the JAX CUDA plugin: pip install 'lowprec[gpu-compile]' "
                "(jax-cuda12-plugin[with-cuda] of your jaxlib's version)")
    on_gpu = args.target or jax.default_backend() == "gpu"
    shape = tuple(args.shape) if args.shape else ((16384, 16384) if on_gpu else (1024, 1024))
    env = environment()
    if args.target:
        t = TARGETS[args.target]
        where = (f"compiled for {t.name} ({t.arch}) on {env['platform']}, no GPU; predictions at "
                 f"{t.copy_tbs} TB/s copy ({t.copy_note})")
    else:
        where = f"{env['platform']}: {env['device']}"
    print(f"lowprec {env['lowprec']}, jax {env['jax']}, {where}; array {shape} float32\n")
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    record = {"shape": shape, "target": args.target}
    if args.gemms != "only":
        record["rows"] = _print_entry_points(args, shape)
    if on_gpu and args.gemms != "none":
        record["products"] = _print_gemms(args)
    if args.json:
        _write_atomic(args.json, json.dumps(record, indent=1))
    return 0


def _print_gemms(args) -> list:
    rows = gemm_rows(args.product_n, args.target, args.only)
    print(f"\nGEMMs of each product ({args.product_n}³; second compile, Triton GEMM off; "
          "precision HIGHEST = FP8 fast accumulation off)\n")
    table = []
    for r in rows:
        if "error" in r:
            table.append([r["product"], "n/a", r["error"][:80], ""])
            continue
        gemms = "; ".join(gemm_label(g) for g in r["gemms"])
        note = f"{r['kernels']} kernels, {r['traffic_over_ideal']:.2f}x ideal bytes"
        note += ", conditional" if r["conditional"] else ""
        table.append([r["product"], str(len(r["gemms"])), gemms, note])
    print(render_table(["product", "GEMMs", "kinds (operand dtypes)", "Triton-on compile"], table,
                       right=(1,)))
    return rows


def _print_entry_points(args, shape) -> list:
    rows = report_rows(shape, args.target, args.only, args.dump, full=not args.short)
    headers = ["entry point", "kernels", "passes", "kinds", "traffic/ideal"]
    headers += ["pred TB/s"] if args.target else []
    headers += ["fused ops", "regs/spill", "notes"]
    table = []
    for r in rows:
        if "error" in r:
            table.append([r["entry point"], "n/a", r["error"][:80]] + [""] * (len(headers) - 3))
            continue
        cells = [r["entry point"], str(r["kernels"]), str(r["passes"]), r["kinds"],
                 f"{r['traffic_over_ideal']:.2f}"]
        cells += [f"{r['pred TB/s']:.2f}"] if args.target else []
        cells += [str(r["fused_ops"]), r["regs/spill"], r["notes"]]
        table.append(cells)
    print(render_table(headers, table, right=(1, 2, 4, 5)))
    return rows


if __name__ == "__main__":
    sys.exit(main())
