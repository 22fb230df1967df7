"""Sampling a flow model: rectified-flow Euler steps from noise to data over packed
requests of any sizes (``knapray sample`` is its command: knapray/commands/sample.py).

Every request, each at its own resolution and frame count, is one sequence of ONE varlen
batch (the model's own packed attention), and every Euler step is one forward pass over
all of them:

    x_1 = noise;  x_{t - dt} = x_t - dt * v(x_t, t)      (x_t = (1-t)·x_0 + t·noise)

with classifier-free guidance against unconditional embeddings, or a FLUX.1-dev model's
embedded guidance input; each request's timesteps shifted by its own shift (the family's
``sample_shift``: FLUX.1-dev and Qwen-Image from its image tokens; Wan 5.0), and as the
family's pipeline schedules and guides (Qwen-Image: the schedule stretched to end at 0.02,
the guided prediction rescaled to the conditional one's norm). A run of two experts
(``flow.expert_boundary``, Wan 2.2 A14B) switches between them step by step (``Experts``). A
model with a time per token (``expand_timesteps``, Wan 2.2 TI2V) samples image to video: a
request's first latent frame is a conditioning image's clean latent, at time 0, never stepped. A
model that takes a conditioning image's channels and tokens (Wan 2.1 I2V: ``in_channels`` above
the latent's, ``image_dim``) gets a request's ``condition`` concatenated to its latent (channel
dim) at every step and its ``image_context`` on every pass, as ``WanImageToVideoPipeline``."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

# torch and the model load in the functions that need them.


def flow_timesteps(steps: int, shift: float = 1.0, terminal: float | None = None) -> list[float]:
    """``steps + 1`` times from 1 to 0; ``shift`` > 1 spends more steps at high noise (SD3);
    ``terminal``: the shifted times before the last stretched so that the one before 0 is
    ``terminal`` (diffusers' ``shift_terminal``: 1 - t scaled by (1 - terminal) / (1 - t_last))."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    ts = np.linspace(1.0, 0.0, steps + 1)
    ts = shift * ts / (1 + (shift - 1) * ts)
    if terminal is not None and steps > 1:
        if not 0 < terminal < 1:
            raise ValueError(f"terminal must be in (0, 1), got {terminal}")
        head = 1.0 - ts[:-1]
        ts[:-1] = 1.0 - head / (head[-1] / (1.0 - terminal))
    return ts.tolist()


def family_timesteps(cfg, steps: int, shift: float) -> list[float]:
    """``flow_timesteps`` as ``cfg``'s family's pipeline schedules them (its ``sample_terminal``)."""
    from knapray.models.families import get_family

    return flow_timesteps(steps, shift, get_family(cfg.family).sample_terminal)


def guided(v_c, v_u, scale, renorm: bool):
    """Classifier-free guidance ``v_u + scale (v_c - v_u)`` of per-token predictions (N, P);
    ``renorm``: rescaled token by token to ``v_c``'s norm (``Family.cfg_renorm``)."""
    import torch

    # a tensor of scales (the gang's, per row, on the device) or one number: nothing made on the host
    mixed = torch.addcmul(v_u, scale, v_c - v_u) if isinstance(scale, torch.Tensor) else v_u + scale * (v_c - v_u)
    if renorm:
        mixed = mixed * (v_c.norm(dim=-1, keepdim=True) / mixed.norm(dim=-1, keepdim=True))
    return mixed


def embeds_guidance(model) -> bool:
    """Whether ``model`` takes a guidance input (FLUX.1-dev) instead of classifier-free guidance."""
    return bool(getattr(model.cfg, "guidance_embeds", False))


def request_shifts(model, shapes: list[tuple[int, int, int]], shift: float | None, steps: int | None = None
                   ) -> list[float]:
    """``config_shifts`` of ``model``'s config."""
    return config_shifts(model.cfg, shapes, shift, steps)


def config_shifts(cfg, shapes: list[tuple[int, int, int]], shift: float | None, steps: int | None = None
                  ) -> list[float]:
    """Each request's timestep shift: ``shift`` for all when given; else the family's
    (``Family.sample_shift``: 1 for the MMDiT and FLUX.1-schnell, which samples unshifted as
    BFL's ``get_schedule(..., shift=not is_schnell)``; Wan 5, its pipelines' ``flow_shift``),
    or, where that is None, the per-request shift from its image tokens, as the family's
    pipeline computes it: FLUX.1-dev's and Qwen-Image's ``resolution_shift``, FLUX.2's
    ``step_shift`` of the image tokens and ``steps``."""
    from knapray.models.families import get_family

    if shift is not None:
        return [shift] * len(shapes)
    fam = get_family(cfg.family)
    own = fam.sample_shift(cfg)
    if own is not None:
        return [own] * len(shapes)
    pt, ph, pw = cfg.patch_size
    tokens = [(t // pt) * (h // ph) * (w // pw) for t, h, w in shapes]
    if fam.step_shift is not None:
        if steps is None:
            raise ValueError(f"{fam.title}'s shift depends on the step count: give steps")
        return [fam.step_shift(n, steps) for n in tokens]
    return [fam.resolution_shift.shift(n) for n in tokens]


@dataclass(frozen=True, eq=False)
class Experts:
    """The models a run samples with: one for every step, or two experts split at a timestep
    ``boundary`` (a run of ``flow.expert_boundary``, Wan 2.2 A14B's pair). A step starting at
    time t of the shifted schedule (``flow_timesteps``; 1 is noise) is denoised by
    ``models[0]``, the high-noise expert (diffusers' ``transformer``), when t >= boundary, and
    by ``models[1]`` (``transformer_2``) below: ``WanPipeline``'s rule, whose scheduler's
    timesteps are these shifted times times ``num_train_timesteps`` (1000), compared with
    ``boundary_ratio`` times the same (its float32 timesteps can differ from these float64
    times in the last bit: a time within one float32 ulp of the boundary may go the other way).
    Each request of a packed batch goes by its own time: where they differ, a step runs both
    experts and takes each token's velocity from its request's."""

    models: tuple
    boundary: float | None = None

    def __post_init__(self) -> None:
        if len(self.models) not in (1, 2) or (self.boundary is None) != (len(self.models) == 1):
            raise ValueError(f"one model, or two experts and their boundary: got {len(self.models)} model(s) and "
                             f"boundary {self.boundary!r}")
        if self.boundary is not None and not 0 < self.boundary < 1:
            raise ValueError(f"the experts' boundary must be in (0, 1), got {self.boundary!r}")

    @property
    def cfg(self):
        """The architecture every expert shares."""
        return self.models[0].cfg

    def expert_at(self, times) -> np.ndarray:
        """The expert (an index into ``models``) of each of ``times`` (any shape): 0 with one model."""
        t = np.asarray(times, dtype=np.float64)
        if self.boundary is None:
            return np.zeros(t.shape, np.int64)
        return np.where(t >= self.boundary, 0, 1)


def experts_of(model) -> Experts:
    """``model`` as ``Experts``: a run's experts as they are, one model alone."""
    return model if isinstance(model, Experts) else Experts((model,))


@dataclass(frozen=True, eq=False)
class DenoiseJob:
    """One request as the ranks of a parallel sampler run it (numpy, picklable): its
    noise, conditioning, timesteps and guidance, resolved on one process for all."""

    noise: np.ndarray
    """(C, T, H, W) latent noise, x_1."""
    text: np.ndarray
    """(Lt, text_dim) text embeddings."""
    pooled: np.ndarray
    """(pooled_dim,)."""
    times: tuple[float, ...]
    """``steps + 1`` times from 1 to 0 (``flow_timesteps`` with the job's shift)."""
    image_tokens: int
    cfg_scale: float = 1.0
    """Classifier-free guidance scale (1: one pass a step)."""
    unconditional: tuple[np.ndarray, np.ndarray] | None = None
    """(text, pooled) of the unconditional pass when ``cfg_scale != 1``."""
    guidance_input: float | None = None
    """The embedded guidance input of a model that takes one (FLUX.1-dev)."""
    adapter: str | None = None
    """The LoRA adapter it runs with, of those a served model holds (None: the model's own)."""
    cfg_renorm: bool = False
    """Its guided prediction rescaled to the conditional one's norm per token (``guided``)."""
    first_frame: np.ndarray | None = None
    """(C, 1, H, W): the clean latent of the first latent frame (a conditioning image's, for a
    model with a time per token: ``expand_timesteps``), kept as it is at every step and given
    time 0, as ``WanImageToVideoPipeline`` keeps its condition; None: every frame denoised."""
    condition: np.ndarray | None = None
    """(C_cond, T, H, W): channels concatenated after the latent's at every step, on every pass (a
    model that takes more channels than it predicts, Wan 2.1 I2V: a conditioning image's mask and
    first-frame latent, ``WanImageToVideoPipeline``'s ``condition``); None: the latent alone."""
    image_context: np.ndarray | None = None
    """(L, image_dim): the conditioning image's encoder tokens, on every pass (``model.image_dim``)."""

    @property
    def steps(self) -> int:
        return len(self.times) - 1

    @property
    def passes(self) -> int:
        return 1 if self.cfg_scale == 1.0 else 2

    @property
    def tokens(self) -> int:
        """Sequence length of the (conditional) pass."""
        return int(self.text.shape[0]) + self.image_tokens


def denoise_job(cfg, noise: np.ndarray, cond: tuple[np.ndarray, np.ndarray], *, steps: int, guidance: float,
                shift: float | None, unconditional: tuple[np.ndarray, np.ndarray] | None,
                first_frame: np.ndarray | None = None, condition: np.ndarray | None = None,
                image_context: np.ndarray | None = None) -> DenoiseJob:
    """The ``DenoiseJob`` of one request, resolved as ``sample_latents`` resolves it: the
    family's shift (None) or ``shift``, classifier-free guidance at ``guidance`` against
    ``unconditional`` (default: no text tokens, zero pooled) unless the model embeds
    guidance, then ``guidance`` is its input. ``first_frame``: the clean first latent frame
    (``check_first_frame``). ``condition``, ``image_context``: a conditioning image's channels
    and tokens (``check_condition``)."""
    from knapray.models.families import get_family

    embedded = bool(getattr(cfg, "guidance_embeds", False))
    c, t, h, w = noise.shape
    if first_frame is not None:
        check_first_frame(cfg, noise.shape, first_frame)
        first_frame = np.ascontiguousarray(first_frame, dtype=np.float32)
    check_condition(cfg, noise.shape, condition, image_context)
    pt, ph, pw = cfg.patch_size
    (s,) = config_shifts(cfg, [(t, h, w)], shift, steps)
    scale = 1.0 if embedded else float(guidance)
    uncond = None
    if scale != 1.0:
        uncond = unconditional if unconditional is not None else (
            np.zeros((0, cfg.text_dim), np.float32), np.zeros(cfg.pooled_dim, np.float32))
    text, pooled = cond
    return DenoiseJob(noise=np.asarray(noise, np.float32), text=np.asarray(text, np.float32),
                      pooled=np.asarray(pooled, np.float32), times=tuple(family_timesteps(cfg, steps, s)),
                      image_tokens=(t // pt) * (h // ph) * (w // pw), cfg_scale=scale, unconditional=uncond,
                      guidance_input=float(guidance) if embedded else None,
                      cfg_renorm=get_family(cfg.family).cfg_renorm and scale != 1.0, first_frame=first_frame,
                      condition=None if condition is None else np.ascontiguousarray(condition, dtype=np.float32),
                      image_context=None if image_context is None else np.ascontiguousarray(image_context,
                                                                                           dtype=np.float32))


def check_first_frame(cfg, shape: tuple[int, ...], first_frame: np.ndarray) -> None:
    """ValueError unless ``first_frame`` can be the clean first latent frame of a latent of
    ``shape`` (C, T, H, W): a model with a time per token (``expand_timesteps``; its temporal
    patch is 1, so the first latent frame is the first frame of tokens), (C, 1, H, W), T >= 2."""
    if not getattr(cfg, "expand_timesteps", False):
        raise ValueError("a clean first frame needs a model with a time per token (model.expand_timesteps)")
    c, t, h, w = shape
    if tuple(first_frame.shape) != (c, 1, h, w) or t < 2:
        raise ValueError(f"a first frame must be (C, 1, H, W) = {(c, 1, h, w)} of a latent of 2 frames or more; got "
                         f"{tuple(first_frame.shape)} for a latent of {t} frame(s)")


def latent_channels(cfg) -> int:
    """Channels of the latent a model predicts and sampling denoises (Wan 2.1 I2V: 16 of its 36
    input channels; every other model: all of them)."""
    return cfg.out_patch_dim // math.prod(cfg.patch_size)


def check_condition(cfg, shape: tuple[int, ...], condition: np.ndarray | None,
                    image_context: np.ndarray | None) -> None:
    """ValueError unless ``condition`` and ``image_context`` complete the input of a latent of
    ``shape`` (C, T, H, W) as the model takes it: the channels it takes beyond the latent's,
    (in_channels - C, T, H, W), and its image tokens, (image_tokens, image_dim); None where it
    takes none (Wan 2.1 I2V takes both: a request needs its conditioning image)."""
    extra = cfg.in_channels - latent_channels(cfg)
    image_dim = int(getattr(cfg, "image_dim", 0) or 0)
    if (condition is None) != (extra == 0) or (image_context is None) != (image_dim == 0):
        raise ValueError(f"the model takes {extra} conditioning channels and image tokens of width {image_dim} "
                         f"(a conditioning image's); got {'no' if condition is None else 'a'} condition and "
                         f"{'no' if image_context is None else 'an'} image_context")
    c, t, h, w = shape
    if condition is not None and tuple(condition.shape) != (extra, t, h, w):
        raise ValueError(f"a condition must be (C_cond, T, H, W) = {(extra, t, h, w)}; got {tuple(condition.shape)}")
    if image_context is not None and tuple(image_context.shape) != (cfg.image_tokens, image_dim):
        raise ValueError(f"an image_context must be (image_tokens, image_dim) = {(cfg.image_tokens, image_dim)}; "
                         f"got {tuple(image_context.shape)}")


def job_noise(cfg, shapes: list[tuple[int, int, int]], seeds: list[int] | int) -> list[np.ndarray]:
    """Noise of every request: one seed for all draws them in order from one generator (as
    ``sample_latents`` does for a batch); one seed per request draws each alone (what
    ``sample_latents`` gives that request sampled by itself)."""
    import torch

    if isinstance(seeds, int):
        gen = torch.Generator().manual_seed(seeds)
        return [torch.randn(latent_channels(cfg), *shape, generator=gen).numpy() for shape in shapes]
    return [torch.randn(latent_channels(cfg), *shape, generator=torch.Generator().manual_seed(int(seed))).numpy()
            for shape, seed in zip(shapes, seeds, strict=True)]


def sample_latents(model, conds: list[tuple[np.ndarray, np.ndarray]], shapes: list[tuple[int, int, int]],
                   *, steps: int, seed: int, guidance: float = 1.0, shift: float | None = 1.0,
                   unconditional: tuple[np.ndarray, np.ndarray] | None = None,
                   first_frames: list[np.ndarray | None] | None = None,
                   conditions: list[tuple[np.ndarray, np.ndarray] | None] | None = None) -> list[np.ndarray]:
    """Euler-integrate the learned velocity of ``model`` (any family's, or a run's ``Experts``)
    from noise to data for every request at once.

    ``conds``: (text (L, text_dim), pooled (pooled_dim,)) per request; ``shapes``: latent
    (T, H, W) per request; ``shift``: None for the family's own (``request_shifts``);
    ``guidance``: the guidance input of a model that embeds it, else the classifier-free
    guidance scale against ``unconditional`` (default: 0 text tokens, zero pooled).
    ``first_frames``: per request, None or the clean first latent frame (C, 1, H, W) that
    replaces its noise's and stays at time 0 every step (a model with ``expand_timesteps``:
    image to video); the noise is drawn for every frame all the same. ``conditions``: per
    request, None or (condition (C_cond, T, H, W), image_context (L, image_dim)) of a model that
    takes a conditioning image's channels and tokens (``check_condition``: Wan 2.1 I2V). Returns
    latents (C, T, H, W), C the predicted channels (``latent_channels``)."""
    import torch

    with torch.no_grad():
        return _integrate(model, conds, shapes, steps=steps, seed=seed, guidance=guidance, shift=shift,
                          unconditional=unconditional, first_frames=first_frames or [None] * len(conds),
                          conditions=conditions or [None] * len(conds))


def _integrate(model, conds, shapes, *, steps: int, seed: int, guidance: float, shift: float | None,
               unconditional, first_frames, conditions) -> list[np.ndarray]:
    import torch

    from knapray.models import pack_samples
    from knapray.models.families import get_family

    experts = experts_of(model)
    cfg = experts.cfg
    device = next(experts.models[0].parameters()).device
    gen = torch.Generator().manual_seed(seed)
    embedded = embeds_guidance(model)
    per_token = bool(getattr(cfg, "expand_timesteps", False))
    items = []
    for (text, pooled), (t, h, w), first, given in zip(conds, shapes, first_frames, conditions, strict=True):
        latent = torch.randn(latent_channels(cfg), t, h, w, generator=gen)
        if first is not None:
            check_first_frame(cfg, tuple(latent.shape), first)
            latent[:, :1] = torch.as_tensor(first, dtype=torch.float32)
        condition, image_context = given if given is not None else (None, None)
        check_condition(cfg, tuple(latent.shape), condition, image_context)
        if condition is not None:  # patchified, the condition's features follow the latent's (channels outermost)
            latent = torch.cat((latent, torch.as_tensor(condition, dtype=torch.float32)))
        items.append({"latent": latent, "text": torch.as_tensor(text, dtype=torch.float32),
                      **({} if image_context is None else
                         {"image_context": torch.as_tensor(image_context, dtype=torch.float32)}),
                      "pooled": torch.as_tensor(pooled, dtype=torch.float32), "timestep": 1.0,
                      **({"guidance": guidance} if embedded else {}),
                      **({"first_frame_timestep": 1.0} if per_token else {})})
    shifts = request_shifts(model, list(shapes), shift, steps)
    cfg_scale = 1.0 if embedded else guidance
    conditioned = [first is not None for first in first_frames]
    if cfg_scale != 1.0:  # the same requests, unconditioned, for classifier-free guidance
        text_u, pooled_u = unconditional if unconditional is not None else (
            np.zeros((0, cfg.text_dim), np.float32), np.zeros(cfg.pooled_dim, np.float32))
        items += [dict(it, text=torch.as_tensor(text_u), pooled=torch.as_tensor(pooled_u)) for it in items]
        shifts += shifts
        conditioned += conditioned
    batch = pack_samples(items, cfg).to(device)
    n = len(conds)
    image_rows = batch.image_seq_index  # (Ni,) request of each image token
    width = cfg.out_patch_dim  # the denoised features; a condition's follow, never stepped
    x, held_input = batch.x_img[:, :width].clone(), batch.x_img[:, width:]
    table = np.array([family_timesteps(cfg, steps, s) for s in shifts], dtype=np.float64)  # (S, steps+1)
    times = torch.tensor(table, dtype=torch.float64, device=device)
    # A conditioned request's first frame: time 0 and no step (its tokens are frame 0's: pos[:, 0] == 0)
    first_times = times * torch.tensor([not c for c in conditioned], dtype=torch.float64, device=device)[:, None]
    held = torch.tensor(conditioned, dtype=torch.bool, device=device)[image_rows] & (
        batch.pos[~batch.is_text][:, 0] == 0)  # (Ni,)
    which = experts.expert_at(table[:, :-1])  # (S, steps): each request's expert at each step
    renorm = get_family(cfg.family).cfg_renorm
    for i in range(steps):
        x_in = torch.cat((x, held_input), dim=1) if held_input.shape[1] else x
        step = replace(batch, x_img=x_in, timesteps=times[:, i].float(),
                       **({"first_frame_timesteps": first_times[:, i].float()} if per_token else {}))
        used = np.unique(which[:, i])
        if used.size == 1:
            v = experts.models[int(used[0])](step)  # (Ni, patch_dim)
        else:  # requests on both sides of the boundary: each token its request's expert
            high = torch.as_tensor(which[:, i] == 0, device=device)[image_rows, None]
            v = torch.where(high, experts.models[0](step), experts.models[1](step))
        if cfg_scale != 1.0:
            cond = image_rows < n
            v_g = guided(v[cond], v[~cond], cfg_scale, renorm)
            v = torch.cat((v_g, v_g))  # both halves move together
        dt = (times[:, i] - times[:, i + 1])[image_rows, None].to(x.dtype)  # (Ni, 1): each token its request's step
        x = x - dt.masked_fill(held[:, None], 0.0) * v
    return _unpack(x[image_rows < n].cpu(), batch, n, cfg)


def _unpack(x, batch, n: int, cfg) -> list[np.ndarray]:
    """The first ``n`` requests' image tokens (Ni, P) -> latents (C, T, H, W)."""
    from knapray.models.packing import unpatchify

    out, start = [], 0
    for grid in batch.grids[:n]:
        count = grid[0] * grid[1] * grid[2]
        out.append(unpatchify(x[start : start + count], grid, cfg.patch_size, latent_channels(cfg)).numpy())
        start += count
    return out
