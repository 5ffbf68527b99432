"""Scale schemes: what a block format's scales mean.

A block format (:class:`~lowprec.MXFormat`) is an element format, a block size and a scale
scheme. The scheme owns everything about the scales: the element format of the scale codes,
whether a float32 scale of the whole tensor multiplies them, its options (one frozen value
per cast, of the scheme's own ``Options`` class: E8M0's :class:`~lowprec.ScaleRule`, NVFP4's
element step), how a block's scale codes and its elements' scaled inputs follow from the
block's values (the block encoder's question), how codes turn back into values (the
decoder's), and what a valid tensor-scale leaf of an :class:`~lowprec.MXArray` is. The
block encoder, the decoder, the option objects, MXArray and the analysis ask the scheme;
none of them knows a scheme by name. Faster formulations of the same bits are optional
objects a scheme returns (:class:`FastEncoder`, :class:`FastDecoder`), which
``kernels/_dispatch.py`` asks for.

A scheme is data plus one module: ``formats/elements.json``'s ``scale_schemes`` table names it
and fixes its scale format and tensor-scale flag, and ``_scheme_<name>.py`` holds its
arithmetic as a :class:`ScaleScheme` subclass registered under that name (:func:`register`),
imported the first time a scheme of that name is looked up (:func:`scheme_class`). Adding a
scale encoding is that module and that data entry; adding a knob to it is a field of its
``Options``.
``lowprec.scale_scheme`` (in ``_format.py``, the loader of format objects) joins the two and
checks that they agree.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import importlib
import re
from typing import TYPE_CHECKING, ClassVar, Optional

if TYPE_CHECKING:  # _format imports this module; a scheme only reads the formats it is given
    from ._format import ElementFormat

_REGISTRY: dict = {}


def register(name: str):
    """Class decorator: registers a :class:`ScaleScheme` subclass as the arithmetic of the
    scale scheme ``name`` (a key of ``lowprec_formats.SCALE_SCHEMES``, or a scheme built
    directly, as a test's). One class per name."""

    def add(cls):
        if not (isinstance(cls, type) and issubclass(cls, ScaleScheme)):
            raise TypeError(f"register({name!r}) takes a ScaleScheme subclass, got {cls!r}")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"scale scheme {name!r} is already registered "
                             f"({_REGISTRY[name].__name__})")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return add


def registered(scheme) -> bool:
    """Whether ``scheme`` is an instance of a registered scheme class."""
    return isinstance(scheme, ScaleScheme) and _REGISTRY.get(type(scheme).name) is type(scheme)


def scheme_class(name: str):
    """The class registered as the arithmetic of scheme ``name``, importing its module
    ``_scheme_<name>.py`` first if no class is registered yet; None if there is none."""
    if name not in _REGISTRY and _MODULE_SUFFIX.fullmatch(name):
        module = f"{__package__}._scheme_{name}"
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
    return _REGISTRY.get(name)


_MODULE_SUFFIX = re.compile(r"[a-z0-9_]+")


