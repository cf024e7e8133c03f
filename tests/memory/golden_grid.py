"""The memory model's numbers over a broad grid of setups, for `golden_grid.json` (test_golden_grid.py).

Every catalog model and a small config of every family the block reader knows (dense, parallel, fused, plain-MLP,
mixtures of experts), each under a deterministic sample of setups (adapter, quantization, optimizer, checkpointing,
offloading, loss, savers, attention, device, batch and length), recorded component by component, with the eval and
per-phase peaks, the layer moments, the per-token terms, the planner's plans (one and several devices, long
contexts), `max_seq_len` and the generation budget. The inputs (configs, setups, requests) are in the file with the
outputs, so the comparison does not depend on anything outside the memory model.

Regenerate (only when a number is meant to change, and say which and why in the commit):
    PYTHONPATH=. python tests/memory/golden_grid.py --write
It recomputes every record over the setups the file already holds, and samples setups only for a model it does not
hold yet (from that model's own seed), so a new catalog model adds its record and moves no other.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import itertools
import json
import random
import sys
from pathlib import Path
from typing import Any

GOLDEN = Path(__file__).with_name("golden_grid.json.gz")

# A small decoder shape every family's config is read at (3 layers so that first-layer and sliding terms show).
BASE = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 8192}  # fmt: skip
# Family → the config keys that change its shape (biases, tying, head_dim, norms, windows, softcaps, experts).
FAMILY_KEYS: dict[str, dict[str, Any]] = {
    "llama": {}, "llama-bias": {"model_type": "llama", "attention_bias": True, "mlp_bias": True},
    "mistral": {"sliding_window": 512}, "qwen2": {}, "qwen2-sliding": {"model_type": "qwen2",
    "use_sliding_window": True, "sliding_window": 512, "max_window_layers": 1},
    "qwen3": {"head_dim": 96}, "gemma": {"head_dim": 96}, "gemma2": {"head_dim": 96, "sliding_window": 512},
    "gemma3_text": {"head_dim": 96, "sliding_window": 512, "sliding_window_pattern": 2},
    "phi3": {}, "granite": {"logits_scaling": 4.0}, "cohere": {"use_qk_norm": True},
    "cohere2": {"sliding_window": 512}, "helium": {"head_dim": 64}, "nemotron": {"hidden_act": "relu2"},
    "arcee": {"hidden_act": "relu2"}, "apertus": {}, "ernie4_5": {}, "smollm3": {}, "glm": {}, "glm4": {},
    "olmo2": {}, "olmo3": {}, "exaone4": {}, "seed_oss": {"attention_out_bias": True},
    "gpt_neox": {}, "falcon": {"new_decoder_architecture": True, "num_kv_heads": 2},
    "falcon-mq": {"model_type": "falcon", "parallel_attn": True}, "phi": {}, "starcoder2": {},
    "qwen": {"kv_channels": 64, "seq_length": 8192}, "unchecked": {"model_type": "lfm_like"},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 192,
                  "shared_expert_intermediate_size": 320},
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 192, "head_dim": 96,
                  "norm_topk_prob": True},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2}, "granitemoe": {"num_local_experts": 4,
    "num_experts_per_tok": 2}, "phimoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
}  # fmt: skip
# Setups: each field's values; a deterministic sample of their product per model, plus one-factor variants.
AXES: dict[str, list[Any]] = {
    "adapter_quant": [("lora", "nf4"), ("lora", "int8"), ("lora", "none"), ("full", "none")],
    "double_quant": [True, False],
    "compute_dtype": ["bfloat16", "float32"],
    "attn_implementation": ["sdpa", "eager", "flash_attention_2"],
    "optimizer": ["paged_adamw_8bit", "adamw_8bit", "adamw_torch", "adafactor", "paged_adamw_32bit"],
    "gradient_checkpointing": [True, False],
    "micro_batch_size": [1, 2],
    "max_seq_len": [512, 1024, 4096],
    "gradient_accumulation": [1, 8],
    "activation_offloading": [False, True],
    "loss_impl": ["trl_fused", "hf_full", "chunked"],
    "loss_chunk_tokens": [None, 256],
    "loss_tokens": [None, 300],
    "savers": [(), ("tiled_mlp",), ("tiled_norms",), ("recompute_lora",), ("embeddings_on_host",),
               ("tiled_mlp", "tiled_norms"), ("tiled_mlp", "recompute_lora"),
               ("tiled_mlp", "tiled_norms", "recompute_lora", "embeddings_on_host")],
    "mlp_tile_tokens": [0, 128],
    "lora_dropout": [0.05, 0.0],
    "lora_targets": [("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                     ("q_proj", "v_proj"), ("all-linear",)],
    "device": ["cuda", "cpu"],
}  # fmt: skip
SAVER_FIELDS = ("tiled_mlp", "tiled_norms", "recompute_lora", "embeddings_on_host")
SAMPLES_PER_MODEL = 32
PER_TOKEN = (
    "layer_activation_bytes", "head_saved_bytes", "mlp_activation_bytes", "first_layer_discount", "eval_mlp_bytes",
    "centred_norm_extra_bytes", "xielu_extra_bytes",
)  # fmt: skip
BYTES = (
    "forward_transient_bytes", "final_norm_forward_bytes", "masked_attention_forward_bytes", "attention_mask_bytes",
    "eager_scores_bytes", "tiled_mlp_transient_bytes",
)  # fmt: skip


def setup_fields(adapter_quant, savers, **rest) -> dict[str, Any]:
    """A `Setup`'s fields, every one given (so a changed default does not move a golden number)."""
    adapter, quant = adapter_quant
    fields = {"adapter": adapter, "quantization": quant, "lora_r": 16, "safety_margin_gb": 1.0, **rest}
    fields.update({name: name in savers for name in SAVER_FIELDS})
    fields["lora_targets"] = list(fields["lora_targets"])
    return fields


