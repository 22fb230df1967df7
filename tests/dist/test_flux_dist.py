"""The flux family on 4 gloo ranks, in one spawn of 4 processes (they cost most of the
time): first tiny Flux checkpoints (3 configs) loaded FSDP-sharded (every rank reads only
its rows; the loaded weights are the file's) and exact against diffusers when balanced
(``knapray reference``'s check); then the whole fine-tuning path: a tiny Flux saved by
diffusers, fine-tuned 5 steps balanced (FSDP full), exported, loaded back by diffusers, and
run by a FluxPipeline with tiny VAE, CLIP and T5."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch


from needs import needs  # noqa: E402
import tiny_encoders as te  # noqa: E402
from dist_utils import run_distributed  # noqa: E402
from flux_utils import save_all, save_tiny_flux  # noqa: E402

pytestmark = [pytest.mark.dist, needs("diffusers", "transformers")]


REFERENCE_ARGS = dict(family=None, topology="g1n2+g2n1", seed=1, sequences=4)


def _convert(x, to):
    """Tensors <-> numpy arrays through nested dicts: a tensor returned through the result
    queue would be shared memory of a process that has exited."""
    if isinstance(x, dict):
        return {k: _convert(v, to) for k, v in x.items()}
    if to == "numpy" and isinstance(x, torch.Tensor):
        return x.numpy()
    if to == "torch" and isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    return x


def _reference_then_finetune(rank: int, world: int, tiny: list[str], corpus: str, run_root: str,
                             pretrained: str) -> tuple[dict, list[float]]:
    from dist_utils import local_trainer

    from knapray.testing.reference import balanced_results
    from knapray.config.parallel import ParallelConfig
    from knapray.driver.run_dir import write_config

    a = REFERENCE_ARGS
    reference = balanced_results(rank, world, tiny, a["family"], a["topology"], a["seed"], a["sequences"],
                                 ParallelConfig(fsdp="full"))

    trainer = local_trainer(rank, world, corpus, run_root, "flux", [
        f"model.pretrained={pretrained}", "parallel.fsdp=full", "run.max_steps=5", "balance.topology=g1n2+g2n1",
        "optim.lr=0.003", "flow.resolution_shift=true", "flow.guidance=3.5", "data.caption_dropout=0.25",
        "data.epochs=5",
    ])
    if rank == 0:
        write_config(trainer.cfg)  # what a launcher's pre-flight writes: export reads it
    summary = trainer.train()
    return _convert(reference, "numpy"), [r["loss"] for r in summary["records"]]


def test_exact_then_finetuned_exported_and_generated(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    from knapray.cli import main
    from knapray.corpus.hf import HFTextEncoder
    from knapray.corpus.synthetic import SyntheticConfig, build_synthetic
    from knapray.corpus.unconditional import KEY, unconditional_record
    from knapray.testing.reference import passed, summarize_balanced
    from knapray.weights.source import open_pretrained

    # Tiny components a FluxPipeline can run: VAE (4 latent channels), CLIP (12), T5 (16).
    models = tmp_path / "models"
    vae, clip, t5 = te.save_vae(models / "vae"), te.save_clip(models / "clip", projection=False), te.save_t5(models / "t5")
    pretrained = save_tiny_flux(models / "transformer", 2, 16, (4, 6, 6), 1, 1, True, text_dim=16, pooled_dim=12)
    corpus = tmp_path / "corpus"
    build_synthetic(SyntheticConfig(mix="g2b2i256f1s0,g2b1i512f1s0", steps=6, scale=4, channels=4, text_dim=16,
                                    pooled_dim=12, shards=2, seed=3), corpus, progress=False)
    schema = json.loads((corpus / "schema.json").read_text())  # the empty caption's embeddings, as ingest records
    schema[KEY] = unconditional_record(HFTextEncoder(str(t5), pooled=str(clip)), 64)
    (corpus / "schema.json").write_text(json.dumps(schema))

    tiny = save_all(tmp_path / "tiny")
    paths = [str(p) for p in tiny.values()]
    results = run_distributed(_reference_then_finetune, 4, paths, str(corpus), str(tmp_path / "runs"),
                              str(pretrained), timeout_s=300)

    # 1. Balanced, FSDP-sharded, loaded from the checkpoints: exact against diffusers.
    report = summarize_balanced(paths, [_convert(r[0], "torch") for r in results], family=None, seed=REFERENCE_ARGS["seed"],
                                sequences=REFERENCE_ARGS["sequences"])
    assert passed(report, 1e-5), report
    for name, path in tiny.items():
        r = report[str(path)]
        assert r["weights_diff"] == 0.0  # each rank's loaded rows are the file's
        # FSDP full: each rank read its quarter of every tensor's rows, together the file once
        assert sum(r["bytes_read_per_rank"]) == r["checkpoint_bytes"]
        assert max(r["bytes_read_per_rank"]) < r["checkpoint_bytes"] / 2
        assert r["imbalance"] < r["baseline_imbalance"]  # the plan moved work: routing was exercised
        assert r["num_grads"] == len(open_pretrained(str(path)).tensors), name  # every tensor's gradient compared

    # 2. Fine-tuned 5 steps: the loss falls, the same on every rank.
    losses = [r[1] for r in results]
    assert all(r == losses[0] for r in losses) and len(losses[0]) == 5  # every rank saw the same summed losses
    assert losses[0][-1] < losses[0][0], losses[0]

    # 3. Exported, sampled by knapray, loaded back by diffusers, run in a FluxPipeline.
    run, out = tmp_path / "runs" / "flux", tmp_path / "exported"
    assert main(["export", "--run", str(run), "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["guidance_embeds"] is True
    # knapray sample on the flux run: one pass per step with the embedded guidance, each
    # request shifted by its own size (the synthetic corpus has no VAE: a latent preview)
    assert main(["sample", "--run", str(run), "--like", "1", "--like", "2", "--size", "32x32", "--size", "64x32",
                 "--steps", "2", "--out", str(tmp_path / "grid.png"), "--json"]) == 0
    sampled = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sampled["family"] == "flux" and sampled["guidance"] == 3.5 and sampled["requests"] == 2
    assert sampled["shifts"][0] < sampled["shifts"][1]  # 4 vs 8 image tokens

    initial = FluxTransformer2DModel.from_pretrained(pretrained).state_dict()
    tuned = FluxTransformer2DModel.from_pretrained(out)
    changed = [k for k, v in tuned.state_dict().items() if not torch.equal(v, initial[k])]
    assert len(changed) == len(initial), sorted(set(initial) - set(changed))[:5]  # every tensor was trained

    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                  base_image_seq_len=256, max_image_seq_len=4096),
        vae=AutoencoderKL.from_pretrained(vae), text_encoder=CLIPTextModel.from_pretrained(clip),
        tokenizer=AutoTokenizer.from_pretrained(clip), text_encoder_2=T5EncoderModel.from_pretrained(t5),
        tokenizer_2=AutoTokenizer.from_pretrained(t5), transformer=tuned,
    )
    image = pipe("a red fox", height=16, width=16, num_inference_steps=2, guidance_scale=3.5, max_sequence_length=16,
                 output_type="np", generator=torch.Generator().manual_seed(0)).images[0]
    assert image.shape == (16, 16, 3) and np.isfinite(image).all() and image.std() > 0
