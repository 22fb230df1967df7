"""A trained run loaded for sampling: its config and checkpoint read without weights
(``read_run``), then its model with the checkpoint's weights (``load_weights``; a run of two
experts, both), as ``knapray sample`` and the sampling gang (``driver.gang``) load it."""

from __future__ import annotations

from typing import Any


def read_run(run_dir: str, checkpoint: str | None = None) -> tuple[Any, str]:
    """(TrainConfig, checkpoint path) of a run directory, read without loading weights."""
    from knapray.driver.run_dir import read_run_config, run_checkpoint
    from knapray.models.families import check_samples

    cfg = read_run_config(run_dir)
    check_samples(cfg.model, f"run {run_dir}: sampling")
    return cfg, run_checkpoint(run_dir, checkpoint, "sample from")


def load_weights(cfg: Any, path: str, ema: bool = True, device: str = "cpu", dtype: Any = None, *,
                 prepare: Any = None, group: Any = None) -> tuple[Any, bool]:
    """(the model of ``cfg.model``'s family with the checkpoint's weights, EMA used), on
    ``device`` in ``dtype`` (None: fp32). The model is built on the meta device and given
    storage where it runs, in its dtype, before the weights are read into it: nothing holds
    a second, fp32 copy (a 12B model is 24 GB in bf16, 48 more in fp32). ``prepare(model)``:
    applied to the meta model first (sharding it over ``group``: every rank of the group then
    calls this together and reads only its shards).

    A run of two experts (``flow.expert_boundary``) gives ``models.sampling.Experts``: both
    models, each loaded as one model is from its own checkpoint parts (``model`` / ``ema``,
    then ``model_2`` / ``ema_2``: ``worker.experts.part_suffix``), and the boundary the
    sampler switches between them at; ``prepare`` is applied to each."""
    from knapray.worker.checkpoint import saved_keys

    used_ema = ema and any(k.startswith("ema.") for k in saved_keys(path))
    split = cfg.flow.experts()
    if split is None:
        return _load_model(cfg, path, None, used_ema, device, dtype, prepare, group), used_ema
    from knapray.models.sampling import Experts
    from knapray.models.timesteps import EXPERT_NAMES

    models = tuple(_load_model(cfg, path, i, used_ema, device, dtype, prepare, group) for i in range(len(EXPERT_NAMES)))
    return Experts(models, split.boundary), used_ema


def _load_model(cfg: Any, path: str, expert: int | None, used_ema: bool, device: str, dtype: Any, prepare: Any,
                group: Any) -> Any:
    """The run's model, or its expert ``expert`` (0: the high-noise one), as ``load_weights`` says."""
    import dataclasses

    import torch

    from knapray.models.families import build_model
    from knapray.worker.checkpoint import safe_load
    from knapray.worker.experts import part_suffix

    with torch.device("meta"):
        model = build_model(cfg.model)
    if dtype is not None:
        model.to(dtype)
    if prepare is not None:
        prepare(model)
    model.to_empty(device=device)
    prefix = ("ema" if used_ema else "model") + part_suffix(expert or 0)
    lora = cfg.model.lora.enabled
    if lora:  # the base from model.pretrained (the one trained on), the adapters from the checkpoint
        from knapray.models.lora import is_adapter
        from knapray.worker.checkpoint import read_trainer_state
        from knapray.weights.checks import base_record
        from knapray.weights.load import load_pretrained
        from knapray.weights.source import expert_path

        trainer = read_trainer_state(path)
        model_cfg, saved = cfg.model, trainer.get("lora_base") or {}
        if expert is not None:  # each expert's own base (a pipeline's transformer/ or transformer_2/)
            model_cfg = dataclasses.replace(cfg.model, pretrained=expert_path(cfg.model.pretrained, expert))
            saved = ((trainer.get("experts") or {}).get("lora_bases") or [None] * (expert + 1))[expert] or {}
        now = base_record(model_cfg)
        if now is None or saved.get("fingerprint") != now["fingerprint"]:
            raise ValueError(f"{path} holds LoRA adapters trained on the base {saved.get('path')!r}, but "
                             f"model.pretrained {model_cfg.pretrained!r} is another checkpoint now")
        load_pretrained(model, model_cfg)
    # The model's own tensors: DCP reads every saved value into them, converting its dtype.
    state = {prefix: {k: v for k, v in model.state_dict().items() if not lora or is_adapter(k)}}
    safe_load(state, path, group)
    model.load_state_dict(state[prefix], strict=not lora)
    return model.eval()


