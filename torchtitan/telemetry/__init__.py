"""What a run reports.

- ``metrics``: the per-step log line, TensorBoard, ``metrics.jsonl`` and Weights & Biases.
- ``health``: optimizer health per group of weights, the largest attention logit, loss spikes.
- ``step_timing``: where a step's time goes (data, forward and backward, optimizer, checkpoint).
- ``profiling``: torch profiler traces and CUDA memory snapshots.
"""
