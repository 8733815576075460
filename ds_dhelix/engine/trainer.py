"""``DhelixTrainer``: a ``transformers.Trainer`` whose DeepSpeed engine is ds_dhelix's.

``TrainingArguments(deepspeed=cfg)`` with ``"dhelix": {"enabled": true}`` in ``cfg``: the Trainer
fills the config's ``"auto"`` values as HF's DeepSpeed integration does, then the engine is built
through ``ds_dhelix.initialize`` (TP/EP layout, SI plan). Each optimizer step's micro-batches,
which the Trainer collects anyway (``get_batch_samples``), go to ``engine.train_batch`` at once, so
the two strands of SI see them together; the Trainer's per-micro-batch calls then only report
that step's loss. What changes against a plain Trainer, method by method:

    get_train_dataloader   shards over the data-parallel ranks of the layout, not the world (the
                           TP ranks of a group read the same samples)
    _prepare_for_training  builds the ds_dhelix engine (and loads a checkpoint to resume)
    get_batch_samples      runs the step: loss normalised by the step's target count like the
                           Trainer's ``num_items_in_batch`` (its own count, not counted again)
    training_step          returns this micro-batch's share of the step loss
    evaluate               forward only through ``engine.eval_batch``; reports ``eval_loss`` weighted
                           by each batch's targets over the data-parallel ranks, as train.py's
                           ``Eval/loss`` (``engine.evaluation``)
    save_model             ``engine.export_hf``: shards gathered, an HF checkpoint (a PEFT LoRA
                           model: ``engine.export_adapter``, the adapter as PEFT writes it)
    log                    adds the step's communication and memory figures (``dhelix/...``)

The Trainer's own checkpoints (``save_strategy``) hold the engine's DeepSpeed checkpoint (every
rank's shards and optimizer state) plus the Trainer state; ``resume_from_checkpoint`` continues
exactly. Settings the op graph cannot honour are refused when the trainer is built.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os

import torch
from transformers import Trainer

from .evaluation import evaluate_loss
from .guard import enabled_dhelix_section

logger = logging.getLogger(__name__)

SCHEDULE_STEP_KEYS = ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps")

REFUSED_ARGS = {
    "gradient_checkpointing": 'the op graph never calls the HF modules\' checkpointing; set "dhelix": '
    '{"recompute": "full"} (or "selective") in the ds_config instead',
    "torch_compile": "the op graph runs the model's weights through its own ops, not the compiled module",
    "neftune_noise_alpha": "NEFTune hooks the HF embedding module, which the op graph does not call",
    "label_smoothing_factor": "the op graph computes the causal-LM loss itself (no label smoothing)",
    "load_best_model_at_end": "the best checkpoint would be loaded into the unsharded HF model; "
    "reload it with DhelixTrainer(resume_from_checkpoint=...) instead",
}
"""TrainingArguments the op graph cannot honour (refused when set), with the reason and the fix."""

OWN_LOSS_TRAINERS = (
    "DPOTrainer",
    "KTOTrainer",
    "ORPOTrainer",
    "CPOTrainer",
    "GRPOTrainer",
    "RLOOTrainer",
    "OnlineDPOTrainer",
    "PPOTrainer",
    "RewardTrainer",
)
"""TRL trainers that compute their loss from the HF model's outputs (``compute_loss`` / their own
forwards), which the engine's step replaces: refused by class name when mixed into DhelixTrainer."""


