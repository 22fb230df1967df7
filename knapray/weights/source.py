"""A pretrained transformer on disk, read from its config.json and safetensors headers only.

Accepted (``model.pretrained``, ``knapray reference --pretrained``):

- a diffusers model directory: ``config.json`` + ``diffusion_pytorch_model.safetensors``,
  or shards listed by ``diffusion_pytorch_model.safetensors.index.json``;
- a diffusers pipeline directory (``model_index.json``): its ``transformer/`` folder (and, for
  the second of two experts, its ``transformer_2/``: ``expert_path``);
- BFL's single file (``flux1-dev.safetensors``), given as the file or as a directory that
  holds one ``.safetensors`` file; its architecture is read from the tensors' shapes (or
  from a diffusers-style ``config.json`` beside it, which wins).

Nothing here reads tensor data: a safetensors header is 8 bytes of length and a JSON
table of names, dtypes, shapes and byte ranges, so every file is checked (names, shapes,
data within the file) before any worker starts. Errors are ValueErrors of one line that
name the file or the first bad tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
from collections.abc import Mapping
from typing import Any

from knapray.models.config import PIPELINE_EXPAND_TIMESTEPS

DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
DIFFUSERS_INDEX = DIFFUSERS_WEIGHTS + ".index.json"
COMFY_PREFIX = "model.diffusion_model."
"""A prefix some single-file checkpoints put before BFL's names."""
MAX_HEADER_BYTES = 100 * 2**20
FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
"""safetensors dtypes a parameter can be loaded from (bytes per element)."""
ALL_DTYPES = {**FLOAT_DTYPES, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
              "F8_E4M3": 1, "F8_E5M2": 1}


@dataclasses.dataclass(frozen=True, slots=True)
class TensorEntry:
    file: str
    """Path of the safetensors file that holds it."""
    name: str
    """Its name in that file (with any single-file prefix)."""
    dtype: str
    """safetensors dtype code (BF16, F32, ...)."""
    shape: tuple[int, ...]
    offset: int
    """Byte offset of its data in the file."""


