"""verl with lossscale: FP16 training on verl's FSDP engines, the scaler set from verl's Hydra config.

    pip install lossscale verl==0.9.1          # and verl's GPU stack (vllm or sglang for RL rollouts)
    torchrun --standalone --nproc_per_node=2 examples/verl_fp16.py      # a short demo on GPUs

What to copy:

* ``FP16ActorRolloutRefWorker``: verl's PPO/GRPO actor worker, its engine attached after
  ``init_model()``. verl's PPO trainers put ``ActorRolloutRefWorker`` in ``role_worker_mapping`` in
  code (verl/trainer/ppo/v1/trainer_base.py:805; the legacy main_ppo_v0.py, ``add_actor_rollout_worker``):
  map the role to this class in a subclass of yours, and run verl's ``main_ppo`` with it.
* ``FP16SFTTrainer``: verl's SFT trainer (verl/trainer/sft_trainer.py), its engine attached once built.
* The keys. FP16 itself is verl's: the engine's ``mixed_precision.param_dtype=fp16``. lossscale's
  keywords go under a ``lossscale`` node that verl does not read (verl's typed configs refuse keys
  they do not know, so it sits beside them, added with Hydra's ``+``)::

      python my_main_ppo.py ... \\
        actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp16 \\
        +actor_rollout_ref.lossscale.init_scale=65536 \\
        +actor_rollout_ref.lossscale.growth_interval=400 \\
        +actor_rollout_ref.lossscale.on_stuck=warn

  For the SFT trainer the node is top-level: ``+lossscale.growth_interval=1000``, with
  ``engine.mixed_precision.param_dtype=fp16``. Any ``lossscale.GradScaler`` keyword works there.

The demo (``main``) trains verl's own step (``TrainingWorker.train_batch``, the SFT trainer's) on a
2-layer Qwen2 built from a config, with the scaler's keywords parsed from Hydra-style overrides. Step
``overflow_at`` multiplies the loss so that its backward overflows FP16: the step is skipped on every
rank, the LR held, the scale halved, and the ``scaler/*`` metrics verl returns say so. Then the
worker saves a checkpoint, a new worker loads it, and the scaler continues where it was.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from lossscale.integrations import verl as ls_verl


def scaler_kwargs(config) -> dict:
    """The ``lossscale`` node of a verl (Hydra) config as ``attach`` keywords; {} when there is none."""
    node = config.get("lossscale") if config is not None else None
    return {} if node is None else OmegaConf.to_container(node, resolve=True)


def _worker_classes():
    # verl is imported here, not at the top: its device platform is chosen when verl first asks for it.
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.trainer.sft_trainer import SFTTrainer
    from verl.workers.engine_workers import ActorRolloutRefWorker

    class FP16ActorRolloutRefWorker(ActorRolloutRefWorker):
        """verl's actor/rollout/ref worker whose actor engine trains FP16 with lossscale."""

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # verl dispatches a worker's methods by this mark
        def init_model(self):
            super().init_model()
            if self.actor is not None:  # a rollout-only or ref-only worker trains nothing
                ls_verl.attach(self.actor.engine, **scaler_kwargs(self.config))

    class FP16SFTTrainer(SFTTrainer):
        """verl's SFT trainer whose engine trains FP16 with lossscale."""

        def _init_engine(self):
            super()._init_engine()  # builds the engine (training_client.reset())
            ls_verl.attach(self.engine, **scaler_kwargs(self.config))

    return FP16ActorRolloutRefWorker, FP16SFTTrainer


def __getattr__(name: str):
    if name in ("FP16ActorRolloutRefWorker", "FP16SFTTrainer"):
        actor, sft = _worker_classes()
        return actor if name == "FP16ActorRolloutRefWorker" else sft
    raise AttributeError(name)


