"""Link rates as ``tc`` writes them: ``1gbit``, ``500mbit``, ..."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

#: tc's SI bit-rate units (tc(8): "kbit" is 1000 bits per second).
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
#: TCP/IPv4 headers with timestamps (20 + 20 + 12) ride inside the MTU, the Ethernet header (14)
#: outside it; tbf counts whole frames, header included.
_TCP_IP_HEADERS = 52
ETHERNET_HEADER_BYTES = 14
_RATE = re.compile(r"^\s*(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[a-z]+)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class LinkRate:
    """A link's rate in bits per second."""

    bits_per_second: int

    def __post_init__(self) -> None:
        if self.bits_per_second <= 0:
            raise ValueError(f"a link rate must be positive, got {self.bits_per_second} bit/s")

    @classmethod
    def parse(cls, text: str) -> LinkRate:
        """``"2gbit"`` -> 2e9 bit/s; units are tc's: bit, kbit, mbit, gbit, tbit (SI)."""
        match = _RATE.match(text)
        unit = match["unit"].lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"bad link rate {text!r}: write a number and one of {', '.join(_UNITS)}, "
                "e.g. 2gbit or 500mbit"
            )
        return cls(round(float(match["number"]) * _UNITS[unit]))

    @property
    def bytes_per_second(self) -> float:
        """The rate in bytes per second."""
        return self.bits_per_second / 8

    def payload_bytes_per_second(self, mtu: int) -> float:
        """TCP payload bytes per second of a stream of full-size frames: the usable rate."""
        return self.bytes_per_second * (mtu - _TCP_IP_HEADERS) / (mtu + ETHERNET_HEADER_BYTES)

    @property
    def tc_argument(self) -> str:
        """The rate as tc reads it, exactly."""
        return f"{self.bits_per_second}bit"

    def __str__(self) -> str:
        for unit in ("tbit", "gbit", "mbit", "kbit"):
            scale = _UNITS[unit]
            if self.bits_per_second % scale == 0:
                return f"{self.bits_per_second // scale}{unit}"
        return f"{self.bits_per_second}bit"


def rate_argument(text: str) -> LinkRate | None:
    """argparse type for a rate flag: a tc rate, or ``none``/``unshaped`` for no shaping."""
    if text.lower() in ("none", "unshaped"):
        return None
    try:
        return LinkRate.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
