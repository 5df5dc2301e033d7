"""verl's actor (and reference) workers, in-process or through Ray, behind one small interface.

Both launchers run the same verl class, ``ActorRolloutRefWorker`` (role "actor", and role "ref"
when a KL loss is asked for), built from the same OmegaConf config (``worker_config``):

- ``LocalWorkers``: in this process, world size 1 -- the CPU (gloo, through
  ``selfplay.train.compat``) or one GPU;
- ``RayWorkers``: a Ray worker group with FSDP2 over the given GPUs, on a local Ray or on an
  existing cluster (``ray_address``); the reference model is colocated with the actor.

The trainer only calls ``log_probs``, ``ref_log_probs``, ``loss``, ``update``, ``save`` and
``close``; each takes and returns CPU tensors in verl's padded layout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Any, Protocol

import torch

from selfplay.environ import scoped_env
from selfplay.train import lm_head
from selfplay.train.batch import from_nested, full_sequence_mask, to_tensordict
from selfplay.train.config import PACKED_SDPA, TrainConfig

log = logging.getLogger(__name__)


class Workers(Protocol):
    def log_probs(self, batch: dict[str, torch.Tensor], entropy: bool = False) -> dict: ...
    def ref_log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...
    def loss(self, batch: dict[str, torch.Tensor]) -> float: ...
    def update(
        self, batch: dict[str, torch.Tensor], mini_batch_size: int, seed: int, entropy: bool = False
    ) -> dict: ...
    def use_sft_loss(self) -> None: ...
    def use_guided_loss(self, gamma: float) -> None: ...
    def save(self, path: str, step: int) -> None: ...
    def load(self, path: str) -> None: ...
    def close(self) -> None: ...


def worker_config(cfg: TrainConfig, total_steps: int):
    """verl's ``actor_rollout_ref`` config for our settings (from verl's own defaults)."""
    import verl
    from omegaconf import OmegaConf

    defaults = os.path.join(
        os.path.dirname(verl.__file__), "trainer/config/_generated_ppo_trainer.yaml"
    )
    root = OmegaConf.load(defaults)
    a = root.actor_rollout_ref
    micro = cfg.micro_batch_size
    a.model.path = cfg.model
    a.model.use_remove_padding = cfg.remove_padding
    a.model.enable_gradient_checkpointing = cfg.gradient_checkpointing
    a.model.override_config = {"attn_implementation": cfg.attention}
    if cfg.attention == PACKED_SDPA:  # verl imports it in each worker before building the model
        a.model.external_lib = "selfplay.train.attention"
    a.model.lora_rank = cfg.lora_rank  # 0: full fine-tuning; else peft adapters, merged on export
    a.model.lora_alpha = cfg.lora_alpha
    a.actor.strategy = "fsdp2"
    a.actor.fsdp_config.strategy = "fsdp2"
    a.actor.use_torch_compile = False
    a.actor.fsdp_config.use_torch_compile = False
    a.actor.fsdp_config.model_dtype = "fp32"  # master weights; compute dtype below
    a.actor.fsdp_config.seed = cfg.seed
    dtype = cfg.param_dtype
    a.actor.fsdp_config.mixed_precision = {
        "param_dtype": dtype,
        "reduce_dtype": "fp32",
        "buffer_dtype": "fp32",
    }
    a.actor.ppo_mini_batch_size = cfg.mini_batch_size or cfg.batch_size or micro
    a.actor.ppo_micro_batch_size_per_gpu = micro
    a.actor.use_dynamic_bsz = False
    a.actor.clip_ratio = cfg.clip_ratio
    a.actor.clip_ratio_low = cfg.clip_ratio
    a.actor.clip_ratio_high = cfg.clip_ratio_high or cfg.clip_ratio
    a.actor.loss_agg_mode = cfg.loss_agg
    a.actor.entropy_coeff = cfg.entropy_coef
    a.actor.use_kl_loss = cfg.kl_coef > 0
    a.actor.kl_loss_coef = cfg.kl_coef
    a.actor.kl_loss_type = cfg.kl_type
    a.actor.ppo_epochs = 1
    a.actor.optim.lr = cfg.lr
    a.actor.optim.weight_decay = cfg.weight_decay
    a.actor.optim.clip_grad = cfg.clip_grad
    a.actor.optim.total_training_steps = max(1, total_steps)
    # without a resumable checkpoint only the HF weights are written (no optimizer state: twice
    # the model's size again)
    a.actor.checkpoint.save_contents = (
        ["model", "optimizer", "extra", "hf_model"] if cfg.save_verl_checkpoint else ["hf_model"]
    )
    a.actor.checkpoint.load_contents = ["model", "optimizer", "extra"]
    a.rollout.n = 1
    a.rollout.log_prob_micro_batch_size_per_gpu = micro
    a.rollout.log_prob_use_dynamic_bsz = False
    a.ref.log_prob_micro_batch_size_per_gpu = micro
    a.ref.fsdp_config.strategy = "fsdp2"
    a.ref.fsdp_config.model_dtype = "fp32"
    a.ref.fsdp_config.mixed_precision = dict(a.actor.fsdp_config.mixed_precision)
    a.ref.use_torch_compile = False
    a.ref.fsdp_config.use_torch_compile = False
    OmegaConf.resolve(root)
    if cfg.device == "cpu":
        from selfplay.train import compat

        compat.adapt_worker_config_for_cpu(root.actor_rollout_ref)
    return root.actor_rollout_ref


def _meta(**extra: Any) -> dict[str, Any]:
    return {"calculate_entropy": False, "compute_loss": False, **extra}


class _Calls:
    """The batch plumbing shared by both launchers: padded tensors <-> verl TensorDicts."""

    actor: Any
    ref: Any
    config: Any  # verl's actor_rollout_ref config the workers were built from
    temperature: float = 1.0  # the policy is scored at log-softmax(logits / temperature)
    # training forwards run the LM head at trained positions only, and every forward takes its
    # log-probs from lm_head.label_log_probs (in-process launcher)
    lm_head_trained = False

    def log_probs(self, batch: dict[str, torch.Tensor], entropy: bool = False) -> dict:
        """Log-probs [B, R] of every response token (and, ``entropy``, the policy's entropies at
        the trained tokens: in-process, 0 on mask-0 tokens; lm_head)."""
        td = to_tensordict(
            _model_inputs(batch), self.temperature, **_meta(calculate_entropy=entropy)
        )
        with lm_head.positions(self.lm_head_trained):  # every position, lm_head.label_log_probs
            out = self.actor.compute_log_prob(td)
        from verl.utils import tensordict_utils as tu

        result = {"log_probs": from_nested(tu.get(out, "log_probs"), td)}
        if entropy and "entropy" in out:
            result["entropy"] = from_nested(tu.get(out, "entropy"), td)
        return result

    def ref_log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.ref is None:
            raise RuntimeError("no reference worker was built (kl_coef is 0)")
        from verl.utils import tensordict_utils as tu

        td = to_tensordict(_model_inputs(batch), self.temperature, **_meta())
        with lm_head.positions(self.lm_head_trained):
            out = self.ref.compute_ref_log_prob(td)
        return from_nested(tu.get(out, "log_probs"), td)

    def loss(self, batch: dict[str, torch.Tensor]) -> float:
        """The PPO loss of ``batch`` under the current weights, forward only (no update)."""
        from verl.utils import tensordict_utils as tu

        td = _tensordict(
            batch,
            temperature=self.temperature,
            **_meta(compute_loss=True, global_batch_size=len(batch["prompts"])),
        )
        with lm_head.positions(self.lm_head_trained):
            out = self.actor.compute_log_prob(td)
        return float(tu.get(out, "metrics")["loss"])

    def update(
        self,
        batch: dict[str, torch.Tensor],
        mini_batch_size: int,
        seed: int,
        entropy: bool = False,
    ) -> dict:
        """verl updates on ``batch``, one per mini-batch; ``entropy`` only when an entropy bonus is
        in the loss (the trainer reports entropy from the no-grad old-log-prob pass instead)."""
        from verl.utils import tensordict_utils as tu

        td = _tensordict(
            batch,
            temperature=self.temperature,
            calculate_entropy=entropy,
            compute_loss=True,
            global_batch_size=mini_batch_size,
            mini_batch_size=mini_batch_size,
            epochs=1,
            seed=seed,
            dataloader_kwargs={"shuffle": False},
        )
        with lm_head.positions(self.lm_head_trained):
            out = self.actor.update_actor(td)
        return tu.get(out, "metrics")

    def use_sft_loss(self) -> None:
        """Train with verl's own SFT loss (mean negative log-likelihood of the mask-1 tokens)
        instead of the PPO loss; ``update`` and ``loss`` then take ``sft_inputs`` batches."""
        from functools import partial

        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.utils.losses import sft_loss

        self.actor.set_loss_fn(partial(sft_loss, config=omega_conf_to_dataclass(self.config.actor)))

    def use_guided_loss(self, gamma: float) -> None:
        """Train guided GRPO groups: ``update`` batches carry ``off_policy`` [B, R], and those
        tokens get LUFFY's shaped objective (``selfplay.train.guided``) instead of the clipped
        ratio. Local workers only: the loss is registered in this process."""
        from functools import partial

        from omegaconf import OmegaConf
        from verl.utils.config import omega_conf_to_dataclass

        from selfplay.train import guided

        guided.register()
        actor = OmegaConf.create(OmegaConf.to_container(self.config.actor))
        actor.policy_loss.loss_mode = guided.LOSS_MODE
        self.actor.set_loss_fn(
            partial(guided.guided_ppo_loss, config=omega_conf_to_dataclass(actor), gamma=gamma)
        )

    def save(self, path: str, step: int) -> None:
        self.actor.save_checkpoint(local_path=path, global_step=step)

    def load(self, path: str) -> None:
        self.actor.load_checkpoint(local_path=path)


_MODEL_INPUT_KEYS = (
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
)


_UPDATE_KEYS = (
    *_MODEL_INPUT_KEYS,
    "old_log_probs",
    "advantages",
    "rollout_is_weights",  # only with --rollout-is tis
    "ref_log_prob",  # only with a KL loss
    "off_policy",  # only with guide rows
)


def sft_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of an SFT update: the model inputs and ``sft_loss_mask`` [B, P+R], the
    response mask placed over the whole sequence (0 on the prompt), as verl's SFT loss wants it."""
    inputs = _model_inputs(batch)
    inputs["sft_loss_mask"] = full_sequence_mask(batch["prompts"], batch["response_mask"])
    return inputs