def served_base(cfg: Any, path: str) -> str | None:
    """The fingerprint of the base a LoRA run was trained on (its checkpoint's record), or
    None for a run without adapters: what every adapter served beside it must share."""
    if not cfg.model.lora.enabled:
        return None
    from knapray.worker.checkpoint import read_trainer_state

    return (read_trainer_state(path).get("lora_base") or {}).get("fingerprint")


def load_adapter(model: Any, served: tuple[Any, str], name: str, run_dir: str, *, device: str, dtype: Any = None,
                 ema: bool = True) -> str:
    """The adapters of LoRA run ``run_dir`` as adapter ``name`` of ``model`` (which holds the
    served run ``served`` = (config, checkpoint path): a LoRA run of the same base, the same
    architecture), on ``device`` in ``dtype``; returns the checkpoint read. ValueError in one
    line naming ``name`` and what differs."""
    from knapray.models.families import get_family
    from knapray.models.lora import add_named_adapter, as_trained
    from knapray.worker.checkpoint import safe_load, saved_keys

    cfg, path = check_adapter(served, name, run_dir)
    add_named_adapter(model, cfg.model.lora, dict(get_family(cfg.model.family).lora_presets), name)
    params = {n: p for n, p in model.named_parameters() if f".lora_A.{name}." in n or f".lora_B.{name}." in n}
    for p in params.values():
        p.data = p.data.to(device=device, dtype=dtype or p.dtype)
    used_ema = ema and any(k.startswith("ema.") for k in saved_keys(path))
    prefix = "ema" if used_ema else "model"
    # The checkpoint names them as adapter "default"; DCP reads each into this adapter's tensor.
    safe_load({prefix: {as_trained(n, name): p for n, p in params.items()}}, path)
    return path


def check_adapter(served: tuple[Any, str], name: str, run_dir: str) -> tuple[Any, str]:
    """(config, checkpoint) of LoRA run ``run_dir``, checked to serve as adapter ``name``
    beside ``served`` = (config, checkpoint path) of the served run, reading no weights:
    a LoRA run of the same base (its model.pretrained's fingerprint) and architecture, both of
    one model (not two experts). ValueError in one line naming ``name`` and what differs."""
    import dataclasses

    from knapray.models.lora import ADAPTER
    from knapray.worker.checkpoint import check_checkpoint

    base_cfg, base_path = served
    if name == ADAPTER or not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ValueError(f"adapter name {name!r}: letters, digits, '.', '_' or '-', and not {ADAPTER!r}")
    cfg, path = read_run(run_dir)
    check_checkpoint(path)
    where = f"adapter {name} ({run_dir})"
    for run, c in ((base_cfg.run.name, base_cfg), (run_dir, cfg)):
        if c.flow.expert_boundary:
            raise ValueError(f"{where}: run {run} holds two experts (flow.expert_boundary {c.flow.expert_boundary}); "
                             "adapters are served beside a run of one model, of one")
    if not cfg.model.lora.enabled:
        raise ValueError(f"{where}: not a LoRA run (its model.lora.rank is 0): only adapters are served beside a run")
    want = served_base(base_cfg, base_path)
    if want is None:
        raise ValueError(f"{where}: the served run {base_cfg.run.name!r} has no adapters of its own, so no base to "
                         "share; serve a LoRA run of the same base with --run")
    if served_base(cfg, path) != want:
        raise ValueError(f"{where}: trained on another base than the served run (its model.pretrained's "
                         "fingerprint differs)")
    mine, theirs = dataclasses.replace(cfg.model, lora=base_cfg.model.lora), base_cfg.model
    if mine != theirs:
        diff = next(f.name for f in dataclasses.fields(theirs) if getattr(mine, f.name) != getattr(theirs, f.name))
        raise ValueError(f"{where}: model.{diff} differs from the served run's")
    return cfg, path