def setups(rng: random.Random, moe: bool) -> list[dict[str, Any]]:
    """A deterministic sample of the setup grid, and each axis's values varied alone from the first setup."""
    base = {axis: values[0] for axis, values in AXES.items()}
    out = [dict(base)]
    for axis, values in AXES.items():
        out += [{**base, axis: v} for v in values[1:]]
    for _ in range(SAMPLES_PER_MODEL):
        out.append({axis: rng.choice(values) for axis, values in AXES.items()})
    if moe:  # the memory model's MoE terms are measured with these savers off (the planner refuses them)
        for point in out:
            point["savers"] = tuple(x for x in point["savers"] if x == "embeddings_on_host")
    return [setup_fields(**point) for point in out]


def models() -> dict[str, dict[str, Any]]:
    """name → {"catalog": hub id} or {"config": dict}."""
    from lowmem_ft.memory.arch import catalog

    out: dict[str, dict[str, Any]] = {name: {"catalog": name} for name in sorted(catalog())}
    for family, keys in FAMILY_KEYS.items():
        out[f"family:{family}"] = {"config": {**BASE, "model_type": family, **keys}}
    out["family:gemma3-vision"] = {"config": {
        "model_type": "gemma3", "tie_word_embeddings": True,
        "text_config": {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 3, "vocab_size": 1024,
                        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "sliding_window": 512},
        "vision_config": {"hidden_size": 64, "image_size": 56, "intermediate_size": 128, "num_hidden_layers": 2,
                          "patch_size": 14, "model_type": "siglip_vision_model"}}}  # fmt: skip
    out["family:llama4"] = {"config": {"model_type": "llama4", "text_config": {**BASE, "head_dim": 64}}}
    return out


def architecture(spec: dict[str, Any]):
    from lowmem_ft.memory.arch import Architecture, load_architecture

    if "catalog" in spec:
        return load_architecture(spec["catalog"])
    return Architecture.from_config(json.loads(json.dumps(spec["config"])), name="golden")


def _number(x: Any) -> Any:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else x


def _listed(x: Any) -> list:
    return sorted(x) if isinstance(x, (set, frozenset)) else list(x)  # a set in a fixed order


