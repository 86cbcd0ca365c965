"""Decoder shapes that ``calibrate`` builds with random weights.

Pure: no torch. A shape is a named preset (``llama3-8b``, ``qwen2.5-32b``) or a JSON file that
holds either our field names or a Hugging Face ``config.json``'s.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tuner.errors import ConfigError

__all__ = [
    "DEFAULT_DRAFT_VOCAB",
    "LLAMA3_8B",
    "QWEN25_32B",
    "SHAPES",
    "ModelShape",
    "resolve_shape",
    "shape_from_mapping",
]

# EAGLE-3 drafts for Llama 3 predict over a reduced vocabulary of 32k tokens.
DEFAULT_DRAFT_VOCAB = 32_000


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes of a dense decoder-only target and its one-layer EAGLE-3-style draft.

    ``head_dim`` defaults to ``hidden // heads``. The draft has the target's hidden size and
    attention shape, a fused ``3 * hidden -> hidden`` input projection (EAGLE-3 feeds it three
    of the target's hidden states) and a head over ``draft_vocab`` tokens.
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    inter: int
    vocab: int
    head_dim: int = 0
    draft_vocab: int = DEFAULT_DRAFT_VOCAB
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        for field in ("hidden", "layers", "heads", "kv_heads", "inter", "vocab", "draft_vocab"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        if self.head_dim == 0:
            if self.hidden % self.heads:
                raise ValueError(
                    f"hidden {self.hidden} is not a multiple of heads {self.heads}; "
                    "give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 1:
            raise ValueError(f"head_dim must be a positive integer, got {self.head_dim!r}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"heads {self.heads} must be a multiple of kv_heads {self.kv_heads} "
                "(grouped-query attention)"
            )
        if not self.name:
            raise ValueError("name must not be empty")

    @property
    def group(self) -> int:
        """Query heads that share one KV head."""
        return self.heads // self.kv_heads

    @property
    def qkv_out(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    def layer_params(self) -> int:
        """Weights of one decoder layer (projections and MLP; norms are negligible)."""
        attn = self.hidden * self.qkv_out + self.heads * self.head_dim * self.hidden
        return attn + 3 * self.hidden * self.inter

    def target_params(self) -> int:
        """Weights a target forward reads: all layers plus the LM head (not the embedding)."""
        return self.layers * self.layer_params() + self.vocab * self.hidden

    def draft_params(self) -> int:
        """Weights a draft forward reads: input projection, one layer, draft head."""
        return 3 * self.hidden * self.hidden + self.layer_params() + self.draft_vocab * self.hidden

    def kv_bytes_per_token(self, *, dtype_bytes: int = 2, layers: int | None = None) -> int:
        """KV-cache bytes one context token takes (K and V, every layer)."""
        n = self.layers if layers is None else layers
        return 2 * n * self.kv_heads * self.head_dim * dtype_bytes

    def to_info(self) -> dict[str, Any]:
        """The shape fields of a calibration table's info row."""
        d = asdict(self)
        d["shape"] = d.pop("name")
        return d


LLAMA3_8B = ModelShape(
    name="llama3-8b", hidden=4096, layers=32, heads=32, kv_heads=8, inter=14336, vocab=128256
)
QWEN25_32B = ModelShape(
    name="qwen2.5-32b",
    hidden=5120,
    layers=64,
    heads=40,
    kv_heads=8,
    inter=27648,
    vocab=152064,
    qkv_bias=True,
)

SHAPES: dict[str, ModelShape] = {s.name: s for s in (LLAMA3_8B, QWEN25_32B)}

# Our field -> the names a Hugging Face config.json uses for it.
_HF_NAMES: dict[str, tuple[str, ...]] = {
    "hidden": ("hidden_size",),
    "layers": ("num_hidden_layers",),
    "heads": ("num_attention_heads",),
    "kv_heads": ("num_key_value_heads",),
    "inter": ("intermediate_size",),
    "vocab": ("vocab_size",),
    "head_dim": ("head_dim",),
    "draft_vocab": ("draft_vocab_size",),
    "qkv_bias": ("attention_bias",),
}
_REQUIRED = ("hidden", "layers", "heads", "inter", "vocab")


def shape_from_mapping(data: Mapping[str, Any], *, name: str, source: str) -> ModelShape:
    """Build a shape from our field names or a Hugging Face config's.

    ``kv_heads`` defaults to ``heads`` (no grouped-query attention) as in Hugging Face configs.

    Raises:
        ConfigError: a field is missing or invalid; the message names ``source`` and the field.
    """
    fields: dict[str, Any] = {}
    for ours, theirs in _HF_NAMES.items():
        for key in (ours, *theirs):
            if key in data and data[key] is not None:
                fields[ours] = data[key]
                break
    missing = [f for f in _REQUIRED if f not in fields]
    if missing:
        raise ConfigError(
            f"{source}: missing field(s) {', '.join(missing)} "
            f"(or their Hugging Face names {', '.join(_HF_NAMES[m][0] for m in missing)})"
        )
    fields.setdefault("kv_heads", fields["heads"])
    for key, value in fields.items():
        if key == "qkv_bias":
            if not isinstance(value, bool):
                raise ConfigError(f"{source}: field qkv_bias must be true or false, got {value!r}")
        elif isinstance(value, float) and value.is_integer() and math.isfinite(value):
            fields[key] = int(value)
    shape_name = data.get("name") or name
    try:
        return ModelShape(name=str(shape_name), **fields)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from exc


def resolve_shape(spec: str) -> ModelShape:
    """A preset's name or the path of a JSON shape file.

    Raises:
        ConfigError: unknown preset, unreadable file, bad JSON or bad fields.
    """
    if spec in SHAPES:
        return SHAPES[spec]
    path = Path(spec)
    if not path.suffix and not path.exists():
        raise ConfigError(
            f"unknown shape {spec!r}: use one of {', '.join(sorted(SHAPES))} or a JSON file"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read shape file {spec}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{spec}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{spec}: expected a JSON object, got {type(data).__name__}")
    return shape_from_mapping(data, name=path.stem, source=spec)
