"""Writing one GGUF file from a model directory (+ a LoRA adapter), tensor by tensor, with the `gguf` package.

The file's layout is what llama.cpp's converter writes: the architecture keys (`families`), the tokenizer
(`vocab`), then every tensor under its GGUF name (`gguf.get_tensor_name_map`) — 1-D tensors (norms, biases) in F32,
matrices in the chosen type (F16, BF16, or Q8_0 through `gguf.quants`, which is llama.cpp's own block format: 32
weights share one fp16 scale). A matrix whose rows are not a multiple of 32 stays F16, as llama.cpp does.

`gguf.GGUFWriter` holds every tensor until it writes them; here only the tensor *infos* are given to it (shapes and
sizes from the safetensors headers), it writes the header, metadata and tensor table, and the data is written block
by block after it, padded to the file's alignment as `GGUFWriter.write_tensor_data` does. So memory holds one block
of one tensor (`stream.BLOCK_ELEMENTS`), or one whole q/k projection where llama.cpp's row permutation needs it.

The file is written under a hidden name beside the target and renamed when complete (`os.replace`): a full disk or
a kill leaves no file under the final name.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lowmem_ft.errors import UserError
from lowmem_ft.export import text_decoder
from lowmem_ft.export.families import GgufFamily, family_of, head_dim, rope_theta
from lowmem_ft.export.stream import Adapter, TensorRef, merged_blocks, tensors

if TYPE_CHECKING:
    import numpy as np

# --quant → (GGML type of matrices, GGUF general.file_type): gguf.LlamaFileType
QUANTS = {"f16": ("F16", 1), "bf16": ("BF16", 32), "q8_0": ("Q8_0", 7)}


@dataclass(frozen=True)
class Planned:
    """One tensor of the output: its source, GGUF name and type."""

    ref: TensorRef
    gguf_name: str
    qtype: str  # gguf.GGMLQuantizationType name
    nbytes: int


def tensor_qtype(shape: tuple[int, ...], quant: str) -> str:
    import gguf

    if len(shape) < 2:
        return "F32"
    wanted = QUANTS[quant][0]
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[wanted]][0]
    return wanted if shape[-1] % block == 0 else "F16"


def nbytes(shape: tuple[int, ...], qtype: str) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    count = math.prod(shape) if shape else 1
    return count // block * size


def model_config(model_dir: Path):
    """The transformers config of the model whose shards are exported: its own, for a checkpoint of its own layout
    (Qwen v1) the native architecture's (`lowmem_ft.native`), which the tensors are exported as, and for a
    vision-language checkpoint its text decoder's (`text_config`, `text_decoder`)."""
    from transformers import AutoConfig

    from lowmem_ft import native

    conversion = native.checkpoint_conversion(str(model_dir))
    if conversion is not None:
        return native.transformers_config(str(model_dir), conversion)
    decoder = text_decoder.of(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    return decoder.text_config(config) if decoder is not None else config


def plan_tensors(model_dir: Path, config, quant: str) -> list[Planned]:
    """Every tensor the GGUF will hold, named and typed, from the safetensors headers (no weight read)."""
    import gguf

    family = family_of(config)
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == family.arch)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    out = []
    for ref in tensors(model_dir):
        if tied and ref.name == "lm_head.weight":
            continue
        if ref.name.endswith("rotary_emb.inv_freq"):
            continue
        stem, _, suffix = ref.name.rpartition(".")
        mapped = names.get_name(stem)
        if mapped is None:
            raise UserError(f"{model_dir}: tensor {ref.name} has no GGUF name for {family.arch} in the gguf package")
        qtype = tensor_qtype(ref.shape, quant)
        out.append(Planned(ref, f"{mapped}.{suffix}", qtype, nbytes(ref.shape, qtype)))
    return out


def rope_factors(config) -> np.ndarray | None:
    """Llama-3.x RoPE scaling as llama.cpp stores it, `rope_freqs.weight` (`LlamaModel.generate_extra_tensors`)."""
    import numpy as np  # here, not at import: every command's parser imports this module (QUANTS)

    scaling = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return None
    base = scaling.get("rope_theta") or getattr(config, "rope_theta", 10000.0)
    dim = head_dim(config)
    factor = scaling.get("factor", 8.0)
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old = scaling.get("original_max_position_embeddings", 8192)
    out = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _encode(block, qtype: str) -> np.ndarray:
    import gguf
    import numpy as np

    array = block.numpy() if hasattr(block, "numpy") else block
    array = np.ascontiguousarray(array, dtype=np.float32)
    if qtype == "F32":
        return array
    if qtype == "F16":
        return array.astype(np.float16)
    return gguf.quants.quantize(array, gguf.GGMLQuantizationType[qtype])


