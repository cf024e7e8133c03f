"""Images in the data: vision-language fine-tuning.

- `families`: one record per vision-language family lowmem-ft trains (the processor's image-token arithmetic, the
  config keys of its image tokens), and the one line that refuses any other VLM by its family.
- `images`: opening the images a row names (relative to the data file) and each way one can be bad, as one line
  naming the row.
- `data`: TRL-style `messages` with `{"type": "image"}` parts plus an `images` column → token ids with the image
  placeholders expanded, labels on the assistant's text only, and the collator that turns images into pixels.

`families` is pure arithmetic (no torch, no transformers, no PIL): the memory model and `plan` read it.
"""
