"""Reading ``LTA_*`` environment variables: every bad value is one :class:`UsageError` (a ValueError) that
names the variable, what it holds, and what it accepts (``LTA_DROP_UP='1.5': must be a probability in
[0, 1)``), raised before anything binds or joins."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from hostlib.errors import UsageError
from hostlib.protocol import parse_address


class EnvReader:
    """Typed, range-checked reads of one environment mapping; unset or empty means the default."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    def _raw(self, name: str) -> str | None:
        text = self.env.get(name)
        return None if text is None or text.strip() == "" else text.strip()

    @staticmethod
    def error(name: str, text: str, accepted: str) -> UsageError:
        return UsageError(f"{name}={text!r}: must be {accepted}")

    def integer(self, name: str, default: int, low: int, high: int | None = None) -> int:
        text = self._raw(name)
        if text is None:
            return default
        accepted = f"an integer in {low}..{high}" if high is not None else f"an integer >= {low}"
        try:
            value = int(text)
        except ValueError:
            raise self.error(name, text, accepted) from None
        if value < low or (high is not None and value > high):
            raise self.error(name, text, accepted)
        return value

    def real(
        self, name: str, default: float, low: float, high: float | None = None, *, high_open: bool = False
    ) -> float:
        text = self._raw(name)
        if text is None:
            return default
        right = "inf)" if high is None else (f"{high:g})" if high_open else f"{high:g}]")
        accepted = f"a number in [{low:g}, {right}"
        try:
            value = float(text)
        except ValueError:
            raise self.error(name, text, accepted) from None
        above = high is not None and (value >= high if high_open else value > high)
        if not math.isfinite(value) or value < low or above:
            raise self.error(name, text, accepted)
        return value

    def probability(self, name: str) -> float:
        """A loss probability in [0, 1) (1 would drop everything), 0 when unset."""
        return self.real(name, 0.0, 0.0, 1.0, high_open=True)

    def choice(self, name: str, default: str, choices: Iterable[str]) -> str:
        text = self._raw(name)
        if text is None:
            return default
        names = list(choices)
        if text not in names:
            raise self.error(name, text, f"one of {', '.join(names)}")
        return text

    def address(self, name: str) -> tuple[str, int] | None:
        text = self._raw(name)
        if text is None:
            return None
        try:
            return parse_address(text)
        except ValueError:
            raise self.error(name, text, "HOST:PORT with a port in 1..65535 (e.g. 127.0.0.1:48879)") from None
