"""Decoder shapes that ``calibrate`` builds with random weights.

Pure: no torch. A shape is a named preset (dense ``llama3-8b``, ``qwen2.5-32b``; mixture of
experts ``qwen3-30b-a3b``, ``mixtral-8x7b``, ``kimi-k2``) or a JSON file that holds either our
field names or a Hugging Face ``config.json``'s.
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
    "KIMI_K2",
    "LLAMA3_8B",
    "MIXTRAL_8X7B",
    "QWEN25_32B",
    "QWEN3_30B_A3B",
    "SHAPES",
    "ModelShape",
    "resolve_shape",
    "shape_from_mapping",
]

# EAGLE-3 drafts for Llama 3 predict over a reduced vocabulary of 32k tokens.
DEFAULT_DRAFT_VOCAB = 32_000


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes of a decoder-only target and its one-layer EAGLE-3-style draft.

    ``head_dim`` defaults to ``hidden // heads``. The draft has the target's hidden size and
    attention shape, a fused ``3 * hidden -> hidden`` input projection (EAGLE-3 feeds it three
    of the target's hidden states), a dense MLP of ``inter`` and a head over ``draft_vocab``
    tokens.

    Mixture of experts (``experts > 0``): every target layer's MLP is a router over
    ``experts`` routed experts of ``moe_inter`` (default ``inter``), ``experts_per_tok`` of
    them per token, plus ``shared_experts`` always-on experts of ``shared_inter`` each
    (default ``moe_inter``; DeepSeek/Kimi style). ``inter`` then sizes the dense draft MLP only.
    Leading dense layers (DeepSeek's ``first_k_dense_replace``) are timed as MoE layers too.
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
    experts: int = 0
    experts_per_tok: int = 0
    moe_inter: int = 0
    shared_experts: int = 0
    shared_inter: int = 0

    def __post_init__(self) -> None:
        for field in ("hidden", "layers", "heads", "kv_heads", "inter", "vocab", "draft_vocab"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        for field in _MOE_FIELDS:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{field} must be a non-negative integer, got {value!r}")
        if self.experts:
            if not 1 <= self.experts_per_tok <= self.experts:
                raise ValueError(
                    f"experts_per_tok must be in 1..{self.experts} (the routed experts), "
                    f"got {self.experts_per_tok}"
                )
            if not self.moe_inter:
                object.__setattr__(self, "moe_inter", self.inter)
            if self.shared_experts and not self.shared_inter:
                object.__setattr__(self, "shared_inter", self.moe_inter)
        elif any(getattr(self, f) for f in _MOE_FIELDS):
            raise ValueError(
                "experts_per_tok, moe_inter and shared experts need experts > 0 "
                "(a mixture-of-experts shape)"
            )
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

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def attention_params(self) -> int:
        return self.hidden * self.qkv_out + self.heads * self.head_dim * self.hidden

    def dense_layer_params(self) -> int:
        """Weights of one dense decoder layer of MLP ``inter`` (the draft's layer)."""
        return self.attention_params() + 3 * self.hidden * self.inter

    def expert_params(self) -> int:
        """Weights of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden * self.moe_inter

    def layer_params(self) -> int:
        """Weights of one target layer (projections and MLP or experts; norms are negligible)."""
        if not self.is_moe:
            return self.dense_layer_params()
        shared = 3 * self.hidden * self.shared_inter * self.shared_experts
        router = self.hidden * self.experts
        return self.attention_params() + router + self.experts * self.expert_params() + shared

    def target_params(self) -> int:
        """Weights a target forward reads at most: all layers plus the LM head (not the
        embedding); a MoE forward reads only the experts its tokens touch."""
        return self.layers * self.layer_params() + self.vocab * self.hidden

    def draft_params(self) -> int:
        """Weights a draft forward reads: input projection, one dense layer, draft head."""
        return (
            3 * self.hidden * self.hidden
            + self.dense_layer_params()
            + self.draft_vocab * self.hidden
        )

    def built_params(self, layers: int | None = None) -> int:
        """Weights ``calibrate`` allocates with ``layers`` target layers (default all):
        embedding, layers, LM head and the draft."""
        n = self.layers if layers is None else layers
        return n * self.layer_params() + 2 * self.vocab * self.hidden + self.draft_params()

    def layers_fitting(self, budget_bytes: int, *, dtype_bytes: int = 2) -> int:
        """Most target layers (at least 1, at most all) whose weights, with the rest of the
        model's, fit in ``budget_bytes``."""
        fixed = (self.built_params(0)) * dtype_bytes
        per = self.layer_params() * dtype_bytes
        return max(1, min(self.layers, (budget_bytes - fixed) // per))

    def kv_bytes_per_token(self, *, dtype_bytes: int = 2, layers: int | None = None) -> int:
        """KV-cache bytes one context token takes (K and V, every layer)."""
        n = self.layers if layers is None else layers
        return 2 * n * self.kv_heads * self.head_dim * dtype_bytes

    def to_info(self) -> dict[str, Any]:
        """The shape fields of a calibration table's info row."""
        d = asdict(self)
        d["shape"] = d.pop("name")
        if not self.is_moe:  # a dense table's info row stays as it was
            for f in _MOE_FIELDS:
                del d[f]
        return d


_MOE_FIELDS = ("experts", "experts_per_tok", "moe_inter", "shared_experts", "shared_inter")


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

# Mixture-of-experts presets, as their Hugging Face configs give them.
QWEN3_30B_A3B = ModelShape(
    name="qwen3-30b-a3b",
    hidden=2048,
    layers=48,
    heads=32,
    kv_heads=4,
    head_dim=128,
    inter=6144,
    vocab=151936,
    experts=128,
    experts_per_tok=8,
    moe_inter=768,
)
MIXTRAL_8X7B = ModelShape(
    name="mixtral-8x7b",
    hidden=4096,
    layers=32,
    heads=32,
    kv_heads=8,
    inter=14336,
    vocab=32000,
    experts=8,
    experts_per_tok=2,
)
# Kimi-K2 / K2.5's text model (DeepSeek-V3 layout). Its MLA attention is timed as
# grouped-query attention with about MLA's bytes: 2 KV heads of 128 read 1 KiB of KV per token
# and layer (MLA's latent: 576 values, 1.1 KiB), 121 M attention weights (MLA: ~100 M). One
# layer's experts are 34 GB in bf16: measure a few layers (--layers) and scale.
KIMI_K2 = ModelShape(
    name="kimi-k2",
    hidden=7168,
    layers=61,
    heads=64,
    kv_heads=2,
    head_dim=128,
    inter=18432,
    vocab=163840,
    experts=384,
    experts_per_tok=8,
    moe_inter=2048,
    shared_experts=1,
)

SHAPES: dict[str, ModelShape] = {
    s.name: s for s in (LLAMA3_8B, QWEN25_32B, QWEN3_30B_A3B, MIXTRAL_8X7B, KIMI_K2)
}

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
    # Qwen2/3-MoE, Mixtral, DeepSeek/Kimi spell the expert count three ways.
    "experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "experts_per_tok": ("num_experts_per_tok",),
    "moe_inter": ("moe_intermediate_size",),
    "shared_experts": ("n_shared_experts",),
    "shared_inter": ("shared_expert_intermediate_size",),  # Qwen2-MoE: one shared expert
}
_REQUIRED = ("hidden", "layers", "heads", "inter", "vocab")


def shape_from_mapping(data: Mapping[str, Any], *, name: str, source: str) -> ModelShape:
    """Build a shape from our field names or a Hugging Face config's.

    ``kv_heads`` defaults to ``heads`` (no grouped-query attention) as in Hugging Face configs.
    A multimodal config's ``text_config`` is read when the top level has no hidden size.
    MoE fields: see :data:`_HF_NAMES`; an expert count of 0 or none means dense. MLA attention
    (a ``kv_lora_rank``, DeepSeek/Kimi) becomes grouped-query attention of ``v_head_dim`` whose
    KV heads hold about as many values per token as MLA's latent (``kv_lora_rank`` plus the
    RoPE dims), since ``calibrate`` has no MLA kernels.

    Raises:
        ConfigError: a field is missing or invalid; the message names ``source`` and the field.
    """
    text = data.get("text_config")
    if isinstance(text, Mapping) and "hidden" not in data and "hidden_size" not in data:
        data = {**text, "name": data.get("name")}
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
    if not fields.get("experts"):
        for f in _MOE_FIELDS:
            fields.pop(f, None)
    elif fields.get("shared_inter") and "shared_experts" not in fields:
        fields["shared_experts"] = 1
    if data.get("kv_lora_rank"):
        _mla_as_gqa(data, fields, source)
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


def _mla_as_gqa(data: Mapping[str, Any], fields: dict[str, Any], source: str) -> None:
    heads = fields["heads"]
    try:
        head_dim = int(data.get("v_head_dim") or fields["hidden"] // heads)
        latent = int(data["kv_lora_rank"]) + int(data.get("qk_rope_head_dim") or 0)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: bad MLA fields (kv_lora_rank, v_head_dim): {exc}") from exc
    want = max(1, round(latent / (2 * head_dim)))
    fields["head_dim"] = head_dim
    fields["kv_heads"] = max(d for d in range(1, want + 1) if heads % d == 0)


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