# ------------------------------------------------------------------------------------------ the demo
def tiny_qwen2(path: str) -> str:
    """A 2-layer Qwen2 built from a config and saved where verl loads models from (nothing downloaded)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def training_worker(model_dir: str, attn_implementation: str = "sdpa"):
    """verl's TrainingWorker (the SFT trainer's) with an fp16 FSDP2 engine, built."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.config.engine import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import sft_loss

    model = HFModelConfig(path=model_dir, load_tokenizer=False, use_remove_padding=False,
                          override_config={"attn_implementation": attn_implementation})
    engine = FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False,
                              mixed_precision={"param_dtype": "fp16", "reduce_dtype": "fp32", "buffer_dtype": "fp32"})
    optim = FSDPOptimizerConfig(lr=1e-3, lr_warmup_steps=10, total_training_steps=100)
    worker = TrainingWorker(config=TrainingWorkerConfig(model_type="language_model", model_config=model,
                                                        engine_config=engine, optimizer_config=optim,
                                                        checkpoint_config=CheckpointConfig()))
    loss = _TimesLoss(sft_loss)
    worker.set_loss_fn(loss)
    worker.reset()
    return worker, loss


class _TimesLoss:
    """verl's SFT loss times ``factor`` (the demo's overflow)."""

    def __init__(self, loss_fn):
        self.loss_fn, self.factor = loss_fn, 1.0

    def __call__(self, model_output, data, dp_group=None):
        loss, metrics = self.loss_fn(None, model_output, data, dp_group)
        return loss * self.factor, metrics


def batch(step: int, world: int, rank: int):
    """Two random sequences per rank, in the layout verl's SFT trainer builds (nested, no padding)."""
    from tensordict.tensorclass import NonTensorData
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    g = torch.Generator().manual_seed(1000 * step + rank)
    lens = [6, 8]
    nested = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    data = tu.get_tensordict(
        tensor_dict={"input_ids": nested([torch.randint(1, 64, (n,), generator=g) for n in lens]),
                     "position_ids": nested([torch.arange(n) for n in lens]),
                     "loss_mask": nested([torch.ones(n, dtype=torch.long) for n in lens])},
        non_tensor_dict=dict(use_remove_padding=False, use_dynamic_bsz=False, max_token_len_per_gpu=64,
                             micro_batch_size_per_gpu=len(lens), temperature=1.0, global_batch_size=len(lens) * world,
                             pad_mode=DatasetPadMode.NO_PADDING, pad_token_id=0))
    tu.assign_non_tensor(data, update_lr_scheduler=True, global_token_num=NonTensorData(lens * world))
    return data


def main(model_dir: str, checkpoint_dir: str, overrides=("lossscale.init_scale=1024",), steps: int = 4,
         overflow_at: int = 2, attn_implementation: str = "sdpa", log=print):
    """Train ``steps`` steps (the loss times 1e3 at ``overflow_at``), save, resume in a new worker.
    Returns the ``scaler/*`` and ``lr`` metrics verl returned at each step, and the resumed scaler's
    state beside the saved one. Run on every rank of an initialised process group."""
    config = OmegaConf.from_dotlist(list(overrides))  # what Hydra makes of +lossscale.<key>=<value>
    rank, world = dist.get_rank(), dist.get_world_size()
    worker, loss = training_worker(model_dir, attn_implementation)
    scaler = ls_verl.attach(worker.engine, **scaler_kwargs(config))
    records = []
    for step in range(steps):
        loss.factor = 1e3 if step == overflow_at else 1.0
        metrics = worker.train_batch(batch(step, world, rank))["metrics"]
        records.append({k: v for k, v in metrics.items() if k.startswith("scaler/") or k == "lr"})
        if rank == 0:
            log(f"step {step}: scale {metrics['scaler/loss_scale']}, skipped {metrics['scaler/last_step_skipped']}, "
                f"lr {metrics['lr']:.2e}")
    worker.save_checkpoint(checkpoint_dir, global_step=steps)
    resumed, _ = training_worker(model_dir, attn_implementation)
    resumed_scaler = ls_verl.attach(resumed.engine, **scaler_kwargs(config))
    resumed.load_checkpoint(checkpoint_dir)
    if rank == 0:
        log(f"resumed: scale {resumed_scaler.get_scale()}; {scaler.health().text}")
    return {"records": records, "saved": scaler.state_dict(), "resumed": resumed_scaler.state_dict()}


if __name__ == "__main__":
    for key, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29512").items():
        os.environ.setdefault(key, value)  # one process without a launcher; torchrun sets them all
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    shared = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]  # one directory for every rank (one machine)
    dist.broadcast_object_list(shared, src=0)
    path = os.path.join(shared[0], "qwen2-tiny")
    if dist.get_rank() == 0:
        tiny_qwen2(path)
    dist.barrier()
    main(path, os.path.join(shared[0], "checkpoint"))
    dist.destroy_process_group()