def _tensordict(batch: dict[str, torch.Tensor], **non_tensors):
    """``to_tensordict``, with an SFT batch's full-sequence mask as verl's nested ``loss_mask``
    (aligned with the nested ``input_ids``: the same tokens, prompt then response)."""
    full = batch.get("sft_loss_mask")
    if full is None:
        return to_tensordict(batch, **non_tensors)
    td = to_tensordict({k: v for k, v in batch.items() if k != "sft_loss_mask"}, **non_tensors)
    values = full[batch["attention_mask"].bool()]
    td["loss_mask"] = torch.nested.nested_tensor_from_jagged(
        values, offsets=td["input_ids"].offsets()
    )
    return td


def _model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: batch[k] for k in _MODEL_INPUT_KEYS}


def update_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors one actor update takes (the optional ones when present)."""
    return {k: batch[k] for k in _UPDATE_KEYS if k in batch}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _restored_environ() -> contextlib.AbstractContextManager[None]:
    """Undo, on exit, what process-group setup and verl's ``Worker`` write to ``os.environ``.

    verl reads the rendezvous (``MASTER_PORT``, ``RANK``, ...) from the environment and writes it
    back there. Left behind, a held ``MASTER_PORT`` leaks into every subprocess this Python
    process starts later (``selfplay iterate`` runs its stages as subprocesses), whose own
    process group then fails to bind that port.
    """
    return scoped_env(keys=("REDIS_STORE_SERVER_HOST", "MASTER_PORT", *_WORLD_OF_ONE))


# the rendezvous of a world of one process (MASTER_PORT, a free port, is added when it is set)
_WORLD_OF_ONE = {
    "MASTER_ADDR": "127.0.0.1",
    "RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "1",
}


def _init_single_process_group(device: str) -> None:
    """World size 1 in this process: gloo on the CPU, nccl (plus gloo for CPU tensors) on a GPU.

    Sets the rendezvous variables verl's ``Worker`` reads; call it inside ``_restored_environ``.
    """
    import torch.distributed as dist

    for key, value in _WORLD_OF_ONE.items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())
    if dist.is_initialized():  # an earlier engine in this process (tests, notebooks)
        if dist.get_world_size() != 1:
            raise RuntimeError(
                "the in-process launcher runs world size 1; use --gpus N (Ray) for several devices"
            )
        return
    if device == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")


class LocalWorkers(_Calls):
    """Actor (and reference) workers in this process, world size 1."""

    def __init__(self, cfg: TrainConfig, total_steps: int):
        from selfplay.train import compat

        compat.check_verl_version()
        if cfg.device == "cpu":
            compat.install_cpu_platform()
        elif not torch.cuda.is_available():
            raise RuntimeError(
                "--gpus was given but torch sees no CUDA device; use --gpus 0 for CPU"
            )
        from verl.workers.engine_workers import ActorRolloutRefWorker

        config = worker_config(cfg, total_steps)
        self.config = config
        self.temperature = cfg.policy_temperature
        self.lm_head_trained = cfg.lm_head_positions == "trained"
        self.ref = None
        with _restored_environ():
            _init_single_process_group(cfg.device)
            if cfg.kl_coef > 0:
                self.ref = ActorRolloutRefWorker(config=config.copy(), role="ref")
                self.ref.init_model()
            self.actor = ActorRolloutRefWorker(config=config, role="actor")
            self.actor.init_model()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The actor's current weights, gathered to full CPU tensors (for checks and tests)."""
        module = self.actor.actor.engine.module
        return {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
            for k, v in module.state_dict().items()
        }

    def close(self) -> None:
        self.actor = None
        self.ref = None


