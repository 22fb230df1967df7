"""``knapray export``: a run's trained (or EMA) weights as a diffusers model directory
(knapray/driver/export.py)."""

from __future__ import annotations

import argparse
import json
import os

NAME = "export"
HELP = "write a run's trained (or EMA) weights in the diffusers layout with its config.json"


MAX_SHARD_BYTES = 1 << 50
"""The largest --max-shard-size: 1 PiB (a file that size holds any model)."""


def _size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    upper = text.strip().upper()
    for unit in sorted(units, key=len, reverse=True):
        if upper.endswith(unit):
            number = upper[: -len(unit)]
            try:
                value = float(number) * units[unit]
            except ValueError:
                break
            if 1 <= value <= MAX_SHARD_BYTES:  # a finite number of bytes (inf and nan are neither)
                return int(value)
            break
    raise argparse.ArgumentTypeError(f"expected a size like 10GB, 500MB or 64KiB, from 1B to 1PiB, got {text!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .flags import add_dtype, add_json

    p.add_argument("--run", required=True, help="run directory (runs/NAME)")
    p.add_argument("--out", required=True, help="new (or empty) directory to write the diffusers model to")
    p.add_argument("--ema", action="store_true", help="the EMA weights (optim.ema_decay > 0) instead of the raw ones")
    p.add_argument("--lora", action="store_true",
                   help="a LoRA run's adapters only, as pytorch_lora_weights.safetensors for a diffusers "
                   "pipeline's load_lora_weights (--dtype and --max-shard-size do not apply)")
    p.add_argument("--format", choices=("diffusers", "kohya", "comfyui"), default="diffusers",
                   help="with --lora: diffusers' format (default), kohya's lora_unet_* names with alphas (kohya's "
                   "sd-scripts, ComfyUI) or ComfyUI's diffusion_model.* names, for Flux.1, FLUX.2 and Qwen-Image")
    p.add_argument("--checkpoint", help="checkpoint directory (default: the run's newest complete one)")
    add_dtype(p, help="dtype of the written tensors (auto = fp32: the trained weights exactly; FLUX.1 ships bf16)")
    p.add_argument("--max-shard-size", type=_size, default="10GB",
                   help="largest output file; more tensors go to further shards with an index (default 10GB)")
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from knapray.driver.export import export_run

    if args.format != "diffusers" and not args.lora:
        raise ValueError(f"--format {args.format}: a LoRA format; add --lora (a full model is written in diffusers' "
                         "layout)")

    if args.lora:
        from knapray.driver.lora_export import export_lora

        r = export_lora(args.run, args.out, ema=args.ema, checkpoint=args.checkpoint, fmt=args.format)
        how = {"diffusers": f"scale {r.scale:g} folded into lora_B", "kohya": f"scale {r.scale:g} as alpha / rank",
               "comfyui": f"scale {r.scale:g} folded into lora_B"}[r.format]
        load = (f"load with pipe.load_lora_weights({r.out!r})" if r.format == "diffusers" else
                f"load {r.file} in ComfyUI, or with pipe.load_lora_weights({r.out!r}, "
                f"weight_name={r.file.rsplit('/', 1)[-1]!r})")
        if r.experts:  # one file per expert, in its folder
            high, low = (os.path.join(r.out, e) for e in r.experts)
            load = (f"both experts' adapters: {high}/ and {low}/; load with pipe.load_lora_weights({high!r}) and "
                    f"pipe.load_lora_weights({low!r}, load_into_transformer_2=True)" if r.format == "diffusers" else
                    f"both experts' adapters: {high}/ and {low}/, a {r.format} file each")
        print(f"wrote {r.out}: {r.family} LoRA adapters after {r.steps} steps ({r.checkpoint})"
              f"{' (EMA)' if r.ema else ''}, in {r.format}'s format, "
              f"rank {r.rank}, {how}, {r.layers} layers as {r.tensors} tensors; {load}; {r.seconds:.1f} s")
        if args.json:
            print(json.dumps(r.to_json()))
        return 0

    r = export_run(args.run, args.out, ema=args.ema, checkpoint=args.checkpoint,
                   dtype="fp32" if args.dtype == "auto" else args.dtype,
                   max_shard_bytes=args.max_shard_size)
    mib = 2**20
    if r.experts:
        experts = (f" of both experts ({', '.join(e + '/' for e in r.experts)}; model_index.json: the boundary"
                   f"{' and expand_timesteps' if r.expand_timesteps else ''})")
    elif r.expand_timesteps:  # WanPipeline reads it from model_index.json: a time per token, image to video
        experts = " in transformer/ (model_index.json: expand_timesteps, a time per token)"
    else:
        experts = ""
    print(f"wrote {r.out}: {r.family} {'EMA' if r.ema else 'trained'} weights{experts} after {r.steps} steps ({r.checkpoint}), "
          f"{r.tensors} tensors, {r.dtype}, {len(r.shards)} file(s), {r.total_bytes / mib:.1f} MiB; largest file "
          f"{r.largest_shard_bytes / mib:.1f} MiB, at most {r.largest_read_bytes / mib:.1f} MiB of parameters read from the "
          f"checkpoint at once; peak host memory {r.peak_host_bytes / mib:.0f} MiB; {r.seconds:.1f} s")
    if args.json:
        print(json.dumps(r.to_json()))
    return 0