def read_header(path: str) -> dict[str, TensorEntry]:
    """Tensor name -> entry, from the safetensors header of ``path`` (no data is read);
    ValueError if it is not a complete safetensors file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"header length {n} does not fit the file ({size} bytes)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (its header is not a table)")
    out: dict[str, TensorEntry] = {}
    data_start = 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {name!r} has a malformed header entry") from None
        if dtype not in ALL_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {dtype!r}, unknown to safetensors")
        count = 1
        for s in shape:
            count *= s
        if end - begin != count * ALL_DTYPES[dtype] or begin < 0 or data_start + end > size:
            raise ValueError(f"{path}: tensor {name!r} ({dtype} {list(shape)}) lies outside the file's data "
                             f"(bytes {begin}..{end} of {size - data_start}): a truncated or corrupt file")
        out[name] = TensorEntry(path, name, dtype, shape, data_start + begin)
    return out


@dataclasses.dataclass(frozen=True)
class PretrainedSource:
    """What a pretrained checkpoint holds, from its config and headers."""

    path: str
    """The directory (or single file) as found (a pipeline's transformer/ resolved)."""
    layout: str
    """``diffusers`` or ``bfl``: the naming its tensors follow."""
    config: dict[str, Any]
    """Its diffusers-style config: config.json, or for a BFL file inferred from shapes."""
    tensors: Mapping[str, TensorEntry]
    """Tensor name (without any single-file prefix) -> where it is."""

    @property
    def class_name(self) -> str | None:
        return self.config.get("_class_name")

    @property
    def files(self) -> list[str]:
        return list(dict.fromkeys(t.file for t in self.tensors.values()))

    @property
    def total_bytes(self) -> int:
        return sum(_nbytes(t) for t in self.tensors.values())


def _nbytes(t: TensorEntry) -> int:
    count = 1
    for s in t.shape:
        count *= s
    return count * ALL_DTYPES[t.dtype]


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read {what} ({e.strerror})") from None
    except ValueError as e:
        raise ValueError(f"{path}: {what} is not valid JSON ({e})") from None


def _diffusers_tensors(directory: str) -> dict[str, TensorEntry]:
    index_path = os.path.join(directory, DIFFUSERS_INDEX)
    single = os.path.join(directory, DIFFUSERS_WEIGHTS)
    if os.path.exists(index_path):
        index = _read_json(index_path, "the shard index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path}: no weight_map of tensor names to shard files")
        tensors: dict[str, TensorEntry] = {}
        for file in dict.fromkeys(weight_map.values()):
            if not isinstance(file, str) or os.path.basename(file) != file:
                raise ValueError(f"{index_path}: shard {file!r} is not a file name in {directory}")
            header = read_header(os.path.join(directory, file))
            for name, entry in header.items():
                if weight_map.get(name) != file:
                    raise ValueError(f"{os.path.join(directory, file)}: tensor {name!r} is not listed for this file "
                                     f"in {DIFFUSERS_INDEX}")
                tensors[name] = entry
        missing = [k for k in weight_map if k not in tensors]
        if missing:
            raise ValueError(f"{index_path}: tensor {missing[0]!r} is listed in {weight_map[missing[0]]} but that "
                             "file does not hold it")
        return tensors
    if os.path.exists(single):
        return read_header(single)
    raise ValueError(f"{directory}: has config.json but neither {DIFFUSERS_WEIGHTS} nor {DIFFUSERS_INDEX} "
                     "(only safetensors weights are read: .bin files would run pickle)")


def _strip_prefix(tensors: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    if tensors and all(k.startswith(COMFY_PREFIX) for k in tensors):
        return {k[len(COMFY_PREFIX):]: v for k, v in tensors.items()}
    return tensors


FLUX2_MARK = "single_stream_modulation.lin.weight"
"""A tensor only FLUX.2's BFL files hold (its shared modulation): FLUX.1's have none."""


def bfl_config(tensors: Mapping[str, TensorEntry], where: str) -> dict[str, Any]:
    """The diffusers-style config of a BFL FLUX.1 or FLUX.2 file (FLUX.2's holds the shared
    modulation ``FLUX2_MARK``), from its tensors' shapes. RoPE axes are not in the file:
    FLUX.1's (16, 56, 56) and FLUX.2's (32, 32, 32, 32) for their head size 128, else an
    error asking for a config.json."""
    flux2 = FLUX2_MARK in tensors
    name_ = "FLUX.2" if flux2 else "Flux.1"

    def shape(name: str) -> tuple[int, ...]:
        if name not in tensors:
            raise ValueError(f"{where}: no tensor {name!r}: not a BFL {name_} checkpoint")
        return tensors[name].shape

    hidden, features = shape("img_in.weight")
    q_norm = "double_blocks.0.img_attn.norm.query_norm.scale"  # (head_dim,): the head size
    head_dim = shape(q_norm if q_norm in tensors else "single_blocks.0.norm.query_norm.scale")[0]
    axes = [32, 32, 32, 32] if flux2 else [16, 56, 56]
    if head_dim != 128:
        raise ValueError(f"{where}: head size {head_dim}: a BFL file does not record its RoPE axes ({name_} uses "
                         f"{', '.join(map(str, axes))} for 128); put a diffusers config.json with axes_dims_rope "
                         "beside the file")

    def count(pattern: str) -> int:
        found = {int(m.group(1)) for k in tensors for m in [re.match(pattern, k)] if m}
        return max(found) + 1 if found else 0

    if flux2:  # the MLP's width from the single blocks' linear1: q, k, v, then 2 x the MLP's
        mlp = (shape("single_blocks.0.linear1.weight")[0] - 3 * hidden) // 2 if count(r"single_blocks\.(\d+)\.") \
            else shape("double_blocks.0.img_mlp.2.weight")[1]
        return {
            "_class_name": "Flux2Transformer2DModel", "patch_size": 1, "in_channels": features,
            "num_layers": count(r"double_blocks\.(\d+)\."), "num_single_layers": count(r"single_blocks\.(\d+)\."),
            "attention_head_dim": head_dim, "num_attention_heads": hidden // head_dim,
            "joint_attention_dim": shape("txt_in.weight")[1], "mlp_ratio": mlp / hidden,
            "guidance_embeds": "guidance_in.in_layer.weight" in tensors, "axes_dims_rope": axes, "rope_theta": 2000,
        }
    return {
        "_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": features,
        "num_layers": count(r"double_blocks\.(\d+)\."), "num_single_layers": count(r"single_blocks\.(\d+)\."),
        "attention_head_dim": head_dim, "num_attention_heads": hidden // head_dim,
        "joint_attention_dim": shape("txt_in.weight")[1], "pooled_projection_dim": shape("vector_in.in_layer.weight")[1],
        "guidance_embeds": "guidance_in.in_layer.weight" in tensors, "axes_dims_rope": [16, 56, 56],
    }


def expert_path(path: str, expert: int) -> str:
    """Where expert ``expert`` of a run of two (``flow.expert_boundary``) starts from, given
    ``model.pretrained``: a pipeline folder's ``transformer/`` (0) or ``transformer_2/`` (1),
    as Wan 2.2 A14B's holds them; any other checkpoint (a pipeline without a second
    transformer, a model folder, a file) starts both."""
    if not path or expert == 0:
        return path
    full = os.path.abspath(os.path.expanduser(path))
    second = os.path.join(full, "transformer_2")
    if os.path.isdir(full) and os.path.exists(os.path.join(full, "model_index.json")) and os.path.isdir(second):
        return second
    return path


def boundary_ratio(path: str) -> float | None:
    """The timestep where a pipeline folder's two experts switch: its model_index.json's
    ``boundary_ratio`` (Wan 2.2 A14B's: 0.875 for T2V, 0.9 for I2V); None where it has no
    number in (0, 1) there."""
    index = os.path.join(os.path.abspath(os.path.expanduser(path)), "model_index.json")
    if not os.path.isfile(index):
        return None
    doc = _read_json(index, "the pipeline's index")
    value = doc.get("boundary_ratio") if isinstance(doc, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        return None
    return float(value)


def _pipeline_facts(path: str) -> dict[str, Any]:
    """What a pipeline folder's model_index.json says about how its transformer is called:
    ``expand_timesteps`` when it is there (under ``PIPELINE_EXPAND_TIMESTEPS``)."""
    doc = _read_json(os.path.join(path, "model_index.json"), "the pipeline's index")
    value = doc.get("expand_timesteps") if isinstance(doc, dict) else None
    return {PIPELINE_EXPAND_TIMESTEPS: value} if isinstance(value, bool) else {}


def open_pretrained(path: str) -> PretrainedSource:
    """Read a pretrained checkpoint's config and headers (see the module docstring)."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file or directory")
    pipeline: dict[str, Any] = {}
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "model_index.json")):
        sub = os.path.join(path, "transformer")
        if not os.path.isdir(sub):
            raise ValueError(f"{path}: a diffusers pipeline without a transformer/ folder")
        pipeline = _pipeline_facts(path)
        path = sub
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise ValueError(f"{path}: not a .safetensors file (only safetensors weights are read)")
        directory, files = os.path.dirname(path), [path]
    else:
        directory = path
        config_path = os.path.join(directory, "config.json")
        if os.path.exists(config_path) and (os.path.exists(os.path.join(directory, DIFFUSERS_WEIGHTS))
                                            or os.path.exists(os.path.join(directory, DIFFUSERS_INDEX))):
            config = _read_json(config_path, "the model config")
            if not isinstance(config, dict):
                raise ValueError(f"{config_path}: not a JSON object")
            return PretrainedSource(path, "diffusers", {**config, **pipeline}, _diffusers_tensors(directory))
        files = sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".safetensors"))
        if len(files) != 1:
            what = "no .safetensors file" if not files else f"{len(files)} .safetensors files and no shard index"
            raise ValueError(f"{directory}: {what}; expected a diffusers model (config.json + "
                             f"{DIFFUSERS_WEIGHTS} or its index) or one BFL single file")
    tensors = _strip_prefix(read_header(files[0]))
    if any(k.startswith(("transformer_blocks.", "x_embedder.")) for k in tensors):
        raise ValueError(f"{files[0]}: diffusers tensor names without a config.json beside it; save the model with "
                         "save_pretrained (config.json + diffusion_pytorch_model.safetensors)")
    beside = os.path.join(directory, "config.json")
    if os.path.exists(beside):
        config = _read_json(beside, "the model config")
        if not isinstance(config, dict):
            raise ValueError(f"{beside}: not a JSON object")
    else:
        config = bfl_config(tensors, files[0])
    return PretrainedSource(files[0], "bfl", config, tensors)