class RayWorkers(_Calls):
    """Actor (and colocated reference) workers as a Ray worker group on GPUs (or CPUs for tests)."""

    def __init__(self, cfg: TrainConfig, total_steps: int):
        import ray

        from selfplay.train import compat

        compat.check_verl_version()
        cpu = cfg.device == "cpu"
        env = compat.cpu_worker_env() if cpu else {"TOKENIZERS_PARALLELISM": "false"}
        if cpu:
            compat.install_cpu_platform()
        self._started_ray = False
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"runtime_env": {"env_vars": env}, "include_dashboard": False}
            if cfg.ray_address:
                kwargs["address"] = cfg.ray_address
            elif cpu:
                kwargs["num_cpus"] = max(2, cfg.world_size)
            ray.init(**kwargs)
            self._started_ray = True
        from verl.single_controller.ray import (
            RayClassWithInitArgs,
            RayResourcePool,
            RayWorkerGroup,
            create_colocated_worker_cls,
        )
        from verl.workers.engine_workers import ActorRolloutRefWorker

        per_node = max(1, cfg.gpus)
        pool = RayResourcePool([per_node] * cfg.nodes, use_gpu=not cpu, max_colocate_count=1)
        self.temperature = cfg.policy_temperature
        config = worker_config(cfg, total_steps)
        self.config = config
        remote = ray.remote(ActorRolloutRefWorker)
        device_name = "cpu" if cpu else "cuda"
        if cfg.kl_coef > 0:
            classes = {
                "actor": RayClassWithInitArgs(remote, config=config, role="actor"),
                "ref": RayClassWithInitArgs(remote, config=config, role="ref"),
            }
            group = RayWorkerGroup(
                pool, create_colocated_worker_cls(classes), device_name=device_name
            )
            spawned = group.spawn(prefix_set=classes.keys())
            self.ref = spawned["ref"]
            self.ref.init_model()
            self.actor = spawned["actor"]
        else:
            self.ref = None
            self.actor = RayWorkerGroup(
                pool,
                RayClassWithInitArgs(remote, config=config, role="actor"),
                device_name=device_name,
            )
        self.actor.init_model()

    def close(self) -> None:
        import ray

        self.actor = None
        self.ref = None
        if self._started_ray:
            ray.shutdown()


def open_workers(cfg: TrainConfig, total_steps: int) -> Workers:
    """Build the workers ``cfg`` asks for (this is where the model is loaded)."""
    if cfg.use_ray:
        log.info("starting verl workers through Ray on %d %s(s)", cfg.world_size, cfg.device)
        return RayWorkers(cfg, total_steps)
    log.info("starting verl workers in-process on %s", cfg.device)
    return LocalWorkers(cfg, total_steps)
