"""The memory model: pure arithmetic over an architecture description (no torch, no recipe), so `plan` is instant and
the same numbers serve the planner, the monitor's "predicted" line and the report.

It reads in five layers; a module imports only from its own layer or the ones above it (`LAYERS`, enforced by
tests/memory/test_map.py):

1. describe — what is trained, and where: `families` (one `Family` record per model_type), `blocks` (a decoder
   block's shape from a config dict), `vision` (the Qwen-VL towers: shapes and per-patch costs), `vision_towers`
   (one plain-ViT tower for Gemma-3, Idefics3 / SmolVLM, LLaVA, LLaVA-OneVision), `layout` (checked against a local
   model's weights), `arch` (the `Architecture` read from config.json), `records` (the `Setup` of knobs, a named
   `Component`, an `Estimate`), `target` (VRAM, margin and budget), `lengths` (the sequence lengths a plan chooses
   and the search for the longest that fits).
2. constants — `calibration`: every number the terms use, each declared with its `Source` (read from a library's
   code, or measured, and how).
3. terms — one concern each, bytes per component at each moment of the step: `linears` (what LoRA adapts and
   keeps), `dora`, `savers` (each memory saver's terms), `static` (weights, trainable tensors, gradients, optimizer
   states), `activations` (what a layer keeps for backward), `experts` (MoE), `loss` (logits and loss),
   `recompute` (the checkpointed backward's moment), `transients` (in flight at the forward and backward peaks),
   `evaluation` (eval forwards), `overheads` (CUDA context, cuBLAS, allocator), `adapter_init` (PiSSA / OLoRA's
   start-up moment), `tower` (a vision-language step's pixel values and the vision tower's moments).
4. compose — the terms summed into a peak: `estimate` (the components of a `Setup`, phase by phase), `sharding`
   (per device under DDP / ZeRO / FSDP), `host` (host RAM as a limit), `inference` (generation memory).
5. methods and search — what a method adds and the planner over `Setup` variants: `preference` (DPO / ORPO /
   SimPO / KTO's reference pass and rows), `grpo` (a GRPO step's phases), `long_context` (the savers as knobs),
   `reasons` (each knob's reason line), `planner` (the fastest setup that fits), `grpo_plan` (a GRPO round that
   fits).
"""

# layer → its modules, top to bottom (the map above)
LAYERS: dict[str, tuple[str, ...]] = {
    "describe": ("families", "blocks", "vision", "vision_towers", "layout", "arch", "records", "target", "lengths"),
    "constants": ("calibration",),
    "terms": (
        "linears", "dora", "savers", "static", "activations", "experts", "loss", "recompute", "transients",
        "evaluation", "overheads", "adapter_init", "tower",
    ),
    "compose": ("estimate", "sharding", "host", "inference"),
    "methods and search": ("preference", "grpo", "long_context", "reasons", "planner", "grpo_plan"),
}  # fmt: skip
