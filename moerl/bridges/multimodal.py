"""The language model of a multimodal checkpoint (Qwen3.5-MoE's ``Qwen3_5MoeForConditionalGeneration``, Gemma 4's,
Llama 4's ``Llama4ForConditionalGeneration``): moerl trains and serves text only. The config is the checkpoint's
``text_config`` under its text architecture; the tensors are the ``model.language_model.*`` ones (Llama 4:
``language_model.*``, the text checkpoint whole), read as the text checkpoint's; the vision and audio towers' and the
multi-token-prediction layers' tensors are skipped by name. An export writes the text checkpoint."""

from __future__ import annotations

from moerl.errors import CheckpointError

# the language model's prefix -> the text checkpoint's
LANGUAGE = {"model.language_model.": "model.", "language_model.": ""}
SKIPPED = (
    "model.visual.", "model.vision_tower.", "model.multi_modal_projector.", "visual.", "mtp.", "vision_model.",
    "multi_modal_projector.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.",
)  # fmt: skip
CARRIED = ("tie_word_embeddings", "quantization_config")  # top-level fields that speak for the text model


def is_multimodal(hf: dict) -> bool:
    """Whether config ``hf`` describes a checkpoint whose language model sits under ``text_config``."""
    return isinstance(hf.get("text_config"), dict) and "vision_config" in hf


def text_config(hf: dict, source: str) -> dict:
    """The text model's config.json: ``text_config`` with its causal-LM architecture and the top-level fields
    that govern it."""
    from moerl.bridges.registry import text_architecture

    text = dict(hf["text_config"])
    kind = text.get("model_type")
    arch = text_architecture(kind) if isinstance(kind, str) else None
    if arch is None:
        raise CheckpointError(
            f"{source}: a multimodal checkpoint ({(hf.get('architectures') or ['?'])[0]}) whose text_config has "
            f"model_type {kind!r}: no causal language model of that type is known to moerl or transformers"
        )
    text |= {k: hf[k] for k in CARRIED if k in hf}
    return text | {"architectures": [arch]}


def text_name(name: str) -> str | None:
    """The text checkpoint's name of tensor ``name`` (``None``: a vision or multi-token-prediction tensor)."""
    for prefix, text in LANGUAGE.items():
        if name.startswith(prefix):
            return text + name[len(prefix) :]
    if name.startswith(SKIPPED):
        return None
    return name
