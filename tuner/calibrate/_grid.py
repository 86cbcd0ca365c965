"""What ``calibrate`` measures: the grid of (batch size, tokens per sequence) and its settings.

Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_BATCH_COOLDOWN_S",
    "DEFAULT_BATCH_SIZES",
    "DEFAULT_CTX",
    "DEFAULT_DTYPE",
    "DEFAULT_POINT_COOLDOWN_S",
    "DEFAULT_REPLAYS",
    "DEFAULT_ROUNDS",
    "DEFAULT_TOKENS_PER_SEQ",
    "DEFAULT_WARMUP",
    "DTYPES",
    "MAX_TOKENS_PER_SEQ",
    "CalibrationGrid",
    "CalibrationSettings",
]

# The batch sizes and tokens per sequence of the reference H200 table
# (shared/calibration/h200-llama8b-bf16-ctx1024.jsonl), so a new table compares point by point.
# q = k + 1 tokens verify k drafts; 5 is there because k = 4 is a common arm.
DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
DEFAULT_TOKENS_PER_SEQ: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8)
DEFAULT_CTX = 1024
DEFAULT_DTYPE = "bf16"
DEFAULT_WARMUP = 5
DEFAULT_REPLAYS = 20
# A cell is the median over rounds of the mean replay time: one round caught by a clock dip
# does not move it.
DEFAULT_ROUNDS = 3
# Idle time before each point and before each batch size: a point timed right after a heavy
# one (the largest q of the previous b) otherwise runs on a hot, clock-throttled GPU.
DEFAULT_POINT_COOLDOWN_S = 0.25
DEFAULT_BATCH_COOLDOWN_S = 2.0
# SGLang's EAGLE runs at most a few dozen draft tokens per sequence; more is a typo.
MAX_TOKENS_PER_SEQ = 64
DTYPES: dict[str, int] = {"bf16": 2, "fp16": 2}  # name -> bytes per element


def _sorted_unique(values: Sequence[int], what: str, *, upper: int | None = None) -> tuple[int, ...]:
    if not values:
        raise ValueError(f"{what} must not be empty")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{what} must be positive integers, got {v!r}")
        if upper is not None and v > upper:
            raise ValueError(f"{what} must be at most {upper}, got {v}")
    return tuple(sorted(set(values)))


@dataclass(frozen=True, kw_only=True)
class CalibrationGrid:
    """Batch sizes ``b`` and tokens per sequence ``q`` to time; stored sorted and unique.

    Points run batch size by batch size, ascending, so running out of device memory at one
    ``b`` leaves every smaller ``b`` complete.
    """

    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    tokens_per_seq: tuple[int, ...] = DEFAULT_TOKENS_PER_SEQ

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "batch_sizes", _sorted_unique(tuple(self.batch_sizes), "batch sizes")
        )
        object.__setattr__(
            self,
            "tokens_per_seq",
            _sorted_unique(tuple(self.tokens_per_seq), "tokens per sequence", upper=MAX_TOKENS_PER_SEQ),
        )

    def __len__(self) -> int:
        return len(self.batch_sizes) * len(self.tokens_per_seq)

    def points(self) -> Iterator[tuple[int, int]]:
        """``(b, q)`` in measuring order."""
        for b in self.batch_sizes:
            for q in self.tokens_per_seq:
                yield b, q

    @property
    def max_q(self) -> int:
        return self.tokens_per_seq[-1]

    def priced_arms(self) -> tuple[int, ...]:
        """Arms ``k`` whose speculative step this grid prices without extrapolating in q.

        A step of ``k`` drafts needs ``q = 1`` (draft steps, and the step without speculation)
        and ``q = k + 1`` (verify, draft extend).
        """
        if 1 not in self.tokens_per_seq:
            return ()
        return (0, *(q - 1 for q in self.tokens_per_seq if q >= 2))


@dataclass(frozen=True, kw_only=True)
class CalibrationSettings:
    """How each point is timed."""

    ctx: int = DEFAULT_CTX
    dtype: str = DEFAULT_DTYPE
    warmup: int = DEFAULT_WARMUP
    replays: int = DEFAULT_REPLAYS
    rounds: int = DEFAULT_ROUNDS
    point_cooldown_s: float = DEFAULT_POINT_COOLDOWN_S
    batch_cooldown_s: float = DEFAULT_BATCH_COOLDOWN_S
    seed: int = 0
    # Target layers to build and time; None: all, or as many as fit in half the device's free
    # memory. Fewer than the model has: the layers' time is scaled up (measure's docstring).
    layers: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.ctx, bool) or not isinstance(self.ctx, int) or self.ctx < 0:
            raise ValueError(f"ctx must be a non-negative integer, got {self.ctx!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.warmup < 1:
            raise ValueError(f"warmup must be >= 1, got {self.warmup}")
        if self.replays < 1:
            raise ValueError(f"replays must be >= 1, got {self.replays}")
        if self.layers is not None and (
            isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers < 1
        ):
            raise ValueError(f"layers must be a positive integer, got {self.layers!r}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        for name in ("point_cooldown_s", "batch_cooldown_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 <= v < 3600):
                raise ValueError(f"{name} must be in [0, 3600) seconds, got {v!r}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPES[self.dtype]