def arch_record(arch) -> dict[str, Any]:
    from lowmem_ft.memory import arch as arch_mod

    record = json.loads(json.dumps(dataclasses.asdict(arch), default=_listed))
    for key, unused in ARCH_ADDED_SINCE_RECORDED.items():  # fields added since, where they hold their unused value
        if key in record and record[key] == unused:
            del record[key]
    for prop in ("norm_params", "block_linear_params", "block_params", "embedding_params", "lm_head_params",
                 "final_norm_params", "linear_params", "total_params", "linear_names", "chunked_loss_refusal",
                 "chunked_loss_exact"):  # fmt: skip
        record[prop] = getattr(arch, prop)
    record["summary"] = arch.summary()
    record["attention_for"] = {a: list(arch.attention_for(a)) for a in ("sdpa", "eager", "flash_attention_2")}
    record["unchecked_family"] = arch_mod.unchecked_family(arch)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    record["adapter_modules"] = arch.adapter_modules(targets)
    if arch.moe:
        record["moe_adapted"] = [arch.moe.adapted_parameters(t) for t in (targets, ["all-linear"], ["gate"])]
        record["moe_layer_params"] = arch.moe.layer_params(arch.hidden_size)
    return record


def estimate_record(est, rounded: bool = False) -> dict[str, Any]:
    """Every number of an estimate (and, `rounded`, its `to_dict` as `plan --json` prints it)."""
    return {
        "components": [[c.name, float(c.bytes), c.phase, c.source] for c in est.components],
        "model_peak_bytes": float(est.model_peak_bytes),
        "overhead_bytes": float(est.overhead_bytes),
        "peak_phase": est.peak_phase,
        "notes": list(est.notes),
        "phases": {k: float(v) for k, v in est.phases.items()},
        "setup": json.loads(json.dumps(dataclasses.asdict(est.setup), default=_listed)),
        **({"to_dict": est.to_dict()} if rounded else {}),
    }


# `Setup` fields added after the grid was recorded, with the value that means "not used": a setup that leaves one
# there is recorded without it (the grid's setups use none of them), so its old record stays the one to match.
ADDED_SINCE_RECORDED = {"use_dora": False, "adapter_init": "default", "image_patches": 0, "batch_patches": None,
                        "vision_train": "frozen", "lora_in_compute_dtype": False}  # fmt: skip
# Architecture fields added since the grid was recorded (a vision-language tower, `lowmem_ft.memory.vision`)
ARCH_ADDED_SINCE_RECORDED = {"vision": None}


def setup_record(arch, fields: dict[str, Any]) -> dict[str, Any]:
    """Every number of the memory model for one setup."""
    from lowmem_ft.memory import estimate as e

    s = e.Setup(**{**fields, "lora_targets": tuple(fields["lora_targets"])})
    est = e.estimate(arch, s)
    es, _ = e.effective_setup(arch, s)
    out: dict[str, Any] = {"estimate": estimate_record(est)}
    out["eval"] = [float(e.eval_peak_bytes(arch, s, b)) for b in (1, 4)]
    out["layer_moments"] = [float(x) for x in e.layer_moments(arch, est)]
    terms: dict[str, Any] = {name: float(getattr(e, name)(arch, es)) for name in PER_TOKEN + BYTES}
    terms["loss_bytes"] = [_number(x) for x in e.loss_bytes(arch, es)]
    terms["backward_transient_bytes"] = [_number(x) for x in e.backward_transient_bytes(arch, es)]
    terms["weight_bytes"] = [_number(x) for x in e.weight_bytes(arch, es)]
    terms["masked_layers"] = e.masked_layers(arch, es)
    terms["mlp_tile_tokens"] = e.mlp_tile_tokens(arch, es)
    terms["loss_chunk_tokens"] = e.loss_chunk_tokens(arch, es)
    terms["largest_loss_chunk"] = [e.largest_loss_chunk(arch, es, b) for b in (0, 2**24, 2**30)]
    terms["trainer_fp32_states"] = e.trainer_fp32_states(arch, es)
    if arch.moe:
        for name in ("moe_activation_bytes", "moe_eval_bytes", "moe_forward_transient_bytes", "moe_router_bytes",
                     "moe_routed_bytes", "unused_sliding_mask_bytes"):  # fmt: skip
            terms[name] = float(getattr(e, name)(arch, es))
        terms["moe_backward_transient_bytes"] = [_number(x) for x in e.moe_backward_transient_bytes(arch, es)]
    out["terms"] = terms
    if s.device == "cpu":
        phases = {}
        for phase in ("forward", "backward", "optimizer step", "eval"):
            for grads, states, ddp in ((True, True, False), (False, False, False), (True, True, True)):
                key = f"{phase}|{grads}|{states}|{ddp}"
                phases[key] = float(e.phase_peak_bytes(arch, s, phase, grads=grads, states=states, ddp=ddp))
        out["phase_peak_bytes"] = phases
    return out