def registered_names() -> tuple:
    """Names of the registered scheme classes, in registration order."""
    return tuple(_REGISTRY)


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options value of a scheme that has none (every cast of it is the same)."""


@dataclasses.dataclass(frozen=True, repr=False)
class ScaleScheme(abc.ABC):
    """What one way of encoding block scales means (frozen and hashable: part of an
    :class:`~lowprec.MXFormat`, a static ``jit`` argument).

    A scheme says how a block's scale follows from its largest magnitude
    (:meth:`encode_blocks`), what a tensor scale is (:meth:`tensor_scale_bits` and its
    checks), what it accepts (:meth:`check_scale`, :meth:`check_element`), how codes decode
    (:meth:`decode_values`) and what each block's elements are scaled by
    (:meth:`element_scale`). Its encode options are one frozen, hashable value of its own
    class :attr:`Options` (E8M0: the :class:`~lowprec.ScaleRule`; NVFP4: the
    :class:`~lowprec.NVFP4Step`; none: :class:`NoOptions`), which an
    :class:`~lowprec._options.MXCast` carries as ``scale_options``: the fields of
    :attr:`Options` are the public keywords that set them (``scale_rule=``,
    ``nvfp4_step=``), so a new knob is a field there and nothing else. Faster
    formulations of the same bits are optional objects (:meth:`fast_encoder`,
    :meth:`fast_decoder`; None: the exact path), which ``kernels/_dispatch.py`` asks for.

    Array arguments are uint32 float32 bit patterns unless said otherwise; blocks are split
    in place (``[..., blocks, block, ...]``, the position within a block at axis ``inner``).

    Attributes:
      scale: the element format of the per-block scale codes (uint8 codes).
    """

    scale: "ElementFormat"

    #: The registry name (set by :func:`register`).
    name: ClassVar[str] = ""
    #: The class of the scheme's options value (a frozen dataclass whose fields have
    #: defaults; each field is a keyword of the public entry points).
    Options: ClassVar[type] = NoOptions
    #: Whether a float32 scale of the whole tensor multiplies every block scale (an extra
    #: MXArray leaf).
    tensor_scale: ClassVar[bool] = False
    #: Whether scale code s is the power of two 2^(s - bias), the block's shared exponent
    #: (what ``lowprec.shared_exponents`` returns, by :meth:`exponents_of_amax`).
    exponent_scales: ClassVar[bool] = False
    #: How the block scales are chosen, in words (for messages).
    recipe: ClassVar[str] = ""
    #: The element roundings a cast may ask for; None: every mode of the element format. A
    #: scheme that rounds its elements itself (docs/design.md §3c) names the ones it has.
    roundings: ClassVar[Optional[tuple]] = None

    def __post_init__(self):
        self.check_scale()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    # -- checks ------------------------------------------------------------------------

    @abc.abstractmethod
    def check_scale(self) -> None:
        """Raises a ValueError unless ``self.scale`` is the scale format this arithmetic
        decodes."""
        raise NotImplementedError

    def check_element(self, element: "ElementFormat", fmt_name: str) -> None:
        """Raises a ValueError if blocks of ``element`` cannot be scaled this way."""

    # -- options (checked once, at the public entry points) ------------------------------

    def options(self, given=None, fmt_name: str = "", **keywords):
        """The scheme's options value (an :attr:`Options`) of a cast: ``given`` (an
        :attr:`Options` value, a mapping of its fields, or None: the defaults) with the
        public ``keywords`` that are not None set on it (each a field of :attr:`Options`;
        any other raises a ValueError naming the keyword and the schemes it applies to)."""
        cls = self.Options
        fields = {k: v for k, v in keywords.items() if v is not None}
        if given is None and not fields:
            return _default_options(cls)  # the common call: built and checked once
        if isinstance(given, cls):
            pass
        elif given is None or isinstance(given, dict):
            fields = {**(given or {}), **fields}
            given = None
        else:
            raise TypeError(f"{fmt_name}: scale_options must be a {cls.__name__} (the options "
                            f"of {self.name!r} scales) or a dict of its fields, got {given!r}")
        names = self.option_names()
        for k in fields:
            if k not in names:
                takers = [n for n, c in _REGISTRY.items() if k in _field_names(c.Options)]
                where = (" applies to " + ", ".join(n.upper() for n in takers) + " scales,"
                         if takers else " is no option of any scale scheme,")
                valid = (f" ({self.name!r} options: {', '.join(names)})" if names
                         else f" ({self.name!r} scales take no options)")
                raise ValueError(f"{k}{where} not to {fmt_name or self.name}{valid}; drop it")
        if given is not None:
            return dataclasses.replace(given, **fields) if fields else given
        return cls(**fields)

    def cast_options(self, given=None, fmt_name: str = "", **keywords):
        """The options of one cast (``MXCast``'s, and the checkpoint pipeline's without
        JAX): :meth:`options` with the call's public keywords, where a ``scale_rule`` is
        dropped if the scheme takes none (one rule is given for every operand of a dot)."""
        if not self.takes("scale_rule"):
            keywords.pop("scale_rule", None)
        return self.options(given, fmt_name, **keywords)

    @classmethod
    def option_names(cls) -> tuple:
        """The fields of :attr:`Options`: the keywords a cast of this scheme takes."""
        return _field_names(cls.Options)

    @classmethod
    def takes(cls, option: str) -> bool:
        """Whether the scheme's options have the field ``option`` (a public keyword)."""
        return option in cls.option_names()

    @property
    def takes_scale_rule(self) -> bool:
        """Whether a :class:`~lowprec.ScaleRule` chooses the block scales (the readers'
        spelling of ``takes("scale_rule")``)."""
        return self.takes("scale_rule")

    def tensor_scale_option(self, tensor_scale, fmt_name: str, func: str):
        """A call's ``tensor_scale=`` as the float32 scalar the encoder takes, or None (then the
        encoder computes it, where the scheme has one)."""
        if tensor_scale is not None:
            raise ValueError(
                f"{func}: {fmt_name} has no tensor scale (its {self.scale.name.upper()} block "
                "scales stand alone; only a format with a tensor scale, such as NVFP4, takes "
                "one); drop tensor_scale"
            )
        return None

    def check_tensor_scale_leaf(self, ts, scales, fmt_name: str, shape: tuple) -> None:
        """Raises unless ``ts`` is a valid tensor-scale leaf of an MXArray whose scale codes
        are ``scales`` and whose logical shape is ``shape`` (placeholders and tracers pass)."""
        if ts is not None:
            raise ValueError(f"MXArray: {fmt_name} has no tensor scale, got tensor_scale={ts!r}")

    # -- encode ------------------------------------------------------------------------

    def tensor_scale_bits(self, bits, tensor_scale, cast, amax=None):
        """Bits (uint32 scalar) of the tensor scale used to quantize the (padded) float32
        patterns ``bits``, from the caller's ``tensor_scale`` or computed; None without one.
        ``amax``: the largest magnitude bits of each block of ``bits`` where the caller has
        them (the block encoder), else None."""
        return None

    @abc.abstractmethod
    def encode_blocks(self, xb, amax, ts_bits, cast, inner: int):
        """The scales of blocks ``xb`` whose largest magnitudes (bits, NaN/inf above every
        finite pattern) are ``amax``: ``(scale_codes, special, quotient, scale_exp)``.

        ``scale_codes`` (int, per block) are final, the scale format's NaN code for a
        ``special`` block (one holding NaN or inf); each element is encoded from
        ``quotient`` (float32 patterns shaped as ``xb``) divided by 2^``scale_exp``
        (per block, expanded at ``inner``; None: not divided), saturating. The cast's
        options are ``cast.scale_options`` (an :attr:`Options`).
        """
        raise NotImplementedError

    def exponents_of_amax(self, amax, cast):
        """The shared exponents (int32) of blocks with largest magnitudes ``amax``, for
        schemes with :attr:`exponent_scales`."""
        raise NotImplementedError(f"{self.name} scales are not shared exponents")

    def fast_encoder(self) -> Optional["FastEncoder"]:
        """The scheme's hardware-float formulation of :meth:`encode_blocks` (a
        :class:`FastEncoder`), or None (the block encoder takes the exact path)."""
        return None

    # -- decode ------------------------------------------------------------------------

    @abc.abstractmethod
    def decode_values(self, value_bits, scale_codes, tensor_scale):
        """Exact float32 patterns of element values ``value_bits`` (split blocks) times their
        block scales, ``scale_codes`` broadcastable to them (and the float32
        ``tensor_scale``, where the scheme has one); a NaN scale code gives NaN."""
        raise NotImplementedError

    def fast_decoder(self) -> Optional["FastDecoder"]:
        """Faster formulations of :meth:`decode_values` (a :class:`FastDecoder`), or None
        (the block decoder builds every value from bits)."""
        return None

    # -- analysis ----------------------------------------------------------------------

    def element_scale(self, scale_codes, tensor_scale):
        """What each block's elements are scaled by, for error studies: an int32 exponent e
        (a factor 2^e; 128 for a NaN block) where scales are shared exponents, else the
        float32 factor (NaN for a NaN block)."""
        raise NotImplementedError


