"""The Megatron-Bridge training config the finetune runs share (tests/integration/bridge/bridge_finetune_worker.py
on the CPU, benchmarks/bridge_finetune_run.py on the GPU): one phase of Bridge's `pretrain()` or
`finetune()` on mock data, a `torch_dist` checkpoint per phase, Adam with a cosine schedule.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class Phase:
    """One run: `train_iters` steps, loading the checkpoint `load` and saving to `save` (folder
    names under the run's directory, or None); a finetune phase also starts from `pretrained`."""

    train_iters: int
    load: Optional[str] = None
    save: Optional[str] = None
    finetuning: bool = True


@dataclass(frozen=True)
class Schedule:
    """The optimizer side: peak and floor learning rates, warm-up steps (finetune phases only),
    decay steps, batch sizes, whether the optimizer (and DDP) is Megatron's distributed one."""

    lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    global_batch_size: int
    micro_batch_size: int
    distributed_optimizer: bool


def finetune_config(provider, phase: Phase, schedule: Schedule, out: Path, *, peft=None,
                    distributed_backend: Optional[str] = None):
    """Bridge's ConfigContainer for `phase` of a run under `out`, the model from `provider`,
    `peft` (a Bridge PEFT, finetune phases only), `distributed_backend` ("gloo" on the CPU)."""
    from megatron.bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        DistributedDataParallelConfig,
        DistributedInitConfig,
        LoggerConfig,
        MockGPTDatasetConfig,
        OptimizerConfig,
        RNGConfig,
        SchedulerConfig,
        TokenizerConfig,
        TrainingConfig,
        ValidationConfig,
    )

    dist = (DistributedInitConfig(distributed_backend=distributed_backend)
            if distributed_backend else DistributedInitConfig())
    return ConfigContainer(
        model=provider,
        train=TrainingConfig(train_iters=phase.train_iters,
                             global_batch_size=schedule.global_batch_size,
                             micro_batch_size=schedule.micro_batch_size),
        validation=ValidationConfig(eval_interval=10_000, eval_iters=0),
        optimizer=OptimizerConfig(optimizer="adam", lr=schedule.lr, min_lr=schedule.min_lr,
                                  weight_decay=0.01, clip_grad=1.0, adam_beta1=0.9,
                                  adam_beta2=0.95, adam_eps=1e-8,
                                  use_distributed_optimizer=schedule.distributed_optimizer),
        scheduler=SchedulerConfig(lr_decay_style="cosine",
                                  lr_warmup_iters=schedule.warmup_iters if phase.finetuning else 0,
                                  lr_warmup_init=0.0, lr_decay_iters=schedule.decay_iters,
                                  start_weight_decay=0.01, end_weight_decay=0.01,
                                  weight_decay_incr_style="constant",
                                  use_checkpoint_opt_param_scheduler=phase.load is not None),
        ddp=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=schedule.distributed_optimizer),
        dataset=MockGPTDatasetConfig(random_seed=1234, reset_attention_mask=False,
                                     reset_position_ids=False, eod_mask_loss=False,
                                     seq_length=provider.seq_length, num_dataset_builder_threads=1,
                                     data_sharding=True, dataloader_type="single", num_workers=1),
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=provider.vocab_size),
        checkpoint=CheckpointConfig(
            save_interval=phase.train_iters if phase.save else None,
            save=str(out / phase.save) if phase.save else None,
            load=str(out / phase.load) if phase.load else None,
            pretrained_checkpoint=str(out / "pretrained") if phase.finetuning else None,
            ckpt_format="torch_dist", fully_parallel_save=True, async_save=False,
            # The pretrain phase's checkpoint is only loaded as `pretrained_checkpoint` (weights).
            save_optim=phase.finetuning, save_rng=phase.finetuning),
        dist=dist,
        rng=RNGConfig(seed=1234),
        mixed_precision="bf16_mixed",
        peft=peft if phase.finetuning else None,
    )
