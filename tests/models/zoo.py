"""Tiny configs of the models people run, built with random weights (no downloads).

Each :class:`ModelCase` builds a float32 model from a config (2 layers, hidden 32-64,
a few heads, short sequences; the caller seeds torch first), makes its inputs for a
given dtype, and picks the tensor that the backward pass starts from. Float inputs are
drawn in float64 and cast, so the float64 reference and the low-precision runs see the
same values.

The cases cover the attention patterns the executor meets in practice: causal LLMs with
grouped-query attention (Llama, Mistral, Qwen2), a boolean padding mask (BERT), a learned
relative-position bias with a gradient (T5), bidirectional vision attention (ViT, CLIP),
cross-attention (Whisper, the UNet), joint attention (SD3), a single-head VAE mid-block
(AutoencoderKL) and the plain-PyTorch models shipped in thunder's own tests (nanoGPT,
Llama-2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class ModelCase:
    name: str
    #: builds the float32 model (torch is seeded by the caller)
    build: Callable[[], torch.nn.Module]
    #: ``inputs(dtype, gen)`` -> keyword arguments; float tensors in ``dtype``
    inputs: Callable[[torch.dtype, torch.Generator], dict]
    #: picks the tensor the backward starts from out of the model's output
    output: Callable[[Any], torch.Tensor]
    #: part of the quick subset CI runs by default
    quick: bool = False
    #: what the case exercises, for the README table
    note: str = ""
    #: dtypes eager CPU can run this model in
    dtypes: tuple = field(default=(torch.float16, torch.bfloat16))
    #: SDPA calls the executor must claim (our forward operator in the final traces); None: every call
    #: the model makes (counted in eager). tests/models/test_models.py asserts it, so a decline fails.
    claims: int | None = None
    #: for a model the executor declines by design (``claims=0``): text every call's explain() reasons contain
    declines: tuple = ()


def _randn(shape, dtype, gen):
    return torch.randn(*shape, dtype=torch.float64, generator=gen).to(dtype)


def _ids(shape, vocab, gen):
    return torch.randint(0, vocab, shape, generator=gen)


def _hidden(o):
    return o.last_hidden_state


# -- transformers: decoder-only LLMs ------------------------------------------------------
def _llm(cls_name: str, **extra):
    def build():
        import transformers

        cfg_cls = getattr(transformers, f"{cls_name}Config")
        model_cls = getattr(transformers, f"{cls_name}Model")
        cfg = cfg_cls(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            use_cache=False,
            attn_implementation="sdpa",
            **extra,
        )
        return model_cls(cfg)

    return build


def _llm_inputs(dtype, gen):
    return {"input_ids": _ids((2, 16), 128, gen)}


def _llm_right_padded_inputs(dtype, gen):
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 10:] = 0  # the second sequence is right-padded: causal and key padding
    return {"input_ids": _ids((2, 16), 128, gen), "attention_mask": mask}


def _gpt2():
    from transformers import GPT2Config, GPT2Model

    cfg = GPT2Config(
        vocab_size=128,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        use_cache=False,
        attn_implementation="sdpa",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2Model(cfg)


def _gpt2_head_dim_12():
    """n_embd 48 over 4 heads: head dim 12, which cuDNN does not take (not a multiple of 8)."""
    from transformers import GPT2Config, GPT2Model

    cfg = GPT2Config(
        vocab_size=128,
        n_positions=64,
        n_embd=48,
        n_layer=2,
        n_head=4,
        use_cache=False,
        attn_implementation="sdpa",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2Model(cfg)


def _bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        attn_implementation="sdpa",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertModel(cfg, add_pooling_layer=False)


def _bert_inputs(dtype, gen):
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 11:] = 0  # the second sequence is padded
    return {"input_ids": _ids((2, 16), 128, gen), "attention_mask": mask}


def _t5():
    from transformers import T5Config, T5Model

    cfg = T5Config(
        vocab_size=128,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return T5Model(cfg)


def _t5_inputs(dtype, gen):
    return {"input_ids": _ids((2, 16), 128, gen), "decoder_input_ids": _ids((2, 8), 128, gen)}


def _vit():
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )
    return ViTModel(cfg, add_pooling_layer=False)


def _image(dtype, gen):
    return {"pixel_values": _randn((2, 3, 32, 32), dtype, gen)}


def _whisper():
    from transformers import WhisperConfig, WhisperModel

    cfg = WhisperConfig(
        vocab_size=128,
        num_mel_bins=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        d_model=64,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=16,
        max_target_positions=32,
        dropout=0.0,
        attention_dropout=0.0,
        use_cache=False,
        attn_implementation="sdpa",
        pad_token_id=0,
        decoder_start_token_id=1,
    )
    return WhisperModel(cfg)


def _whisper_inputs(dtype, gen):
    return {"input_features": _randn((2, 16, 32), dtype, gen), "decoder_input_ids": _ids((2, 8), 128, gen)}


def _clip():
    from transformers import CLIPConfig, CLIPModel

    text = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
        projection_dim=32,
    )
    vision = dict(
        image_size=32,
        patch_size=8,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        projection_dim=32,
    )
    cfg = CLIPConfig(text_config=text, vision_config=vision, projection_dim=32, attn_implementation="sdpa")
    return CLIPModel(cfg)


def _clip_inputs(dtype, gen):
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0
    return {"input_ids": _ids((2, 16), 128, gen), "attention_mask": mask, **_image(dtype, gen)}


def _clip_output(o):
    return torch.cat([o.text_embeds, o.image_embeds], dim=-1)


# -- diffusers ----------------------------------------------------------------------------
def _unet():
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=32,
    )


def _unet_inputs(dtype, gen):
    return {
        "sample": _randn((2, 4, 16, 16), dtype, gen),
        "timestep": torch.tensor([10, 500]),
        "encoder_hidden_states": _randn((2, 8, 32), dtype, gen),
    }


def _sample(o):
    return o.sample


def _sd3():
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        caption_projection_dim=64,
        pooled_projection_dim=32,
        out_channels=4,
        pos_embed_max_size=16,
    )


def _sd3_inputs(dtype, gen):
    return {
        "hidden_states": _randn((2, 4, 16, 16), dtype, gen),
        "encoder_hidden_states": _randn((2, 8, 32), dtype, gen),
        "pooled_projections": _randn((2, 32), dtype, gen),
        "timestep": torch.tensor([10, 500]),
    }


def _vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(32, 64),
        latent_channels=4,
        norm_num_groups=32,
        layers_per_block=1,
        sample_size=32,
    )


def _vae_inputs(dtype, gen):
    return {"sample": _randn((2, 3, 32, 32), dtype, gen), "sample_posterior": False}


# -- thunder's own test models --------------------------------------------------------------
def _nanogpt():
    from thunder.tests.nanogpt_model import GPT, GPTConfig

    return GPT(GPTConfig(block_size=32, vocab_size=128, n_layer=2, n_head=4, n_embd=64, dropout=0.0))


def _nanogpt_inputs(dtype, gen):
    return {"idx": _ids((2, 16), 128, gen)}


def _llama2():
    from thunder.tests.llama2_model import ModelArgs, Transformer

    return Transformer(
        ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=32)
    )


def _llama2_inputs(dtype, gen):
    return {"tokens": _ids((2, 16), 128, gen)}


def _logits(o):
    return o[0] if isinstance(o, tuple) else o


CASES: dict[str, ModelCase] = {
    c.name: c
    for c in [
        ModelCase(
            "llama", _llm("Llama"), _llm_inputs, _hidden, quick=True, note="causal, GQA 4/2 heads, boolean causal mask"
        ),
        ModelCase(
            "llama_right_padding", _llm("Llama"), _llm_right_padded_inputs, _hidden, note="causal + right padding"
        ),
        ModelCase("mistral", _llm("Mistral", sliding_window=8), _llm_inputs, _hidden, note="GQA, sliding window 8"),
        ModelCase("qwen2", _llm("Qwen2"), _llm_inputs, _hidden, note="GQA, qkv bias"),
        ModelCase("gpt2", _gpt2, _llm_inputs, _hidden, note="causal, fused c_attn"),
        ModelCase(
            "gpt2_head_dim_12",
            _gpt2_head_dim_12,
            _llm_inputs,
            _hidden,
            note="head dim 12: declined, runs on thunder's torch path",
            claims=0,
            declines=("head dim 12 is not a multiple of 8",),
        ),
        ModelCase("bert", _bert, _bert_inputs, _hidden, quick=True, note="padding mask"),
        ModelCase(
            "t5", _t5, _t5_inputs, _hidden, quick=True, note="relative position bias with a gradient, cross-attention"
        ),
        ModelCase("vit", _vit, _image, _hidden, note="bidirectional, 17 tokens"),
        ModelCase("whisper", _whisper, _whisper_inputs, _hidden, note="encoder-decoder, cross-attention"),
        ModelCase("clip", _clip, _clip_inputs, _clip_output, note="text (causal + padding) and vision towers"),
        ModelCase(
            "unet2d_condition",
            _unet,
            _unet_inputs,
            _sample,
            quick=True,
            note="diffusers UNet, self and cross-attention, head dim 8",
        ),
        ModelCase("sd3_transformer", _sd3, _sd3_inputs, _sample, note="diffusers SD3 joint attention"),
        ModelCase("autoencoder_kl", _vae, _vae_inputs, _sample, note="diffusers VAE, one head of dim 64"),
        ModelCase("nanogpt", _nanogpt, _nanogpt_inputs, _logits, note="thunder.tests.nanogpt_model, is_causal"),
        ModelCase("llama2", _llama2, _llama2_inputs, _logits, note="thunder.tests.llama2_model, GQA by repeat_kv"),
    ]
}
