"""Each memory saver's terms in one place: what turning it on changes at each moment of the step — the tensors kept
for backward, the transients in flight at the forward's and the backward's peaks, the evaluation forward, the
static state — and, for the long-context savers the planner adds, their cost, reason line and refusals.

One idea: the composition (`activations`, `transients`, `evaluation`, `static`, `estimate`) computes a moment as it
is without savers and hands the term to each saver that touches it (`TILED_NORMS.layer_norms(arch, s, untiled)`):
the saver gives it back unchanged when it is off, or its own figure when it is on. So "what does the tiled MLP
change?" is the `TiledMLP` class below. Terms that exist only when two savers are on together live with the costlier
(later) saver and are named in the other's docstring. Checkpointing and activation offloading, which are not
long-context savers the planner stages, are the last section (what a checkpointed layer keeps).

The savers themselves are applied to a built model in `lowmem_ft.train.savers.apply`; every constant is in
`lowmem_ft.memory.calibration`.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowmem_ft.memory import dora
from lowmem_ft.memory.arch import Architecture, Linear
from lowmem_ft.memory.calibration import (
    FWD_BESIDE_CKPT,
    FWD_BESIDE_NO_CKPT_TILED_NORMS,
    FWD_TRANSIENT_CKPT,
    FWD_TRANSIENT_NO_CKPT,
    NORM_BWD_BYTES_PER_H,
    RECOMPUTE_BWD_I_LORA_RECOMPUTED,
    TILE_BWD_I,
    TILE_BWD_I_TILED_NORMS,
    TILED_NORMS_BWD_H,
    TILED_NORMS_RECOMPUTE_BWD_H,
    TILED_RECOMPUTE_BWD_H,
)
from lowmem_ft.memory.linears import (
    dropout_mask_bytes,
    is_mlp_linear,
    lora_linears,
    peft_lora_input_bytes,
    shared_input_bytes,
)
from lowmem_ft.memory.records import DTYPE_BYTES, Component, Setup, mlp_tile_tokens


@dataclass(frozen=True)
class Saver:
    """A long-context saver as the planner sees it: `name` is its `Setup` field (the recipe's `memory.<name>`),
    `label` its name in prose, `cost` its relative step time (the comment above the instances says where the costs
    come from), `what` what it does for its "on: …" line (formatted with the embedding table's GB and the tile),
    `tiled` whether `mlp_tile_tokens` sizes its tiles."""

    name: str
    label: str
    cost: float
    what: str
    tiled: bool

    def on(self, s: Setup) -> bool:
        return getattr(s, self.name)

    def refusal(self, arch: Architecture, s: Setup, gpus: int) -> str | None:
        """Why it cannot be used for this setup (the reason line's "off: …"), None when it can."""
        return None

    def _unmeasured_on_experts(self, arch: Architecture) -> str | None:
        if arch.experts:
            return f"not measured on a mixture of experts ({self.name}'s terms are fitted on dense blocks)"
        return None


# -- host embeddings ---------------------------------------------------------------------------------------------
class HostEmbeddings(Saver):
    """The frozen input embedding table stays in host RAM and the lookup runs there (lowmem_ft/train/
    host_embeddings.py). Static only: the table leaves the device's 16-bit weights for the host."""

    def refusal(self, arch: Architecture, s: Setup, gpus: int) -> str | None:
        if s.adapter != "lora":
            return "full fine-tuning trains the embeddings"
        if arch.tie_embeddings:
            return "the input embeddings are tied to the lm_head, which the loss uses on the device"
        if gpus > 1:
            return "not supported with several processes"
        return None

    def host_table(self, arch: Architecture, s: Setup) -> Component | None:
        """The table in host memory (None: on the device), which the static 16-bit weights no longer hold."""
        if not (self.on(s) and not arch.tie_embeddings and s.adapter == "lora"):
            return None
        host = DTYPE_BYTES[s.compute_dtype] * arch.embedding_params
        return Component("input embeddings (host)", host, "host", f"memory.{self.name}: CPU lookup")


# -- tiled norms -------------------------------------------------------------------------------------------------
class TiledNorms(Saver):
    """Each hidden-sized RMSNorm (the layers' and the final one; q/k norms are left as they are) runs over tiles of
    tokens under its own checkpoint (lowmem_ft/train/savers/tiles.py tile_norms): it keeps only a view of its c-byte
    input, its fp32 copies exist for one tile at a time. With the tiled MLP too, the recomputed layer's backward and
    one MLP tile's are `TiledMLP.recomputed_backward` / `TiledMLP.tile_backward`; with LoRA recompute, the forward's
    hidden-sized tensors are `RecomputeLora.forward`."""

    def refusal(self, arch: Architecture, s: Setup, gpus: int) -> str | None:
        return self._unmeasured_on_experts(arch)

    def layer_norms(self, arch: Architecture, s: Setup, untiled: float) -> float:
        """Per token, what a layer's hidden-sized norms keep: each a view of its c-byte input; under checkpointing
        the first one's input is the layer input the checkpoint holds already (measured per layer: 1,808 B/token for
        the probe, tiled MLP and recompute_lora on, without checkpointing)."""
        if not self.on(s):
            return untiled
        c, h = DTYPE_BYTES[s.compute_dtype], arch.hidden_size
        return c * h * (arch.norms_per_layer - (1 if s.gradient_checkpointing else 0))

    def centred_norms(self, s: Setup, untiled: int) -> int:
        """Hidden-sized mean-centred norms that keep their second fp32 copy: none once tiled."""
        return 0 if self.on(s) else untiled

    def one_norm(self, arch: Architecture, s: Setup, untiled: float) -> float:
        """Per token, what one hidden-sized norm keeps (the final norm, or the first layer's when its input needs
        grad): its c-byte input."""
        return DTYPE_BYTES[s.compute_dtype] * arch.hidden_size if self.on(s) else untiled

    def final_norm_forward(self, s: Setup, untiled: float) -> float:
        """The final norm's forward moment: its fp32 copies exist for one tile at a time (0: the layers' or the
        loss's moment is larger)."""
        return 0.0 if self.on(s) else untiled

    def head_output(self, s: Setup) -> bool:
        """Whether the final norm's output is a tensor of its own beside its kept input through the loss's forward
        (the tiled norm's output is not a view of what it keeps; PeakMemory, tiny-model runs at 4,096 tokens)."""
        return self.on(s)

    def forward_beside(self, s: Setup, untiled: float) -> float:
        """Hidden-sized c-byte tensors beside peft's widest linear without checkpointing: two (the other two are the
        tiled norms' kept inputs, counted as kept)."""
        return FWD_BESIDE_NO_CKPT_TILED_NORMS if self.on(s) else untiled

    def final_norm_backward(self, arch: Architecture, s: Setup) -> float:
        """Without checkpointing, the final norm's fp32 backward (NORM_BWD_BYTES_PER_H per element), over one tile
        when tiled."""
        t = mlp_tile_tokens(arch, s) if self.on(s) else s.tokens
        return NORM_BWD_BYTES_PER_H * arch.hidden_size * t


# -- tiled MLP ---------------------------------------------------------------------------------------------------
class TiledMLP(Saver):
    """Each decoder MLP runs over tiles of tokens under a checkpoint per tile (lowmem_ft/train/savers/tiles.py): it
    keeps only its input, and its own tensors exist for one tile at a time — in the forward, in the backward's
    recompute and in evaluation. Its linears are left out of peft's kept inputs and of LoRA recompute (they run
    inside the tiles)."""

    def refusal(self, arch: Architecture, s: Setup, gpus: int) -> str | None:
        if arch.experts:
            return f"a mixture of {arch.experts} experts is not tiled (its router sees the whole sequence)"
        return None

    def tiles(self, arch: Architecture, s: Setup, lin: Linear) -> bool:
        """Whether this linear runs inside the MLP's tiles (what it keeps is the tile's, not the layer's)."""
        return self.on(s) and is_mlp_linear(arch, lin)

    def mlp_kept(self, arch: Architecture, s: Setup, untiled: float) -> float:
        """Per token, what the MLP keeps: its input (c·h, the view each tile's checkpoint holds); in a parallel block
        a full fine-tune's q/k/v keep that norm output already (measured: Cohere h 256, head_dim 96, full, tiled:
        12,857 B/token per layer; 13,356 with it counted twice)."""
        if not self.on(s):
            return untiled
        shared = s.adapter == "full" and arch.norms_per_layer == 1
        return 0 if shared else DTYPE_BYTES[s.compute_dtype] * arch.hidden_size

    def forward(self, arch: Architecture, s: Setup, lins: list[Linear], transient: float, wide_in: int) -> float:
        """peft's forward moment (`transients._dense_forward_transient_bytes`) with the MLP tiled: under
        checkpointing the attention's output projection may be the larger moment (`attention_output`, beside the
        LoRA copies of `wide_in`, the widest input outside the MLP); without, the attention's linears beside two
        hidden-sized tensors (measured); then one tile's moment — the MLP's linears see one tile at a time under its
        checkpoint (nothing kept), beside the tile outputs gathered so far, the residual sum and the MLP input (3·c·h
        per token: the forward of the yardstick's 1,024-token-tile points, where this moment is the peak, is exact on
        the three shapes)."""
        if not self.on(s):
            return transient
        c, h, t = DTYPE_BYTES[s.compute_dtype], arch.hidden_size, s.tokens
        drop = dropout_mask_bytes(s)
        if s.gradient_checkpointing:
            transient = max(transient, self.attention_output(arch, s, (drop + FWD_TRANSIENT_CKPT) * wide_in))
        else:
            transient = ((c + drop + FWD_TRANSIENT_NO_CKPT) * wide_in + 2 * c * h) * t
        inside = max((lin.in_features for lin in lins if is_mlp_linear(arch, lin)), default=0)
        tile = mlp_tile_tokens(arch, s)
        return max(transient, (c + drop + FWD_TRANSIENT_CKPT) * inside * tile + 3 * c * h * t)

    def attention_output(self, arch: Architecture, s: Setup, lora_copies: float) -> float:
        """Under checkpointing: the moment of the attention's output projection — q, k, v and the attention output
        (c bytes each), the norm output and the projection's base output (c·h each) and its LoRA copies
        (`lora_copies` bytes per token; measured, see FWD_TRANSIENT_CKPT)."""
        c = DTYPE_BYTES[s.compute_dtype]
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        return (c * (2 * q + 2 * kv) + 2 * c * arch.hidden_size + lora_copies) * s.tokens

    def tile_backward(self, arch: Architecture, s: Setup, mlp: float) -> float:
        """The MLP's backward working set beyond the layer's saved tensors: one tile's recomputed MLP tensors (`mlp`
        B per token) and TILE_BWD_I·i B per tile token of gradients, beside the tiles' input gradients (c·h per
        token); with tiled norms TILE_BWD_I_TILED_NORMS·i and no per-token gather in the peak."""
        c = DTYPE_BYTES[s.compute_dtype]
        tile = mlp_tile_tokens(arch, s)
        if TILED_NORMS.on(s):
            return tile * (mlp + TILE_BWD_I_TILED_NORMS * arch.intermediate_size)
        per_tile_token = mlp + TILE_BWD_I * arch.intermediate_size
        return tile * per_tile_token + c * arch.hidden_size * s.tokens

    def recomputed_backward(self, arch: Architecture, s: Setup, mlp: float) -> tuple[float, str]:
        """Under checkpointing: the recomputed layer's attention gradients in flight (TILED_RECOMPUTE_BWD_H·h B/token;
        with tiled norms TILED_NORMS_BWD_H, or TILED_NORMS_RECOMPUTE_BWD_H with LoRA recompute too) or one MLP tile's
        backward, the larger."""
        h, t = arch.hidden_size, s.tokens
        attn_h = TILED_RECOMPUTE_BWD_H
        if TILED_NORMS.on(s):
            attn_h = TILED_NORMS_RECOMPUTE_BWD_H if RECOMPUTE_LORA.on(s) else TILED_NORMS_BWD_H
        grads = max(attn_h * h * t, self.tile_backward(arch, s, mlp))
        return grads, f"attention gradients or one MLP tile of {mlp_tile_tokens(arch, s)} tokens (measured)"

    def eval_tokens(self, arch: Architecture, s: Setup) -> int:
        """Tokens whose MLP tensors are in flight at once in an evaluation forward: one tile's."""
        return mlp_tile_tokens(arch, s) if self.on(s) else s.tokens


# -- LoRA recompute ----------------------------------------------------------------------------------------------
class RecomputeLora(Saver):
    """Each LoRA branch runs over tiles of tokens under its own checkpoint (lowmem_ft/train/savers/lora_recompute.py): it
    keeps only its c-byte input, no fp32 copies or dropout masks (`kept_inputs`); its forward moment is output-side
    (`forward`); the recomputed MLP's gradients in flight are fewer (`recomputed_mlp_bwd_i`). The MLP's linears are
    left to the tiled MLP when that is on."""

    def refusal(self, arch: Architecture, s: Setup, gpus: int) -> str | None:
        if s.adapter != "lora":
            return "no LoRA branches (full fine-tuning)"
        return self._unmeasured_on_experts(arch)

    def lora_inputs(self, arch: Architecture, s: Setup, mlp: bool) -> float:
        """Per token, what the attention's (`mlp` False) or MLP's (True) LoRA layers keep: peft's
        (`peft_lora_input_bytes`), or the branch checkpoints' inputs (`kept_inputs`); DoRA's kept tensors beside
        either (`dora.kept_per_token`)."""
        drop = dropout_mask_bytes(s)
        lins = [lin for lin in lora_linears(arch, s) if is_mlp_linear(arch, lin) == mlp]
        if self.on(s) and not (mlp and TILED_MLP.on(s)):
            return self.kept_inputs(arch, s, lins) + dora.kept_per_token(s, lins)
        return peft_lora_input_bytes(arch, s, lins, drop) + dora.kept_per_token(s, lins)

    def kept_inputs(self, arch: Architecture, s: Setup, lins: list[Linear]) -> float:
        """Per token, what each branch checkpoint keeps for these adapted linears: only its input, a c-byte tensor,
        one per tensor however many linears read it (`linears.shared_input_bytes`). Measured per layer with
        PeakMemory (1- vs 2-layer models): 6,424 and 2,328 (with the tiled MLP) B/token for the Llama-shaped probe
        of tests/memory/test_estimate.py."""
        return shared_input_bytes(arch, s, lins)

    def first_layer_masks(self, s: Setup, peft: float) -> float:
        """Dropout mask bytes per element the first layer does not keep: none are kept in any layer."""
        return 0 if self.on(s) else peft

    def forward(self, arch: Architecture, s: Setup, lins: list[Linear]) -> float:
        """The forward moment: the fp32 input copies live inside each branch's tile; what remains is output-side: the
        base layer's c-byte output and the branch's fp32 tile outputs and their concatenation (FWD_TRANSIENT_CKPT
        bytes per output element; peft's plain Linear then adds them in fp32), for the adapted linear with the
        widest output, beside one c-byte tensor of the widest live activation and the two hidden-sized ones of
        FWD_BESIDE_CKPT. Without checkpointing part of the fp32 output is kept already (FWD_TRANSIENT_NO_CKPT),
        beside three c-byte hidden-sized tensors (one with tiled MLP and norms: the rest are the tiled norms' kept
        inputs). With the tiled MLP under checkpointing the attention's output projection is the larger moment; one
        MLP tile's moment as in `TiledMLP.forward`. Measured as FWD_TRANSIENT_CKPT says: within 4 B/token on the
        three shapes."""
        c = DTYPE_BYTES[s.compute_dtype]
        h, t = arch.hidden_size, s.tokens
        outside = [lin for lin in lins if not TILED_MLP.tiles(arch, s, lin)]
        widest = max((lin.out_features for lin in outside), default=0)
        live = max([h] + [arch.intermediate_size for lin in outside if is_mlp_linear(arch, lin)])
        if s.gradient_checkpointing:
            transient = ((c + FWD_TRANSIENT_CKPT) * widest + c * live + (FWD_BESIDE_CKPT - 1) * c * h) * t
            if TILED_MLP.on(s):
                transient = max(transient, TILED_MLP.attention_output(arch, s, FWD_TRANSIENT_CKPT * h))
        else:
            beside = 1 if TILED_MLP.on(s) and TILED_NORMS.on(s) else 3
            transient = ((c + FWD_TRANSIENT_NO_CKPT) * widest + beside * c * h) * t
        if TILED_MLP.on(s):
            inside = max((lin.out_features for lin in lins if is_mlp_linear(arch, lin)), default=0)
            tile = mlp_tile_tokens(arch, s)
            i = arch.intermediate_size
            transient = max(transient, ((c + FWD_TRANSIENT_CKPT) * inside + c * i) * tile + 3 * c * h * t)
        return transient

    def recomputed_mlp_bwd_i(self, s: Setup, peft: float) -> float:
        """Under checkpointing without the tiled MLP: the recomputed MLP's gradients in flight per intermediate
        element (RECOMPUTE_BWD_I_LORA_RECOMPUTED)."""
        return RECOMPUTE_BWD_I_LORA_RECOMPUTED if self.on(s) and s.adapter == "lora" else peft


# `cost`: relative step time, for the planner's ranking (`lowmem_ft.memory.planner.COST`). CPU step-time ratios,
# not GPU ones (python -m devkit.bench.context, benchmarks/context_cpu.md: each on top of checkpointing + the chunked
# loss, a 4-layer hidden-256 model at 1,024 tokens): tiled norms +9 % (the norms recomputed tile by tile),
# tiled MLP +16 % (one more MLP forward per step), LoRA recompute +39 % (the LoRA branches' forward again, as many
# small per-tile ops — what a CPU runs worst). Host embeddings measured +0 % on the CPU; 1.02 stands for a GPU's host
# gather and host→device copy of 2·hidden B per token (~33 ms per 100k tokens predicted at PCIe 4 speed, a few % of a
# step that long). The order they give — host embeddings, tiled norms, tiled MLP, LoRA recompute — is kept for a GPU:
# the MLP's recompute is FLOPs (most of a layer's), the norms' a memory-bound pass, and LoRA recompute, whose GPU cost
# is the least known, comes last.
HOST_EMBEDDINGS = HostEmbeddings(
    name="embeddings_on_host",
    label="host embeddings",
    cost=1.02,
    what="the {table:.2f} GB input embedding table stays in host RAM",
    tiled=False,
)
TILED_NORMS = TiledNorms(
    name="tiled_norms",
    label="tiled norms",
    cost=1.09,
    what="the norms run in tiles of {tile:,} tokens (no fp32 copy of the whole sequence)",
    tiled=True,
)
TILED_MLP = TiledMLP(
    name="tiled_mlp",
    label="tiled MLP",
    cost=1.16,
    what="the MLPs run in tiles of {tile:,} tokens (no tokens × intermediate tensor)",
    tiled=True,
)
RECOMPUTE_LORA = RecomputeLora(
    name="recompute_lora",
    label="LoRA recompute",
    cost=1.39,
    what="the LoRA branches are recomputed in backward (no fp32 copies of their inputs kept)",
    tiled=True,
)
# the planner's long-context savers, in order of cost (`lowmem_ft.memory.long_context`)
LONG_CONTEXT_SAVERS: tuple[Saver, ...] = (HOST_EMBEDDINGS, TILED_NORMS, TILED_MLP, RECOMPUTE_LORA)


# -- checkpointing and activation offloading ---------------------------------------------------------------------
def checkpointed_layers(arch: Architecture, s: Setup, comps: list[Component], layer: float) -> float:
    """With gradient checkpointing: what the layers keep (each layer's input, the non-reentrant checkpoint's; none on
    the device with activation offloading, which moves them to host RAM with `save_on_cpu`), and one layer's
    activations recomputed in backward (`layer` bytes); their components appended to `comps`."""
    boundary = DTYPE_BYTES[s.compute_dtype] * arch.hidden_size * s.tokens  # a decoder layer's input
    kept = 0.0 if s.activation_offloading else arch.num_layers * boundary
    label = "checkpointed layer inputs" + (" (offloaded to host)" if s.activation_offloading else "")
    comps.append(Component(label, kept, "forward/backward", "non-reentrant checkpoint keeps each layer's input"))
    if s.activation_offloading:
        comps.append(Component("offloaded layer inputs", arch.num_layers * boundary, "host", "save_on_cpu"))
    comps.append(Component("one layer's activations (recompute)", layer, "forward/backward", "recomputed in bwd"))
    return kept