def _metadata(writer, config, family: GgufFamily, name: str, quant: str) -> None:
    writer.add_name(name)
    writer.add_type("model")
    writer.add_file_type(QUANTS[quant][1])
    writer.add_quantization_version(2)  # gguf.GGML_QUANT_VERSION
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    theta = rope_theta(config)  # the global layers' (Gemma-3 gives its sliding ones another: families._gemma3)
    if theta:
        writer.add_rope_freq_base(theta)
    writer.add_vocab_size(config.vocab_size)
    family.extra_keys(writer, config)


def write_gguf(
    model_dir: Path,
    adapter_dir: Path | None,
    tokenizer_dir: Path,
    output: Path,
    quant: str,
    name: str,
    progress: Callable[[int, int], None] | None = None,
) -> list[Planned]:
    """Write the merged model as one GGUF file at `output` (atomically: module docstring); returns its tensors."""
    import gguf
    import numpy as np

    config = model_config(model_dir)
    family = family_of(config)
    planned = plan_tensors(model_dir, config, quant)
    decoder = text_decoder.of(model_dir)
    rename = decoder.name if decoder is not None else None
    adapter = Adapter(adapter_dir, rename) if adapter_dir is not None else None
    if adapter is not None:
        known = {p.ref.name for p in planned} | {"lm_head.weight"}
        missing = [n for n in [*adapter.loras, *adapter.replaced] if n not in known]
        if missing:
            raise UserError(f"adapter {adapter_dir} does not fit base {model_dir}: it has no tensor {missing[0]}")
    rope = rope_factors(config)

    staged = output.parent / f".{output.name}.partial-{os.getpid()}"
    writer = gguf.GGUFWriter(None, family.arch)
    try:
        from lowmem_ft.export.vocab import general_name, write_vocab

        tokens = write_vocab(writer, tokenizer_dir, config.vocab_size)
        # llama.cpp reads Mistral as a Llama; transformers' loader tells them apart by this name (families.py)
        name = general_name(f"{family.name} {name}" if family.name == "mistral" else name, tokens)
        _metadata(writer, config, family, name, quant)
        for p in planned:
            qtype = gguf.GGMLQuantizationType[p.qtype]
            shape = gguf.quant_shape_to_byte_shape(p.ref.shape, qtype) if p.qtype not in ("F32", "F16") else p.ref.shape
            dtype = {"F32": np.float32, "F16": np.float16}.get(p.qtype, np.uint8)
            writer.add_tensor_info(p.gguf_name, shape, np.dtype(dtype), p.nbytes,
                                   raw_dtype=None if p.qtype in ("F32", "F16") else qtype)  # fmt: skip
        if rope is not None:
            writer.add_tensor_info("rope_freqs.weight", rope.shape, rope.dtype, rope.nbytes)
        writer.write_header_to_file(staged)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]
        for done, p in enumerate(planned):
            writer.write_padding(fout, fout.tell())
            transform = family.transform(p.ref.name, config)
            offset = family.offset(p.ref.name)
            written = 0
            for block in merged_blocks(p.ref, adapter, whole=transform is not None):
                if transform is not None:
                    block = transform(block)
                if offset:
                    block = block + offset
                data = _encode(block, p.qtype)
                data.tofile(fout)
                written += data.nbytes
            assert written == p.nbytes, f"{p.gguf_name}: wrote {written} bytes, planned {p.nbytes}"
            writer.write_padding(fout, written)
            if progress is not None:
                progress(done + 1, len(planned))
        if rope is not None:
            writer.write_padding(fout, fout.tell())
            rope.tofile(fout)
            writer.write_padding(fout, rope.nbytes)
        fout.flush()
        os.fsync(fout.fileno())
        writer.close()
        os.replace(staged, output)
    except BaseException:
        writer.close()
        staged.unlink(missing_ok=True)
        raise
    return planned


def clear_dead_partials(output: Path) -> None:
    """Remove `.NAME.partial-PID` files that exports to `output` killed on the way left behind (and a K-quant's
    f16 file, `.NAME.partial-f16-PID`, with its own staged name)."""
    from lowmem_ft.merging import process_alive

    for staged in [*output.parent.glob(f".{output.name}.partial-*"), *output.parent.glob(f"..{output.name}.partial-*")]:
        pid = staged.name.rpartition("-")[2]
        if pid.isdigit() and not process_alive(int(pid)):
            staged.unlink(missing_ok=True)
