"""Evaluating a fine-tune with lm-eval: the adapter on its base as trained (no merge), optionally the base too.

- `batch`: the batch size from the memory model (the eval forward's activations, its KV cache and the logits
  lm-eval's log-softmax holds) within a device budget — planned, not found by running into OOM as lm-eval's
  `batch_size="auto"` does.
- `tasks`: task names or local task YAML files resolved through lm-eval's `TaskManager`, an unknown name in one line;
  a task file's relative `data_files` read against the file's directory.
- `scores`: `simple_evaluate` on the loaded model, the metrics per task, the deltas against the base.
- `trackers`: the scores to the training run's trackers (its W&B run resumed, TensorBoard, trackio).

`lowmem_ft.commands.eval` is the command over these.
"""