@functools.lru_cache(maxsize=None)
def _field_names(options_cls) -> tuple:
    return tuple(f.name for f in dataclasses.fields(options_cls))


@functools.lru_cache(maxsize=None)
def _default_options(options_cls):
    return options_cls()


class FastEncoder(abc.ABC):
    """A scheme's hardware-float formulation of :meth:`ScaleScheme.encode_blocks`: the block
    encoder's ``Formulation.HWFLOAT`` (``_mx_hwfloat.py``), taken on CPU where
    ``kernels/_dispatch.py`` allows it and :meth:`scales` says it is exact for the array.

    It runs on CPU only (XLA:CPU's float semantics: subnormal operands and results flushed
    to zero, a division by a broadcast turned into a product with the reciprocal)."""

    @abc.abstractmethod
    def scales(self, amax, ts_bits, cast):
        """The blocks' scale codes: ``(scale_codes, exact)``, uint8 codes.

        ``exact`` (a scalar bool) says that the path is right for every block:
        ``scale_codes`` equal those of ``encode_blocks`` bit for bit, and so do the
        ``special`` flags of :meth:`operands`; and for every element of a block not
        ``special``, :meth:`quotients` with the ``operand`` of :meth:`operands` gives the
        float32 quotient that the exact path rounds, or, where that quotient is below
        2^-126, anything below 2^-126 (under nearest-even rounding both give a zero
        element). Where it is False the block encoder takes the exact path for the whole
        array."""

    @abc.abstractmethod
    def operands(self, scale_codes, ts_bits, cast):
        """``(special, operand)`` per block from the codes of :meth:`scales`: the blocks
        holding a NaN or an infinity, and what :meth:`quotients` divides or multiplies by.
        Called inside the hardware-float branch, so that XLA may compute them in the element
        loop instead of writing them out before the branch."""

    @abc.abstractmethod
    def quotients(self, magnitudes, operand, x_bits, cast):
        """float32 quotients of float32 ``magnitudes`` (blocks split; their patterns with
        the signs are ``x_bits``) by their blocks' scales, by hardware float arithmetic with
        ``operand`` from :meth:`operands` (expanded to broadcast against them)."""


