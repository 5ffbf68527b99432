"""The :class:`Layout` object: how a checkpoint stores quantized tensors, and its registry.

A layout is one frozen, hashable object registered under its name (``--layout NAME`` and the
``layout=`` argument of the Python API look it up here; an unknown name is refused with the
registered ones listed). lowprec's own layouts and the engines' are each one module
(``_layout_lowprec``, ``_layout_gpt_oss``, ``_layout_ct``, ``_layout_modelopt``,
``_layout_gguf``); a new one is one module more (tests/test_checkpoint_layouts.py registers a
toy one). What a layout provides (docs/design.md §16):

- ``holds(fmt)``: whether it can store the checkpoint format ``fmt``; :meth:`Layout.check_format`
  refuses the rest with the layout's name and what it holds.
- The reader side: ``recognize(reader)`` → ``{logical name: (spec, {role: stored} or None)}``
  for the tensors of one safetensors file stored in this layout (by metadata, or by stored
  names, dtypes and shapes), and ``check(reader, name, spec, parts, config, data)``: its part
  of :mod:`lowprec.checkpoint._validate` (config agreement, stored scales). A spec lists its
  stored parts (``parts(name)``) and decodes them (:func:`lowprec.checkpoint._convert`'s
  readers: ``decode_pieces``, or lowprec's own pieces).
- The writer side: ``quantize(src, dst, fmt, **options)`` and ``convert(src, dst,
  **options)`` (a quantized checkpoint moved into this layout, bits kept), each returning a
  :class:`~lowprec.checkpoint.ConversionReport`; the layout's config.json, side files and
  metadata are written there.
- A layout with its own container (GGUF) says which paths are its files (``owns_path``) and
  serves ``dequantize`` / ``inspect`` of them too.
- Its config: ``quant_method`` (config.json's, None for none), ``read_config``,
  ``keep_config``; moving bits between layouts: ``lowprec_arrays`` and the scale
  conventions (``reciprocal_global_scale``, ``scales_in_model_dtype``, ``scalar_shape``);
  ``label`` names a tensor's format in ``inspect``. No code outside a layout's module
  branches on its name: it asks the object.

Example:
    >>> from lowprec.checkpoint import get_layout, layout_names
    >>> get_layout("gpt-oss").holds(checkpoint_format("mxfp4"))
    True
    >>> "compressed-tensors" in layout_names()
    True
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import ClassVar, Optional

from ._errors import CheckpointError
from ._formats import checkpoint_format  # noqa: F401 (the doctest's)

__all__ = ["Layout", "get_layout", "is_default", "layout_names", "layout_of_path", "layouts",
           "register", "unregister"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """A checkpoint layout (see the module docstring for what a subclass provides).

    Attributes:
      name: the registered name (``--layout NAME``).
      summary: one line on what it stores, for ``--help`` and error messages.
    """

    name: str
    summary: str = ""

    # -- what it holds ---------------------------------------------------------------
    def holds(self, fmt) -> bool:
        """Whether the layout can store checkpoint format ``fmt`` (a format object)."""
        return False

    def holdable(self) -> str:
        """What the layout holds, in words (for refusals)."""
        return "nothing lowprec writes"

    #: Where to go instead, appended to a refusal ("use --layout lowprec").
    instead: ClassVar[str] = ""

    def check_format(self, fmt, *, axis=None) -> None:
        """Refuses a format the layout cannot store (naming both and what it holds), or a
        block ``axis`` it cannot (None: the default)."""
        if not self.holds(fmt):
            raise CheckpointError(
                f"the {self.name} layout holds {self.holdable()}, not "
                f"{getattr(fmt, 'name', fmt)}" + (f"; {self.instead}" if self.instead else ""))

    # -- the reader side ---------------------------------------------------------------
    #: Whether tensors recognized by this layout are the whole file's quantized tensors (the
    #: later layouts are then not asked): lowprec's metadata, which names every one.
    exclusive: ClassVar[bool] = False

    def recognize(self, reader) -> Optional[dict]:
        """``{name: (spec, {role: stored name} or None)}`` of the quantized tensors of
        ``reader`` stored in this layout (None: the file is not in it at all)."""
        return None

    def check(self, reader, name, spec, parts, config, data: bool) -> None:
        """This layout's checks of one recognized tensor (beside the shape and dtype checks
        every reader makes): agreement with the checkpoint's quantization ``config``, and
        with ``data``, the stored scales."""

    # -- the writer side -------------------------------------------------------------
    def quantize(self, src, dst, fmt, **options):
        """Quantizes the high-precision checkpoint ``src`` into ``dst`` in this layout."""
        raise CheckpointError(f"the {self.name} layout is read only: lowprec does not write it")

    def convert(self, src, dst, **options):
        """Moves the quantized tensors of ``src`` into this layout (bits kept, or refused)."""
        raise CheckpointError(f"lowprec convert does not write the {self.name} layout; "
                              f"it writes: {', '.join(n for n, l in _REGISTRY.items() if l.converts)}")

    @property
    def converts(self) -> bool:
        """Whether ``convert`` can write this layout."""
        return type(self).convert is not Layout.convert

    @property
    def title(self) -> str:
        """The layout's name in messages (its registered name, or how its tool spells it)."""
        return self.name

    def label(self, spec) -> str:
        """How ``inspect`` names the format of a tensor stored in this layout."""
        return f"{spec.format.name} ({self.name})"

    # -- moving NVFP4 / MX / FP8 bits between layouts (lowprec convert) ---------------
    # What :func:`~lowprec.checkpoint._engine_convert.convert_layouts` asks of a layout it
    # moves bits out of or into (the engine layouts and lowprec's say more).
    #: NVFP4's tensor scale stored as its reciprocal (compressed-tensors' global scale).
    reciprocal_global_scale: ClassVar[bool] = False
    #: FP8 scales stored in the model dtype (compressed-tensors), not float32.
    scales_in_model_dtype: ClassVar[bool] = False
    #: The stored shape of a tensor-wide number.
    scalar_shape: ClassVar[tuple] = ()

    def lowprec_arrays(self, spec, arrays: dict) -> Optional[dict]:
        """A recognized tensor's stored ``arrays`` (``{role: array}``) in the roles of
        lowprec's layout (elements, scales, scale, values), for moving them to another
        layout; None: its tensors are not moved that way."""
        return None

    # -- the checkpoint's quantization config (config.json) ----------------------------
    #: The ``quant_method`` of config.json's ``quantization_config`` that says this layout
    #: (None: the layout has no config; lowprec's own records its tensors in metadata).
    quant_method: ClassVar[Optional[str]] = None
    #: A config file of its own beside config.json (ModelOpt's ``hf_quant_config.json``).
    config_file: ClassVar[Optional[str]] = None

    def read_config(self, q: Optional[dict], hf: Optional[dict], where: str):
        """The :class:`~lowprec.checkpoint._qconfig.QuantConfig` of config.json's
        ``quantization_config`` ``q`` (and ModelOpt's ``hf_quant_config.json`` ``hf``)."""
        raise NotImplementedError

    def keep_config(self, config, groups, decoded) -> tuple:
        """``(quantization_config, hf_quant_config)`` after decoding modules ``decoded``
        while the ``groups`` claiming the others stay
        (:func:`~lowprec.checkpoint._qconfig.config_keeping`)."""
        raise NotImplementedError

    # -- a container of its own ------------------------------------------------------
    def owns_path(self, path, *, output: bool = False) -> bool:
        """Whether ``path`` is a file in this layout's own container (not safetensors); an
        ``output`` is judged by its name (it may not exist yet)."""
        return False