# -- the planner ---------------------------------------------------------------------------------------------------
PLAN_MODELS = ("Qwen/Qwen2.5-7B", "meta-llama/Llama-3.1-8B", "google/gemma-2-9b", "mistralai/Mixtral-8x7B-v0.1",
               "microsoft/Phi-3-mini-4k-instruct", "Qwen/Qwen3-30B-A3B")  # fmt: skip
# (vram, gpus, strategy, offload, max_seq_len, start overrides, fixed knobs, accumulation, eval batch)
PLAN_REQUESTS: list[tuple[Any, ...]] = [
    (8, 1, "auto", None, 1024, {}, (), 8, 0),
    (16, 1, "auto", None, 2048, {}, (), 8, 0),
    (24, 1, "auto", None, 2048, {}, (), 8, 0),
    (24, 1, "auto", None, 16384, {}, (), 8, 0),
    (24, 1, "auto", None, 65536, {}, (), 8, 0),
    (40, 1, "auto", None, 4096, {"quantization": "none", "optimizer": "adamw_torch"}, (), 4, 0),
    (80, 1, "auto", None, 4096, {"adapter": "full", "quantization": "none", "optimizer": "adamw_8bit"}, (), 8, 0),
    (24, 1, "auto", None, 4096, {"micro_batch_size": 4}, ("micro_batch_size",), 2, 8),
    (12, 1, "auto", None, 32768, {"quantization": "nf4"}, ("quantization", "gradient_checkpointing"), 8, 0),
    (24, 2, "auto", None, 4096, {}, (), 8, 0),
    (24, 4, "fsdp", None, 8192, {"quantization": "none", "optimizer": "adamw_torch"}, (), 8, 0),
    (40, 8, "zero3", True, 4096, {"adapter": "full", "quantization": "none", "optimizer": "adamw_torch"}, (), 8, 0),
    (24, 2, "zero2", None, 4096, {"quantization": "none", "optimizer": "adamw_torch"}, (), 8, 0),
    (2, 1, "auto", None, 4096, {}, (), 8, 0),
]
START = setup_fields(
    ("lora", "nf4"), (), double_quant=True, compute_dtype="bfloat16", attn_implementation="sdpa",
    optimizer="paged_adamw_8bit", gradient_checkpointing=True, micro_batch_size=1, max_seq_len=1024,
    gradient_accumulation=8, activation_offloading=False, loss_impl="trl_fused", loss_chunk_tokens=None,
    loss_tokens=None, mlp_tile_tokens=0, lora_dropout=0.05, device="cuda",
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
)  # fmt: skip


def plan_record(arch, request: tuple[Any, ...]) -> dict[str, Any]:
    from lowmem_ft.errors import UserError
    from lowmem_ft.memory import planner
    from lowmem_ft.memory.estimate import Setup
    from lowmem_ft.memory.target import Target

    vram, gpus, strategy, offload, seq, start, fixed, accumulation, eval_batch = request
    fields = {**START, **start, "max_seq_len": seq, "gradient_accumulation": accumulation}
    s = Setup(**{**fields, "lora_targets": tuple(fields["lora_targets"])})
    req = planner.Request(s, Target(vram, 1.5, gpus), accumulation, eval_batch, frozenset(fixed), strategy, offload)
    out: dict[str, Any] = {}
    try:
        p = planner.plan(arch, req)
        out["plan"] = p.to_dict()
        out["estimate"] = estimate_record(p.estimate, rounded=True)
        out["peak_bytes"] = float(p.estimate.peak_bytes)
    except (UserError, KeyError) as exc:  # KeyError: a MoE refusal's message lacks the experts' component
        out["refused"] = f"{type(exc).__name__}: {exc}"
    try:
        out["max_seq_len"] = planner.max_seq_len(arch, req)
    except (UserError, KeyError) as exc:
        out["max_seq_len_refused"] = f"{type(exc).__name__}: {exc}"
    return out


