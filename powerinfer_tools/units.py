"""Reading and printing byte sizes such as ``11GB``, ``11GiB`` or ``1.5g``.

One rule (units are case-insensitive, so ``gb`` is ``GB``; a trailing ``b`` never means bits): the letter
K, M, G or T alone is decimal, with an ``i`` binary.

* ``K M G T``, with or without ``B`` (``kB MB GB TB``, ``1.5g``), are 10^3, 10^6, 10^9, 10^12 bytes (SI);
* ``KiB MiB GiB TiB`` are 2^10, 2^20, 2^30, 2^40 bytes (IEC);
* ``B`` is bytes. A number without a unit is rejected: ``11`` could mean GB or GiB.

(A bare letter was binary before, as PowerInfer's ``--vram-budget`` counts GiB: ``1.5g`` is now 1.5 GB, the
smaller budget.)

Fractional results are rounded down to whole bytes. A size is at least 1 byte (0 where an option
allows it, e.g. ``--reserve 0B``) and below 2^63 (8 EiB): sizes are stored as 64-bit integers.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

from powerinfer_tools.errors import PitoolsError

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
}

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)\s*", re.IGNORECASE)

ACCEPTED_FORMS = (
    "11GB or 11000MB (decimal: GB = 10^9 bytes, and so is a bare G), 11GiB or 11264MiB (binary: GiB = 2^30 "
    "bytes); units B, kB, MB, GB, TB, KiB, MiB, GiB, TiB"
)


MAX_SIZE = 2**63 - 1  # split and profile files store sizes as 64-bit integers, and so do the solvers


def parse_size(text: str, what: str = "size", minimum: int = 1) -> int:
    """Return the number of bytes that ``text`` names; PitoolsError if it is not a size, or one
    below ``minimum`` bytes (1 unless the option allows 0) or above ``MAX_SIZE``."""
    match = _SIZE.fullmatch(text)
    unit = match and _UNITS.get(match.group(2).lower())
    if not unit:
        raise PitoolsError(f"{what}: cannot read {text!r} as a size; write it as {ACCEPTED_FORMS}")
    # Decimal, not float: 0.3kB must be 300 bytes, not 299.
    return check_size(int(Decimal(match.group(1)) * unit), what, minimum)


def check_size(nbytes: int, what: str = "size", minimum: int = 1) -> int:
    """``nbytes``, if it is a size from ``minimum`` to ``MAX_SIZE`` bytes; else PitoolsError naming ``what``."""
    if nbytes < minimum:
        raise PitoolsError(f"{what}: {nbytes} bytes is too small; it must be at least "
                           f"{format_size(minimum, round_up=True)}")
    if nbytes > MAX_SIZE:
        raise PitoolsError(f"{what}: {format_size(nbytes)} is too large; sizes stop below 2^63 bytes (8 EiB)")
    return nbytes


def format_size(nbytes: float, round_up: bool = False) -> str:
    """``12345678901`` -> ``'11.50 GiB'``: binary units, as GPU tools report memory. ``round_up``: at the last digit
    shown (of a size >= 0), for a minimum the user is told to give: the text then reads back (``parse_size``) as at
    least ``nbytes``, where the nearest hundredth may fall short (4.5415 MiB shown as 4.54 MiB)."""
    for unit, scale in (("EiB", 2**60), ("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            if round_up:  # in integers: a float's rounding could land a hundredth below
                hundredths = -(-math.ceil(nbytes) * 100 // scale)
                return f"{hundredths // 100}.{hundredths % 100:02d} {unit}"
            return f"{nbytes / scale:.2f} {unit}"
    return f"{math.ceil(nbytes) if round_up else int(nbytes)} B"