_REGISTRY: dict = {}


def is_default(value, default) -> bool:
    """Whether an option holds its default (so a layout is not handed it): the default's
    own value, or an empty sequence for a sequence option (or one defaulting to None).

    Example:
        >>> is_default(False, None), is_default([], ()), is_default(1, 1), is_default(True, 1)
        (False, True, True, False)
    """
    if value is None or value is False or default is None or default is False:
        return value is default or (isinstance(value, (tuple, list)) and not value
                                    and default is None)
    if isinstance(value, (tuple, list)) and not value:
        return default is None or default == ()
    return type(value) is type(default) and isinstance(default, (int, str)) and value == default


def register(layout: Layout, *, replace: bool = False) -> Layout:
    """Registers ``layout`` under its name (returned, so it can decorate an instance).

    Raises:
      TypeError: ``layout`` is not a :class:`Layout`.
      ValueError: the name is taken (unless ``replace``).
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"register takes a Layout, got {type(layout).__name__}")
    if not replace and layout.name in _REGISTRY and _REGISTRY[layout.name] != layout:
        raise ValueError(f"a layout named {layout.name!r} is already registered")
    _REGISTRY[layout.name] = layout
    return layout


def unregister(name: str) -> None:
    """Removes a registered layout (tests that register a toy one clean up with it)."""
    _REGISTRY.pop(name, None)


def layouts() -> tuple:
    """The registered layouts, in registration order (the order readers ask them in)."""
    return tuple(_REGISTRY.values())


def layout_names(*, writes: Optional[str] = None) -> tuple:
    """The registered names; ``writes="convert"``: only those ``convert`` writes."""
    return tuple(l.name for l in _REGISTRY.values() if writes != "convert" or l.converts)


def get_layout(layout, *, writes: Optional[str] = None) -> Layout:
    """The registered layout named ``layout`` (a :class:`Layout` is returned as is).

    Raises:
      CheckpointError: an unknown name, with the closest and all registered ones.
    """
    if isinstance(layout, Layout):
        return layout
    found = _REGISTRY.get(layout) if isinstance(layout, str) else None
    names = layout_names(writes=writes)
    if found is None or found.name not in names:
        close = difflib.get_close_matches(layout, names, n=2) if isinstance(layout, str) else []
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        what = " for convert" if writes == "convert" else ""
        raise CheckpointError(f"unknown layout {layout!r}{what}; choose one of: "
                              f"{', '.join(names)}{hint}")
    return found


def layout_of_path(src, dst=None) -> Optional[Layout]:
    """The layout whose own container ``src`` (an input) or ``dst`` (an output) is (GGUF),
    else None (safetensors)."""
    for layout in _REGISTRY.values():
        if layout.owns_path(os.fspath(src)) or (
                dst is not None and layout.owns_path(os.fspath(dst), output=True)):
            return layout
    return None
