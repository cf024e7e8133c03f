"""Host memory of a GGUF export, measured, beside the export plan's prediction and the 16-bit merge it replaces.

    nice -n 10 python -m devkit.bench.export_memory --out benchmarks/export_memory.md

A Llama-shaped model of a few hundred million parameters (random bf16 weights, `--hidden`, `--layers`, `--vocab`)
with a random LoRA adapter (rank 16 on every linear) is written to a temporary directory; then, each in a fresh
process, (a) `lowmem_ft.export.gguf_file.write_gguf` for each --quant (a K-quant: the f16 file, then llama.cpp's
quantizer through `lowmem_ft.export.llama_quant`, in the same process) and (b) what `lowmem-ft merge` does on the CPU:
the base loaded in bf16, peft's adapter, `merge_and_unload`. Measured on the CPU: the growth of the process's
anonymous resident memory (RssAnon, /proc/self/status, sampled every 2 ms) and of its file-backed resident pages
(RssFile: the memory-mapped shards, reclaimable) over their values just before the work, after the imports.
Predicted: `ExportPlan.host` (which counts the largest tensor's mapped pages in).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, threading, time
from pathlib import Path
import torch, gguf
from transformers import AutoConfig, AutoTokenizer  # noqa: F401 (imported before the baseline)
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
peak = {"RssAnon:": 0, "RssFile:": 0}
stop = []
def sample():
    while not stop:
        for key in peak:
            peak[key] = max(peak[key], status(key))
        time.sleep(0.002)
args = json.loads(sys.argv[1])
base, adapter, out = Path(args["base"]), Path(args["adapter"]), Path(args["out"])
if args["what"] == "merge":
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    before = {key: status(key) for key in peak}
    sampler = threading.Thread(target=sample); sampler.start()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload(safe_merge=True)
elif args["what"] in ("f16", "bf16", "q8_0"):
    from lowmem_ft.export.gguf_file import write_gguf
    before = {key: status(key) for key in peak}
    sampler = threading.Thread(target=sample); sampler.start()
    write_gguf(base, adapter, base, out, args["what"], "bench")
else:  # a K-quant: the f16 file, then llama.cpp's quantizer in this process (llama-cpp-python)
    import llama_cpp  # noqa: F401 (its library loaded before the baseline)
    from lowmem_ft.export.gguf_file import write_gguf
    from lowmem_ft.export.llama_quant import write_quantized
    before = {key: status(key) for key in peak}
    sampler = threading.Thread(target=sample); sampler.start()
    write_quantized(lambda f16: write_gguf(base, adapter, base, f16, "f16", "bench"), out, args["what"])
stop.append(1); sampler.join()
print(json.dumps({"anon": peak["RssAnon:"] - before["RssAnon:"], "file": peak["RssFile:"] - before["RssFile:"]}))
"""


def build(root: Path, hidden: int, layers: int, vocab: int) -> tuple[Path, Path, int]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    from devkit.tiny import build_tiny_model

    tokenizer_dir = build_tiny_model(root / "tok")  # any tokenizer: the bench measures weights, not text
    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                         num_attention_heads=hidden // 128, num_key_value_heads=hidden // 512, vocab_size=vocab,
                         tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    base = root / "base"
    model.save_pretrained(base)
    for f in tokenizer_dir.iterdir():
        if "token" in f.name or f.suffix == ".jinja":
            (base / f.name).write_bytes(f.read_bytes())
    params = sum(p.numel() for p in model.parameters())
    lora = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False))
    lora.save_pretrained(root / "adapter")
    return base, root / "adapter", params


def measure(what: str, base: Path, adapter: Path, out: Path) -> dict:
    arg = json.dumps({"what": what, "base": str(base), "adapter": str(adapter), "out": str(out)})
    done = subprocess.run([sys.executable, "-c", CHILD, arg], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--quants", default="f16,q8_0,q4_k_m")  # q4_k_m needs llama-cpp-python
    parser.add_argument("--out", default="benchmarks/export_memory.md")
    args = parser.parse_args(argv)

    from transformers import AutoConfig

    from lowmem_ft.export.gguf_file import plan_tensors
    from lowmem_ft.export.llama_quant import LLAMA_QUANTS
    from lowmem_ft.export.llama_quant import make_plan as llama_quant_plan
    from lowmem_ft.export.plan import make_plan
    from lowmem_ft.memory.inference import human

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base, adapter, params = build(root, args.hidden, args.layers, args.vocab)
        config = AutoConfig.from_pretrained(base)
        adapter_bytes = (adapter / "adapter_model.safetensors").stat().st_size
        rows = []
        for quant in args.quants.split(","):
            if quant in LLAMA_QUANTS:  # planned as the command plans it: the f16 merge, then llama.cpp
                plan = llama_quant_plan(plan_tensors(base, config, "f16"), quant, adapter_bytes, config)
            else:
                plan = make_plan(plan_tensors(base, config, quant), quant, adapter_bytes, config)
            got = measure(quant, base, adapter, root / f"{quant}.gguf")
            rows.append((f"export --quant {quant}", human(plan.host), human(got["anon"]), human(got["file"])))
        got = measure("merge", base, adapter, root / "merged")
        rows.append(("16-bit merge (what `merge` does on the CPU)", f"{human(params * 2)} weights + adapter + step",
                     human(got["anon"]), human(got["file"])))  # fmt: skip
    lines = [
        "# GGUF export: host memory measured against the plan",
        "",
        f"Generated by `python -m devkit.bench.export_memory` (module docstring: how). Model: Llama-shaped, hidden "
        f"{args.hidden}, {args.layers} layers, vocabulary {args.vocab}: {params:,} parameters "
        f"({human(params * 2)} in bf16); LoRA rank 16 on every linear ({human(adapter_bytes)}). CPU, peak growth "
        f"of a fresh process's anonymous and file-backed resident memory.",
        "",
        "| what | predicted host memory | measured anonymous peak | measured file-backed peak |",
        "|------|-----------------------|-------------------------|---------------------------|",
        *[f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows],
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