class FastDecoder:
    """Faster formulations of a scheme's :meth:`ScaleScheme.decode_values`, each giving
    the same bits where it applies (``kernels/_dispatch.decode_formulations`` names them,
    ``_mx_decode.py`` computes them); every method's default says "none"."""

    #: Whether :meth:`route` chooses between two formulations of a decode with a tensor scale
    #: (then :meth:`route` and :meth:`routed_values` are implemented).
    routes: ClassVar[bool] = False

    def one_multiply(self, element: "ElementFormat") -> bool:
        """Whether values may be decoded by one float32 multiply per element by
        :meth:`scale_factors` (exact where :meth:`scale_min` says)."""
        return False

    def scale_min(self, element: "ElementFormat") -> int:
        """The smallest scale code at which the one-multiply decode of every ``element``
        value is a float32 normal (or zero)."""
        raise NotImplementedError

    def scale_factors(self, scale_codes):
        """float32 factor of each scale code, for the one-multiply decode."""
        raise NotImplementedError

    def narrow(self, value_bits, scale_codes, element: "ElementFormat", out_bits: int):
        """``decode_values`` without a tensor scale, as float32 (``out_bits=32``) or
        bfloat16 (16, rounded to nearest even) patterns in a uint32, by a formulation with
        fewer operations per element; None where there is none for ``element``."""
        return None

    def route(self, scale_codes, tensor_scale):
        """For a decoder that :attr:`routes`, ``(serves, blocks)``: a scalar bool choosing
        between two formulations of :meth:`routed_values` for the whole array, and the
        per-block values both use, from the scales alone. On CPU the block decoder computes
        them once and branches before decoding any element, so that each branch decodes in
        one loop (a branch inside ``decode_values`` would have the element values written
        out first)."""
        raise NotImplementedError

    def routed_values(self, value_bits, scale_codes, tensor_scale, route):
        """``decode_values`` in the branch ``route = (flag, blocks)`` its caller took
        (``flag`` a Python bool, or a per-block array: each block's own branch)."""
        raise NotImplementedError
