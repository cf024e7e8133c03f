"""`lowmem-ft generate RUN_DIR --prompt ...`: try a fine-tune — base + adapter, chat template, streamed tokens.

The output length is bounded by the VRAM budget: weights (counted from the loaded model) + safety margin +
prefill workspace + the KV cache, which grows by 2 × layers × kv_heads × head_dim × bytes per token
(`lowmem_ft.memory.inference`). Without a GPU and without --vram there is no device budget to bound it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lowmem_ft.commands import flags
from lowmem_ft.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="answer prompts with a fine-tuned run (base + adapter), streaming tokens",
        description="Load RUN_DIR's base model (stored as in training) and adapter, apply the chat template and "
        "stream the answer to --prompt; without --prompt, chat interactively (or read the prompt from stdin). "
        "--max-new-tokens is bounded by what the VRAM budget leaves for the KV cache.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by `lowmem-ft train` (runs/<name>)")
    p.add_argument("--prompt", help="the user message; omit to chat interactively")
    p.add_argument("--system", help="a system message before the prompt")
    p.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image before the prompt (repeatable); a vision-language run only, resized at the cap it trained at",
    )
    p.add_argument("--max-new-tokens", type=flags.count, default=256, metavar="N", help="longest answer (default 256)")
    p.add_argument(
        "--temperature",
        type=flags.ranged(float, ge=0),
        default=0.7,
        help="sampling temperature; 0 = greedy (default 0.7)",
    )
    p.add_argument(
        "--top-p",
        type=flags.ranged(float, gt=0, le=1),
        default=0.9,
        help="nucleus sampling mass, in (0, 1] (default 0.9)",
    )
    p.add_argument(
        "--repetition-penalty",
        type=flags.ranged(float, gt=0),
        default=1.0,
        help="above 0; > 1 discourages repeats, 1 leaves them alone (default 1.0)",
    )
    p.add_argument("--seed", type=flags.seed, help="seed for sampling, for repeatable answers")
    p.add_argument("--vram", type=flags.vram_gb, metavar="GB", help="GPU memory to fit in (default: the whole GPU)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="where to run (default auto)")
    p.add_argument("--base", metavar="PATH", help="the base model, if it is no longer where training found it")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as plain text")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow the base model's (or tokenizer's) own code; the run directory's recipe cannot turn this on",
    )
    p.set_defaults(func=run)


def _budget_bytes(args: argparse.Namespace, device: str) -> int | None:
    """The device budget in bytes: --vram, else the whole GPU; None on the CPU without --vram."""
    from lowmem_ft.memory.estimate import GB

    if args.vram is not None:
        return int(args.vram * GB)
    if device == "cuda":
        import torch

        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return None


def reserve_bytes(margin_gb: float) -> int:
    """What the planner keeps off a GPU, kept here too: the recipe's safety margin, this GPU's calibration (only ever
    added, `lowmem_ft.calibrated`; said on stderr) and the CUDA context."""
    from lowmem_ft import calibrated
    from lowmem_ft.memory.estimate import CUDA_CONTEXT_BYTES, GB

    added, said = calibrated.for_this_device()
    if said:
        print(f"note: {said}", file=sys.stderr)
    return int((margin_gb + added) * GB + CUDA_CONTEXT_BYTES)


class Generator:
    """A loaded fine-tune that answers message lists within a token budget."""

    def __init__(self, args: argparse.Namespace):
        from lowmem_ft.finetuned import (
            load_finetuned,
            load_tokenizer_of,
            open_run,
            resolve_device,
            weights_bytes,
        )
        from lowmem_ft.memory.arch import Architecture
        from lowmem_ft.train.model import torch_dtype

        self.args = args
        run = open_run(args.run_dir, base=args.base, trust_remote_code=args.trust_remote_code)
        device = resolve_device(args.device)
        self.tokenizer = load_tokenizer_of(run)
        self.model = load_finetuned(run, run.base_recipe(), device)
        self.model.eval()
        self.model.config.use_cache = True  # training switched the cache off; generation needs it
        self.budget = _budget_bytes(args, device)
        self.reserve = reserve_bytes(run.recipe.memory.safety_margin_gb)
        self.weights = weights_bytes(self.model)
        self.kv_bytes = torch_dtype(run.recipe.model.compute_dtype).itemsize
        self.arch = Architecture.from_config(self.model.config.to_dict(), name=run.base)
        self.use_template = bool(self.tokenizer.chat_template) and not args.no_chat_template
        self.images = None
        if args.image:
            from lowmem_ft.vision.generate import ImagePrompt

            self.images = ImagePrompt.of_run(run, self.tokenizer, args.image)
        if not self.tokenizer.chat_template and not args.no_chat_template:
            print("note: the tokenizer has no chat template; prompts are used as plain text", file=sys.stderr)
        if self.budget is None:
            print(
                f"note: no device budget on the CPU (no --vram): --max-new-tokens {args.max_new_tokens} as given",
                file=sys.stderr,
            )
        elif device == "cpu":
            print(
                f"note: running on the CPU; the --vram {args.vram:g} GB budget is applied as on a GPU", file=sys.stderr
            )

    def encode(self, messages: list[dict[str, Any]]):
        if self.images is not None:  # image chats: placeholders expanded, pixel values beside (lowmem_ft.vision)
            return self.images.encode(messages)
        if self.use_template:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = "\n".join(m["content"] for m in messages)
        return self.tokenizer(text, return_tensors="pt", add_special_tokens=not self.use_template)

    def max_new_tokens(self, prompt_tokens: int) -> int:
        """--max-new-tokens, bounded by what the budget leaves for the KV cache."""
        from lowmem_ft.memory.inference import plan_generation

        requested = self.args.max_new_tokens
        if self.budget is None:
            return requested
        plan = plan_generation(
            self.arch,
            budget_bytes=self.budget,
            weights_bytes=self.weights,
            reserve_bytes=self.reserve,
            prompt_tokens=prompt_tokens,
            requested_new_tokens=requested,
            bytes_per_value=self.kv_bytes,
        )
        if plan.max_new_tokens < 1:
            given = f"--vram {self.args.vram:g} GB" if self.args.vram is not None else "this GPU"
            raise UserError(
                f"{given} leaves no room to generate a {prompt_tokens}-token prompt's answer: {plan.describe()}; "
                "raise --vram or shorten the prompt"
            )
        if plan.bounded:
            print(
                f"note: --max-new-tokens {requested} bounded to {plan.max_new_tokens} by the budget: {plan.describe()}",
                file=sys.stderr,
            )
        return plan.max_new_tokens

    def reply(self, messages: list[dict[str, Any]]) -> str:
        """Stream the answer to stdout and return it."""
        import torch
        from transformers import TextStreamer

        inputs = self.encode(messages).to(self.model.device)
        prompt_tokens = inputs["input_ids"].shape[1]
        new_tokens = self.max_new_tokens(prompt_tokens)
        if self.args.seed is not None:
            torch.manual_seed(self.args.seed)
        sample = self.args.temperature > 0
        kwargs = dict(temperature=self.args.temperature, top_p=self.args.top_p) if sample else {}
        streamer = TextStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        with torch.inference_mode():
            output = self.model.generate(
                **inputs,
                max_new_tokens=new_tokens,
                do_sample=sample,
                repetition_penalty=self.args.repetition_penalty,
                pad_token_id=self.tokenizer.pad_token_id,
                streamer=streamer,
                **kwargs,
            )
        return self.tokenizer.decode(output[0, prompt_tokens:], skip_special_tokens=True)


def _start(args: argparse.Namespace) -> list[dict[str, str]]:
    return [{"role": "system", "content": args.system}] if args.system else []


def run(args: argparse.Namespace) -> int:
    prompt = args.prompt
    interactive = prompt is None and sys.stdin.isatty()
    if prompt is None and not interactive:
        prompt = sys.stdin.read().strip()
        if not prompt:
            raise UserError("no prompt: pass --prompt TEXT, pipe one on stdin, or run in a terminal to chat")
    generator = Generator(args)
    if not interactive:
        images = [{"type": "image"} for _ in args.image]
        content = [*images, {"type": "text", "text": prompt}] if images else prompt
        generator.reply([*_start(args), {"role": "user", "content": content}])
        return 0
    if args.image:
        raise UserError("--image takes --prompt (or a prompt on stdin): the chat mode is for text")
    print("chatting with the fine-tune; an empty line or Ctrl-D ends", file=sys.stderr)
    messages = _start(args)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        messages.append({"role": "assistant", "content": generator.reply(messages)})
    return 0
