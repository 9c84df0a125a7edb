"""Gemma-4 (E2B and kin) on the flex_attention engine of qwen3_flex_inference.py.

Only what Gemma-4 does differently lives here; the page table, paged KV cache, block masks,
scheduler, CUDA graphs, LoRA double-copy and CLI are the base engine's:
- KV-sharing layers: the last `num_kv_shared_layers` layers have no k/v projections and attend over
  the paged cache of their "store" layer (the last non-shared layer of the same attention type),
  with the same block masks; only non-shared layers own a cache.
- Two attention regimes, `full_attention` (head_dim 512, proportional RoPE) and
  `sliding_attention` (head_dim 256, window 512), each with its own cos/sin from the model's own
  `Gemma4TextRotaryEmbedding(x, position_ids, layer_type)` and its own block mask.
- Attention scale 1.0 (q_norm/k_norm carry it), v_norm without weight, values = raw keys when
  `attention_k_eq_v`.
- Per-layer inputs (PLE), four norms, layer_scalar: the decoder layers run Hugging Face's own
  forward, which threads them, so they are exact by construction; the walker supplies each layer
  its PLE slice, its regime's RoPE and its layer step (its store layer's cache, its regime's mask).
- The final logit softcap, tanh(logits / c) * c.
- Prefill shortcut: KV-shared layers write no K/V, so past the last store layer only each prompt's
  last position goes on (sliding layers' pages are recycled by the base engine's window pool).
- Loading: multimodal checkpoints drop their vision/audio towers and the language model moves into
  a `Gemma4ForCausalLM` shell (lm_head tied to the embeddings); adapters trained on the multimodal
  model are renamed onto it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from qwen3_flex_inference import (
    FlexInference,
    FlexInferenceError,
    ModelRunner,
    PagedKVCache,
    PageTable,
    PrefillStep,
    SamplingParams,
    Sequence,
    apply_rotary,
    build_arg_parser,
    check_adapter_weights_fit,
    eos_token_ids,
    flex_attention_compiled,
    load_causal_lm,
    load_config,
    load_peft_adapter,
    lora_module_name,
    packed_block_masks,
    project,
    qkv_projections,
    read_adapter_weights,
    refresh_lora_merge_from_pristine,
    run_cli,
    run_drift_verification,
)

__all__ = [
    "FlexGemma4Inference",
    "Gemma4ModelRunner",
    "PagedKVCache",
    "PageTable",
    "SamplingParams",
    "Sequence",
    "flex_attention_compiled",
    "load_gemma4",
    "load_gemma4_adapter",
    "refresh_lora_merge_from_pristine",
    "run_drift_verification",
]

GEMMA4_INSTALL_HINT = (
    "Gemma-4 needs transformers >= 5.5, whose gemma4 module this install lacks: pip install -U 'transformers>=5.5'"
)


def require_gemma4() -> None:
    """Raises, with an install hint, when the installed transformers has no gemma4 module."""
    try:
        import transformers.models.gemma4.modeling_gemma4  # noqa: F401
    except ImportError:
        raise FlexInferenceError(GEMMA4_INSTALL_HINT)


# ---------------------------------------------------------------------------------------------
# KV sharing
# ---------------------------------------------------------------------------------------------


def first_kv_shared_layer(config) -> int:
    """Index of the first KV-shared layer (num_hidden_layers when none is shared)."""
    return config.num_hidden_layers - (getattr(config, "num_kv_shared_layers", 0) or 0)


def kv_store_layers(config) -> list[int]:
    """For each layer, the layer whose paged cache it attends over (itself unless KV-shared).

    A KV-shared layer reads the last non-shared layer of its own attention type (HF's
    `store_full_length_kv` layer).
    """
    first_shared_layer_idx = first_kv_shared_layer(config)
    cache_layer_idx = []
    for layer_idx, layer_type in enumerate(config.layer_types):
        if layer_idx < first_shared_layer_idx:
            cache_layer_idx.append(layer_idx)
        else:
            same_type = [i for i in range(first_shared_layer_idx) if config.layer_types[i] == layer_type]
            cache_layer_idx.append(same_type[-1])
    return cache_layer_idx


# ---------------------------------------------------------------------------------------------
# Patched attention
# ---------------------------------------------------------------------------------------------


def gemma4_attention_forward(self, hidden_states, position_embeddings, attention_mask=None, layer_step=None, **kwargs):
    """Replaces Gemma4TextAttention.forward: HF's projections and norms, paged flex attention."""
    input_shape = hidden_states.shape[:-1]  # [B, S]
    hidden_shape = (*input_shape, -1, self.head_dim)
    cos, sin = position_embeddings
    projections = [
        t.view(hidden_shape) for t in project(self, qkv_projections(self), "fused_qkv_weight", hidden_states)
    ]
    q = apply_rotary(self.q_norm(projections[0]).transpose(1, 2), cos, sin)  # [B, H, S, D]
    k = v = None  # KV-shared layers read their store layer's cache
    if not self.is_kv_shared_layer:
        k = projections[1]
        v = projections[2] if len(projections) == 3 else k  # attention_k_eq_v: values are the raw keys
        k = apply_rotary(self.k_norm(k).transpose(1, 2), cos, sin)  # [B, H_kv, S, D]
        v = self.v_norm(v).transpose(1, 2)
    attn_output = layer_step.attend(q, k, v, self.scaling)
    attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1)
    return self.o_proj(attn_output), None


