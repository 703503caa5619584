"""FP16 training with torchtitan: torchtitan's own entry point (torchtitan/train.py), two lines added.

Run it where you run torchtitan (its checkout, for the debug model's tokenizer and dataset in
tests/assets), with torchtitan's usual arguments, one GPU per rank::

    torchrun --nproc_per_node=8 examples/torchtitan_fp16.py --module llama3 --config llama3_debugmodel

torchtitan's command line offers bfloat16 and float32 only: FP16 is set here, in Python. Without a
loss scaler FP16 training writes the first overflow into the weights; ``attach`` scales the loss,
skips overflow steps (the learning rate held), saves the scaler in torchtitan's checkpoints and logs
its figures with torchtitan's (``scaler/loss_scale``, ``scaler/skipped_steps``, ...). A batch whose
loss is not finite is skipped instead of stopping the run; ten in a row stop it. Tested with
torchtitan 0.3.0: see docs/how-to/torchtitan.md.
"""

import torch
from torchtitan.config import ConfigManager
from torchtitan.tools.logging import init_logger, logger

import lossscale.integrations.torchtitan as ls_torchtitan


def main() -> None:
    init_logger()
    config = ConfigManager().parse_args()
    config.training.mixed_precision_param = "float16"  # FSDP2 computes in FP16 (bf16 needs no scaler)
    trainer = config.build()
    scaler = ls_torchtitan.attach(trainer)  # before train(): a resumed run restores the scaler too
    try:
        trainer.train()
    finally:
        trainer.close()
    report = scaler.health()  # which skips were the scale calibrating, which were bad batches
    if torch.distributed.get_rank() == 0:
        logger.info(report.text)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
