"""[optimizer]: every optimizer's options (read, checked and resolved by ``torchtitan.optim.settings``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torchtitan.config.options import opt


@dataclass
class Optimizer:
    name: str = opt(
        "AdamW",
        "optimizer: AdamW, Adam, AdamMini, AdamMini8bit, AdamMini4bit, AdamW8bit, AdamW4bit, "
        "AdamWFp8, Muon, NorMuon, AdEMAMix, SOAP (case-insensitive)",
    )
    # Read, checked and resolved in one pass by torchtitan.optim.settings (lr, betas, eps, weight_decay: torch.optim's
    # rules; which optimizer takes which option: its TAKES table).
    lr: float = opt(8e-4, "peak learning rate")
    beta1: float = opt(0.9, "first-moment decay")
    beta2: float = opt(0.95, "second-moment decay")
    eps: float = opt(1e-8, "denominator epsilon")
    weight_decay: float = opt(0.1, "decoupled weight decay (not applied to norms and biases by AdamMini)")
    implementation: Optional[str] = opt(
        None,
        "for-loop, foreach or fused where the optimizer has them (AdamMini: foreach or fused, the default); "
        "unset picks the optimizer's default",
        choices=("for-loop", "foreach", "fused"),
    )
    state_dtype: Optional[str] = opt(
        None,
        "AdamW, Adam: dtype of both moments; AdamMini: dtype of its first moment; Muon, NorMuon: their momentum and "
        "their AdamW part's moments; AdEMAMix: its three moments (unset: float32, also for bfloat16 weights; "
        "bfloat16 is stochastically rounded)",
        choices=("float32", "bfloat16"),
    )
    # AdamMini only.
    value_blocks: Optional[str] = opt(
        None,
        "AdamMini: second moment of value weights per output row (per_row) or per tensor (per_tensor)",
        choices=("per_row", "per_tensor"),
    )
    embedding_blocks: Optional[str] = opt(
        None,
        "AdamMini: second moment of the embedding per token (per_row, adam-mini 1.1.1's) or per element (per_element, "
        "Adam's, as Adam-mini's first release); unset: per_row",
        choices=("per_row", "per_element"),
    )
    output_blocks: Optional[str] = opt(
        None,
        "AdamMini: second moment of the output projection per token (per_row) or per element (per_element); unset: "
        "per_row",
        choices=("per_row", "per_element"),
    )
    attn_out_blocks: Optional[str] = opt(
        None,
        "AdamMini: second moment of attention output weights per output neuron (per_row, 1.1.1's) or one for the "
        "whole matrix (per_tensor, the first release's); unset: per_row",
        choices=("per_row", "per_tensor"),
    )
    mlp_blocks: Optional[str] = opt(
        None,
        "AdamMini: second moment of MLP weights per output neuron (per_row) or one for the whole matrix "
        "(per_tensor); unset: per_row",
        choices=("per_row", "per_tensor"),
    )
    norm_weight_decay: Optional[bool] = opt(
        None, "AdamMini: decay the norms' scales too (unset: false, as adam-mini 1.1.1: neither norms nor biases)"
    )
    # torchao low-bit optimizers only.
    block_size: Optional[int] = opt(None, "low-bit AdamW and AdamMini: quantization block size", gt=0)
    bf16_stochastic_round: Optional[bool] = opt(
        None, "low-bit AdamW: stochastic rounding of the updated weights (needs training.param_dtype bfloat16)"
    )
    # Muon and NorMuon only (their AdamW part takes lr, beta1, beta2, eps, weight_decay, implementation and
    # state_dtype).
    momentum: Optional[float] = opt(
        None, "Muon, NorMuon: momentum of the hidden matrices (unset: 0.95)", ge=0.0, lt=1.0
    )
    nesterov: Optional[bool] = opt(None, "Muon, NorMuon: Nesterov momentum (unset: true)")
    ns_steps: Optional[int] = opt(None, "Muon, NorMuon: Newton-Schulz iterations (unset: 5)", gt=0, lt=100)
    ns_dtype: Optional[str] = opt(
        None,
        "Muon, NorMuon: dtype of the Newton-Schulz iteration (unset: bfloat16, as torch.optim.Muon)",
        choices=("bfloat16", "float32", "float64"),
    )
    adjust_lr: Optional[str] = opt(
        None,
        "Muon, NorMuon: lr scale of a matrix update: match_rms_adamw (0.2 sqrt(max dim): optimizer.lr means what it "
        "means for AdamW) or original (sqrt(max(1, rows/cols))); unset: match_rms_adamw",
        choices=("match_rms_adamw", "original"),
    )
    # NorMuon only.
    neuron_beta2: Optional[float] = opt(
        None,
        "NorMuon: decay of the per-row (neuron-wise) second moment of the orthogonalised update (unset: 0.95)",
        ge=0.0,
        lt=1.0,
    )
    neuron_eps: Optional[float] = opt(
        None, "NorMuon: added to the root of the per-row second moment before dividing (unset: 1e-8)", ge=0.0
    )
    normuon_step_size: Optional[str] = opt(
        None,
        "NorMuon: reference (the reference code's: Muon's lr scale times ||O||_F / ||N||_F) or rms (the paper's: "
        "0.2 lr sqrt(rows cols) / ||N||_F, an update RMS of exactly 0.2 lr); unset: reference",
        choices=("reference", "rms"),
    )
    # AdEMAMix only (optimizer.beta1 and beta2 are its fast momentum's and second moment's decays).
    ademamix_alpha: Optional[float] = opt(
        None,
        "AdEMAMix: weight of the slow momentum in the update, reached at the end of its warm-up (unset: 5)",
        ge=0.0,
    )
    ademamix_beta3: Optional[float] = opt(
        None,
        "AdEMAMix: decay of the slow momentum, reached at the end of its warm-up (unset: 0.9999)",
        gt=0.0,
        lt=1.0,
    )
    ademamix_warmup_steps: Optional[int] = opt(
        None,
        "AdEMAMix: steps over which alpha rises linearly from 0 and beta3 from beta1 (the paper's schedules); 0: "
        "none; unset: training.steps, as the paper",
        ge=0,
    )
    # SOAP only (Adam in the eigenbasis of Shampoo's preconditioner: beta1, beta2 and eps are its Adam's, and its
    # AdamW part's with weight_decay and implementation).
    precondition_frequency: Optional[int] = opt(
        None, "SOAP: refresh the eigenbases after every this many updates (unset: 10)", gt=0
    )
    max_precondition_dim: Optional[int] = opt(
        None,
        "SOAP: a matrix side longer than this is not rotated (no statistic or basis kept for it; unset: 10000)",
        gt=0,
    )
    shampoo_beta: Optional[float] = opt(
        None, "SOAP: decay of Shampoo's statistics G G^T and G^T G (unset: beta2)", ge=0.0, lt=1.0
    )
