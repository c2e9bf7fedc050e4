"""[memory_estimation]: ``estimation.py``'s simulated job."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torchtitan.config.options import opt


@dataclass
class MemoryEstimation:
    """Read by estimation.py only; train.py ignores this section."""

    world_size: int = opt(8, "estimation.py: number of ranks to simulate", gt=0)
    optimizers: str = opt(
        "AdamW,AdamMini,AdamMini:state_dtype=bfloat16,AdamMini8bit,AdamMini4bit,AdamW4bit,Muon",
        "estimation.py: comma-separated optimizers to estimate, each NAME or NAME:option=value[:option=value] "
        "with [optimizer] options (AdamMini:state_dtype=bfloat16)",
    )
    device: str = opt(
        "cuda",
        "estimation.py: training to simulate: cuda (mixed precision, as train.py on a GPU) or cpu (param_dtype "
        "throughout)",
        choices=("cuda", "cpu"),
    )
    vocab_size: int = opt(
        0,
        "estimation.py: vocabulary size; 0 takes the tokenizer's, or the flavor's when the tokenizer file is absent",
        ge=0,
    )
    device_memory_gib: float = opt(
        0.0,
        "estimation.py: the GPU's memory in GiB, where the caching allocator frees cached blocks before it reports "
        "out of memory (0: no limit, the reserved memory a roomy GPU would show)",
        ge=0,
    )
    json: Optional[str] = opt(
        None, "estimation.py: also write the estimate as JSON to this file ('-': JSON only, to stdout)"
    )