# ---------------------------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------------------------


class Gemma4ModelRunner(ModelRunner):
    """The model runner's hooks for Gemma-4 text models (`Gemma4ForCausalLM`)."""

    use_prefill_shortcut = True  # False: every prefill row runs every layer (to measure the shortcut)

    @staticmethod
    def kv_cache_heads(causal_lm: nn.Module) -> list[tuple[str, int, int] | None]:
        """Only non-shared layers own a cache (KV bytes per token = the sum over those layers), each
        over its regime's pool (sliding layers: the recycled window pool)."""
        heads = []
        for layer in causal_lm.model.layers:
            attn = layer.self_attn
            if attn.is_kv_shared_layer:  # no k_proj
                heads.append(None)
                continue
            heads.append((attn.layer_type, attn.k_proj.out_features // attn.head_dim, attn.head_dim))
        return heads

    def patch_attention(self) -> None:
        for attn, cache_layer_idx in zip(self.attention_layers(), kv_store_layers(self.config)):
            attn.kv_cache_layer_idx = cache_layer_idx
            self.patches.replace_forward(attn, gemma4_attention_forward.__get__(attn))

    def embed(self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Embeddings (scaled) [B, S, hidden]; the layer inputs: PLE [B, S, layers, ple_dim] and
        each regime's RoPE cos/sin."""
        decoder = self.decoder
        hidden_BSE = decoder.embed_tokens.forward(input_ids_BS)  # not __call__: no trainer hook
        per_layer_inputs_BSLP = None
        if decoder.hidden_size_per_layer_input:
            per_layer_inputs_BSLP = decoder.project_per_layer_inputs(
                hidden_BSE, decoder.get_per_layer_inputs(input_ids_BS, None)
            )
        position_embeddings = {t: decoder.rotary_emb(hidden_BSE, position_ids_BS, t) for t in self.sliding_windows}
        return hidden_BSE, {"per_layer_inputs": per_layer_inputs_BSLP, "position_embeddings": position_embeddings}

    def layer_kwargs(self, layer_idx: int, layer_inputs: dict, step) -> dict:
        """Each layer gets its PLE slice, its regime's RoPE, and its store layer's cache."""
        attn = self.decoder.layers[layer_idx].self_attn
        per_layer_inputs_BSLP = layer_inputs["per_layer_inputs"]
        return dict(
            per_layer_input=per_layer_inputs_BSLP[:, :, layer_idx] if per_layer_inputs_BSLP is not None else None,
            position_embeddings=layer_inputs["position_embeddings"][attn.layer_type],
            attention_mask=None,
            layer_step=step.for_layer(attn.kv_cache_layer_idx, attn.layer_type),
        )

    def prefill_hidden(self, input_ids_1T, position_ids_1T, step: PrefillStep, last_positions_N) -> torch.Tensor:
        """Prefill shortcut: KV-shared layers write no K/V, so past the last store layer only each
        prompt's last position goes on; its queries still see the store layers' packed K/V."""
        if not self.use_prefill_shortcut:
            return super().prefill_hidden(input_ids_1T, position_ids_1T, step, last_positions_N)
        hidden_1TE, layer_inputs = self.embed(input_ids_1T, position_ids_1T)
        num_layers, first_shared = len(self.decoder.layers), first_kv_shared_layer(self.config)
        hidden_1TE = self.run_layers(hidden_1TE, layer_inputs, step, range(first_shared))
        # The rows, their layer inputs and the block masks cut to each prompt's last position.
        hidden_1NE = hidden_1TE[:, last_positions_N]
        per_layer_inputs_1TLP = layer_inputs["per_layer_inputs"]
        last_position_inputs = {
            "per_layer_inputs": per_layer_inputs_1TLP[:, last_positions_N]
            if per_layer_inputs_1TLP is not None
            else None,
            "position_embeddings": {
                regime: (cos[:, last_positions_N], sin[:, last_positions_N])
                for regime, (cos, sin) in layer_inputs["position_embeddings"].items()
            },
        }
        last_position_masks = packed_block_masks(
            step.document_id_C,
            step.num_tokens,
            self.sliding_windows,
            self.device,
            last_positions_N,
            self.max_batch_size,
        )
        last_position_step = dataclasses.replace(step, block_masks=last_position_masks)
        hidden_1NE = self.run_layers(
            hidden_1NE, last_position_inputs, last_position_step, range(first_shared, num_layers)
        )
        return self.decoder.norm(hidden_1NE)

    def final_logits(self, head_out_NV: torch.Tensor) -> torch.Tensor:
        logits_NV = head_out_NV.float()
        softcap = self.config.final_logit_softcapping
        if softcap is not None:
            logits_NV = torch.tanh(logits_NV / softcap) * softcap
        return logits_NV


class FlexGemma4Inference(FlexInference):
    """FlexInference for Gemma-4 text models (`Gemma4ForCausalLM`, optionally in a PEFT wrapper)."""

    runner_class = Gemma4ModelRunner


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def text_config_of(config):
    """The text config of a multimodal Gemma-4 config (or the config itself)."""
    return getattr(config, "text_config", None) or config


def causal_lm_from_multimodal(multimodal) -> nn.Module:
    """Moves a Gemma4ForConditionalGeneration's language model into a Gemma4ForCausalLM shell.

    The vision and audio towers are dropped; lm_head is tied to the embeddings; the end ids of the
    multimodal config and generation config carry over.
    """
    from transformers import Gemma4ForCausalLM

    text_config = multimodal.config.text_config
    end_ids = eos_token_ids(multimodal.config, text_config, multimodal.generation_config)
    with torch.device("meta"):
        shell = Gemma4ForCausalLM(text_config)
    shell.model = multimodal.model.language_model
    shell.lm_head = nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False)
    shell.lm_head.weight = shell.model.embed_tokens.weight
    shell.generation_config = multimodal.generation_config
    shell.generation_config.eos_token_id = sorted(end_ids)
    return shell


def load_gemma4(path: str, dtype: torch.dtype, device: torch.device, **load_kwargs) -> nn.Module:
    """Loads a Gemma-4 checkpoint (multimodal or text-only) as a Gemma4ForCausalLM on `device`;
    `load_kwargs` as for load_causal_lm (load_format, load_in_4bit, trust_remote_code, ...)."""
    from transformers import Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    is_dummy = load_kwargs.get("load_format") == "dummy"
    config = load_config(path, load_kwargs.get("trust_remote_code", False), use_preset=is_dummy)
    if config.model_type not in ("gemma4", "gemma4_text"):
        if config.model_type in ("qwen3", "llama"):
            raise FlexInferenceError(
                f"{path} is a {config.model_type} checkpoint, not Gemma-4: run it with qwen3_flex_inference.py"
            )
        raise FlexInferenceError(
            f"{path} is a {config.model_type} checkpoint, not Gemma-4, the one model this engine runs"
        )
    if is_dummy:
        return load_causal_lm(
            path, dtype, device, model_class=Gemma4ForCausalLM, config_hook=text_config_of, **load_kwargs
        )
    if getattr(config, "text_config", None) is None:
        return load_causal_lm(path, dtype, device, model_class=Gemma4ForCausalLM, **load_kwargs)
    multimodal = load_causal_lm(path, dtype, device, model_class=Gemma4ForConditionalGeneration, **load_kwargs)
    return causal_lm_from_multimodal(multimodal).eval()


def load_gemma4_adapter(causal_lm: nn.Module, adapter_path: str):
    """Loads a PEFT LoRA adapter onto the Gemma4ForCausalLM shell.

    Adapters trained on the multimodal model name their modules `model.language_model.*`; the
    shell holds the same modules as `model.*`, so such an adapter's weights are renamed and its
    targets become the renamed module names (vision/audio targets cannot exist in the shell).
    """
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    weights = read_adapter_weights(adapter_path)
    if not any(".language_model." in key for key in weights):
        return load_peft_adapter(causal_lm, adapter_path)
    renamed = {
        key.replace(".model.language_model.", ".model."): w for key, w in weights.items() if ".language_model." in key
    }
    if len(renamed) != len(weights):
        raise FlexInferenceError("the adapter also adapts the vision or audio towers, which the text engine drops")
    check_adapter_weights_fit(causal_lm, renamed, adapter_path)
    config = LoraConfig.from_pretrained(adapter_path)
    config.target_modules = sorted({lora_module_name(key) for key in renamed})
    config.inference_mode = True
    peft_model = get_peft_model(causal_lm, config)
    result = set_peft_model_state_dict(peft_model, renamed)
    if result.unexpected_keys:
        raise FlexInferenceError(f"adapter weights {result.unexpected_keys[:3]} have no place in the model")
    return peft_model.eval()


def main(argv=None) -> None:
    args = build_arg_parser(
        "unsloth/gemma-4-E2B-it", "Rollouts (greedy or sampled) for Gemma-4 on flex_attention."
    ).parse_args(argv)
    try:
        require_gemma4()
    except FlexInferenceError as error:
        raise SystemExit(str(error))
    run_cli(args, FlexGemma4Inference, load_gemma4, default_chat_template="native", load_adapter=load_gemma4_adapter)


if __name__ == "__main__":
    main()