class _SteppedByEngine:
    """The Trainer's optimizer / LR scheduler handle: ``engine.train_batch`` already stepped both,
    so the Trainer's own ``step()`` / ``zero_grad()`` calls do nothing; everything else (param
    groups, ``get_last_lr``, state dicts) is the engine's object."""

    def __init__(self, inner):
        self.inner = inner

    def step(self, *args, **kwargs):
        pass

    def zero_grad(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _original_config(source) -> dict:
    """The ds_config as the user wrote it (before HF filled its "auto" values)."""
    if isinstance(source, dict):
        return copy.deepcopy(source)
    with open(source) as f:
        return json.load(f)


class DhelixTrainer(Trainer):
    """``transformers.Trainer`` for a ds_config with an enabled dhelix section (see the module doc)."""

    def __init__(self, *args, **kwargs):
        mixed = [c.__name__ for c in type(self).__mro__ if c.__name__ in OWN_LOSS_TRAINERS]
        if mixed:
            raise ValueError(
                f"DhelixTrainer mixed with TRL's {mixed[0]}: it computes its loss from the HF model's outputs, "
                f"which the engine's op graph replaces; train preference objectives (dpo, ipo, simpo, orpo) and "
                f"GRPO's update with train.py --objective (ds_dhelix's own loss, docs: post-training)"
            )
        super().__init__(*args, **kwargs)
        source = getattr(self.args, "deepspeed", None)
        if not self.is_deepspeed_enabled or source is None:
            raise ValueError(
                'DhelixTrainer needs TrainingArguments(deepspeed=<ds_config with "dhelix": '
                '{"enabled": true}>); without DeepSpeed use transformers.Trainer'
            )
        self._user_config = _original_config(source)
        if not enabled_dhelix_section(self._user_config):
            raise ValueError(
                "DhelixTrainer: the ds_config's dhelix section is missing or disabled; add "
                '"dhelix": {"enabled": true, ...} or use transformers.Trainer for plain DeepSpeed'
            )
        self._refuse_unsupported_args()
        from .build import check_setup

        config = self._hf_config().config
        setup = check_setup(self._config_for_check(config), self.model.config, self.args.world_size)
        if setup.dims.pp > 1:
            raise ValueError(
                f"DhelixTrainer runs one pipeline stage (dhelix.pipeline.stages = {setup.dims.pp}); "
                f"train a pipeline with train.py"
            )
        if setup.dh.objective.name != "cross_entropy":
            raise ValueError(
                f"DhelixTrainer trains the causal-LM cross-entropy; dhelix.objective {setup.dh.objective.name!r} "
                f"(its pairs or rollouts, its step average) runs through train.py --objective for now"
            )
        self._dims = setup.dims
        self._engine = None
        self._engine_steps = None  # the optimizer steps its LR schedule was built for
        self._step_batches: list[dict] = []
        self._step_loss = None
        self.step_losses: list[float] = []
        """Every optimizer step's loss as the engine returned it (the Trainer logs it rounded)."""

    # ------------------------------------------------------------------ configuration
    def _refuse_unsupported_args(self) -> None:
        set_args = [name for name in REFUSED_ARGS if getattr(self.args, name, None) not in (None, False, 0, 0.0)]
        if set_args:
            raise ValueError(
                "DhelixTrainer cannot honour "
                + "; ".join(f"TrainingArguments.{name} ({REFUSED_ARGS[name]})" for name in set_args)
            )

    def _hf_config(self):
        return self.accelerator.state.deepspeed_plugin.hf_ds_config

    def _config_for_check(self, config: dict) -> dict:
        """``config`` with the batch size HF computed over the whole world removed where the user left
        it to "auto" (or out): with TP the data-parallel size is smaller than the world."""
        config = copy.deepcopy(config)
        if self._user_config.get("train_batch_size", "auto") == "auto":
            config.pop("train_batch_size", None)
        return config

    def _finalize_config(self, max_steps: int) -> dict:
        """HF's "auto" filling for the run (``trainer_config_finalize``); a schedule length written
        in the ds_config is kept (warned once when it differs from the run's steps), and the batch
        arithmetic is checked against the data-parallel size, not the world. ``dhelix.seed`` (the
        base of every random draw) defaults to ``TrainingArguments.seed``."""
        hf = self._hf_config()
        hf.mismatches = [m for m in hf.mismatches if "train_batch_size" not in m]
        written = {}
        for key in SCHEDULE_STEP_KEYS:
            node, leaf = hf.find_config_node(key)
            if node is not None and node.get(leaf) not in (None, "auto"):
                written[key] = node[leaf]
                node[leaf] = "auto"
        hf.trainer_config_finalize(self.args, self.model, max_steps)
        for key, value in written.items():
            node, leaf = hf.find_config_node(key)
            if node[leaf] != value:
                logger.warning(
                    f"ds_config {key} = {value} is kept (this run trains {max_steps} steps, which "
                    f'would give {node[leaf]}); write "auto" to follow TrainingArguments'
                )
            node[leaf] = value
        config = self._config_for_check(hf.config)
        # dropout masks and router noise follow TrainingArguments.seed, as train.py's --seed
        config["dhelix"].setdefault("seed", self.args.seed)
        return config

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        return self._shard_over_data_parallel(loader)

    def get_eval_dataloader(self, eval_dataset=None):
        return self._shard_over_data_parallel(super().get_eval_dataloader(eval_dataset))

    def _shard_over_data_parallel(self, loader):
        """Accelerate shards batches over every process; the ranks of one TP group must read the same
        ones, so the shard is the data-parallel rank of the layout."""
        dims = self._dims
        if dims.dp == dims.world:
            return loader
        sampler = getattr(loader, "batch_sampler", None)
        if not hasattr(sampler, "num_processes"):
            raise ValueError(
                f"DhelixTrainer with tensor_parallel.size {dims.tp}: the dataset must be map-style "
                f"(a torch Dataset with __len__), so its batches can be split over the "
                f"{dims.dp} data-parallel ranks"
            )
        sampler.num_processes = dims.dp
        sampler.process_index = dims.coords(self.args.process_index).dp_rank
        return loader

    # ------------------------------------------------------------------ engine
    def _planned_steps(self) -> int:
        """The run's optimizer steps as ``Trainer.train`` will compute them (``max_steps``, else the
        epochs over the training set), for an engine built before training (``evaluate`` first)."""
        if self.args.max_steps > 0 or self.train_dataset is None:
            return max(self.args.max_steps, 1)
        batches = len(self.get_train_dataloader())
        gas = self.args.gradient_accumulation_steps
        return math.ceil(self.args.num_train_epochs * max(batches // gas + int(batches % gas > 0), 1))

    def _build_engine(self, max_steps: int):
        if self._engine is not None:
            if max_steps != self._engine_steps:
                raise ValueError(
                    f"the engine's LR schedule was built for {self._engine_steps} steps, this "
                    f"train() runs {max_steps}: build a new DhelixTrainer for another run length"
                )
            return self._engine
        self._engine_steps = max_steps
        from .build import initialize

        config = self._finalize_config(max_steps)
        optimizer = lr_scheduler = None
        if "optimizer" not in config:  # the Trainer's optimizer, over the parameters after sharding
            self.optimizer = None
            sharded_model = self.model
            optimizer = lambda params: self.create_optimizer(sharded_model)  # noqa: E731
            config["zero_allow_untested_optimizer"] = True
        if "scheduler" not in config:  # the Trainer's LR schedule (lr_scheduler_type, warmup)

            def lr_scheduler(opt):
                trainer = copy.copy(self)
                trainer.lr_scheduler = None
                return Trainer.create_scheduler(trainer, num_training_steps=max_steps, optimizer=opt)

        self._engine, *_ = initialize(model=self.model, config=config, optimizer=optimizer, lr_scheduler=lr_scheduler)
        return self._engine

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        engine = self._build_engine(max_steps)
        self.model_wrapped = self.deepspeed = engine
        self.optimizer = _SteppedByEngine(engine.optimizer)
        self.lr_scheduler = _SteppedByEngine(engine.lr_scheduler)
        if resume_from_checkpoint is not None:
            path, _ = engine.load_checkpoint(
                resume_from_checkpoint, load_optimizer_states=True, load_lr_scheduler_states=True
            )
            if path is None:
                raise ValueError(
                    f"resume_from_checkpoint {resume_from_checkpoint!r}: no DeepSpeed checkpoint of "
                    f"this run there (a DhelixTrainer checkpoint holds a global_step* folder)"
                )
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return engine, train_dataloader

    # ------------------------------------------------------------------ training
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._step_batches, self._step_loss = batches, None
        if batches:
            self._step_loss = self._train_step(batches, num_items)
        return batches, num_items

    def _train_step(self, batches: list[dict], num_items) -> torch.Tensor:
        """One optimizer step over the step's micro-batches. With the Trainer's ``num_items`` (its
        ``num_items_in_batch``; None: a mean of micro-batch means, as the Trainer then does) the loss
        is the sum over the step's targets / their count, like a plain Trainer's."""
        engine = self._engine
        gas = engine.gradient_accumulation_steps()
        if len(batches) != gas:
            raise ValueError(
                f"this optimizer step has {len(batches)} micro-batches, the engine takes "
                f"gradient_accumulation_steps = {gas}: the epoch's last step is short; use a "
                f"dataset whose batch count is a multiple of {gas} per data-parallel rank, "
                f"dataloader_drop_last=True with max_steps, or max_steps within the first epoch"
            )
        if num_items is not None:
            # the Trainer's count is this rank's, or with average_tokens_across_devices summed over
            # every process: each TP (and CP) rank of a sequence counted the same samples, so it is
            # tp x cp times the data-parallel total; engine.train_batch averages micro-batches and DP ranks
            if self.args.average_tokens_across_devices and self.args.world_size > 1:
                denominator = float(num_items) / (self._dims.shards * gas * self._dims.dp)
            else:
                denominator = float(num_items) / gas
            batches = [{**b, "loss_denominator": max(denominator, 1e-12)} for b in batches]
        loss = engine.train_batch(iter(batches))
        self.step_losses.append(float(loss))
        return loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The step already ran (``get_batch_samples``): this micro-batch's share of its loss, so the
        Trainer's sum over the step's micro-batches is the step loss."""
        return (self._step_loss / len(self._step_batches)).detach().to(self.args.device)

    def _clip_grad_norm(self, model):
        return self._engine.get_global_grad_norm()  # clipped inside the engine's step

    def _get_grad_norm(self, model, grad_norm=None):
        norm = self._engine.get_global_grad_norm() if grad_norm is None else grad_norm
        return float(norm) if norm is not None else None

    def log(self, logs: dict, start_time=None) -> None:
        stats = getattr(self._engine, "last_stats", None)
        if stats is not None and "loss" in logs:
            logs = {
                **logs,
                "dhelix/comm_ms": stats.comm_and_exposed[0] * 1e3,  # CUDA: from CUDA events
                "dhelix/exposed_comm_ms": stats.comm_and_exposed[1] * 1e3,
                "dhelix/hidden_comm_fraction": stats.hidden_fraction,
                "dhelix/peak_activation_bytes": float(stats.peak_activation_bytes),
                "dhelix/tokens_per_s": stats.tokens_per_s,
            }
            if stats.starved_share is not None:  # CUDA: compute ops that found the GPU idle at launch
                logs["dhelix/starved_launch_fraction"] = stats.starved_share
            if stats.dp_reduce_s is not None:  # the data-parallel reduction; the part the step waited for
                logs["dhelix/dp_reduce_ms"] = stats.dp_reduce_s * 1e3
                logs["dhelix/dp_exposed_ms"] = stats.dp_exposed_s * 1e3
            auto = getattr(self._engine, "auto", None)
            if auto is not None:  # "schedule": "auto": the logged step's schedule, its index in auto.candidates
                logs["dhelix/auto_schedule"] = float(auto.candidates.index(self._engine.current_schedule))
        super().log(logs, start_time)

    # ------------------------------------------------------------------ evaluation and saving
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """The evaluation set's loss weighted by each batch's targets over every data-parallel rank,
        forward only through ``engine.eval_batch`` (each rank its data-parallel share): train.py's
        ``Eval/loss`` (``ds_dhelix.engine.evaluation``). ``compute_metrics`` needs logits, which the
        sharded graph does not gather, so it is refused."""
        if self.compute_metrics is not None:
            raise ValueError(
                "DhelixTrainer.evaluate reports eval_loss only: compute_metrics needs the full "
                "logits, which the tensor-parallel graph never gathers; drop compute_metrics"
            )
        engine = self._build_engine(self._engine_steps or self._planned_steps())
        # one batch per eval_batch call: the last batch of the set may be shorter than the others
        loss, targets = evaluate_loss(engine, self.get_eval_dataloader(eval_dataset), chunk=1)
        if not targets:
            raise ValueError(
                "DhelixTrainer.evaluate: the evaluation set gave no batch with a target (a label other than -100)"
            )
        metrics = {f"{metric_key_prefix}_loss": loss}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """An HF checkpoint in ``output_dir`` (tensor-parallel shards gathered; every rank calls it)."""
        output_dir = output_dir or self.args.output_dir
        if self._engine is None:
            if self.args.should_save:
                self.model.save_pretrained(output_dir)
                if self.processing_class is not None:
                    self.processing_class.save_pretrained(output_dir)
            return
        if getattr(self._engine.module, "dhelix_lora", None) is not None:  # a PEFT model: its adapter, as PEFT saves it
            self._engine.export_adapter(output_dir, tokenizer=self.processing_class)
        else:
            self._engine.export_hf(output_dir, self.processing_class)
        if self.args.should_save:
            from transformers.trainer import TRAINING_ARGS_NAME

            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
