"""ArchConfig: the architecture facts of a Hugging Face checkpoint, parsed from its JSON files.

transformers is not a runtime dependency, so config.json (+ generation_config.json) is read here with
the same defaults transformers applies per model type: which layers slide, where rope_theta lives
(``rope_theta``/``rope_scaling`` in older files, ``rope_parameters`` in transformers >= 5), Gemma2's
soft-capping constants, and so on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SLIDING = "sliding_attention"
FULL = "full_attention"

# Per-architecture defaults transformers uses when a key is missing from config.json.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "hidden_act": "silu"},
    "MistralForCausalLM": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "hidden_act": "silu"},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "hidden_act": "silu"},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "hidden_act": "silu"},
    "Gemma2ForCausalLM": {
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "hidden_act": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "query_pre_attn_scalar": 256,
    },
}


@dataclass(frozen=True)
class ArchConfig:
    """Immutable architecture description; derived values are properties."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    hidden_act: str
    # rope_scaling: None for plain RoPE, else a dict with "rope_type" in SUPPORTED_ROPE_TYPES.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    mlp_bias: bool = False
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    # One entry per layer: "sliding_attention" or "full_attention".
    layer_types: tuple[str, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def qkv_bias(self) -> bool:
        # NOTE: Qwen2 always has q/k/v biases (and no o_proj bias) whatever attention_bias says.
        return self.attention_bias or self.architecture == "Qwen2ForCausalLM"

    @property
    def o_bias(self) -> bool:
        return self.attention_bias and self.architecture != "Qwen2ForCausalLM"

    @property
    def has_qk_norm(self) -> bool:
        return self.architecture == "Qwen3ForCausalLM"

    @property
    def attn_scale(self) -> float:
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        return float(self.head_dim) ** -0.5

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The window of layer ``layer_idx`` (None: full causal attention)."""
        if self.sliding_window is not None and self.layer_types[layer_idx] == SLIDING:
            return self.sliding_window
        return None

    @classmethod
    def from_pretrained(cls, model_dir: str) -> ArchConfig:
        """Reads ``model_dir/config.json`` and, when present, ``generation_config.json``."""
        root = Path(model_dir)
        config_path = root / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir!r}")
        d: dict[str, Any] = json.loads(config_path.read_text())
        gen_path = root / "generation_config.json"
        if gen_path.is_file():
            d = {**d, "_generation_config": json.loads(gen_path.read_text())}
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArchConfig:
        """Parses a config.json dict (key ``_generation_config`` optionally holds generation_config.json)."""
        architectures = d.get("architectures") or []
        arch = architectures[0] if architectures else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        defaults = _DEFAULTS[arch]

        def get(key: str, default: Any = None) -> Any:
            value = d.get(key, defaults.get(key, default))
            return defaults.get(key, default) if value is None and key in defaults else value

        hidden_size = int(d["hidden_size"])
        num_heads = int(d["num_attention_heads"])
        num_layers = int(d["num_hidden_layers"])
        max_pos = int(get("max_position_embeddings"))
        rope_theta, rope_scaling = _parse_rope(d, max_pos)
        hidden_act = d.get("hidden_activation") if arch == "Gemma2ForCausalLM" else None
        hidden_act = hidden_act or get("hidden_act")
        is_gemma2 = arch == "Gemma2ForCausalLM"
        sliding_window, layer_types = _parse_sliding(d, arch, num_layers)
        generation = d.get("_generation_config") or {}
        return cls(
            architecture=arch,
            model_type=str(d.get("model_type", "")),
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            hidden_act=str(hidden_act),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            bos_token_id=d.get("bos_token_id", generation.get("bos_token_id")),
            eos_token_ids=_union_ids(d.get("eos_token_id"), generation.get("eos_token_id")),
            sliding_window=sliding_window,
            attn_logit_softcapping=_opt_float(d, "attn_logit_softcapping", defaults) if is_gemma2 else None,
            final_logit_softcapping=_opt_float(d, "final_logit_softcapping", defaults) if is_gemma2 else None,
            query_pre_attn_scalar=_opt_float(d, "query_pre_attn_scalar", defaults) if is_gemma2 else None,
            layer_types=layer_types,
        )


def _opt_float(d: dict[str, Any], key: str, defaults: dict[str, Any]) -> float | None:
    # NOTE: an explicit null in config.json disables the feature; only a missing key takes the default.
    value = d[key] if key in d else defaults.get(key)
    return None if value is None else float(value)


def _union_ids(*values: int | list[int] | None) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        for token_id in [value] if isinstance(value, int) else value or []:
            if int(token_id) not in ids:
                ids.append(int(token_id))
    return tuple(ids)


def _parse_rope(d: dict[str, Any], max_pos: int) -> tuple[float, dict[str, Any] | None]:
    params = dict(d.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type rope_parameters are not supported: {sorted(params)}")
    legacy = d.get("rope_scaling") or {}
    scaling = {**legacy, **{k: v for k, v in params.items() if k != "rope_theta"}}
    rope_theta = float(params.get("rope_theta") or d.get("rope_theta") or 10000.0)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return rope_theta, None
    if rope_type == "llama3":
        scaling.setdefault("original_max_position_embeddings", max_pos)
    return rope_theta, {"rope_type": rope_type, **scaling}


def _parse_sliding(d: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """Which layers slide, as transformers decides it for each architecture."""
    if arch == "Gemma2ForCausalLM":
        window = d.get("sliding_window", _DEFAULTS[arch]["sliding_window"])
        default_types = [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        window = d.get("sliding_window", 4096) if d.get("use_sliding_window", False) else None
        first_sliding = int(d.get("max_window_layers", 28))
        default_types = [
            SLIDING if window is not None and i >= first_sliding else FULL for i in range(num_layers)
        ]
    elif arch == "MistralForCausalLM":
        window = d.get("sliding_window")
        default_types = [SLIDING if window is not None else FULL] * num_layers
    else:
        window = None
        default_types = [FULL] * num_layers
    layer_types = tuple(d.get("layer_types") or default_types)
    if arch == "MistralForCausalLM":
        # NOTE: Mistral's modeling code slides every layer whenever sliding_window is set.
        layer_types = tuple(default_types)
    if len(layer_types) != num_layers or any(t not in (SLIDING, FULL) for t in layer_types):
        raise ValueError(f"layer_types must list {num_layers} of {SLIDING!r}/{FULL!r}, got {layer_types}")
    return (None if window is None else int(window)), layer_types
