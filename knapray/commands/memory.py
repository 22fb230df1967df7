"""``knapray memory``: per-GPU memory of a run config and the largest token budget that fits."""

from __future__ import annotations

import argparse
import json

from knapray.limits import MAX_RANK_TOKENS

from .flags import add_ac, add_config, add_fsdp, add_gpus_per_node, add_json, add_world_size, float_in, int_at_least


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config(p, required=True)
    add_world_size(p, default=None, help="GPUs (default: scaling.num_workers)")
    add_gpus_per_node(p, help="default: balance.gpus_per_node, else 8")
    add_fsdp(p, default=None, help="default parallel.fsdp")
    add_ac(p, default=None, help="default parallel.activation_checkpointing")
    p.add_argument("--tokens-per-gpu", type=int_at_least(0, MAX_RANK_TOKENS), default=None,
                   help="routed tokens per GPU (default: data.max_tokens_per_gpu, else the largest that fits)")
    p.add_argument("--gpu-gib", type=float_in(gt=0), default=80.0, help="GPU memory in GiB (default 80)")
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from knapray.planning.costs.memory import GIB, memory_model_for_run
    from knapray.driver.preflight import load_run_config

    cfg = load_run_config(args.config, args.set)  # a ConfigError (ValueError) names the file or the key
    from knapray.models.families import adapter_counts

    mem = memory_model_for_run(
        cfg, world_size=args.world_size, gpus_per_node=args.gpus_per_node, sharding=args.fsdp,
        checkpointing=args.ac, ac_every=args.ac_every, trainable=adapter_counts(cfg.model),
    )
    gpu_bytes = int(args.gpu_gib * GIB)
    fit = mem.max_tokens_per_gpu(gpu_bytes)
    tokens = args.tokens_per_gpu
    if tokens is None:
        tokens = cfg.data.max_tokens_per_gpu or fit
    br = mem.breakdown(tokens)
    gib = br.to_gib()
    result = {
        "config": args.config, "params": mem.shape.num_params, "world_size": mem.world_size,
        "gpus_per_node": mem.gpus_per_node, "fsdp": mem.sharding, "shard_size": mem.shard_size,
        "ac": mem.checkpointing, "ac_every": mem.ac_every, "precision": mem.precision,
        "tokens_per_gpu": tokens, "breakdown": {k: v for k, v in gib.items() if k != "total"},
        "total_gib": gib["total"], "peak_phase": br.peak_phase, "gpu_gib": args.gpu_gib,
        "usable_gib": mem.usable_bytes(gpu_bytes) / GIB, "fits": mem.fits(tokens, gpu_bytes),
        "max_tokens_per_gpu": fit, "trainable_params": mem.trainable[0] if mem.trainable else mem.shape.num_params,
        "experts": mem.experts,
    }
    ac = mem.checkpointing + (f" (k={mem.ac_every})" if mem.checkpointing == "every_k" else "")
    print(f"{cfg.run.name}: {mem.shape.num_params / 1e9:.2f} B parameters, {mem.precision}, "
          f"{mem.world_size} GPUs ({mem.gpus_per_node} per node), fsdp {mem.sharding} "
          f"(state sharded over {mem.shard_size}), activation checkpointing {ac}")
    if mem.trainable:
        print(f"LoRA: {mem.trainable[0] / 1e6:.1f} M adapter parameters train (rank {cfg.model.lora.rank}); the base "
              "is frozen: gradients and AdamW state are the adapters' alone")
    if mem.experts > 1:
        print(f"two experts (flow.expert_boundary={cfg.flow.expert_boundary}): both resident, each with its parameter "
              "shards" + (", AdamW state and EMA" if mem.ema else " and AdamW state") + "; a step trains one (its gradients "
              "alone)")
    print(f"per GPU at {tokens} tokens per GPU:")
    for key, value in result["breakdown"].items():
        if key == "ema" and not value:
            continue  # no optim.ema_decay
        note = {"step_buffers": "  (optimizer step, after activations are freed)",
                "overlap": "  (activations freed in backward before all gradients exist)"}.get(key, "")
        print(f"  {key.replace('_', ' '):<18} {value:>9.2f} GiB{note}")
    print(f"  {'total':<18} {gib['total']:>9.2f} GiB  peak in the {br.peak_phase}; usable of "
          f"{args.gpu_gib:g} GiB: {result['usable_gib']:.2f} GiB ({mem.reserve_bytes / GIB:g} GiB reserve, "
          f"{mem.fragmentation:.0%} fragmentation) -> {'fits' if result['fits'] else 'DOES NOT FIT'}")
    if fit:
        print(f"largest token budget that fits {args.gpu_gib:g} GiB: {fit} tokens per GPU")
    else:
        print(f"the model state alone does not fit {args.gpu_gib:g} GiB: shard it (--fsdp full|hybrid)")
    if args.json:
        print(json.dumps(result))
    return 0
