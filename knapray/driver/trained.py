"""A trained run loaded for sampling: its config and checkpoint read without weights
(``read_run``), then its model with the checkpoint's weights (``load_weights``), as
``knapray sample`` and the sampling gang (``driver.gang``) load it."""

from __future__ import annotations

from typing import Any


def read_run(run_dir: str, checkpoint: str | None = None) -> tuple[Any, str]:
    """(TrainConfig, checkpoint path) of a run directory, read without loading weights."""
    from knapray.driver.run_dir import read_run_config, run_checkpoint

    cfg = read_run_config(run_dir)
    return cfg, run_checkpoint(run_dir, checkpoint, "sample from")


def load_weights(cfg: Any, path: str, ema: bool = True, device: str = "cpu", dtype: Any = None, *,
                 prepare: Any = None, group: Any = None) -> tuple[Any, bool]:
    """(the model of ``cfg.model``'s family with the checkpoint's weights, EMA used), on
    ``device`` in ``dtype`` (None: fp32). The model is built on the meta device and given
    storage where it runs, in its dtype, before the weights are read into it: nothing holds
    a second, fp32 copy (a 12B model is 24 GB in bf16, 48 more in fp32). ``prepare(model)``:
    applied to the meta model first (sharding it over ``group``: every rank of the group then
    calls this together and reads only its shards)."""
    import torch

    from knapray.models.families import build_model
    from knapray.worker.checkpoint import safe_load, saved_keys

    with torch.device("meta"):
        model = build_model(cfg.model)
    if dtype is not None:
        model.to(dtype)
    if prepare is not None:
        prepare(model)
    model.to_empty(device=device)
    used_ema = ema and any(k.startswith("ema.") for k in saved_keys(path))
    prefix = "ema" if used_ema else "model"
    lora = cfg.model.lora.enabled
    if lora:  # the base from model.pretrained (the one trained on), the adapters from the checkpoint
        from knapray.models.lora import is_adapter
        from knapray.worker.checkpoint import read_trainer_state
        from knapray.weights.checks import base_record
        from knapray.weights.load import load_pretrained

        saved, now = read_trainer_state(path).get("lora_base") or {}, base_record(cfg.model)
        if now is None or saved.get("fingerprint") != now["fingerprint"]:
            raise ValueError(f"{path} holds LoRA adapters trained on the base {saved.get('path')!r}, but "
                             f"model.pretrained {cfg.model.pretrained!r} is another checkpoint now")
        load_pretrained(model, cfg.model)
    # The model's own tensors: DCP reads every saved value into them, converting its dtype.
    state = {prefix: {k: v for k, v in model.state_dict().items() if not lora or is_adapter(k)}}
    safe_load(state, path, group)
    model.load_state_dict(state[prefix], strict=not lora)
    return model.eval(), used_ema
