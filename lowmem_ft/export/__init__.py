"""Shipping a fine-tune as one GGUF file (llama.cpp, Ollama, LM Studio), merged on the way without loading the model.

- `families`: one record per model family — GGUF architecture, llama.cpp's tensor transforms, its metadata keys.
- `stream`: the base's tensors merged with the LoRA adapter block by block (peft's formulas, no model in memory).
- `vocab`: the tokenizer (byte-level or SentencePiece-style BPE), special tokens and chat template as GGUF metadata.
- `gguf_file`: the file itself, through the `gguf` package, written under a hidden name and renamed when complete.
- `plan`: host memory and disk predicted before any weight is read; a one-line refusal when they do not fit.
- `ollama`: the Modelfile beside the file.

`lowmem_ft.commands.export` is the command over these.
"""