def generation_record(arch) -> dict[str, Any]:
    from lowmem_ft.memory import inference

    out: dict[str, Any] = {}
    for bpv, prompt, budget in itertools.product((1, 2), (16, 2048), (4e9, 24e9)):
        g = inference.plan_generation(
            arch, budget_bytes=int(budget), weights_bytes=int(arch.total_params * bpv), reserve_bytes=int(5e8),
            prompt_tokens=prompt, requested_new_tokens=4096, bytes_per_value=bpv,
        )  # fmt: skip
        out[f"{bpv}|{prompt}|{budget}"] = {
            **{k: _number(v) for k, v in dataclasses.asdict(g).items()},
            "describe": g.describe(),
            "fixed_bytes": g.fixed_bytes,
        }
    out["kv_cache_bytes"] = inference.kv_cache_bytes(arch, 1000, 2, batch=3)
    out["prefill_workspace_bytes"] = inference.prefill_workspace_bytes(arch, 777, 2)
    return out


def build(recorded: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every record, over the setups already recorded for a model (`recorded`, the file's content) and a fresh sample
    for a model the file does not hold yet, drawn from that model's own random stream: adding a model to the catalog
    leaves every other model's setups as they are."""
    golden: dict[str, Any] = {"models": {}, "plans": {}}
    for name, spec in models().items():
        arch = architecture(spec)
        if recorded and name in recorded["models"]:
            points = [p["fields"] for p in recorded["models"][name]["setups"]]
        else:
            points = setups(random.Random(f"20:{name}"), moe=arch.moe is not None)
        golden["models"][name] = {
            "spec": spec,
            "arch": arch_record(arch),
            "setups": [{"fields": f, **setup_record(arch, f)} for f in points],
            "generation": generation_record(arch),
        }
    for name in PLAN_MODELS:
        arch = architecture({"catalog": name})
        golden["plans"][name] = [{"request": list(r), **plan_record(arch, r)} for r in PLAN_REQUESTS]
    return golden


def load() -> dict[str, Any]:
    return json.loads(gzip.decompress(GOLDEN.read_bytes()))


def normalized(data: Any) -> Any:
    """JSON's view of the records (tuples as lists, keys as strings), what the file holds; every `setup` record
    without the fields added since the grid was recorded, where they hold their unused value."""
    return _without_added(json.loads(json.dumps(data)))


def _without_added(data: Any) -> Any:
    if isinstance(data, list):
        return [_without_added(v) for v in data]
    if not isinstance(data, dict):
        return data
    out = {k: _without_added(v) for k, v in data.items()}
    if isinstance(out.get("setup"), dict):
        out["setup"] = {
            k: v for k, v in out["setup"].items() if not (k in ADDED_SINCE_RECORDED and v == ADDED_SINCE_RECORDED[k])
        }
    return out


def count_numbers(data: Any) -> int:
    if isinstance(data, dict):
        return sum(count_numbers(v) for v in data.values())
    if isinstance(data, list):
        return sum(count_numbers(v) for v in data)
    return int(isinstance(data, (int, float)) and not isinstance(data, bool))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {GOLDEN.name}")
    args = parser.parse_args(argv)
    golden = normalized(build(load() if GOLDEN.exists() else None))
    setups_n = sum(len(m["setups"]) for m in golden["models"].values())
    plans_n = sum(len(p) for p in golden["plans"].values())
    print(f"{len(golden['models'])} models, {setups_n} setups, {plans_n} plans, {count_numbers(golden)} numbers")
    if args.write:
        GOLDEN.write_bytes(gzip.compress((json.dumps(golden, sort_keys=True) + "\n").encode(), mtime=0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
