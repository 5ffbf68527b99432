"""A NumPy model of the few PTX instructions lowprec's inline assembly uses, to run that
assembly's text on CPU.

Semantics from the PTX ISA (version 8.x, "Integer Arithmetic", "Logic and Shift", "Data
Movement and Conversion: prmt", "Half Precision Floating-Point"): ``shf.r.wrap.b32 d, a, b,
c`` is the low word of the 64-bit (b:a) shifted right by c mod 32; ``lop3.b32 d, a, b, c,
lut`` gives, per bit, bit ``(a << 2) | (b << 1) | c`` of ``lut``; ``prmt.b32 d, a, b, c``
(default mode) picks, for output byte i, byte ``c[4i+2:4i]`` of {b, a} (a is bytes 0-3),
replaced by the replicated sign bit of that byte when ``c[4i+3]`` is set;
``mul.rn.bf16x2`` multiplies each 16-bit half as bfloat16, rounding to nearest even, with
subnormals kept (no flush-to-zero exists for it); ``max.u16x2`` takes each half's unsigned
maximum; ``mad.lo.u32`` the low 32 bits of a·b + c.

Registers are uint32 NumPy arrays (one lane per element, so a whole batch of inputs runs at
once); ``$n`` operands are the caller's, names declared with ``.reg`` are local.
"""

from __future__ import annotations

import re

import numpy as np

_U32 = np.uint32


def _bf16_to_f64(bits16: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return (bits16.astype(_U32) << _U32(16)).view(np.float32).astype(np.float64)


def _f64_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float64 values to bfloat16 (nearest even, subnormals kept, overflow to inf) and
    return the 16-bit patterns. Exact products of two bfloat16 values are float64 values."""
    x = np.asarray(x, np.float64)
    out = np.zeros(x.shape, np.float64)
    finite = np.isfinite(x) & (x != 0)
    _, e = np.frexp(np.where(finite, x, 1.0))  # x = f · 2^e, 0.5 <= |f| < 1
    quantum = np.maximum(e - 8, -133).astype(np.float64)  # 8 significant bits; 2^-133 floor
    scaled = np.where(finite, x / np.exp2(quantum), 0.0)
    rounded = np.rint(scaled) * np.exp2(quantum)  # np.rint: ties to even
    out = np.where(finite, rounded, x)  # zeros (signed), inf and NaN pass through
    out = np.where(np.abs(out) > 3.3895313892515355e38, np.copysign(np.inf, out), out)
    with np.errstate(over="ignore", invalid="ignore"):
        bits = (out.astype(np.float32).view(_U32) >> _U32(16)).astype(np.uint16)
    return np.where(np.isnan(out), np.uint16(0x7FC0), bits)


def _halves(v):
    return v & _U32(0xFFFF), v >> _U32(16)


def _join(lo, hi):
    return (lo.astype(_U32) & _U32(0xFFFF)) | (hi.astype(_U32) << _U32(16))


def _prmt(a, b, c):
    src = [(a >> _U32(8 * i)) & _U32(0xFF) for i in range(4)]
    src += [(b >> _U32(8 * i)) & _U32(0xFF) for i in range(4)]
    out = np.zeros(np.broadcast(a, b, c).shape, _U32)
    for i in range(4):
        nib = (c >> _U32(4 * i)) & _U32(0xF)
        sel = np.choose((nib & _U32(7)).astype(np.int64), src)
        rep = np.where((sel >> _U32(7)) & _U32(1), _U32(0xFF), _U32(0))
        out |= np.where(nib & _U32(8), rep, sel) << _U32(8 * i)
    return out


def _lop3(a, b, c, lut):
    out = np.zeros(np.broadcast(a, b, c).shape, _U32)
    for bit in range(32):
        idx = (((a >> _U32(bit)) & 1) << 2) | (((b >> _U32(bit)) & 1) << 1) | ((c >> _U32(bit)) & 1)
        out |= ((_U32(lut) >> idx) & _U32(1)) << _U32(bit)
    return out


def _mul_bf16x2(a, b):
    (alo, ahi), (blo, bhi) = _halves(a), _halves(b)
    with np.errstate(invalid="ignore", over="ignore"):  # inf × 0 is NaN, as in IEEE
        lo = _f64_to_bf16(_bf16_to_f64(alo) * _bf16_to_f64(blo))
        hi = _f64_to_bf16(_bf16_to_f64(ahi) * _bf16_to_f64(bhi))
    return _join(lo, hi)


def _max_u16x2(a, b):
    (alo, ahi), (blo, bhi) = _halves(a), _halves(b)
    return _join(np.maximum(alo, blo), np.maximum(ahi, bhi))


def _shf_r_wrap(a, b, c):
    c = np.asarray(c, _U32) & _U32(31)
    wide = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    return ((wide >> c.astype(np.uint64)) & np.uint64(0xFFFFFFFF)).astype(_U32)


_OPS = {
    "shf.r.wrap.b32": lambda a, b, c: _shf_r_wrap(a, b, c),
    "and.b32": lambda a, b: a & b,
    "shl.b32": lambda a, b: (a << (b & _U32(31))).astype(_U32),
    "lop3.b32": _lop3,
    "prmt.b32": _prmt,
    "mul.rn.bf16x2": _mul_bf16x2,
    "max.u16x2": _max_u16x2,
    "mad.lo.u32": lambda a, b, c: (a.astype(np.uint64) * b.astype(np.uint64) + c).astype(_U32),
}


def run(asm: str, operands: dict) -> dict:
    """Runs ``asm`` (one instruction per line) with ``operands`` {n: uint32 array or int} for
    ``$n``; returns every ``$n`` after the run (outputs included)."""
    regs = {f"${n}": np.asarray(v, _U32) for n, v in operands.items()}

    def value(tok: str):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok):
            return _U32(int(tok, 0) & 0xFFFFFFFF)
        raise KeyError(f"unknown operand {tok!r}")

    for line in asm.splitlines():
        line = line.split("//")[0].strip()
        if not line or line in ("{", "}") or line.startswith(".reg"):
            continue
        m = re.fullmatch(r"(\S+)\s+(.*);", line)
        if m is None or m.group(1) not in _OPS:
            raise NotImplementedError(f"no model for PTX line {line!r}")
        dst, *srcs = [s.strip() for s in m.group(2).split(",")]
        regs[dst] = np.asarray(_OPS[m.group(1)](*[value(s) for s in srcs]), _U32)
    return {k: v for k, v in regs.items() if k.startswith("$")}


def instructions(asm: str) -> list:
    """The instruction lines of an inline-assembly text."""
    return [ln.strip() for ln in asm.splitlines()
            if ln.strip() and ln.strip() not in ("{", "}") and not ln.strip().startswith(".reg")]
