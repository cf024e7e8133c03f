"""Images in the data: vision-language fine-tuning.

- `families`: one record per vision-language family lowmem-ft trains on images, naming its processor arithmetic, and
  the one line that refuses any other VLM by its family.
- `qwen_vl`, `gemma3`, `idefics3`, `llava`, `llava_onevision`: each family's processor as numbers (tokens per
  image, the text a placeholder expands to, the resolution caps) and its call into the checkpoint's image processor.
- `images`: opening the images a row names (relative to the data file) and each way one can be bad, as one line
  naming the row.
- `data`: TRL-style `messages` with `{"type": "image"}` parts plus an `images` column → token ids with the image
  placeholders expanded, labels on the assistant's text only, and the collator that turns images into pixels.
- `setup`: a run's vision side (family, arithmetic, resolution cap and why), which `plan`, `train` and `data` share;
  `generate`: `generate --image`.

`families` and the family modules are pure arithmetic (no torch, no transformers, no PIL) but for the processor
call: the memory model and `plan` read them.
"""
